"""The commit ops on CPU: ``advance_commit_`` and ``causal_layout_`` (their references)
against the host model ``HostLayout`` over long rollouts of odd geometries, the flat
descriptor, and argument validation.

The helpers here (geometries, device state built from a host model, the commit
sequence, the comparison) are shared by the simulator and GPU tests of these ops.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from framekv.engine.cache import HostLayout, LayoutPlan, ring_base_for
from framekv.ops import rotate_rows_
from framekv.ops.advance_commit import advance_commit_, advance_commit_reference
from framekv.ops.causal_layout import DESC_COLUMNS, causal_layout_, causal_layout_reference
from framekv.specs import Geometry
from test_layout_host import random_geometry

OUTPUTS = ("rows", "seq_len_kv", "staged_src", "staged_dst", "staged_dst2",
           "committed_src", "committed_dst")

GEOMETRIES = {
    # name: (P, W, M, block sizes, tokens_per_page)
    "worked-example": (6, 9, 6, (3,), 4),
    "no-pin-no-window": (0, 0, 5, (1, 5), 2),
    "window-under-a-page": (3, 2, 7, (1, 7), 8),
    "window-over-M": (5, 37, 6, (2, 3, 6), 4),
    "pin-over-forwards": (29, 11, 4, (1, 2, 4), 4),
    "pin-only": (10, 0, 4, (1, 2, 4), 4),
    "window-only": (0, 13, 5, (1, 5), 8),
    "one-token-pages": (3, 5, 4, (1, 2, 4), 1),
    "128-token-pages": (130, 200, 48, (1, 16, 48), 128),
    "big-pages-tiny": (1, 1, 3, (1, 3), 64),
    "aligned": (8, 16, 8, (4, 8), 4),
    "M-not-multiple-of-b": (7, 10, 7, (2, 3, 7), 4),
}


def make_plan(P, W, M, sizes, tpp) -> LayoutPlan:
    return LayoutPlan.for_geometry(Geometry(P, W, M, sizes), tpp)


def random_plan(rng) -> LayoutPlan:
    """Odd geometries: pin 0 / unaligned / aligned / past M, window 0 / under a page /
    unaligned / past M, block sizes 1..M, tpp 1..128 (the host model suite's draw)."""
    geometry, tpp = random_geometry(rng)
    return LayoutPlan.for_geometry(geometry, tpp)


def layout_kwargs(plan: LayoutPlan) -> dict:
    g = plan.geometry
    return dict(pin_tokens=g.pin_tokens, window_tokens=g.window_tokens,
                max_staged_tokens=g.max_staged_tokens, tokens_per_page=plan.tokens_per_page,
                fixed_pages=plan.fixed_pages, ring_pages=plan.ring_pages)


def advance_kwargs(plan: LayoutPlan) -> dict:
    g = plan.geometry
    return dict(pin_tokens=g.pin_tokens, window_tokens=g.window_tokens,
                tokens_per_page=plan.tokens_per_page, fixed_pages=plan.fixed_pages)


def device_state(host: HostLayout, device, garbage: int = -7) -> dict:
    """Tensors of the host model's state (counters, table, desc); outputs full of
    ``garbage`` so a test sees every entry the op must write."""
    plan = host.plan
    rows, blocks, staged, committed = plan.flat_sizes()
    t = dict(counters=torch.tensor([host.committed, host.ring_base, 0, 0]),
             table=torch.from_numpy(host.table),
             desc=torch.from_numpy(plan.descriptor()))
    for name, n in zip(OUTPUTS, (rows, blocks, staged, staged, staged, committed, committed)):
        t[name] = torch.full((n,), garbage, dtype=torch.int32 if name in OUTPUTS[:2]
                             else torch.int64)
    return {name: x.to(device) for name, x in t.items()}


def scribble(t: dict, value: int) -> None:
    """Overwrite every op output (the op must not depend on their old contents)."""
    for name in OUTPUTS:
        t[name].fill_(value)


def commit_ops(t: dict, plan: LayoutPlan, n: int) -> None:
    """The device side of commit(n): advance, rotate the ring, rebuild the layout."""
    advance_commit_(t["counters"], n, **advance_kwargs(plan))
    rotate_rows_(t["table"][plan.fixed_pages:], t["counters"][2:3])
    layout_args = [t[k] for k in ("counters", "table", "desc") + OUTPUTS]
    causal_layout_(*layout_args, **layout_kwargs(plan))


def host_commit(rng, host: HostLayout) -> tuple[int, int]:
    """A forward of random size then a commit of it or of a random part; (n, shift)."""
    M, sizes = host.plan.geometry.max_staged_tokens, host.plan.geometry.causal_block_sizes
    b = int(rng.choice(sizes))
    T = b * int(rng.integers(1, M // b + 1))
    host.note_staged(T)
    n = T if rng.random() < 0.7 else int(rng.integers(0, host.staged + 1))
    return n, host.commit(n)


def assert_matches_host(t: dict, host: HostLayout, shift: int | None = None,
                        where: str = "") -> None:
    """Counters, table and every flat output equal the host model's."""
    got = {name: x.cpu().numpy() for name, x in t.items()}
    assert got["counters"][0] == host.committed, where
    assert got["counters"][1] == host.ring_base, where
    if shift is not None:
        assert got["counters"][2] == shift, where
    assert np.array_equal(got["table"], host.table), where
    flat = host.flat_layout()
    for name in OUTPUTS:
        want = getattr(flat, name)
        assert got[name].dtype == want.dtype, name
        bad = np.nonzero(got[name] != want)[0]
        assert bad.size == 0, (where, name, bad[:8], got[name][bad[:8]], want[bad[:8]])


def host_at(plan: LayoutPlan, committed: int, seed: int) -> HostLayout:
    """A host model jumped to ``committed`` positions with a shuffled ring (any ring
    order is a reachable state), to reach positions past 2**32 without committing."""
    host = HostLayout(plan)
    host._committed = committed
    host._ring_base = ring_base_for(plan, committed)
    ring = host._table[plan.fixed_pages:]
    ring[:] = np.random.default_rng(seed).permutation(ring)
    return host


def run_rollout(plan: LayoutPlan, commits: int, seed: int, device="cpu",
                scribble_every: int = 7, host: HostLayout | None = None) -> HostLayout:
    """Commits through the ops on ``device`` against the host model (fresh, or ``host``),
    checked after each."""
    rng = np.random.default_rng(seed)
    host = host if host is not None else HostLayout(plan)
    t = device_state(host, device)
    for c in range(commits):
        n, shift = host_commit(rng, host)
        if c % scribble_every == 0:
            scribble(t, -(c % 5) - 2)
        commit_ops(t, plan, n)
        assert_matches_host(t, host, shift, where=f"commit {c}, n {n}")
    return host


# --------------------------------------------------------------------------- rollouts

LONG = {"window-over-M": 600, "pin-over-forwards": 600, "window-only": 500,
        "one-token-pages": 500}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_ops_equal_host_model_named(name):
    host = run_rollout(make_plan(*GEOMETRIES[name]), LONG.get(name, 120),
                       seed=zlib.crc32(name.encode()))
    assert host.committed > 0


@pytest.mark.parametrize("seed", range(16))
def test_ops_equal_host_model_random(seed):
    run_rollout(random_plan(np.random.default_rng(500 + seed)), 60, seed)


@pytest.mark.parametrize("name", ["window-over-M", "128-token-pages", "one-token-pages"])
def test_ops_equal_host_model_past_2_to_the_32(name):
    plan = make_plan(*GEOMETRIES[name])
    run_rollout(plan, 40, seed=1, host=host_at(plan, 2 ** 40 + 12345, seed=2))


def test_reference_equals_host_model_at_arbitrary_states():
    """The reference on (C, ring_base, table) of the host model, called directly."""
    rng = np.random.default_rng(3)
    for _ in range(6):
        plan = random_plan(rng)
        host = HostLayout(plan)
        for _ in range(30):
            host_commit(rng, host)
            t = device_state(host, "cpu", garbage=int(rng.integers(-9, 9)))
            causal_layout_reference(*(t[k] for k in ("counters", "table", "desc") + OUTPUTS),
                                    **layout_kwargs(plan))
            assert_matches_host(t, host)


def test_advance_commit_equals_ring_base_for():
    rng = np.random.default_rng(0)
    for _ in range(40):
        plan = random_plan(rng)
        for C in [0, 1, 2 ** 40 + 3] + [int(x) for x in rng.integers(0, 500, size=10)]:
            base0 = int(rng.integers(0, 1000))
            for n in (0, 1, int(rng.integers(0, 100))):
                counters = torch.tensor([C, base0, 99, 5])
                advance_commit_(counters, n, **advance_kwargs(plan))
                base = ring_base_for(plan, C + n)
                assert counters.tolist() == [C + n, base, base - base0, 5]


def test_advance_commit_tensor_n_equals_int_n():
    """n as a one-element device tensor (read when the op runs) commits as the int does;
    0 leaves C and the ring as they were (a pool sequence that did not commit)."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        plan = random_plan(rng)
        for n in (0, 1, int(rng.integers(0, 300))):
            C, base0 = int(rng.integers(0, 500)), int(rng.integers(0, 100))
            a, b = torch.tensor([C, base0, 99, 5]), torch.tensor([C, base0, 99, 5])
            advance_commit_(a, n, **advance_kwargs(plan))
            advance_commit_(b, torch.tensor([n]), **advance_kwargs(plan))
            assert a.tolist() == b.tolist()
    counters = torch.tensor([12, 3, 4, 0])
    advance_commit_(counters, torch.zeros(1, dtype=torch.int64), pin_tokens=0,
                    window_tokens=4, tokens_per_page=2, fixed_pages=0)
    assert counters.tolist() == [12, 4, 1, 0]   # max(0, 8 // 2) = 4: the shift from 3


@pytest.mark.parametrize("bad,match", [(torch.tensor([1, 2]), "one-element int64"),
                                       (torch.tensor([1], dtype=torch.int32), "int64"),
                                       (torch.tensor([1.0]), "int64")])
def test_advance_commit_rejects_bad_n_tensor(bad, match):
    counters = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"^n: .*{match}"):
        advance_commit_(counters, bad, pin_tokens=5, window_tokens=7, tokens_per_page=4,
                        fixed_pages=2)
    assert counters.tolist() == [0, 0, 0, 0]


def test_advance_commit_reference_is_tensor_only():
    counters = torch.tensor([10, 3, 0, 7])
    advance_commit_reference(counters, 6, pin_tokens=5, window_tokens=4, tokens_per_page=2,
                             fixed_pages=3)
    assert counters.tolist() == [16, 6, 3, 7]   # max(3, max(5, 12) // 2)


def test_custom_ops_are_registered():
    plan = make_plan(*GEOMETRIES["worked-example"])
    host = HostLayout(plan)
    t = device_state(host, "cpu")
    torch.ops.framekv.advance_commit_(t["counters"], None, 0, *advance_kwargs(plan).values())
    torch.ops.framekv.causal_layout_(*(t[k] for k in ("counters", "table", "desc") + OUTPUTS),
                                     *layout_kwargs(plan).values())
    assert_matches_host(t, host)


def test_ops_under_torch_compile():
    plan = make_plan(*GEOMETRIES["pin-over-forwards"])
    host = HostLayout(plan)
    t = device_state(host, "cpu")
    compiled = torch.compile(lambda: commit_ops(t, plan, 3), backend="aot_eager", fullgraph=True)
    for _ in range(3):
        host.note_staged(3)
        host.commit(3)
        compiled()
        assert_matches_host(t, host)


# --------------------------------------------------------------------------- descriptor

def test_descriptor_and_flat_sizes():
    plan = make_plan(5, 7, 8, (2, 8), 4)   # F 2, R 5; see test_layout_host.test_pool_tokens_for
    assert DESC_COLUMNS[:2] == ("b", "nb") and len(DESC_COLUMNS) == 12
    assert plan.descriptor().tolist() == [
        [2, 4, 6, 3, 9, 6, 7, 0, 0, 0, 32, 0],
        [8, 1, 8, 5, 9, 0, 19, 24, 4, 32, 8, 36]]
    assert plan.flat_sizes() == (32, 5, 40, 45)
    flat = HostLayout(plan).flat_layout()
    assert [len(getattr(flat, f)) for f in ("rows", "seq_len_kv", "seq_len_q", "staged_src",
                                            "committed_src")] == [32, 5, 5, 40, 45]
    assert flat.seq_len_q.tolist() == [2, 2, 2, 2, 8]


# --------------------------------------------------------------------------- validation

def _valid_layout_args():
    plan = make_plan(5, 7, 8, (2, 8), 4)
    t = device_state(HostLayout(plan), "cpu")
    return t, layout_kwargs(plan)


def _call_layout(t, kw):
    causal_layout_(*(t[k] for k in ("counters", "table", "desc") + OUTPUTS), **kw)


def _desc_with(row, col, value):
    def edit(t, kw):
        t["desc"] = t["desc"].clone()
        t["desc"][row, col] = value
    return edit


def _tensor(name, make):
    def edit(t, kw):
        t[name] = make(t[name])
    return edit


def _scalar(name, value):
    def edit(t, kw):
        kw[name] = value
    return edit


META = torch.device("meta")
LAYOUT_ERRORS = {
    # case: (edit of the valid arguments, what the message must start with)
    "counters-dtype": (_tensor("counters", lambda x: x.int()), "counters"),
    "counters-shape": (_tensor("counters", lambda x: x[:3]), "counters"),
    "counters-2d": (_tensor("counters", lambda x: x.view(2, 2)), "counters"),
    "counters-strided": (_tensor("counters", lambda x: torch.zeros(8, dtype=x.dtype)[::2]),
                         "counters"),
    "counters-list": (_tensor("counters", lambda x: x.tolist()), "counters"),
    "table-dtype": (_tensor("table", lambda x: x.int()), "table"),
    "table-length": (_tensor("table", lambda x: x[:-1]), "table"),
    "table-device": (_tensor("table", lambda x: x.to(META)), "table"),
    "table-strided": (_tensor("table", lambda x: x.repeat_interleave(2)[::2]), "table"),
    "desc-dtype": (_tensor("desc", lambda x: x.int()), "desc"),
    "desc-columns": (_tensor("desc", lambda x: x[:, :11]), "desc"),
    "desc-empty": (_tensor("desc", lambda x: x[:0]), "desc"),
    "desc-1d": (_tensor("desc", lambda x: x.reshape(-1)), "desc"),
    "desc-device": (_tensor("desc", lambda x: x.to(META)), "desc"),
    "desc-strided": (_tensor("desc", lambda x: x.repeat_interleave(2, 1)[:, ::2]), "desc"),
    "desc-order": (_tensor("desc", lambda x: x.flip(0).contiguous()), "desc"),
    "desc-b-over-M": (_desc_with(1, 0, 9), "desc"),
    "desc-nb": (_desc_with(0, 1, 3), "desc"),
    "desc-row-pages": (_desc_with(1, 2, 7), "desc"),
    "desc-current-len": (_desc_with(0, 5, 5), "desc"),
    "desc-offset": (_desc_with(1, 7, 23), "desc"),
    "desc-staged-off": (_desc_with(1, 9, 0), "desc"),
    "desc-private-in-ring": (_desc_with(0, 6, 6), "desc"),
    "desc-private-overlap": (_desc_with(1, 6, 18), "desc"),
    "rows-dtype": (_tensor("rows", lambda x: x.long()), "rows"),
    "rows-length": (_tensor("rows", lambda x: x[1:]), "rows"),
    "rows-2d": (_tensor("rows", lambda x: x.view(4, -1)), "rows"),
    "rows-strided": (_tensor("rows", lambda x: x.repeat_interleave(2)[::2]), "rows"),
    "rows-device": (_tensor("rows", lambda x: x.to(META)), "rows"),
    "seq_len_kv-dtype": (_tensor("seq_len_kv", lambda x: x.long()), "seq_len_kv"),
    "seq_len_kv-length": (_tensor("seq_len_kv", lambda x: x[1:]), "seq_len_kv"),
    "staged_src-dtype": (_tensor("staged_src", lambda x: x.int()), "staged_src"),
    "staged_dst-length": (_tensor("staged_dst", lambda x: x[1:]), "staged_dst"),
    "staged_dst2-dtype": (_tensor("staged_dst2", lambda x: x.int()), "staged_dst2"),
    "staged_dst2-length": (_tensor("staged_dst2", lambda x: x[1:]), "staged_dst2"),
    "committed_src-dtype": (_tensor("committed_src", lambda x: x.int()), "committed_src"),
    "committed_dst-length": (_tensor("committed_dst", lambda x: x[1:]), "committed_dst"),
    "committed_dst-device": (_tensor("committed_dst", lambda x: x.to(META)), "committed_dst"),
    "pin-negative": (_scalar("pin_tokens", -1), "pin_tokens"),
    "pin-bool": (_scalar("pin_tokens", True), "pin_tokens"),
    "pin-float": (_scalar("pin_tokens", 5.0), "pin_tokens"),
    "window-negative": (_scalar("window_tokens", -2), "window_tokens"),
    "window-str": (_scalar("window_tokens", "7"), "window_tokens"),
    "max-staged-zero": (_scalar("max_staged_tokens", 0), "max_staged_tokens"),
    "tpp-not-power": (_scalar("tokens_per_page", 6), "tokens_per_page"),
    "tpp-zero": (_scalar("tokens_per_page", 0), "tokens_per_page"),
    "fixed-pages": (_scalar("fixed_pages", 1), "fixed_pages"),
    "ring-pages-zero": (_scalar("ring_pages", 0), "ring_pages"),
}


@pytest.mark.parametrize("case", sorted(LAYOUT_ERRORS))
def test_causal_layout_rejects(case):
    edit, name = LAYOUT_ERRORS[case]
    t, kw = _valid_layout_args()
    _call_layout(t, kw)                      # valid as built
    edit(t, kw)
    with pytest.raises(ValueError, match=f"^{name}"):
        _call_layout(t, kw)


@pytest.mark.parametrize("name,value", [("ring_pages", 6), ("window_tokens", 11),
                                        ("max_staged_tokens", 9), ("pin_tokens", 9)])
def test_causal_layout_rejects_scalars_that_disagree_with_tensors(name, value):
    """A valid scalar that contradicts the table or the descriptor: the message names
    the tensor and the scalars it was checked against."""
    t, kw = _valid_layout_args()
    kw[name] = value
    with pytest.raises(ValueError, match=name):
        _call_layout(t, kw)


ADVANCE_ERRORS = [
    ("counters", lambda c, kw: (c.int(), kw)),
    ("counters", lambda c, kw: (c[:3], kw)),
    ("counters", lambda c, kw: (torch.zeros(4, 1, dtype=torch.int64), kw)),
    ("counters", lambda c, kw: (torch.zeros(8, dtype=torch.int64)[::2], kw)),
    ("counters", lambda c, kw: (torch.zeros(1, dtype=torch.int64).expand(4), kw)),
    ("counters", lambda c, kw: ([0, 0, 0, 0], kw)),
    ("n", lambda c, kw: (c, {**kw, "n": -1})),
    ("n", lambda c, kw: (c, {**kw, "n": True})),
    ("n", lambda c, kw: (c, {**kw, "n": 2.0})),
    ("pin_tokens", lambda c, kw: (c, {**kw, "pin_tokens": -1})),
    ("window_tokens", lambda c, kw: (c, {**kw, "window_tokens": -1})),
    ("window_tokens", lambda c, kw: (c, {**kw, "window_tokens": None})),
    ("tokens_per_page", lambda c, kw: (c, {**kw, "tokens_per_page": 12})),
    ("tokens_per_page", lambda c, kw: (c, {**kw, "tokens_per_page": -4})),
    ("fixed_pages", lambda c, kw: (c, {**kw, "fixed_pages": 3})),
    ("fixed_pages", lambda c, kw: (c, {**kw, "fixed_pages": -1})),
]


@pytest.mark.parametrize("i", range(len(ADVANCE_ERRORS)))
def test_advance_commit_rejects(i):
    name, edit = ADVANCE_ERRORS[i]
    kw = dict(n=3, pin_tokens=5, window_tokens=7, tokens_per_page=4, fixed_pages=2)
    counters, kw = edit(torch.zeros(4, dtype=torch.int64), kw)
    before = None if not isinstance(counters, torch.Tensor) else counters.clone()
    with pytest.raises(ValueError, match=f"^{name}"):
        advance_commit_(counters, kw.pop("n"), **kw)
    if before is not None:
        assert torch.equal(counters, before)
