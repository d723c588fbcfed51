"""``quantize_rows``'s kernel under numba's CUDA simulator against the torch reference,
bit for bit: row widths where a thread holds one to several groups, a partial last
group (K not a multiple of 4: the scalar path), bf16 and fp32 rows of very different
magnitudes, GELU, zero and NaN rows, rows in a slice of a buffer.
Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``."""
from __future__ import annotations

import math

import pytest
import torch

from framekv.ops import _launch
from framekv.ops.quant_rows import _layout, quantize_rows, quantize_rows_reference
from test_quant_rows import spread_rows

pytestmark = pytest.mark.sim


def same(a, b) -> bool:
    """The same bytes and scales; NaN bytes compared as NaN (torch keeps a NaN's sign)."""
    (qa, sa), (qb, sb) = a, b
    nan = torch.isnan(qb.float())
    return (torch.equal(torch.isnan(qa.float()), nan) and torch.equal(sa, sb)
            and torch.equal(qa.view(torch.uint8)[~nan], qb.view(torch.uint8)[~nan]))


def test_kernel_runs_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


def test_layouts():
    # the simulator's blocks: at most 8 threads of 4, so wide rows take several groups
    assert _layout(96) == (8, 3) and _layout(7) == (4, 1) and _layout(256) == (8, 8)


@pytest.mark.parametrize("M,K", [(3, 8), (5, 96), (2, 7), (4, 50), (3, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True])
def test_kernel_equals_the_reference(M, K, dtype, gelu):
    x = spread_rows(M, K, dtype, seed=K)
    assert same(quantize_rows(x, gelu=gelu), quantize_rows_reference(x, gelu=gelu))


def test_zero_nan_and_infinite_rows_and_a_buffer_slice():
    buf = spread_rows(6, 40, seed=3, octaves=4)
    x = buf[1:5, 4:36]
    x[0] = 0
    x[1, 7] = math.nan
    x[2, 2] = -math.inf
    assert same(quantize_rows(x), quantize_rows_reference(x))
    assert same(quantize_rows(x, gelu=True), quantize_rows_reference(x, gelu=True))
