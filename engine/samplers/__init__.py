"""framekv.engine.samplers: how a chunk's latents move from noise to clean, by name.

A `Sampler` is built over a schedule, the model timesteps of the steps it may run
(decreasing in (0, timestep_scale]), and the model's ``timestep_scale``, with its own
options: ``cls(timesteps, timestep_scale, **options)``, a ValueError naming a bad
option. `ChunkRunner` runs it inside the chunk, so on a GPU within the one captured
graph::

    x = start(noise, inputs)                     # [B, C, F, H, W] fp32
    for i in range(len(timesteps)):              # the steps this sampler runs
        v = model(x, timesteps[i])
        x = update(x, v, i)
        if i + 1 < len(timesteps):
            x = renoise(x, i, inputs)
    # x: the chunk's clean latents

``timesteps`` and ``sigmas`` (t_i / timestep_scale, then 0) are the steps a chunk
runs: all of the schedule, or a suffix of it for a chunk that starts part way (from
other latents noised to its first sigma). ``inputs`` are the sampler's static inputs
of the chunk beyond ``noise`` and ``frame0``: `input_shapes` names each with its
shape per row (given the chunk's [C, F, H, W]), so a captured graph holds one static
buffer of [B, *shape] for it; `row_inputs` gives one stream's values of them for its
chunk ``index`` (host, fp32), drawn from its (seed, index, sequence) alone, or taken
from ``source``, what the stream brings beside its noise (its input latents, say):
a scheduler's `StepPlan.draw_noise` stacks them per row, zeros for scratch rows.
``options`` (JSON-able) are what the sampler was built with beyond the schedule; with
its name they are baked into the chunk graph's key (`sampler_label`) and into what a
stream must match to be restored (`sampler_description`, in `ChunkRunner.describe`).
How many steps run is the schedule's (`pick_steps`), so ``sigmas`` carry it.

The registry (`register_sampler`, `get_sampler`, `samplers`) is the one place a name
becomes a sampler: ``euler`` (`EulerSampler`, the default) and ``self_forcing``
(`SelfForcingSampler`, how a Self-Forcing or CausVid generator checkpoint samples)
and ``v2v`` (`VideoToVideoSampler`: a chunk started part way from its input latents,
either of them finishing it) are its entries; no other module branches on a sampler's
name. A sampler that wraps another (a mode over a base sampler) builds the base by name
through `get_sampler`. A sampler whose chunks start from a source each stream gives
(``from_source``: ``v2v``) is picked by that input (``--video-in``,
``--video-strength``), so ``--sampler`` offers the others (`named_samplers`).
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from framekv.specs.checks import check_choice

from .base import ScheduleSampler, check_steps, pick_steps
from .euler import EulerSampler
from .self_forcing import SelfForcingSampler
from .v2v import VideoToVideoSampler, check_strength

__all__ = ["DEFAULT_SAMPLER", "GENERATOR_SAMPLER", "VIDEO_SAMPLER", "EulerSampler", "Sampler",
           "ScheduleSampler", "SelfForcingSampler", "VideoToVideoSampler", "build_sampler",
           "check_steps", "check_strength", "get_sampler", "named_samplers", "pick_steps",
           "register_sampler", "sampler_description", "sampler_label", "samplers",
           "unregister_sampler"]


@runtime_checkable
class Sampler(Protocol):
    """What a sampler gives the runner (module doc)."""

    timesteps: tuple[float, ...]      # model timesteps of the steps a chunk runs
    sigmas: tuple[float, ...]         # t_i / timestep_scale of those steps, then 0
    options: dict                     # JSON-able: its options beyond the schedule

    def input_shapes(self, chunk_shape) -> dict[str, tuple[int, ...]]:
        """Its static inputs beyond noise and frame0: name -> shape of one row, for a
        chunk of [C, F, H, W] ``chunk_shape``."""

    def row_inputs(self, seed: int, index: int, chunk_shape, sequence: int = 0,
                   source=None) -> dict[str, torch.Tensor]:
        """One stream's values of those inputs for its chunk ``index`` (host fp32, the
        shapes `input_shapes` gives), from (``seed``, ``index``, ``sequence``) and
        ``source`` (what the stream brings beside its noise; None: nothing)."""

    def start(self, noise: torch.Tensor, inputs: dict) -> torch.Tensor:
        """The chunk's starting latents [B, C, F, H, W] from its noise and inputs (a
        new tensor: the static buffers stay as they came)."""

    def update(self, x: torch.Tensor, v: torch.Tensor, i: int) -> torch.Tensor:
        """The latents after step ``i``'s model call, from x and the velocity v."""

    def renoise(self, x: torch.Tensor, i: int, inputs: dict) -> torch.Tensor:
        """The latents handed to step ``i + 1``'s model call, from step ``i``'s update."""


