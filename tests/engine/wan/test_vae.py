"""`StreamingVAEDecoder` on the CPU (fp32): a video decoded in chunks of any split equals
diffusers' whole-video decode of ``latents * std + mean``; sequences decoded together,
apart, or by row subsets equal each decoded alone; reset starts over; the arguments
that must fail do. The graph path's plumbing runs through `GraphCache`'s eager stand-in."""
from __future__ import annotations

import inspect

import pytest
import torch

from coder_harness import (check_common_refusals, check_graph_path, check_refusals,
                           check_reset, check_row_subsets, chunked, wan22_vae)
from framekv.engine.arena import HOST_CHUNK_BYTES, carved_bytes, round_up
from framekv.engine.wan import CONFIGS, VAE_CONFIGS, StreamingVAEDecoder, build_vae, load_vae

H, W = 5, 6  # latent size: odd, not square


@pytest.fixture(scope="module")
def vae():
    return build_vae("tiny", seed=3)


def latents(seed: int, B: int = 1, F: int = 7, size=(H, W), stamp: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 4, F, *size, generator=g) + stamp  # [B, C, F, H, W]


def denorm(vae, z: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return z * std + mean


@torch.no_grad()
def whole(vae, z: torch.Tensor) -> torch.Tensor:
    """The reference: diffusers' whole-video decode, denormalised here."""
    return vae.decode(denorm(vae, z)).sample


def test_configs_pair_with_the_transformers_and_diffusers_defaults():
    from diffusers import AutoencoderKLWan

    assert VAE_CONFIGS["tiny"]["z_dim"] == CONFIGS["tiny"]["in_channels"]
    assert VAE_CONFIGS["1.3b"]["z_dim"] == CONFIGS["1.3b"]["in_channels"]
    assert VAE_CONFIGS["14b"]["z_dim"] == CONFIGS["14b"]["in_channels"]
    defaults = {k: p.default for k, p in inspect.signature(AutoencoderKLWan).parameters.items()}
    for k, v in VAE_CONFIGS["1.3b"].items():
        assert list(v) == list(defaults[k]) if isinstance(v, tuple) else v == defaults[k], k
    tiny = VAE_CONFIGS["tiny"]
    assert len(tiny["latents_mean"]) == len(tiny["latents_std"]) == 4
    assert len(tiny["dim_mult"]) == 4 and list(tiny["temperal_downsample"]) == [False, True, True]
    assert len(set(tiny["latents_mean"])) == 4 and all(s not in (0, 1) for s in tiny["latents_std"])


def test_the_decoders_cache_is_what_the_streaming_relies_on(vae):
    """None, then one step or "Rep" after a video's first frame, two steps after."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    n = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
    cache, x = [None] * n, vae.post_quant_conv(latents(0, F=3))
    seen = []
    with torch.no_grad():
        for i in range(3):
            vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
            seen.append([c if c is None or isinstance(c, str) else c.shape[2] for c in cache])
    used = sum(c is not None for c in seen[0])
    assert set(seen[0][:used]) == {1, "Rep"} and seen[0].count("Rep") == 2
    assert seen[1][:used] == seen[2][:used] == [2] * used and seen[2][used:] == [None] * (n - used)


@pytest.fixture(scope="module")
def video(vae):
    z = latents(1, B=2)
    return z, whole(vae, z)


@pytest.mark.parametrize("split", [(1, 2, 4), (3, 3, 1), (1,) * 7, (2, 5), (7,)])
def test_chunks_equal_the_whole_video_decode(vae, video, split):
    z, ref = video
    dec = StreamingVAEDecoder(vae)
    got = chunked(dec, z, split)
    assert got.shape == ref.shape == (2, 3, 1 + 4 * 6, 8 * H, 8 * W)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert dec.state == (7, 7) and dec.frames_decoded(1) == 7


def test_denormalisation_is_wanpipelines_formula(vae):
    """latents / (1 / std) + mean, as WanPipeline builds them: bit for bit through
    diffusers' modules, within fp32 rounding through the fused program."""
    z = latents(2, F=3)
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)
    with torch.no_grad():
        ref = vae.decode(z / inv_std + mean).sample
        raw = vae.decode(z).sample
    got = StreamingVAEDecoder(vae, fused=False).decode(z)
    assert torch.equal(got, ref)
    torch.testing.assert_close(StreamingVAEDecoder(vae).decode(z), ref, rtol=0, atol=1e-5)
    assert (got - raw).abs().max() > 1e-2  # the denormalisation is not a no-op


