"""Sessions off the pool: a `StreamScheduler` with fewer slots than sessions.

The pool holds S slots (sequences of the runner); up to N >= S sessions are open. A
session without a slot is *parked*: its stream waits in host memory (`Parked`) and
takes a slot again before its next chunk. `SlotPool` keeps the free slots, the parked
streams and the swap counters; `pick_victim` says which resident session gives its
slot up::

    swap out   ChunkRunner.snapshot(slot) (waited for: the slot is reused next), the
               decoder row's StreamingVAEDecoder.snapshot, then the row started over
               (prefill_rows: nothing of the stream stays in the pool), the slot freed
    swap in    ChunkRunner.restore(slot, state) and the decoder row's restore, then the
               prompt change made while it was parked (a rewrite, as on a resident
               session); a session parked before its first chunk starts the slot under
               its prompt instead (no stream to restore)

Neither captures a graph. A finished session (done, failed) gives its slot up with no
snapshot: it makes no chunk any more. A swap that raises is raised again with the slot
freed and nothing parked for that session; the scheduler fails that session alone.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from .sessions import Histogram, Session
from .stream_state import StreamState

__all__ = ["Parked", "SWAP_BUCKETS", "SlotPool", "pick_victim"]
log = logging.getLogger("framekv.scheduler")

#: upper bounds (seconds) of the swap histogram of `StreamScheduler.metrics`
SWAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(eq=False)
class Parked:
    """A session's stream off the pool.

    ``stream``: its `StreamState`, or None for a session that has made no chunk (it
    starts at position 0). ``decoder``: its decoder row (`StreamingVAEDecoder.snapshot`)
    or None. ``prompt``: None, or the prompt in force from its next chunk: the one it
    starts under (no stream), or a prompt change made while it was parked.
    """

    stream: StreamState | None
    decoder: dict | None = None
    prompt: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Host bytes held: the stream's, the decoder row's and the prompt's."""
        tensors = [] if self.decoder is None else list(self.decoder["cache"])
        tensors += [] if self.prompt is None else [self.prompt]
        stream = 0 if self.stream is None else self.stream.nbytes
        return stream + sum(t.numel() * t.element_size() for t in tensors)


def pick_victim(sessions, keep, is_ready) -> Session | None:
    """The resident session (``sequence`` not None, id not in ``keep``) that gives its
    slot up: one that is not ready (``is_ready(s)`` False: paused, queue full, finished)
    before one that is, then the least recently stepped (``last_stepped``), then the
    first in ``sessions``' order; None when every resident one is kept."""
    candidates = [s for s in sessions if s.sequence is not None and s.id not in keep]
    return min(candidates, key=lambda s: (bool(is_ready(s)), s.last_stepped), default=None)


