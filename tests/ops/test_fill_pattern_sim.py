"""fill_pattern_'s numba kernel under the CUDA simulator, against its torch reference.

Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``. The region
is a pitched view inside a larger buffer, so the bytes around it must stay untouched,
and grids are capped small, so the grid-stride loop takes several turns.
"""
from __future__ import annotations

import pytest
import torch

from framekv.ops import _launch, fill_pattern_, fill_pattern_reference

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.bfloat16, torch.int32,
                                   torch.float32])
@pytest.mark.parametrize("value", [0x5A, 0xBEEF, 0x01020304, -1, 0xFFFFFFFF, 0])
def test_kernel_matches_the_reference_over_a_pitched_region(dtype, value):
    assert _launch.use_kernel(torch.zeros(1))  # the kernel runs, not the reference
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(-100, 100, (7, 13), generator=gen).to(dtype)
    got, want = base.clone(), base.clone()
    fill_pattern_(got[1:6, 2:11], value)           # 5 rows of 9, 13 elements apart
    fill_pattern_reference(want[1:6, 2:11], value)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_one_row_and_one_column_regions():
    for shape in ((1, 40), (40, 1)):
        got, want = torch.zeros(shape, dtype=torch.int16), torch.zeros(shape, dtype=torch.int16)
        fill_pattern_(got, 0x1234)
        fill_pattern_reference(want, 0x1234)
        assert torch.equal(got, want) and int(got[0, 0]) == 0x1234
