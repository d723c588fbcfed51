"""The slots of a pool (host bookkeeping only): which are free, which resident stream
gives its slot up for a waiting one (`pick_victim`), the turns (when the last rotation
was, how many slots were taken) and the swap counters.

A scheduler with S slots and N >= S streams plans each step's swaps here; the runner
runs them (`framekv.engine.step`). A swap out copies the stream's K/V, prompt and
history to host memory (`ChunkRunner.snapshot`) and its decoder row; a swap in
restores them (no capture). A slot freed by a stream that ended is started over by the
next stream that takes it (nothing of the old stream is read again).
"""
from __future__ import annotations

from .records import SWAP_BUCKETS, Histogram
from .stream import Stream

__all__ = ["SlotPool", "pick_victim"]


def pick_victim(streams, keep, is_ready) -> Stream | None:
    """The resident stream (``slot`` not None, id not in ``keep``) that gives its slot
    up: one that is not ready (``is_ready(s)`` False: paused, queue full, finished)
    before one that is, then the least recently stepped (``last_stepped``), then the
    first in ``streams``' order; None when every resident one is kept."""
    candidates = [s for s in streams if s.slot is not None and s.id not in keep]
    return min(candidates, key=lambda s: (bool(is_ready(s)), s.last_stepped), default=None)


class SlotPool:
    """S slots (the runner's sequences 0 .. S-1) and the swap counters.

    Attributes:
        free: the free slots, taken first to last.
        counts: swap_outs, swap_ins, swap_bytes (host bytes moved, both ways),
            failed_swaps, rotations (steps whose ready streams gave their slots up).
        seconds: a `Histogram` of each step's swap seconds (`SWAP_BUCKETS`).
        turn: the step count of the last rotation.
        entries: slots taken so far (`Stream.entered`: the last taken's number).
    """

    def __init__(self, slots: int):
        self.free: list[int] = list(range(slots))
        self.counts = {"swap_outs": 0, "swap_ins": 0, "swap_bytes": 0, "failed_swaps": 0,
                       "rotations": 0}
        self.seconds = Histogram(SWAP_BUCKETS)
        self.turn = self.entries = 0

    def take(self) -> int | None:
        """A free slot, or None."""
        return self.free.pop(0) if self.free else None

    def rotated(self, steps: int) -> None:
        """Ready streams gave their slots up at step ``steps``: a rotation (one a step),
        the next one a turn from it."""
        self.counts["rotations"] += self.turn != steps
        self.turn = steps

    def give(self, slot: int) -> None:
        """Free ``slot`` (its next stream starts it over or restores into it)."""
        if slot not in self.free:
            self.free.append(slot)

    def count(self, kind: str, nbytes: int) -> None:
        """One swap of ``kind`` ("swap_outs", "swap_ins") of ``nbytes`` host bytes."""
        self.counts[kind] += 1
        self.counts["swap_bytes"] += nbytes
