"""The causal K/V cache: one paged pool, exact per-block windows, device-resident commit.

One rollout is one logical sequence [fixed region | rolling window | staged tokens]
in one pool shared by every layer (a page holds the same positions in all layers, so
eviction is one decision). A pool may hold N independent sequences (``num_sequences``:
concurrent streams, the two branches of classifier-free guidance), each with its own
pages, commit count and ring; a forward over B of them is one launch per layer
(``sequences.py``). The page layout and its rules are in ``plan.py`` and ``host.py``,
a sequence's tensors in ``state.py``; this module owns the memory and the crossing
to the kernels::

    pool (arena)   [L, 2, pages, tokens_per_page, H_kv, D]     K at [:, 0], V at [:, 1]

Sequences: ``sequences`` is always host ints. The sequences in use (`use_sequences`,
default every one, in order) are what forwards and commits act on: batch row r of a
forward is sequence ``sequences[r]``. They are also kept in a fixed device buffer,
written only when they change, which the device work reads when it runs; so a forward
or commit captured once in a CUDA graph serves any choice of as many sequences (set
them, then replay).

Hot path (every forward, every chunk): ``write_staged`` is one scatter launch; a
commit has two halves, one path for any number of sequences::

    commit(n)          commit_host(n), then commit_device(n); all or nothing
    commit_host(n)     each sequence's host mirror: C += n, the ring (never reads back)
    commit_device(n)   on a CUDA device, kernels that read only device memory: advance
                       the counters of the sequences in use, rotate the rings
                       (``rotate_rows_``), rebuild every per-block tensor
                       (``causal_layout_``), copy the committed private slots
                       (``copy_kv_slots_``)

A chunk captured with its commit replays the device half; its replay hook runs
``note_staged`` and ``commit_host``. Edit path (``write_range`` / ``zero_values``, several
of them all or nothing inside ``keeping``): host-built slot lists, uploaded per call.
A sequence that starts over (``open``, ``reset_sequences``) has every page it owns
zeroed: nothing of an earlier rollout, a NaN included, is left where a kernel reads,
not even a padding slot it masks.

Snapshots (`export_sequence`, `import_sequence`; ``snapshot.py``): a sequence between
chunks leaves the pool as its visible K/V and C, copied out on a side stream, and comes
back into any sequence of a pool of the same geometry. Until an export's copy has run,
the device work that could write its pages (that sequence put in use, reset, edited or
imported into) waits for it on the device, never on the host.

One file: the cache's public surface (sizing, lifecycle, sequences, forwards, commit,
edits) is one object; its rules, states and batches live in the modules beside it.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from framekv import ops
from framekv.specs import Geometry

from ..arena import DEVICE_CHUNK_BYTES, carved_bytes, make_arena, round_up
from . import quant
from .plan import LayoutPlan
from .plan import ring_base_for
from .sequences import PoolState, Selection, batch_bytes_specs, check_rows, flat_rows
from .snapshot import (SequenceSnapshot, describe_pool, gather, kept_positions,
                       reserve_pinned, scatter)
from .state import BlockTensors, GeometryState, nbytes, state_specs

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, quant.FP8)
#: What a forward's K and V may be over an fp8 pool (quantized as they are written).
_FP8_INPUTS = (torch.bfloat16, torch.float16, torch.float32)
#: Address space reserved beyond the pool for per-geometry state. Reserving costs no
#: memory; only what a geometry carves is mapped.
_STATE_RESERVE_BYTES = 4 << 30


class CausalKVCache:
    """Paged K/V cache of one rollout: pinned prefix, rolling window, staged tokens.

    Args (keyword-only):
        num_layers, num_kv_heads, head_dim: K/V shape per token and layer.
        dtype: the pool's dtype: torch.bfloat16 / torch.float16 (any device),
            torch.float32 (CPU only) or torch.float8_e4m3fn (any device: fp8 K/V,
            ``quant.py``; the K/V written stay bf16, fp16 or fp32 and are quantized
            with the per layer, K/V and head ``kv_scales`` as they are written).
        tokens_per_page: a power of two.
        pool_tokens: slots of the pool; ``pool_tokens_for(geometry, tokens_per_page,
            num_sequences=N)`` gives what a geometry needs (every private page included).
        device: "cpu" or a CUDA device.
        num_sequences: N independent sequences on the pool (default 1). Forwards and
            commits act on the sequences in use (`use_sequences`; module doc).

    The constructor owns the pool; ``open(geometry)`` starts a rollout; ``close()``
    ends it and keeps the geometry's device state, so graphs captured over it replay
    after a later ``open`` of the same geometry; ``shutdown()`` frees everything.
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, tokens_per_page: int, pool_tokens: int, device,
                 num_sequences: int = 1):
        _check_sizes(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     pool_tokens=pool_tokens, num_sequences=num_sequences)
        self.num_sequences = num_sequences
        _check_tpp(tokens_per_page)
        self.device = ops.resolve_device(device)
        _check_dtype(dtype, self.device)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.tokens_per_page = dtype, tokens_per_page
        self.quantized = quant.is_fp8(dtype)
        self.num_pages = -(-pool_tokens // tokens_per_page)
        shape = (num_layers, 2, self.num_pages, tokens_per_page, num_kv_heads, head_dim)
        self._arena = make_arena(self.device, nbytes(shape, dtype) + _STATE_RESERVE_BYTES)
        self._pool = self._arena.empty(shape, dtype, name="kv_pool")
        # fp8: scales and statistics at fixed addresses (graphs read them at replay).
        self.kv_scales = self.kv_amax = self.kv_saturated = None
        self._scales_host = None   # kv_scales as host lists: describe() never syncs
        if self.quantized:
            self.kv_scales = self._arena.empty((num_layers, 2, num_kv_heads), torch.float32,
                                               name="kv_scales").fill_(1.0)
            self.kv_amax = self._arena.zeros((num_layers, 2, num_kv_heads), torch.float32,
                                             name="kv_amax")
            self.kv_saturated = self._arena.zeros((num_layers, 2), torch.int64,
                                                  name="kv_saturated")
            self._scales_host = self.kv_scales.tolist()
        slots = self.num_pages * tokens_per_page
        # [L, slots, H_kv, D] views: a slot id addresses the same token in every layer.
        self.k_pool = self._pool[:, 0].view(num_layers, slots, num_kv_heads, head_dim)
        self.v_pool = self._pool[:, 1].view(num_layers, slots, num_kv_heads, head_dim)
        self._states: dict[Geometry, PoolState] = {}
        self._open: PoolState | None = None
        self._exports: dict[int, object] = {}   # sequence -> CUDA event of its export copy
        self._export_side = None                # the CUDA stream exports copy on, in order

    # ------------------------------------------------------------------ sizing
    @staticmethod
    def pool_tokens_for(geometry: Geometry, tokens_per_page: int, *,
                        num_sequences: int = 1) -> int:
        """Pool slots ``geometry`` needs for ``num_sequences`` sequences: each its fixed
        pages, ring and every private page."""
        _check_geometry(geometry)
        _check_tpp(tokens_per_page)
        _check_sizes(num_sequences=num_sequences)
        return num_sequences * LayoutPlan.for_geometry(geometry, tokens_per_page).pool_tokens

    @staticmethod
    def pool_bytes_for(geometry: Geometry, *, num_layers: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, tokens_per_page: int,
                       num_sequences: int = 1) -> int:
        """Device bytes a cache sized for ``geometry`` and ``num_sequences`` maps once
        it is opened.

        The pool (one byte a value for fp8), an fp8 pool's scales and statistics,
        every sequence's state tensors, the batch buffers and arena alignment, rounded
        up to the 2 MiB mapping chunk: exactly what the driver hands out.
        """
        _check_geometry(geometry)
        _check_sizes(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     num_sequences=num_sequences)
        _check_dtype(dtype, None)
        N = num_sequences
        plan = LayoutPlan.for_geometry(geometry, tokens_per_page)
        shape = (num_layers, 2, N * plan.total_pages, tokens_per_page, num_kv_heads, head_dim)
        sizes = [nbytes(shape, dtype)] + _stats_sizes(num_layers, num_kv_heads, dtype)
        sizes += [nbytes((N, *s), d) for _, s, d in state_specs(plan)]
        sizes += [nbytes(s, d) for s, d in batch_bytes_specs(plan, N)]
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
        """C of sequence 0: positions committed in its rollout (from the host mirror)."""
        return self._seq(0).host.committed

    @property
    def staged_tokens(self) -> int:
        """Tokens sequence 0 wrote since its last commit (the most any forward wrote)."""
        return self._seq(0).host.staged

    def sequence_committed_tokens(self, i: int) -> int:
        """C of sequence ``i``: positions committed in its rollout (host mirror, no sync)."""
        return self._seq(i).host.committed

    def sequence_staged_tokens(self, i: int) -> int:
        """Tokens sequence ``i`` wrote since its last commit."""
        return self._seq(i).host.staged

    def open(self, geometry: Geometry) -> None:
        """Start a rollout of ``geometry`` at position 0, every sequence in use, the
        pages of every sequence zero (K and V, every layer).

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
        N = self.num_sequences
        if N * plan.total_pages > self.num_pages:
            raise ValueError(
                f"pool too small for {geometry} x {N} sequences: it needs "
                f"{N * plan.pool_tokens} tokens ({N} x {plan.total_pages} pages of "
                f"{self.tokens_per_page}), the pool has {self.pool_tokens}")
        state = self._states.get(geometry) or PoolState.carve(self._arena, plan,
                                                              self.num_layers, N)
        self._states[geometry] = state
        # A failure here leaves the cache closed; the next open resets again.
        self._zero_pages(state, range(N))
        state.reset(range(N))
        state.use(range(N))
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

    def _require_open(self) -> PoolState:
        if self._open is None:           # shut down (it closes first) or never opened
            self._check_alive()
            raise ValueError("no geometry is open; call open(geometry) first")
        return self._open

    def _seq(self, i: int) -> GeometryState:
        pool = self._require_open()
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_sequences:
            raise ValueError(f"sequence must be an integer in [0, {self.num_sequences}), "
                             f"got {i!r}")
        return pool.seqs[i]

    def _check_alive(self) -> None:
        if self._arena.closed:
            raise RuntimeError("this CausalKVCache was shut down: its memory is freed; "
                               "build a new one")

    # ------------------------------------------------------------------ fp8 scales
    def set_kv_scales(self, scales) -> None:
        """Set an fp8 pool's scales (``quant.py``): a positive finite number, or fp32
        values broadcastable to [L, 2, H_kv] (K at [:, 0], V at [:, 1]). Written in
        place (captured graphs read the new values). Only while no sequence holds K/V
        (closed, or every sequence at position 0 with nothing staged): the stored bytes
        mean nothing under other scales. ValueError otherwise, nothing changed."""
        self._check_scalable("set_kv_scales")
        want = (self.num_layers, 2, self.num_kv_heads)
        try:
            new = torch.as_tensor(scales, dtype=torch.float32).to(self.device).expand(want)
        except (RuntimeError, TypeError, ValueError):
            got = list(scales.shape) if isinstance(scales, torch.Tensor) else repr(scales)
            raise ValueError(f"scales must be a number or values broadcastable to "
                             f"{list(want)} (layers, K/V, heads), got {got}") from None
        if not bool(torch.isfinite(new).all()) or not bool((new > 0).all()):
            raise ValueError("scales must be positive and finite, got "
                             f"min {float(new.min())}, max {float(new.max())}")
        self.kv_scales.copy_(new)
        self._scales_host = self.kv_scales.tolist()

    def calibrate_kv_scales(self, margin: float = 2.0) -> None:
        """Scales from what the pool has seen since the statistics were last reset:
        each head's amax * ``margin`` maps to 448 (a head never written keeps its
        scale). Same conditions as `set_kv_scales`; then the statistics restart."""
        self._check_scalable("calibrate_kv_scales")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1:
            raise ValueError(f"margin must be a number >= 1, got {margin!r}")
        self.kv_scales.copy_(quant.scales_from_amax(self.kv_amax, self.kv_scales, margin))
        self._scales_host = self.kv_scales.tolist()
        self.reset_kv_stats()

    def kv_stats(self) -> dict | None:
        """An fp8 pool's statistics on the host (synchronises): ``saturated`` [L][2]
        counts of saturated values (K, V), ``amax`` and ``scales`` [L][2][H_kv];
        None for a pool that is not fp8."""
        if not self.quantized:
            return None
        return {"dtype": str(self.dtype).removeprefix("torch."),
                "saturated": self.kv_saturated.tolist(), "amax": self.kv_amax.tolist(),
                "scales": self.kv_scales.tolist()}

    def reset_kv_stats(self) -> None:
        """Zero an fp8 pool's amax and saturation counts (no-op otherwise)."""
        if self.quantized:
            self.kv_amax.zero_()
            self.kv_saturated.zero_()

    def _check_scalable(self, what: str) -> None:
        self._check_alive()
        if not self.quantized:
            raise ValueError(f"{what} needs an fp8 pool (dtype torch.float8_e4m3fn), this "
                             f"one is {self.dtype}")
        held = [i for i, st in enumerate(self._open.seqs) if st.host.committed or st.host.staged
                ] if self._open is not None else []
        if held:
            raise ValueError(f"{what} while sequences {held} hold K/V: their bytes were "
                             "quantized with the current scales; reset them first")

    def _stage_extra(self, layer: int) -> dict:
        """What the fused staging needs beyond the slots: an fp8 pool's layer scales
        and statistics (`framekv.ops.qk_norm_rope_stage_`'s kv_scale, kv_amax,
        saturated)."""
        if not self.quantized:
            return {}
        return {"kv_scale": self.kv_scales[layer], "kv_amax": self.kv_amax[layer],
                "saturated": self.kv_saturated[layer]}

    def _quantize(self, layer: int, kind: int, x: torch.Tensor) -> torch.Tensor:
        """Rows [E, H_kv, D] as the pool stores them (fp8: quantized, statistics kept)."""
        if not self.quantized:
            return x
        return quant.quantize(x, self.kv_scales[layer, kind], self.kv_amax[layer, kind],
                              self.kv_saturated[layer, kind])

    # ------------------------------------------------------------------ accessors
    def block_tensors(self, causal_block_size: int, sequence: int = 0) -> BlockTensors:
        """The per-block tensors of a declared block size of one sequence."""
        state = self._seq(sequence)
        state.plan.block(causal_block_size)  # ValueError naming the declared sizes
        return state.blocks[causal_block_size]

    def batch_blocks(self, batch: int, causal_block_size: int, tokens: int) -> BlockTensors:
        """What a forward of ``tokens`` rows per sequence over ``batch`` sequences reads:
        block j of batch row r at r * nb + j, at fixed addresses, refreshed by every
        `select` (sequence 0's own tensors when the pool holds one sequence)."""
        pool = self._require_open()
        pool.plan.block(causal_block_size)
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= self.num_sequences:
            raise ValueError(f"batch must hold 1 to num_sequences={self.num_sequences} "
                             f"sequences, got {batch!r}")
        return pool.batch_view(batch, causal_block_size, tokens)

    def page_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [pages, H_kv, tokens_per_page, D] strided views."""
        self._check_alive()
        self._check_layer(layer)
        shape = (self.num_pages, self.tokens_per_page, self.num_kv_heads, self.head_dim)
        k = self.k_pool[layer].view(shape).permute(0, 2, 1, 3)
        v = self.v_pool[layer].view(shape).permute(0, 2, 1, 3)
        return k, v

    def slot_of(self, position: int, sequence: int = 0) -> int:
        """Pool slot of a resident position of one sequence (host mirror)."""
        return self._seq(sequence).host.slot_of(position)

    # ------------------------------------------------------------------ sequences
    @property
    def sequences(self) -> tuple[int, ...]:
        """The sequences in use (host ints; batch row r of a forward is sequences[r])."""
        return self._require_open().rows

    @property
    def sequence_ids(self) -> torch.Tensor:
        """The sequences in use as int64 [B] on the cache's device: the fixed buffer the
        device work reads (graph replays read its contents then)."""
        return self._require_open().ids

    def use_sequences(self, sequences) -> None:
        """Make ``sequences`` (host ints: distinct, in [0, num_sequences)) the ones the
        next forwards and commits act on, batch row r on sequences[r]. Kept on the
        device in a fixed buffer that captured graphs read, written only when they
        change: set them before capturing or replaying a graph (a change during a
        capture is a ValueError)."""
        pool = self._require_open()
        self._fence(sequences)
        pool.use(sequences)

    def _rows(self, sequences) -> PoolState:
        """The open pool state with ``sequences`` in use (None: those already in use)."""
        pool = self._require_open()
        if sequences is not None:
            self._fence(sequences)
            pool.use(sequences)
        return pool

    def select(self, causal_block_size: int, tokens: int, *, sequences=None) -> Selection:
        """The `Selection` of a forward of ``tokens`` rows per sequence over the
        sequences in use (``sequences``: use these first): their per-block tensors
        gathered on the device. A forward selects once and passes it to every layer."""
        pool = self._rows(sequences)
        pool.plan.block(causal_block_size)
        M = pool.plan.geometry.max_staged_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= M:
            raise ValueError(f"tokens must be an integer in [1, {M}], got {tokens!r}")
        return Selection(cache=self, rows=pool.rows, block_size=causal_block_size,
                         tokens=tokens, blocks=pool.gather(causal_block_size, tokens))

    def reset_sequences(self, sequences) -> None:
        """Sequences ``sequences`` (host ints; every one: ``range(num_sequences)``) start
        over at position 0; the others keep their state. Every page they own (fixed,
        ring and private pages, K and V, every layer) is zeroed, so nothing of their
        past, a NaN or inf included, is left for a later forward to read, not even a
        padding slot a kernel masks. Graphs stay valid."""
        pool = self._require_open()
        if sequences is None:
            raise ValueError(f"sequences must name the sequences to reset (host ints; every "
                             f"one: range({self.num_sequences})), got None")
        rows = check_rows(sequences, self.num_sequences)
        self._zero_pages(pool, rows)
        pool.reset(rows)

    def _zero_pages(self, pool: PoolState, rows) -> None:
        """Zero K and V of every page sequences ``rows`` own in ``pool``'s layout."""
        pages = pool.plan.total_pages
        self._fence(rows)
        with torch.no_grad():
            for i in rows:
                base = pool.seqs[i].plan.page_base
                self._pool[:, :, base:base + pages].zero_()

    # ------------------------------------------------------------------ snapshots
    def describe(self) -> dict:
        """What a `SequenceSnapshot` must match to be imported here (geometry, K/V
        shape, dtype, an fp8 pool's scales), JSON-able."""
        return describe_pool(self._require_open().plan.geometry, self.num_layers,
                             self.num_kv_heads, self.head_dim, self.dtype,
                             self._scales_host)

    def export_sequence(self, i: int) -> SequenceSnapshot:
        """Sequence ``i`` (between chunks: nothing staged) as a `SequenceSnapshot`: C
        and the K/V of its visible positions in every layer, copied to pinned host
        memory on the cache's export stream (one for all exports: they copy in the
        order asked) behind the work queued so far (returns at once on a CUDA device;
        the snapshot's tensors wait for the copy). Reads only; the
        sequence goes on unchanged (module doc for what waits for the copy)."""
        state = self._seq(i)
        if state.host.staged:
            raise ValueError(f"sequence {i} has {state.host.staged} staged tokens: export it "
                             "between chunks (after a commit)")
        return self._export(i, state)

    def reserve_exports(self, count: int = 1) -> int:
        """Page-lock the host memory of ``count`` exports of a full window now (CUDA
        pools; none on the CPU), so that `export_sequence` copies at its steady speed
        from the first export on instead of page-locking its buffers as it goes.
        Returns the host bytes reserved. Call it after `open`."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        g = self._require_open().plan.geometry
        if self.device.type != "cuda":
            return 0
        n = len(kept_positions(g, g.pin_tokens + g.window_tokens + g.max_staged_tokens))
        dtype = torch.uint8 if self.quantized else self.dtype  # fp8 moves as bytes
        return reserve_pinned((self.num_layers, n, self.num_kv_heads, self.head_dim), dtype,
                              count)

    def _export(self, i: int, state: GeometryState) -> SequenceSnapshot:
        C = state.host.committed
        slots = torch.from_numpy(state.host.slots_of(kept_positions(state.plan.geometry, C)))
        if self.device.type == "cuda" and self._export_side is None:
            self._export_side = torch.cuda.Stream(self.device)
        # One stream for every export: they copy in the order asked, so a sequence's
        # latest export done (what `_fence` waits for) means its earlier ones are too.
        k, v, done = gather(self.k_pool, self.v_pool, slots.to(self.device), self._export_side)
        if done is not None:
            self._exports[i] = done
        return SequenceSnapshot(state.plan.geometry, self.num_layers, self.num_kv_heads,
                                self.head_dim, self.dtype, C, k, v, done,
                                self._scales_host)

    def import_sequence(self, i: int, snap: SequenceSnapshot) -> None:
        """Sequence ``i`` becomes ``snap``: at its C, its visible K/V written (private
        copies included), the other sequences untouched. ValueError naming every
        difference for a snapshot of another geometry, K/V shape or dtype (nothing
        changed). All or nothing: if a copy fails part way, sequence ``i`` is put back
        as it was (a sequence under way is exported first to be written back; one at
        position 0, or one whose write-back fails too, starts over with its pages
        zeroed) and the error raised again."""
        state = self._seq(i)
        if not isinstance(snap, SequenceSnapshot):
            raise ValueError(f"snap must be a SequenceSnapshot, got {type(snap).__name__}")
        snap.check_fits(self.describe())
        backup = self._export(i, state) if state.host.committed else None
        try:
            self._write_snapshot(i, state, snap)
        except BaseException:
            try:
                if backup is None:
                    raise
                self._write_snapshot(i, state, backup)
            except BaseException:   # nothing to put back, or that failed too: start over
                self._zero_pages(self._open, [i])
                state.reset()
            raise

    def _write_snapshot(self, i: int, state: GeometryState, snap: SequenceSnapshot) -> None:
        """Sequence ``i`` zeroed, then at C = snap.committed with its visible K/V in
        their shared slots, the private copies and the device layout rebuilt."""
        self._zero_pages(self._open, [i])
        C, plan = snap.committed, state.plan
        L = self.num_layers
        state.host.restore((C, ring_base_for(plan, C),
                            plan.page_base + np.arange(plan.table_len, dtype=np.int64), [0] * L))
        slots = torch.from_numpy(state.host.slots_of(snap.positions)).to(self.device)
        scatter(self.k_pool, self.v_pool, slots, snap.k, snap.v)
        state.upload()
        src, dst = state.host.committed_copies()
        ops.copy_kv_slots_(self.k_pool, self.v_pool, torch.from_numpy(src).to(self.device),
                           torch.from_numpy(dst).to(self.device))

    def _fence(self, rows) -> None:
        """Make the current stream wait for the export copies of sequences ``rows``
        still in flight (device-side; the host does not block)."""
        if not self._exports or not isinstance(rows, (list, tuple, range)):
            return
        for i in list(rows):
            done = self._exports.pop(i, None) if isinstance(i, int) else None
            if done is not None and not done.query():
                torch.cuda.current_stream(self.device).wait_event(done)

    # ------------------------------------------------------------------ forwards
    def write_staged(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                     causal_block_size: int, *, sequences=None,
                     selection: Selection | None = None, stage=None) -> None:
        """Write this forward's T tokens of one layer at positions [C, C + T) of each
        sequence in use.

        Each token goes to its shared slot (read by later blocks and commits) and to
        its block's private slots; earlier blocks' tokens on a partly visible page
        are copied into later blocks' private slots (current_private). One launch for
        all sequences.

        Args:
            layer: layer index.
            k, v: [B, T, H_kv, D], batch row r for the r-th sequence in use, or
                [T, H_kv, D] with one in use; any token/head strides (head dim
                contiguous), T a multiple of ``causal_block_size`` and <=
                max_staged_tokens.
            causal_block_size: a block size declared by the open geometry.
            sequences: host ints to put in use first (default: those in use).
            selection: the forward's `select` result (then ``sequences`` is not given).
            stage: None, or a callable ``stage(k_pool=, v_pool=, dst=, dst2=,
                src_rows=)`` that writes the K/V itself (a fused kernel computing them
                on the way, `framekv.ops.qk_norm_rope_stage_`) with the slot lists the
                scatter would use over the [B * T] rows, and for an fp8 pool the
                layer's ``kv_scale=``, ``kv_amax=``, ``saturated=``; k and v are then
                only checked. Without one, an fp8 pool's K/V are quantized here.
        """
        pool = self._require_open()
        self._check_layer(layer)
        T, B = self._check_kv(k, v)
        M = pool.plan.geometry.max_staged_tokens
        pool.plan.block(causal_block_size)
        if T > M or T % causal_block_size:
            raise ValueError(
                f"k must hold a positive multiple of causal_block_size={causal_block_size} "
                f"tokens, at most max_staged_tokens={M}, got {T}")
        if selection is None:
            selection = self.select(causal_block_size, T, sequences=sequences)
        elif sequences is not None:
            raise ValueError("pass sequences or selection, not both")
        selection.check(self, causal_block_size, T, 1 if B is None else B)
        with torch.no_grad():  # a cache write never records autograd history
            if stage is not None:
                bt = selection.blocks
                stage(k_pool=self.k_pool[layer], v_pool=self.v_pool[layer],
                      dst=bt.staged_dst, dst2=bt.staged_dst2, src_rows=bt.staged_src,
                      **self._stage_extra(layer))
            else:
                rows = [self._quantize(layer, c, flat_rows(x.detach()))
                        for c, x in enumerate((k, v))]                 # [B * T, H_kv, D]
                self._scatter(layer, causal_block_size, B, selection)(*rows)
        for i in selection.rows:
            pool.seqs[i].host.note_staged(T, layer)

    def _scatter(self, layer: int, b: int, B, selection: Selection):
        """The bound scatter of one layer's staged K/V (made once per layer, b, B)."""
        pool = self._open
        key = ("scatter", layer, b, B)
        launch = pool.launchers.get(key)
        if launch is None:
            bt = selection.blocks
            launch = ops.bind_scatter_kv_slots(self.k_pool[layer], self.v_pool[layer],
                                               bt.staged_dst, bt.staged_dst2, bt.staged_src)
            pool.launchers[key] = launch
        return launch

    # ------------------------------------------------------------------ commit
    def commit(self, n: int, *, sequences=None) -> None:
        """Make the first ``n`` staged tokens of each sequence in use history: C += n,
        its window slides; the other sequences do not move. `commit_host` then
        `commit_device`, all or nothing.

        ValueError (nothing changed) unless n is in [0, staged] and every layer staged
        n tokens since the last commit, for every sequence; if the device half fails
        part way, the host mirrors and the device state are put back as they were and
        the error is raised again, so the same commit can be retried. Captured in a
        CUDA graph, its host half runs once at the capture (a rollout resets after
        capturing) and a replay's hook runs `note_staged` and `commit_host`.
        """
        pool = self._rows(sequences)
        states = [pool.seqs[i] for i in pool.rows]
        for st in states:
            st.host.check_commit(n)
        snaps = [st.host.snapshot() for st in states]
        try:
            for st in states:
                st.host.commit(n)
            pool.commit_device(n, self.k_pool, self.v_pool)
        except BaseException:
            for st, snap in zip(states, snaps):
                self._recover(st, snap)
            raise

    def commit_host(self, n: int, *, sequences=None) -> None:
        """The host half of ``commit(n)`` alone (the mirrors of the sequences in use,
        all or nothing): what a replayed commit leaves the host to do."""
        pool = self._rows(sequences)
        states = [pool.seqs[i] for i in pool.rows]
        for st in states:
            st.host.check_commit(n)
        for st in states:
            st.host.commit(n)

    def commit_device(self, n: int, *, sequences=None) -> None:
        """The device half of ``commit(n)`` alone, safe to capture: no host-computed
        argument but the constant n, the ids read on the device, no upload, no
        synchronisation (`PoolState.commit_device`). Without kernels (CPU) it applies
        the host mirrors, so it must follow `commit_host`."""
        self._rows(sequences).commit_device(n, self.k_pool, self.v_pool)

    def note_staged(self, tokens: int, *, sequences=None) -> None:
        """Advance the host mirrors' staged count of the sequences in use as a forward
        of ``tokens`` in every layer would: what a replayed forward leaves the host to
        do (the graph wrote the K/V; the host never reads the device back)."""
        pool = self._rows(sequences)
        for i in pool.rows:
            pool.seqs[i].host.note_staged(tokens)

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
    def write_range(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, *,
                    sequence: int = 0) -> None:
        """Overwrite K/V of resident positions [start, start + T) of one layer of one
        sequence.

        Committed positions' private copies are updated too, so the edit takes effect
        on the next forward. Staged positions are rewritten by every forward; an
        edit reaches the shared slot that the next commit reads. All or nothing: a
        failure part way puts back every slot it touched.
        """
        state = self._seq(sequence)
        self._check_layer(layer)
        T, B = self._check_kv(k, v)
        if B is not None:
            raise ValueError(f"k must have shape [T, {self.num_kv_heads}, {self.head_dim}], "
                             f"got {list(k.shape)}")
        self._fence([sequence])
        src_rows, dst = state.host.edit_targets(start, T)
        rows, slots = (torch.from_numpy(a).to(self.device) for a in (src_rows, dst))
        with self._restoring(layer, slots), torch.no_grad():
            kq, vq = (self._quantize(layer, c, x.detach()) for c, x in enumerate((k, v)))
            ops.scatter_kv_slots_(self.k_pool[layer], self.v_pool[layer], kq, vq, slots,
                                  None, rows)

    def zero_values(self, layer: int, start: int, n: int, *, sequence: int = 0) -> None:
        """Zero V (not K) of resident positions [start, start + n) of one layer of one
        sequence, private copies included (all or nothing)."""
        state = self._seq(sequence)
        self._check_layer(layer)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        self._fence([sequence])
        _, dst = state.host.edit_targets(start, n)
        slots = torch.from_numpy(dst).to(self.device)
        with self._restoring(layer, slots):
            _bits(self.v_pool[layer]).index_fill_(0, slots, 0)   # 0 is zero in every format

    @contextlib.contextmanager
    def keeping(self, start: int, n: int, *, sequences):
        """Keep the K/V of resident positions [start, start + n) of sequences
        ``sequences`` (host ints) in every layer, their private copies included, and put
        them back if the block raises: several edits (`write_range`, `zero_values`) made
        all or nothing together."""
        pool = self._require_open()
        rows = check_rows(sequences, self.num_sequences)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        dst = [pool.seqs[i].host.edit_targets(start, n)[1] for i in rows]
        slots = torch.from_numpy(np.concatenate(dst)).to(self.device)
        with self._restoring(None, slots):
            yield

    @contextlib.contextmanager
    def _restoring(self, layer: int | None, slots: torch.Tensor):
        """Keep the K/V of ``slots`` of ``layer`` (None: every layer); put them back if
        the block raises."""
        dim = 1 if layer is None else 0
        k, v = (self.k_pool, self.v_pool) if layer is None else (self.k_pool[layer],
                                                                 self.v_pool[layer])
        k, v = _bits(k), _bits(v)
        with torch.no_grad():
            k_old, v_old = k.index_select(dim, slots), v.index_select(dim, slots)
            try:
                yield
            except BaseException:
                k.index_copy_(dim, slots, k_old)
                v.index_copy_(dim, slots, v_old)
                raise

    # ------------------------------------------------------------------ checks
    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an integer in [0, {self.num_layers}), got {layer!r}")

    def _check_kv(self, k, v) -> tuple[int, int | None]:
        """(T, B) of k/v [T, H_kv, D] (B None) or [B, T, H_kv, D]."""
        want = (self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() not in (3, 4) or tuple(t.shape[-2:]) != want or 0 in t.shape[:-2]:
                raise ValueError(f"{name} must have shape [T >= 1, {want[0]}, {want[1]}] or "
                                 f"[B, T, {want[0]}, {want[1]}], got {list(t.shape)}")
            if self.quantized and t.dtype not in _FP8_INPUTS:
                raise ValueError(f"{name} must have dtype bfloat16, float16 or float32 (an "
                                 f"fp8 pool quantizes them), got {t.dtype}")
            if not self.quantized and t.dtype != self.dtype:
                raise ValueError(f"{name} must have dtype {self.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        if k.dtype != v.dtype:
            raise ValueError(f"k and v must have the same dtype, got {k.dtype} and {v.dtype}")
        return int(k.shape[-3]), (int(k.shape[0]) if k.dim() == 4 else None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (torch has no index_copy_ / index_fill_ for fp8),
    any other as it is."""
    return t.view(torch.uint8) if quant.is_fp8(t.dtype) else t


def _stats_sizes(num_layers: int, num_kv_heads: int, dtype) -> list[int]:
    """Bytes of an fp8 pool's scales, amax and saturation counts (none otherwise)."""
    if not quant.is_fp8(dtype):
        return []
    heads = (num_layers, 2, num_kv_heads)
    return [nbytes(heads, torch.float32)] * 2 + [nbytes((num_layers, 2), torch.int64)]


def _check_sizes(**sizes) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_dtype(dtype, device: torch.device | None) -> None:
    """bf16/fp16/fp8 anywhere, fp32 on the CPU (``device`` None: any device)."""
    cpu = device is None or device.type == "cpu"
    if dtype not in _DTYPES or (dtype == torch.float32 and not cpu):
        allowed = "bfloat16, float16, float8_e4m3fn" + (", float32 (cpu)" if cpu else "")
        where = f" on {device.type}" if device is not None else ""
        raise ValueError(f"dtype must be one of {allowed}{where}, got {dtype}")


def _check_tpp(tpp) -> None:
    if isinstance(tpp, bool) or not isinstance(tpp, int) or tpp < 1 or tpp & (tpp - 1):
        raise ValueError(f"tokens_per_page must be a power of two, got {tpp!r}")


def _check_geometry(geometry) -> None:
    if not isinstance(geometry, Geometry):
        raise ValueError(f"geometry must be a framekv.specs.Geometry, got {type(geometry).__name__}")
