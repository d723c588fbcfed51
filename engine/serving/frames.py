"""Decoded frames as the pixels a client gets: `to_uint8`, the one conversion of video in
[-1, 1] to uint8 RGB (a served chunk's frames, a generated MP4's)."""
from __future__ import annotations

import torch

__all__ = ["to_uint8"]


def to_uint8(frames: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Frames in [-1, 1] as uint8 RGB, channels last, on the frames' device (so that
    only the pixels cross to the host).

    Args:
        frames: a float tensor [3, F, H, W] (one video) or [B, 3, F, H, W] (B videos).

    Returns:
        uint8 [F, H, W, 3] for one video, [B, F, H, W, 3] for B (``out[b]`` is video
        b): round((x + 1) * 127.5), ties to even, clamped to [0, 255].

    ``check=False`` skips the NaN / inf check, which waits for the frames on the host:
    a caller that must not wait checks them itself (`framekv.engine.decode_lane`).

    Raises:
        ValueError: not such a tensor, not floating point, or NaN or inf in it.
    """
    if not isinstance(frames, torch.Tensor) or frames.dim() not in (4, 5) or frames.shape[-4] != 3:
        got = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"frames must be a tensor [3, F, H, W] or [B, 3, F, H, W], got {got}")
    if not frames.is_floating_point():
        raise ValueError(f"frames must be floating point in [-1, 1], got {frames.dtype}")
    x = frames.detach().float()
    if check and not bool(torch.isfinite(x).all()):
        raise ValueError("frames must be finite, got NaN or inf values")
    x = ((x + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
    return x.movedim(-4, -1).contiguous()  # [..., F, H, W, 3]
