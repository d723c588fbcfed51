"""CPU tests of the ops: references against plain torch formulas, the public ops and
the scatter's bound launcher on CPU tensors (the reference path), argument validation,
and torch.compile over the custom ops."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import (bind_scatter_kv_slots, copy_kv_slots_, copy_kv_slots_reference,
                         rotate_rows_, rotate_rows_reference, scatter_kv_slots_,
                         scatter_kv_slots_reference)
from test_ops_cases import ROTATE_SHIFTS, assert_bits_equal, copy_case, scatter_case

CPU = torch.device("cpu")


# --- references against simple formulas -------------------------------------------

@pytest.mark.parametrize("shift", ROTATE_SHIFTS + [10 ** 30, -(10 ** 30) - 1])
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 10), (2, 1)])
def test_rotate_reference_is_roll(shape, shift):
    x = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)
    expected = torch.roll(x, -(shift % shape[-1]), dims=-1)
    rotate_rows_reference(x, shift)
    assert torch.equal(x, expected)


@pytest.mark.parametrize("shift", [-3, 0, 4, 2 ** 40 + 1])
def test_rotate_reference_tensor_shift(shift):
    x = torch.arange(30, dtype=torch.int32).reshape(3, 10)
    expected = torch.roll(x, -(shift % 10), dims=-1)
    rotate_rows_reference(x, torch.tensor([shift]))
    assert torch.equal(x, expected)


def _scatter_loop(k_pool, v_pool, k, v, dst, dst2=None, src_rows=None):
    for e in range(dst.shape[0]):
        r = int(src_rows[e]) if src_rows is not None else e
        if not 0 <= r < k.shape[0]:
            continue
        for d in (dst, dst2):
            if d is not None and int(d[e]) >= 0:
                k_pool[int(d[e])] = k[r]
                v_pool[int(d[e])] = v[r]


@pytest.mark.parametrize("dst2,src_rows", [(False, False), (True, False), (True, True),
                                           (False, True)])
def test_scatter_reference_is_loop(dst2, src_rows):
    args = lambda: scatter_case(CPU, torch.bfloat16, T=5, H=2, D=4, slots=20,  # noqa: E731
                                kv="fused", dst2=dst2, src_rows=src_rows, seed=3)
    got, want = args(), args()
    scatter_kv_slots_reference(**got)
    _scatter_loop(**want)
    assert_bits_equal(got["k_pool"], want["k_pool"], "k_pool")
    assert_bits_equal(got["v_pool"], want["v_pool"], "v_pool")


def test_copy_reference_is_loop():
    got, want = (copy_case(CPU, torch.float16, L=3, slots=12, H=2, D=4, seed=1)
                 for _ in range(2))
    copy_kv_slots_reference(**got)
    kp, vp = want["k_pool"], want["v_pool"]
    for s, d in zip(want["src"].tolist(), want["dst"].tolist()):
        if s >= 0 and d >= 0:
            kp[:, d] = kp[:, s].clone()
            vp[:, d] = vp[:, s].clone()
    assert_bits_equal(got["k_pool"], kp, "k_pool")
    assert_bits_equal(got["v_pool"], vp, "v_pool")


# --- public ops and bound launchers on CPU ----------------------------------------

def test_public_ops_on_cpu_match_references():
    x = torch.arange(24, dtype=torch.int64).reshape(2, 12)
    want = x.clone()
    rotate_rows_(x, -5)
    rotate_rows_reference(want, -5)
    assert torch.equal(x, want)
    got, want = (scatter_case(CPU, torch.float32, T=4, H=2, D=3, slots=16, dst2=True,
                              src_rows=True, seed=2) for _ in range(2))
    scatter_kv_slots_(**got)
    scatter_kv_slots_reference(**want)
    assert_bits_equal(got["k_pool"], want["k_pool"], "k_pool")
    got, want = (copy_case(CPU, torch.bfloat16, L=2, slots=12, H=1, D=8, seed=4)
                 for _ in range(2))
    copy_kv_slots_(**got)
    copy_kv_slots_reference(**want)
    assert_bits_equal(got["v_pool"], want["v_pool"], "v_pool")


def test_rotate_reads_the_shift_tensor_at_each_call():
    x = torch.arange(10, dtype=torch.int32)
    shift = torch.tensor(3)
    rotate_rows_(x, shift)
    shift.fill_(-3)
    rotate_rows_(x, shift)
    assert torch.equal(x, torch.arange(10, dtype=torch.int32))


def test_bound_scatter_on_cpu():
    got, want = (scatter_case(CPU, torch.bfloat16, T=4, H=2, D=8, slots=16, kv="fused",
                              dst2=True, seed=5) for _ in range(2))
    bind_scatter_kv_slots(got["k_pool"], got["v_pool"], got["dst"], got["dst2"])(
        got["k"], got["v"])
    scatter_kv_slots_reference(**want)
    assert_bits_equal(got["k_pool"], want["k_pool"], "k_pool")


def test_noops_leave_data_alone():
    x = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    rotate_rows_(x, 8)
    rotate_rows_(torch.empty(3, 0, dtype=torch.int64), 1)
    rotate_rows_(torch.empty(0, 4, dtype=torch.int32), torch.tensor([1]))
    assert torch.equal(x, torch.arange(12).reshape(3, 4))
    c = scatter_case(CPU, torch.float16, T=3, H=1, D=2, slots=8, src_rows=True)
    before = c["k_pool"].clone()
    c["src_rows"].fill_(-1)
    scatter_kv_slots_(**c)
    assert torch.equal(c["k_pool"], before)


# --- validation ---------------------------------------------------------------------

def _kv(T=4, H=2, D=8, slots=10, dtype=torch.bfloat16):
    return {"k_pool": torch.zeros(slots, H, D, dtype=dtype),
            "v_pool": torch.zeros(slots, H, D, dtype=dtype),
            "k": torch.ones(T, H, D, dtype=dtype), "v": torch.ones(T, H, D, dtype=dtype),
            "dst": torch.arange(T)}


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


SCATTER_BAD = {
    "k_pool 2-D": ("k_pool", lambda a: a["k_pool"][0]),
    "k_pool not a tensor": ("k_pool", lambda a: 3),
    "k_pool complex": ("k_pool", lambda a: torch.zeros(10, 2, 8, dtype=torch.complex64)),
    "k_pool bool": ("k_pool", lambda a: torch.zeros(10, 2, 8, dtype=torch.bool)),
    "k_pool strided D": ("k_pool", lambda a: torch.zeros(10, 2, 16, dtype=torch.bfloat16)[..., ::2]),
    "k_pool zero stride": ("k_pool", lambda a: torch.zeros(1, 2, 8, dtype=torch.bfloat16).expand(10, 2, 8)),
    "v_pool dtype": ("v_pool", lambda a: a["v_pool"].half()),
    "v_pool shape": ("v_pool", lambda a: torch.zeros(11, 2, 8, dtype=torch.bfloat16)),
    "v_pool device": ("v_pool", lambda a: _meta(a["v_pool"])),
    "k dtype": ("k", lambda a: a["k"].float()),
    "k 2-D": ("k", lambda a: a["k"][:, 0]),
    "k heads": ("k", lambda a: torch.ones(4, 3, 8, dtype=torch.bfloat16)),
    "k head dim": ("k", lambda a: torch.ones(4, 2, 4, dtype=torch.bfloat16)),
    "k strided D": ("k", lambda a: torch.ones(4, 2, 16, dtype=torch.bfloat16)[..., ::2]),
    "k device": ("k", lambda a: _meta(a["k"])),
    "v shape": ("v", lambda a: torch.ones(3, 2, 8, dtype=torch.bfloat16)),
    "v dtype": ("v", lambda a: a["v"].half()),
    "v strided D": ("v", lambda a: torch.ones(4, 2, 16, dtype=torch.bfloat16)[..., ::2]),
    "dst int32": ("dst", lambda a: a["dst"].int()),
    "dst 2-D": ("dst", lambda a: a["dst"][None]),
    "dst length": ("dst", lambda a: torch.arange(5)),
    "dst device": ("dst", lambda a: _meta(a["dst"])),
    "dst float": ("dst", lambda a: a["dst"].float()),
}


@pytest.mark.parametrize("case", sorted(SCATTER_BAD))
def test_scatter_rejects(case):
    name, make = SCATTER_BAD[case]
    args = _kv()
    args[name] = make(args)
    with pytest.raises(ValueError, match=f"^{name}: "):
        scatter_kv_slots_(**args)


@pytest.mark.parametrize("name,value", [
    ("dst2", torch.arange(3)), ("dst2", torch.arange(4).int()),
    ("src_rows", torch.arange(3)), ("src_rows", torch.arange(4).int()),
    ("src_rows", torch.empty(4, dtype=torch.int64, device="meta")),
])
def test_scatter_rejects_optional_lists(name, value):
    with pytest.raises(ValueError, match=f"^{name}: "):
        scatter_kv_slots_(**_kv(), **{name: value})


def test_scatter_message_says_expected_and_actual():
    args = _kv()
    args["dst"] = args["dst"].int()
    with pytest.raises(ValueError, match="expected dtype torch.int64, got torch.int32"):
        scatter_kv_slots_(**args)


def test_scatter_src_rows_allow_any_length():
    args = _kv()
    args["dst"] = torch.tensor([1, 2, -1, 3, 4, 5, 6])
    scatter_kv_slots_(**args, src_rows=torch.tensor([0, 3, 1, 9, -1, 2, 2]))
    assert args["k_pool"][[1, 2, 5, 6]].eq(1).all() and args["k_pool"][[0, 3, 4]].eq(0).all()


def test_bound_scatter_validates():
    a = _kv()
    with pytest.raises(ValueError, match="^dst: "):
        bind_scatter_kv_slots(a["k_pool"], a["v_pool"], a["dst"].int())
    bound = bind_scatter_kv_slots(a["k_pool"], a["v_pool"], a["dst"])
    with pytest.raises(ValueError, match="^k: "):
        bound(a["k"].float(), a["v"])
    with pytest.raises(ValueError, match="^dst: "):
        bound(a["k"][:3], a["v"][:3])


def _pools(L=2, slots=6, H=2, D=4, dtype=torch.float16):
    return {"k_pool": torch.zeros(L, slots, H, D, dtype=dtype),
            "v_pool": torch.zeros(L, slots, H, D, dtype=dtype),
            "src": torch.tensor([0, 1, -1]), "dst": torch.tensor([2, -1, 3])}


COPY_BAD = {
    "k_pool 3-D": ("k_pool", lambda a: a["k_pool"][0]),
    "k_pool strided D": ("k_pool", lambda a: torch.zeros(2, 6, 2, 8, dtype=torch.float16)[..., ::2]),
    "k_pool float64 complex": ("k_pool", lambda a: torch.zeros(2, 6, 2, 4, dtype=torch.complex128)),
    "v_pool dtype": ("v_pool", lambda a: a["v_pool"].bfloat16()),
    "v_pool shape": ("v_pool", lambda a: torch.zeros(3, 6, 2, 4, dtype=torch.float16)),
    "v_pool device": ("v_pool", lambda a: _meta(a["v_pool"])),
    "src int32": ("src", lambda a: a["src"].int()),
    "src 2-D": ("src", lambda a: a["src"][None]),
    "src device": ("src", lambda a: _meta(a["src"])),
    "dst length": ("dst", lambda a: torch.tensor([1, 2])),
    "dst int32": ("dst", lambda a: a["dst"].int()),
}


@pytest.mark.parametrize("case", sorted(COPY_BAD))
def test_copy_rejects(case):
    name, make = COPY_BAD[case]
    args = _pools()
    args[name] = make(args)
    with pytest.raises(ValueError, match=f"^{name}: "):
        copy_kv_slots_(**args)


ROTATE_BAD = [
    ("x", lambda: (torch.zeros(2, 3, 4, dtype=torch.int32), 1)),
    ("x", lambda: (torch.zeros(5), 1)),
    ("x", lambda: (torch.zeros(5, dtype=torch.int16), 1)),
    ("x", lambda: ([1, 2, 3], 1)),
    ("x", lambda: (torch.zeros(1, 5, dtype=torch.int32).expand(3, 5), 1)),
    ("shift", lambda: (torch.zeros(5, dtype=torch.int32), 1.5)),
    ("shift", lambda: (torch.zeros(5, dtype=torch.int32), True)),
    ("shift", lambda: (torch.zeros(5, dtype=torch.int32), torch.tensor([1.0]))),
    ("shift", lambda: (torch.zeros(5, dtype=torch.int32), torch.tensor([1, 2]))),
    ("shift", lambda: (torch.zeros(5, dtype=torch.int32), torch.tensor([], dtype=torch.int64))),
    ("shift", lambda: (torch.zeros(5, dtype=torch.int32),
                       torch.empty(1, dtype=torch.int64, device="meta"))),
]


@pytest.mark.parametrize("i", range(len(ROTATE_BAD)))
def test_rotate_rejects(i):
    name, make = ROTATE_BAD[i]
    x, shift = make()
    with pytest.raises(ValueError, match=f"^{name}: "):
        rotate_rows_(x, shift)


# --- torch.compile over the custom ops ----------------------------------------------

def test_ops_trace_under_torch_compile():
    torch._dynamo.reset()

    def step(page_table, shift, k_pool, v_pool, qkv, dst, src, dst_copy):
        rotate_rows_(page_table, shift)
        scatter_kv_slots_(k_pool[0], v_pool[0], qkv[:, 4:6], qkv[:, 6:8], dst)
        copy_kv_slots_(k_pool, v_pool, src, dst_copy)
        return page_table.sum() + 1

    def inputs():
        g = torch.Generator().manual_seed(0)
        return (torch.arange(20, dtype=torch.int32).reshape(2, 10), torch.tensor([3]),
                torch.zeros(2, 8, 2, 4), torch.zeros(2, 8, 2, 4),
                torch.randn(3, 8, 4, generator=g), torch.tensor([1, -1, 2]),
                torch.tensor([1, 2]), torch.tensor([5, 6]))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = inputs(), inputs()
    compiled(*got)
    step(*want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
