"""Memset nodes of a captured graph turned into kernel nodes.

CUDA launches a straight-line chain of kernel nodes in nearly constant host time, but
memset nodes make the launch cost grow quickly with the node count (docs/benchmarks.md,
"Launches after a wait": a 36-layer forward and a whole chunk, with and without them).
cuDNN's attention issues a small memset (scheduler state in its workspace) before every
launch, and it ends up in every graph. This module replaces each memset node by a
kernel node writing the same bytes, with the same dependencies, before the graph is
instantiated::

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    ... capture ...
    replace_memsets(graph)      # count of nodes replaced
    graph.instantiate()

The kernel node comes from `framekv.ops.fill_node_params` (a numba kernel over the
memset's 2-D region, compiled through the ops' launcher and so through numba's disk
cache when a warm-up turned it on); driver calls go through `framekv.ops.driver.check`.
"""
from __future__ import annotations

import torch

from framekv.ops.driver import check, driver
from framekv.ops.fill_pattern import fill_node_params


def replace_memsets(graph: torch.cuda.CUDAGraph, device_index: int | None = None) -> int:
    """Replace every memset node of ``graph`` (captured with ``keep_graph=True``, not yet
    instantiated) by an equivalent kernel node; returns how many were replaced.

    ``device_index``: the device the graph was captured on (default: torch's current).
    """
    dr = driver()
    if device_index is None:
        device_index = torch.cuda.current_device()
    raw = dr.CUgraph(init_value=graph.raw_cuda_graph())
    memset = dr.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET
    replaced = 0
    for node in _list(dr.cuGraphGetNodes, raw):
        if check("cuGraphNodeGetType", dr.cuGraphNodeGetType(node)) != memset:
            continue
        p = check("cuGraphMemsetNodeGetParams", dr.cuGraphMemsetNodeGetParams(node))
        params = fill_node_params(int(p.dst), int(p.height), int(p.width), int(p.pitch),
                                  int(p.elementSize), int(p.value), device_index)
        deps = _list(dr.cuGraphNodeGetDependencies, node)
        after = _list(dr.cuGraphNodeGetDependentNodes, node)
        # The fill joins the graph next to the memset before the memset goes: a failure
        # part way leaves both (the same bytes written twice), never neither.
        fill = check("cuGraphAddKernelNode", dr.cuGraphAddKernelNode(raw, deps, len(deps), params))
        if after:
            _add_edges(raw, [fill] * len(after), after)
        check("cuGraphDestroyNode", dr.cuGraphDestroyNode(node))
        replaced += 1
    return replaced


def _list(fn, handle) -> list:
    """The nodes a cuda-python list query returns (status, nodes, ..., count): asked
    for 0 entries first, which reports the count."""
    name = fn.__name__
    out = fn(handle, 0)
    check(name, out)
    count = int(out[-1])
    if not count:
        return []
    out = fn(handle, count)
    check(name, out)
    return list(out[1])


def _add_edges(raw, src, dst) -> None:
    dr = driver()
    try:
        check("cuGraphAddDependencies", dr.cuGraphAddDependencies(raw, src, dst, None, len(src)))
    except TypeError:  # bindings without edge data
        check("cuGraphAddDependencies", dr.cuGraphAddDependencies(raw, src, dst, len(src)))
