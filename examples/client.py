"""Streaming from `framekv serve` with its Python client: sessions side by side, a prompt
change mid-stream.

    framekv serve --preset tiny &                      # any framekv server
    python examples/client.py --url http://127.0.0.1:8000

Without --url a server starts in this process (the tiny reference model, streaming
latents) on a free port. ``--chunks N``: chunks per session (default 8; at least 2, so
the prompt change asked for at chunk 1 can take). The token, if the server has one, comes from FRAMEKV_TOKEN.
Up to three sessions are opened, as many as the server has room for (a full server
answers 503); every session opened here is closed when the example ends, also when it
fails or is interrupted.
"""
import argparse
import contextlib
import threading
import time

from framekv.client import Client, ServerError

CHUNKS = 8          # a change asked for at chunk 1 takes within the session (queue <= 4)


@contextlib.contextmanager
def local_server(device):
    """The app `framekv serve` runs, in a thread of this process: its URL; drained and
    stopped when the block ends."""
    from framekv.engine.serving import StreamScheduler
    from framekv.tools.serve import build_app
    from framekv.tools.serve.net import DrainingServer, server_config

    sched = StreamScheduler("tiny", max_sessions=4, device=device, queue_chunks=2)
    server = DrainingServer(server_config(build_app(sched), port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the local server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join()
        sched.close()


def open_sessions(client, stack, chunks: int = CHUNKS) -> dict:
    """Up to three sessions of ``chunks`` chunks by seed, each closed by ``stack`` however
    the example ends."""
    sessions = {}
    for seed in (1, 2, 3):
        try:
            s = client.create(seed=seed, chunks=chunks)
        except ServerError as exc:
            if exc.status != 503 or not sessions:      # not "full", or no room at all
                raise
            print(f"session {seed}: not opened, the server is full ({exc.message})")
            break
        stack.callback(s.close)
        sessions[seed] = s
    return sessions


def change_prompt(client, seed: int, s) -> None:
    """A new prompt for session ``s``: text where the server's model takes text."""
    text = client.info()["prompt"]["text"]
    try:
        ack = s.change_prompt(text="a blue whale") if text else s.change_prompt(prompt_seed=7)
    except ServerError as exc:                          # e.g. its last chunk came first
        print(f"session {seed}: prompt change refused: {exc.message}")
        return
    print(f"session {seed}: prompt version {ack['prompt_version']} from chunk "
          f"{ack['applies_from']}")


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--url", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--chunks", type=int, default=CHUNKS, help=f"chunks per session (default "
                   f"{CHUNKS})")
    args = p.parse_args()
    if args.chunks < 2:
        p.error(f"--chunks must be at least 2, got {args.chunks}")
    with contextlib.ExitStack() as stack:      # closed in reverse: sessions, client, server
        url = args.url or stack.enter_context(local_server(args.device))
        client = stack.enter_context(Client(url))
        for seed, s in open_sessions(client, stack, args.chunks).items():
            for chunk in s.stream():
                got = chunk.latents if chunk.latents is not None else chunk.video()  # frames
                print(f"session {seed}: chunk {chunk.index} of {list(got.shape)}, "
                      f"prompt version {chunk.prompt_version}", flush=True)
                if seed == 1 and chunk.index == 1:
                    change_prompt(client, seed, s)
            print(f"session {seed}: {s.end['state']}")


if __name__ == "__main__":
    main()