#: The sampler a runner uses unless told otherwise.
DEFAULT_SAMPLER = "euler"
#: The sampler a distilled generator checkpoint (Self-Forcing, CausVid) samples with.
GENERATOR_SAMPLER = "self_forcing"
#: The video-to-video mode over either of them (`VideoToVideoSampler`: base, strength).
VIDEO_SAMPLER = "v2v"
_BUILT_IN = (DEFAULT_SAMPLER, GENERATOR_SAMPLER, VIDEO_SAMPLER)
_REGISTRY: dict[str, type] = {}


def register_sampler(name: str, cls) -> None:
    """Make ``cls`` (called ``cls(timesteps, timestep_scale, **options)``, building a
    `Sampler`) the sampler ``name``: a runner, ``framekv generate`` and ``framekv
    serve`` take it by that name from then on. ValueError for a name that is not a
    lower-case identifier or is taken, or a ``cls`` that is not callable."""
    if not (isinstance(name, str) and name.isidentifier() and name == name.lower()):
        raise ValueError(f"name must be a lower-case identifier (it is a --sampler value "
                         f"and part of a graph key), got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"sampler {name!r} is registered already "
                         f"(unregister_sampler({name!r}) first)")
    if not callable(cls):
        raise ValueError(f"cls must be a callable building a Sampler, got {cls!r}")
    _REGISTRY[name] = cls


def unregister_sampler(name: str) -> None:
    """Forget the sampler ``name``; ValueError for one not registered or built in."""
    if name in _BUILT_IN:
        raise ValueError(f"name must not be a built-in sampler {list(_BUILT_IN)}, got {name!r}")
    check_choice("name", name, samplers())
    del _REGISTRY[name]


def samplers() -> tuple[str, ...]:
    """The registered samplers' names, in the order they were registered."""
    return tuple(_REGISTRY)


def named_samplers() -> tuple[str, ...]:
    """The samplers a command may name (``--sampler``): the registered ones but those
    whose chunks start from a source a stream gives (``from_source``: a video input picks
    its sampler)."""
    return tuple(n for n, cls in _REGISTRY.items() if not getattr(cls, "from_source", False))


def get_sampler(name: str):
    """The class (or factory) registered as ``name``; ValueError naming the registered
    ones for any other."""
    return _REGISTRY[check_choice("sampler", name, samplers())]


def build_sampler(name: str, timesteps, timestep_scale: float, options=None) -> Sampler:
    """The sampler ``name`` over the schedule ``timesteps`` (``timestep_scale``: the
    model timestep at sigma = 1) with ``options`` (a mapping, default none). ValueError
    naming the sampler, an option it does not take, or a bad schedule."""
    cls = get_sampler(name)
    if options is None:
        options = {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise ValueError(f"sampler_options must be a mapping of option names to values, "
                         f"got {options!r}")
    try:
        inspect.signature(cls).bind(timesteps, timestep_scale, **options)
    except TypeError as exc:
        raise ValueError(f"sampler_options {dict(options)!r} do not fit the {name} "
                         f"sampler: {exc}") from None
    sampler = cls(timesteps, timestep_scale, **options)
    if not isinstance(sampler, Sampler):
        raise ValueError(f"the {name} sampler built a {type(sampler).__name__}, which lacks "
                         f"the Sampler protocol (timesteps, sigmas, options, input_shapes, "
                         f"row_inputs, start, update, renoise)")
    return sampler


def sampler_description(name: str, sampler: Sampler):
    """What a stream's state records of its sampler: the name alone, or with options
    ``{"name": name, "options": options}``."""
    return name if not sampler.options else {"name": name, "options": dict(sampler.options)}


def sampler_label(name: str, sampler: Sampler) -> str:
    """The sampler in a graph key's program: ``name`` or ``name(k=v,...)``."""
    opts = ",".join(f"{k}={v}" for k, v in sorted(sampler.options.items()))
    return f"{name}({opts})" if opts else name


register_sampler(DEFAULT_SAMPLER, EulerSampler)
register_sampler(GENERATOR_SAMPLER, SelfForcingSampler)
register_sampler(VIDEO_SAMPLER, VideoToVideoSampler)
