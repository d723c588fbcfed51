"""Static sizes of one geometry's page layout, and the integer rules every layer shares.

Everything here is a pure function of (geometry, tokens_per_page) or of the committed
count; nothing holds rollout state. ``host.py`` draws the layout and holds the state;
the device kernel ``causal_layout_`` copies the same rules. The descriptor's format (its
columns) is the op's, ``framekv.ops.causal_layout.DESC_COLUMNS``; its values are defined
here, once, and the op checks them against what its kernel needs.

Notation (DESIGN.md, "The cache"): P = pin_tokens, W = window_tokens,
M = max_staged_tokens, tpp = tokens_per_page, C = committed count.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from framekv.ops.causal_layout import DESC_COLUMNS
from framekv.specs import Geometry


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockPlan:
    """Sizes of the per-block tensors of one declared causal block size.

    Attributes:
        block_size: b, tokens of one causal block.
        num_blocks: nb = M // b, the most blocks one forward holds.
        private_pages: Q_b = ceil((3*(tpp-1) + b) / tpp), private pages per block.
        row_pages: (P + W) // tpp + Q_b, entries of one row (full pages are at most
            (P + W) // tpp).
        committed_len: 3*(tpp-1), committed_private pairs per block.
        current_len: CPMAX_b = min(3*(tpp-1), (nb-1)*b), current_private entries per
            block (block j sees at most j*b staged tokens before its start).
        staged_len: M + nb * current_len, entries of the staged scatter list.
        private_base: first physical page of block 0's private pages.
    """

    block_size: int
    num_blocks: int
    private_pages: int
    row_pages: int
    committed_len: int
    current_len: int
    staged_len: int
    private_base: int

    def private_page(self, j: int) -> int:
        """First physical page of block j's private pages (they are contiguous)."""
        return self.private_base + j * self.private_pages


