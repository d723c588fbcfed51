"""A streaming session's records (`framekv.engine.scheduler`): `Session`, a client's
stream on one sequence of the pool, and `SessionChunk`, one chunk it was given; the
batch sizes a scheduler captures by default (`default_batch_sizes`); the `Histogram`
its step and chunk latencies are counted in."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

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

    ``state``: "active", "done" (its chunk budget is spent), "failed" (``error`` says
    why) or "closed". ``paused``: the client asked for a pause. ``waiting_since``: when
    it last became ready for a chunk (None while it is not).
    """

    id: str
    sequence: int
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

    @property
    def finished(self) -> bool:
        """No chunk will come any more (done, failed or closed)."""
        return self.state != "active"


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