def test_output_shape_dtype_and_clamp():
    loud = build_vae("tiny", seed=3)
    loud.decoder.conv_out.weight.mul_(30)  # the decoder's raw output passes [-1, 1]
    dec = StreamingVAEDecoder(loud)
    first, later = dec.decode(latents(3, B=2, F=2)), dec.decode(latents(4, B=2, F=3))
    assert first.shape == (2, 3, 5, 8 * H, 8 * W) and later.shape == (2, 3, 12, 8 * H, 8 * W)
    for out in (first, later):
        assert out.dtype == torch.float32 and out.min() == -1 and out.max() == 1
        assert ((out.abs() < 1) & (out != 0)).any()  # clamped, not squashed to a sign
    assert dec.decode(latents(5, B=2, F=1)).shape[2] == 4


def test_bf16_vae_returns_bf16_frames_equal_to_its_own_whole_decode():
    vae16 = build_vae("tiny", dtype=torch.bfloat16, seed=4)
    z = latents(6, F=3, size=(3, 4))
    mean = torch.tensor(vae16.config.latents_mean).view(1, 4, 1, 1, 1).to(torch.bfloat16)
    inv_std = (1.0 / torch.tensor(vae16.config.latents_std).view(1, 4, 1, 1, 1)).to(torch.bfloat16)
    with torch.no_grad():
        ref = vae16.decode(z.to(torch.bfloat16) / inv_std + mean).sample
        exact = build_vae("tiny", seed=4).decode(denorm(vae16, z)).sample    # fp32
    got = chunked(StreamingVAEDecoder(vae16, fused=False), z, (1, 2))
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    # the fused program rounds once where the modules round five times: no further
    # from fp32 than the modules' own bf16 frames, give or take a bf16 step
    fused = chunked(StreamingVAEDecoder(vae16), z, (1, 2))
    assert fused.dtype == torch.bfloat16 and not torch.equal(fused, got)
    err = (fused.float() - exact).abs().max()
    assert err <= (got.float() - exact).abs().max() + 2 ** -7, float(err)


def test_reset_reproduces_a_fresh_decoder(vae):
    check_reset(StreamingVAEDecoder(vae), StreamingVAEDecoder(vae), latents(7, F=4), (2, 2),
                latents(8, F=3), (1, 2))


def test_sequences_in_one_batch_equal_each_alone(vae):
    z = torch.cat([latents(10 + s, stamp=s) for s in range(3)])  # [3, C, 7, H, W]
    together = chunked(StreamingVAEDecoder(vae), z, (3, 1, 3))
    for s in range(3):
        alone = chunked(StreamingVAEDecoder(vae), z[s:s + 1], (3, 1, 3))
        torch.testing.assert_close(together[s:s + 1], alone, rtol=0, atol=1e-5)


def test_row_subsets_touch_only_their_rows(vae):
    z = [latents(20 + s, F=6, stamp=0.5 * s) for s in range(3)]  # sequence s: its own latents
    solo = [chunked(StreamingVAEDecoder(vae), z[s], (2, 1, 3)) for s in range(3)]
    dec = StreamingVAEDecoder(vae, sequences=3)
    check_row_subsets(dec, z, solo, [([1, 2, 0], 0, 2), ([2, 0], 2, 1), ([1], 2, 1),
                                     ([0, 1, 2], 3, 3)])
    # Row 1 starts a new video; rows 0 and 2 are untouched by it.
    dec.reset([1])
    assert dec.state == (6, 0, 6)
    new = latents(30, F=2)
    torch.testing.assert_close(dec.decode(new, [1]), StreamingVAEDecoder(vae).decode(new),
                               rtol=0, atol=1e-5)


def test_rows_at_different_stages_are_refused_and_change_nothing(vae):
    dec = StreamingVAEDecoder(vae, sequences=3)
    dec.decode(latents(40, F=2), [2])
    with pytest.raises(ValueError, match=r"rows \[0\] start, rows \[2\] continue"):
        dec.decode(latents(41, B=2, F=1), [2, 0])
    assert dec.state == (0, 0, 2)


def test_the_graph_path_through_graphcaches_eager_stand_in(vae):
    z = latents(50, B=2)
    dec = StreamingVAEDecoder(vae)
    # first:2 (captured), steady:2 (captured), steady:1
    check_graph_path(dec, z, (2, 2, 2, 1), whole(vae, z), (H, W), graphs=3)
    check_refusals([
        (lambda: dec.capture(2, 1, (H, 0)), r"latent_size must be \(H, W\)"),
        (lambda: dec.capture(3, 1, (H, W)), r"batch must be an integer in \[1, 2\], got 3"),
        (lambda: dec.capture(2, 0, (H, W)), r"frames must be an integer in \[1, inf\], got 0")])


