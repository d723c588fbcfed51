"""GraphCache: capture a callable per key over static buffers, replay it, count the cost.

On a CUDA device a key's callable is warmed up with a few eager calls on a side stream
(as ``torch.cuda.make_graphed_callables`` does: lazy library initialisation, cuDNN plan
builds and kernel compilation must not happen inside a capture), then captured on that
stream into one memory pool shared by every graph of the cache, its memset nodes
turned into kernel nodes before it is instantiated (`framekv.graphs.rewrite`: memset
nodes make a launch's host cost grow several times faster with the node count), then
replayed. On CPU the same API calls the callable eagerly every time, so CPU code paths
are the same.

State effects, the contract callers must know:

* Warm-up calls run the callable (device and host effects, on CUDA and CPU alike).
  Either the callable is safe to run then, or pass ``warmup_fn`` (e.g. the same work
  over scratch state), or reset the state after capturing. A rollout captures all its
  keys before it starts, then resets (``cache.close(); cache.open(g)``).
* The capture call runs the callable's Python once: its host effects happen (a cache
  mirror advances), its device work does not.
* A replay runs no Python: host bookkeeping goes in ``after_replay`` (e.g. a cache's
  ``note_staged`` / ``commit_host``), called after every graph replay. An eager call
  (CPU) runs the callable's own Python, so no hook is called.
* Static outputs are rewritten by each replay and may share pool memory with other
  graphs' temporaries: read or copy them before replaying any other graph of the
  cache. Outputs written into the caller's own fixed buffers (an arena) stay put.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping

import msgspec
import torch

from .capture import end_failed_capture, instantiate, new_graph
from .captured import CapturedGraph, GraphCaptureError, static_copy
from .keys import GraphKey, TensorSpec, input_specs
from .warmup import WarmupReport, run_warmup


class KeyStats(msgspec.Struct, frozen=True):
    """Cost and use of one key's graph.

    Attributes:
        key: ``GraphKey.summary()``.
        hits: replays (eager calls on CPU).
        capture_seconds: warm-up plus capture wall time.
        allocated_bytes: growth of torch's allocated memory during capture (the static
            outputs and anything else the callable kept alive).
        reserved_bytes: growth of torch's reserved memory during capture: what the
            graph added to the shared pool (0 when it fit in memory freed by earlier
            graphs).
    """

    key: str
    hits: int
    capture_seconds: float
    allocated_bytes: int
    reserved_bytes: int


class GraphStats(msgspec.Struct, frozen=True):
    """Totals of a `GraphCache` (``per_key`` in capture order)."""

    device: str
    eager: bool
    graphs: int
    captures: int
    capture_failures: int
    hits: int
    capture_seconds: float
    allocated_bytes: int
    reserved_bytes: int
    per_key: tuple[KeyStats, ...]


class GraphCache:
    """Graphs by `GraphKey` on one device, in one shared memory pool.

    Args:
        device: "cpu" (eager) or a CUDA device.
        debug: check at every replay that each given input has the captured layout
            (ValueError naming it) and that no static buffer moved (RuntimeError).
            Shape and dtype of given inputs are checked always.
        warmup_iters: eager calls before each capture (default 2).

    Every graph is captured into the cache's one pool, its memset nodes turned into
    kernel nodes before instantiation; every replay is torch's ``CUDAGraph.replay``.
    """

    def __init__(self, device, *, debug: bool = False, warmup_iters: int = 2):
        from framekv.ops.device import resolve_device  # the one device check

        self.device = resolve_device(device)
        if isinstance(warmup_iters, bool) or not isinstance(warmup_iters, int) or warmup_iters < 0:
            raise ValueError(f"warmup_iters must be an integer >= 0, got {warmup_iters!r}")
        self.debug, self.warmup_iters = debug, warmup_iters
        self._entries: dict[GraphKey, CapturedGraph] = {}
        self._pool = None  # torch.cuda.graph_pool_handle(), made at the first capture
        self._side: torch.cuda.Stream | None = None
        self._captures = self._failures = 0
        self._dropped_hits = 0

    @property
    def eager(self) -> bool:
        """True where the callable runs eagerly instead of being captured (CPU)."""
        return self.device.type != "cuda"

    # ------------------------------------------------------------------ lookup
    def __contains__(self, key: GraphKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[GraphKey]:
        """Captured keys, in capture order."""
        return list(self._entries)

    def get(self, key: GraphKey) -> CapturedGraph | None:
        """The key's `CapturedGraph` handle, or None."""
        return self._entries.get(key)

    def _entry(self, key: GraphKey) -> CapturedGraph:
        entry = self._entries.get(key)
        if entry is None:
            what = key.summary() if isinstance(key, GraphKey) else repr(key)
            raise KeyError(f"no graph captured for {what}")
        return entry

    def get_static_inputs(self, key: GraphKey) -> Mapping[str, torch.Tensor]:
        """Read-only mapping of the key's static input buffers, to fill in place."""
        return self._entry(key).static_inputs

    def load(self, key: GraphKey, inputs: Mapping[str, torch.Tensor]) -> None:
        """Copy ``inputs`` into the key's static input buffers (as `replay` does),
        checking names, shapes and dtypes, without replaying."""
        self._entry(key).load(inputs)

    def get_static_outputs(self, key: GraphKey) -> Any:
        """The key's static outputs (None before the first call of an eager entry)."""
        return self._entry(key).static_outputs

    def drop(self, key: GraphKey) -> None:
        """Forget a key's graph (its pool memory stays for later captures)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._dropped_hits += entry.hits

    def clear(self) -> None:
        """Forget every graph."""
        for key in list(self._entries):
            self.drop(key)

    # ------------------------------------------------------------------ capture
    def capture(self, key: GraphKey, fn: Callable[..., Any], inputs: Mapping[str, torch.Tensor],
                *, after_replay: Callable[[], None] | None = None, warmup: int | None = None,
                warmup_fn: Callable[..., Any] | None = None) -> CapturedGraph:
        """Warm up and capture ``outputs = fn(**static_inputs)`` for ``key``.

        Args:
            key: must describe ``inputs`` (same names and layouts) and be new.
            fn: called with the static input buffers as keyword arguments; returns
                None, a tensor, or a tuple/list/dict of tensors (the static outputs).
            inputs: initial values; the static buffers are fresh copies of them.
            after_replay: host hook called after every graph replay.
            warmup: eager calls before capture (default ``warmup_iters``).
            warmup_fn: called for warm-up instead of ``fn`` (same arguments).
        Returns the `CapturedGraph` handle. On failure raises `GraphCaptureError`
        (cause attached) and keeps no entry; torch is left out of capture mode.
        """
        if key in self._entries:
            raise ValueError(f"already captured: {key.summary()}")
        static = self._static_inputs(key, inputs)
        entry = CapturedGraph(key, fn, static, after_replay=after_replay, debug=self.debug,
                              on_abandon=lambda: self._abandon(key))
        iters = self.warmup_iters if warmup is None else warmup
        start = time.perf_counter()
        try:
            self._warm_up(key, warmup_fn or fn, static, iters)
            if not self.eager:
                self._record(entry, fn)
        except GraphCaptureError:
            self._failures += 1
            raise
        entry.capture_seconds = time.perf_counter() - start
        self._entries[key] = entry
        self._captures += 1
        return entry

    def _static_inputs(self, key: GraphKey, inputs) -> dict[str, torch.Tensor]:
        """Fresh fixed-address copies of ``inputs`` after checking them against the key."""
        if not isinstance(key, GraphKey):
            raise ValueError(f"key must be a GraphKey, got {type(key).__name__}")
        specs = input_specs(inputs)
        if specs != key.inputs:
            raise ValueError(_describe_mismatch(key.inputs, specs))
        for spec in specs:
            if torch.device(spec.device) != self.device:
                raise ValueError(f"input {spec.name!r} is on {spec.device}, "
                                 f"the cache on {self.device}")
        return {name: static_copy(t) for name, t in inputs.items()}

    def _warm_up(self, key: GraphKey, fn, static, iters: int) -> None:
        side = None if self.eager else self._side_stream()
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(self.device))
        for i in range(iters):
            try:
                if side is None:
                    fn(**static)
                else:
                    with torch.cuda.stream(side):
                        fn(**static)
            except Exception as exc:
                raise GraphCaptureError(f"warm-up call {i + 1} of {key.summary()} failed: "
                                        f"{exc}") from exc
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)

    def _record(self, entry: CapturedGraph, fn) -> None:
        """Capture on the side stream into the pool; measure the memory it takes."""
        dev = self.device
        torch.cuda.synchronize(dev)
        alloc0, reserved0 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
        graph = new_graph()
        side = self._side_stream()
        side.wait_stream(torch.cuda.current_stream(dev))
        pool = self._pool_handle()
        with torch.cuda.device(dev), torch.cuda.stream(side):
            graph.capture_begin(pool=pool)
            try:
                outputs = fn(**entry.static_inputs)
                graph.capture_end()
            except BaseException as exc:
                self._abandon_capture(graph, pool)
                graph = None
                raise GraphCaptureError(f"capture of {entry.key.summary()} failed: {exc}") from exc
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        entry.memsets_replaced = instantiate(graph, rewrite=True, device_index=dev.index)
        try:
            entry.set_captured(graph, outputs, dev)
        except ValueError as exc:
            raise GraphCaptureError(f"capture of {entry.key.summary()}: {exc}") from exc
        entry.allocated_bytes = torch.cuda.memory_allocated(dev) - alloc0
        entry.reserved_bytes = torch.cuda.memory_reserved(dev) - reserved0

    def _pool_handle(self):
        """The shared pool to capture into (an explicit id, so that a failed capture's
        pool can be named in the cleanup)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        return self._side

    def _abandon_capture(self, graph: torch.cuda.CUDAGraph, pool) -> None:
        """Leave capture mode after a failure inside it and retire the pool id.

        torch leaves its allocator tied to a pool whose capture failed (the next
        capture into it fails with "already recording to mempool_id"), so later
        captures go to a fresh shared pool; graphs already captured keep theirs.
        """
        end_failed_capture(graph, self.device, pool)
        self._pool = None

    def _abandon(self, key: GraphKey) -> None:
        """An eager entry's first call failed: forget it, as a failed capture would be."""
        if self._entries.pop(key, None) is not None:
            self._captures -= 1
        self._failures += 1

    # ------------------------------------------------------------------ replay
    def replay(self, key: GraphKey, inputs: Mapping[str, torch.Tensor] | None = None, *,
               after_replay: Callable[[], None] | None = None) -> Any:
        """Replay ``key``'s graph (see `CapturedGraph.replay`); KeyError if not captured."""
        return self._entry(key).replay(inputs, after_replay=after_replay)

    def run(self, key: GraphKey, fn: Callable[..., Any], inputs: Mapping[str, torch.Tensor], *,
            after_replay: Callable[[], None] | None = None, warmup: int | None = None,
            warmup_fn: Callable[..., Any] | None = None) -> Any:
        """Capture ``key`` if it is new (warm-up effects included), then replay it."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self.capture(key, fn, inputs, after_replay=after_replay, warmup=warmup,
                                 warmup_fn=warmup_fn)
            return entry.replay()  # the static inputs already hold ``inputs``
        return entry.replay(inputs, after_replay=after_replay)

    # ------------------------------------------------------------------ warm-up, stats
    def warmup(self, requests: Iterable, builder: Callable | None = None, *,
               progress: bool = True, stream=None) -> WarmupReport:
        """Capture every `CaptureRequest` (or item ``builder`` turns into one) up front,
        with a progress bar and a report; see `run_warmup`."""
        return run_warmup(self, requests, builder, progress=progress, stream=stream)

    def stats(self) -> GraphStats:
        """Counts, capture time and memory, per key and in total."""
        per_key = tuple(KeyStats(e.key.summary(), e.hits, e.capture_seconds, e.allocated_bytes,
                                 e.reserved_bytes) for e in self._entries.values())
        return GraphStats(
            device=str(self.device), eager=self.eager, graphs=len(self._entries),
            captures=self._captures, capture_failures=self._failures,
            hits=self._dropped_hits + sum(k.hits for k in per_key),
            capture_seconds=sum(k.capture_seconds for k in per_key),
            allocated_bytes=sum(k.allocated_bytes for k in per_key),
            reserved_bytes=sum(k.reserved_bytes for k in per_key), per_key=per_key)


def _describe_mismatch(want: tuple[TensorSpec, ...], got: tuple[TensorSpec, ...]) -> str:
    """Which input differs between a key and the tensors given with it."""
    w, g = {s.name: s for s in want}, {s.name: s for s in got}
    if w.keys() != g.keys():
        return (f"inputs {sorted(g)} do not match the key's inputs {sorted(w)} "
                f"(missing {sorted(w.keys() - g.keys())}, "
                f"unexpected {sorted(g.keys() - w.keys())})")
    for name in sorted(w):
        if w[name] != g[name]:
            return (f"input {name!r} is {g[name].summary()} (strides {list(g[name].stride)}), the "
                    f"key says {w[name].summary()} (strides {list(w[name].stride)})")
    return "inputs do not match the key"
