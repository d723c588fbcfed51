"""``qk_norm_rope_stage_``'s fp8 paths on a CUDA GPU (sm_89+): the hardware e4m3 stores
and loads of `_float` against torch over every rounding boundary, and the kernel against
the torch reference (`compare_fp8_with_reference`) at odd geometries in every launch
mode and at Wan's shape (12 heads, all-heads norm, D = 128, bf16), CUDA graph replay
(bit for bit an eager call, statistics included)."""
from __future__ import annotations

import pytest
import torch
from framekv.ops import _launch
from framekv.ops.qk_norm_rope import qk_norm_rope_stage_
from test_ops_gpu import _side_stream_warmup
from test_qk_norm_rope_fp8 import (
    store_kernel,
    FP8,
    clone_case,
    compare_fp8_with_reference,
    e4m3_probe_values,
    fp8_case,
    staged_entries,
    torch_e4m3_bytes,
    u8,
)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _needs_fp8_hardware():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversions need sm_89 or newer")


def test_hardware_e4m3_is_torch_on_every_boundary():
    """cvt.rn.satfinite.e4m3x2 (one value and four at once) writes the bytes of torch's
    clamp-then-cast, every NaN as 0x7F; the hardware's e4m3 -> f16 reads them back."""
    x = e4m3_probe_values()
    x = torch.cat([x, torch.zeros(-x.numel() % 4)]).to(CUDA)
    out1 = torch.zeros(x.numel(), dtype=FP8, device=CUDA)
    out4 = torch.zeros(x.numel(), dtype=FP8, device=CUDA)
    back = torch.zeros(x.numel(), dtype=torch.float32, device=CUDA)
    args = [_launch.array_arg(t).for_dispatcher() for t in (x, out1, out4, back)]
    store_kernel[8, 128](*args)
    torch.cuda.synchronize()
    want = torch_e4m3_bytes(x.cpu())
    for name, got in (("store_f32", out1), ("store_f32x4", out4)):
        bad = (u8(got).cpu() != want).nonzero().flatten()
        assert bad.numel() == 0, (name, [(x[i].item(), u8(got)[i].item(), want[i].item())
                                         for i in bad[:5]])
    assert torch.equal(back.nan_to_num(), out1.float().nan_to_num())
    assert torch.equal(back.isnan(), out1.float().isnan())


ODD = [  # (B, S, H, Hkv, D, norm, style, dtype)
    (1, 37, 5, 1, 64, "head", "interleaved", BF16),   # statistics of 8-lane heads
    (2, 29, 4, 2, 96, "all", "half", BF16),           # 12 lanes a head: each lane publishes
    (2, 19, 3, 3, 256, "all", "half", torch.float32),  # a warp a head
    (1, 11, 2, 1, 512, "head", "interleaved", BF16),  # two warps a head
    (2, 9, 4, 2, 8, "all", None, torch.float32),
    (3, 13, 6, 2, 12, "head", "interleaved", BF16),   # odd D: scalar accesses
]


@pytest.mark.parametrize("B,S,H,Hkv,D,norm,style,dtype", ODD)
def test_kernel_matches_reference(B, S, H, Hkv, D, norm, style, dtype, launch_mode):
    got = compare_fp8_with_reference(
        CUDA, dtype, B=B, S=S, H=H, Hkv=Hkv, D=D, norm=norm, style=style or "interleaved",
        rope=style is not None, grid=(3, 5), offset=7, frame_hi=30000, dst2=True,
        src_rows=B > 1, tokens=S - 2, strided=B == 2, q_out=True, q_strided=B == 2, seed=S,
        prepare=_saturate)
    assert staged_entries(got)


def _saturate(args):
    """Some saturation: large V in the first staged row, inf and NaN in it, a K and a
    Q scale small enough to saturate head 0."""
    H, Hkv = args["num_heads"], args["num_kv_heads"]
    T = args.get("tokens") or args["qkv"].shape[1]
    b, t = divmod(staged_entries(args)[0][1], T)
    v = args["qkv"][b, t, H + Hkv:]
    v[0, :4] = torch.tensor([3000.0, -1e30, float("inf"), float("nan")])
    args["kv_scale"][0, 0] = 2.0 ** -9
    if args.get("q_scale") is not None:
        args["q_scale"][0] = 2.0 ** -9


@pytest.mark.parametrize("q_out", [False, True])
def test_wan_shape(q_out):
    """Wan's attention: 12 heads, norm over all heads, D = 128, two sequences of 4680."""
    got = compare_fp8_with_reference(CUDA, BF16, B=2, S=4680, H=12, Hkv=12, D=128, norm="all",
                                     grid=(30, 52), frame_hi=5000, dst2=True, q_out=q_out,
                                     seed=12, prepare=_saturate)
    assert (got["saturated"] > torch.tensor([3, 5], device=CUDA)).all()


def test_wan_shape_sharded_tokens():
    compare_fp8_with_reference(CUDA, BF16, B=2, S=1170, H=12, Hkv=12, D=128, norm="all",
                               grid=(30, 52), offset=2340, dst2=True, src_rows=True,
                               tokens=1000, q_out=True, q_strided=True, seed=3)


# --- CUDA graphs ----------------------------------------------------------------------------

_KW = dict(B=2, S=1560, H=12, Hkv=12, D=128, norm="all", grid=(30, 52), dst2=True,
           src_rows=True, q_out=True)
_OUT = ("qkv", "k_pool", "v_pool", "q_out", "kv_amax", "saturated", "q_saturated")


def _refill(c, seed):
    """New contents in place (qkv, frame0, lists, pools, statistics of another case)."""
    fresh = fp8_case(CUDA, BF16, seed=seed, **_KW)
    for name in _OUT + ("dst", "dst2", "src_rows", "kv_scale", "q_scale"):
        dst, src = c[name], fresh[name]
        (u8(dst) if dst.dtype == FP8 else dst).copy_(u8(src) if src.dtype == FP8 else src)
    c["rope"].frame0.copy_(fresh["rope"].frame0)


def test_graph_replay_is_an_eager_call_bit_for_bit():
    c = fp8_case(CUDA, BF16, seed=0, **_KW)
    _side_stream_warmup(lambda: qk_norm_rope_stage_(**c))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qk_norm_rope_stage_(**c)
    for trial in range(3):
        _refill(c, trial + 1)
        eager = clone_case(c)
        qk_norm_rope_stage_(**eager)
        graph.replay()
        torch.cuda.synchronize()
        for name in _OUT:
            g, e = c[name], eager[name]
            if g.dtype == FP8:
                g, e = u8(g), u8(e)
            assert torch.equal(g, e), (trial, name)
