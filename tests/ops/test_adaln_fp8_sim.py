"""``adaln_``'s fp8 output under numba's CUDA simulator: the kernel's e4m3 rows and
scales equal, bit for bit, the same kernel's output in x's dtype quantized by
``quantize_rows_reference`` (one kernel computes both from the same fp32 values), and
the torch reference's within one e4m3 step (its sums run in another order); the vector
and scalar paths, threads past the row's end (N = 7), per-token modulation spread over
20 binades, residual and gate, bf16 and fp32 x.

Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import _launch, adaln_reference
from test_adaln import BF16, CPU, FP32, adaln_case, clone_case
from test_adaln_fp8 import KEYS, composed, fp8_adaln, fp8_outputs, same_fp8, spread_case

pytestmark = pytest.mark.sim


def reference_fp8(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference's fp8 output of ``case`` (updated in place)."""
    q, s = fp8_outputs(case["x"])
    adaln_reference(**{k: case[k] for k in KEYS}, out=q, out_scale=s)
    return q, s


def within_one_step(got, want) -> None:
    """Scales within a bf16 step (the norm's output may round one bf16 step apart),
    every value within one e4m3 step plus that step."""
    (q, s), (qr, sr) = got, want
    torch.testing.assert_close(s, sr, rtol=2 ** -7, atol=0)
    a, b = q.float() * s, qr.float() * sr
    assert bool(((a - b).abs() <= (2 ** -3 + 2 ** -7) * b.abs() + 2 ** -9 * sr).all())


CASES = [  # (B, S, N, M, dtype, strided, parts)
    (2, 3, 96, 3, BF16, False, "mod"),           # vector path
    (2, 4, 96, 1, FP32, False, "all"),
    (1, 5, 33, 5, BF16, True, "all"),            # scalar path: strided rows, N odd
    (2, 2, 7, 2, BF16, False, "residual"),       # N = 7: threads with no value
    (1, 2, 250, 1, BF16, True, "mod"),           # several groups a thread
]
PARTS = dict(mod=dict(shift=True, scale=True),
             residual=dict(shift=False, scale=False, weight=True, bias=True, residual=True,
                           gate=True),
             all=dict(weight=True, bias=True, residual=True, gate=True))


def test_kernel_runs_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


@pytest.mark.parametrize("B,S,N,M,dtype,strided,parts", CASES)
def test_fp8_out_equals_the_kernels_own_output_quantized(B, S, N, M, dtype, strided, parts):
    case = adaln_case(CPU, B=B, S=S, N=N, M=M, dtype=dtype, strided=strided, seed=N + S,
                      **PARTS[parts])
    other, ref = clone_case(case), clone_case(case)
    got = fp8_adaln(case)
    assert same_fp8(got, composed(other))
    assert torch.equal(case["x"], other["x"])
    within_one_step(got, reference_fp8(ref))


def test_rows_of_very_different_magnitudes():
    case = spread_case(CPU, S=8, N=64, residual=True, gate=True)
    other, ref = clone_case(case), clone_case(case)
    q, s = fp8_adaln(case)
    assert same_fp8((q, s), composed(other))
    within_one_step((q, s), reference_fp8(ref))
    assert float(s.max() / s.min()) > 2.0 ** 18
    assert bool((q.float().abs().amax(-1) == 448).all())
