"""The ``reference`` model family: the reference DiT (`CausalVideoDiT`) of a preset,
rolled out by `Rollout`.

A preset names the whole model (its shape, and its weights through the preset's seed),
so the family has no config, weights or checkpoint; it takes ``steps``, ``kv_dtype`` and
``gemm_dtype`` (`Rollout`'s), has no text encoder (its prompt is the model's own
tokens) and shows its latents as pictures (`LatentPreview`).
"""
from __future__ import annotations

from framekv.specs import load_preset

from ..rollout import Rollout, resolve_device, resolve_specs
from ..samplers import check_steps
from .family import LoadedModel, ModelFamily, ModelOptions, spelled

__all__ = ["ReferenceFamily", "ReferenceModel"]


class ReferenceFamily(ModelFamily):
    """The reference DiT of a preset (module doc)."""

    title = "the reference DiT of PRESET (weights drawn from the preset's seed)"
    default_preset = "tiny"
    options = frozenset({"steps", "kv_dtype", "gemm_dtype"})

    def check(self, options: ModelOptions, names=None) -> None:
        """A ValueError for a preset that is none, or ``steps`` beyond its steps."""
        super().check(options, names)
        _, _, rollout = resolve_specs(options.preset or self.default_preset)
        check_steps(options.steps, rollout.denoising_steps, name=spelled(names, "steps"))

    def load(self, options: ModelOptions, *, device=None, text_encoder: bool | None = None,
             decode: bool = True) -> "ReferenceModel":
        """The preset's model, described (`Rollout` builds it, weights from the seed)."""
        if text_encoder is True:
            raise ValueError(f"the {self.name} model family has no text encoder (its prompt "
                             f"is the model's own tokens): a text prompt needs a family with "
                             f"one, got text_encoder=True")
        self.check(options)
        preset = options.preset or self.default_preset
        if isinstance(preset, str) or hasattr(preset, "__fspath__"):
            preset = load_preset(preset)
        return ReferenceModel(self, options, preset, device=resolve_device(device))


class ReferenceModel(LoadedModel):
    """A preset's reference DiT (`ReferenceFamily.load`); ``preset`` the loaded preset."""

    def __init__(self, family: ReferenceFamily, options: ModelOptions, preset, *, device):
        name = resolve_specs(preset)[0]
        super().__init__(family, options, device=device, title=f"preset {name}")
        self.preset = preset

    def _rollout_args(self) -> dict:
        o = self.options
        return {"kv_dtype": o.kv_dtype, "steps": o.steps, "gemm_dtype": o.gemm_dtype}

    def rollout(self, **kwargs) -> Rollout:
        """The preset's `Rollout` on the model's device (``kwargs`` as `Rollout` takes)."""
        return Rollout(self.preset, self.device, **{**self._rollout_args(), **kwargs})

    def scheduler_args(self) -> dict:
        """The scheduler's own preset `Rollout`: the preset, its pool, GEMMs and steps."""
        return {"preset": self.preset, **self._rollout_args()}
