"""Presets: a model, a rollout and tool settings under one name."""
from __future__ import annotations

import msgspec

from .checks import check_instance, check_str
from .geometry import Geometry
from .model import ModelSpec
from .rollout import RolloutSpec


class WarmupOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Warm-up settings a preset carries (what to capture comes from its rollout).

    Attributes:
        cache_dir: where capture artefacts may be kept, or None.
    """

    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.cache_dir is not None:
            check_str("WarmupOptions", "cache_dir", self.cache_dir)


class Preset(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A named bundle the tools run: ``framekv demo --preset tiny``.

    Attributes:
        name: the preset's name (a shipped preset's name is its file's stem).
        model: the model shapes.
        rollout: the rollout; its tokens_per_frame must equal the model's.
        description: what the preset is for.
        warmup: warm-up settings.
    """

    name: str
    model: ModelSpec
    rollout: RolloutSpec
    description: str = ""
    warmup: WarmupOptions = msgspec.field(default_factory=WarmupOptions)

    def __post_init__(self) -> None:
        check_str("Preset", "name", self.name)
        check_instance("Preset", "model", self.model, ModelSpec)
        check_instance("Preset", "rollout", self.rollout, RolloutSpec)
        check_str("Preset", "description", self.description, nonempty=False)
        check_instance("Preset", "warmup", self.warmup, WarmupOptions)
        ours, theirs = self.rollout.tokens_per_frame, self.model.tokens_per_frame
        if ours != theirs:
            raise ValueError(
                f"Preset.rollout.tokens_per_frame must equal Preset.model.tokens_per_frame "
                f"({theirs}), got {ours}")

    def geometry(self) -> Geometry:
        """The cache geometry of the rollout."""
        return self.rollout.geometry()

