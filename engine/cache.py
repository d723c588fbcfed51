"""The causal K/V cache: one paged pool, exact per-block windows, device-resident commit.

One rollout is one logical sequence [fixed region | rolling window | staged tokens]
in one pool shared by every layer (a page holds the same positions in all layers, so
eviction is one decision). The page layout and its rules are in ``layout.py``; this
module owns the memory and the crossing to the device:

    pool (arena)   [L, 2, pages, tokens_per_page, H_kv, D]     K at [:, 0], V at [:, 1]
    per geometry   counters [4] int64 (committed, ring_base, ring shift, pad)
    (arena)        table [F + R] int64, and per block size: rows, seq_len_kv,
                   seq_len_q, staged scatter lists; committed copy list (all sizes)

``commit(n)`` on a CUDA device is four kernels that read only device memory:
advance the counters, rotate the ring (``rotate_rows_``), rebuild every per-block
tensor (``causal_layout_``), copy the committed private slots (``copy_kv_slots_``).
The host keeps a mirror advanced by the same rule and never reads the device back,
so a commit captured once in a CUDA graph replays for every later chunk.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from framekv.specs import Geometry

from ._cache_rw import CacheWrites
from .arena import DEVICE_CHUNK_BYTES, carved_bytes, make_arena, round_up
from .layout import FLAT_FIELDS, HostLayout, LayoutPlan

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Address space reserved beyond the pool for per-geometry state. Reserving costs no
#: memory; only what a geometry carves is mapped.
_STATE_RESERVE_BYTES = 4 << 30
_NUM_COUNTERS = 4  # committed, ring_base, ring shift, pad (keeps 32-byte alignment)


def _state_specs(plan: LayoutPlan) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every tensor a geometry carves, in carve order; sizing and carving share it.

    Per-block tensors of all block sizes are flat (``LayoutPlan.descriptor`` gives
    each size's offsets) so one ``causal_layout_`` launch rewrites them all.
    """
    rows, blocks, staged, committed = plan.flat_sizes()
    return [("counters", (_NUM_COUNTERS,), torch.int64),
            ("table", (plan.table_len,), torch.int64),
            ("desc", tuple(plan.descriptor().shape), torch.int64),
            ("rows", (rows,), torch.int32),
            ("seq_len_kv", (blocks,), torch.int32),
            ("seq_len_q", (blocks,), torch.int32),
            ("staged_src", (staged,), torch.int64),
            ("staged_dst", (staged,), torch.int64),
            ("staged_dst2", (staged,), torch.int64),
            ("committed_src", (committed,), torch.int64),
            ("committed_dst", (committed,), torch.int64)]


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@dataclass
class BlockTensors:
    """Device tensors of one block size (fixed addresses; rewritten in place at commit).

    rows: int32 [nb, row_pages] page ids; seq_len_kv / seq_len_q: int32 [nb];
    staged_src / staged_dst / staged_dst2: int64 [M + nb * current_len], the scatter
    list of a forward (see ``layout.BlockLayout``).
    """

    block_size: int
    rows: torch.Tensor
    seq_len_kv: torch.Tensor
    seq_len_q: torch.Tensor
    staged_src: torch.Tensor
    staged_dst: torch.Tensor
    staged_dst2: torch.Tensor


@dataclass
class GeometryState:
    """A geometry's tensors in the arena and its host mirror; survives close()."""

    plan: LayoutPlan
    host: HostLayout
    flat: dict[str, torch.Tensor]  # counters, table, desc and the flat per-block tensors
    blocks: dict[int, BlockTensors]
    launchers: dict = field(default_factory=dict)  # bound kernels, built on first use

    @property
    def counters(self) -> torch.Tensor:
        """int64 [4]: committed, ring_base, ring shift, pad (advanced on the device)."""
        return self.flat["counters"]

    @property
    def table(self) -> torch.Tensor:
        """int64 [F + R]: fixed pages, then the ring."""
        return self.flat["table"]


def _block_views(plan: LayoutPlan, t: dict[str, torch.Tensor]) -> dict[int, BlockTensors]:
    """Per-block-size views into the flat tensors (same bytes, fixed addresses)."""
    out = {}
    for bp, d in zip(plan.blocks, plan.descriptor().tolist()):
        nb, rp, rows_off, blocks_off, staged_off = d[1], d[2], d[7], d[8], d[9]
        sl = slice(staged_off, staged_off + bp.staged_len)
        out[bp.block_size] = BlockTensors(
            bp.block_size, t["rows"][rows_off:rows_off + nb * rp].view(nb, rp),
            t["seq_len_kv"][blocks_off:blocks_off + nb], t["seq_len_q"][blocks_off:blocks_off + nb],
            t["staged_src"][sl], t["staged_dst"][sl], t["staged_dst2"][sl])
    return out


