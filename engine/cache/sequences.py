"""Many sequences on one pool: N independent rollouts of one geometry, batched forwards.

Sequence i of a pool of N owns physical pages [i * Pg, (i + 1) * Pg) (Pg = the
geometry's ``total_pages``: fixed pages, ring, private pages) and a full copy of the
single-sequence state (``GeometryState`` over ``LayoutPlan.shifted(i * Pg)``): its
own commit count, ring, table and per-block tensors. Page and slot ids are global,
so one sequence's rows never name another's pages. The state tensors are carved
stacked, one row per sequence, so a batch of B sequences is gathered on the device::

    stacked rows        int32 [N, sum nb * row_pages]    (every state tensor: [N, ...])
    batch rows          int32 [B * nb, row_pages]        row (r, j): block j of ids[r]
    batch seq_len_kv/q  int32 [B * nb]
    batch staged lists  int64 [B * staged_len]           source rows offset by r * T

``ids`` is a device tensor and a graph input: the gather (`PoolState.gather`) and
the commit (`PoolState.commit_device`) read it when they run, so one captured
forward or commit serves any B sequences. The batch buffers are sized for N and a
batch of B uses their first B rows (fixed addresses for every B).

Commit of the sequences in ``ids``: ``advance[ids] = n`` (0 elsewhere), then every
sequence's counters advance by its own ``advance[i]`` on the device, its ring rotates
by the resulting shift and its layout is rebuilt; a sequence with 0 keeps its state
(the rebuild rewrites the same values; the committed copies re-copy what they copied).
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
    """

    def __init__(self, plan: LayoutPlan, stacked: dict, batch: dict, num_layers: int,
                 num_sequences: int):
        self.plan, self.stacked, self.num_sequences = plan, stacked, num_sequences
        pages = plan.total_pages
        self.seqs = [GeometryState(plan.shifted(i * pages),
                                   {name: t[i] for name, t in stacked.items()}, num_layers)
                     for i in range(num_sequences)]
        self._batch = batch  # block size -> BlockTensors sized for N (N > 1 only)
        self._advance = batch.get("advance")        # int64 [N]: tokens each sequence commits
        self._row = batch.get("row")                # int64 [N]: 0 .. N-1, a batch row's index
        self._none = batch.get("none")              # int64 []: -1, a dropped list entry
        self.launchers: dict = {}

    @classmethod
    def carve(cls, arena, plan: LayoutPlan, num_layers: int, num_sequences: int) -> "PoolState":
        """Carve every tensor from ``arena``: all of them or none (rolled back on failure)."""
        mark = arena.mark()
        try:
            N = num_sequences
            stacked = {name: arena.empty((N, *shape), dtype, name=name)
                       for name, shape, dtype in state_specs(plan)}
            batch = _carve_batch(arena, plan, N) if N > 1 else {}
            return cls(plan, stacked, batch, num_layers, N)
        except BaseException:
            arena.release_to(mark)
            raise

    def reset(self, ids=None) -> None:
        """Sequences ``ids`` (host ints; default all) back to position 0."""
        for i in range(self.num_sequences) if ids is None else ids:
            self.seqs[i].reset()

    # ------------------------------------------------------------------ ids
    def resolve(self, sequences, batch: int | None, device) -> tuple:
        """(ids int64 [B] on the device, host ints or None) of a ``sequences`` argument.

        None: the first ``batch`` sequences (batch None: every sequence). A tensor: int32/int64 [B], 1 <= B <= N, on
        ``device``; its values are read (a synchronisation) and must be distinct and in
        [0, N), except while a CUDA graph is captured (host None: read on the device
        at replay; the replay's caller names them on the host)."""
        N = self.num_sequences
        if sequences is None:
            B = N if batch is None else check_batch(batch, N)
            return self._row[:B] if N > 1 else None, tuple(range(B))
        ids = check_ids(sequences, N, device)
        if batch is not None and ids.shape[0] != batch:
            raise ValueError(f"sequences must name one sequence per batch row ({batch}), "
                             f"got {ids.shape[0]}")
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return ids, None
        return ids, check_id_values(ids.tolist(), N)

    def host_ids(self, sequences, device) -> tuple:
        """Host ints of ``sequences`` (host ints or a tensor; default every sequence),
        checked."""
        if sequences is None:
            return tuple(range(self.num_sequences))
        if isinstance(sequences, torch.Tensor):
            ids, host = self.resolve(sequences, None, device)
            if host is None:
                raise ValueError("sequences cannot be read on the host while a CUDA graph "
                                 "is captured; pass them as host ints")
            return host
        if not isinstance(sequences, (list, tuple, range)):
            raise ValueError(f"sequences must be an int tensor or host ints, got "
                             f"{type(sequences).__name__}")
        return check_id_values(list(sequences), self.num_sequences)

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

    def gather(self, ids, block_size: int, tokens: int) -> BlockTensors:
        """`batch_view` filled for the B sequences ``ids`` names (int64 [B] on the
        device): block j of batch row r at r * nb + j; staged source rows of the
        forward offset by r * tokens (rows past ``tokens`` dropped), so its K/V are read
        as one [B * tokens] row list. Device work only (capturable); nothing to do for
        a one-sequence pool."""
        if self.num_sequences == 1:
            return self.batch_view(1, block_size, tokens)
        bp = self.plan.block(block_size)
        B, nb = ids.shape[0], tokens // block_size
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
    def commit_device(self, n: int, ids: torch.Tensor, k_pool, v_pool) -> None:
        """The device half of committing ``n`` tokens of the sequences ``ids`` (int64
        [B] on the device): no host-computed argument but n (capturable)."""
        adv = self._advance
        adv.zero_()
        adv.index_fill_(0, ids, n)
        g, plan = self.plan.geometry, self.plan
        for i, st in enumerate(self.seqs):
            ops.advance_commit_(st.counters, adv[i:i + 1], pin_tokens=g.pin_tokens,
                                window_tokens=g.window_tokens,
                                tokens_per_page=plan.tokens_per_page,
                                fixed_pages=plan.fixed_pages)
            t = st.flat
            ops.rotate_rows_(t["table"][plan.fixed_pages:], t["counters"][2:3])
            layout_kernel(st)
        ops.copy_kv_slots_(k_pool, v_pool, self.stacked["committed_src"].view(-1),
                           self.stacked["committed_dst"].view(-1))


