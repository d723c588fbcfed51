"""torch's capture mechanics as `GraphCache` uses them: a graph that keeps its
cudaGraph_t after capture, its instantiation (after the memset rewrite of
`framekv.graphs.rewrite`), and the cleanup after a capture failed inside torch.
"""
from __future__ import annotations

import warnings

import torch


def new_graph() -> torch.cuda.CUDAGraph:
    """A graph whose raw cudaGraph_t stays after capture (to rewrite and inspect)."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # a torch without keep_graph: graphs are used as captured
        return torch.cuda.CUDAGraph()


def instantiate(graph: torch.cuda.CUDAGraph, rewrite: bool, device_index: int) -> int:
    """Rewrite memset nodes into kernel nodes (when ``rewrite`` and the graph was kept),
    then instantiate; returns how many memset nodes became kernel nodes. `GraphCache`
    always rewrites; ``rewrite=False`` keeps a graph as captured (to compare)."""
    try:
        graph.raw_cuda_graph()
    except (RuntimeError, AttributeError):  # instantiated at capture end already
        return 0
    replaced = 0
    if rewrite:
        from .rewrite import replace_memsets

        try:
            replaced = replace_memsets(graph, device_index)
        except Exception as exc:  # the graph is still whole: launch it as captured
            warnings.warn(f"memset nodes not rewritten ({exc}); graph launches cost per node",
                          stacklevel=3)
    graph.instantiate()
    return replaced


def end_failed_capture(graph: torch.cuda.CUDAGraph, device: torch.device, pool) -> None:
    """End the stream capture and the allocator's routing to the pool, whatever state
    the failure left them in.

    A capture invalidated by an illegal call (a host sync) makes ``capture_end``
    raise, which is expected here (and a second ``capture_end`` after a successful
    one raises too). torch has no public call to stop routing allocations to the
    pool, hence the private one (named differently before torch 2.8), which raises
    harmlessly when routing already ended. A final synchronize surfaces and clears
    any error left by the failed call.
    """
    try:
        graph.capture_end()
    except Exception:
        pass
    end = (getattr(torch._C, "_cuda_endAllocateToPool", None)
           or getattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", None))
    if end is not None and pool is not None:
        try:
            end(device.index, pool)
        except Exception:
            pass
    try:
        torch.cuda.synchronize(device)
    except Exception:
        pass

