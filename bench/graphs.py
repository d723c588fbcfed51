"""Graph replay host cost: one replay instead of many small launches.

    python -m framekv.bench.graphs [--json out.json] [--kernels 1,10,100,1000] [--repeats 200]

For graphs of N tiny elementwise kernels (N = ``--kernels``), captured through a
``framekv.graphs.GraphCache``:

- host wall per call of the eager callable (N launches) and of a replay, through the
  raw ``CUDAGraph.replay``, a kept ``CapturedGraph`` handle, ``GraphCache.replay(key)``
  and ``GraphCache.replay(key, inputs)`` (one input copy) and the same in debug mode;
- device time per replay (CUDA events, median);
- capture time and the memory the capture added to the shared pool.

A whole chunk of the seed model is thousands of kernels; what a replay saves is the
launch cost of each of them, which this measures in isolation.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from framekv.bench.report import dump_json
from framekv.bench.timing import require_cuda
from framekv.graphs import GraphCache, GraphKey


def chain(n: int):
    """A callable of ``n`` small dependent kernels."""
    def fn(x):
        for _ in range(n):
            x = x * 1.0001 + 1e-4
        return x
    return fn


def host_us(fn, repeats: int, inner: int = 20) -> float:
    """Median host wall per call in µs (the device is drained between batches)."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def device_us(replay, repeats: int) -> float:
    """Median device time of one replay in µs (CUDA events)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def measure(n: int, repeats: int) -> dict:
    x = {"x": torch.randn(4096, device="cuda")}
    fresh = torch.randn(4096, device="cuda")
    fn = chain(n)
    key = GraphKey.build(owner=1, program=f"chain:{n}", inputs=x)
    cache, debug = GraphCache("cuda"), GraphCache("cuda", debug=True)
    handle = cache.capture(key, fn, x)
    debug.capture(key, fn, x)
    eager_x = x["x"].clone()
    row = {
        "kernels": n,
        "eager_host_us": host_us(lambda: fn(eager_x), repeats),
        "cudagraph_replay_host_us": host_us(handle.graph.replay, repeats),
        "handle_replay_host_us": host_us(handle.replay, repeats),
        "cache_replay_host_us": host_us(lambda: cache.replay(key), repeats),
        "cache_replay_inputs_host_us": host_us(lambda: cache.replay(key, {"x": fresh}), repeats),
        "debug_replay_inputs_host_us": host_us(lambda: debug.replay(key, {"x": fresh}), repeats),
        "replay_device_us": device_us(handle.replay, repeats),
        "capture_seconds": handle.capture_seconds,
        "pool_reserved_bytes": handle.reserved_bytes,
    }
    assert torch.allclose(cache.replay(key, {"x": fresh}), fn(fresh), rtol=1e-5, atol=1e-5)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--kernels", default="1,10,100,1000", help="kernels per graph, comma-separated")
    ap.add_argument("--repeats", type=int, default=200, help="timed batches per number")
    args = ap.parse_args(argv)
    require_cuda("framekv.bench.graphs")
    rows = [measure(int(n), args.repeats) for n in args.kernels.split(",")]
    cols = [("kernels", "kernels", "{:>9}"), ("eager_host_us", "eager", "{:>9.1f}"),
            ("cudagraph_replay_host_us", "CUDAGraph", "{:>9.2f}"),
            ("handle_replay_host_us", "handle", "{:>9.2f}"),
            ("cache_replay_host_us", "cache", "{:>9.2f}"),
            ("cache_replay_inputs_host_us", "+inputs", "{:>9.2f}"),
            ("debug_replay_inputs_host_us", "debug", "{:>9.2f}"),
            ("replay_device_us", "device", "{:>9.1f}")]
    print("host µs per call (median): eager launches, CUDAGraph.replay, handle.replay(),\n"
          "cache.replay(key), cache.replay(key, inputs), the same in debug mode; "
          "device µs per replay")
    print(" ".join(f"{title:>9}" for _, title, _ in cols))
    for r in rows:
        print(" ".join(fmt.format(r[name]) for name, _, fmt in cols))
    dump_json(args.json, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "rows": rows})


if __name__ == "__main__":
    main()
