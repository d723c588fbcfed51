"""What a scheduler hands out, counts and raises: `SessionChunk`, one chunk a stream made;
`PromptChange`, a prompt change and when it took; `EndedSessions`, the bounded record
of streams that ended; `Histogram`, the step, chunk and swap latencies;
`SchedulerFull` and `LoopStopped`, why a stream cannot open; `PromptTooLate`, why a
prompt change cannot take."""
from __future__ import annotations

import collections
import concurrent.futures
from dataclasses import dataclass

import torch

__all__ = ["EndedSessions", "Histogram", "LATENCY_BUCKETS", "LoopStopped", "PromptChange",
           "PromptTooLate", "SWAP_BUCKETS", "SchedulerFull", "SessionChunk"]

#: upper bounds (seconds) of the step and chunk latency histograms
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: upper bounds (seconds) of the swap histogram
SWAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class SchedulerFull(Exception):
    """``max_sessions`` streams are open."""


class LoopStopped(RuntimeError):
    """The GPU loop (`StreamScheduler.run`) ended by an exception: no stream can be
    stepped any more; the message says why."""


class PromptTooLate(ValueError):
    """A prompt change no chunk would be made under: its stream has made its last chunk
    (its budget is spent) or ended; the message says which (`Stream.late_prompt`)."""


@dataclass
class SessionChunk:
    """One finished chunk of a stream: index, first latent frame, latents fp32
    [C, F, H, W], seconds of the batched step that made it (decode included), its
    batch size, the stream's prompt version it was made under, its latent frames; with
    a decoder ``video`` uint8 [F', H, W, 3] (host) from video frame ``video_frame0`` on;
    ``requested``/``queued``: `time.monotonic` when the stream was ready for it / got it;
    ``received``: a video stream's, when the newest frame of its input came (None: no
    input, or its input latency observed already: `StreamScheduler.handout`);
    ``input``: a video stream's, the numbers of the input frames it was made from,
    (first, count): frames ``first`` to ``first + count - 1`` in the order the stream
    received them, dropped ones counted (`Intake`); None for a text stream. Recorded
    as the frames are taken, it goes with the chunk wherever the chunk goes (a
    re-send, a checkpoint, a move).

    The latents are on the host, or on the runner's device where its frames are what a
    client gets (`StreamScheduler`'s ``host_latents``): those are copied to the host
    for an export or a checkpoint only, and a pickled chunk (a replica's, on its way to
    an ingress) leaves them out (None): device memory never leaves its process."""

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
    received: float | None = None
    input: tuple[int, int] | None = None

    def __getstate__(self) -> dict:
        """Its fields for pickling, latents on a device left out (None)."""
        state = dict(self.__dict__)
        if isinstance(self.latents, torch.Tensor) and self.latents.device.type != "cpu":
            state["latents"] = None
        return state


class PromptChange:
    """A prompt change of a stream: its new prompt ``version`` and ``applies_from``, the
    index of the first chunk made under it (every chunk before it was made under the
    old prompt, every one from it on under the new one, until the next change).

    The change takes at the stream's next step boundary (its history re-cached on the
    GPU): `result` waits for that and returns the change, ``applies_from`` final, or
    raises what the re-cache raised (the stream then goes on under its old prompt). A
    stream off the pool takes it as it comes back: its change is final at once."""

    def __init__(self, version: int, applies_from: int):
        self.version, self.applies_from = version, applies_from
        self._done: concurrent.futures.Future = concurrent.futures.Future()

    def result(self, timeout: float | None = None) -> "PromptChange":
        """This change once it took (``timeout`` seconds at most: TimeoutError)."""
        self._done.result(timeout)
        return self

    def done(self) -> bool:
        """Whether it took or failed."""
        return self._done.done()

    @property
    def future(self) -> concurrent.futures.Future:
        """The future `result` waits on (for ``asyncio.wrap_future``)."""
        return self._done

    def settle(self, applies_from: int | None = None, error: BaseException | None = None) -> None:
        """Mark it taken from chunk ``applies_from`` on, or failed with ``error``."""
        if self._done.done():
            return
        if error is not None:
            self._done.set_exception(error)
            return
        if applies_from is not None:
            self.applies_from = applies_from
        self._done.set_result(self)

    def __iter__(self):
        """(version, applies_from), as a pair unpacks."""
        return iter((self.version, self.applies_from))

    def __eq__(self, other) -> bool:
        """Equal to itself, and to the pair (version, applies_from)."""
        if isinstance(other, tuple):
            return (self.version, self.applies_from) == other
        return self is other

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"PromptChange(version={self.version}, applies_from={self.applies_from})"


class EndedSessions:
    """The info of the last ``keep`` streams that ended, by id; older ones are forgotten
    first, so the record never holds more than ``keep``. ``by_reason`` counts every
    stream ever added by its ``end_reason``."""

    def __init__(self, keep: int):
        self.keep, self._infos = keep, collections.OrderedDict()
        self.by_reason: collections.Counter = collections.Counter()

    def add(self, info: dict) -> None:
        """Record one ended stream's info (its ``id`` the key)."""
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
