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
    delivery           its chunks on their way to its client, whatever carries them
                       (`Delivery`: the unacknowledged ones, the reader, the last index
                       acknowledged)
    video_frames       decoded frames so far
    intake             a video stream's incoming frames (`Intake`: its input cursor,
                       what waits, what was dropped); None for a text stream. Its
                       encoder row's snapshot is ``encoder`` while it is off the pool
    state (a `Phase`), paused, budget, error, end_reason, the scheduler's clocks

So a stream leaves a process as one `StreamState` (`state_files.stream_state`) and
comes back from one, anywhere a runner of the same model and pool takes it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..stream_state import StreamState
from .records import PromptTooLate
from .delivery import Delivery
from .intake import Intake

__all__ = ["Phase", "Stream"]


class Phase(enum.StrEnum):
    """Where a stream is in its life: ACTIVE (chunks come), DONE (its chunk budget is
    spent), FAILED (its ``error`` says why) or CLOSED (ended before either). A string
    enum: each member equals, prints and serializes as its lower-case name."""

    ACTIVE = "active"
    DONE = "done"
    FAILED = "failed"
    CLOSED = "closed"


@dataclass(eq=False)
class Stream:
    """One stream (module doc). ``state``: its `Phase` (a string of one given is taken
    as its member). ``waiting_since``: when it last became ready for a chunk (None
    while it is not). ``delivery``: its `Delivery`. ``last_stepped``: the
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
    delivery: Delivery = field(default_factory=Delivery)
    intake: Intake | None = None
    encoder: dict | None = None
    paused: bool = False
    state: Phase = Phase.ACTIVE
    error: str | None = None
    end_reason: str | None = None
    waiting_since: float | None = None
    last_stepped: int = 0
    slot_since: int = 0
    entered: int = 0
    inflight: int = 0

    def __post_init__(self):
        self.state = Phase(self.state)

    @property
    def finished(self) -> bool:
        """No chunk will come any more (done, failed or closed)."""
        return self.state != Phase.ACTIVE

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
        if self.state == Phase.DONE:
            return PromptTooLate(f"session {self.id[:64]!r} has made all {self.chunks} of "
                                 f"its chunks: a prompt change would apply from chunk "
                                 f"{self.chunks}, which will not come")
        return PromptTooLate(f"session {self.id[:64]!r} is {self.state}: no chunk will come "
                             "under a new prompt")

    @property
    def held_bytes(self) -> int:
        """Host bytes it holds off the pool: its parked stream, decoder and encoder
        rows, and the input frames waiting."""
        n = 0 if self.parked is None else self.parked.nbytes
        for row in (self.decoder, self.encoder):
            if row is not None:
                n += sum(t.numel() * t.element_size() for t in row["cache"])
        if self.intake is not None:
            n += sum(f.numel() * f.element_size() for f in self.intake.frames)
        return n

    def info(self) -> dict:
        """A JSON-able snapshot: id, state, paused, seed, chunks (made), delivered,
        waiting (made, not acknowledged), budget, prompt_version, error, resident
        (on the pool), ended (whether it left the scheduler) and end_reason; input
        ("text" or "video") and for a video stream its `Intake.info` fields."""
        video = {} if self.intake is None else self.intake.info()
        return {"input": "text" if self.intake is None else "video", **video,
                "id": self.id, "state": self.state.value, "paused": self.paused,
                "seed": self.seed, "chunks": self.chunks,
                "delivered": self.delivery.delivered, "waiting": len(self.delivery.queue),
                "budget": self.budget, "prompt_version": self.prompt_version,
                "error": self.error, "resident": self.slot is not None,
                "ended": self.end_reason is not None, "end_reason": self.end_reason}
