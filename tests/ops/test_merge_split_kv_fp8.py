"""``merge_split_kv_`` over fp8 e4m3 partials (what cuDNN's fp8 SDPA writes), on CPU: the
reference dequantizes (scale, per-head scale) and merges exactly, S = 1 is the
dequantization alone, garbage in empty sub-rows stays out, and the arguments are checked.
Also the case builder the simulator and GPU tests share."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import merge_split_kv_, merge_split_kv_reference
from test_merge_split_kv import merge_case, split_attention_case

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn


def fp8_merge_case(device, dtype, *, hs, amp=40.0, **kw):
    """`merge_case` with e4m3 partials (values ~ ``amp`` N(0, 1), NaN and 448 garbage in
    empty sub-rows) and the dequantizing factors: ``scale`` [1], ``head_scale`` [hs]."""
    args, base = merge_case(device, dtype, **kw)
    p = args["partial"].float() * amp
    args["partial"] = p.clamp(-448, 448).to(FP8)
    g = torch.Generator().manual_seed(kw.get("seed", 0) + 1)
    args["scale"] = torch.tensor([1.0 / amp], device=device)
    args["head_scale"] = (torch.rand(hs, generator=g) * 4 + 0.25).to(device)
    return args, base


@pytest.mark.parametrize("S,nb,b,H,hs", [(3, 2, 4, 3, 1), (2, 4, 3, 4, 2), (4, 2, 5, 6, 3)])
def test_fp8_partials_dequantize_then_merge_exactly(S, nb, b, H, hs):
    """Partials rounded to e4m3 under a scale, merged with (1 / scale) * head scale:
    attention over all keys times the head scale, within e4m3's rounding."""
    partial, lse, kv_lens, want = split_attention_case(S=S, nb=nb, b=b, H=H, D=64, seed=S + nb)
    amp = 100.0
    p8 = (partial.float() * amp).clamp(-448, 448).to(FP8)  # empty sub-rows: NaN
    head_scale = torch.arange(1, hs + 1, dtype=torch.float32) / 2
    out = torch.empty(nb * b, H, 64, dtype=torch.bfloat16)
    merge_split_kv_(out, p8, lse.float(), kv_lens, block_size=b, seq_len=nb * b,
                    scale=torch.tensor([1 / amp]), head_scale=head_scale)
    factor = head_scale.repeat_interleave(H // hs).double()[None, :, None]
    # e4m3 keeps 3 mantissa bits (2^-4 relative step); |attention| <= a few
    torch.testing.assert_close(out.double(), want * factor, rtol=0.07, atol=0.05)


def test_one_split_is_the_dequantization_alone():
    """S = 1 with zero statistics (an unsplit fp8 launch's output): out = o8 * factors."""
    T, H, D = 8, 4, 32
    o8 = (torch.randn(1, T, H, D) * 50).clamp(-448, 448).to(FP8)
    scale, head_scale = torch.tensor([0.125]), torch.tensor([0.5, 3.0])
    out = torch.empty(T, H, D, dtype=torch.bfloat16)
    merge_split_kv_(out, o8, torch.zeros(2, H, 4), torch.full((2,), 5, dtype=torch.int32),
                    block_size=4, seq_len=T, scale=scale, head_scale=head_scale)
    f = torch.tensor([0.5, 0.5, 3.0, 3.0])[None, :, None] * 0.125
    assert torch.equal(out, (o8[0].float() * f).to(torch.bfloat16))


@pytest.mark.parametrize("blocked", [False, True])
def test_fp8_reference_is_the_op_on_cpu(blocked):
    kw = dict(S=3, nb=2, b=3, H=4, D=64, seq_len=5, seed=3, blocked=blocked)
    args, _ = fp8_merge_case(CPU, torch.bfloat16, hs=2, **kw)
    want = dict(args, out=args["out"].clone())
    merge_split_kv_(**args)
    merge_split_kv_reference(**want)
    assert torch.equal(args["out"], want["out"])
    assert torch.isfinite(args["out"].float()).all()  # NaN garbage stayed out
    assert args["out"][5:].eq(0).all() and args["out"][3:6].eq(0).all()


def test_fp8_scales_default_to_one():
    args, _ = fp8_merge_case(CPU, torch.float16, hs=1, S=2, nb=1, b=4, H=2, D=64, seed=2)
    bare = dict(args, out=args["out"].clone(), scale=None, head_scale=None)
    ones = dict(args, out=args["out"].clone(), scale=torch.ones(1), head_scale=torch.ones(2))
    merge_split_kv_(**bare)
    merge_split_kv_(**ones)
    assert torch.equal(bare["out"], ones["out"])


def test_fp8_argument_checks():
    args, _ = fp8_merge_case(CPU, torch.bfloat16, hs=2, S=2, nb=2, b=2, H=4, D=64, seed=1)
    bad = [
        (dict(head_scale=torch.ones(3)), r"head_scale: expected \[H_s\] with H_s dividing H = 4"),
        (dict(scale=torch.ones(2)), r"scale: expected shape \[1\], got \(2,\)"),
        (dict(scale=torch.ones(1, dtype=torch.float64)), "scale: expected a 1-d torch.float32"),
        (dict(head_scale=torch.ones(1, 2)), "head_scale: expected a 1-d torch.float32"),
        (dict(partial=args["partial"].float().to(torch.float16)),
         "partial: expected dtype torch.bfloat16 .* or torch.float8_e4m3fn, got torch.float16"),
        (dict(partial=args["partial"].float().to(torch.bfloat16)),
         "scale and head_scale dequantize fp8 partials, got a torch.bfloat16 partial"),
    ]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            merge_split_kv_(**{**args, **change})
    odd = torch.zeros(2, 4, 4, 64 + 4, dtype=FP8)[..., :64]  # rows 68 bytes apart
    with pytest.raises(ValueError, match=r"multiples of 8 elements \(8-byte rows\)"):
        merge_split_kv_(**{**args, "partial": odd})
