"""Embedding framekv's scheduler in your own app: sessions on one batched pool.

    python examples/streaming.py [--device cpu|cuda]

Three clients stream at once; one GPU loop steps them together as one batch.
"""
import argparse
import threading

from framekv.engine.scheduler import StreamScheduler

p = argparse.ArgumentParser()
p.add_argument("--device", default=None)
p.add_argument("--preset", default="tiny")
args = p.parse_args()

sched = StreamScheduler(args.preset, max_sessions=4, device=args.device)  # captures here
stop = threading.Event()
loop = threading.Thread(target=sched.run, args=(stop,))
loop.start()

sessions = [sched.open_session(seed=seed, chunks=3) for seed in (1, 2, 3)]
for s in sessions:
    while (chunk := sched.next_chunk(s.id, timeout=60)) is not None:
        print(f"session {s.seed}: chunk {chunk.index}, frames {chunk.frame0}.."
              f"{chunk.frame0 + chunk.latents.shape[0] - 1}, batch of {chunk.batch}")
    print(f"session {s.seed}: {s.state}")
    sched.close_session(s.id)

stop.set()
loop.join()
sched.close()
