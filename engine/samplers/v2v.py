"""Video to video: a chunk starts part way, from its input latents noised with its own
noise, and runs the rest of a base sampler's steps (StreamDiffusionV2's training-free
mode over Self-Forcing / CausVid generators).

Over the schedule t_0 > t_1 > ... (the runner's timesteps, ``--steps`` already picked)
and ``strength`` s in (0, 1]::

    k = the first step with t_k <= s * timestep_scale
    x = (1 - sigma_k) * video + sigma_k * noise      s < 1   (video: the chunk's input
    x = noise                                        s = 1    latents, [B, C, F, H, W])
    then the base sampler's steps k, k + 1, ... (its update, its re-noise)

So strength 0.75 of the 4-step list (1000, 750, 500, 250) runs the three steps from
750. At s = 1 the input is not read: the chunk is the base sampler's text-to-video
chunk of the same noise, bit for bit (the same arithmetic on the same values). A
strength below the last step's t / timestep_scale runs no step and is refused. The
noise is the chunk's own (`chunk_noise(seed, i)`) and the base sampler's inputs are
drawn as it draws them, so the same input, seed and strength give the same chunk.

``video`` is a static input of the chunk graph (`input_shapes`), each row's from its
``source`` (`row_inputs`: the stream's input latents for that chunk, [C, F, H, W]).
"""
from __future__ import annotations

import math

import torch

from framekv.specs.checks import check_choice

from .base import ScheduleSampler
from .euler import EulerSampler
from .self_forcing import SelfForcingSampler

__all__ = ["BASES", "VideoToVideoSampler", "check_strength", "first_step"]

#: The base samplers a chunk may finish with, by their registered names (a mode over a
#: mode is refused).
BASES = {"euler": EulerSampler, "self_forcing": SelfForcingSampler}


def check_strength(strength, *, name: str = "strength") -> float:
    """``strength`` as a float if it is a number in (0, 1], else a ValueError naming
    ``name`` (whatever the schedule: `first_step` also asks for a step to run)."""
    if (isinstance(strength, bool) or not isinstance(strength, (int, float))
            or not math.isfinite(strength) or not 0 < strength <= 1):
        raise ValueError(f"{name} must be a number in (0, 1] (1: the input is not used), "
                         f"got {strength!r}")
    return float(strength)


def first_step(timesteps, timestep_scale: float, strength) -> int:
    """k: the index of the first of ``timesteps`` at or below ``strength`` x
    ``timestep_scale``. ValueError naming ``strength`` unless it is a number in (0, 1]
    (`check_strength`) that leaves at least one step (the smallest such strength named)."""
    check_strength(strength)
    for k, t in enumerate(timesteps):
        if t <= strength * timestep_scale:
            return k
    least = float(timesteps[-1]) / timestep_scale
    raise ValueError(f"strength {strength} runs none of the steps {list(timesteps)}: it "
                     f"must be at least {least:g} (the last step's t / {timestep_scale:g})")


class VideoToVideoSampler(ScheduleSampler):
    """The input latents noised to part way, then the base sampler's remaining steps
    (module doc).

    Args:
        timesteps, timestep_scale: the runner's schedule (`ScheduleSampler`).
        base: the sampler that runs the remaining steps: "euler" or "self_forcing".
        strength: s in (0, 1]: how far back towards noise the input goes.
    """

    from_source = True

    def __init__(self, timesteps, timestep_scale: float, *, base: str = "euler",
                 strength: float = 1.0):
        check_choice("base", base, tuple(BASES))
        k = first_step(tuple(float(t) for t in timesteps), timestep_scale, strength)
        super().__init__(tuple(timesteps)[k:], timestep_scale)
        self.base = BASES[base](self.timesteps, timestep_scale)
        self.full = strength == 1
        self.options = {"base": base, "strength": float(strength)}

    def input_shapes(self, chunk_shape) -> dict[str, tuple[int, ...]]:
        """``video``: the chunk's input latents [C, F, H, W]; then the base's inputs."""
        return {"video": tuple(chunk_shape), **self.base.input_shapes(chunk_shape)}

    def row_inputs(self, seed: int, index: int, chunk_shape, sequence: int = 0,
                   source=None) -> dict[str, torch.Tensor]:
        """The stream's input latents of chunk ``index`` (``source``, [C, F, H, W], on
        its own device; None only at strength 1, where it is not read: zeros on the
        CPU, as for any source there), then the base's inputs."""
        shape = tuple(chunk_shape)
        if source is None:
            if not self.full:
                raise ValueError(f"source must be the chunk's input latents {list(shape)} at "
                                 f"strength {self.options['strength']} < 1, got None")
            video = torch.zeros(shape)
        elif not isinstance(source, torch.Tensor) or tuple(source.shape) != shape:
            got = list(source.shape) if isinstance(source, torch.Tensor) else type(source).__name__
            raise ValueError(f"source must be the chunk's input latents {list(shape)}, got {got}")
        elif self.full:                 # not read: the same zeros as without a source
            video = torch.zeros(shape)
        else:                           # where it is: no wait on a copy off the device
            video = source.detach().float()
        return {"video": video, **self.base.row_inputs(seed, index, shape, sequence)}

    def start(self, noise: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The noise (strength 1), else the input noised to sigma_k (module doc)."""
        if self.full:
            return self.base.start(noise, inputs)
        s = self.sigmas[0]
        return (1 - s) * inputs["video"] + s * noise

    def update(self, x: torch.Tensor, v: torch.Tensor, i: int) -> torch.Tensor:
        """The base sampler's update of step ``i`` of the remaining steps."""
        return self.base.update(x, v, i)

    def renoise(self, x: torch.Tensor, i: int, inputs: dict) -> torch.Tensor:
        """The base sampler's re-noise between the remaining steps."""
        return self.base.renoise(x, i, inputs)
