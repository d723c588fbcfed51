"""``adaln_``'s fp8 output on a CUDA GPU (sm_89+): at the real geometries (B = 2, S = 4680,
N = 1536 and 5120, the modulation per sequence or per frame, residual and gate, the
affine norm) the e4m3 rows and scales equal, bit for bit, the same kernel's bf16 output
quantized by ``quantize_rows`` (the GPU kernel); against the fp32 reference norm of the
kernel's own updated x within one e4m3 step; rows 20 binades apart each with its own
scale; odd shapes in every launch mode; a CUDA graph replayed with new contents equal
to eager calls."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import adaln_, quantize_rows
from test_adaln import BF16, FP32, adaln_case, clone_case
from test_adaln_fp8 import KEYS, fp8_adaln, fp8_outputs, same_fp8, spread_case
from test_adaln_fp8_sim import reference_fp8, within_one_step
from test_ops_gpu import _side_stream_warmup

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def kernel_composed(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16-output kernel, then the quantize_rows kernel (case updated in place)."""
    h = adaln_(**{k: case[k] for k in KEYS})
    q, s = quantize_rows(h.view(-1, h.shape[-1]))
    return q.view(h.shape), s.view(*h.shape[:2], 1)


def check(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    other = clone_case(case)
    got = fp8_adaln(case)
    want = kernel_composed(other)
    torch.cuda.synchronize()
    assert same_fp8(got, want)
    assert torch.equal(case["x"], other["x"])
    ref = clone_case(case)                  # the norm of the kernel's own updated x
    ref["residual"] = ref["gate"] = None
    within_one_step(got, reference_fp8(ref))
    return got


REAL = [  # (N, M, affine, residual)
    (1536, 1, False, False), (1536, 3, True, True), (1536, 1, False, True),
    (5120, 1, False, False), (5120, 3, True, True)]


@pytest.mark.parametrize("N,M,affine,residual", REAL)
def test_real_geometry_is_the_bf16_kernel_quantized_bit_for_bit(N, M, affine, residual):
    check(adaln_case(CUDA, B=2, S=4680, N=N, M=M, dtype=BF16, shift=not affine,
                     scale=not affine, weight=affine, bias=affine, residual=residual,
                     gate=residual, seed=N + M))


def test_rows_of_very_different_magnitudes():
    q, s = check(spread_case(CUDA, B=2, S=64, N=1536, residual=True, gate=True))
    assert float(s.max() / s.min()) > 2.0 ** 18
    assert bool((q.float().abs().amax(-1) == 448).all())


ODD = [  # (B, S, N, M, dtype, strided)
    (1, 1, 7, 1, BF16, False), (2, 3, 97, 3, FP32, True), (3, 5, 1537, 5, BF16, True),
    (2, 7, 5120, 7, BF16, False), (2, 2, 4099, 1, FP32, False)]


@pytest.mark.parametrize("B,S,N,M,dtype,strided", ODD)
def test_odd_shapes_in_every_launch_mode(B, S, N, M, dtype, strided, launch_mode):
    check(adaln_case(CUDA, B=B, S=S, N=N, M=M, dtype=dtype, strided=strided, weight=True,
                     bias=True, residual=True, gate=True, seed=N))


def test_graph_replay_equals_eager_calls():
    case = adaln_case(CUDA, B=2, S=4680, N=1536, M=3, residual=True, gate=True, seed=5)
    q, s = fp8_outputs(case["x"])
    x0 = case["x"].clone()

    def step():
        adaln_(**{k: case[k] for k in KEYS}, out=q, out_scale=s)

    _side_stream_warmup(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(6)
    for k in ("shift", "scale", "gate", "residual"):
        case[k].copy_(torch.randn(case[k].shape, generator=g))
    case["x"].copy_(x0)
    graph.replay()
    torch.cuda.synchronize()
    replayed = (q.clone(), s.clone(), case["x"].clone())
    case["x"].copy_(x0)
    step()
    torch.cuda.synchronize()
    assert same_fp8(replayed[:2], (q, s)) and torch.equal(replayed[2], case["x"])
