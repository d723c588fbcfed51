"""framekv.specs: msgspec structs describing geometries, models, rollouts and plans.

Every struct validates itself in ``__post_init__`` (on construction and on decoding)
and raises ValueError naming the field, the rule and the value. Presets ship as TOML
files and load with ``load_preset``.
"""
from .bench import BENCH_VARIANTS, BenchSpec
from .geometry import Geometry
from .kv import DTYPES, KVSpec
from .loading import decode_json, decode_toml, encode_json, list_presets, load, load_preset
from .model import ModelSpec
from .preset import Preset, WarmupOptions
from .rollout import RolloutSpec
from .warmup import WarmupEntry, WarmupPlan

__all__ = [
    "BENCH_VARIANTS",
    "BenchSpec",
    "DTYPES",
    "Geometry",
    "KVSpec",
    "ModelSpec",
    "Preset",
    "RolloutSpec",
    "WarmupEntry",
    "WarmupOptions",
    "WarmupPlan",
    "decode_json",
    "decode_toml",
    "encode_json",
    "list_presets",
    "load",
    "load_preset",
]
