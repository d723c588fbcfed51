"""What a captured CUDA graph holds: node count, node types, shape of its dependencies.

A launch's host cost grows fastest with the node count when the graph is not
straight-line (every node one dependency and one dependent) or holds memset/memcpy or
event nodes; this is the first thing to look at when a replay's host cost is high.
A straight-line kernel-only graph launches in nearly constant time whatever its node
count, while any launch right after the host waited costs far more whatever the graph
(docs/benchmarks.md, "Launches after a wait").

    info = graph_info(captured.graph)     # a torch.cuda.CUDAGraph
    info.nodes, info.types, info.straight_line

Runtime calls are checked by `framekv.ops.driver.check`.
"""
from __future__ import annotations

from collections import Counter

import msgspec
import torch

from framekv.ops.driver import check


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
    count = _count(rt.cudaGraphGetNodes, raw)
    nodes = check("cudaGraphGetNodes", rt.cudaGraphGetNodes(raw, count))[0] if count else []
    types, deps, dependents = Counter(), 0, 0
    for node in nodes:
        kind = check("cudaGraphNodeGetType", rt.cudaGraphNodeGetType(node))
        types[kind.name.removeprefix("cudaGraphNodeType").lower()] += 1
        deps = max(deps, _count(rt.cudaGraphNodeGetDependencies, node))
        dependents = max(dependents, _count(rt.cudaGraphNodeGetDependentNodes, node))
    return GraphInfo(nodes=len(nodes), types=dict(types), max_dependencies=deps,
                     max_dependents=dependents, straight_line=deps <= 1 and dependents <= 1)


def _count(fn, handle) -> int:
    """The count a CUDA list query reports when asked for 0 entries."""
    out = fn(handle, 0)
    check(fn.__name__, out)
    return int(out[-1])