class CausalKVCache(CacheWrites):
    """Paged K/V cache of one rollout: pinned prefix, rolling window, staged tokens.

    Args (keyword-only):
        num_layers, num_kv_heads, head_dim: K/V shape per token and layer.
        dtype: torch.bfloat16 / torch.float16 (any device) or torch.float32 (CPU only).
        tokens_per_page: a power of two.
        pool_tokens: slots of the pool; ``pool_tokens_for(geometry, tokens_per_page)``
            gives what a geometry needs (every private page included).
        device: "cpu" or a CUDA device.

    The constructor owns the pool; ``open(geometry)`` starts a rollout; ``close()``
    ends it and keeps the geometry's device state, so graphs captured over it replay
    after a later ``open`` of the same geometry; ``shutdown()`` frees everything.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, tokens_per_page: int, pool_tokens: int, device):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("pool_tokens", pool_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        _check_tpp(tokens_per_page)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if dtype not in _DTYPES or (dtype == torch.float32 and self.device.type != "cpu"):
            allowed = "bfloat16, float16" + (", float32" if self.device.type == "cpu" else "")
            raise ValueError(f"dtype must be one of {allowed} on {self.device.type}, got {dtype}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.tokens_per_page = dtype, tokens_per_page
        self.num_pages = -(-pool_tokens // tokens_per_page)
        shape = (num_layers, 2, self.num_pages, tokens_per_page, num_kv_heads, head_dim)
        pool_nbytes = _nbytes(shape, dtype)
        self._arena = make_arena(self.device, pool_nbytes + _STATE_RESERVE_BYTES)
        self._pool = self._arena.empty(shape, dtype, name="kv_pool")
        slots = self.num_pages * tokens_per_page
        # [L, slots, H_kv, D] views: a slot id addresses the same token in every layer.
        self.k_pool = self._pool[:, 0].view(num_layers, slots, num_kv_heads, head_dim)
        self.v_pool = self._pool[:, 1].view(num_layers, slots, num_kv_heads, head_dim)
        self._states: dict[Geometry, GeometryState] = {}
        self._open: GeometryState | None = None
        #: Changes whenever the per-block tensors may change (open, each commit call):
        #: whoever derives tensors from them rebuilds when it differs from last time.
        self.layout_epoch = 0

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def pool_tokens_for(geometry: Geometry, tokens_per_page: int) -> int:
        """Pool slots ``geometry`` needs: fixed pages, the ring, every private page."""
        _check_geometry(geometry)
        _check_tpp(tokens_per_page)
        return LayoutPlan.for_geometry(geometry, tokens_per_page).pool_tokens

    @staticmethod
    def pool_bytes_for(geometry: Geometry, *, num_layers: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, tokens_per_page: int) -> int:
        """Device bytes a cache sized for ``geometry`` maps once it is opened.

        The pool, the geometry's state tensors and arena alignment, rounded up to
        the 2 MiB mapping chunk: exactly what the driver hands out.
        """
        plan = LayoutPlan.for_geometry(geometry, tokens_per_page)
        shape = (num_layers, 2, plan.total_pages, tokens_per_page, num_kv_heads, head_dim)
        sizes = [_nbytes(shape, dtype)] + [_nbytes(s, d) for _, s, d in _state_specs(plan)]
        return round_up(carved_bytes(sizes), DEVICE_CHUNK_BYTES)

    @property
    def pool_bytes(self) -> int:
        """Bytes this cache's arena has mapped now (pool plus opened geometries' state)."""
        return self._arena.mapped_bytes

    @property
    def pool_tokens(self) -> int:
        """Slots in the pool."""
        return self.num_pages * self.tokens_per_page

    # ------------------------------------------------------------------ lifecycle
    @property
    def is_open(self) -> bool:
        return self._open is not None

    @property
    def geometry(self) -> Geometry | None:
        """The open geometry, or None."""
        return self._open.plan.geometry if self._open else None

    @property
    def committed_tokens(self) -> int:
        """C: positions committed in the open rollout (from the host mirror)."""
        return self._require_open().host.committed

    @property
    def staged_tokens(self) -> int:
        """Tokens written since the last commit (the most any forward wrote)."""
        return self._require_open().host.staged

    def open(self, geometry: Geometry) -> None:
        """Start a rollout of ``geometry`` at position 0.

        The geometry's tensors are carved the first time and reused after, at the
        same addresses. Raises ValueError (already open, a bad geometry, or a pool
        too small: the message says how many tokens are needed and available); a
        failed open leaves nothing open and nothing allocated.
        """
        if self._arena.closed:
            raise RuntimeError("CausalKVCache was shut down")
        if self._open is not None:
            raise ValueError(f"a geometry is already open ({self._open.plan.geometry}); close() it first")
        _check_geometry(geometry)
        plan = LayoutPlan.for_geometry(geometry, self.tokens_per_page)
        if plan.total_pages > self.num_pages:
            raise ValueError(
                f"pool too small for {geometry}: it needs {plan.pool_tokens} tokens "
                f"({plan.total_pages} pages of {self.tokens_per_page}), the pool has "
                f"{self.pool_tokens}")
        state = self._states.get(geometry) or self._carve_state(plan)
        self._reset_state(state)
        self._states[geometry] = state
        self._open = state
        self.layout_epoch += 1

    def close(self) -> None:
        """End the rollout; the geometry's device state stays for a later open."""
        self._open = None

    def shutdown(self) -> None:
        """Free the pool and every geometry's state; the cache is unusable after."""
        self._open = None
        self._states.clear()
        self._pool = self.k_pool = self.v_pool = None
        self._arena.close()

    def _carve_state(self, plan: LayoutPlan) -> GeometryState:
        mark = self._arena.mark()
        try:
            t = {name: self._arena.empty(shape, dtype, name=name)
                 for name, shape, dtype in _state_specs(plan)}
        except Exception:
            self._arena.release_to(mark)  # all or nothing
            raise
        t["desc"].copy_(torch.from_numpy(plan.descriptor()))
        return GeometryState(plan=plan, host=HostLayout(plan), flat=t, blocks=_block_views(plan, t))

    def _reset_state(self, state: GeometryState) -> None:
        """Position 0: host mirror and device tensors from the host model (an upload
        at open is fine; commits never upload)."""
        state.host.reset()
        h = state.host
        state.counters.copy_(torch.tensor([h.committed, h.ring_base, 0, 0], dtype=torch.int64))
        self._upload_layout(state)

    def _upload_layout(self, state: GeometryState) -> None:
        """Host model -> the geometry's tensors (open, and every commit on CPU)."""
        state.table.copy_(torch.from_numpy(np.ascontiguousarray(state.host.table)))
        flat = state.host.flat_layout()
        for name in FLAT_FIELDS:
            state.flat[name].copy_(torch.from_numpy(np.ascontiguousarray(getattr(flat, name))))

    def _require_open(self) -> GeometryState:
        if self._open is None:
            raise ValueError("no geometry is open; call open(geometry) first")
        return self._open

    # ------------------------------------------------------------------ accessors
    def block_tensors(self, causal_block_size: int) -> BlockTensors:
        """The open geometry's per-block tensors of a declared block size."""
        state = self._require_open()
        state.plan.block(causal_block_size)  # ValueError naming the declared sizes
        return state.blocks[causal_block_size]

    def page_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [pages, H_kv, tokens_per_page, D] strided views."""
        self._check_layer(layer)
        shape = (self.num_pages, self.tokens_per_page, self.num_kv_heads, self.head_dim)
        k = self.k_pool[layer].view(shape).permute(0, 2, 1, 3)
        v = self.v_pool[layer].view(shape).permute(0, 2, 1, 3)
        return k, v

    def slot_of(self, position: int) -> int:
        """Pool slot of a resident position (host mirror)."""
        return self._require_open().host.slot_of(position)

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")


def _check_tpp(tpp) -> None:
    if isinstance(tpp, bool) or not isinstance(tpp, int) or tpp < 1 or tpp & (tpp - 1):
        raise ValueError(f"tokens_per_page must be a power of two, got {tpp!r}")


def _check_geometry(geometry) -> None:
    if not isinstance(geometry, Geometry):
        raise ValueError(f"geometry must be a framekv.specs.Geometry, got {type(geometry).__name__}")
