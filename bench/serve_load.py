"""Load on `framekv serve`: N sessions streaming over real WebSockets for a while.

    python -m framekv.bench.serve_load [--preset small-stream] [--sessions 8]
        [--seconds 60] [--scrape S] [--device D] [--json FILE]

A preset ``MODEL:CONFIG[:PRESET]`` serves a config of another model family instead
(``framekv serve --model MODEL --config CONFIG [--preset PRESET] --output latents``,
random weights): ``wan-diffusers:1.3b`` is diffusers' Wan transformer.

Starts ``framekv serve PRESET --output latents`` (the stream, not its preview pictures)
as its own process on 127.0.0.1 (every graph captured before
its socket opens: /health answers once it serves), opens the sessions, and lets one
client thread per session read and acknowledge its chunks for ``--seconds``. Reports
the aggregate latent frames/s received, p50/p99 of the batched step time of each chunk
and of the gap between a session's chunks, the batch sizes seen, and the graph captures
after start (which must be 0; from /metrics). ``--scrape S`` GETs ``/metrics`` every S
seconds through the measured window, as a monitoring system would, and reports the
scrapes, their p50/p99 latency and the first and last body sizes (a bounded registry
keeps them flat). The scraper runs in a process of its own, so its latency is the
server's and not the reading clients' (which share a GIL); beside each scrape it GETs
``/health``, a route that does no work, so a slow scrape reads as the route's own cost
(``/metrics`` slow, ``/health`` fast) or as the server's event loop being held
(both slow). Runs on a CPU too (``--device cpu``). Needs the ``serve`` extra.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from framekv.specs import wire

from .timing import stderr_progress, write_result

#: seconds the server may take to build and capture before it serves
START_TIMEOUT_S = 900.0


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def server_command(preset: str, sessions: int, port: int, device=None) -> list[str]:
    """The ``framekv serve`` command line of a load run (module doc)."""
    cmd = [sys.executable, "-m", "framekv.tools.cli", "serve"]
    if ":" in preset:                               # MODEL:CONFIG[:PRESET]
        model, config, *sizes = preset.split(":")
        cmd += ["--model", model, "--config", config, "--output", "latents"]
        cmd += ["--preset", sizes[0]] if sizes else []
    else:
        cmd += [preset, "--output", "latents"]      # the stream, not its preview pictures
    cmd += ["--max-sessions", str(sessions), "--host", "127.0.0.1", "--port", str(port),
            "--session-idle-timeout", "3600"]
    return cmd + (["--device", str(device)] if device is not None else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_chunks(url: str, stop: threading.Event, out: list) -> None:
    """Read and acknowledge the chunks of the socket at ``url`` until ``stop`` (or its
    end): (arrival time, header) of each into ``out``."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with connect(url, max_size=None, open_timeout=60) as ws:
        while not stop.is_set():
            try:
                msg = ws.recv(timeout=60)
            except (ConnectionClosed, TimeoutError):  # the server going after the run
                return
            if isinstance(msg, str):
                return
            header, _ = wire.decode(msg)
            out.append((time.perf_counter(), header))
            try:
                ws.send(json.dumps({"type": "ack", "index": header["index"]}))
            except ConnectionClosed:
                return


def _timed_get(http, path: str) -> tuple[float, int]:
    t = time.perf_counter()
    r = http.get(path)
    r.raise_for_status()
    return time.perf_counter() - t, len(r.content)


def scrape_process(base: str, every: float, go, stop, conn) -> None:
    """A scraper process's body: says it is ready through ``conn``, then once ``go`` is
    set, every ``every`` seconds until ``stop`` is set, GETs ``/metrics`` then
    ``/health`` of ``base``; sends back ([(seconds, bytes)] of the scrapes, [seconds] of
    the health checks) through ``conn``, or the error's text."""
    import httpx

    scrapes, health = [], []
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            conn.send("ready")
            go.wait()
            while not stop.wait(every):
                scrapes.append(_timed_get(http, "/metrics"))
                health.append(_timed_get(http, "/health")[0])
        conn.send((scrapes, health))
    except Exception as exc:                      # noqa: BLE001 - reported by the parent
        conn.send(f"{type(exc).__name__}: {exc}")


