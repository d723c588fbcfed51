"""A sequence's history: the clean latents of its visible frames, and how a re-cache
cuts them into clean passes.

When a model's finished frames' K/V depend on the prompt (Wan's prompt lives in
cross-attention), a prompt change can re-cache the history (as LongLive does): the K/V
of every frame still visible recomputed under the new prompt. For that the runner keeps,
per pool sequence, the clean latents of its visible frames: the first ``sink_frames``
frames and the last ``window_frames``. A re-cache replays clean passes over them in
frame order, at their own rope frames, each committed before the next::

    pieces   runs of consecutive visible frames cut at the sink boundary and at the
             chunk grid (multiples of frames_per_chunk), so a piece of a whole chunk is
             the chunk the sequence once made
"""
from __future__ import annotations

import torch

__all__ = ["History", "pieces"]


class History:
    """Clean latents of the visible frames of each pool sequence.

    Args:
        sequences: pool sequences; sink_frames, window_frames: what stays visible.
    """

    def __init__(self, sequences: int, sink_frames: int, window_frames: int):
        self.sink, self.window = sink_frames, window_frames
        self._frames: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(sequences)]

    def add(self, seq: int, frame0: int, latents: torch.Tensor) -> None:
        """A finished chunk of sequence ``seq``: latents [C, F, H, W] of frames frame0 ..."""
        kept = self._frames[seq]
        for f in range(latents.shape[1]):
            kept.append((frame0 + f, latents[:, f:f + 1].clone()))             # [C, 1, H, W]
        sink = [e for e in kept if e[0] < self.sink]
        rest = [e for e in kept if e[0] >= self.sink]
        self._frames[seq] = sink + rest[len(rest) - self.window:] if self.window else sink

    def clear(self, seq: int | None = None) -> None:
        """Forget sequence ``seq``'s frames (default every sequence's)."""
        for i in range(len(self._frames)) if seq is None else (seq,):
            self._frames[i] = []

    def put(self, seq: int, frames: list[tuple[int, torch.Tensor]]) -> None:
        """Sequence ``seq``'s visible frames become ``frames`` ((index, [C, 1, H, W]) in
        order, as `visible` gave them): a restored stream's history."""
        self._frames[seq] = [(f, x.clone()) for f, x in frames]

    def visible(self, seq: int) -> list[tuple[int, torch.Tensor]]:
        """(frame index, latents [C, 1, H, W]) of the sequence's visible frames, in order."""
        return list(self._frames[seq])


def pieces(frames: list[int], sink: int, per_chunk: int) -> list[list[int]]:
    """Frame indices cut into runs: consecutive, not across the sink boundary nor a
    multiple of ``per_chunk``."""
    out: list[list[int]] = []
    for f in frames:
        run = out[-1] if out else None
        cut = run is None or f != run[-1] + 1 or f == sink or f % per_chunk == 0
        out.append([f]) if cut else run.append(f)
    return out
