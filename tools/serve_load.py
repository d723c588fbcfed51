"""Load on `framekv serve`: N sessions streaming over real WebSockets for a while.

    python -m framekv.tools.serve_load [--preset small-stream] [--sessions 8]
        [--seconds 60] [--json FILE]

A preset ``wan-diffusers:CONFIG[:PRESET]`` serves diffusers' Wan transformer instead
(the server's ``--model wan-diffusers --config CONFIG [--preset PRESET]``, random
weights).

Starts the server in this process on 127.0.0.1 (every graph captured before the socket
opens), opens the sessions, and lets one client thread per session read its socket
for ``--seconds``. Reports the aggregate latent frames/s received, p50/p99 of the
batched step time of each chunk (the chunk latency a client sees at the head of its
queue) and of the gap between a session's chunks, and the graph captures after start
(which must be 0). ``--scrape S`` GETs ``/metrics`` every S seconds through the
measured window, as a monitoring system would, and reports the scrapes, their p50/p99
latency and the first and last body sizes (a bounded registry keeps them flat). Needs
the ``serve`` extra.
"""
import argparse
import json
import sys
import threading
import time

from framekv.bench.timing import stderr_progress, write_result
from framekv.specs import wire


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _client(url: str, stop: threading.Event, out: list) -> None:
    from websockets.sync.client import connect

    from websockets.exceptions import ConnectionClosed

    with connect(url, max_size=None, open_timeout=60) as ws:
        while not stop.is_set():
            try:
                msg = ws.recv(timeout=60)
            except ConnectionClosed:  # the server shutting down after the measurement
                return
            if isinstance(msg, str):
                return
            header, _ = wire.decode(msg)
            out.append((time.perf_counter(), header))
            ws.send(json.dumps({"type": "ack", "index": header["index"]}))


def _scraper(url: str, every: float, stop: threading.Event, out: list) -> None:
    import httpx

    with httpx.Client(timeout=30) as http:
        while not stop.wait(every):
            t = time.perf_counter()
            r = http.get(url)
            r.raise_for_status()
            out.append((time.perf_counter() - t, len(r.content)))


def measure_load(preset: str = "small-stream", *, sessions: int = 8, seconds: float = 60.0,
                 scrape: float | None = None, device=None, progress=print) -> dict:
    """Serve ``sessions`` open-ended sessions for ``seconds`` (module doc)."""
    import httpx
    import uvicorn

    from framekv.engine.serving import StreamScheduler
    from framekv.tools.serve import build_app, wan_factory

    progress(f"serve_load {preset}: building and capturing ({sessions} slots)")
    factory = None
    if preset.startswith("wan-diffusers:"):
        _, config, *sizes = preset.split(":")
        factory = wan_factory(argparse.Namespace(config=config, preset=(sizes or [None])[0],
                                                 weights=None, device=device, cache_dir=None),
                              decode=False)  # the load test streams latents
    sched = StreamScheduler(preset if factory is None else "tiny", max_sessions=sessions,
                            device=device, runner_factory=factory)
    captures0 = sched.metrics()["graph_captures"]
    srv = uvicorn.Server(uvicorn.Config(build_app(sched), host="127.0.0.1", port=0,
                                        log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    ids = [httpx.post(f"http://127.0.0.1:{port}/v1/sessions", json={"seed": i}).json()["id"]
           for i in range(sessions)]
    stop, received = threading.Event(), [[] for _ in ids]
    clients = [threading.Thread(target=_client, args=(
        f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream", stop, out), daemon=True)
        for sid, out in zip(ids, received)]
    progress(f"serve_load {preset}: {sessions} sessions streaming for {seconds:.0f} s")
    for c in clients:
        c.start()
    time.sleep(min(10.0, seconds / 6))        # past the first chunks: steady state
    scrapes, scrape_stop = [], threading.Event()
    if scrape:
        threading.Thread(target=_scraper, args=(f"http://127.0.0.1:{port}/metrics", scrape,
                                                scrape_stop, scrapes), daemon=True).start()
    t0, n0 = time.perf_counter(), [len(r) for r in received]
    time.sleep(seconds)
    t1, n1 = time.perf_counter(), [len(r) for r in received]
    scrape_stop.set()
    stop.set()
    srv.should_exit = True
    frames = sum((b - a) * sched.frames_per_chunk for a, b in zip(n0, n1))
    steps = [h["seconds"] for r in received for _, h in r]
    gaps = [b[0] - a[0] for r in received for a, b in zip(r, r[1:])]
    res = {"preset": preset, "sessions": sessions, "seconds": t1 - t0,
           "chunks": sum(b - a for a, b in zip(n0, n1)),
           "frames_per_second": frames / (t1 - t0),
           "step_seconds_p50": _percentile(steps, 0.5), "step_seconds_p99": _percentile(steps, 0.99),
           "chunk_gap_p50": _percentile(gaps, 0.5), "chunk_gap_p99": _percentile(gaps, 0.99),
           "batch_sizes_seen": sorted({h["batch"] for r in received for _, h in r}),
           "captures_after_start": sched.metrics()["graph_captures"] - captures0}
    if scrape:
        lat = [t for t, _ in scrapes]
        res.update(scrapes=len(scrapes), scrape_seconds_p50=_percentile(lat, 0.5),
                   scrape_seconds_p99=_percentile(lat, 0.99),
                   metrics_bytes_first=scrapes[0][1] if scrapes else None,
                   metrics_bytes_last=scrapes[-1][1] if scrapes else None)
    time.sleep(1.0)
    sched.close()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m framekv.tools.serve_load",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", action="append", default=None,
                   help="preset (repeatable; default small-stream)")
    p.add_argument("--sessions", type=int, action="append", default=None,
                   help="sessions per preset, in order (default 8)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--scrape", type=float, default=None, metavar="S",
                   help="GET /metrics every S seconds while measuring")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    presets = args.preset or ["small-stream"]
    counts = args.sessions or [8] * len(presets)
    out = []
    for preset, n in zip(presets, counts):
        out.append(measure_load(preset, sessions=n, seconds=args.seconds, scrape=args.scrape,
                                progress=stderr_progress("load")))
        print(json.dumps(out[-1]), flush=True)
        write_result(args.json_path, load=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
