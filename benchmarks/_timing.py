"""Shared by the benchmark scripts: capture a callable as a warmed-up CUDA graph."""
from __future__ import annotations

import torch


def captured_graph(fn, launches: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``launches`` calls of ``fn``, warmed up and replayed a few times.

    Warm-up runs on a side stream (as torch's make_graphed_callables does) so lazy
    initialisation (kernel loading, cuDNN plans) happens outside the capture.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    for _ in range(5):
        graph.replay()
    return graph
