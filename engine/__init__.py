"""framekv.engine: device arenas, the causal K/V cache, cached attention, the model."""
from .arena import (ArenaClosedError, ArenaError, ArenaExhaustedError, DeviceArena,
                    HostArena, make_arena)
from .attention import CachedAttention
from .attention_backends import AttentionBackend
from .cache import CausalKVCache

__all__ = ["AttentionBackend", "CachedAttention", "ArenaClosedError", "ArenaError", "ArenaExhaustedError", "CausalKVCache",
           "DeviceArena", "HostArena", "make_arena"]
