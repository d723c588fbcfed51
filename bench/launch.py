"""Host cost of launching big captured graphs, and what it depends on.

    python -m framekv.bench.launch [--json out.json] [--rows chains,kinds,stack,params]

(``--rows`` picks groups of rows; the default is chains,kinds,stack.)

For graphs of the seed geometry's attention stack (one forward over 36 layers, both
block sizes, as captured and with cuDNN's memset nodes turned into kernel nodes by
`framekv.graphs.rewrite`), for chains of N small kernels, for chains of one node kind
(numba kernels, cuDNN attention alone) and for numba kernels that differ only in their
parameter bytes or in how many functions they cycle through: the node count and node
types, and the host wall of one launch with the device idle before it, launched

- by torch's ``CUDAGraph.replay``, also while the device is still busy (the launch
  queued behind a ~2 ms sleep kernel, as a pipelined caller's would be),
- instantiated again and uploaded through the CUDA runtime (no flags), and
  instantiated for device launch (both launched from the host),
- as the body of a one-node conditional IF parent (the device walks the body),

the methods taken in turn over 60 rounds; and the device time per launch, plain and
through the conditional parent.
"""
from __future__ import annotations

import argparse
import statistics

import msgspec
import torch
from numba import cuda

from framekv import specs
from framekv.bench.timing import interleaved_host_times, require_cuda, summary, write_result
from framekv.bench.stack import AttentionStack, KVShape
from framekv.engine.attention.cudnn import CudnnBackend
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


def device_us(launch, n: int = 20) -> float:
    """GPU µs per launch, n back-to-back launches between two events (median of 5)."""
    out = []
    for _ in range(5):
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            launch()
        e.record()
        torch.cuda.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / n)
    return statistics.median(out)


def conditional_launch(graph: torch.cuda.CUDAGraph):
    """The graph cloned into the body of an IF node whose condition defaults to 1, in
    a one-node parent graph, instantiated and uploaded: a launch callable."""
    from cuda.bindings import driver as dr

    ctx = dr.cuCtxGetCurrent()[1]
    parent = dr.cuGraphCreate(0)[1]
    handle = dr.cuGraphConditionalHandleCreate(parent, ctx, 1, dr.CU_GRAPH_COND_ASSIGN_DEFAULT)[1]
    params = dr.CUgraphNodeParams()
    params.type = dr.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    params.conditional.handle, params.conditional.size = handle, 1
    params.conditional.type = dr.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF
    params.conditional.ctx = ctx
    assert int(dr.cuGraphAddNode(parent, None, None, 0, params)[0]) == 0
    body = params.conditional.phGraph_out[0]
    raw = dr.CUgraph(init_value=graph.raw_cuda_graph())
    assert int(dr.cuGraphAddChildGraphNode(body, None, 0, raw)[0]) == 0
    err, exe = dr.cuGraphInstantiate(parent, 0)
    assert int(err) == 0, err
    stream = dr.CUstream(init_value=torch.cuda.current_stream().cuda_stream)
    assert int(dr.cuGraphUpload(exe, stream)[0]) == 0
    return lambda: dr.cuGraphLaunch(exe, stream)


def row(label: str, graph: torch.cuda.CUDAGraph, launches: int = 20) -> dict:
    from cuda.bindings import runtime as rt

    info = graph_info(graph)
    calls = {"torch_replay": graph.replay, "torch_replay_busy": graph.replay,
             "runtime_launch": runtime_launch(graph), "conditional_launch":
             conditional_launch(graph)}
    try:  # the same graph instantiated for device launch (launched from the host here)
        flag = int(rt.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagDeviceLaunch)
        calls["device_launch_flag"] = runtime_launch(graph, flag)
    except (AssertionError, RuntimeError):
        pass
    # In turn, many rounds: the host's speed drifts, and one method timed after another
    # would each catch a different part of that drift.
    host = interleaved_host_times(calls, 60, busy=("torch_replay_busy",))
    r = {"graph": label, **msgspec.structs.asdict(info),
         **{f"{k}_host_us": summary(v) for k, v in host.items()},
         "plain_device_us": device_us(graph.replay, launches),
         "conditional_device_us": device_us(calls["conditional_launch"], launches)}
    med = {k: statistics.median(v) for k, v in host.items()}
    print(f"{label:<40}{info.nodes:>6}" + "".join(
        f"{med.get(k, float('nan')):>8.1f}" for k in (
            "torch_replay", "torch_replay_busy", "runtime_launch", "device_launch_flag",
            "conditional_launch"))
        + f"{r['plain_device_us']:>11.1f}{r['conditional_device_us']:>11.1f}"
        f"  {'straight' if info.straight_line else 'branched'} {info.types}", flush=True)
    return r


