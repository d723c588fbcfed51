"""What a captured CUDA graph holds: node count, node types, shape of its dependencies.

A launch's host cost grows fastest with the node count when the graph is not
straight-line (every node one dependency and one dependent) or holds memset/memcpy or
event nodes; this is the first thing to look at when a replay's host cost is high.
Straight-line kernel-only graphs launch in nearly constant time (H200: a 691-node
chunk ~10 µs right after another launch); a launch after the host waited tens of ms
costs ~100 µs whatever the graph, a 4-node one included (docs/benchmarks.md).

    info = graph_info(captured.graph)     # a torch.cuda.CUDAGraph
    info.nodes, info.types, info.straight_line
"""
from __future__ import annotations

from collections import Counter

import msgspec
import torch


class GraphInfo(msgspec.Struct, frozen=True):
    """Nodes of one CUDA graph.

    Attributes:
        nodes: how many.
        types: node type name ("kernel", "memset", "memcpy", ...) -> count.
        max_dependencies, max_dependents: the widest join and fork.
        straight_line: every node has at most one dependency and one dependent.
    """

    nodes: int
    types: dict[str, int]
    max_dependencies: int
    max_dependents: int
    straight_line: bool


def graph_info(graph: torch.cuda.CUDAGraph) -> GraphInfo:
    """Inspect ``graph`` (captured, not reset) through the CUDA runtime."""
    from cuda.bindings import runtime as rt

    raw = rt.cudaGraph_t(init_value=graph.raw_cuda_graph())
    nodes = _call(rt.cudaGraphGetNodes, raw, _count(rt.cudaGraphGetNodes, raw))
    types, deps, dependents = Counter(), 0, 0
    for node in nodes:
        kind = _call(rt.cudaGraphNodeGetType, node)
        types[kind.name.removeprefix("cudaGraphNodeType").lower()] += 1
        deps = max(deps, _count(rt.cudaGraphNodeGetDependencies, node))
        dependents = max(dependents, _count(rt.cudaGraphNodeGetDependentNodes, node))
    return GraphInfo(nodes=len(nodes), types=dict(types), max_dependencies=deps,
                     max_dependents=dependents, straight_line=deps <= 1 and dependents <= 1)


def _count(fn, handle) -> int:
    """The count a CUDA list query reports when asked for 0 entries."""
    out = fn(handle, 0)
    _check(out[0])
    return int(out[-1])


def _call(fn, *args):
    out = fn(*args)
    _check(out[0])
    return out[1] if len(out) > 1 else None


def _check(err) -> None:
    if int(err) != 0:
        raise RuntimeError(f"CUDA runtime call failed: {err}")
