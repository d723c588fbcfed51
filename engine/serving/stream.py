"""`Stream`: everything one client's stream is, in one record.

A stream is on the pool (``slot``: the runner's sequence holding its K/V, prompt and
history; the decoder's row of the same number holding its decoder state) or off it
(``parked``: a `StreamState` in host memory with all of that, and ``decoder``: its
decoder row's snapshot), or not started (neither: it starts at position 0 under
``prompt`` when it first takes a slot). Besides, the record alone keeps::

    chunks, frames     the next chunk's index and first rope frame (the runner keeps no
                       position for a scheduler's rows)
    seed               its noise: chunk i starts from chunk_noise(seed, i), and the
                       sampler's inputs are drawn from (seed, i) too (self_forcing
                       re-noises from chunk_renoise(seed, i)): no generator state
    prompt             the prompt in force (host; None: the runner's default) and its
                       ``prompt_version``; ``pending``: changes not yet taken, the last
                       one's prompt in ``pending_prompt``
    queue              chunks made and not yet acknowledged by its client, oldest first;
                       the first ``sent`` of them are on their way (handed to a socket);
                       ``acked`` the last index acknowledged
    video_frames       decoded frames so far
    state, paused, budget, error, end_reason, the scheduler's clocks

So a stream leaves a process as one `StreamState` (`state_files.stream_state`) and
comes back from one, anywhere a runner of the same model and pool takes it.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from ..stream_state import StreamState
from .records import PromptTooLate

__all__ = ["Stream"]


@dataclass(eq=False)
class Stream:
    """One stream (module doc). ``state``: "active", "done" (its chunk budget is spent),
    "failed" (``error`` says why) or "closed". ``waiting_since``: when it last became
    ready for a chunk (None while it is not). ``acked``: the last chunk index its client
    acknowledged (-1: none), every one before it acknowledged too; never past the last
    chunk made (a client's ``after`` beyond it is refused: `check_after`). ``sent``: how
    many queued chunks the current reader took; ``reader``: which connection reads its
    chunks (`rewind` makes a new one; those before it take none). ``last_stepped``: the
    scheduler's step count when it last made a chunk or took its slot (which resident
    stream gives its slot up first: the least recent); ``slot_since``: the step count
    when it took its slot (its swap quantum runs from it); ``entered``: the scheduler's
    count of slots taken when it took its slot (on a rotation the lowest, the earliest
    in, gives its slot up first); ``inflight``: chunks counted made whose frames are
    still being decoded (an overlapped step's, `Overlap`)."""

    id: str
    seed: int
    budget: int | None
    slot: int | None = None
    chunks: int = 0
    frames: int = 0
    video_frames: int = 0
    prompt: torch.Tensor | None = None
    prompt_version: int = 0
    pending: list = field(default_factory=list)
    pending_prompt: torch.Tensor | None = None
    parked: StreamState | None = None
    decoder: dict | None = None
    queue: collections.deque = field(default_factory=collections.deque)
    sent: int = 0
    reader: int = 0
    acked: int = -1
    paused: bool = False
    state: str = "active"
    error: str | None = None
    end_reason: str | None = None
    waiting_since: float | None = None
    last_stepped: int = 0
    slot_since: int = 0
    entered: int = 0
    inflight: int = 0

    @property
    def finished(self) -> bool:
        """No chunk will come any more (done, failed or closed)."""
        return self.state != "active"

    @property
    def started(self) -> bool:
        """Whether it has a stream to keep: on the pool, or parked with one."""
        return self.slot is not None or self.parked is not None

    def late_prompt(self) -> PromptTooLate | None:
        """The `PromptTooLate` a prompt change of this stream meets when no chunk would
        be made under it any more (it finished: its budget made, failed or closed);
        else None."""
        if not self.finished:
            return None
        if self.state == "done":
            return PromptTooLate(f"session {self.id[:64]!r} has made all {self.chunks} of "
                                 f"its chunks: a prompt change would apply from chunk "
                                 f"{self.chunks}, which will not come")
        return PromptTooLate(f"session {self.id[:64]!r} is {self.state}: no chunk will come "
                             "under a new prompt")

    @property
    def delivered(self) -> int:
        """Chunks its client acknowledged."""
        return self.acked + 1

    @property
    def held_bytes(self) -> int:
        """Host bytes it holds off the pool: its parked stream and decoder row."""
        n = 0 if self.parked is None else self.parked.nbytes
        if self.decoder is not None:
            n += sum(t.numel() * t.element_size() for t in self.decoder["cache"])
        return n

    def info(self) -> dict:
        """A JSON-able snapshot: id, state, paused, seed, chunks (made), delivered,
        waiting (made, not acknowledged), budget, prompt_version, error, resident
        (on the pool), ended (whether it left the scheduler) and end_reason."""
        return {"id": self.id, "state": self.state, "paused": self.paused, "seed": self.seed,
                "chunks": self.chunks, "delivered": self.delivered, "waiting": len(self.queue),
                "budget": self.budget, "prompt_version": self.prompt_version,
                "error": self.error, "resident": self.slot is not None,
                "ended": self.end_reason is not None, "end_reason": self.end_reason}
