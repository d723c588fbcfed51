"""The numba kernels under numba's CUDA simulator, against the torch references.

Run in their own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``. The ops
then run their kernels on CPU tensors (numpy views sharing memory). Shapes stay tiny:
the simulator runs one Python thread per CUDA thread; blocks are capped at 32 threads
and grids at 3 blocks, so every grid-stride loop takes several turns.
"""
from __future__ import annotations

import pytest
import torch

from framekv.ops import (bind_scatter_kv_slots, copy_kv_slots_, copy_kv_slots_reference,
                         rotate_rows_, rotate_rows_reference, scatter_kv_slots_,
                         scatter_kv_slots_reference)
from framekv.ops import _launch
from test_ops_cases import (COPY_PARAMS, ROTATE_SHIFTS, assert_bits_equal, copy_case,
                            rotate_case, scatter_case, scatter_params)

pytestmark = pytest.mark.sim

CPU = torch.device("cpu")


def test_kernels_run_in_the_simulator():
    assert _launch.SIMULATOR
    assert _launch.use_kernel(torch.zeros(1))


def _check_pools(got, want):
    assert_bits_equal(got["k_pool"], want["k_pool"], "k_pool")
    assert_bits_equal(got["v_pool"], want["v_pool"], "v_pool")


@pytest.mark.parametrize("dtype,D,kv,pool,dst2,src_rows", scatter_params())
def test_scatter_matches_reference(dtype, D, kv, pool, dst2, src_rows):
    make = lambda: scatter_case(CPU, dtype, T=4, H=2, D=D, slots=16, kv=kv,  # noqa: E731
                                pool=pool, dst2=dst2, src_rows=src_rows, seed=D)
    got, want = make(), make()
    scatter_kv_slots_(**got)
    scatter_kv_slots_reference(**want)
    _check_pools(got, want)


def test_scatter_word_sizes_cover_every_path():
    sizes = set()
    for dtype, D, kv, pool, *_ in scatter_params():
        c = scatter_case(CPU, dtype, T=2, H=2, D=D, slots=8, kv=kv, pool=pool)
        row = D * dtype.itemsize
        sizes.add(_launch.pick_word_size(row, [c["k_pool"], c["v_pool"], c["k"], c["v"]]))
    assert sizes == {1, 2, 4, 8, 16}


def test_bound_scatter_matches_reference_across_calls():
    got = scatter_case(CPU, torch.bfloat16, T=4, H=2, D=8, slots=20, kv="fused",
                       dst2=True, src_rows=True, seed=11)
    want = scatter_case(CPU, torch.bfloat16, T=4, H=2, D=8, slots=20, kv="fused",
                        dst2=True, src_rows=True, seed=11)
    bound = bind_scatter_kv_slots(got["k_pool"], got["v_pool"], got["dst"], got["dst2"],
                                  got["src_rows"])
    bound(got["k"], got["v"])
    scatter_kv_slots_reference(**want)
    _check_pools(got, want)
    # New list contents and a misaligned source (2-byte words) through the same binding.
    for c in (got, want):
        c["dst"].copy_(torch.tensor([9, 8, 7, -1, 6, 5, 4]))
        c["src_rows"].copy_(torch.tensor([3, 2, 1, 0, 3, 2, -1]))
    k2 = scatter_case(CPU, torch.bfloat16, T=4, H=2, D=8, slots=20, kv="misaligned", seed=12)
    bound(k2["k"], k2["v"])
    scatter_kv_slots_reference(want["k_pool"], want["v_pool"], k2["k"], k2["v"], want["dst"],
                               want["dst2"], want["src_rows"])
    _check_pools(got, want)


@pytest.mark.parametrize("dtype,D,pool", COPY_PARAMS)
def test_copy_matches_reference(dtype, D, pool):
    make = lambda: copy_case(CPU, dtype, L=2, slots=12, H=2, D=D, pool=pool, seed=D)  # noqa: E731
    got, want = make(), make()
    copy_kv_slots_(**got)
    copy_kv_slots_reference(**want)
    _check_pools(got, want)


def test_copy_sees_new_lists():
    got, want = (copy_case(CPU, torch.bfloat16, L=3, slots=12, H=1, D=8, seed=4)
                 for _ in range(2))
    copy_kv_slots_(**got)
    copy_kv_slots_reference(**want)
    for c in (got, want):
        c["src"][:3] = torch.tensor([7, -1, 0])
        c["dst"][:3] = torch.tensor([11, 2, -1])
    copy_kv_slots_(**got)
    copy_kv_slots_reference(**want)
    _check_pools(got, want)


ROTATE_SHAPES = [((13,), "contiguous"), ((3, 9), "contiguous"), ((2, 70), "strided_rows"),
                 ((4, 6), "transposed"), ((5, 11), "offset"), ((2, 1), "contiguous")]


def _rotate_int_params():
    """Every shift on every layout once, int32 and int64 alternating."""
    shifts = ROTATE_SHIFTS + [10 ** 30 + 1]
    out = []
    for i, (shape, layout) in enumerate(ROTATE_SHAPES):
        for j in range(3):
            shift = shifts[(3 * i + j) % len(shifts)]
            out.append((shape, layout, (torch.int32, torch.int64)[(i + j) % 2], shift))
    return out


@pytest.mark.parametrize("shape,layout,dtype,shift", _rotate_int_params())
def test_rotate_int_shifts(shape, layout, dtype, shift):
    got = rotate_case(CPU, dtype, shape=shape, layout=layout, seed=len(shape))
    want = got.clone()
    rotate_rows_(got, shift)
    rotate_rows_reference(want, shift)
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape,layout,shift_dtype,shift", [
    ((13,), "contiguous", torch.int32, -1),
    ((3, 9), "contiguous", torch.int64, 7),
    ((2, 70), "strided_rows", torch.int32, -(2 ** 31)),
    ((4, 6), "transposed", torch.int64, 2 ** 31 - 1),
    ((5, 11), "offset", torch.int32, 0),
])
def test_rotate_tensor_shifts(shape, layout, shift_dtype, shift):
    got = rotate_case(CPU, torch.int32, shape=shape, layout=layout, seed=3)
    want = got.clone()
    s = torch.tensor(shift, dtype=shift_dtype)  # 0-d: one element is enough
    rotate_rows_(got, s)
    rotate_rows_reference(want, s)
    assert torch.equal(got, want)


def test_rotate_huge_int64_tensor_shifts():
    x = rotate_case(CPU, torch.int64, shape=(3, 10), seed=1)
    want = x.clone()
    shift = torch.tensor([-(2 ** 63)])
    rotate_rows_(x, shift)
    rotate_rows_reference(want, shift)
    assert torch.equal(x, want)
    shift.fill_(2 ** 63 - 1)  # the kernel reads the new value
    rotate_rows_(x, shift)
    rotate_rows_reference(want, shift)
    assert torch.equal(x, want)


def test_rotate_many_rows_grid_strides():
    x = rotate_case(CPU, torch.int32, shape=(8, 5), layout="offset")
    want = x.clone()
    rotate_rows_(x, torch.tensor([2]))
    rotate_rows_reference(want, 2)
    assert torch.equal(x, want)


def test_rotate_empty_rows_are_noops():
    rotate_rows_(torch.empty(3, 0, dtype=torch.int32), torch.tensor([5]))
    rotate_rows_(torch.empty(0, 4, dtype=torch.int64), 3)
    rotate_rows_(torch.empty(0, dtype=torch.int32), torch.tensor([1]))
