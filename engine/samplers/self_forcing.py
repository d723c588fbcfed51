"""The Self-Forcing sampler: each model call predicts the clean latents, which are
noised afresh to the next step's sigma::

    x0 = x - sigma_i * v(x, t_i)
    x  <- (1 - sigma_{i+1}) * x0 + sigma_{i+1} * e_i      (between calls)

The chunk is x0 of the last step. The fresh noise e_i [steps - 1, C, F, H, W] of a
stream's chunk is a static input of the chunk (``renoise``), drawn on the CPU from the
stream's (seed, chunk index, sequence) alone (`framekv.engine.step.chunk_renoise`): a
stream's chunk is the same wherever, and beside whatever, it runs, and a stream moved
to another process goes on with the same noise.
"""
from __future__ import annotations

import torch

from ..step import chunk_renoise
from .base import ScheduleSampler

__all__ = ["SelfForcingSampler"]


class SelfForcingSampler(ScheduleSampler):
    """x0 prediction, then fresh noise to the next sigma (module doc)."""

    def input_shapes(self, chunk_shape) -> dict[str, tuple[int, ...]]:
        """``renoise``: one fresh noise per step after the first, [steps - 1, C, F, H, W]."""
        return {"renoise": (len(self.timesteps) - 1, *chunk_shape)}

    def row_inputs(self, seed: int, index: int, chunk_shape, sequence: int = 0,
                   source=None) -> dict[str, torch.Tensor]:
        """The stream's fresh noise of chunk ``index`` (`chunk_renoise`)."""
        return {"renoise": chunk_renoise(seed, index, len(self.timesteps), tuple(chunk_shape),
                                         sequence)}

    def update(self, x: torch.Tensor, v: torch.Tensor, i: int) -> torch.Tensor:
        """The clean prediction x0 = x - sigma_i v."""
        return x - self.sigmas[i] * v

    def renoise(self, x: torch.Tensor, i: int, inputs: dict) -> torch.Tensor:
        """x0 of step ``i`` noised to sigma_{i+1} with the step's fresh noise."""
        s = self.sigmas[i + 1]
        return (1 - s) * x + s * inputs["renoise"][:, i]
