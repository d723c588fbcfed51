"""A stream's history under a new prompt: the clean latents of its visible frames, and
the clean passes that recompute their K/V.

A Wan stream's prompt lives in cross-attention, so the K/V a clean pass wrote depend on
the prompt it ran under. When the prompt changes mid-stream, the history can be
re-cached (as LongLive does): the K/V of every frame still visible recomputed under the
new prompt. For that a rollout keeps, per sequence, the clean latents of its visible
frames (`History`): the first ``sink_frames`` frames and the last ``window_frames``.

`recache` resets the sequence and replays clean passes (timestep 0) over those frames,
in frame order, at their own rope frames, each committed before the next:

    pieces   runs of consecutive visible frames cut at the sink boundary and at the
             chunk grid (multiples of frames_per_chunk), so a piece of a whole chunk is
             the chunk the stream once made
    blocks   a whole chunk: the rollout's clean block (one block with "chunk"); a
             shorter piece (the sink, a window cut mid-chunk): one-frame blocks

Afterwards the sequence holds exactly the visible frames (pinned sink, then window), so
the next chunk sees the same frames as before, with K/V of the new prompt. The
sequence's commit count is smaller than before; positions in the rope come from the
frame indices, which the caller keeps. Eager (a prompt change is rare): no graph.
"""
from __future__ import annotations

import torch

__all__ = ["History", "recache", "pieces"]


class History:
    """Clean latents of the visible frames of each pool sequence.

    Args:
        sequences: pool sequences; shape: the rollout's `WanShape` (sink and window).
    """

    def __init__(self, sequences: int, shape):
        self.sink, self.window = shape.sink_frames, shape.window_frames
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


@torch.no_grad()
def recache(rollout, seq: int) -> None:
    """Recompute sequence ``seq``'s K/V of its visible frames under its current prompt
    (module doc). ``rollout``: a `WanRollout` without guidance."""
    visible = dict(rollout.history.visible(seq))
    rollout.kv.reset_sequences([seq])
    if not visible:
        return
    rollout.kv.use_sequences([seq])
    try:
        for run in pieces(sorted(visible), rollout.shape.sink_frames,
                          rollout.shape.frames_per_chunk):
            x = torch.cat([visible[f] for f in run], dim=1)[None]            # [1, C, F', H, W]
            rollout.ctx.frame0 = torch.tensor([run[0]], dtype=torch.int64, device=rollout.device)
            rollout.clean_pass(x.to(rollout.device))
    finally:
        rollout.kv.use_sequences(range(rollout.pool))
