"""The causal K/V cache: one paged pool, exact per-block windows, device-resident commit.

One rollout is one logical sequence [fixed region | rolling window | staged tokens]
in one pool shared by every layer (a page holds the same positions in all layers, so
eviction is one decision). The page layout and its rules are in ``plan.py`` and
``host.py``, a geometry's tensors in ``state.py``; this module owns the memory and
the crossing to the kernels::

    pool (arena)   [L, 2, pages, tokens_per_page, H_kv, D]     K at [:, 0], V at [:, 1]

Hot path (every forward, every chunk): ``write_staged`` is one scatter launch;
``commit(n)`` on a CUDA device is four kernels that read only device memory: advance
the counters, rotate the ring (``rotate_rows_``), rebuild every per-block tensor
(``causal_layout_``), copy the committed private slots (``copy_kv_slots_``). The host
keeps a mirror advanced by the same rule and never reads the device back, so a commit
captured once in a CUDA graph replays for every later chunk. Edit path
(``write_range`` / ``zero_values``): host-built slot lists, uploaded per call.
"""
from __future__ import annotations

import contextlib

import torch

from framekv import ops
from framekv.specs import Geometry

from ..arena import DEVICE_CHUNK_BYTES, carved_bytes, make_arena, round_up
from .plan import LayoutPlan
from .state import BlockTensors, GeometryState, nbytes, state_specs

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Address space reserved beyond the pool for per-geometry state. Reserving costs no
#: memory; only what a geometry carves is mapped.
_STATE_RESERVE_BYTES = 4 << 30


