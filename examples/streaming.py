"""Embedding framekv's scheduler in your own app: sessions on one batched pool.

    python examples/streaming.py [--device cpu|cuda] [--model reference|wan-diffusers]

Three clients stream at once; one GPU loop steps them together as one batch. Every model
family (`framekv.engine.models`) hands out chunks in one layout: latents [C, F, H, W].
"""
import argparse
import threading

from framekv.engine.models import ModelOptions, get_model, models
from framekv.engine.serving import StreamScheduler

p = argparse.ArgumentParser(allow_abbrev=False)
p.add_argument("--device", default=None)
p.add_argument("--model", choices=models(), default="reference")
args = p.parse_args()
# the family's model at its defaults (diffusers' Wan: the tiny config, random weights)
model = get_model(args.model).load(ModelOptions(), device=args.device, text_encoder=False,
                                  decode=False)
sched = StreamScheduler(max_sessions=4, device=args.device, **model.scheduler_args())
stop = threading.Event()
loop = threading.Thread(target=sched.run, args=(stop,))
loop.start()                                                 # the GPU loop
try:
    sessions = [sched.open_session(seed=seed, chunks=3) for seed in (1, 2, 3)]
    for s in sessions:
        while (chunk := sched.next_chunk(s.id, timeout=60)) is not None:
            sched.ack(s.id, chunk.index)                 # ours now: the stream may go on
            C, F, H, W = chunk.latents.shape
            print(f"session {s.seed}: chunk {chunk.index}, frames {chunk.frame0}.."
                  f"{chunk.frame0 + F - 1} of {C}x{H}x{W}, batch of {chunk.batch}")
        print(f"session {s.seed}: {s.state}")
        sched.close_session(s.id)
finally:                     # however it ends (an error, Ctrl-C): the loop stops, the pool goes
    stop.set()
    loop.join()
    sched.close()
