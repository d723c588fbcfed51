"""`ScheduleSampler`: what most samplers share, over the schedule they are built with;
and `pick_steps`, the rule ``steps=N`` (``--steps N``) runs N of a schedule's steps by.

A sampler is built over a schedule, the model timesteps t_0 > t_1 > ... of its steps
(the runner's ``timesteps``, N of a preset's already picked), and the model's
``timestep_scale``: sigma_i = t_i / timestep_scale, and sigma = 0 after the last step.
`ScheduleSampler` keeps both and answers every part of the `Sampler` protocol but the
update: it runs every step of its schedule, starts a chunk from a copy of its noise,
re-noises nothing and takes no static input beyond noise and frame0. A sampler that
runs a suffix of its schedule (a chunk started part way, from other latents) narrows
``timesteps`` and ``sigmas`` in its constructor.
"""
from __future__ import annotations

import abc

import torch

from framekv.specs.checks import check_timesteps

__all__ = ["ScheduleSampler", "check_steps", "pick_steps"]


def check_steps(steps, count: int, *, name: str = "steps") -> int | None:
    """``steps`` if it is None or an integer in [1, ``count``] (how many of a preset's
    ``count`` denoising steps run), else a ValueError naming ``name`` and the range."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)
                              or not 1 <= steps <= count):
        raise ValueError(f"{name} must be an integer in [1, {count}] (how many of the "
                         f"preset's {count} denoising steps run), got {steps!r}")
    return steps


def pick_steps(timesteps, steps: int | None, *, name: str = "steps") -> tuple[float, ...]:
    """``steps`` N of the S steps ``timesteps``: those at indices floor(i S / N) for
    i = 0 .. N - 1, evenly spaced and always the first (N = S: all of them; N = 1: the
    first alone); None: all. ValueError naming ``name`` (`check_steps`) for an N that is
    not an integer in [1, S]."""
    ts = tuple(float(t) for t in timesteps)
    S = len(ts)
    if check_steps(steps, S, name=name) is None:
        return ts
    return tuple(ts[i * S // steps] for i in range(steps))


class ScheduleSampler(abc.ABC):
    """A sampler's schedule and its defaults (module doc); a subclass gives `update`.

    Args:
        timesteps: the model timesteps of the steps, decreasing in (0, timestep_scale].
        timestep_scale: the model timestep at sigma = 1.

    Attributes:
        timesteps: the model timesteps of the steps a chunk runs.
        sigmas: t_i / timestep_scale of those steps, then 0.
        options: the options it was built with beyond the schedule (none here).
    """

    #: whether its chunks start from a source each stream gives (a video's latents): a
    #: command picks it from that input, never by ``--sampler``
    from_source = False

    def __init__(self, timesteps, timestep_scale: float):
        sigmas = check_timesteps(timesteps, timestep_scale)
        self.timesteps = tuple(float(t) for t in timesteps)
        self.sigmas = tuple(sigmas)
        self.options: dict = {}

    def input_shapes(self, chunk_shape) -> dict[str, tuple[int, ...]]:
        """No static input beyond noise and frame0."""
        return {}

    def row_inputs(self, seed: int, index: int, chunk_shape, sequence: int = 0,
                   source=None) -> dict[str, torch.Tensor]:
        """Nothing to draw."""
        return {}

    def start(self, noise: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The chunk's noise itself (a copy: the static buffer stays as it came)."""
        return noise.clone()

    @abc.abstractmethod
    def update(self, x: torch.Tensor, v: torch.Tensor, i: int) -> torch.Tensor:
        """The latents after step ``i``'s model call (a subclass's)."""

    def renoise(self, x: torch.Tensor, i: int, inputs: dict) -> torch.Tensor:
        """Nothing between the calls: ``x`` as it is."""
        return x