class CausalKVCache:
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
        _check_sizes(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     pool_tokens=pool_tokens)
        _check_tpp(tokens_per_page)
        self.device = ops.resolve_device(device)
        _check_dtype(dtype, self.device)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.tokens_per_page = dtype, tokens_per_page
        self.num_pages = -(-pool_tokens // tokens_per_page)
        shape = (num_layers, 2, self.num_pages, tokens_per_page, num_kv_heads, head_dim)
        self._arena = make_arena(self.device, nbytes(shape, dtype) + _STATE_RESERVE_BYTES)
        self._pool = self._arena.empty(shape, dtype, name="kv_pool")
        slots = self.num_pages * tokens_per_page
        # [L, slots, H_kv, D] views: a slot id addresses the same token in every layer.
        self.k_pool = self._pool[:, 0].view(num_layers, slots, num_kv_heads, head_dim)
        self.v_pool = self._pool[:, 1].view(num_layers, slots, num_kv_heads, head_dim)
        self._states: dict[Geometry, GeometryState] = {}
        self._open: GeometryState | None = None

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
        _check_geometry(geometry)
        _check_sizes(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        _check_dtype(dtype, None)
        plan = LayoutPlan.for_geometry(geometry, tokens_per_page)
        shape = (num_layers, 2, plan.total_pages, tokens_per_page, num_kv_heads, head_dim)
        sizes = [nbytes(shape, dtype)] + [nbytes(s, d) for _, s, d in state_specs(plan)]
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
        self._check_alive()
        if self._open is not None:
            raise ValueError(f"a geometry is already open ({self._open.plan.geometry}); close() it first")
        _check_geometry(geometry)
        plan = LayoutPlan.for_geometry(geometry, self.tokens_per_page)
        if plan.total_pages > self.num_pages:
            raise ValueError(
                f"pool too small for {geometry}: it needs {plan.pool_tokens} tokens "
                f"({plan.total_pages} pages of {self.tokens_per_page}), the pool has "
                f"{self.pool_tokens}")
        state = self._states.get(geometry) or GeometryState.carve(self._arena, plan,
                                                                   self.num_layers)
        self._states[geometry] = state
        state.reset()  # a failure here leaves the cache closed; the next open resets again
        self._open = state

    def close(self) -> None:
        """End the rollout; the geometry's device state stays for a later open."""
        self._open = None

    def shutdown(self) -> None:
        """Free the pool and every geometry's state; the cache is unusable after."""
        self._open = None
        self._states.clear()
        self._pool = self.k_pool = self.v_pool = None
        self._arena.close()

    def _require_open(self) -> GeometryState:
        self._check_alive()
        if self._open is None:
            raise ValueError("no geometry is open; call open(geometry) first")
        return self._open

    def _check_alive(self) -> None:
        if self._arena.closed:
            raise RuntimeError("this CausalKVCache was shut down: its memory is freed; "
                               "build a new one")

    # ------------------------------------------------------------------ accessors
    def block_tensors(self, causal_block_size: int) -> BlockTensors:
        """The open geometry's per-block tensors of a declared block size."""
        state = self._require_open()
        state.plan.block(causal_block_size)  # ValueError naming the declared sizes
        return state.blocks[causal_block_size]

    def page_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [pages, H_kv, tokens_per_page, D] strided views."""
        self._check_alive()
        self._check_layer(layer)
        shape = (self.num_pages, self.tokens_per_page, self.num_kv_heads, self.head_dim)
        k = self.k_pool[layer].view(shape).permute(0, 2, 1, 3)
        v = self.v_pool[layer].view(shape).permute(0, 2, 1, 3)
        return k, v

    def slot_of(self, position: int) -> int:
        """Pool slot of a resident position (host mirror)."""
        return self._require_open().host.slot_of(position)

    # ------------------------------------------------------------------ forwards
    def write_staged(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                     causal_block_size: int) -> None:
        """Write this forward's T tokens of one layer at positions [C, C + T).

        Each token goes to its shared slot (read by later blocks and commits) and to
        its block's private slots; earlier blocks' tokens on a partly visible page
        are copied into later blocks' private slots (current_private). One launch.

        Args:
            layer: layer index.
            k, v: [T, H_kv, D] with any token/head strides (head dim contiguous), T a
                multiple of ``causal_block_size`` and <= max_staged_tokens.
            causal_block_size: a block size declared by the open geometry.
        """
        state = self._require_open()
        self._check_layer(layer)
        bt = self.block_tensors(causal_block_size)
        T = self._check_kv(k, v)
        M = state.plan.geometry.max_staged_tokens
        if T > M or T % causal_block_size:
            raise ValueError(
                f"k must hold a positive multiple of causal_block_size={causal_block_size} "
                f"tokens, at most max_staged_tokens={M}, got {T}")
        key = ("scatter", layer, causal_block_size)
        launch = state.launchers.get(key)
        if launch is None:
            launch = ops.bind_scatter_kv_slots(self.k_pool[layer], self.v_pool[layer],
                                               bt.staged_dst, bt.staged_dst2, bt.staged_src)
            state.launchers[key] = launch
        with torch.no_grad():  # a cache write never records autograd history
            launch(k.detach(), v.detach())
        state.host.note_staged(T, layer)

    def note_staged(self, tokens: int) -> None:
        """Advance the host mirror's staged count as a forward of ``tokens`` would.

        For replays of a captured forward: the graph writes every layer's K/V on the
        device, the host mirror learns of it here (it never reads the device back).
        """
        self._require_open().host.note_staged(tokens)

    # ------------------------------------------------------------------ commit
    def commit(self, n: int) -> None:
        """Make the first ``n`` staged tokens history: C += n, the window slides.

        All or nothing: ValueError (nothing changed) unless n is in [0, staged] and every
        layer staged n tokens since the last commit; if the device half fails part way,
        the host mirror and the device state are put back as they were and the error is
        raised again, so the same commit can be retried.
        """
        state = self._require_open()
        state.host.check_commit(n)
        snap = state.host.snapshot()
        try:
            state.host.commit(n)
            self.commit_device(n)
        except BaseException:
            self._recover(state, snap)
            raise

    def commit_mirror(self, n: int) -> None:
        """Advance the host mirror only (all or nothing): what a replay of a captured
        commit needs."""
        self._require_open().host.commit(n)

    def commit_device(self, n: int) -> None:
        """The device side of commit(n), safe to capture: no host-computed argument
        but the constant n, no upload, no synchronisation. On CPU it applies the
        host mirror (unless numba's simulator runs the kernels), so it must follow
        ``commit_mirror(n)``."""
        state = self._require_open()
        if ops.use_kernel(self._pool):  # CUDA, or numba's simulator on CPU
            _commit_kernels(state, n)
        else:
            state.upload_layout()
        ops.copy_kv_slots_(self.k_pool, self.v_pool, state.flat["committed_src"],
                           state.flat["committed_dst"])

    def _recover(self, state: GeometryState, snap: tuple) -> None:
        """After a failed commit: the host mirror back to ``snap``, the device state
        (counters, table, per-block tensors, committed private copies) rebuilt from it.
        The copies read only shared slots, which a commit never writes."""
        state.host.restore(snap)
        state.upload()
        src, dst = state.host.committed_copies()
        dev = self.device
        ops.copy_kv_slots_(self.k_pool, self.v_pool, torch.from_numpy(src).to(dev),
                           torch.from_numpy(dst).to(dev))

    # ------------------------------------------------------------------ edits
    def write_range(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite K/V of resident positions [start, start + T) of one layer.

        Committed positions' private copies are updated too, so the edit takes effect
        on the next forward. Staged positions are rewritten by every forward; an
        edit reaches the shared slot that the next commit reads. All or nothing: a
        failure part way puts back every slot it touched.
        """
        state = self._require_open()
        self._check_layer(layer)
        T = self._check_kv(k, v)
        src_rows, dst = state.host.edit_targets(start, T)
        rows, slots = (torch.from_numpy(a).to(self.device) for a in (src_rows, dst))
        with self._restoring(layer, slots):
            ops.scatter_kv_slots_(self.k_pool[layer], self.v_pool[layer], k.detach(),
                                  v.detach(), slots, None, rows)

    def zero_values(self, layer: int, start: int, n: int) -> None:
        """Zero V (not K) of resident positions [start, start + n) of one layer,
        private copies included (all or nothing)."""
        state = self._require_open()
        self._check_layer(layer)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        _, dst = state.host.edit_targets(start, n)
        slots = torch.from_numpy(dst).to(self.device)
        with self._restoring(layer, slots):
            self.v_pool[layer].index_fill_(0, slots, 0)

    @contextlib.contextmanager
    def _restoring(self, layer: int, slots: torch.Tensor):
        """Keep the K/V of ``slots`` of ``layer``; put them back if the block raises."""
        with torch.no_grad():
            k_old, v_old = self.k_pool[layer][slots], self.v_pool[layer][slots]  # [n, H_kv, D]
            try:
                yield
            except BaseException:
                self.k_pool[layer].index_copy_(0, slots, k_old)
                self.v_pool[layer].index_copy_(0, slots, v_old)
                raise

    # ------------------------------------------------------------------ checks
    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")

    def _check_kv(self, k, v) -> int:
        want = (self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != want or t.shape[0] < 1:
                raise ValueError(f"{name} must have shape [T >= 1, {want[0]}, {want[1]}], "
                                 f"got {list(t.shape)}")
            if t.dtype != self.dtype:
                raise ValueError(f"{name} must have dtype {self.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        return int(k.shape[0])


def _commit_kernels(state: GeometryState, n: int) -> None:
    """advance counters -> rotate the ring -> rebuild every per-block tensor."""
    plan, g, t = state.plan, state.plan.geometry, state.flat
    ops.advance_commit_(t["counters"], n, pin_tokens=g.pin_tokens,
                        window_tokens=g.window_tokens,
                        tokens_per_page=plan.tokens_per_page, fixed_pages=plan.fixed_pages)
    ops.rotate_rows_(t["table"][plan.fixed_pages:], t["counters"][2:3])
    ops.causal_layout_(t["counters"], t["table"], t["desc"], t["rows"], t["seq_len_kv"],
                       t["staged_src"], t["staged_dst"], t["staged_dst2"],
                       t["committed_src"], t["committed_dst"],
                       pin_tokens=g.pin_tokens, window_tokens=g.window_tokens,
                       max_staged_tokens=g.max_staged_tokens,
                       tokens_per_page=plan.tokens_per_page,
                       fixed_pages=plan.fixed_pages, ring_pages=plan.ring_pages)


def _check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_dtype(dtype, device: torch.device | None) -> None:
    """bf16/fp16 anywhere, fp32 on the CPU (``device`` None: any device)."""
    cpu = device is None or device.type == "cpu"
    if dtype not in _DTYPES or (dtype == torch.float32 and not cpu):
        allowed = "bfloat16, float16" + (", float32 (cpu)" if cpu else "")
        where = f" on {device.type}" if device is not None else ""
        raise ValueError(f"dtype must be one of {allowed}{where}, got {dtype}")


def _check_tpp(tpp) -> None:
    if isinstance(tpp, bool) or not isinstance(tpp, int) or tpp < 1 or tpp & (tpp - 1):
        raise ValueError(f"tokens_per_page must be a power of two, got {tpp!r}")


def _check_geometry(geometry) -> None:
    if not isinstance(geometry, Geometry):
        raise ValueError(f"geometry must be a framekv.specs.Geometry, got {type(geometry).__name__}")
