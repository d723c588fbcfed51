"""Moves on a framekv cluster: what a live stream's move costs, and how fast sessions
are placed.

    python -m framekv.bench.cluster [--device cpu|cuda] [--presets tiny,small-stream]
        [--moves 8] [--placements 32] [--json FILE]

``--device`` defaults to cuda where a GPU is visible, else cpu; ``--presets`` to those
of `DEFAULT_PRESETS` for that device (a CPU: tiny). Each preset is checked to fit
two replicas of ``--max-sessions 8`` on the device before any cluster starts: one that
does not is refused with what it needs, in one line, exit status 2.

For each preset, starts ``framekv serve PRESET --replicas 2 --output latents`` (a
local Ray cluster, its own process), then:

- placement: opens ``--placements`` sessions one after another (each to the replica
  with the most free sessions) and closes them; sessions placed per second;
- moves: one session streams to a client thread that records when each chunk arrives,
  while ``--moves`` moves send it from replica to replica; for each move the stream
  state's bytes and the replica-measured export, transfer (object store) and import
  seconds, the whole move as the ingress saw it, and the client-visible gap (the
  longest wait between two chunks from the move's request to two chunks after it)
  against the median gap between chunks of the same stream without a move.

Medians of each, and each move's numbers, go to ``--json``. Runs on a CPU (Ray's
wheels do not travel to the GPU machines here; a move on a GPU is its export and
import, which ``framekv.bench.snapshots`` measures). Needs the ``cluster`` extra.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from .serve_load import free_port, read_chunks, stop_server, wait_serving
from .timing import stderr_progress, write_result

START_TIMEOUT_S = 600.0
#: the presets measured by default, by device type: on a CPU the small-stream pool (8
#: sessions of a 36-layer model) does not fit an ordinary host's memory
DEFAULT_PRESETS = {"cpu": "tiny", "cuda": "tiny,small-stream"}
#: each replica's sessions, as `cluster` starts them (``--max-sessions``)
SESSIONS = 8
REPLICAS = 2


@contextlib.contextmanager
def cluster(preset: str, device: str, progress):
    """``framekv serve PRESET --replicas 2`` in its own process; its URL once both
    replicas serve."""
    import httpx

    port, state = free_port(), tempfile.TemporaryDirectory(prefix="framekv-bench-cluster-")
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "framekv.tools.cli", "serve", preset, "--replicas",
           str(REPLICAS), "--output", "latents", "--device", device, "--max-sessions",
           str(SESSIONS), "--port", str(port), "--state-dir", state.name,
           "--session-idle-timeout", "3600"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, lambda: len(_replicas(httpx, url)) == REPLICAS, log.name,
                     START_TIMEOUT_S)
        progress(f"{preset}: cluster up at {url}")
        yield url
    finally:
        stop_server(proc, 90)
        log.close()
        os.unlink(log.name)
        state.cleanup()


def check_presets(presets: list[str], device) -> None:
    """ValueError naming the first of ``presets`` whose `REPLICAS` replicas of
    `SESSIONS` sessions do not fit ``device`` (`framekv.engine.memory.check_fits`: on one
    host, every replica's pool and model on the same memory), before any cluster
    starts."""
    from framekv.engine.memory import check_fits, rollout_bytes
    from framekv.engine.model import default_backend, model_dtype
    from framekv.engine.rollout import resolve_specs

    for preset in presets:
        name, model, rollout = resolve_specs(preset)
        need = rollout_bytes(model, rollout, model_dtype(model, device), sequences=SESSIONS,
                             reference_attention=default_backend(device, model.head_dim)
                             == "reference")
        check_fits(f"preset {name!r} ({REPLICAS} replicas of {SESSIONS} sessions)",
                   {k: REPLICAS * v for k, v in need.items()}, device)


def _replicas(httpx, url: str) -> list:
    r = httpx.get(f"{url}/v1/cluster/replicas", timeout=5)
    return r.json() if r.status_code == 200 else []


def placements(url: str, n: int) -> dict:
    """Sessions placed per second: ``n`` opened one after another (in rounds of the
    cluster's room, each round closed before the next), the closes not timed."""
    import httpx

    with httpx.Client(base_url=url, timeout=60) as http:
        room, seconds, spread, i = http.get("/v1/info").json()["max_sessions"], 0.0, [], 0
        while i < n:
            k = min(room, n - i)
            t = time.perf_counter()
            ids = [http.post("/v1/sessions", json={"seed": i + j, "paused": True}).json()["id"]
                   for j in range(k)]
            seconds += time.perf_counter() - t
            spread = [r["sessions"] for r in http.get("/v1/cluster/replicas").json()]
            for sid in ids:
                http.delete(f"/v1/sessions/{sid}")
            i += k
    return {"sessions": n, "seconds": seconds, "per_second": n / seconds,
            "spread_of_a_full_round": spread}


def moves(url: str, count: int, progress) -> dict:
    """``count`` moves of one streaming session (module doc)."""
    import httpx

    headers, stop = [], threading.Event()
    with httpx.Client(base_url=url, timeout=120) as http:
        sid = http.post("/v1/sessions", json={"seed": 1}).json()["id"]
        ws_url = url.replace("http://", "ws://") + f"/v1/sessions/{sid}/stream"
        reader = threading.Thread(target=read_chunks, args=(ws_url, stop, headers),
                                  daemon=True)
        reader.start()
        while len(headers) < 8:
            time.sleep(0.05)
        done = []
        for i in range(count):
            seen, asked = len(headers), time.perf_counter()
            report = http.post(f"/v1/sessions/{sid}/move", json={}).json()
            while len(headers) < seen + 3:
                time.sleep(0.01)
            after = [t for t, _ in headers if t >= asked][:3]
            gaps = [b - a for a, b in zip([asked] + after, after)]
            report["client_gap_s"] = max(gaps)
            done.append(report)
            progress(f"move {i + 1}/{count}: {report['bytes']} B, "
                     f"{report['seconds'] * 1e3:.1f} ms, gap {max(gaps) * 1e3:.1f} ms")
            time.sleep(0.3)
        stop.set()
        http.delete(f"/v1/sessions/{sid}")
    arrivals = [t for t, _ in headers]
    steady = [b - a for a, b in zip(arrivals, arrivals[1:])][:8]
    med = {k: statistics.median(m[k] for m in done)
           for k in ("export_s", "transfer_s", "import_s", "seconds", "client_gap_s")}
    return {"bytes": done[0]["bytes"], "median": med, "moves": done,
            "steady_gap_s": statistics.median(steady)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.cluster",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=None,
                   help="comma-separated presets (default: "
                        + "; ".join(f"{v} on {k}" for k, v in DEFAULT_PRESETS.items()) + ")")
    p.add_argument("--moves", type=int, default=8)
    p.add_argument("--placements", type=int, default=32)
    p.add_argument("--device", default=None,
                   help="the replicas' device: cpu, or cuda on a host with a GPU per "
                        "replica (default: cuda where a GPU is visible, else cpu)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    try:
        device, presets = resolve(args)
    except ValueError as exc:
        print(f"python -m framekv.bench.cluster: error: {exc}", file=sys.stderr)
        return 2
    progress, out = stderr_progress("cluster"), {}
    for preset in presets:
        with cluster(preset, str(device), progress) as url:
            out[preset] = {"placement": placements(url, args.placements),
                           "moves": moves(url, args.moves, progress)}
        m, pl = out[preset]["moves"], out[preset]["placement"]
        print(f"{preset:14s} move {m['bytes'] / 1024:8.1f} KiB  export "
              f"{m['median']['export_s'] * 1e3:6.1f} ms  transfer "
              f"{m['median']['transfer_s'] * 1e3:6.1f} ms  import "
              f"{m['median']['import_s'] * 1e3:6.1f} ms  whole "
              f"{m['median']['seconds'] * 1e3:6.1f} ms  client gap "
              f"{m['median']['client_gap_s'] * 1e3:6.1f} ms (steady "
              f"{m['steady_gap_s'] * 1e3:.1f} ms)  placed {pl['per_second']:.1f}/s")
    write_result(args.json, cluster=out)
    return 0


def resolve(args) -> tuple:
    """(the torch device, the presets) of ``args``: the defaults filled in (module
    doc), every preset checked to fit (`check_presets`); ValueError for a bad device or
    a preset that does not fit."""
    from framekv.engine.rollout import resolve_device

    device = resolve_device(args.device)
    presets = (args.presets or DEFAULT_PRESETS[device.type]).split(",")
    check_presets(presets, device)
    return device, presets


if __name__ == "__main__":
    sys.exit(main())
