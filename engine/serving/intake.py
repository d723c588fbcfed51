"""`Intake`: a video stream's incoming frames, waiting to become its next chunk's input.

A stream that takes video (a video-to-video session) makes chunk i from the latents of
its chunk i input: ``first`` frames for chunk 0 (1 + 4 (F - 1) for a VAE's chunk of F
latent frames), ``later`` (4 F) for every chunk after. Its client sends frames as they
come (`push`); the scheduler takes a chunk's frames as it plans the stream's step
(`take`), and the stream is ready for a chunk only once they are in (`ready`), so it
never runs ahead of its input.

Drops. Frames wait in one queue, oldest first. It holds at most one whole chunk, the
next one's count (``first`` until chunk 0's frames are taken, then ``later``): a frame
past that pushes the oldest out, counted in ``dropped``. So when input comes faster
than chunks are made, the stream keeps the newest whole chunk and what waits beyond
the chunk being made is at most one chunk of frames: latency stays bounded by one
chunk of input beyond the one in the works. A chunk is the newest ``count`` frames
waiting when it is taken, so frames are dropped only ever before a chunk's first one.

A drop is a cut in the stream's video: the encoder's causal cache is not reset, it
carries the last frames it encoded across the gap, and the stream's input latents are
those of the frames it kept, encoded as one video (the first chunk is always the
encoder's 1 + 4k, whatever came before it). A client that wants no cut sends no faster
than chunks are made (``waiting`` and ``dropped`` in the session's info say how it
does).

Counters (kept over swaps, moves and restarts, `state` / `from_state`): ``received``
frames pushed, ``dropped``, ``taken`` chunks of input taken (the input cursor: the next
chunk's index), ``used`` frames taken. ``last`` is `time.monotonic` of the newest frame
waiting (a chunk's input-to-output latency runs from it).

Frame numbers. Each frame pushed is numbered in the order the stream received it, from
0, over every frame received, dropped ones included: the waiting frames are always the
newest ones, numbers ``received - waiting`` to ``received - 1``. A chunk's input is a
run of them, (first, count) (`span`, what `take` returns), so a client can tell which
of the frames it sent a chunk answers; chunk i's first frame is ``used + dropped`` as
it is taken, and the counters give the same numbers after a restart or a move.
"""
from __future__ import annotations

import collections
import time

import torch

__all__ = ["Intake"]


class Intake:
    """One video stream's waiting frames (module doc). ``size``: (H, W) of a frame;
    ``first``, ``later``: the frames of chunk 0 and of each chunk after."""

    def __init__(self, size: tuple[int, int], first: int, later: int):
        self.size, self.first, self.later = tuple(size), int(first), int(later)
        self.frames: collections.deque = collections.deque()   # [3, H, W] fp32 each
        self.received = self.dropped = self.taken = self.used = 0
        self.last: float | None = None

    @property
    def need(self) -> int:
        """Frames of the next chunk of input (``first`` for chunk 0, else ``later``)."""
        return self.first if self.taken == 0 else self.later

    def check(self, frames: torch.Tensor) -> torch.Tensor:
        """``frames`` as fp32 [n, 3, H, W] in [-1, 1] of this stream's size; ValueError
        naming the shape expected and given."""
        H, W = self.size
        if (not isinstance(frames, torch.Tensor) or frames.dim() != 4
                or tuple(frames.shape[1:]) != (3, H, W) or not frames.is_floating_point()):
            got = (f"{list(frames.shape)} {frames.dtype}" if isinstance(frames, torch.Tensor)
                   else type(frames).__name__)
            raise ValueError(f"frames must be a float [n, 3, {H}, {W}] tensor in [-1, 1] "
                             f"(the model's video size), got {got}")
        return frames.detach().to("cpu", torch.float32)

    def push(self, frames: torch.Tensor, when: float | None = None) -> int:
        """Frames [n, 3, H, W] (`check`ed) in, received at ``when`` (`time.monotonic`,
        default now); the oldest waiting past one chunk dropped. Returns how many this
        call dropped."""
        before = self.dropped
        for f in frames:
            self.frames.append(f)
        self.received += len(frames)
        self.last = time.monotonic() if when is None else when
        while len(self.frames) > self.need:
            self.frames.popleft()
            self.dropped += 1
        return self.dropped - before

    def ready(self) -> bool:
        """Whether the next chunk's frames are in."""
        return len(self.frames) >= self.need

    def span(self) -> tuple[int, int]:
        """(first, count): the numbers of the frames the next chunk takes (module doc),
        the oldest waiting on."""
        return self.received - len(self.frames), self.need

    def take(self) -> tuple[torch.Tensor, float | None, tuple[int, int]]:
        """The next chunk's frames [3, n, H, W] (the encoder's layout), when the newest
        came and their numbers (`span`); they leave the queue. ValueError when they are
        not in."""
        n, span = self.need, self.span()
        if len(self.frames) < n:
            raise ValueError(f"chunk {self.taken}'s input needs {n} frames, "
                             f"{len(self.frames)} are in")
        out = torch.stack([self.frames.popleft() for _ in range(n)], dim=1)  # [3, n, H, W]
        self.taken += 1
        self.used += n
        return out, self.last, span

    def info(self) -> dict:
        """The session info's input fields: frames_in (received), frames_dropped,
        frames_waiting, input_chunks (chunks of input taken: the next one's index)
        and frames_needed (what the next chunk takes)."""
        return {"frames_in": self.received, "frames_dropped": self.dropped,
                "frames_waiting": len(self.frames), "input_chunks": self.taken,
                "frames_needed": self.need}

    # ------------------------------------------------------------------ state
    def copy(self) -> "Intake":
        """A copy whose queue and counters move apart from this one's (the frames,
        never written to, shared)."""
        other = Intake(self.size, self.first, self.later)
        other.frames.extend(self.frames)
        other.received, other.dropped, other.taken, other.used = (
            self.received, self.dropped, self.taken, self.used)
        other.last = self.last
        return other

    def state(self) -> tuple[dict, torch.Tensor | None]:
        """(its fields, its waiting frames [n, 3, H, W] or None) for a `StreamState`."""
        fields = {"size": list(self.size), "first": self.first, "later": self.later,
                  "received": self.received, "dropped": self.dropped,
                  "taken": self.taken, "used": self.used}
        return fields, (torch.stack(list(self.frames)) if self.frames else None)

    @classmethod
    def from_state(cls, fields: dict, frames: torch.Tensor | None) -> "Intake":
        """The intake `state` gave; ValueError for a field that is not a count."""
        bad = [k for k in ("first", "later", "received", "dropped", "taken", "used")
               if type(fields[k]) is not int or fields[k] < 0]
        size = fields["size"]
        if bad or not (isinstance(size, list) and len(size) == 2
                       and all(type(v) is int and v > 0 for v in size)):
            raise ValueError(f"the input's fields {bad or ['size']} must be counts >= 0 "
                             f"(size two > 0), got { {k: str(v)[:24] for k, v in fields.items()} }")
        intake = cls(tuple(size), fields["first"], fields["later"])
        for k in ("received", "dropped", "taken", "used"):
            setattr(intake, k, fields[k])
        if frames is not None:
            intake.frames.extend(intake.check(frames)[-intake.need:])
        return intake
