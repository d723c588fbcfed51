"""Which streams a step of `StreamScheduler` runs (`Turns`), and when a stream is ready.

A step runs every ready stream on the pool, and ready streams off it (the longest
waiting first) in the slots that are free or held by streams not ready, so no row runs
scratch while a ready stream waits for a slot. A ready stream on the pool gives its slot
up only at a turn boundary, ``swap_quantum`` steps or more after the last rotation, and
only once it held the slot ``swap_quantum`` steps: at a boundary as many of those as
there are streams waiting (at most S) leave, the first in first, in one step (its swaps
in one plan); the rest stay until a later boundary. So N > S ready streams rotate in
groups, a full batch every step, and share the chunks alike (round robin: the first to
leave comes back first; over any window each stream's count is within a quantum's worth
of the others').

A stream is ready while it is active, not paused, has budget left and fewer than
``queue_chunks`` chunks unacknowledged (chunks in flight, an overlapped step's, count
as queued and as made) and, for a video stream, its next chunk's input frames in
(`VideoIn`: it never runs ahead of its input); each ready stream's clock runs from when it turned ready.
"""
from __future__ import annotations

import math
import time

from .stream import Phase, Stream


def _waited(s: Stream) -> tuple:
    """How long ``s`` has waited for its next chunk, as a sort key: longest first (of
    those that left the pool together, the first to leave)."""
    return (math.inf if s.waiting_since is None else s.waiting_since, s.entered)


class Turns:
    """The turns of `StreamScheduler` (module doc); its attributes are the scheduler's
    (``sessions``, ``slots``, ``pool``, ``queue_chunks``, ``swap_quantum``, the step
    count); it calls nothing of the scheduler's besides."""

    def _is_ready(self, s: Stream) -> bool:
        # chunks in flight (an overlapped step's) count as queued and as made
        return (s.state == Phase.ACTIVE and not s.paused
                and len(s.delivery.queue) + s.inflight < self.queue_chunks
                and (s.budget is None or s.chunks < s.budget)
                and (s.intake is None or s.intake.ready()))  # a video stream: its input in

    def _ready(self) -> list[Stream]:
        """The streams of the next step (at most S; none while held): the ready ones on
        the pool, and ready ones off it (longest waiting first) as many as there are
        slots free, slots of streams not ready, and at a turn boundary slots of streams
        whose quantum ran (`_rotating`), less those the rotation takes."""
        if self._held:
            return []
        ready = [s for s in self.sessions.values() if self._is_ready(s)]
        on = sorted((s for s in ready if s.slot is not None), key=lambda s: s.entered)
        off = sorted((s for s in ready if s.slot is None), key=_waited)
        idle = self.slots - len(on)        # slots free or held by streams not ready
        if len(off) <= idle:
            return on + off
        leaving = {s.id for s in self._rotating(on)[:len(off) - idle]}
        staying = [s for s in on if s.id not in leaving]
        return staying + off[:self.slots - len(staying)]

    def _rotating(self, on: list[Stream]) -> list[Stream]:
        """The ready streams on the pool that give their slots up to waiting ones, in
        that order: at a turn boundary (``swap_quantum`` steps since the last rotation),
        those whose own quantum ran, longest on the pool first; else none."""
        steps = self._counts["steps"]
        if steps - self.pool.turn < self.swap_quantum:
            return []
        ran = [s for s in on if steps - s.slot_since >= self.swap_quantum]
        return sorted(ran, key=lambda s: s.entered)

    def _mark_waiting(self, s: Stream) -> None:
        """Start (or stop) the clock of a stream's next chunk as it turns ready (or not)."""
        if not self._is_ready(s):
            s.waiting_since = None
        elif s.waiting_since is None:
            s.waiting_since = time.monotonic()
