"""framekv.engine: device arenas, the causal K/V cache, cached attention, the models,
the chunk runner.

Wings (docs/DESIGN.md, "Map"): ``cache/`` (the paged cache, its layout plan and host
model, the fp32 reference), ``attention/`` (the layer module, backends, cuDNN,
split-KV, Ulysses), ``model/`` (the reference DiT), ``wan/`` (diffusers' Wan),
``models/`` (model families by name: what a command builds its model from); ``kv.py``
is the seam between a model and the K/V it attends (`KVStore`, `ForwardContext`);
``runner.py`` is the one chunk cycle (`ChunkRunner`), which `Rollout` (``rollout.py``)
and `WanRollout` adapt to their models, running a sampler of ``samplers/`` (the
`Sampler` protocol and its registry), and ``step.py`` the step it takes from a
scheduler (`StepPlan`); ``serving/`` steps streams on it (`StreamScheduler`).
"""
from .arena import (ArenaClosedError, ArenaError, ArenaExhaustedError, DeviceArena,
                    HostArena, make_arena)
from .attention import AttentionBackend, AttentionPlan, CachedAttention
from .cache import CausalKVCache, ExactWindowReference
from .kv import ForwardContext, KVStore, PagedKV, ReferenceKV
from .model import CausalVideoDiT
from .rollout import Rollout, WarmupResult, warm_up
from .runner import ChunkModel, ChunkRunner
from .serving import StreamScheduler
from .verify import ReferenceRollout, VerifyReport, verify_rollout
from .wan import WanRollout

__all__ = ["AttentionBackend", "AttentionPlan", "ArenaClosedError", "ArenaError",
           "ArenaExhaustedError", "CachedAttention", "CausalKVCache", "CausalVideoDiT", "ChunkModel", "ChunkRunner",
           "DeviceArena", "ExactWindowReference", "ForwardContext", "HostArena", "KVStore", "PagedKV",
           "ReferenceKV", "ReferenceRollout", "Rollout", "StreamScheduler", "VerifyReport", "WanRollout", "WarmupResult",
           "make_arena", "verify_rollout", "warm_up"]
