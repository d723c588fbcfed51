"""Many sequences on one pool: N independent rollouts of one geometry, batched forwards.

Sequence i of a pool of N owns physical pages [i * Pg, (i + 1) * Pg) (Pg = the
geometry's ``total_pages``: fixed pages, ring, private pages) and a full copy of the
single-sequence state (``GeometryState`` over ``LayoutPlan.shifted(i * Pg)``): its
own commit count, ring, table and per-block tensors. Page and slot ids are global,
so one sequence's rows never name another's pages. The state tensors are carved
stacked, one row per sequence, so a batch of B sequences is gathered on the device::

    stacked rows        int32 [N, sum nb * row_pages]    (every state tensor: [N, ...])
    batch rows          int32 [B * nb, row_pages]        row (r, j): block j of rows[r]
    batch seq_len_kv/q  int32 [B * nb]
    batch staged lists  int64 [B * staged_len]           source rows offset by r * T

Sequences in use: the host ints ``rows`` (batch row r is sequence rows[r]) and the
same ids in a fixed device buffer ``ids`` [N] (its first B entries), written only when
the rows change (`PoolState.use`). Every device step (the gather, the commit) reads the
buffer when it runs, so one captured forward or commit serves any B sequences: set the
rows, then replay. The batch buffers are sized for N and a batch of B uses their first
B rows (fixed addresses for every B).

Commit of the sequences in use, device half (`PoolState.commit_device`, the one path for
any N): ``advance[ids] = n`` (0 elsewhere), then every sequence's counters advance by
its own ``advance[i]``, its ring rotates by the resulting shift and its layout is
rebuilt (a sequence at 0 rewrites the same values), then one copy of every committed
private slot. Host half: each sequence's `HostLayout` mirror (`GeometryState.host`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from framekv import ops

from .plan import LayoutPlan
from .state import BlockTensors, GeometryState, state_specs


class PoolState:
    """One geometry's N sequence states in the cache's arena, and the batch buffers.

    Attributes:
        plan: the geometry's `LayoutPlan` (sequence 0's pages).
        seqs: the N per-sequence `GeometryState`s (views of the stacked tensors).
        stacked: name -> [N, ...] tensor of every `state_specs` entry.
        rows: the sequences in use, host ints (batch row r is rows[r]).
    """

    def __init__(self, plan: LayoutPlan, stacked: dict, batch: dict, num_layers: int,
                 num_sequences: int):
        self.plan, self.stacked, self.num_sequences = plan, stacked, num_sequences
        pages = plan.total_pages
        self.seqs = [GeometryState(plan.shifted(i * pages),
                                   {name: t[i] for name, t in stacked.items()}, num_layers)
                     for i in range(num_sequences)]
        self._batch = batch  # block size -> BlockTensors sized for N (N > 1 only)
        self._ids = batch["ids"]            # int64 [N]: rows in use, then stale entries
        self._advance = batch["advance"]    # int64 [N]: tokens each sequence commits
        self._row = batch["row"]            # int64 [N]: 0 .. N-1, a batch row's index
        self._none = batch["none"]          # int64 []: -1, a dropped list entry
        self.rows: tuple[int, ...] = ()
        self.launchers: dict = {}

    @classmethod
    def carve(cls, arena, plan: LayoutPlan, num_layers: int, num_sequences: int) -> "PoolState":
        """Carve every tensor from ``arena``: all of them or none (rolled back on failure)."""
        mark = arena.mark()
        try:
            N = num_sequences
            stacked = {name: arena.empty((N, *shape), dtype, name=name)
                       for name, shape, dtype in state_specs(plan)}
            return cls(plan, stacked, _carve_batch(arena, plan, N), num_layers, N)
        except BaseException:
            arena.release_to(mark)
            raise

    def reset(self, rows) -> None:
        """Sequences ``rows`` (host ints, checked by the caller) back to position 0."""
        for i in rows:
            self.seqs[i].reset()

    # ------------------------------------------------------------------ rows
    def use(self, rows) -> tuple[int, ...]:
        """Make ``rows`` (host ints, distinct, in [0, N)) the sequences in use; the
        device buffer is written only when they change, which a CUDA graph capture
        cannot do (ValueError then: set the rows before capturing)."""
        rows = check_rows(rows, self.num_sequences)
        if rows != self.rows:
            if self._ids.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise ValueError(f"the sequences in use change from {self.rows} to {rows} "
                                 "while a CUDA graph is captured; set them before the capture")
            self._ids[:len(rows)].copy_(torch.tensor(rows, dtype=torch.int64))
            self.rows = rows
        return rows

    @property
    def ids(self) -> torch.Tensor:
        """int64 [B] on the device: the sequences in use (a fixed buffer graphs read)."""
        return self._ids[:len(self.rows)]

    # ------------------------------------------------------------------ batches
    def batch_view(self, batch: int, block_size: int, tokens: int) -> BlockTensors:
        """What a forward of ``tokens`` rows per sequence over ``batch`` sequences reads:
        its B * nb block rows (nb = tokens // block_size) and the staged lists, at fixed
        addresses (with one sequence: that sequence's own tensors)."""
        bp = self.plan.block(block_size)
        nb = tokens // block_size
        if self.num_sequences == 1:
            bt = self.seqs[0].blocks[block_size]
            return BlockTensors(block_size, bt.rows[:nb], bt.seq_len_kv[:nb],
                                bt.seq_len_q[:nb], bt.staged_src, bt.staged_dst, bt.staged_dst2)
        full, n, L = self._batch[block_size], batch * nb, batch * bp.staged_len
        return BlockTensors(block_size, full.rows[:n], full.seq_len_kv[:n], full.seq_len_q[:n],
                            full.staged_src[:L], full.staged_dst[:L], full.staged_dst2[:L])

    def gather(self, block_size: int, tokens: int) -> BlockTensors:
        """`batch_view` filled for the sequences in use: block j of batch row r at
        r * nb + j; staged source rows of the forward offset by r * tokens (rows past
        ``tokens`` dropped), so its K/V are read as one [B * tokens] row list. Device
        work only, reading the ids buffer (capturable); nothing to do for one sequence."""
        B = len(self.rows)
        if self.num_sequences == 1:
            return self.batch_view(1, block_size, tokens)
        bp = self.plan.block(block_size)
        nb, ids = tokens // block_size, self.ids
        out = self.batch_view(B, block_size, tokens)
        seq0 = self.seqs[0].blocks[block_size]
        st = self.stacked
        rows_off = seq0.rows.storage_offset() - st["rows"].storage_offset()
        blocks_off = seq0.seq_len_kv.storage_offset() - st["seq_len_kv"].storage_offset()
        staged_off = seq0.staged_src.storage_offset() - st["staged_src"].storage_offset()
        rows = st["rows"][:, rows_off:rows_off + nb * bp.row_pages]         # [N, nb * RP]
        torch.index_select(rows, 0, ids, out=out.rows.view(B, -1))
        lens = st["seq_len_kv"][:, blocks_off:blocks_off + nb]               # [N, nb]
        torch.index_select(lens, 0, ids, out=out.seq_len_kv.view(B, nb))
        sl = slice(staged_off, staged_off + bp.staged_len)
        for name in ("staged_dst", "staged_dst2"):
            torch.index_select(st[name][:, sl], 0, ids, out=getattr(out, name).view(B, -1))
        src = st["staged_src"][:, sl].index_select(0, ids)                  # [B, staged_len]
        keep = (src >= 0) & (src < tokens)
        torch.where(keep, src + self._row[:B, None] * tokens, self._none,
                    out=out.staged_src.view(B, -1))
        return out

    # ------------------------------------------------------------------ commit
    def commit_device(self, n: int, k_pool, v_pool) -> None:
        """The device half of committing ``n`` tokens of the sequences in use: no
        host-computed argument but n, the ids read on the device (capturable). Without
        kernels (CPU) the layouts come from the host mirrors, which must have moved."""
        if ops.use_kernel(k_pool):
            adv = self._advance
            adv.zero_()
            adv.index_fill_(0, self.ids, n)
            g, plan = self.plan.geometry, self.plan
            for i, st in enumerate(self.seqs):
                ops.advance_commit_(st.counters, adv[i:i + 1], pin_tokens=g.pin_tokens,
                                    window_tokens=g.window_tokens,
                                    tokens_per_page=plan.tokens_per_page,
                                    fixed_pages=plan.fixed_pages)
                t = st.flat
                ops.rotate_rows_(t["table"][plan.fixed_pages:], t["counters"][2:3])
                layout_kernel(st)
        else:
            for i in self.rows:
                self.seqs[i].upload_layout()
        # Re-copying a sequence that did not move copies the same values again.
        ops.copy_kv_slots_(k_pool, v_pool, self.stacked["committed_src"].view(-1),
                           self.stacked["committed_dst"].view(-1))


@dataclass
class Selection:
    """One forward's sequences, checked and gathered (`CausalKVCache.select`).

    Attributes:
        cache: the cache it was selected on.
        rows: the sequences (host ints; batch row r is rows[r]).
        block_size, tokens: the forward's causal block size and rows per sequence.
        blocks: the per-block tensors the forward reads (B * nb block rows).
    """

    cache: object
    rows: tuple[int, ...]
    block_size: int
    tokens: int
    blocks: BlockTensors

    @property
    def size(self) -> int:
        """B, the sequences of the forward."""
        return len(self.rows)

    def check(self, cache, block_size: int, tokens: int, batch: int) -> None:
        """ValueError unless this batch was selected for such a forward on ``cache``."""
        if cache is not self.cache or (block_size, tokens, batch) != (self.block_size, self.tokens,
                                                                     self.size):
            raise ValueError(f"selection was made for {self.size} sequences x {self.tokens} "
                             f"tokens in blocks of {self.block_size} on another or the same "
                             f"cache; this forward is {batch} x {tokens} in blocks of {block_size}")


def check_rows(rows, num_sequences: int, name: str = "sequences") -> tuple[int, ...]:
    """``rows`` as a tuple of host ints if it names 1 to N distinct sequences in
    [0, num_sequences), else a ValueError naming the argument ``name``."""
    if isinstance(rows, torch.Tensor) or not isinstance(rows, (list, tuple, range)):
        raise ValueError(f"{name} must be host ints (a list, tuple or range), got "
                         f"{type(rows).__name__}")
    values = list(rows)
    bad = [i for i in values if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < num_sequences]
    if bad or not 1 <= len(values) <= num_sequences:
        raise ValueError(f"{name} must name 1 to {num_sequences} sequences in "
                         f"[0, {num_sequences}), got {values}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} must be distinct (one batch row per sequence), got {values}")
    return tuple(values)


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] as is; [B, T, H, D] as [B * T, H, D] (a view when the batch stride is T
    token strides, else a copy)."""
    if x.dim() == 3:
        return x
    B, T, H, D = x.shape
    if B == 1:
        return x[0]
    if x.stride(0) == T * x.stride(1):
        return x.as_strided((B * T, H, D), (x.stride(1), x.stride(2), x.stride(3)))
    return x.reshape(B * T, H, D)


def layout_kernel(state: GeometryState) -> None:
    """``causal_layout_`` over one sequence's state (its counters and table)."""
    plan, g, t = state.plan, state.plan.geometry, state.flat
    ops.causal_layout_(t["counters"], t["table"], t["desc"], t["rows"], t["seq_len_kv"],
                       t["staged_src"], t["staged_dst"], t["staged_dst2"],
                       t["committed_src"], t["committed_dst"],
                       pin_tokens=g.pin_tokens, window_tokens=g.window_tokens,
                       max_staged_tokens=g.max_staged_tokens,
                       tokens_per_page=plan.tokens_per_page,
                       fixed_pages=plan.fixed_pages, ring_pages=plan.ring_pages)


def batch_bytes_specs(plan: LayoutPlan, num_sequences: int) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of every batch buffer a pool of ``num_sequences`` carves, in carve
    order: the ids, advance and row vectors and the -1 scalar, then (N > 1 only) each
    block size's batch tensors. Sizing and carving share it."""
    N = num_sequences
    specs = [((N,), torch.int64), ((N,), torch.int64), ((N,), torch.int64), ((), torch.int64)]
    if N == 1:
        return specs
    for bp in plan.blocks:
        specs += [((N * bp.num_blocks, bp.row_pages), torch.int32),
                  ((N * bp.num_blocks,), torch.int32), ((N * bp.num_blocks,), torch.int32)]
        specs += [((N * bp.staged_len,), torch.int64)] * 3
    return specs


def _carve_batch(arena, plan: LayoutPlan, N: int) -> dict:
    specs = iter(batch_bytes_specs(plan, N))
    out = {name: arena.empty(*next(specs), name=f"batch_{name}")
           for name in ("ids", "advance", "row", "none")}
    out["row"].copy_(torch.arange(N, dtype=torch.int64))
    out["none"].fill_(-1)
    if N > 1:
        for bp in plan.blocks:
            t = [arena.empty(*next(specs), name=f"batch_{bp.block_size}_{i}") for i in range(6)]
            t[2].fill_(bp.block_size)
            out[bp.block_size] = BlockTensors(bp.block_size, *t)
    return out
