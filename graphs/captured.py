"""One captured graph: its static buffers, its replay, the debug checks.

`GraphCache` builds these; callers may keep the handle `GraphCache.capture` returns
and call `CapturedGraph.replay` in a hot loop (it skips the key lookup). A replay is
torch's ``CUDAGraph.replay`` of the instantiated graph.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from .keys import GraphKey, TensorSpec


class GraphCaptureError(RuntimeError):
    """Warm-up or capture of a key failed; no entry was kept. ``__cause__`` is the error."""


def named_outputs(outputs: Any) -> list[tuple[str, torch.Tensor]]:
    """A callable's outputs as (name, tensor) pairs.

    None -> []; a tensor -> ``output``; a tuple/list -> ``output[i]``; a dict -> its
    keys. Anything else raises ValueError: a graph can only hand back tensors.
    """
    if outputs is None:
        return []
    if isinstance(outputs, torch.Tensor):
        pairs = [("output", outputs)]
    elif isinstance(outputs, (tuple, list)):
        pairs = [(f"output[{i}]", t) for i, t in enumerate(outputs)]
    elif isinstance(outputs, Mapping):
        pairs = [(str(k), t) for k, t in outputs.items()]
    else:
        raise ValueError(f"a graph's callable must return None, a tensor, or a tuple/list/dict "
                         f"of tensors, got {type(outputs).__name__}")
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return pairs


def static_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A new buffer with ``tensor``'s shape, strides, dtype and device, holding its values."""
    out = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype,
                              device=tensor.device)
    out.copy_(tensor)
    return out


_UNSET = object()


