"""Host cost of launching big captured graphs, and what it depends on.

    python benchmarks/bench_launch.py [--json out.json]

For graphs of the seed geometry's attention stack (one forward over L layers, split-KV
on and off) and for chains of N trivial kernels: the node count and node types of
the captured graph, and the host wall of a launch with the device idle before it
(torch's replay, and the same graph instantiated again through the CUDA runtime and
uploaded, and instantiated for device launch), as captured and with its memset nodes
turned into kernel nodes (`framekv.graphs.rewrite`); and chains of one node kind
(numba kernels, cuDNN attention alone). Tells whether a launch costs per node, and
which nodes make it so.
"""
from __future__ import annotations

import argparse
import json
import statistics

import msgspec
import torch

from framekv import specs
from framekv.bench.timing import environment, host_times
from framekv.engine.attention_cudnn import CudnnBackend
from framekv.engine.attention_stack import AttentionStack
from framekv.graphs.inspect import graph_info
from framekv.graphs.rewrite import replace_memsets


def capture(fn, warm: int = 2, rewrite: bool = False) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    if rewrite:
        replace_memsets(graph)
    graph.instantiate()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def runtime_launch(graph: torch.cuda.CUDAGraph, flags: int = 0):
    """The same graph instantiated by the runtime and uploaded: a launch callable."""
    from cuda.bindings import runtime as rt

    raw = rt.cudaGraph_t(init_value=graph.raw_cuda_graph())
    err, exe = rt.cudaGraphInstantiateWithFlags(raw, flags)
    assert int(err) == 0, err
    stream = rt.cudaStream_t(init_value=torch.cuda.current_stream().cuda_stream)
    assert int(rt.cudaGraphUpload(exe, stream)[0]) == 0
    for _ in range(3):
        rt.cudaGraphLaunch(exe, stream)
    torch.cuda.synchronize()
    return lambda: rt.cudaGraphLaunch(exe, stream)


def row(label: str, graph: torch.cuda.CUDAGraph) -> dict:
    from cuda.bindings import runtime as rt

    info = graph_info(graph)
    rt_launch = runtime_launch(graph)
    r = {"graph": label, **msgspec.structs.asdict(info),
         "torch_replay_host_us": statistics.median(host_times(graph.replay, 30)),
         "runtime_launch_host_us": statistics.median(host_times(rt_launch, 30))}
    try:  # the same graph instantiated for device launch (launched from the host here)
        flag = int(rt.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch)
        r["device_launch_flag_host_us"] = statistics.median(
            host_times(runtime_launch(graph, flag), 30))
    except (AssertionError, RuntimeError) as exc:
        r["device_launch_flag_host_us"] = f"not instantiable: {exc}"
    print(f"{label:<34}{info.nodes:>7}{r['torch_replay_host_us']:>10.1f}"
          f"{r['runtime_launch_host_us']:>10.1f}  {'straight' if info.straight_line else 'branched'}"
          f" {info.types}", flush=True)
    return r


def stack_rows(rows: list) -> None:
    preset = specs.load_preset("seed-bench")
    g, kv = preset.rollout.geometry(), preset.warmup_plan().kv
    for split in ("auto",):
        for layers in (36,):
            stack = AttentionStack(msgspec.structs.replace(kv, num_layers=layers), [g],
                                   device="cuda", num_heads=32, backend=CudnnBackend(split=split))
            stack.ensure_open(g)
            x = stack.qkv_input(1576)["qkv"]
            for b in (1576, 394):
                for rewrite in (False, True):
                    graph = capture(lambda: stack.forward(x, 1576, b), rewrite=rewrite)
                    label = f"forward L={layers} b={b} split={split}" + (" kernels" if rewrite else "")
                    rows.append(row(label, graph))
                    del graph
            graph = capture(lambda: stack.cache.commit_device(1576))
            rows.append(row(f"commit L={layers}", graph))
            stack.cache.shutdown()


def kind_rows(rows: list) -> None:
    """Per-node cost by kind: 100 numba launches, and 36 cuDNN attention launches alone."""
    from framekv.engine import CausalKVCache
    from framekv.ops import rotate_rows_

    x = torch.arange(1300, dtype=torch.int32, device="cuda").view(1, -1)
    rows.append(row("chain of 100 numba kernels", capture(
        lambda: [rotate_rows_(x, 1) for _ in range(100)], rewrite=True)))
    preset = specs.load_preset("seed-bench")
    g = preset.rollout.geometry()
    cache = CausalKVCache(num_layers=1, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                          tokens_per_page=32, device="cuda",
                          pool_tokens=CausalKVCache.pool_tokens_for(g, 32))
    cache.open(g)
    backend = CudnnBackend(split=1)
    q = torch.randn(1576, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    rows.append(row("36 cuDNN attention launches", capture(
        lambda: [backend.cached(q, cache, 0, 1576, 128 ** -0.5, out) for _ in range(36)],
        rewrite=True)))
    cache.shutdown()


def chain_rows(rows: list) -> None:
    x = torch.randn(4096, device="cuda")
    for n in (10, 100, 1000):
        def fn(n=n):
            y = x
            for _ in range(n):
                y = y * 1.0001
            return y
        rows.append(row(f"chain of {n} elementwise kernels", capture(fn)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"{'graph':<34}{'nodes':>7}{'torch µs':>10}{'rt µs':>10}  shape, node types")
    rows: list = []
    chain_rows(rows)
    kind_rows(rows)
    stack_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
