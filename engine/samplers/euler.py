"""The flow-matching Euler sampler: one Euler step along the velocity per model call,

    x <- x + (sigma_{i+1} - sigma_i) * v(x, t_i)

from the chunk's noise at sigma_0; the chunk is x after the last step (sigma = 0)."""
from __future__ import annotations

import torch

from .base import ScheduleSampler

__all__ = ["EulerSampler"]


class EulerSampler(ScheduleSampler):
    """Flow-matching Euler over the schedule (module doc); no option, no static input."""

    def update(self, x: torch.Tensor, v: torch.Tensor, i: int) -> torch.Tensor:
        """x [B, C, F, H, W] one Euler step on, from sigma_i to sigma_{i+1}."""
        sig = self.sigmas
        return x + (sig[i + 1] - sig[i]) * v