def test_arena_holds_every_sequences_steady_cache(vae):
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    n = sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())
    cache, x = [None] * n, vae.post_quant_conv(latents(0, F=2))
    with torch.no_grad():
        for i in range(2):
            vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
    sizes = [3 * c.nbytes for c in cache if c is not None]  # 3 sequences
    dec = StreamingVAEDecoder(vae, sequences=3)
    assert dec.arena_bytes == 0
    dec.decode(latents(1, F=1))
    assert dec.arena_bytes == round_up(carved_bytes(sizes), HOST_CHUNK_BYTES)
    assert [tuple(t.shape) for t in dec._cache.tensors] == [(3, *c.shape[1:]) for c in cache
                                                            if c is not None]
    dec.close()
    assert dec.arena_bytes == 0 and dec.graph_count == 0
    dec.close()  # idempotent


def test_bad_arguments(vae):
    dec = StreamingVAEDecoder(vae, sequences=2)
    z = latents(60, B=2, F=1)
    check_common_refusals(dec, z, dec.frames_decoded)
    check_refusals([
        (lambda: StreamingVAEDecoder(vae, sequences=0), r"sequences must be None or an integer"),
        (lambda: StreamingVAEDecoder(vae, use_graphs="yes"), r"use_graphs must be True or False"),
        (lambda: StreamingVAEDecoder(torch.nn.Linear(2, 2)),
         r"vae must be a diffusers AutoencoderKLWan, got Linear"),
        (lambda: build_vae("huge"), r"config must be one of \['1.3b', '14b', 'tiny'\]")])
    dec.decode(z)
    with pytest.raises(ValueError, match=r"latents must be \[5, 6\] \(H, W\).*got \[6, 6\]"):
        dec.decode(latents(62, B=2, F=1, size=(6, 6)))
    assert dec.state == (1, 1)


def test_wan22_vaes_are_refused():
    with pytest.raises(ValueError, match="vae must be a Wan 2.1 VAE.*patch_size=2"):
        StreamingVAEDecoder(wan22_vae())


def test_load_vae_reads_a_local_folder_and_its_vae_subfolder(vae, tmp_path):
    vae.save_pretrained(tmp_path / "pipe" / "vae")
    vae.save_pretrained(tmp_path / "alone")
    for path in (tmp_path / "pipe", tmp_path / "alone"):
        loaded = load_vae(path)
        assert loaded.dtype == torch.float32 and not loaded.training
        assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(),
                                                     loaded.state_dict().values()))
    assert load_vae(tmp_path / "alone", dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="path must be a local diffusers folder.*nowhere"):
        load_vae(tmp_path / "nowhere")


def test_a_row_snapshot_moves_a_video_to_another_decoder(vae):
    """A video's decoder row leaves (`snapshot`) and goes on in another decoder's other
    row (`restore`): its frames equal the uninterrupted decode; the restore touches no
    other row; a state of another latent size is refused."""
    z = latents(40, F=6)
    whole_run = chunked(StreamingVAEDecoder(vae), z, (2, 2, 2))
    a = StreamingVAEDecoder(vae, sequences=2)
    first = chunked(a, z[:, :, :4], (2, 2), rows=[1])
    state = a.snapshot(1)
    assert state["frames"] == 4 and len(state["cache"]) == len(a._cache.tensors)
    b = StreamingVAEDecoder(vae, sequences=3)
    b.decode(latents(41, B=3, F=2), [0, 1, 2])
    kept = [t[0].clone() for t in b._cache.tensors]
    b.restore(2, state)
    assert b.state == (2, 2, 4) and all(torch.equal(t[0], k) for t, k in zip(b._cache.tensors, kept))
    rest = b.decode(z[:, :, 4:], [2])
    assert torch.equal(torch.cat([first, rest], 2), whole_run)
    other = StreamingVAEDecoder(vae, sequences=1)
    other.decode(latents(42, F=1, size=(3, 4)))
    with pytest.raises(ValueError, match="another vae or latent size"):
        other.restore(0, state)
    assert other.state == (1,)
    fresh = a.snapshot(0)                      # row 0 never decoded: an empty video
    b.restore(2, fresh)
    assert b.state == (2, 2, 0)
