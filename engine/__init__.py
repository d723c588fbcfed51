"""framekv.engine: device arenas, the causal K/V cache, cached attention, the model."""
from .arena import (ArenaClosedError, ArenaError, ArenaExhaustedError, DeviceArena,
                    HostArena, make_arena)
from .attention import CachedAttention
from .attention_backends import AttentionBackend
from .cache import CausalKVCache
from .dense_rollout import DenseRollingKV, DenseRollout
from .model import CausalVideoDiT
from .rollout import Rollout
from .verify import ReferenceRollout, VerifyReport, verify_rollout

__all__ = ["AttentionBackend", "CachedAttention", "ArenaClosedError", "ArenaError", "ArenaExhaustedError", "CausalKVCache",
           "CausalVideoDiT", "DenseRollingKV", "DenseRollout", "DeviceArena", "HostArena",
           "ReferenceRollout", "Rollout", "VerifyReport", "make_arena", "verify_rollout"]
