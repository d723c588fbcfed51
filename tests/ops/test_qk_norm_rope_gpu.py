"""``qk_norm_rope_stage_``'s kernel on a CUDA GPU against the fp32 torch reference: odd
geometries in every launch mode, the real shapes (Wan-like all-heads norm at 12 heads,
per-head norm with GQA at 32 / 8 heads, 2 x 4680 tokens of D = 128) with staging, CUDA
graph capture replayed with new contents (bit for bit an eager call), torch.compile."""
from __future__ import annotations

import pytest
import torch

from framekv.ops.qk_norm_rope import qk_norm_rope_stage_, qk_norm_rope_stage_reference
from test_ops_gpu import _side_stream_warmup
from test_qk_norm_rope import _bits, assert_matches, compare_with_reference, qk_case

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BF16 = torch.bfloat16

ODD = [  # (B, S, H, Hkv, D, norm, style, staging)
    (1, 37, 5, 1, 64, "head", "interleaved", False),
    (2, 50, 12, 12, 128, "all", "interleaved", True),
    (3, 23, 40, 8, 128, "head", "half", True),      # more groups than lanes per group
    (2, 19, 3, 3, 256, "all", "half", False),
    (1, 11, 2, 1, 512, "head", "interleaved", True),  # the largest head dim
    (2, 9, 4, 2, 8, "all", None, True),
]


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("B,S,H,Hkv,D,norm,style,staging", ODD)
def test_kernel_matches_reference(B, S, H, Hkv, D, norm, style, staging, dtype, launch_mode):
    compare_with_reference(CUDA, dtype, B=B, S=S, H=H, Hkv=Hkv, D=D, norm=norm,
                           style=style or "interleaved", rope=style is not None, grid=(3, 5),
                           offset=7, frame_hi=30000, staging=staging, dst2=staging,
                           src_rows=staging and B > 1, tokens=S - 2 if staging else None,
                           strided=B == 2, seed=S)


REAL = [  # (H, Hkv, norm)
    (12, 12, "all"),
    (32, 8, "head"),
]


@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize("H,Hkv,norm", REAL)
def test_real_shapes(H, Hkv, norm, staging):
    compare_with_reference(CUDA, BF16, B=2, S=4680, H=H, Hkv=Hkv, D=128, norm=norm,
                           grid=(30, 52), offset=0, frame_hi=5000, staging=staging,
                           dst2=staging, src_rows=False, seed=H)


def test_real_shape_sharded_tokens():
    compare_with_reference(CUDA, BF16, B=2, S=1170, H=12, Hkv=12, D=128, norm="all",
                           grid=(30, 52), offset=2340, staging=True, dst2=True,
                           src_rows=True, tokens=1000, seed=3)


# --- CUDA graphs ----------------------------------------------------------------------------

_KW = dict(B=2, S=4680, H=12, Hkv=12, D=128, norm="all", grid=(30, 52), staging=True,
           dst2=True, src_rows=True)


def _refill(c, seed):
    """New contents in place: qkv, frame0, slot lists and pools of another case."""
    fresh, _ = qk_case(CUDA, BF16, seed=seed, **_KW)
    for name in ("qkv", "k_pool", "v_pool", "dst", "dst2", "src_rows"):
        c[name].copy_(fresh[name])
    c["rope"].frame0.copy_(fresh["rope"].frame0)


def test_graph_replay_is_an_eager_call_bit_for_bit():
    c, _ = qk_case(CUDA, BF16, seed=0, **_KW)
    _side_stream_warmup(lambda: qk_norm_rope_stage_(**c))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qk_norm_rope_stage_(**c)
    for trial in range(3):
        _refill(c, trial + 1)
        eager = dict(c, qkv=c["qkv"].clone(), k_pool=c["k_pool"].clone(),
                     v_pool=c["v_pool"].clone())
        ref = dict(c, qkv=c["qkv"].clone().float(), k_pool=c["k_pool"].clone().float(),
                   v_pool=c["v_pool"].clone().float())
        qk_norm_rope_stage_(**eager)
        qk_norm_rope_stage_reference(**ref)
        graph.replay()
        torch.cuda.synchronize()
        for name in ("qkv", "k_pool", "v_pool"):
            assert torch.equal(_bits(c[name]), _bits(eager[name])), (trial, name)
        assert_matches(c["qkv"], ref["qkv"], BF16, f"qkv {trial}")
        assert_matches(c["k_pool"], ref["k_pool"], BF16, f"k_pool {trial}")


# --- torch.compile --------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_traces_under_torch_compile_on_cuda(backend):
    torch._dynamo.reset()
    kw = dict(B=2, S=30, H=4, Hkv=2, D=64, staging=True, dst2=True, seed=5)
    got, _ = qk_case(CUDA, BF16, **kw)
    want, _ = qk_case(CUDA, BF16, **kw)

    def step(qkv, k_pool, v_pool):
        qk_norm_rope_stage_(**dict(got, qkv=qkv, k_pool=k_pool, v_pool=v_pool))
        return qkv.float().sum()

    torch.compile(step, fullgraph=True, backend=backend)(got["qkv"], got["k_pool"],
                                                        got["v_pool"])
    qk_norm_rope_stage_(**want)
    torch.cuda.synchronize()
    for name in ("qkv", "k_pool", "v_pool"):
        assert torch.equal(_bits(got[name]), _bits(want[name])), name