def stack_rows(rows: list) -> None:
    preset = specs.load_preset("seed-bench")
    g, kv = preset.rollout.geometry(), KVShape.of(preset.model)
    for split in ("auto",):
        for layers in (36,):
            stack = AttentionStack(kv._replace(num_layers=layers), [g],
                                   device="cuda", num_heads=32, backend=CudnnBackend(split=split))
            stack.ensure_open(g)
            x = stack.qkv_input(1576)["qkv"]
            for b in (1576, 394):
                for rewrite in (False, True):
                    graph = capture(lambda: stack.forward(x, 1576, b), rewrite=rewrite)
                    label = (f"forward L={layers} b={b} split={split}"
                             + (" kernels" if rewrite else ""))
                    rows.append(row(label, graph, launches=1))
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
    plan = CudnnBackend(split=1).plan(cache, tokens=1576, block_size=1576, num_heads=32,
                                      scale=128 ** -0.5)
    q = torch.randn(1576, 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    rows.append(row("36 cuDNN attention launches", capture(
        lambda: [plan.run(q, 0, out) for _ in range(36)], rewrite=True), launches=2))
    cache.shutdown()


def _touch_kernel(i: int, j: int, k: int):
    """A one-array numba kernel bumping element (i, j, k): each call a new function."""
    @cuda.jit
    def touch(a):
        if cuda.grid(1) == 0:
            a[i, j, k] += 1
    return touch


_touch1, _touch1b, _touch1c, _touch1d = (_touch_kernel(*ijk) for ijk in
                                         ((0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)))


@cuda.jit
def _touch4(a, b, c, d):
    if cuda.grid(1) == 0:
        a[0, 0, 0] += b[0, 0, 0] + c[0, 0, 0] + d[0, 0, 0]


@cuda.jit
def _touch8(a, b, c, d, e, f, g, h):
    if cuda.grid(1) == 0:
        a[0, 0, 0] += (b[0, 0, 0] + c[0, 0, 0] + d[0, 0, 0] + e[0, 0, 0] + f[0, 0, 0]
                       + g[0, 0, 0] + h[0, 0, 0])


def param_rows(rows: list) -> None:
    """Does a node's host cost follow its parameter bytes, or the switching between
    kernels? Chains of 100 one-thread-block numba kernels with 1, 4 or 8 3-D array
    arguments (88, 352, 704 bytes of parameters), and with 1 argument cycling through
    four different kernels."""
    # numba arrays made before capture: converting a tensor may synchronize its stream
    bufs = [cuda.as_cuda_array(torch.zeros(2, 2, 2, dtype=torch.int32, device="cuda"))
            for _ in range(8)]

    def chain(kernels, nargs):
        def run():
            stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
            for i in range(100):
                kernels[i % len(kernels)][1, 32, stream](*bufs[:nargs])
        return run

    for label, kernels, nargs in (("1 array arg (88 B)", [_touch1], 1),
                                  ("4 array args (352 B)", [_touch4], 4),
                                  ("8 array args (704 B)", [_touch8], 8),
                                  ("1 arg, 4 kernels in turn", [_touch1, _touch1b, _touch1c,
                                                                 _touch1d], 1)):
        rows.append(row(f"100 numba kernels, {label}", capture(chain(kernels, nargs))))


def chain_rows(rows: list) -> None:
    x = torch.randn(4096, device="cuda")
    for n in (10, 100, 1000):
        def fn(n=n):
            y = x
            for _ in range(n):
                y = y * 1.0001
            return y
        rows.append(row(f"chain of {n} elementwise kernels", capture(fn)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="chains,kinds,stack",
                    help="comma-separated groups of rows to run (chains, kinds, params, stack)")
    args = ap.parse_args(argv)
    groups = {"chains": chain_rows, "kinds": kind_rows, "params": param_rows,
              "stack": stack_rows}
    wanted = [g for g in args.rows.split(",") if g]
    bad = sorted(set(wanted) - groups.keys())
    if bad:
        ap.error(f"--rows: unknown groups {bad}; choose from {sorted(groups)}")
    require_cuda("framekv.bench.launch")
    print("host µs per launch (medians of 60 rounds, methods in turn): torch replay, the same "
          "while the device is busy, runtime launch, device-launch instantiation, conditional "
          "parent; then device µs per launch: plain, conditional parent")
    print(f"{'graph':<40}{'nodes':>6}{'torch':>8}{'busy':>8}{'rt':>8}{'devfl':>8}{'cond':>8}"
          f"{'dev plain':>11}{'dev cond':>11}  shape, node types")
    rows: list = []
    for name in wanted:
        groups[name](rows)
    write_result(args.json, rows=rows)


if __name__ == "__main__":
    main()
