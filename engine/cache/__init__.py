"""The cache wing: the paged causal K/V cache and everything that draws its pages.

- `CausalKVCache` (``cache.py``): the pool, open/close, staged writes, commit, edits.
- `LayoutPlan` (``plan.py``): the static sizes of one geometry's layout and the integer
  rules every layer shares (pure functions of geometry, page size and C).
- ``host.py``: the host model of the layout, the specification the ``causal_layout_``
  kernel follows; `HostLayout` (``mirror.py``): the rollout state's host mirror.
- `GeometryState` / `BlockTensors` (``state.py``): one geometry's tensors in the arena.
- `SequenceSnapshot` (``snapshot.py``): a sequence on the host (C and its kept K/V),
  saved through ``tensorfile.py`` (safetensors layout, versioned header, CRC).
- `ExactWindowReference` (``reference.py``): the fp32 oracle over exactly V(j), with
  `visible_positions`, the one definition of the keys a block sees.
"""
from .cache import CausalKVCache
from .host import BlockLayout, FlatLayout, build_block_layout, build_block_layout_looped
from .mirror import HostLayout
from .plan import BlockPlan, LayoutPlan, pool_tokens_for, ring_base_for
from .reference import ExactWindowReference, visible_positions
from .snapshot import SequenceSnapshot
from .state import BlockTensors, GeometryState
from .tensorfile import CorruptFile

__all__ = ["BlockLayout", "BlockPlan", "BlockTensors", "CausalKVCache", "CorruptFile",
           "ExactWindowReference",
           "FlatLayout", "GeometryState", "HostLayout", "LayoutPlan", "build_block_layout",
           "build_block_layout_looped", "pool_tokens_for", "ring_base_for",
           "SequenceSnapshot", "visible_positions"]
