"""Host cost of starting a graph after the host waited: launched, or submitted resident.

    python -m framekv.bench.resident [--rounds 20] [--json out.json]

After the host waited for the device, a graph launch costs far more than one issued
right behind another, whatever the graph (``python -m framekv.bench.wait``).
`GraphCache.resident` keeps a loop on the device that runs the graph when the host
stores to a doorbell. For a one-kernel graph and the seed geometry's 36-layer
denoising forward this module times, after the previous run finished and then 0 or
50 ms passed (the thread sleeping or spinning):

- ``replay``: `GraphCache.replay` (torch's replay, plus the host hook);
- ``resident``: `ResidentGraph.submit` with the loop still polling (idle limit 1 s);
- ``resident, relaunch``: the submit after the loop left on its idle limit (10 ms),
  which launches the loop again;

and, for the one-kernel graph, the latency from the call to the host seeing the run
done (replay: to a stream query returning true; resident: to ``done()``). Each row
has the median and minimum host µs over the rounds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from framekv.bench.timing import write_result
from framekv.bench.stack import AttentionStack
from framekv.graphs import GraphCache, GraphKey

PAUSES = {"none": None, "sleep 50 ms": time.sleep, "spin 50 ms": "spin"}
PAUSE_S = 0.05


def _pause(how) -> None:
    if how is None:
        return
    if how == "spin":
        end = time.perf_counter() + PAUSE_S
        while time.perf_counter() < end:
            pass
    else:
        how(PAUSE_S)


def _graphs():
    """(cache, {name: key}, stack) for the one-kernel graph and a 36-layer forward."""
    stack = AttentionStack.for_preset("seed-bench")
    g = stack.geometries[0]
    cache, T = GraphCache("cuda"), g.max_staged_tokens
    one = torch.zeros(1, device="cuda")
    k1 = GraphKey.build(owner=1, program="one-kernel", inputs={"one": one})
    cache.capture(k1, lambda one: one.add_(1), {"one": one})
    req = stack.forward_request(g, T, T)
    cache.capture(req.key, req.fn, req.inputs, after_replay=req.after_replay,
                  warmup_fn=req.warmup_fn)
    return cache, {"one-kernel graph": k1, "denoising forward, 36 layers": req.key}, stack


def _replay_rows(cache, keys, rounds: int) -> list[dict]:
    rows = []
    for name, key in keys.items():
        for pname, how in PAUSES.items():
            samples = []
            for _ in range(rounds):
                torch.cuda.synchronize()
                _pause(how)
                t0 = time.perf_counter()
                cache.replay(key)
                samples.append((time.perf_counter() - t0) * 1e6)
            rows.append(_row(name, "replay", pname, samples))
    return rows


def _resident_rows(cache, keys, rounds: int) -> list[dict]:
    rows = []
    for name, key in keys.items():
        for method, idle in (("resident", 1.0), ("resident, relaunch", 0.01)):
            r = cache.resident(key, idle_timeout_s=idle)
            try:
                r.submit()
                r.wait()
                for pname, how in PAUSES.items():
                    samples = []
                    for _ in range(rounds):
                        r.wait()
                        if idle < PAUSE_S:
                            _until_exited(r)
                        _pause(how)
                        t0 = time.perf_counter()
                        r.submit()
                        samples.append((time.perf_counter() - t0) * 1e6)
                    rows.append(_row(name, method, pname, samples, launches=r.launches))
            finally:
                r.close()
    return rows


def _until_exited(r) -> None:
    deadline = time.perf_counter() + 5
    while r.state != "exited":
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the resident loop did not leave on its idle limit: {r.counters()}")
        time.sleep(1e-3)


def _latency_rows(cache, key, rounds: int) -> list[dict]:
    """µs from the call to the host seeing the one-kernel run finished."""
    stream = torch.cuda.current_stream()
    replayed = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cache.replay(key)
        while not stream.query():
            pass
        replayed.append((time.perf_counter() - t0) * 1e6)
    resident = []
    with cache.resident(key, idle_timeout_s=1.0) as r:
        r.submit()
        r.wait()
        for _ in range(rounds):
            t0 = time.perf_counter()
            seq = r.submit()
            while not r.done(seq):
                pass
            resident.append((time.perf_counter() - t0) * 1e6)
    return [_row("one-kernel graph", "replay: call to done", "none", replayed),
            _row("one-kernel graph", "resident: submit to done", "none", resident)]


def _row(graph: str, method: str, pause: str, samples: list[float], **extra) -> dict:
    return {"graph": graph, "method": method, "pause": pause,
            "host_us": statistics.median(samples), "host_us_min": min(samples),
            "n": len(samples), **extra}


def measure(rounds: int) -> list[dict]:
    cache, keys, stack = _graphs()
    for key in keys.values():  # warm: the first replays of a graph upload it
        for _ in range(4):
            cache.replay(key)
    torch.cuda.synchronize()
    rows = _replay_rows(cache, keys, rounds)
    rows += _resident_rows(cache, keys, rounds)
    rows += _latency_rows(cache, keys["one-kernel graph"], rounds)
    torch.cuda.synchronize()
    cache.clear()
    stack.cache.shutdown()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    rows = measure(args.rounds)
    print(f"{'graph':<32}{'method':<28}{'pause':<14}{'host µs':>9}{'min':>8}")
    for r in rows:
        print(f"{r['graph']:<32}{r['method']:<28}{r['pause']:<14}{r['host_us']:>9.1f}"
              f"{r['host_us_min']:>8.1f}")
    write_result(args.json, rows=rows)


if __name__ == "__main__":
    main()