class CapturedGraph:
    """A key's graph (on CPU: its eager stand-in) over fixed input/output buffers.

    Attributes:
        key: the `GraphKey`.
        static_inputs: read-only mapping name -> input buffer; fill these in place, or
            pass tensors to `replay` to have them copied in.
        static_outputs: what the callable returned at capture (on CPU: at the first
            call); rewritten by every replay.
        graph: the ``torch.cuda.CUDAGraph``, or None when running eagerly.
        hits: replays (eager calls on CPU).
        memsets_replaced: memset nodes turned into kernel nodes before instantiation.
        capture_seconds, allocated_bytes, reserved_bytes: capture cost; the byte
            counts are the growth of torch's allocated / reserved memory during capture.
    """

    def __init__(self, key: GraphKey, fn: Callable[..., Any], static_inputs: dict,
                 *, after_replay: Callable[[], None] | None, debug: bool,
                 on_abandon: Callable[[], None] | None = None):
        self.key, self.fn, self.debug = key, fn, debug
        self._inputs = static_inputs
        self.static_inputs: Mapping[str, torch.Tensor] = MappingProxyType(static_inputs)
        self._specs = {s.name: s for s in key.inputs}
        self.after_replay = after_replay
        self.graph: torch.cuda.CUDAGraph | None = None
        self._outputs: Any = _UNSET
        self._addresses: dict[str, int] = {}
        self._on_abandon = on_abandon
        self.hits = 0
        self.capture_seconds = 0.0
        self.allocated_bytes = self.reserved_bytes = 0
        self.memsets_replaced = 0  # memset nodes turned into kernel nodes at capture
        self._graph_device: torch.device | None = None
        self._remember_addresses()

    @property
    def static_outputs(self) -> Any:
        """The static outputs, or None before the first call of an eager entry."""
        return None if self._outputs is _UNSET else self._outputs

    def set_captured(self, graph: torch.cuda.CUDAGraph | None, outputs: Any,
                     device: torch.device | None = None) -> None:
        """Record the capture's graph (captured on ``device``) and static outputs and
        remember every address."""
        named_outputs(outputs)  # ValueError for anything but tensors
        self.graph, self._outputs = graph, outputs
        self._graph_device = device
        self._remember_addresses()

    def _remember_addresses(self) -> None:
        self._addresses = {f"input {n!r}": t.data_ptr() for n, t in self._inputs.items()}
        if self._outputs is not _UNSET:
            self._addresses.update((f"static output {n!r}", t.data_ptr())
                                   for n, t in named_outputs(self._outputs))

    # ------------------------------------------------------------------ replay
    def replay(self, inputs: Mapping[str, torch.Tensor] | None = None, *,
               after_replay: Callable[[], None] | None = None) -> Any:
        """Copy ``inputs`` (any subset of the input names) in, replay, return outputs.

        A tensor that *is* the static buffer is not copied. After a graph replay the
        host hook runs (``after_replay`` if given, else the one set at capture): the
        replay ran no Python, so host-side bookkeeping (a cache's mirror) goes there.
        An eager call runs the callable's Python itself and calls no hook.

        The outputs are the static buffers: valid until the next replay of any graph
        sharing the memory pool (copy out what you keep).
        """
        if inputs:
            self.load(inputs)
        if self.debug:
            self.check_addresses()
        if self.graph is None:
            return self._call_eagerly()
        self.graph.replay()
        self.hits += 1
        hook = after_replay if after_replay is not None else self.after_replay
        if hook is not None:
            hook()
        return self._outputs

    @property
    def device(self) -> torch.device | None:
        """The device the graph was captured on (None for an eager entry)."""
        return self._graph_device

    def load(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Copy tensors into the static input buffers of the same names: every input
        is checked first, so a refused call copies nothing (the next replay never runs
        on a mix of old and new inputs)."""
        static = self._inputs
        for name, t in inputs.items():
            s = static.get(name)
            if s is None:
                raise ValueError(f"unknown input {name!r} for {self.key.program}; "
                                 f"the graph takes {sorted(static)}")
            if t is s:
                continue
            if self.debug or not isinstance(t, torch.Tensor):
                self.check_layout(name, t)
            elif t.shape != s.shape or t.dtype != s.dtype:
                # Checked always: copy_ would broadcast a wrong shape without a word.
                raise ValueError(f"input {name!r}: got shape {list(t.shape)} {t.dtype}, the "
                                 f"graph was captured for {list(s.shape)} {s.dtype}; a "
                                 "different layout is a different key")
        for name, t in inputs.items():
            if t is not static[name]:
                static[name].copy_(t)

    # ------------------------------------------------------------------ debug checks
    def check_layout(self, name: str, tensor: torch.Tensor) -> None:
        """ValueError naming the input unless ``tensor`` has the captured layout."""
        want = self._specs[name]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"input {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        got = TensorSpec.of(name, tensor)
        if got != want:
            raise ValueError(f"input {name!r} has layout {got.summary()} (strides "
                             f"{list(got.stride)}), the graph was captured for {want.summary()} "
                             f"(strides {list(want.stride)}): that is a different key")

    def check_addresses(self) -> None:
        """RuntimeError naming the buffer if a static buffer moved since capture."""
        current = {f"input {n!r}": t.data_ptr() for n, t in self._inputs.items()}
        if self._outputs is not _UNSET:
            current.update((f"static output {n!r}", t.data_ptr())
                           for n, t in named_outputs(self._outputs))
        for what, ptr in current.items():
            was = self._addresses.get(what, ptr)
            if ptr != was:
                raise RuntimeError(f"{what} of {self.key.program} moved from {was:#x} to "
                                   f"{ptr:#x} since capture; the graph still reads the old "
                                   "address (fill static buffers in place, never replace them)")

    # ------------------------------------------------------------------ eager stand-in
    def _call_eagerly(self) -> Any:
        """CPU: run the callable; the first call's outputs become the static outputs."""
        first = self._outputs is _UNSET
        try:
            out = self.fn(**self._inputs)
            if first:
                self.set_captured(None, out)
            else:
                _copy_outputs(self._outputs, out)
        except Exception as exc:
            if not first:
                raise
            # The first call plays the capture's part: a failure leaves no entry.
            if self._on_abandon is not None:
                self._on_abandon()
            raise GraphCaptureError(f"first call of {self.key.summary()} failed: {exc}") from exc
        self.hits += 1
        return self._outputs


def _copy_outputs(static: Any, fresh: Any) -> None:
    """Copy an eager call's outputs into the static ones, as a replay would rewrite them."""
    want, got = named_outputs(static), named_outputs(fresh)
    if [n for n, _ in want] != [n for n, _ in got]:
        raise ValueError(f"outputs changed from {[n for n, _ in want]} to {[n for n, _ in got]}; "
                         "a captured graph's outputs are fixed")
    for (name, s), (_, t) in zip(want, got):
        if t.shape != s.shape or t.dtype != s.dtype:
            raise ValueError(f"{name} changed from {list(s.shape)} {s.dtype} to "
                             f"{list(t.shape)} {t.dtype}; a captured graph's outputs are fixed")
        if t.data_ptr() != s.data_ptr() or t.stride() != s.stride():
            s.copy_(t)
