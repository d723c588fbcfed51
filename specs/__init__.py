"""framekv.specs: msgspec structs describing geometries, models, rollouts and presets.

Every struct validates itself in ``__post_init__`` (on construction and on decoding)
and raises ValueError naming the field, the rule and the value. Presets ship as TOML
files and load with ``load_preset``.
"""
from .geometry import Geometry
from .loading import decode_json, decode_toml, encode_json, list_presets, load, load_preset
from .model import DTYPES, ModelSpec
from .preset import Preset, WarmupOptions
from .rollout import RolloutSpec

__all__ = [
    "DTYPES",
    "Geometry",
    "ModelSpec",
    "Preset",
    "RolloutSpec",
    "WarmupOptions",
    "decode_json",
    "decode_toml",
    "encode_json",
    "list_presets",
    "load",
    "load_preset",
]
