"""Commit at the seed geometry: kernels, uploads, device time, host wall.

    python -m framekv.bench.commit [--json out.json] [--repeats 200]

Seed geometry (DESIGN.md): 36 layers, 8 K/V heads of 128, bf16, 32-token pages,
512 pinned tokens, a 37,824-token window, 1576-token chunks with block sizes 394 and
1576. The cache is run until the window is full, then one commit(1576) is measured:

- kernels and host-to-device copies of one eager commit (torch profiler, CUPTI);
- device time from the first kernel's start to the last kernel's end (profiler), and
  CUDA events around the replay of a graph holding one commit (median);
- host wall of an eager ``commit`` and of a graph-replayed commit (replay plus the
  host mirror's advance), medians over ``--repeats``.

Before timing, the graph-replayed commits are checked against eager ones: every
layout tensor and the pool equal after each of 20 chunks.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from framekv.bench.report import dump_json
from framekv.bench.timing import require_cuda
from framekv.engine import CausalKVCache
from framekv.specs import Geometry

L, H, D, TPP = 36, 8, 128, 32
GEOM = Geometry(512, 37824, 1576, (394, 1576))
N = 1576


def make_cache() -> CausalKVCache:
    cache = CausalKVCache(num_layers=L, num_kv_heads=H, head_dim=D, dtype=torch.bfloat16,
                          tokens_per_page=TPP, device="cuda",
                          pool_tokens=CausalKVCache.pool_tokens_for(GEOM, TPP))
    cache.open(GEOM)
    return cache


def stage(cache, kv, layers=range(L)) -> None:
    """One forward's writes (the real chunk's K/V), all layers unless told."""
    for layer in layers:
        cache.write_staged(layer, kv[layer, 0], kv[layer, 1], N)


def fill_window(cache, kv) -> None:
    while cache.committed_tokens < GEOM.pin_tokens + GEOM.window_tokens + 2 * N:
        stage(cache, kv)
        cache.commit(N)
    torch.cuda.synchronize()


def profile_commit(cache, kv) -> dict:
    from torch.profiler import ProfilerActivity, profile

    stage(cache, kv, layers=[0])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        cache.commit(N)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if str(e.device_type).endswith("CUDA")]
    kernels = [e for e in events
               if "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
    h2d = [e for e in events if "htod" in e.name.lower().replace(" ", "")]
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
            if kernels else 0)
    return {"kernels": len(kernels), "kernel_names": [e.name for e in kernels],
            "h2d_copies": len(h2d), "first_to_last_us": span,
            "kernel_sum_us": sum(e.time_range.end - e.time_range.start for e in kernels)}


def capture_commit(cache) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        cache.commit_device(N)
    return graph


def check_graph_equals_eager(kv) -> None:
    eager, graphed = make_cache(), make_cache()
    for c in (eager, graphed):
        fill_window(c, kv)
    graph = capture_commit(graphed)
    for _ in range(20):
        stage(eager, kv, layers=[0, L - 1])
        stage(graphed, kv, layers=[0, L - 1])
        eager.commit(N)
        graphed.commit_host(N)
        graph.replay()
        torch.cuda.synchronize()
        for k in eager._open.seqs[0].flat:
            assert torch.equal(eager._open.seqs[0].flat[k], graphed._open.seqs[0].flat[k]), k
        assert torch.equal(eager._pool, graphed._pool)
    eager.shutdown()
    graphed.shutdown()


def time_host(fn, repeats: int, setup=None) -> float:
    """Median host wall of ``fn`` in µs; ``setup`` runs before each call, untimed."""
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def device_us(graph, repeats: int) -> list[float]:
    """µs of each of ``repeats`` replays of ``graph`` between CUDA events."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return out


def measure(repeats: int) -> dict:
    """Check graph-replayed commits against eager ones, then time both."""
    torch.manual_seed(0)
    kv = torch.randn(L, 2, N, H, D, device="cuda").to(torch.bfloat16)
    check_graph_equals_eager(kv)
    cache = make_cache()
    fill_window(cache, kv)
    prof = profile_commit(cache, kv)

    def forward():  # one layer's write stages N tokens: what a commit needs, untimed
        stage(cache, kv, layers=[0])

    eager_us = time_host(lambda: cache.commit(N), repeats, setup=forward)
    torch.cuda.synchronize()
    graph = capture_commit(cache)

    def replayed_commit():
        cache.commit_host(N)
        graph.replay()

    replay_us = time_host(replayed_commit, repeats, setup=forward)
    replay_only_us = time_host(graph.replay, repeats)
    dev = device_us(graph, repeats)
    return {"geometry": {"pin": GEOM.pin_tokens, "window": GEOM.window_tokens, "chunk": N,
                         "layers": L, "kv_heads": H, "head_dim": D, "tokens_per_page": TPP},
            "device": torch.cuda.get_device_name(), "profile": prof,
            "graph_device_us_median": statistics.median(dev),
            "host_eager_commit_us": eager_us, "host_replayed_commit_us": replay_us,
            "host_replay_only_us": replay_only_us}


def report(out: dict) -> None:
    prof = out["profile"]
    print(f"commit at the seed geometry on {out['device']}")
    print(f"  kernels per commit        {prof['kernels']}  ({', '.join(prof['kernel_names'])})")
    print(f"  host-to-device copies     {prof['h2d_copies']}")
    print(f"  device first->last kernel {prof['first_to_last_us']:.1f} us (profiler), "
          f"graph replay {out['graph_device_us_median']:.1f} us (events, median)")
    print(f"  host wall: eager {out['host_eager_commit_us']:.1f} us, graph replay + mirror "
          f"{out['host_replayed_commit_us']:.1f} us, replay alone "
          f"{out['host_replay_only_us']:.1f} us")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args(argv)
    require_cuda("framekv.bench.commit")
    out = measure(args.repeats)
    report(out)
    dump_json(args.json, out)


if __name__ == "__main__":
    main()
