"""Direct launches: a captured graph's own executable launched without torch's prologue.

Opt-in (``GraphCache(..., direct_launch=True)``); by default a replay is torch's
``CUDAGraph.replay``.

``torch.cuda.CUDAGraph.replay`` runs a prologue before every launch: for each random
number generator registered with the graph (the default CUDA generator always is) it
writes the generator's seed and offset into the graph's device tensors, two eager
``fill_`` kernels through the dispatcher. A graph that draws no random numbers does not
read them, and the prologue's host time is measurable (docs/benchmarks.md, "The chunk
cycle"). `DirectLaunch` launches the executable torch instantiated, on the current
stream, with nothing before it.

Whether a graph draws random numbers is only visible in torch's replay: it advances
the default generator's offset by what one run of the graph consumes. `RngProbe`, the
launcher a ``direct_launch`` cache gives each entry, therefore replays through torch
until one replay left the offset where it was (another thread drawing numbers
meanwhile only delays the switch), then uses `DirectLaunch`; a graph that moved the
offset `RNG_PROBES` times draws numbers and stays on torch's replay. Either way the
probe records the finding in ``entry.draws_random`` (a `ResidentGraph` refuses a graph
that draws: nothing would advance the generator between its runs).
"""
from __future__ import annotations

import torch

from ..capture import default_generator_offset

__all__ = ["DirectLaunch", "RNG_PROBES", "RngProbe", "default_generator_offset"]

#: Replays through torch that may still show no RNG use; a graph that moved the offset
#: this many times draws numbers (another thread's draws are not that regular).
RNG_PROBES = 3
#: Distinct streams remembered per launcher before the table is cleared (bounds memory
#: for callers that replay on many short-lived streams).
_MAX_STREAMS = 64


class DirectLaunch:
    """``cuGraphLaunch`` of ``graph``'s executable on ``device``'s current stream.

    `DirectLaunch.of` returns None where torch does not expose the executable. The
    launcher holds ``owner`` (the torch graph) so that the executable it launches is not
    destroyed under it. Callable with no argument, or as a `CapturedGraph` launcher
    (the entry it is given is not needed).
    """

    def __init__(self, exec_handle: int, device: torch.device, owner: object = None):
        # Here, not at the top: importing framekv.graphs must not import the ops (numba).
        from framekv.ops.driver import check, driver

        self._dr = dr = driver()
        self._check = check
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

    def __call__(self, entry=None) -> None:
        ptr = self._current(self._device)
        stream = self._streams.get(ptr)
        if stream is None:
            if len(self._streams) >= _MAX_STREAMS:
                self._streams.clear()
            stream = self._streams[ptr] = self._dr.CUstream(init_value=ptr)
        self._check("cuGraphLaunch", self._dr.cuGraphLaunch(self._exec, stream))


class RngProbe:
    """A `CapturedGraph` launcher: torch's replay while probing the graph's RNG use,
    then `DirectLaunch` (no numbers drawn) or torch's replay for good (numbers drawn,
    or the offset unreadable). Sets ``entry.draws_random`` and ``entry.direct_launch``.
    """

    def __init__(self, probes: int = RNG_PROBES):
        self._probes = probes
        self._decided = None  # the launcher once the probes have decided

    def __call__(self, entry) -> None:
        if self._decided is not None:
            self._decided(entry)
            return
        device = entry.device
        before = default_generator_offset(device)
        entry.graph.replay()
        if before is None:
            self._settle(entry, _torch_replay)
        elif default_generator_offset(device) == before:
            entry.draws_random = False
            direct = DirectLaunch.of(entry.graph, device)
            self._settle(entry, direct if direct is not None else _torch_replay)
        else:
            self._probes -= 1
            if self._probes <= 0:
                entry.draws_random = True
                self._settle(entry, _torch_replay)

    def _settle(self, entry, launcher) -> None:
        """Launch with ``launcher`` from now on; on top of the entry's slot, it takes
        the probe's place there (no indirection left on the hot path)."""
        self._decided = launcher
        entry.direct_launch = launcher is not _torch_replay
        if entry.launcher is self:
            entry.launcher = None if launcher is _torch_replay else launcher  # None: torch's


def _torch_replay(entry) -> None:
    entry.graph.replay()
