"""``rms_norm_silu`` on the CPU (the torch reference): equal to the Wan VAE's own
``WanRMS_norm`` + SiLU in fp32, rows that are slices of a larger buffer, and every
argument error named before anything is written. The kernel's tests: ``_sim`` (numba's
simulator) and ``_gpu``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framekv.ops.rms_silu import MAX_N, rms_norm_silu, rms_norm_silu_reference


def stamped(B, M, N, dtype=torch.float32, seed=0, device="cpu"):
    """Rows of distinct scales (row r scaled by 1 + r / 7), so a row mixed up shows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, M, N, generator=g)
    x *= (1 + torch.arange(B * M).view(B, M, 1) / 7)
    gamma = 0.5 + torch.rand(N, generator=g)
    return x.to(device, dtype), gamma.to(device, dtype)


@pytest.mark.parametrize("silu", [True, False])
def test_equals_the_vae_modules_in_fp32(silu):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    x, gamma = stamped(2, 37, 96)
    norm = WanRMS_norm(96, images=False)
    norm.gamma.data.copy_(gamma.view(96, 1, 1, 1))
    nchw = x.permute(0, 2, 1).reshape(2, 96, 37, 1, 1)       # [B, C, T, H, W]
    want = norm(nchw)
    want = (F.silu(want) if silu else want).reshape(2, 96, 37).permute(0, 2, 1)
    torch.testing.assert_close(rms_norm_silu(x, gamma, silu=silu), want, rtol=1e-6, atol=1e-6)


def test_writes_rows_into_a_slice_of_a_buffer_and_nothing_else():
    x, gamma = stamped(3, 10, 16)
    buf = torch.full((3, 12, 16), 7.0)
    out = rms_norm_silu(x, gamma, out=buf[:, 2:])
    assert out.data_ptr() == buf[:, 2:].data_ptr()
    torch.testing.assert_close(buf[:, 2:], rms_norm_silu_reference(x, gamma))
    assert bool((buf[:, :2] == 7.0).all())


def test_taps_of_a_folded_conv_buffer_from_one_call():
    # buf [B, T, R, 3, N]: tap k of step s holds step s + k of [c0, c1, x0 .. x_{T-1}],
    # so x's first T - 2 + k steps go to tap k from step 2 - k on
    B, T, R, N = 2, 4, 3, 16
    x, gamma = stamped(B, T * R, N, seed=3)
    buf = torch.full((B, T, R, 3, N), 7.0)
    outs = tuple(buf[:, 2 - k:, :, k].view(B, -1, N) for k in range(3))
    assert rms_norm_silu(x, gamma, out=outs) is outs
    want = rms_norm_silu_reference(x, gamma).view(B, T, R, N)
    for k in range(3):
        torch.testing.assert_close(buf[:, 2 - k:, :, k], want[:, :T - 2 + k])
        assert bool((buf[:, :2 - k, :, k] == 7.0).all())


def test_scale_eps_and_zero_rows():
    x, gamma = stamped(1, 4, 8)
    x[0, 1] = 0                                                # a zero row: eps floors the norm
    got = rms_norm_silu(x, gamma, scale=2.0, silu=False)
    want = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12) * 2.0 * gamma
    torch.testing.assert_close(got, want)
    assert bool((got[0, 1] == 0).all())


def test_a_bias_is_a_conv_bias_before_the_norm():
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    x, gamma = stamped(2, 9, 24)
    bias = torch.linspace(-3, 3, 24)                  # large next to x: a missed add shows
    norm = WanRMS_norm(24, images=False)
    norm.gamma.data.copy_(gamma.view(24, 1, 1, 1))
    want = F.silu(norm((x + bias).permute(0, 2, 1).reshape(2, 24, 9, 1, 1)))
    got = rms_norm_silu(x, gamma, bias=bias)
    torch.testing.assert_close(got, want.reshape(2, 24, 9).permute(0, 2, 1),
                               rtol=1e-6, atol=1e-6)
    assert (got - rms_norm_silu(x, gamma)).abs().max() > 0.1


def test_bf16_is_rounded_once_from_fp32():
    x, gamma = stamped(2, 5, 24, dtype=torch.bfloat16)
    got = rms_norm_silu(x, gamma)
    want = F.silu(F.normalize(x.float(), dim=-1) * 24 ** 0.5 * gamma.float()).bfloat16()
    assert torch.equal(got, want)


def test_errors_name_the_argument_and_write_nothing():
    x, gamma = stamped(1, 4, 8)
    out = torch.full_like(x, 3.0)
    cases = [
        (dict(x=x[0]), "x: expected"),
        (dict(x=x.int()), "x must have dtype"),
        (dict(x=x.transpose(1, 2).contiguous().transpose(1, 2)), "x: expected a contiguous"),
        (dict(gamma=gamma[:7]), r"gamma: expected \[8\]"),
        (dict(bias=gamma[:5]), r"bias: expected \[8\]"),
        (dict(bias=gamma.int()), "bias must have dtype"),
        (dict(bias=out[0, 0]), "out: expected memory apart from bias"),
        (dict(out=out[:, :3]), r"out: expected shape \[1, 4, 8\]"),
        (dict(out=x), "out: expected memory apart"),
        (dict(scale=float("inf")), "scale: expected a finite number"),
        (dict(eps=-1.0), "eps: expected a finite number >= 0"),
        (dict(silu=1), "silu: expected True or False"),
        (dict(out=(out[:, :2], out[:, 1:3])), r"out\[1\]: expected memory apart from out\[0\]"),
        (dict(out=(torch.zeros(1, 5, 8),)), r"out: expected \[1, M_i, 8\] with 1 <= M_i <= 4"),
        (dict(out=(out[:, :1],) * 4), "out: expected a tensor or 1 to 3 tensors, got 4"),
        (dict(out=(out[:, :2], x)), r"out\[1\]: expected memory apart from x"),
    ]
    for kw, match in cases:
        args = dict(x=x, gamma=gamma, out=out) | kw
        with pytest.raises(ValueError, match=match):
            rms_norm_silu(args.pop("x"), args.pop("gamma"), **args)
        assert bool((out == 3.0).all()), match
    wide = torch.zeros(1, 1, MAX_N + 4)
    with pytest.raises(ValueError, match=f"N <= {MAX_N}"):
        rms_norm_silu(wide, torch.ones(MAX_N + 4))
