"""Host model of the cache layout, checked by simulating the pool slot by slot.

The simulated pool holds int64 stamps instead of K/V; a stamp encodes (forward step,
layer, K or V, position), so a key read from the wrong slot, layer, tensor or forward
decodes to the wrong tuple. Every block's row is read the way a paged kernel reads it
(whole pages in row order, cut at seq_len_kv) and must decode to exactly V(j).
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from framekv.engine.cache import (HostLayout, LayoutPlan, build_block_layout,
                                  build_block_layout_looped, pool_tokens_for, ring_base_for)
from framekv.engine.cache.host import FLAT_FIELDS
from framekv.engine.cache.reference import visible_positions
from framekv.specs import Geometry

LAYERS = 2
LAYOUT_FIELDS = FLAT_FIELDS


# --------------------------------------------------------------------------- stamps

def stamp(step, pos):
    """Stamps [LAYERS, 2 (K, V), n] of positions ``pos`` written by forward ``step``."""
    pos = np.asarray(pos, np.int64)
    tag = (np.int64(step) * LAYERS + np.arange(LAYERS)[:, None]) * 2 + np.arange(2)[None, :]
    return (tag[:, :, None] << 32) + pos[None, None, :] + 1


def decode(stamps):
    """(step, layer, kv, pos) arrays of stamps; an untouched slot decodes to pos -1."""
    tag = stamps >> 32
    return tag >> 2, (tag >> 1) & 1, tag & 1, (stamps & 0xFFFFFFFF) - 1


class PoolSim:
    """Stamps of every slot of every layer, K and V: int64 [LAYERS, 2, pool_tokens]."""

    def __init__(self, plan: LayoutPlan):
        self.plan = plan
        self.pool = np.zeros((LAYERS, 2, plan.pool_tokens), np.int64)

    def scatter(self, layout, tokens: int, step: int, committed: int) -> None:
        """The staged scatter of one forward of ``tokens`` rows, every layer."""
        src = layout.staged_src
        for dst in (layout.staged_dst, layout.staged_dst2):
            use = (src >= 0) & (src < tokens) & (dst >= 0)
            self.pool[:, :, dst[use]] = stamp(step, committed + src[use])

    def copy(self, src, dst) -> None:
        use = src >= 0
        assert np.array_equal(use, dst >= 0)
        self.pool[:, :, dst[use]] = self.pool[:, :, src[use]]

    def read_row(self, layout, j: int) -> np.ndarray:
        """Keys of block j in kernel order: whole pages of the row, cut at seq_len_kv."""
        tpp = self.plan.tokens_per_page
        k = np.arange(layout.seq_len_kv[j])
        return self.pool[:, :, layout.rows[j, k // tpp].astype(np.int64) * tpp + k % tpp]


# --------------------------------------------------------------------------- checks

def check_block(sim, layout, geometry, j, committed, step, committed_step):
    """Block j's keys are exactly V(j): right positions, layer, K/V and forward."""
    b = layout.block_size
    s = committed + j * b
    want = visible_positions(geometry, committed, s, b)
    assert layout.seq_len_kv[j] == want.size and layout.seq_len_q[j] == b
    st, layer, kv, pos = decode(sim.read_row(layout, j))
    assert (layer == np.arange(LAYERS)[:, None, None]).all(), (s, layer)
    assert (kv == np.arange(2)[None, :, None]).all(), (s, kv)
    assert (pos == pos[0, 0]).all()
    got = pos[0, 0]
    assert np.array_equal(np.sort(got), want), (s, np.sort(got), want)
    assert np.array_equal(got[-b:], np.arange(s, s + b)), "own tokens must be the last keys"
    # Full pages are exactly the pages wholly inside V'(j), whole and in logical order;
    # the private keys follow in increasing position order.
    tpp, table_len = sim.plan.tokens_per_page, sim.plan.table_len
    pages, counts = np.unique(want[want < s] // tpp, return_counts=True)
    full = pages[counts == tpp]
    n_full = int((layout.rows[j] < table_len).sum())
    assert n_full == full.size, (s, n_full, full)
    want_full = (full[:, None] * tpp + np.arange(tpp)[None, :]).reshape(-1)
    assert np.array_equal(got[:n_full * tpp], want_full), (s, got, want_full)
    assert (np.diff(got[n_full * tpp:]) > 0).all(), (s, got)
    want_step = np.where(got >= committed, step, committed_step[np.minimum(got, committed)])
    assert (st == want_step).all(), (s, st[0, 0], want_step)


def check_invariants(plan, host, layout):
    """Page table, rows and slot lists stay inside their own regions."""
    F, R, tpp = plan.fixed_pages, plan.ring_pages, plan.tokens_per_page
    table = host.table
    assert np.array_equal(np.sort(table), np.arange(F + R)), table
    assert np.array_equal(table[:F], np.arange(F))
    bp = plan.block(layout.block_size)
    nb, b, Q = bp.num_blocks, bp.block_size, bp.private_pages
    shared_end = (F + R) * tpp
    for j in range(nb):
        row, page0 = layout.rows[j], bp.private_page(j)
        n_full = int((row < F + R).sum())
        assert (row[:n_full] < F + R).all() and len(set(row[:n_full])) == n_full
        assert np.array_equal(row[n_full:n_full + Q], page0 + np.arange(Q))
        assert (row[n_full + Q:] == page0 + Q - 1).all()
        assert layout.seq_len_kv[j] <= (n_full + Q) * tpp
        lo, hi = page0 * tpp, (page0 + Q) * tpp
        cp = slice(j * bp.committed_len, (j + 1) * bp.committed_len)
        c_src, c_dst = layout.committed_src[cp], layout.committed_dst[cp]
        assert ((c_src < 0) == (c_dst < 0)).all()
        assert ((c_src[c_src >= 0] < shared_end)).all()
        assert ((c_dst[c_dst >= 0] >= lo) & (c_dst[c_dst >= 0] < hi)).all()
        cur = slice(plan.geometry.max_staged_tokens + j * bp.current_len,
                    plan.geometry.max_staged_tokens + (j + 1) * bp.current_len)
        r_src, r_dst = layout.staged_src[cur], layout.staged_dst[cur]
        assert (r_src < j * b).all() and ((r_src < 0) == (r_dst < 0)).all()
        assert ((r_dst[r_dst >= 0] >= lo) & (r_dst[r_dst >= 0] < hi)).all()
        own = slice(j * b, (j + 1) * b)
        assert (layout.staged_dst[own] < shared_end).all()
        assert ((layout.staged_dst2[own] >= lo) & (layout.staged_dst2[own] < hi)).all()
    assert (layout.staged_dst2[layout.staged_dst2 >= 0] >= shared_end).all()
    dsts = np.concatenate([layout.staged_dst, layout.staged_dst2])
    dsts = dsts[dsts >= 0]
    assert len(np.unique(dsts)) == dsts.size, "two staged writes hit one slot"
    c_dst = layout.committed_dst[layout.committed_dst >= 0]
    assert len(np.unique(c_dst)) == c_dst.size
    assert not np.isin(c_dst, dsts).any(), "a forward would overwrite a committed copy"


def check_committed(sim, host, committed_step):
    """Every resident committed position's slot, and every committed copy, is current."""
    plan, C = host.plan, host.committed
    g = plan.geometry
    positions = [x for x in range(min(g.pin_tokens, C))] + list(
        range(max(g.pin_tokens, C - g.window_tokens), C))
    if positions:
        slots = np.array([host.slot_of(x) for x in positions])
        st, _, _, pos = decode(sim.pool[:, :, slots])
        assert (pos == np.array(positions)).all()
        assert (st == committed_step[positions]).all()
    src, dst = host.committed_copies()
    dst = dst[dst >= 0]
    st, layer, kv, pos = decode(sim.pool[:, :, dst])
    assert (pos >= 0).all() and (pos < C).all()
    assert (st == committed_step[pos]).all()
    assert (layer == np.arange(LAYERS)[:, None, None]).all()


# --------------------------------------------------------------------------- rollout

def run_rollout(geometry: Geometry, tpp: int, commits: int, seed: int,
                check_every: int = 1) -> HostLayout:
    """Forwards, reads and commits with random block sizes, token counts and n."""
    rng = np.random.default_rng(seed)
    plan = LayoutPlan.for_geometry(geometry, tpp)
    host, sim = HostLayout(plan), PoolSim(plan)
    M, sizes = geometry.max_staged_tokens, geometry.causal_block_sizes
    horizon = (commits + 1) * M + 1
    written_step = np.full(horizon, -1, np.int64)     # last forward that wrote a position
    committed_step = np.full(horizon, -1, np.int64)   # its value when committed
    step = 0
    for c in range(commits):
        C = host.committed
        for _ in range(int(rng.integers(1, 4))):       # denoising steps overwrite
            step += 1
            b = int(rng.choice(sizes))
            T = b * int(rng.integers(1, M // b + 1))
            layout = host.block_layout(b)
            if c % check_every == 0:
                check_invariants(plan, host, layout)
            host.note_staged(T)
            sim.scatter(layout, T, step, C)
            written_step[C:C + T] = step
            for j in range(T // b):
                check_block(sim, layout, geometry, j, C, step, committed_step)
        n = T if rng.random() < 0.7 else int(rng.integers(0, host.staged + 1))
        host.commit(n)
        committed_step[C:C + n] = written_step[C:C + n]
        sim.copy(*host.committed_copies())
        if c % check_every == 0:
            check_committed(sim, host, committed_step)
    return host


CASES = {
    # name: (P, W, M, block sizes, tokens_per_page, commits)
    "worked-example": (6, 9, 6, (3,), 4, 150),
    "no-pin-no-window": (0, 0, 5, (1, 5), 2, 150),
    "window-under-a-page": (3, 2, 7, (1, 7), 8, 150),
    "window-over-M-long": (5, 37, 6, (2, 3, 6), 4, 500),
    "pin-over-forwards-long": (29, 11, 4, (1, 2, 4), 4, 500),
    "pin-only": (10, 0, 4, (1, 2, 4), 4, 100),
    "window-only-long": (0, 13, 5, (1, 5), 8, 500),
    "one-token-pages": (3, 5, 4, (1, 2, 4), 1, 200),
    "128-token-pages": (130, 200, 48, (1, 16, 48), 128, 40),
    "big-pages-tiny-geometry": (1, 1, 3, (1, 3), 64, 150),
    "aligned": (8, 16, 8, (4, 8), 4, 150),
    "M-not-multiple-of-b": (7, 10, 7, (2, 3, 7), 4, 200),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rollout_named(name):
    P, W, M, sizes, tpp, commits = CASES[name]
    run_rollout(Geometry(P, W, M, sizes), tpp, commits, seed=zlib.crc32(name.encode()))


def random_geometry(rng):
    tpp = int(2 ** rng.integers(0, 8))
    M = int(rng.integers(1, 25))
    P = int(rng.choice([0, rng.integers(1, 4 * tpp + 2), tpp * rng.integers(1, 4),
                        rng.integers(M + 1, 3 * M + 2)]))
    W = int(rng.choice([0, rng.integers(1, tpp + 1), rng.integers(1, 4 * tpp + 30),
                        rng.integers(M + 1, 3 * M + 2)]))
    sizes = {1, M} | {int(x) for x in rng.integers(1, M + 1, size=2)}
    return Geometry(P, W, M, tuple(sizes)), tpp


@pytest.mark.parametrize("seed", range(24))
def test_rollout_random(seed):
    rng = np.random.default_rng(1000 + seed)
    geometry, tpp = random_geometry(rng)
    run_rollout(geometry, tpp, commits=60, seed=seed)


# --------------------------------------------------------------------------- worked example

def logical_pages(host, pages):
    """Logical page of each physical page in ``pages`` (fixed or ring)."""
    plan, table = host.plan, host.table
    F = plan.fixed_pages
    inverse = {int(p): (i if i < F else host.ring_base + i - F) for i, p in enumerate(table)}
    return [inverse[int(p)] for p in pages]


def test_worked_example():
    """DESIGN.md: tpp 4, P 6, W 9, a forward of 6 tokens at C = 20 in blocks of 3."""
    plan = LayoutPlan.for_geometry(Geometry(6, 9, 6, (3,)), 4)
    host = HostLayout(plan)
    for tokens, n in ((6, 6), (6, 6), (6, 6), (3, 2)):
        host.note_staged(tokens)
        host.commit(n)
    assert host.committed == 20
    layout = host.block_layout(3)
    tpp, bp = 4, plan.block(3)
    slot_pos = {host.slot_of(x): x for x in list(range(6)) + list(range(11, 26))}
    expected = {  # block: (full logical pages, committed copies, current rows, seq_len_kv)
        0: ([0, 3, 4], [4, 5, 11], [], 18),
        1: ([0, 4], [4, 5, 14, 15], [0, 1, 2], 18),
    }
    for j, (full, committed, current, seq_len_kv) in expected.items():
        row = layout.rows[j]
        assert logical_pages(host, row[:len(full)]) == full
        assert list(row[len(full):len(full) + bp.private_pages]) == list(
            bp.private_page(j) + np.arange(bp.private_pages))
        assert layout.seq_len_kv[j] == seq_len_kv
        slot0 = bp.private_page(j) * tpp
        cp = slice(j * bp.committed_len, (j + 1) * bp.committed_len)
        src, dst = layout.committed_src[cp], layout.committed_dst[cp]
        assert [slot_pos[s] for s in src[src >= 0]] == committed
        assert list(dst[dst >= 0] - slot0) == list(range(len(committed)))
        cur = slice(6 + j * bp.current_len, 6 + (j + 1) * bp.current_len)
        r_src, r_dst = layout.staged_src[cur], layout.staged_dst[cur]
        assert list(r_src[r_src >= 0]) == current
        n_part = len(committed) + len(current)
        assert list(r_dst[r_dst >= 0] - slot0) == list(range(len(committed), n_part))
        own = slice(3 * j, 3 * j + 3)
        assert list(layout.staged_src[own]) == [3 * j, 3 * j + 1, 3 * j + 2]
        assert [slot_pos[s] for s in layout.staged_dst[own]] == list(range(20 + 3 * j,
                                                                            23 + 3 * j))
        assert list(layout.staged_dst2[own] - slot0) == list(range(n_part, n_part + 3))


# --------------------------------------------------------------------------- sizes, errors

def test_pool_tokens_for():
    assert pool_tokens_for(Geometry(6, 9, 6, (3,)), 4) == (2 + 5 + 2 * 3) * 4
    assert pool_tokens_for(Geometry(0, 0, 1, (1,)), 1) == 2
    plan = LayoutPlan.for_geometry(Geometry(5, 7, 8, (8, 2)), 4)
    assert (plan.fixed_pages, plan.ring_pages) == (2, 5)
    b2, b8 = plan.blocks
    assert (b2.block_size, b2.num_blocks, b2.private_pages, b2.private_base) == (2, 4, 3, 7)
    assert (b8.block_size, b8.num_blocks, b8.private_pages, b8.private_base) == (8, 1, 5, 19)
    assert (b2.row_pages, b2.committed_len, b2.current_len, b2.staged_len) == (6, 9, 6, 32)
    assert (b8.current_len, b8.staged_len) == (0, 8)
    assert plan.total_pages == 24 and plan.pool_tokens == 96
    assert pool_tokens_for(Geometry(5, 7, 8, (2, 8)), 4) == 96


def test_bad_tokens_per_page():
    for tpp in (0, 3, 48, True, 4.0):
        with pytest.raises(ValueError, match="tokens_per_page"):
            LayoutPlan.for_geometry(Geometry(1, 1, 1, (1,)), tpp)


def test_residency_and_slot_errors():
    plan = LayoutPlan.for_geometry(Geometry(6, 9, 6, (3,)), 4)
    host = HostLayout(plan)
    for _ in range(3):
        host.note_staged(6)
        host.commit(6)
    host.note_staged(2)
    host.commit(2)                                       # C = 20
    resident = set(range(6)) | set(range(11, 26))
    for x in range(-3, 40):
        assert host.is_resident(x) == (x in resident), x
        if x in resident:
            assert 0 <= host.slot_of(x) < (plan.fixed_pages + plan.ring_pages) * 4
        else:
            with pytest.raises(ValueError, match="not resident"):
                host.slot_of(x)
    slots = [host.slot_of(x) for x in sorted(resident)]
    assert len(set(slots)) == len(slots)
    with pytest.raises(ValueError, match="integer"):
        host.slot_of(3.0)


def test_commit_and_staged_errors():
    host = HostLayout(LayoutPlan.for_geometry(Geometry(2, 3, 4, (1, 2, 4)), 2))
    with pytest.raises(ValueError, match="staged=0"):
        host.commit(1)
    host.note_staged(4)
    host.note_staged(2)
    assert host.staged == 4
    with pytest.raises(ValueError, match="staged=4"):
        host.commit(5)
    with pytest.raises(ValueError):
        host.commit(-1)
    host.commit(3)
    assert (host.committed, host.staged) == (3, 1)
    with pytest.raises(ValueError, match="staged=1"):
        host.commit(2)
    for bad in (5, -1, 2.0):
        with pytest.raises(ValueError, match="tokens"):
            host.note_staged(bad)
    with pytest.raises(ValueError, match="causal_block_size"):
        host.block_layout(3)
    table = host.table
    table[:] = 0                                         # a copy: the state is untouched
    assert np.array_equal(np.sort(host.table), np.arange(len(table)))


def test_open_state():
    plan = LayoutPlan.for_geometry(Geometry(5, 3, 4, (2,)), 4)
    host = HostLayout(plan)
    assert (host.committed, host.ring_base, host.staged) == (0, 2, 0)
    assert np.array_equal(host.table, np.arange(plan.fixed_pages + plan.ring_pages))
    layout = host.block_layout(2)
    assert (layout.committed_src == -1).all() and (layout.committed_dst == -1).all()
    assert list(layout.seq_len_kv) == [2, 4]             # block 1 sees block 0's tokens


# --------------------------------------------------------------------------- drivers agree

@pytest.mark.parametrize("seed", range(6))
def test_vectorised_equals_looped(seed):
    """The vectorised host model against the per-block loop (the op reference), at many
    states of a random rollout, per field; then the flat format against its parts."""
    rng = np.random.default_rng(seed)
    geometry, tpp = random_geometry(rng)
    plan = LayoutPlan.for_geometry(geometry, tpp)
    host = HostLayout(plan)
    desc = plan.descriptor()
    for _ in range(40):
        for bp in plan.blocks:
            args = (plan, bp.block_size, host.committed, host.ring_base, host.table)
            fast, slow = build_block_layout(*args), build_block_layout_looped(*args)
            for field in LAYOUT_FIELDS:
                assert np.array_equal(getattr(fast, field), getattr(slow, field)), field
        flat = host.flat_layout()
        for i, bp in enumerate(plan.blocks):
            part = host.block_layout(bp.block_size)
            b, nb, rp, _, cl, _, _, roff, boff, soff, sl, coff = desc[i]
            assert np.array_equal(flat.rows[roff:roff + nb * rp], part.rows.reshape(-1))
            assert np.array_equal(flat.seq_len_kv[boff:boff + nb], part.seq_len_kv)
            assert np.array_equal(flat.staged_dst2[soff:soff + sl], part.staged_dst2)
            assert np.array_equal(flat.committed_src[coff:coff + nb * cl], part.committed_src)
        assert tuple(len(getattr(flat, f)) for f in ("rows", "seq_len_kv", "staged_src",
                                                     "committed_src")) == plan.flat_sizes()
        host.note_staged(geometry.max_staged_tokens)
        host.commit(int(rng.integers(0, geometry.max_staged_tokens + 1)))
        assert host.ring_base == ring_base_for(plan, host.committed)
