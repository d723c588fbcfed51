"""``copy_rows_`` on the CPU (the torch reference): equal to a plain loop over the rows
for every layout a streaming coder uses (a cache entry gathered into a channel slice
of a wider buffer, scattered back from one, its second step alone, a contiguous
slice, both lists given, three inner dimensions that cannot merge, no list), every
dtype size, nothing written beside dst's rows; how the inner dimensions merge; every
refusal named before anything is written. The kernel's tests: ``_sim`` (numba's
simulator) and ``_gpu``. `rows_case` builds the cases all three share."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import copy_rows_, copy_rows_reference
from framekv.ops.copy_rows import MAX_OUTER, merged_dims
from test_ops_cases import assert_bits_equal, bits

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

LAYOUTS = ["load_folded", "store_folded", "step1", "contiguous", "both", "three_outer",
           "identity"]


def stamped(shape, dtype, offset: int, device="cpu") -> torch.Tensor:
    """Every element's bits distinct (element i holds i + offset, wrapped to the dtype's
    width), so a row or position mix-up changes bits."""
    n = 1
    for s in shape:
        n *= s
    it = _INT[dtype.itemsize]
    bits = torch.arange(n, dtype=torch.int64, device=device) * 40503 + offset
    if dtype.itemsize < 8:                 # wrapped into the signed range of the width
        half = 1 << (8 * dtype.itemsize - 1)
        bits = (bits + half) % (2 * half) - half
    return bits.to(it).view(dtype).view(*shape)


def rows_case(device, dtype, layout: str, *, S=5, B=3, H=3, W=4, C=6, pad=2, seed=0) -> dict:
    """``copy_rows_`` arguments of ``layout`` (``LAYOUTS``), with ``parents``: the whole
    tensors dst is a view of (compared whole: nothing beside dst's rows may change).
    A folded conv's buffer has 3 C + ``pad`` channels. Row lists out of order;
    deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    perm = lambda n: torch.randperm(n, generator=g)[:B].to(device)  # noqa: E731
    arena = stamped((S, 2, H, W, C), dtype, 7 + seed, device)          # [S, 2, H, W, C]
    buf = stamped((B, 4, H, W, 3 * C + pad), dtype, 50_000 + seed, device)  # a folded conv's
    if layout == "load_folded":           # entry -> tap 0's first two steps
        return dict(dst=buf[:, :2, :, :, :C], src=arena, src_rows=perm(S), parents=[buf])
    if layout == "store_folded":          # tap 2's last two steps -> entry
        return dict(dst=arena, src=buf[:, -2:, :, :, 2 * C + pad // 2:3 * C + pad // 2], dst_rows=perm(S),
                    parents=[arena])
    if layout == "step1":                 # the entry's second step -> tap 1's first
        return dict(dst=buf[:, :1, :, :, C:2 * C], src=arena[:, 1:], src_rows=perm(S),
                    parents=[buf])
    if layout == "contiguous":            # entry -> the first steps of a plain buffer
        plain = stamped((B, 5, H, W, C), dtype, 90_000 + seed, device)
        return dict(dst=plain[:, :2], src=arena, src_rows=perm(S), parents=[plain])
    if layout == "both":
        other = stamped((S + 2, 2, H, W, C), dtype, 20_000 + seed, device)
        return dict(dst=other, src=arena, dst_rows=perm(S + 2), src_rows=perm(S),
                    parents=[other])
    if layout == "three_outer":           # no two inner dimensions merge
        big = stamped((B, 4, 4, 4, C + 3), dtype, 30_000 + seed, device)
        src = stamped((S, 2, 2, 2, C), dtype, 40_000 + seed, device)
        return dict(dst=big[:, 1:3, 1:3, 1:3, :C], src=src, src_rows=perm(S), parents=[big])
    if layout == "identity":
        return dict(dst=buf[:, 1:3, :, :, C:2 * C], src=arena[:B], parents=[buf])
    raise ValueError(layout)


def call(fn, case: dict) -> None:
    """``fn(dst, src, dst_rows=..., src_rows=...)`` with the case's arguments."""
    fn(case["dst"], case["src"], dst_rows=case.get("dst_rows"), src_rows=case.get("src_rows"))


def loop_reference(case: dict) -> None:
    """The contract as a plain loop: all rows read, then written one by one."""
    dst, src = case["dst"], case["src"]
    dst_rows, src_rows = case.get("dst_rows"), case.get("src_rows")
    B = (dst_rows if dst_rows is not None else src_rows if src_rows is not None else dst).shape[0]
    rows = [src[int(src_rows[b]) if src_rows is not None else b].clone() for b in range(B)]
    for b in range(B):
        dst[int(dst_rows[b]) if dst_rows is not None else b].copy_(rows[b])


def check_against_loop(fn, device, dtype, layout, **kw) -> None:
    """``fn`` on a case leaves its parents bit for bit as the loop leaves them."""
    got, want = (rows_case(device, dtype, layout, **kw) for _ in range(2))
    call(fn, got)
    loop_reference(want)
    for a, b in zip(got["parents"], want["parents"]):
        assert_bits_equal(a, b, layout)
    fresh = rows_case(device, dtype, layout, **kw)["parents"][0]
    assert not torch.equal(bits(want["parents"][0]), bits(fresh))      # the case writes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reference_is_the_loop(layout, dtype):
    check_against_loop(copy_rows_reference, "cpu", dtype, layout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, torch.int8, torch.int32])
def test_every_dtype_size(dtype):
    check_against_loop(copy_rows_, "cpu", dtype, "load_folded", C=3)
    check_against_loop(copy_rows_, "cpu", dtype, "store_folded", C=5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_op_on_cpu_is_the_loop(layout):
    check_against_loop(copy_rows_, "cpu", torch.bfloat16, layout, C=3)


def _meta(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


def test_inner_dimensions_merge_where_both_tensors_lay_them_out_back_to_back():
    entry = _meta(2, 2, 480, 832, 96)                                # [S, 2, H, W, C]
    # a contiguous slice of steps: one row of every value
    assert merged_dims(_meta(1, 4, 480, 832, 96)[:, :2], entry) == [[2 * 480 * 832 * 96, 1, 1]]
    # a channel slice of a folded conv's buffer: rows of 96 at the buffer's 288
    folded = _meta(1, 2, 480, 832, 288)[..., 96:192]
    assert merged_dims(folded, entry) == [[96, 1, 1], [2 * 480 * 832, 288, 96]]
    assert merged_dims(entry, folded) == [[96, 1, 1], [2 * 480 * 832, 96, 288]]
    # size-1 dimensions drop out, whatever their strides
    assert merged_dims(_meta(3, 1, 5, 7)[:, :, :, :4], _meta(3, 1, 5, 4)) == [[4, 1, 1],
                                                                              [5, 7, 4]]
    c = rows_case("cpu", torch.bfloat16, "three_outer")
    assert len(merged_dims(c["dst"], c["src"])) == MAX_OUTER + 1


def test_empty_lists_and_empty_rows_write_nothing():
    c = rows_case("cpu", torch.float32, "load_folded")
    before = c["parents"][0].clone()
    none = torch.zeros(0, dtype=torch.int64)
    copy_rows_(c["dst"][:0], c["src"], src_rows=none)
    copy_rows_(c["src"], c["dst"], dst_rows=none, src_rows=none)
    copy_rows_(c["dst"][..., :0], c["src"][..., :0], src_rows=c["src_rows"])
    assert_bits_equal(c["parents"][0], before, "empty")


def _refusals(c):
    """(changed arguments, message) pairs over a load_folded case ``c``."""
    dst, src, rows = c["dst"], c["src"], c["src_rows"]
    S = src.shape[0]
    wide = torch.zeros(2, 2, 3, 4, 6, 2, dtype=src.dtype)
    return [
        (dict(dst=dst.tolist()), "dst: expected a torch.Tensor, got list"),
        (dict(src=src[0, 0, 0, 0]), r"src: expected at least 2 dimensions \[S, \*inner\], got 1"),
        (dict(dst=dst.to(torch.complex64), src=src.to(torch.complex64)),
         "dst: expected a real dtype of 1, 2, 4 or 8 bytes"),
        (dict(src=src.float()), "src: expected dtype torch.bfloat16 .the dtype of dst., got "
                                "torch.float32"),
        (dict(src=src[..., :5]), r"src: expected shape \[S_s, 2, 3, 4, 6\] .dst's inner shape., "
                                 r"got \[5, 2, 3, 4, 5\]"),
        (dict(src=src.to("meta")), "src: expected device cpu .the device of dst., got meta"),
        (dict(dst=dst.transpose(3, 4).contiguous().transpose(3, 4)),
         "dst: expected a contiguous last dimension"),
        (dict(src=wide[..., 0], src_rows=rows[:2]), "src: expected a contiguous last dimension"),
        (dict(dst=dst[:1].expand(3, 2, 3, 4, 6)), "dst: expected no zero strides"),
        (dict(dst=torch.zeros(3, 3, 3, 3, 3, 9, dtype=src.dtype)[:, 1:, 1:, 1:, 1:, :6],
              src=torch.zeros(3, 2, 2, 2, 2, 6, dtype=src.dtype), src_rows=None),
         f"dst: expected at most {MAX_OUTER} inner dimensions besides the last"),
        (dict(src_rows=rows.int()), "src_rows: expected dtype torch.int64, got torch.int32"),
        (dict(src_rows=rows[None]), r"src_rows: expected 1 dimensions \[E\]"),
        (dict(src_rows=rows[:2]), r"dst: expected 2 rows \(B, dst_rows being absent\), got "
                                  r"shape \[3, 2, 3, 4, 6\]"),
        (dict(src_rows=None), r"src: expected 3 rows \(B, src_rows being absent\)"),
        (dict(dst_rows=rows[:2]), "src_rows: expected length 2 .the length of dst_rows., got 3"),
        (dict(src_rows=rows.to("meta")), "src_rows: expected device cpu .the device of dst."),
        (dict(src_rows=torch.tensor([0, S, 1])), rf"src_rows: expected row ids in \[0, {S}\) "
                                                 rf"\(the rows of src\), got values in \[0, {S}\]"),
        (dict(src_rows=torch.tensor([0, -1, 1])), "src_rows: expected row ids in"),
        (dict(dst_rows=torch.tensor([0, 3, 1])), r"dst_rows: expected row ids in \[0, 3\)"),
        (dict(dst_rows=torch.tensor([2, 0, 2])), r"dst_rows: expected distinct row ids, "
                                                 r"got \[2, 0, 2\]"),
    ]


def test_refusals_name_the_argument_and_write_nothing():
    c = rows_case("cpu", torch.bfloat16, "load_folded")
    before = c["parents"][0].clone()
    base = dict(dst=c["dst"], src=c["src"], dst_rows=None, src_rows=c["src_rows"])
    for change, match in _refusals(c):
        args = base | change
        with pytest.raises(ValueError, match=match):
            copy_rows_(args.pop("dst"), args.pop("src"), **args)
        assert_bits_equal(c["parents"][0], before, match)