@dataclass
class SequenceBatch:
    """One forward's choice of sequences, checked and gathered (`CausalKVCache.select`).

    Attributes:
        cache: the cache it was selected on.
        source: the ``sequences`` argument it came from (None: the first B).
        ids: int64 [B] on the device (None for a one-sequence pool).
        host: the ids as host ints, or None when selected during a graph capture.
        block_size, tokens: the forward's causal block size and rows per sequence.
        blocks: the per-block tensors the forward reads (B * nb block rows).
    """

    cache: object
    source: object
    ids: torch.Tensor | None
    host: tuple | None
    block_size: int
    tokens: int
    blocks: BlockTensors

    @property
    def size(self) -> int:
        """B, the sequences of the forward."""
        return 1 if self.ids is None else int(self.ids.shape[0])

    def check(self, cache, block_size: int, tokens: int, batch: int | None) -> None:
        """ValueError unless this batch was selected for such a forward on ``cache``."""
        B = 1 if batch is None else batch
        if cache is not self.cache or (block_size, tokens, B) != (self.block_size, self.tokens,
                                                                 self.size):
            raise ValueError(f"batch was selected for {self.size} sequences x {self.tokens} "
                             f"tokens in blocks of {self.block_size} on another or the same "
                             f"cache; this forward is {B} x {tokens} in blocks of {block_size}")


def check_batch(batch, num_sequences: int) -> int:
    """``batch`` if it is an int in [1, num_sequences], else ValueError."""
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= num_sequences:
        raise ValueError(f"the batch must hold 1 to num_sequences={num_sequences} sequences, "
                         f"got {batch!r}")
    return batch


def check_ids(ids, num_sequences: int, device) -> torch.Tensor:
    """The ids tensor as int64, after the checks that need no host read."""
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"sequences must be an int tensor [B] on {device}, got "
                         f"{type(ids).__name__}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"sequences must have dtype torch.int32 or torch.int64, got {ids.dtype}")
    if ids.device != device:
        raise ValueError(f"sequences must be on {device} (the cache's device), got {ids.device}")
    if ids.dim() != 1 or not 1 <= ids.shape[0] <= num_sequences:
        raise ValueError(f"sequences must have shape [B] with 1 <= B <= num_sequences="
                         f"{num_sequences}, got {list(ids.shape)}")
    return ids if ids.dtype == torch.int64 else ids.long()


def check_id_values(values: list, num_sequences: int) -> tuple:
    """The ids as a tuple of ints if distinct and in [0, num_sequences), else ValueError."""
    bad = [i for i in values if isinstance(i, bool) or not isinstance(i, int)
           or not 0 <= i < num_sequences]
    if bad:
        raise ValueError(f"sequences must be in [0, {num_sequences}), got {values}")
    if len(set(values)) != len(values):
        raise ValueError(f"sequences must be distinct (one batch row per sequence), got {values}")
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
    """(shape, dtype) of every batch buffer a pool of ``num_sequences`` carves (none
    for one sequence): sizing and carving share it."""
    N = num_sequences
    if N == 1:
        return []
    specs = [((N,), torch.int64), ((N,), torch.int64), ((), torch.int64)]
    for bp in plan.blocks:
        specs += [((N * bp.num_blocks, bp.row_pages), torch.int32),
                  ((N * bp.num_blocks,), torch.int32), ((N * bp.num_blocks,), torch.int32)]
        specs += [((N * bp.staged_len,), torch.int64)] * 3
    return specs


def _carve_batch(arena, plan: LayoutPlan, N: int) -> dict:
    specs = iter(batch_bytes_specs(plan, N))
    out = {name: arena.empty(*next(specs), name=f"batch_{name}")
           for name in ("advance", "row", "none")}
    out["row"].copy_(torch.arange(N, dtype=torch.int64))
    out["none"].fill_(-1)
    for bp in plan.blocks:
        t = [arena.empty(*next(specs), name=f"batch_{bp.block_size}_{i}") for i in range(6)]
        t[2].fill_(bp.block_size)
        out[bp.block_size] = BlockTensors(bp.block_size, *t)
    return out


