"""Streaming from `framekv serve` with its Python client: three sessions, a prompt change.

    framekv serve --preset tiny &                      # any framekv server
    python examples/client.py --url http://127.0.0.1:8000

Without --url a server starts in this process (the tiny reference model, streaming
latents) on a free port. The token, if the server has one, comes from FRAMEKV_TOKEN.
"""
import argparse
import threading
import time

from framekv.client import Client

p = argparse.ArgumentParser()
p.add_argument("--url", default=None)
p.add_argument("--device", default=None)
args = p.parse_args()
if args.url is None:                           # the app `framekv serve` runs, in a thread
    from framekv.engine.serving import StreamScheduler
    from framekv.tools.serve import build_app
    from framekv.tools.serve.net import DrainingServer, server_config

    sched = StreamScheduler("tiny", max_sessions=4, device=args.device, queue_chunks=2)
    server = DrainingServer(server_config(build_app(sched), port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    args.url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

with Client(args.url) as client:
    sessions = {seed: client.create(seed=seed, chunks=6) for seed in (1, 2, 3)}
    for seed, s in sessions.items():
        for chunk in s.stream():
            got = chunk.latents if chunk.latents is not None else chunk.video()  # or frames
            print(f"session {seed}: chunk {chunk.index} of {list(got.shape)}, "
                  f"prompt version {chunk.prompt_version}")
            if seed == 1 and chunk.index == 0:
                ack = s.change_prompt(prompt_seed=7)    # text="..." for a text model
                print(f"session {seed}: prompt version {ack['prompt_version']} from chunk "
                      f"{ack['applies_from']}")
        print(f"session {seed}: {s.end['state']}")
if "server" in globals():                       # drain, stop the loop, free the pool
    server.should_exit = True
    thread.join()
    sched.close()