def start_scraper(base: str, every: float):
    """`scrape_process` in a process of its own (spawned: no GIL or fork state shared
    with the clients), waiting for ``go()``; returns (go, finish): ``finish()`` ends it
    and gives its results."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    go, stop, (recv, send) = ctx.Event(), ctx.Event(), ctx.Pipe(duplex=False)
    proc = ctx.Process(target=scrape_process, args=(base, every, go, stop, send), daemon=True)
    proc.start()
    got = recv.recv() if recv.poll(120) else "it did not start within 120 s"
    if got != "ready":
        proc.kill()
        raise RuntimeError(f"serve_load scraper failed: {got}")

    def finish() -> tuple[list, list]:
        stop.set()
        got = recv.recv() if recv.poll(60) else "the scraper sent nothing within 60 s"
        proc.join(10)
        if isinstance(got, str):
            raise RuntimeError(f"serve_load scraper failed: {got}")
        return got
    return go.set, finish


def _captures(http) -> int:
    text = http.get("/metrics").text
    m = re.search(r"^framekv_graph_captures_total (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def wait_serving(proc, up, log_path: str, timeout: float = START_TIMEOUT_S) -> None:
    """Wait until ``up()`` is true (an HTTP error: not yet); RuntimeError with the
    server's log if its process ends first, or after ``timeout`` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                raise RuntimeError(f"framekv serve exited with status {proc.returncode}:\n"
                                   f"{f.read()[-4000:]}")
        try:
            if up():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"framekv serve did not serve within {timeout:.0f} s")


def stop_server(proc, timeout: float) -> None:
    """SIGTERM (a server's drain), then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure_load(preset: str = "small-stream", *, sessions: int = 8, seconds: float = 60.0,
                 scrape: float | None = None, device=None, progress=print) -> dict:
    """Serve ``sessions`` open-ended sessions for ``seconds`` (module doc)."""
    import httpx

    port = free_port()
    progress(f"serve_load {preset}: starting framekv serve ({sessions} slots) on port {port}")
    with tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(server_command(preset, sessions, port, device),
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            wait_serving(proc, lambda: http.get("/health").status_code == 200, log.name)
            captures0 = _captures(http)
            ids = [http.post("/v1/sessions", json={"seed": i}).json()["id"]
                   for i in range(sessions)]
            res = _measure(port, ids, seconds, scrape, progress, preset)
            res["captures_after_start"] = _captures(http) - captures0
        return res
    finally:
        stop_server(proc, 60)
        os.unlink(log.name)


def _measure(port: int, ids: list[str], seconds: float, scrape, progress, preset) -> dict:
    """The clients (and the scraper) over ``seconds``: the load's numbers."""
    stop, received = threading.Event(), [[] for _ in ids]
    clients = [threading.Thread(target=read_chunks, args=(
        f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream", stop, out), daemon=True)
        for sid, out in zip(ids, received)]
    progress(f"serve_load {preset}: {len(ids)} sessions streaming for {seconds:.0f} s")
    go, finish = (start_scraper(f"http://127.0.0.1:{port}", scrape) if scrape
                  else (lambda: None, lambda: ([], [])))
    for c in clients:
        c.start()
    time.sleep(min(10.0, seconds / 6))        # past the first chunks: steady state
    go()
    t0, n0 = time.perf_counter(), [len(r) for r in received]
    time.sleep(seconds)
    t1, n1 = time.perf_counter(), [len(r) for r in received]
    scrapes, health = finish()
    stop.set()
    frames = sum(h["frames"] for r, a, b in zip(received, n0, n1) for _, h in r[a:b])
    steps = [h["seconds"] for r in received for _, h in r]
    gaps = [b[0] - a[0] for r in received for a, b in zip(r, r[1:])]
    res = {"preset": preset, "sessions": len(ids), "seconds": t1 - t0,
           "chunks": sum(b - a for a, b in zip(n0, n1)), "frames_per_second": frames / (t1 - t0),
           "step_seconds_p50": _percentile(steps, 0.5), "step_seconds_p99": _percentile(steps, 0.99),
           "chunk_gap_p50": _percentile(gaps, 0.5), "chunk_gap_p99": _percentile(gaps, 0.99),
           "batch_sizes_seen": sorted({h["batch"] for r in received for _, h in r})}
    if scrape:
        lat = [t for t, _ in scrapes]
        res.update(scrapes=len(scrapes), scrape_seconds_p50=_percentile(lat, 0.5),
                   scrape_seconds_p99=_percentile(lat, 0.99),
                   health_seconds_p50=_percentile(health, 0.5),
                   health_seconds_p99=_percentile(health, 0.99),
                   metrics_bytes_first=scrapes[0][1] if scrapes else None,
                   metrics_bytes_last=scrapes[-1][1] if scrapes else None)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.serve_load",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", action="append", default=None,
                   help="preset (repeatable; default small-stream)")
    p.add_argument("--sessions", type=int, action="append", default=None,
                   help="sessions per preset, in order (default 8)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--scrape", type=float, default=None, metavar="S",
                   help="GET /metrics every S seconds while measuring")
    p.add_argument("--device", default=None, help="the server's device (default its own)")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    presets = args.preset or ["small-stream"]
    counts = args.sessions or [8] * len(presets)
    out = []
    for preset, n in zip(presets, counts):
        out.append(measure_load(preset, sessions=n, seconds=args.seconds, scrape=args.scrape,
                                device=args.device, progress=stderr_progress("load")))
        print(json.dumps(out[-1]), flush=True)
        write_result(args.json_path, load=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
