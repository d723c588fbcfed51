"""framekv.engine: device arenas, the causal K/V cache, cached attention, the model,
the rollout.

Wings (docs/DESIGN.md, "Map"): ``cache/`` (the paged cache, its layout plan and host
model, the fp32 reference), ``attention/`` (the layer module, backends, cuDNN,
split-KV, Ulysses), ``model/`` (the reference DiT); ``kv.py`` is the seam between a
model and the K/V it attends; ``rollout.py`` drives a model over a store chunk by chunk.
"""
from .arena import (ArenaClosedError, ArenaError, ArenaExhaustedError, DeviceArena,
                    HostArena, make_arena)
from .attention import AttentionBackend, AttentionPlan, CachedAttention
from .cache import CausalKVCache, ExactWindowReference
from .kv import KVStore, PagedKV, ReferenceKV
from .model import CausalVideoDiT
from .rollout import Rollout
from .verify import ReferenceRollout, VerifyReport, verify_rollout
from .warmup import WarmupResult, warm_up
from .wan import WanRollout

__all__ = ["AttentionBackend", "AttentionPlan", "ArenaClosedError", "ArenaError",
           "ArenaExhaustedError", "CachedAttention", "CausalKVCache", "CausalVideoDiT",
           "DeviceArena", "ExactWindowReference", "HostArena", "KVStore", "PagedKV",
           "ReferenceKV", "ReferenceRollout", "Rollout", "VerifyReport", "WanRollout", "WarmupResult",
           "make_arena", "verify_rollout", "warm_up"]
