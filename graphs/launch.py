"""Launching a captured graph's own executable through the driver.

``torch.cuda.CUDAGraph.replay`` runs a prologue before every launch: for each random
number generator registered with the graph (the default CUDA generator always is) it
writes the generator's seed and offset into the graph's device tensors, two eager
``fill_`` kernels through the dispatcher. A graph that draws no random numbers does not
read them; on H200 hosts they added 3 µs to a whole-chunk replay issued while earlier
chunks were queued and 11-25 µs to one issued right after a wait (docs/benchmarks.md).
`DirectLaunch` launches the executable torch instantiated, on the current stream, with
nothing before it.

Whether a graph draws random numbers is only visible in torch's replay: it advances
the default generator's offset by what one run of the graph consumes. `CapturedGraph`
therefore replays through torch until one replay left the offset where it was (another
thread drawing numbers meanwhile only delays the switch), then uses `DirectLaunch`.
"""
from __future__ import annotations

import torch

#: Distinct streams remembered per launcher before the table is cleared (bounds memory
#: for callers that replay on many short-lived streams).
_MAX_STREAMS = 64


class DirectLaunch:
    """``cuGraphLaunch`` of ``graph``'s executable on ``device``'s current stream.

    `DirectLaunch.of` returns None where torch does not expose the executable. The
    launcher holds ``owner`` (the torch graph) so that the executable it launches is not
    destroyed under it.
    """

    def __init__(self, exec_handle: int, device: torch.device, owner: object = None):
        from cuda.bindings import driver as dr

        self._dr = dr
        self._owner = owner
        self._exec = dr.CUgraphExec(init_value=exec_handle)
        self._device = device.index if device.index is not None else torch.cuda.current_device()
        self._streams: dict[int, object] = {}
        # Raw stream of a device without building a torch.cuda.Stream object.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._current = raw if raw is not None else (
            lambda i: torch.cuda.current_stream(i).cuda_stream)

    @classmethod
    def of(cls, graph: torch.cuda.CUDAGraph, device: torch.device) -> "DirectLaunch | None":
        try:
            handle = graph.raw_cuda_graph_exec()
        except (AttributeError, RuntimeError):  # older torch, or not instantiated
            return None
        return cls(int(handle), device, owner=graph) if handle else None

    def __call__(self) -> None:
        ptr = self._current(self._device)
        stream = self._streams.get(ptr)
        if stream is None:
            if len(self._streams) >= _MAX_STREAMS:
                self._streams.clear()
            stream = self._streams[ptr] = self._dr.CUstream(init_value=ptr)
        (err,) = self._dr.cuGraphLaunch(self._exec, stream)
        if err != self._dr.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuGraphLaunch failed: {err}")


def default_generator_offset(device: torch.device) -> int | None:
    """The default CUDA generator's Philox offset on ``device`` (None if unreadable)."""
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.default_generators[index].get_offset())
    except (AttributeError, IndexError, RuntimeError):
        return None
