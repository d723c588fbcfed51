"""A streaming session's records (`framekv.engine.scheduler`): `Session`, a client's
stream on one sequence of the pool (or off it, swapped out), and `SessionChunk`, one
chunk it was given; what a prompt change answers (`PromptChange`); the bounded record
of ended sessions (`EndedSessions`); the batch sizes a scheduler captures by default
(`default_batch_sizes`); the `Histogram` its step, chunk and swap latencies are counted
in; decoded frames as the uint8 a chunk carries (`video_uint8`)."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

#: upper bounds (seconds) of the step and chunk latency histograms of
#: `StreamScheduler.metrics`
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class SessionChunk:
    """One finished chunk of a session: index, first latent frame, latents fp32
    [C, F, H, W] (host), seconds of the batched step that made it (decode included), its
    batch size, the session's prompt changes then, its latent frames; with a decoder
    ``video`` uint8 [F', H, W, 3] (host) from video frame ``video_frame0`` on;
    ``requested``/``queued``: `time.monotonic` when the session was ready for it / got it."""

    index: int
    frame0: int
    latents: torch.Tensor
    seconds: float
    batch: int
    prompt_version: int = 0
    frames: int = 0
    video: torch.Tensor | None = None
    video_frame0: int = 0
    requested: float = 0.0
    queued: float = 0.0


@dataclass
class Session:
    """A client's stream: its sequence of the pool, its position, its undelivered chunks.

    ``sequence``: its slot, the pool sequence it runs on, or None while it is swapped
    out (its stream in host memory: `framekv.engine.swap`). ``state``: "active", "done"
    (its chunk budget is spent), "failed" (``error`` says why) or "closed". ``paused``:
    the client asked for a pause. ``waiting_since``: when it last became ready for a
    chunk (None while it is not). ``delivered``: chunks handed out by
    `StreamScheduler.next_chunk`. ``end_reason``: why it ended (the ``reason`` of
    `StreamScheduler.close_session`), None while it is open.
    ``last_stepped``: the scheduler's step count when it last made a chunk or took its
    slot (which resident session gives its slot up first: the least recent).
    ``slot_since``: the step count when it took its slot (its swap quantum runs from it).
    """

    id: str
    sequence: int | None
    seed: int
    budget: int | None
    chunks: int = 0
    frames: int = 0
    video_frames: int = 0
    paused: bool = False
    prompt_version: int = 0
    state: str = "active"
    error: str | None = None
    waiting_since: float | None = None
    queue: collections.deque = field(default_factory=collections.deque)
    delivered: int = 0
    end_reason: str | None = None
    last_stepped: int = 0
    slot_since: int = 0

    @property
    def finished(self) -> bool:
        """No chunk will come any more (done, failed or closed)."""
        return self.state != "active"

    def info(self) -> dict:
        """A JSON-able snapshot: id, state, paused, seed, chunks (made), delivered,
        budget, prompt_version, error, ended (whether it left the scheduler) and
        end_reason."""
        return {"id": self.id, "state": self.state, "paused": self.paused, "seed": self.seed,
                "chunks": self.chunks, "delivered": self.delivered, "budget": self.budget,
                "prompt_version": self.prompt_version, "error": self.error,
                "ended": self.end_reason is not None, "end_reason": self.end_reason}


class PromptChange(NamedTuple):
    """A prompt change of a session: its new prompt ``version`` and ``applies_from``,
    the index of the first chunk made under it (every chunk before it was made under
    the old prompt, every one from it on under the new one, until the next change)."""

    version: int
    applies_from: int


class EndedSessions:
    """The `Session.info` of the last ``keep`` sessions that ended, by id; older ones
    are forgotten first, so the record never holds more than ``keep``. ``by_reason``
    counts every session ever added by its ``end_reason``."""

    def __init__(self, keep: int):
        self.keep, self._infos = keep, collections.OrderedDict()
        self.by_reason: collections.Counter = collections.Counter()

    def add(self, info: dict) -> None:
        """Record one ended session's info (its ``id`` the key)."""
        self.by_reason[info["end_reason"]] += 1
        self._infos[info["id"]] = info
        self._infos.move_to_end(info["id"])
        while len(self._infos) > self.keep:
            self._infos.popitem(last=False)

    def get(self, session_id: str) -> dict | None:
        """The recorded info of ``session_id``, None if it is not (or no longer) kept."""
        return self._infos.get(session_id)

    def __len__(self) -> int:
        return len(self._infos)


def default_batch_sizes(max_sessions: int) -> tuple[int, ...]:
    """Powers of two below ``max_sessions``, and ``max_sessions``."""
    sizes = [1 << i for i in range(max_sessions.bit_length()) if 1 << i < max_sessions]
    return tuple(sizes) + (max_sessions,)


class Histogram:
    """Counts of observed values under each of ``bounds``, their sum and number."""

    def __init__(self, bounds=LATENCY_BUCKETS):
        self.bounds, self.counts, self.sum, self.count = tuple(bounds), [0] * len(bounds), 0.0, 0

    def observe(self, value: float) -> None:
        """Count one value."""
        self.counts = [c + (value <= b) for c, b in zip(self.counts, self.bounds)]
        self.sum, self.count = self.sum + value, self.count + 1

    def snapshot(self) -> dict:
        """{"buckets": [(bound, values <= bound), ...], "sum", "count"} (cumulative)."""
        return {"buckets": list(zip(self.bounds, self.counts)), "sum": self.sum,
                "count": self.count}


def video_uint8(video: torch.Tensor) -> torch.Tensor:
    """Decoded frames [B, 3, F, H, W] in [-1, 1] as uint8 [B, F, H, W, 3] on the same
    device: (x + 1) * 127.5 clamped to [0, 255], rounded half to even (torch.round)."""
    x = ((video.float() + 1) * 127.5).clamp_(0, 255).round_()
    return x.to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous()  # [B, F, H, W, 3]
