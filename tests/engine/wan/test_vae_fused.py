"""The Wan VAE's fused channels-last chunk program (`framekv.engine.wan.vae_fused`) on
the CPU in fp32, against diffusers' modules run frame by frame (`fused=False`): every
split, row order and odd size, the 1.3B decoder's real widths (attention included) at a
small size, states moved between the two programs, the arena's channels-last layout,
and a program that must not write leaving every row as it was; the causal convs with
their time taps folded into the channels and without, and the upsample's phase conv."""
from __future__ import annotations

import weakref

import pytest
import torch

from coder_harness import (check_channels_last_arena, check_half_precision,
                           check_state_moves_between_programs, check_unwritten, chunked,
                           fused_pair)
from framekv.engine.wan import StreamingVAEDecoder, build_vae
from framekv.engine.wan import vae_blocks, vae_fused
from framekv.engine.wan.vae_fused import FusedDecoder, fused_chunk_program
from framekv.engine.wan.vae_graph import CacheLayout
from framekv.engine.wan.vae_cache import ChunkCache
from test_vae import latents


def shuffled_gammas(vae, seed: int):
    """The norms' gammas drawn in [0.5, 1.5] (they start as ones): a bias added after the
    gamma instead of before it, or a gamma of the wrong norm, then shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
    return vae


@pytest.fixture(scope="module")
def vae():
    return shuffled_gammas(build_vae("tiny", seed=7), 8)


def pair(vae, **kw):
    return fused_pair(StreamingVAEDecoder, vae, **kw)


@pytest.mark.parametrize("fold_below", [None, 0])
@pytest.mark.parametrize("split,size", [((1, 2, 4), (5, 6)), ((3, 3, 1), (3, 7)), ((7,), (4, 4)),
                                        ((2, 1, 1, 3), (1, 2))])
def test_fused_frames_equal_the_modules(vae, split, size, fold_below, monkeypatch):
    # the tiny config's widths are all below FOLD_BELOW: every causal conv folded, or none
    monkeypatch.setattr(vae_fused, "FOLD_BELOW", vae_fused.FOLD_BELOW if fold_below is None
                        else fold_below)
    z = latents(11, B=2, size=size)
    fused, ref = pair(vae)
    folded = [w.conv1.folded for kind, w in fused._program_weights.blocks if kind == "res"]
    assert folded and all(f == (fold_below is None) for f in folded)
    got, want = chunked(fused, z, split, rows=[1, 0]), chunked(ref, z, split, rows=[1, 0])
    assert got.shape == want.shape == (2, 3, 25, 8 * size[0], 8 * size[1])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert fused.PROGRAM == "vae-decode-fused" and ref.PROGRAM == "vae-decode"


def test_the_13b_decoder_with_its_attention_at_a_small_size():
    big = build_vae("1.3b", seed=1)
    g = torch.Generator().manual_seed(2)
    z = torch.randn(1, 16, 4, 2, 3, generator=g)                     # [B, C, F, H, W]
    fused, ref = pair(big)
    got, want = chunked(fused, z, (2, 2)), chunked(ref, z, (2, 2))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    layout = CacheLayout.probe(big, (2, 3), torch.device("cpu"))
    program = FusedDecoder(big)
    assert program.entries == len(layout.shapes) == 32
    # the 96-channel convs run folded, the wider ones as 3-D convs
    widths = {w.conv1.weight.shape[1] // (3 if w.conv1.folded else 1): w.conv1.folded
              for kind, w in program.blocks if kind == "res"}
    assert widths == {384: False, 192: False, 96: True}
    assert program.conv_in.folded and program.conv_out.folded
    assert [s[0] for s in layout.shapes][:3] == [16, 384, 384]        # conv_in, mid block


@pytest.mark.parametrize("fold_below", [None, 0])
def test_a_residual_block_adds_the_bias_pending_on_its_input(vae, fold_below):
    # Wan's shortcut blocks follow an upsample (nothing pending): this one gets a pending
    # bias, which its norm1 and its shortcut's bias must take in
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

    torch.manual_seed(4)
    block = shuffled_gammas(WanResidualBlock(6, 10).eval().requires_grad_(False), 5)
    program = FusedDecoder(vae, fold_below=fold_below)
    g = torch.Generator().manual_seed(6)
    pending = torch.randn(6, generator=g)
    w = program._res_weights(block, pending)
    assert w.short is not None and w.conv1.folded == (fold_below is None)
    x = torch.randn(2, 3, 4, 5, 6, generator=g)                       # [B, T, H, W, C]
    arena = [torch.full((3, 2, 4, 5, c), 7.0) for c in (6, 10)]     # stale rows: unread
    caches = ChunkCache(arena, torch.tensor([2, 0]), True, True)     # a video's start
    got = program._res(w, x, caches, 0, 1)      # conv2 bias in the shortcut: none pending
    with torch.no_grad():
        want = block((x + pending).movedim(-1, 1)).movedim(1, -1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_first_conv_output_is_freed_once_its_norm_has_read_it(vae, monkeypatch):
    # the residual block's peak: conv1's output must not live on beside conv2's input
    freed = []
    call = vae_blocks._Fill.__call__

    def watched(fill, outs, counts):
        ref = weakref.ref(fill._x) if fill._release else None
        call(fill, outs, counts)
        if ref is not None:
            freed.append(ref() is None)

    monkeypatch.setattr(vae_blocks._Fill, "__call__", watched)
    dec = StreamingVAEDecoder(vae)
    dec.decode(latents(16, F=3))               # two passes: the first frame, then the rest
    blocks = sum(kind == "res" for kind, _ in dec._program_weights.blocks)
    assert len(freed) == 2 * blocks and all(freed)


@pytest.mark.parametrize("src_fused", [True, False])
def test_a_state_moves_between_the_programs(vae, src_fused):
    src = StreamingVAEDecoder(vae, fused=src_fused, sequences=2)
    dst = StreamingVAEDecoder(vae, fused=not src_fused, sequences=3)
    check_state_moves_between_programs(src, dst, latents(12, B=1, F=6), (2, 1), 3)


def test_the_arena_is_channels_last_and_snapshots_keep_the_modules_layout(vae):
    check_channels_last_arena(*pair(vae, sequences=2), latents(13, B=2, F=3))


def test_a_program_that_must_not_write_leaves_the_rows(vae):
    fused = StreamingVAEDecoder(vae, sequences=2)
    fused.decode(latents(14, B=2, F=2))
    fn = fused_chunk_program(fused._program_weights, fused._cache, first=False,
                             mean=fused._mean, inv_std=fused._inv_std, write=False)
    assert check_unwritten(fused, fn, latents(15, B=2, F=2)).shape == (2, 3, 8, 40, 48)


def test_a_half_precision_vae_runs_the_modules_and_refuses_fused():
    check_half_precision(StreamingVAEDecoder, build_vae("tiny", dtype=torch.float16, seed=7))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 0.1)])
def test_the_phase_conv_is_the_upsample_then_the_conv(dtype, atol):
    g = torch.Generator().manual_seed(3)
    conv = torch.nn.Conv2d(6, 5, 3, padding=1).to(dtype)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g))
    x = torch.randn(2, 6, 3, 7, generator=g).to(dtype)                # [N, C, H, W]
    with torch.no_grad():
        want = conv(torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"))
    phase = vae_fused._upsample_conv(conv)
    assert phase.weight.shape == (20, 6, 2, 2) and phase.out == 5
    p = torch.nn.functional.conv2d(x, phase.weight, phase.bias, padding=1)   # [N, 4C, H+1, W+1]
    p = p.view(2, 2, 2, 5, 4, 8)                                      # [N, py, px, C, H+1, W+1]
    for py in range(2):
        for px in range(2):
            got = p[:, py, px, :, py:py + 3, px:px + 7]
            torch.testing.assert_close(got.float(), want[..., py::2, px::2].float(), rtol=0,
                                       atol=atol * float(want.abs().max()))


def test_an_upsample_conv_that_is_not_3x3_is_refused():
    with pytest.raises(ValueError, match=r"expected a 3x3 kernel with padding 1, got kernel \[1, 1\]"):
        vae_fused._upsample_conv(torch.nn.Conv2d(4, 4, 1))