class SlotPool:
    """The slots of a runner's pool and the streams parked off it (module doc).

    Args:
        runner: the `ChunkRunner` whose sequences [0, slots) are the slots.
        decoder: None, or the streaming decoder whose row r is slot r's video.
        slots: S.

    Attributes:
        free: the free slots, taken first to last; parked: session id -> `Parked`;
        counts: swap_outs, swap_ins, swap_bytes (host bytes moved, both ways),
        failed_swaps; seconds: a `Histogram` of each swap's seconds (`SWAP_BUCKETS`).
    """

    def __init__(self, runner, decoder, slots: int):
        self.runner, self.decoder = runner, decoder
        self.free: list[int] = list(range(slots))
        self.parked: dict[str, Parked] = {}
        self.counts = {"swap_outs": 0, "swap_ins": 0, "swap_bytes": 0, "failed_swaps": 0}
        self.seconds = Histogram(SWAP_BUCKETS)

    @property
    def parked_bytes(self) -> int:
        """Host bytes the parked streams hold."""
        return sum(p.nbytes for p in self.parked.values())

    def park_start(self, session_id: str, prompt: torch.Tensor | None) -> None:
        """Park a new session with no stream yet: its swap in starts a slot under
        ``prompt`` (None: the runner's default)."""
        self.parked[session_id] = Parked(None, prompt=prompt)

    def place(self, batch, sessions, is_ready, step: int) -> list[Session]:
        """``batch`` (sessions to step) with a slot each: one without a slot takes a
        free one, else the slot of a resident session of ``sessions`` outside the batch
        (`pick_victim` with ``is_ready``), swapped out; one swapped in gets
        ``last_stepped`` = ``step``. A session whose swap raises fails (`_try`) and is
        left out; so is one for which every slot is held by the batch (it waits)."""
        keep, placed = {s.id for s in batch}, []
        for s in batch:
            if s.sequence is None:
                if not self.free:
                    victim = pick_victim(sessions, keep, is_ready)
                    if victim is None:
                        continue
                    self._try(self.swap_out, victim)      # its slot is freed either way
                if not self._try(self.swap_in, s, self.free.pop(0)):
                    continue
                s.last_stepped = s.slot_since = step
            placed.append(s)
        return placed

    def _try(self, swap, s: Session, *args) -> bool:
        """``swap(s, *args)``: True, or, if it raises, ``s`` failed (state "failed",
        ``error`` saying which swap and why, logged, counted) and False."""
        try:
            swap(s, *args)
            return True
        except Exception as exc:
            self.counts["failed_swaps"] += 1
            which = "out" if swap == self.swap_out else "in"
            s.state, s.waiting_since = "failed", None
            s.error = f"swapping the session {which} failed: {type(exc).__name__}: {exc}"
            log.warning("session %s: %s", s.id, s.error)
            return False

    def capture(self, s: Session) -> Parked | None:
        """What a swap out of ``s`` would park, ``s`` left where it is: its parked
        stream, a snapshot of its slot (waited for), or None for a finished session
        (nothing to keep)."""
        if s.finished:
            return None
        if s.sequence is None:
            return self.parked.get(s.id)
        stream = self.runner.snapshot(s.sequence)
        stream.synchronize()
        decoder = None if self.decoder is None else self.decoder.snapshot(s.sequence)
        return Parked(stream, decoder)

    def swap_out(self, s: Session) -> None:
        """Park ``s``'s stream (`capture`) and free its slot (the row started over);
        the slot is freed and ``s`` left without one even when the snapshot raises,
        which is raised again."""
        t0, seq = time.perf_counter(), s.sequence
        try:
            parked = self.capture(s)
            if parked is not None:
                self.parked[s.id] = parked
                self._count("swap_outs", parked.nbytes, t0)
        finally:
            s.sequence = None
            self.release(seq)

    def swap_in(self, s: Session, slot: int) -> None:
        """Put parked ``s`` into free ``slot`` (module doc). If that raises, the slot
        is freed again, nothing stays parked for ``s`` and the error is raised again."""
        t0, parked = time.perf_counter(), self.parked.pop(s.id)
        try:
            if parked.stream is None:
                self.runner.prefill_rows([slot], parked.prompt)
                if self.decoder is not None:
                    self.decoder.reset(rows=[slot])
            else:
                self.runner.restore(slot, parked.stream)
                if self.decoder is not None:
                    self.decoder.restore(slot, parked.decoder)
                if parked.prompt is not None:
                    self.runner.prefill_rows([slot], parked.prompt, rewrite=True)
        except BaseException:
            self.release(slot)
            raise
        s.sequence = slot
        if parked.stream is not None:
            self._count("swap_ins", parked.nbytes, t0)

    def release(self, slot: int) -> None:
        """Start ``slot``'s row over (none of its stream stays in the pool) and free
        it. A start-over that raises is logged and the slot freed anyway: whoever takes
        it next starts it over (`prefill_rows`) or restores into it, which resets it."""
        try:
            self.runner.prefill_rows([slot])
        except Exception:
            log.exception("starting slot %d over as it was freed raised; its next user "
                          "resets it", slot)
        self.free.append(slot)

    def _count(self, kind: str, nbytes: int, t0: float) -> None:
        self.counts[kind] += 1
        self.counts["swap_bytes"] += nbytes
        self.seconds.observe(time.perf_counter() - t0)