@dataclass(frozen=True)
class LayoutPlan:
    """Frozen page counts of one geometry inside the pool; holds no rollout state.

    Attributes:
        geometry: the geometry the plan is for.
        tokens_per_page: tpp, a power of two.
        fixed_pages: F = ceil(P / tpp), physical pages [0, F).
        ring_pages: R = floor((W + M + tpp - 2) / tpp) + 1, initially pages [F, F+R).
        blocks: one BlockPlan per declared block size, in sorted order.
        total_pages: F + R + every block's private pages: the pages of one sequence.
        page_base: physical page of the sequence's page 0 (`shifted`); 0 for the
            first sequence of a pool, i * total_pages for sequence i.
    """

    geometry: Geometry
    tokens_per_page: int
    fixed_pages: int
    ring_pages: int
    blocks: tuple[BlockPlan, ...]
    total_pages: int
    page_base: int = 0

    @staticmethod
    def for_geometry(geometry: Geometry, tokens_per_page: int) -> "LayoutPlan":
        """Compute every size of ``geometry`` at ``tokens_per_page`` tokens a page."""
        tpp = tokens_per_page
        if isinstance(tpp, bool) or not isinstance(tpp, int) or tpp < 1 or tpp & (tpp - 1):
            raise ValueError(f"tokens_per_page must be a power of two, got {tpp!r}")
        P, W, M = geometry.pin_tokens, geometry.window_tokens, geometry.max_staged_tokens
        fixed = _ceil_div(P, tpp)
        # [max(P, C-W), C+M) spans W+M positions starting anywhere inside a page.
        ring = (W + M + tpp - 2) // tpp + 1
        next_page = fixed + ring
        blocks = []
        for b in geometry.causal_block_sizes:  # sorted by the Geometry struct
            nb = M // b
            q = _ceil_div(3 * (tpp - 1) + b, tpp)
            current = min(3 * (tpp - 1), (nb - 1) * b)
            blocks.append(BlockPlan(
                block_size=b, num_blocks=nb, private_pages=q,
                row_pages=(P + W) // tpp + q, committed_len=3 * (tpp - 1),
                current_len=current, staged_len=M + nb * current, private_base=next_page))
            next_page += nb * q
        return LayoutPlan(geometry=geometry, tokens_per_page=tpp, fixed_pages=fixed,
                          ring_pages=ring, blocks=tuple(blocks), total_pages=next_page)

    def shifted(self, page_base: int) -> "LayoutPlan":
        """The same layout over physical pages [page_base, page_base + total_pages):
        the plan of one sequence of a pool holding several. Only physical page ids
        move (the table's initial pages, every block's private_base); every size and
        rule stays, so sequences share graphs, plans and kernels."""
        blocks = tuple(dataclasses.replace(bp, private_base=bp.private_base - self.page_base
                                           + page_base) for bp in self.blocks)
        return dataclasses.replace(self, blocks=blocks, page_base=page_base)

    @property
    def table_len(self) -> int:
        """F + R: entries of the page table (fixed pages, then the ring)."""
        return self.fixed_pages + self.ring_pages

    @property
    def pool_tokens(self) -> int:
        """Slots the geometry needs: total_pages * tokens_per_page."""
        return self.total_pages * self.tokens_per_page

    def descriptor(self) -> np.ndarray:
        """The layout descriptor ``causal_layout_`` reads: int64 [S, len(DESC_COLUMNS)],
        one row per block size in ``blocks`` order, columns named by the op's
        ``DESC_COLUMNS``; the ``*_off`` columns index the flat per-block tensors
        (each size's part starts where the previous size's ends)."""
        rows, off = [], dict.fromkeys(("rows_off", "blocks_off", "staged_off", "committed_off"), 0)
        for bp in self.blocks:
            row = {"b": bp.block_size, "nb": bp.num_blocks, "row_pages": bp.row_pages,
                   "private_pages": bp.private_pages, "committed_len": bp.committed_len,
                   "current_len": bp.current_len, "private_base": bp.private_base,
                   "staged_len": bp.staged_len, **off}
            rows.append([row[c] for c in DESC_COLUMNS])
            for name, n in zip(off, (bp.num_blocks * bp.row_pages, bp.num_blocks,
                                     bp.staged_len, bp.num_blocks * bp.committed_len)):
                off[name] += n
        return np.array(rows, np.int64).reshape(len(self.blocks), len(DESC_COLUMNS))

    def flat_sizes(self) -> tuple[int, int, int, int]:
        """Lengths of the flat tensors: (rows, seq_len_kv, staged lists, committed lists)."""
        return (sum(bp.num_blocks * bp.row_pages for bp in self.blocks),
                sum(bp.num_blocks for bp in self.blocks),
                sum(bp.staged_len for bp in self.blocks),
                sum(bp.num_blocks * bp.committed_len for bp in self.blocks))

    def block(self, block_size: int) -> BlockPlan:
        """The BlockPlan of a declared block size; ValueError for an undeclared one."""
        for bp in self.blocks:
            if bp.block_size == block_size:
                return bp
        raise ValueError(
            f"causal_block_size must be one of {self.geometry.causal_block_sizes}, "
            f"got {block_size!r}")


def pool_tokens_for(geometry: Geometry, tokens_per_page: int) -> int:
    """Pool slots (fixed + ring + every private page) ``geometry`` needs."""
    return LayoutPlan.for_geometry(geometry, tokens_per_page).pool_tokens


def ring_base_for(plan: LayoutPlan, committed: int) -> int:
    """Lowest logical page held by the ring after ``committed`` commits.

    max(F, max(P, C - W) // tpp): no future block sees a position below
    max(P, C - W) outside the fixed pages. A function of C alone, so the device
    advances it from the commit count without host input.
    """
    g = plan.geometry
    low = max(g.pin_tokens, committed - g.window_tokens)
    return max(plan.fixed_pages, low // plan.tokens_per_page)


def resident_low(plan: LayoutPlan, committed: int) -> int:
    """First resident position above the pinned ones: max(P, C - W)."""
    g = plan.geometry
    return max(g.pin_tokens, committed - g.window_tokens)


def is_resident(plan: LayoutPlan, committed: int, pos: int) -> bool:
    """True when ``pos`` has a slot: [0, P) or [max(P, C - W), C + M)."""
    g = plan.geometry
    if 0 <= pos < g.pin_tokens:
        return True
    return resident_low(plan, committed) <= pos < committed + g.max_staged_tokens


def check_ring_capacity(plan: LayoutPlan, committed: int, ring_base: int) -> None:
    """Assert the ring holds every page up to the last stageable position."""
    last = (committed + plan.geometry.max_staged_tokens - 1) // plan.tokens_per_page
    assert last - ring_base + 1 <= plan.ring_pages, (committed, ring_base, plan)
