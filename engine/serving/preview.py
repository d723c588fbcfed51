"""`LatentPreview`: a picture of latents for a model without a VAE (the reference DiT),
so that a served stream always has frames to show.

Each latent frame becomes one RGB image, ``scale`` times larger (nearest neighbour)::

    rgb[k] = tanh(sum over channels c with c % 3 == k of z[c] / sqrt(n_k))   in (-1, 1)

(the channels dealt round robin to red, green and blue, each sum scaled to unit
variance for unit-normal latents). It is a preview of the latents, not a decoded
video: one image per latent frame, no temporal upsampling, no state. It has the
streaming decoder's interface (`decode`, `reset`, `snapshot`, `restore`, `close`,
`video_frames`) that `StreamScheduler` drives, so its rows swap and move as a VAE's do.
"""
from __future__ import annotations

import math

import torch

__all__ = ["LatentPreview"]


class LatentPreview:
    """Latents [B, C, F, H, W] -> frames [B, 3, F, scale * H, scale * W] in (-1, 1)
    (module doc). ``sequences``: the rows it serves (a scheduler's slots)."""

    def __init__(self, sequences: int, *, scale: int = 8):
        for name, v in (("sequences", sequences), ("scale", scale)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        self.sequences, self.scale = sequences, scale
        self._frames = [0] * sequences

    def video_frames(self, latent_frames: int, first: bool) -> int:
        """Frames a chunk of ``latent_frames`` becomes (one each, first chunk or not)."""
        return latent_frames

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, rows=None) -> torch.Tensor:
        """The preview of ``latents`` [B, C, F, H, W] (rows: the sequences they go on,
        default 0 .. B-1)."""
        if not isinstance(latents, torch.Tensor) or latents.dim() != 5:
            raise ValueError(f"latents must be a [B, C, F, H, W] tensor, got "
                             f"{getattr(latents, 'shape', type(latents).__name__)}")
        rows = list(range(latents.shape[0])) if rows is None else list(rows)
        if len(rows) != latents.shape[0] or any(not 0 <= r < self.sequences for r in rows):
            raise ValueError(f"rows must be {latents.shape[0]} of [0, {self.sequences}), got "
                             f"{rows}")
        z = latents.float()
        C = z.shape[1]
        rgb = torch.stack([z[:, k::3].sum(1) / math.sqrt(max(1, len(range(k, C, 3))))
                           for k in range(3)], dim=1)                    # [B, 3, F, H, W]
        rgb = torch.tanh(rgb).repeat_interleave(self.scale, -2).repeat_interleave(self.scale, -1)
        for r in rows:
            self._frames[r] += z.shape[2]
        return rgb

    def reset(self, rows=None) -> None:
        """Rows ``rows`` (default all) start a new video."""
        for r in range(self.sequences) if rows is None else rows:
            self._frames[r] = 0

    def snapshot(self, row: int) -> dict:
        """Row ``row``'s state: the frames shown so far (there is nothing else)."""
        return {"frames": self._frames[row], "cache": [], "latent_size": None}

    def restore(self, row: int, state: dict) -> None:
        """Row ``row`` goes on from ``state`` (`snapshot`)."""
        self._frames[row] = int(state["frames"])

    def close(self) -> None:
        """Nothing to free."""
