"""The Wan VAE encoder's fused channels-last program (`framekv.engine.wan.
vae_encoder_fused`) on the CPU in fp32, against diffusers' modules run as ``_encode``
runs them (`fused=False`): cuts, row orders and sizes, with the causal convs' time taps
folded into the channels and without; the 1.3B encoder's real widths (the folded
96-channel convs, the mid block's attention) at a small size; states moved between the
two programs; the arena's channels-last layout; a program that must not write leaving
every row as it was; bf16 no further from fp32 than the modules' own bf16 latents."""
from __future__ import annotations

import pytest
import torch

from coder_harness import (check_channels_last_arena, check_half_precision,
                           check_state_moves_between_programs, check_unwritten, chunked,
                           fused_pair)
from framekv.engine.wan import StreamingVAEEncoder, build_vae
from framekv.engine.wan import vae_encoder_fused
from framekv.engine.wan.vae_cache import CacheLayout
from framekv.engine.wan.vae_encoder_fused import (IN_FOLDED, IN_WIDTH, FusedEncoder,
                                                  fused_encode_program)
from test_vae_encoder import frames, whole
from test_vae_fused import vae  # noqa: F401  (the fixture: the tiny VAE, its gammas drawn)


def pair(vae, **kw):
    return fused_pair(StreamingVAEEncoder, vae, **kw)


@pytest.mark.parametrize("fold_below", [None, 0])
@pytest.mark.parametrize("cut,size", [((1, 4, 8), (16, 24)), ((5, 8), (24, 8)), ((13,), (8, 8)),
                                      ((9, 4), (32, 16))])
def test_fused_latents_equal_the_modules(vae, cut, size, fold_below, monkeypatch):
    # the tiny config's widths are all below FOLD_BELOW: every causal conv folded, or none
    monkeypatch.setattr(vae_encoder_fused, "FOLD_BELOW", vae_encoder_fused.FOLD_BELOW
                        if fold_below is None else fold_below)
    x = frames(11, B=2, F=13, size=size)
    fused, ref = pair(vae)
    folded = [w.conv1.folded for kind, w in fused._program_weights.blocks if kind == "res"]
    assert folded and all(f == (fold_below is None) for f in folded)
    got, want = chunked(fused, x, cut, rows=[1, 0]), chunked(ref, x, cut, rows=[1, 0])
    assert got.shape == want.shape == (2, 4, 4, size[0] // 8, size[1] // 8)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert fused.PROGRAM == "vae-encode-fused" and ref.PROGRAM == "vae-encode"


def test_the_13b_encoder_with_its_attention_at_a_small_size():
    big = build_vae("1.3b", seed=1)
    x = frames(2, F=9, size=(16, 24))
    fused = StreamingVAEEncoder(big)
    got = chunked(fused, x, (5, 4))
    torch.testing.assert_close(got, whole(big, x), rtol=0, atol=2e-5)
    program = fused._program_weights
    layout = CacheLayout.probe(big, (16, 24), torch.device("cpu"), part="encoder")
    assert program.entries == len(layout.shapes) == 24
    # conv_in, the residual blocks' two convs, the two time downsamples (one step), conv_out
    assert [s[1] for s in layout.shapes].count(1) == 2
    assert [s[0] for s in layout.shapes][:2] == [3, 96]
    # the 96-channel convs and the input conv run folded, the wider ones as 3-D convs
    widths = {w.conv1.weight.shape[1] // (3 if w.conv1.folded else 1): w.conv1.folded
              for kind, w in program.blocks if kind == "res"}
    assert widths == {96: True, 192: False, 384: False}
    # the input conv: three taps of IN_WIDTH channels, zero-padded to IN_FOLDED together
    conv_in = program.conv_in
    assert conv_in.folded and conv_in.width == IN_WIDTH and IN_FOLDED > 3 * IN_WIDTH
    assert conv_in.weight.shape == (96, IN_FOLDED, 3, 3)
    assert not conv_in.weight[:, 3 * IN_WIDTH:].any()
    assert all(not conv_in.weight[:, k * IN_WIDTH + 3:(k + 1) * IN_WIDTH].any() for k in range(3))
    assert not program.conv_out.folded and program.conv_out.out == 16


def test_the_output_conv_is_conv_out_then_the_means_quant_rows_then_the_normalisation(vae):
    program = FusedEncoder(vae, fold_below=0)                        # a 3-D conv here
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 16, 3, 2, 3, generator=g)                     # [B, C, 2 + 1, h, w]
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        moments = vae.quant_conv(vae.encoder.conv_out(h))[:, :, -1:]  # its last step: h's steps
        #                                                                before it are the cache
        want = (moments[:, :4] - mean) * inv_std
        conv = program.conv_out
        got = torch.nn.functional.conv3d(h, conv.weight, None, padding=conv.pad)
    assert conv.weight.shape[0] == 8 and conv.out == 4                # padded to 8 channels
    assert torch.equal(got[:, 4:], torch.zeros_like(got[:, 4:]))
    got = got[:, :4] + program.out_bias.view(1, -1, 1, 1, 1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("src_fused", [True, False])
def test_a_state_moves_between_the_programs(vae, src_fused):
    src = StreamingVAEEncoder(vae, fused=src_fused, sequences=2)
    dst = StreamingVAEEncoder(vae, fused=not src_fused, sequences=3)
    check_state_moves_between_programs(src, dst, frames(12, F=13), (5, 4), 9)


def test_the_arena_is_channels_last_and_snapshots_keep_the_modules_layout(vae):
    fused, ref = pair(vae, sequences=2)
    check_channels_last_arena(fused, ref, frames(13, B=2, F=9))
    assert sorted({t.shape[1] for t in fused._cache.rows_last}) == [1, 2]   # steps per entry


def test_a_program_that_must_not_write_leaves_the_rows(vae):
    fused = StreamingVAEEncoder(vae, sequences=2)
    fused.encode(frames(14, B=2, F=5))
    fn = fused_encode_program(fused._program_weights, fused._cache, first=False, write=False)
    out = check_unwritten(fused, fn, frames(15, B=2, F=8))
    assert out.shape == (2, 4, 2, 2, 3) and out.is_contiguous()


def test_a_half_precision_vae_runs_the_modules_and_refuses_fused():
    check_half_precision(StreamingVAEEncoder, build_vae("tiny", dtype=torch.float16, seed=7))


def test_bf16_latents_are_no_further_from_fp32_than_the_modules():
    exact = whole(build_vae("tiny", seed=4), frames(16, F=9))            # fp32
    vae16 = build_vae("tiny", dtype=torch.bfloat16, seed=4)
    fused, ref = pair(vae16)
    x = frames(16, F=9)
    got, base = chunked(fused, x, (5, 4)), chunked(ref, x, (5, 4))
    assert got.dtype == base.dtype == torch.bfloat16 and not torch.equal(got, base)
    assert (got.float() - exact).abs().max() <= (base.float() - exact).abs().max() + 2 ** -6
