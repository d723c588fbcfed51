"""The host mirror of a geometry's rollout state: C, the ring, the table, the staging.

The device advances the same state itself at every commit (``causal_layout_`` and
friends); the host keeps this mirror by the same deterministic rule and never reads the
device back. It answers where a position lives (``slot_of``), what an edit must write
(``edit_targets``) and what the device should hold (``flat_layout``, uploaded at open
and after a failed commit).
"""
from __future__ import annotations

import numpy as np

from .host import FLAT_FIELDS, BlockLayout, FlatLayout, build_block_layout, slot_at, slots_at
from .plan import (LayoutPlan, check_ring_capacity, is_resident, resident_low,
                   ring_base_for)

__all__ = ["HostLayout"]


class HostLayout:
    """Rollout state of one geometry's layout: committed count, ring base, page table,
    and what each layer staged.

    ``open`` state is C = 0, ring_base = F, table = the plan's pages
    [page_base, page_base + F + R) in order. Each
    layer's staged count is the most tokens it wrote since the last commit
    (``note_staged``); ``commit(n)`` needs every layer to have staged n (a forward that
    failed part way leaves some layers short) and leaves ``staged - n`` staged.
    ``snapshot`` / ``restore`` bring the whole state back after a failed operation.

    Args:
        plan: the geometry's `LayoutPlan`.
        num_layers: layers whose staging is tracked.
    """

    def __init__(self, plan: LayoutPlan, num_layers: int = 1):
        self.plan, self.num_layers = plan, num_layers
        self.reset()

    def reset(self) -> None:
        """Back to the state of a freshly opened geometry."""
        self._committed = 0
        self._ring_base = self.plan.fixed_pages
        self._table_np = self.plan.page_base + np.arange(self.plan.table_len, dtype=np.int64)  # [F + R]
        self._pending_roll = 0  # ring rotation not yet applied to _table_np (commit is O(1))
        self._staged = [0] * self.num_layers
        self._layouts: dict[int, BlockLayout] = {}

    def snapshot(self) -> tuple:
        """The whole state, to `restore` after an operation that failed part way."""
        return (self._committed, self._ring_base, self._table.copy(), list(self._staged))

    def restore(self, snap: tuple) -> None:
        """Back to a `snapshot`."""
        self._committed, self._ring_base, table, staged = snap
        self._table_np, self._pending_roll = table.copy(), 0
        self._staged = list(staged)
        self._layouts = {}

    @property
    def committed(self) -> int:
        """C, positions committed so far."""
        return self._committed

    @property
    def ring_base(self) -> int:
        """Logical page held by ring entry 0."""
        return self._ring_base

    @property
    def table(self) -> np.ndarray:
        """A copy of the page table, int64 [F + R]; the state cannot be edited through it."""
        return self._table.copy()

    @property
    def _table(self) -> np.ndarray:
        """The page table with every commit's ring rotation applied.

        Commits only add to a pending rotation, applied here on first use: a replayed
        commit's host mirror then costs a few integer operations, not an array roll.
        """
        if self._pending_roll:
            F = self.plan.fixed_pages
            self._table_np[F:] = np.roll(self._table_np[F:], -self._pending_roll)
            self._pending_roll = 0
        return self._table_np

    @property
    def staged(self) -> int:
        """Tokens written since the last commit and not yet committed (the most any
        layer wrote)."""
        return max(self._staged)

    def layer_staged(self, layer: int) -> int:
        """Tokens ``layer`` wrote since the last commit."""
        return self._staged[layer]

    def is_resident(self, pos: int) -> bool:
        """True when ``pos`` has a slot: [0, P) or [max(P, C - W), C + M)."""
        return is_resident(self.plan, self._committed, pos)

    def slot_of(self, pos: int) -> int:
        """Slot id of a resident position; ValueError for any other position."""
        if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)):
            raise ValueError(f"pos must be an integer, got {pos!r}")
        if not self.is_resident(int(pos)):
            g = self.plan.geometry
            raise ValueError(
                f"position {pos} is not resident: resident are [0, {g.pin_tokens}) and "
                f"[{resident_low(self.plan, self._committed)}, "
                f"{self._committed + g.max_staged_tokens})")
        return slot_at(self.plan, self._ring_base, self._table, int(pos))

    def slots_of(self, positions) -> np.ndarray:
        """`slot_of` of every position in ``positions`` (ints) at once: int64 [n];
        ValueError naming the first position that is not resident."""
        x = np.asarray(positions, dtype=np.int64).reshape(-1)
        M = self.plan.geometry.max_staged_tokens
        ok = ((x >= 0) & (x < self.plan.geometry.pin_tokens)) | (
            (x >= resident_low(self.plan, self._committed)) & (x < self._committed + M))
        if not ok.all():
            self.slot_of(int(x[~ok][0]))      # raises, naming it and the resident ranges
        return slots_at(self.plan, self._ring_base, self._table, x)

    def block_layout(self, b: int) -> BlockLayout:
        """Per-block tensors of block size ``b`` at the current state (cached)."""
        layout = self._layouts.get(b)
        if layout is None:
            layout = build_block_layout(self.plan, b, self._committed, self._ring_base,
                                        self._table)
            self._layouts[b] = layout
        return layout

    def flat_layout(self) -> FlatLayout:
        """Every block size's tensors at the current state, in the flat format (what
        the cache uploads at open, and on CPU after every commit)."""
        layouts = [self.block_layout(bp.block_size) for bp in self.plan.blocks]
        return FlatLayout(**{name: np.concatenate([getattr(x, name).reshape(-1)
                                                   for x in layouts])
                             for name in FLAT_FIELDS})

    def committed_copies(self) -> tuple[np.ndarray, np.ndarray]:
        """(src, dst) slot pairs of every block size, -1 padded, to apply after commit."""
        layouts = [self.block_layout(bp.block_size) for bp in self.plan.blocks]
        return (np.concatenate([x.committed_src for x in layouts]),
                np.concatenate([x.committed_dst for x in layouts]))

    def edit_targets(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source row, slot) pairs of an edit of positions [start, start + count): each
        position's shared slot, then every committed private copy of a committed one.

        Raises ValueError (from `slot_of`) naming the resident ranges for a position
        that is not resident.
        """
        if isinstance(start, bool) or not isinstance(start, int):
            raise ValueError(f"start must be an integer, got {start!r}")
        rows = np.arange(count, dtype=np.int64)
        slots = np.array([self.slot_of(start + int(r)) for r in rows], np.int64)
        csrc, cdst = self.committed_copies()
        copies: dict[int, list[int]] = {}
        for s_, d_ in zip(csrc.tolist(), cdst.tolist()):
            if s_ >= 0:
                copies.setdefault(s_, []).append(d_)
        extra_rows, extra_dst = [], []
        for r, slot in zip(rows.tolist(), slots.tolist()):
            if start + r < self._committed:
                for d_ in copies.get(slot, ()):
                    extra_rows.append(r)
                    extra_dst.append(d_)
        return (np.concatenate([rows, np.array(extra_rows, np.int64)]),
                np.concatenate([slots, np.array(extra_dst, np.int64)]))

    def note_staged(self, tokens: int, layer: int | None = None) -> None:
        """Record a forward of ``layer`` (None: of every layer, as a replayed forward)
        that wrote ``tokens`` rows at [C, C + tokens)."""
        M = self.plan.geometry.max_staged_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= M:
            raise ValueError(f"tokens must be an integer in [0, {M}], got {tokens!r}")
        layers = range(self.num_layers) if layer is None else (layer,)
        for i in layers:
            self._staged[i] = max(self._staged[i], tokens)

    def check_commit(self, n: int) -> None:
        """ValueError unless ``commit(n)`` may run: n in [0, staged], and every layer
        staged at least n (else the commit would make stale K/V history)."""
        staged = self.staged
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= staged:
            raise ValueError(f"n must be an integer in [0, staged={staged}], got {n!r}")
        short = [i for i, s in enumerate(self._staged) if s < n]
        if short:
            raise ValueError(f"commit({n}) needs every layer to have staged {n} tokens since "
                             f"the last commit; layers {short} staged "
                             f"{[self._staged[i] for i in short]} (a forward failed part way?): "
                             "run the forward again, then commit")

    def commit(self, n: int) -> int:
        """Make [C, C + n) history and rotate the ring; returns the rotation d. All or
        nothing: the state changes only once every check passed.

        The caller then applies ``committed_copies()`` to every layer.
        """
        self.check_commit(n)
        committed = self._committed + n
        new_base = ring_base_for(self.plan, committed)
        d = new_base - self._ring_base
        assert 0 <= d <= self.plan.ring_pages, (d, self._ring_base, new_base)
        check_ring_capacity(self.plan, committed, new_base)
        self._committed, self._ring_base = committed, new_base
        self._staged = [max(0, s - n) for s in self._staged]
        # Dropped pages return at the ring's end; the roll itself waits for `_table`.
        self._pending_roll = (self._pending_roll + d) % self.plan.ring_pages
        self._layouts.clear()
        return d
