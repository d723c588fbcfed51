"""The chunk breakdown's arithmetic on the CPU: kernel categories, the FLOP counts
against a brute-force count over every (query, key) pair, the roofline fraction."""
from __future__ import annotations

import pytest

from framekv.bench.breakdown import (CATEGORIES, attention_flops, category, chunk_flops,
                                     reference_chunk_flops, roofline, summarise)


@pytest.mark.parametrize("name, want", [
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("cutlass3x_sm90_tensorop_h16816gemm_bf16", "gemm"),
    ("_ZN6cudapy7framekv3ops5adaln14_adaln_kernel", "framekv"),
    # demangled, as the profiler names numba kernels (no "cudapy" left in the name)
    ("framekv::ops::qk_norm_rope::_qk_norm_rope_kernel[abi:v40][abi:cw51cXTLSUw]", "framekv"),
    ("framekv::ops::merge_split_kv::_merge_split_kv_kernel[abi:v19]", "framekv"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>", "other"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy", "other"),
    ("Memcpy DtoD (Device -> Device)", "other"),
])
def test_kernel_categories(name, want):
    assert category(name) == want and want in CATEGORIES


def _brute(pin, window, tokens, block, heads, head_dim):
    """4 H D per visible (query, key) pair, the visible set enumerated key by key."""
    total = 0
    for q in range(tokens):
        j = q // block
        total += pin + window + (j + 1) * block
    return 4 * heads * head_dim * total


@pytest.mark.parametrize("pin, window, tokens, block", [(5, 12, 6, 6), (5, 12, 6, 2), (0, 7, 9, 3)])
def test_attention_flops_equal_the_brute_force_count(pin, window, tokens, block):
    got = attention_flops(heads=3, head_dim=8, pin=pin, window=window, tokens=tokens, block=block)
    assert got == _brute(pin, window, tokens, block, 3, 8)


def test_chunk_flops_and_roofline():
    f = chunk_flops(layers=2, heads=3, head_dim=8, pin=5, window=12, tokens=6, blocks=[6, 6, 2],
                    linear_per_token=100, cross_keys=4)
    assert f["gemm"] == 2 * 6 * 100 * 3
    attn = 2 * (2 * _brute(5, 12, 6, 6, 3, 8) + _brute(5, 12, 6, 2, 3, 8))
    assert f["attention"] == attn + 4 * 3 * 8 * 6 * 4 * 2 * 3
    r = roofline({"gemm": 4e12, "attention": 6e12}, 500.0, 40_000.0)  # 10 TFLOP at 500
    assert r["roofline_us"] == pytest.approx(20_000.0) and r["fraction"] == pytest.approx(0.5)
    s = summarise({"us": {"attention": 30.0, "gemm": 50.0, "framekv": 5.0, "other": 15.0},
                   "kernels": 9, "top_other": []}, {"gemm": 4e12, "attention": 6e12}, 500.0,
                  [40_000.0, 39_000.0, 41_000.0])
    assert s["share"]["gemm"] == pytest.approx(0.5) and s["chunk_us"] == 40_000.0


def test_the_skipped_gemms_are_what_a_trimmed_clean_pass_does_not_run():
    """`reference_chunk_flops` less its trimmed count is the GEMM work torch's FLOP
    counter sees disappear from a steady-state chunk when the clean pass is trimmed."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from framekv.engine.rollout import Rollout

    gemm = {}
    for trim in (True, False):
        r = Rollout("tiny", use_graphs=False, trim_clean_pass=trim)
        r.prefill()
        for _ in range(r.spec.window_frames // r.spec.frames_per_chunk + 1):
            r.step()
        with FlopCounterMode(display=False) as counter:
            r.step()
        gemm[trim] = counter.get_flop_counts()["Global"][torch.ops.aten.addmm]
    pair = (r.model_spec, r.spec)
    whole, trimmed = reference_chunk_flops(pair, trimmed=False), reference_chunk_flops(pair)
    assert gemm[False] - gemm[True] == whole["gemm"] - trimmed["gemm"] > 0
    assert whole["attention"] > trimmed["attention"]


def test_the_wan_tail_is_what_its_trimmed_clean_pass_does_not_run():
    """`wan_chunk_flops`' clean tail is the GEMM work torch's FLOP counter sees
    disappear from a `WanRollout` chunk (fused glue) when its clean pass is trimmed."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from framekv.bench.breakdown import wan_chunk_flops
    from framekv.engine import WanRollout
    from framekv.engine.wan import CONFIGS, build_model

    m = build_model("tiny", seed=0)
    kw = dict(latent_size=(4, 4), frames_per_chunk=2, sink_frames=1, window_frames=2)
    text = torch.randn(1, 7, CONFIGS["tiny"]["text_dim"], generator=torch.Generator().manual_seed(9))
    gemm = {}
    for trim in (True, False):
        r = WanRollout(m, use_graphs=False, trim_clean_pass=trim, **kw)
        r.set_prompt(text)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            r.step(torch.randn(1, 4, 2, 4, 4, generator=gen))
        with FlopCounterMode(display=False) as counter:
            r.step(torch.randn(1, 4, 2, 4, 4, generator=gen))
        gemm[trim] = counter.get_flop_counts()["Global"][torch.ops.aten.addmm]
    flops, tail = wan_chunk_flops(m, kw, text.shape[1])
    assert gemm[False] - gemm[True] == tail["gemm"] > 0
    assert 0 < tail["attention"] < flops["attention"]


def test_the_glue_benchmark_compares_the_same_work():
    """`bench.glue`'s torch and framekv glue compute the same tensors (fp32, CPU), so
    their times compare like for like (the inductor variant compiles the torch one)."""
    import torch

    from framekv.bench.glue import _rms_norm, fused_glue, torch_glue
    from framekv.engine.model.blocks import Rope3D

    g = torch.Generator().manual_seed(0)
    B, S, H, Hkv, D, hid, ffn = 1, 24, 4, 2, 16, 32, 48

    def r(*shape, s=1.0):
        return torch.randn(*shape, generator=g) * s
    x, mods = r(B, S, hid), [r(B, 1, hid, s=0.1) for _ in range(6)]
    qkv, proj, fc2 = r(B, S, H + 2 * Hkv, D), r(B, S, hid), r(B, S, hid)
    qn, kn = _rms_norm(1 + r(D, s=0.1)), _rms_norm(1 + r(D, s=0.1))
    fc1 = torch.nn.Linear(hid, ffn).requires_grad_(False)
    rope = Rope3D(D, (2, 4), torch.device("cpu"))
    f0 = torch.tensor([5])
    cos, sin = Rope3D.cos_sin(rope.angles(f0, S // 8))
    h1, packed, mlp, x_out = torch_glue(x, mods, qkv, proj, fc2, cos, sin, qn, kn, fc1, H, Hkv)
    fx, fqkv = x.clone(), qkv.clone()
    fh1, fmlp = fused_glue(fx, mods, fqkv, proj, fc2, rope.grid(f0), qn, kn, fc1, H, Hkv)
    for want, got in ((h1, fh1), (packed, fqkv), (mlp, fmlp), (x_out, fx)):
        assert float((want - got).abs().max()) <= 1e-5
    assert float((x_out - x).abs().max()) > 1e-3  # the residuals did something
