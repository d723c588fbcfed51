"""Host model of the causal K/V cache's page layout: plain numpy, integers only.

It is the specification the device kernel ``causal_layout_`` mirrors, and the CPU cache
uses it directly. Notation (DESIGN.md, "The cache"): P pin_tokens, W window_tokens,
M max_staged_tokens, tpp tokens_per_page, C committed count; logical page of position
x is x // tpp; a slot id is physical_page * tpp + offset, the same in every layer.

Physical pages of one geometry::

    page id  0 ... F-1 | F ...... F+R-1 | F+R ............................... total_pages
            +----------+----------------+-----------------------------------------+
            |  fixed   |  ring          | private: size b0: blk0 | blk1 | ...     |
            | [0, P)   | [max(P,C-W),   |          size b1: blk0 | blk1 | ...     |
            | (+ tail) |  C+M)          |          (Q_b pages each, contiguous)   |
            +----------+----------------+-----------------------------------------+

Page table ``table`` (int64 [F + R])::

    table[p]              logical page p < F            (fixed, never moves)
    table[F + i]          logical page ring_base + i    (ring)
    commit: ring_base' = max(F, max(P, C' - W) // tpp); the ring part is rolled left by
    ring_base' - ring_base, so dropped pages come back at its end for new positions.

Row of causal block j (s = C + j*b, V'(j) = [0, min(P, s)) U [max(P, s - W), s))::

    | full | full | ... | private page | private page | ... | pad (last private) |
      pages wholly in V'  visible positions of the <= 3 partly visible pages
      (table order)       (committed_private, then current_private), own b tokens
    seq_len_kv = n_full * tpp + n_partial + b; keys past seq_len_kv are never read.

``build_block_layout`` is the vectorised host model; ``build_block_layout_looped`` runs
the op reference ``causal_layout_reference`` (a loop over blocks, one per kernel CTA),
so the two are independent codings of one rule. ``mirror.HostLayout`` holds the
rollout state and draws its layouts with ``build_block_layout``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from framekv.ops.causal_layout import DESC_COLUMNS, causal_layout_reference

from .plan import BlockPlan, LayoutPlan

__all__ = ["BlockLayout", "FlatLayout", "build_block_layout", "build_block_layout_looped",
           "physical_page", "slot_at", "slots_at", "FLAT_FIELDS"]

#: Fields of BlockLayout / FlatLayout that hold tensors, in the op's argument order
#: (seq_len_q, constant, is not an op output).
FLAT_FIELDS = ("rows", "seq_len_kv", "seq_len_q", "staged_src", "staged_dst",
               "staged_dst2", "committed_src", "committed_dst")
_OP_OUTPUTS = tuple(f for f in FLAT_FIELDS if f != "seq_len_q")


# --------------------------------------------------------------------------- lookups

def physical_page(plan: LayoutPlan, ring_base: int, table: np.ndarray, p: int) -> int:
    """Physical page of logical page ``p`` (fixed below F, ring above)."""
    F = plan.fixed_pages
    if p < F:
        return int(table[p])
    i = p - ring_base
    assert 0 <= i < plan.ring_pages, (p, ring_base)
    return int(table[F + i])


def slot_at(plan: LayoutPlan, ring_base: int, table: np.ndarray, x: int) -> int:
    """Slot id of position ``x`` (no residency check beyond the ring bounds)."""
    tpp = plan.tokens_per_page
    return physical_page(plan, ring_base, table, x // tpp) * tpp + x % tpp


# --------------------------------------------------------------------------- drivers

@dataclass
class FlatLayout:
    """Per-block tensors of every block size, concatenated in ``plan.blocks`` order:
    the flat format ``causal_layout_`` writes (``LayoutPlan.descriptor()`` gives each
    size's offsets). rows: int32 [sum nb * row_pages] (each size row-major);
    seq_len_kv, seq_len_q: int32 [sum nb]; staged_src/dst/dst2: int64
    [sum staged_len]; committed_src/dst: int64 [sum nb * committed_len].
    """

    rows: np.ndarray
    seq_len_kv: np.ndarray
    seq_len_q: np.ndarray
    staged_src: np.ndarray
    staged_dst: np.ndarray
    staged_dst2: np.ndarray
    committed_src: np.ndarray
    committed_dst: np.ndarray


@dataclass
class BlockLayout(FlatLayout):
    """Per-block tensors of one block size at one committed count.

    Attributes:
        block_size: b.
        rows: int32 [nb, row_pages]; seq_len_kv, seq_len_q: int32 [nb].
        staged_src, staged_dst, staged_dst2: int64 [M + nb * current_len]. Entry i < M
            writes forward row i to its shared slot and to its block's private slot;
            then block j's current_private entries at M + j * current_len. The scatter
            skips src_row outside [0, T) and destinations < 0.
        committed_src, committed_dst: int64 [nb * committed_len], pool-to-pool copies
            applied to every layer after commit; -1 pairs are padding.
    """

    block_size: int = field(kw_only=True)  # after the inherited fields, still required


def _empty_layout(plan: LayoutPlan, bp: BlockPlan) -> BlockLayout:
    nb = bp.num_blocks
    return BlockLayout(
        block_size=bp.block_size, rows=np.zeros((nb, bp.row_pages), np.int32),
        seq_len_kv=np.zeros(nb, np.int32), seq_len_q=np.full(nb, bp.block_size, np.int32),
        staged_src=np.full(bp.staged_len, -1, np.int64),
        staged_dst=np.full(bp.staged_len, -1, np.int64),
        staged_dst2=np.full(bp.staged_len, -1, np.int64),
        committed_src=np.full(nb * bp.committed_len, -1, np.int64),
        committed_dst=np.full(nb * bp.committed_len, -1, np.int64))


_OFFSET_COLUMNS = [DESC_COLUMNS.index(c)
                   for c in ("rows_off", "blocks_off", "staged_off", "committed_off")]


def build_block_layout_looped(plan: LayoutPlan, b: int, committed: int, ring_base: int,
                              table: np.ndarray) -> BlockLayout:
    """The layout of block size ``b`` from the per-block loop of the op reference
    (``causal_layout_reference``: one iteration per kernel CTA), on this size's
    descriptor row with its offsets moved to 0 so it fills this size's arrays alone.
    """
    bp = plan.block(b)
    desc = plan.descriptor()[[plan.blocks.index(bp)]]           # [1, 12]
    desc[:, _OFFSET_COLUMNS] = 0
    out = _empty_layout(plan, bp)
    counters = torch.tensor([committed, ring_base, 0, 0], dtype=torch.int64)
    g = plan.geometry
    causal_layout_reference(
        counters, torch.from_numpy(np.ascontiguousarray(table, np.int64)),
        torch.from_numpy(desc), *(torch.from_numpy(getattr(out, name).reshape(-1))
                                  for name in _OP_OUTPUTS),
        pin_tokens=g.pin_tokens, window_tokens=g.window_tokens,
        max_staged_tokens=g.max_staged_tokens, tokens_per_page=plan.tokens_per_page,
        fixed_pages=plan.fixed_pages, ring_pages=plan.ring_pages)
    return out


def slots_at(plan: LayoutPlan, ring_base: int, table: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Vectorised ``slot_at`` over positions known to be resident (int64 [n])."""
    tpp, F = plan.tokens_per_page, plan.fixed_pages
    page = x // tpp
    idx = np.where(page < F, page, F + page - ring_base)
    assert idx.size == 0 or (idx.min() >= 0 and idx.max() < plan.table_len), (x, ring_base)
    return table[idx] * tpp + x % tpp


def _block_geometry(plan: LayoutPlan, bp: BlockPlan, committed: int):
    """Per block: starts s, full page ranges of both intervals, partial candidates."""
    g, tpp = plan.geometry, plan.tokens_per_page
    P, W = g.pin_tokens, g.window_tokens
    s = committed + np.arange(bp.num_blocks, dtype=np.int64) * bp.block_size  # [nb]
    a, lo = np.minimum(P, s), np.maximum(P, s - W)
    merged = lo <= a
    v0 = np.where(merged, s, a)
    u1 = np.where(merged, s, np.minimum(lo, s))
    fv0 = v0 // tpp                               # interval 0 starts at 0: pages [0, fv0)
    cu1 = -(-u1 // tpp)
    fv1 = np.maximum(cu1, s // tpp)               # interval 1: pages [cu1, fv1)
    # Partial segments in position order: tail of [0, v0), head and tail of [u1, s).
    starts = np.stack([fv0 * tpp, u1, fv1 * tpp], axis=1)                 # [nb, 3]
    ends = np.stack([v0, np.minimum(s, cu1 * tpp), s], axis=1)           # [nb, 3]
    cand = starts[:, :, None] + np.arange(tpp - 1)[None, None, :]        # [nb, 3, tpp-1]
    valid = cand < ends[:, :, None]
    nb = bp.num_blocks
    width = 3 * (tpp - 1)
    return s, fv0, cu1, fv1, cand.reshape(nb, width), valid.reshape(nb, width)


def _fill_rows(out: BlockLayout, plan: LayoutPlan, bp: BlockPlan, ring_base: int,
               table: np.ndarray, fv0, cu1, fv1, page0) -> np.ndarray:
    """Rows of every block: full pages of both intervals, private pages, padding."""
    tpp, g = plan.tokens_per_page, plan.geometry
    n_a, n_full = fv0, fv0 + (fv1 - cu1)                                     # [nb]
    assert n_full.max() <= (g.pin_tokens + g.window_tokens) // tpp
    k = np.arange(bp.row_pages)[None, :]                                     # [1, RP]
    logical = np.where(k < n_a[:, None], k, cu1[:, None] + k - n_a[:, None])  # [nb, RP]
    is_full = k < n_full[:, None]
    rows = page0[:, None] + np.minimum(k - n_full[:, None], bp.private_pages - 1)
    rows[is_full] = slots_at(plan, ring_base, table, logical[is_full] * tpp) // tpp
    out.rows[:] = rows
    return n_full


def build_block_layout(plan: LayoutPlan, b: int, committed: int, ring_base: int,
                       table: np.ndarray) -> BlockLayout:
    """The layout of block size ``b``, vectorised over blocks; equals the looped one."""
    bp, tpp, M = plan.block(b), plan.tokens_per_page, plan.geometry.max_staged_tokens
    nb, out = bp.num_blocks, _empty_layout(plan, bp)
    s, fv0, cu1, fv1, cand, valid = _block_geometry(plan, bp, committed)
    page0 = bp.private_base + np.arange(nb) * bp.private_pages               # [nb]
    n_full = _fill_rows(out, plan, bp, ring_base, table, fv0, cu1, fv1, page0)
    n_partial = valid.sum(axis=1)                                            # [nb]
    assert n_partial.max(initial=0) <= bp.committed_len
    out.seq_len_kv[:] = n_full * tpp + n_partial + b
    rank = np.cumsum(valid, axis=1) - 1                # private slot of each candidate
    slot0 = page0 * tpp
    jj = np.broadcast_to(np.arange(nb)[:, None], cand.shape)                 # block ids
    com = valid & (cand < committed)   # committed positions come first in each row
    n_com = com.sum(axis=1)
    at = jj[com] * bp.committed_len + rank[com]
    out.committed_src[at] = slots_at(plan, ring_base, table, cand[com])
    out.committed_dst[at] = slot0[jj[com]] + rank[com]
    cur = valid & (cand >= committed)
    assert (n_partial - n_com).max(initial=0) <= bp.current_len
    at = M + jj[cur] * bp.current_len + rank[cur] - n_com[jj[cur]]
    out.staged_src[at] = cand[cur] - committed
    out.staged_dst[at] = slot0[jj[cur]] + rank[cur]
    i = np.arange(nb * b)                                                    # own tokens
    out.staged_src[:nb * b] = i
    out.staged_dst[:nb * b] = slots_at(plan, ring_base, table, committed + i)
    out.staged_dst2[:nb * b] = slot0[i // b] + n_partial[i // b] + i % b
    return out
