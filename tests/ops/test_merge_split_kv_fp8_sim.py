"""``merge_split_kv_``'s fp8 path (e4m3 partials in 8-byte words, dequantized) under
numba's CUDA simulator, against the torch reference.

Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``.
"""
from __future__ import annotations

import pytest
import torch

from framekv.ops import merge_split_kv_, merge_split_kv_reference
from test_merge_split_kv import assert_merged_close
from test_merge_split_kv_fp8 import fp8_merge_case

pytestmark = pytest.mark.sim

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn


def test_every_e4m3_byte_decodes_as_torch_does():
    from framekv.ops.merge_split_kv import _unpack_e4m3

    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = raw.view(FP8).float()
    got = torch.tensor([v for w in raw.view(torch.int64).tolist() for v in _unpack_e4m3(w)])
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("S,nb,b,H,hs,layout,blocked", [
    (1, 1, 3, 3, 3, "contiguous", False),   # an unsplit launch's dequantization
    (2, 1, 4, 4, 2, "packed", True),
    (3, 2, 3, 2, 1, "heads_major", False),
    (5, 3, 2, 6, 3, "contiguous", True),    # more splits than one round of four loads
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kernel_matches_reference(S, nb, b, H, hs, layout, blocked, dtype):
    kw = dict(S=S, nb=nb, b=b, H=H, D=64, seq_len=nb * b - 1, layout=layout, blocked=blocked,
              seed=S * 5 + nb)
    args, base = fp8_merge_case(CPU, dtype, hs=hs, **kw)
    want, want_base = fp8_merge_case(CPU, dtype, hs=hs, **kw)
    merge_split_kv_(**args)
    merge_split_kv_reference(**want)
    assert torch.isfinite(args["out"].float()).all()
    assert_merged_close(base, want_base)
    assert args["out"][nb * b - 1:].eq(0).all()
