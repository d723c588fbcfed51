"""framekv.engine: device arenas, the causal K/V cache, cached attention, the model."""
from .arena import (ArenaClosedError, ArenaError, ArenaExhaustedError, DeviceArena,
                    HostArena, make_arena)

__all__ = ["ArenaClosedError", "ArenaError", "ArenaExhaustedError", "DeviceArena",
           "HostArena", "make_arena"]
