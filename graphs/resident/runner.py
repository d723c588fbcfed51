"""A captured graph kept resident on the device: a run is one host store, no launch.

After the host has waited (for a chunk, for a request), its next CUDA launch costs
several times what a launch issued right behind another one costs, whatever it launches
(docs/benchmarks.md, "Launches after a wait"). A `ResidentGraph` takes the launch out of
the loop. A small parent graph is launched once; it loops on the device, and each turn a
one-thread gate kernel polls a doorbell in mapped pinned host memory (the control block
of `framekv.graphs.resident.protocol`) and, when the host rang it, runs the captured
graph as a child graph and counts it done::

    parent graph (launched once, on its own non-blocking stream)
    WHILE loop != 0:
        gate            waits for RING > SERVED (run: SERVED += 1), STOP, or idle time
        IF run != 0:
            chunk       the captured graph, as a child graph node
            done        DONE = SERVED

`ResidentGraph.submit` stores RING = n + 1 (and runs the host hook a replay would
run): no driver call. After ``idle_timeout_s`` without a ring the gate leaves the loop
and the parent graph ends, so that a device-wide synchronize does not hang forever and
an idle server does not keep an SM polling; the next submit launches the parent again
(one launch, paid only after an idle spell). The gate re-reads RING after announcing
that it leaves (STATE = EXITING), and `wait` / `done` relaunch if the gate left with a
ring unseen, so no submitted run is lost to that race.

Contract: a run reads the captured graph's static inputs when the gate serves it, on
a stream of its own. Whatever it reads must be on the device before `submit` (written
by earlier runs, or by work the host has waited for); read its outputs after `wait`.
Other graphs of the same memory pool must not run while runs are in flight, and while
the runner is open the entry's own replays raise RuntimeError (the runner holds the
entry's launcher slot, `CapturedGraph.launcher`). `framekv.graphs.resident.device`
builds the device side; on CPU (an eager entry) a submit calls the entry eagerly.

While the loop polls, a CUDA call that waits for the whole device returns only once
the gate has left on its idle limit: ``torch.cuda.synchronize()``, a cudaFree
(``torch.cuda.empty_cache``) and, under CUDA's lazy module loading (torch's default),
the first launch of a kernel not loaded yet (``python -m framekv.bench.resident_waits``
times each; docs/benchmarks.md). Wait on a stream, not the device, and run host-side
work once before going resident so that its kernels are loaded.
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np

from .protocol import (DONE, EXITED, EXITING, NOT_LAUNCHED, RING, RUNNING, SERVED, STATE,
                       STATE_NAMES, STOP, WORDS, ResidentLoop)

__all__ = ["ResidentGraph"]

#: Longest a submit waits for a leaving gate to decide (it decides within microseconds).
_DECIDE_S = 1.0
#: `wait` spins for the first millisecond, then sleeps this long between looks (what
#: follows a wait is a submit, a store, not a driver call).
_SPIN_S, _NAP_S = 1e-3, 2e-5


def _halt(cb: np.ndarray, loop: ResidentLoop) -> None:
    """Stop the loop (the gate leaves at its next look) and wait until it has ended."""
    cb[STOP] = 1
    if int(cb[STATE]) != NOT_LAUNCHED:
        loop.synchronize()


def _stop(loop: ResidentLoop, cb: np.ndarray, entry, guard: "_ReplayGuard") -> None:
    """`_halt`, then free the loop and give replays back (a runner collected without
    `close`)."""
    _halt(cb, loop)
    loop.release()
    guard.lift(entry)


class _ReplayGuard:
    """The entry's launcher (`CapturedGraph.launcher`) while a `ResidentGraph` of it is
    open: a replay would race the resident runs over the same buffers. Lifted, it puts
    back the launcher it replaced; if another one was installed on top of it meanwhile,
    it stays beneath that one and passes replays through."""

    def __init__(self, entry):
        self.previous, self.open = entry.launcher, True
        entry.launcher = self

    def __call__(self, entry) -> None:
        if self.open:
            raise RuntimeError(f"{entry.key.summary()} runs resident: submit through its "
                               "ResidentGraph, or close it before replaying")
        if self.previous is None:
            entry.graph.replay()
        else:
            self.previous(entry)

    def lift(self, entry) -> None:
        self.open = False
        if entry.launcher is self:
            entry.launcher = self.previous


class ResidentGraph:
    """Runs of a captured graph submitted by a host store to a loop kept on the device.

    One thread at a time may submit, wait or close (the sequence numbers are the
    host's own counter); any thread may, CUDA context or not.

    Args:
        entry: the `CapturedGraph` to run (`GraphCache.resident` builds this).
        idle_timeout_s: how long the gate polls without a ring before the loop ends
            (the next submit then pays one launch).
        loop: the device side; default: `device.DeviceLoop` for a captured graph,
            none (eager submits) for an eager entry.
    Raises:
        ValueError: a bad ``idle_timeout_s``, a CUDA entry without its graph, or one
            known to draw random numbers (``entry.draws_random``: a resident run repeats
            them, nothing advances the generator). `GraphCache.capture` learns it from
            the warm-up calls; None (unknown) is not refused.
    """

    def __init__(self, entry, *, idle_timeout_s: float = 0.05, loop: ResidentLoop | None = None):
        if isinstance(idle_timeout_s, bool) or not isinstance(idle_timeout_s, (int, float)) \
                or not 0 < idle_timeout_s <= 60:
            raise ValueError(f"idle_timeout_s must be a number in (0, 60] seconds, "
                             f"got {idle_timeout_s!r}")
        if entry.draws_random:
            raise ValueError(f"{entry.key.summary()} draws random numbers: a resident run "
                             "has no replay prologue to advance the generator, so every run "
                             "would repeat the same numbers; replay it instead")
        self.entry, self.idle_timeout_s = entry, float(idle_timeout_s)
        if loop is None and entry.graph is not None:
            from .device import DeviceLoop

            loop = DeviceLoop(entry, idle_timeout_s=self.idle_timeout_s)
        self._loop = loop
        self._cb = loop.control if loop is not None else np.zeros(WORDS, dtype=np.uint64)
        self.submitted = 0
        self.launches = 0  # parent launches: the first, and one after each idle exit
        self.closed = False
        self._guard = _ReplayGuard(entry)
        # A runner dropped without close() still stops its loop before freeing the
        # control block the loop reads (at collection, or at interpreter exit).
        self._finalizer = (weakref.finalize(self, _stop, loop, self._cb, entry, self._guard)
                           if loop is not None else None)

    # ------------------------------------------------------------------ state
    @property
    def eager(self) -> bool:
        """True where submits run the entry eagerly (no device loop)."""
        return self._loop is None

    @property
    def completed(self) -> int:
        """Runs finished so far (the device's DONE counter)."""
        return int(self._cb[DONE])

    @property
    def state(self) -> str:
        """The gate's state: not launched, running, exiting, exited."""
        return STATE_NAMES[int(self._cb[STATE])]

    def counters(self) -> str:
        """The protocol's counters in words (for errors and logs)."""
        cb = self._cb
        return (f"submitted {self.submitted}, served {int(cb[SERVED])}, done {int(cb[DONE])}, "
                f"gate {self.state}")

    # ------------------------------------------------------------------ runs
    def submit(self) -> int:
        """Ring for one more run; returns its sequence number (1, 2, ...).

        One store to the control block, a launch only when the loop is not running,
        then the entry's host hook (what a replay runs after its launch).
        """
        self._check_open()
        seq = self.submitted + 1
        if self._loop is None:
            self.entry.replay()
            self.submitted = self._cb[SERVED] = self._cb[DONE] = seq
            return seq
        self._cb[RING] = seq
        self.submitted = seq
        self._ensure_running()
        self.entry.hits += 1
        if self.entry.after_replay is not None:
            self.entry.after_replay()
        return seq

    def done(self, seq: int | None = None) -> bool:
        """Whether run ``seq`` (default: the last submitted) has finished; never blocks."""
        seq = self._seq(seq)
        if int(self._cb[DONE]) >= seq:
            return True
        self._recover()
        return False

    def wait(self, seq: int | None = None, timeout_s: float = 10.0) -> Any:
        """Block until run ``seq`` (default: the last submitted) finished; returns the
        entry's static outputs (rewritten by later runs).

        Raises:
            TimeoutError: not done after ``timeout_s``, naming the counters.
        """
        seq = self._seq(seq)
        start = time.perf_counter()
        deadline = start + timeout_s
        while int(self._cb[DONE]) < seq:
            self._recover()
            now = time.perf_counter()
            if now - start > _SPIN_S:  # a long run: poll gently, the CPU is not needed
                time.sleep(_NAP_S)
            if now > deadline:
                raise TimeoutError(f"run {seq} not done after {timeout_s} s: {self.counters()}")
        return self.entry.static_outputs

    def close(self, timeout_s: float = 10.0) -> None:
        """Let submitted runs finish, stop the loop, free the device side. Idempotent."""
        if self.closed:
            return
        try:
            if self.submitted and self._loop is not None:
                self.wait(self.submitted, timeout_s)
        finally:
            self.closed = True
            if self._finalizer is not None and self._finalizer.detach() is not None:
                _halt(self._cb, self._loop)
                self._cb = self._cb.copy()  # the last counters outlive the mapped block
                self._loop.release()
            self._guard.lift(self.entry)  # replays may run again: the loop has ended

    def __enter__(self) -> "ResidentGraph":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _ensure_running(self) -> None:
        """Launch the loop if the gate is not there to see the ring just stored."""
        cb = self._cb
        if int(cb[STATE]) == EXITING:
            # The gate re-reads RING before it leaves: wait for its decision.
            deadline = time.perf_counter() + _DECIDE_S
            while int(cb[STATE]) == EXITING:
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the resident gate did not finish leaving in "
                                       f"{_DECIDE_S} s: {self.counters()}")
        if int(cb[STATE]) in (NOT_LAUNCHED, EXITED) and int(cb[SERVED]) < self.submitted:
            self._launch()

    def _recover(self) -> None:
        """Relaunch if the gate left with runs submitted and not served (a ring that
        landed while it was leaving, unseen by its last look)."""
        cb = self._cb
        if int(cb[STATE]) == EXITED and int(cb[SERVED]) < self.submitted and not self.closed:
            self._launch()

    def _launch(self) -> None:
        # Marked before the launch, so that no other submit launches a second loop; the
        # gate keeps it (a stale EXITED is never left for this loop's submits to see).
        self._cb[STATE] = RUNNING
        self._loop.launch()
        self.launches += 1

    def _seq(self, seq: int | None) -> int:
        if seq is None:
            seq = self.submitted
        if isinstance(seq, bool) or not isinstance(seq, (int, np.integer)) \
                or not 0 <= seq <= self.submitted:
            raise ValueError(f"seq must be a submitted run in [0, {self.submitted}], got {seq!r}")
        return int(seq)

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError(f"this ResidentGraph of {self.entry.key.summary()} is closed")
