"""`TinyStreamingDecoder` (fp32 on the CPU unless marked gpu): a video decoded in chunks
of any split, rows at different points of their videos batched together, equals its
decode in one call; the network is the TAEHV layout's (checked against a plain
functional decode over the checkpoint's own key names); frame counts are the Wan VAE's;
reset, snapshot and restore move rows; checkpoints of another layout are refused by
name; .pth and .safetensors load; bad arguments fail. Random weights throughout."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framekv.engine.wan import StreamingVAEDecoder, TinyStreamingDecoder
from coder_harness import (check_common_refusals, check_graph_path, check_random_draws,
                           check_refusals, check_refused_layouts,
                           check_rows_at_different_points, check_tiny_on_cuda, chunked,
                           taehv_memory_block, tiny_factory)
from framekv.engine.wan.tiny_decoder import WIDTHS, TinyDecoderNet, random_init

H, W = 5, 7     # latent size of the main equivalence tests: odd, not square
h, w = 3, 5     # a smaller one for the rest


NARROW = (32, 16, 8, 8)  # the layout's structure at an eighth of its widths


def factory(widths, seed: int = 7):
    """Fresh decoders over one set of random weights."""
    return tiny_factory(TinyStreamingDecoder, widths, seed)


@pytest.fixture(scope="module")
def dec_factory():
    return factory(NARROW)


@pytest.fixture(scope="module")
def full_factory():
    """Decoders of the checkpoint layout's widths."""
    return factory(WIDTHS, seed=5)


def latents(seed: int, B: int = 1, F_: int = 6, size=(H, W), C: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, C, F_, *size, generator=g)  # [B, C, F, H, W]


@pytest.fixture(scope="module")
def video(dec_factory):
    z = latents(1, B=2)
    return z, dec_factory().decode(z)


@pytest.mark.parametrize("split", [(2, 2, 2), (3, 3), (3, 2, 1), (1,) * 6])
def test_chunks_equal_the_whole_video_decode(dec_factory, video, split):
    z, whole = video
    dec = dec_factory()
    got = chunked(dec, z, split)
    assert got.shape == whole.shape == (2, 3, 4 * 6 - 3, 8 * H, 8 * W)
    torch.testing.assert_close(got, whole, rtol=0, atol=1e-5)
    assert dec.state == (6, 6) and dec.frames_decoded(1) == 6
    assert got.abs().max() <= 1 and got.std() > 0.05


def test_frames_are_the_rgb_clamped_to_0_1_then_mapped_to_minus_1_1():
    net = TinyDecoderNet(16, NARROW)
    random_init(net, seed=2)
    net.head.weight.data.mul_(30)                   # the raw output passes [0, 1] both ways
    z = latents(14, F_=2, size=(h, w))
    out = TinyStreamingDecoder(net).decode(z)
    rgb, _ = net.stream(z, [torch.zeros(1, *s) for s in net.memory_shapes((h, w))])
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert torch.equal(out, rgb[:, :, 3:].clamp(0, 1) * 2 - 1)
    assert out.min() == -1 and out.max() == 1 and ((out.abs() < 1) & (out != 0)).any()


def test_rows_at_different_points_of_their_videos_in_one_batch(dec_factory, video):
    """Row 0 has decoded 2 frames of its video, row 1 3 of another: their next chunks,
    decoded together, equal each video's whole decode; what a row decoded before matters."""
    z, whole = video
    both = check_rows_at_different_points(dec_factory, z, whole, (2, 5), (3, 6))
    fresh = dec_factory().decode(z[1:2, :, 3:6])    # the same latents starting a video
    assert (fresh[:, :, -4:] - both[1:2, :, -4:]).abs().max() > 1e-2


def _taehv_reference(sd: dict, z: torch.Tensor) -> torch.Tensor:
    """A whole video through the TAEHV decoder, written over the checkpoint's key names in
    its own order (upsample, then the time conv): z [B, C, F, H, W] -> [B, 3, 4F-3, ...]
    in [-1, 1]."""
    def conv(x, i, pad=1):
        return F.conv2d(x, sd[f"decoder.{i}.weight"], sd.get(f"decoder.{i}.bias"), padding=pad)

    B, T = z.shape[0], z.shape[2]
    x = z.transpose(1, 2).flatten(0, 1)                       # [B T, C, H, W]
    x = F.relu(conv(torch.tanh(x / 3) * 3, 1))
    for base, k in ((3, 1), (9, 2), (15, 2)):
        for i in range(base, base + 3):
            x = taehv_memory_block(sd, f"decoder.{i}", x, B, T)
        x = F.interpolate(x, scale_factor=2.0)
        x = F.conv2d(x, sd[f"decoder.{base + 4}.conv.weight"])
        x = x.reshape(-1, x.shape[1] // k, *x.shape[2:])      # [B T k, C, h, w]
        T *= k
        x = conv(x, base + 5)
    x = conv(F.relu(x), 22).unflatten(0, (B, T))[:, 3:]
    return (x.clamp(0, 1) * 2 - 1).transpose(1, 2)


@pytest.mark.parametrize("widths", [NARROW, WIDTHS])
def test_the_network_is_the_taehv_layouts(widths):
    dec = factory(widths)()
    z = latents(2, B=2, F_=3, size=(h, w))
    ref = _taehv_reference(dec.net.taehv_state_dict(), z)
    got = dec.decode(z)
    assert got.shape == ref.shape == (2, 3, 9, 8 * h, 8 * w)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


def test_frame_counts_are_the_wan_vaes(dec_factory):
    dec = dec_factory()
    first = True
    for f in (1, 3, 2, 1):
        out = dec.decode(latents(3, F_=f, size=(1, 2)))
        want = StreamingVAEDecoder.video_frames(f, first)
        assert dec.video_frames(f, first) == want == (4 * f - 3 if first else 4 * f)
        assert out.shape == (1, 3, want, 8, 16)
        first = False


def test_reset_of_one_row_restarts_only_it(dec_factory):
    z = latents(4, B=2, F_=4, size=(h, w))
    dec = dec_factory()
    dec.decode(z[:, :, :2])
    dec.reset(rows=[1])
    assert dec.state == (2, 0)
    new1 = dec.decode(z[1:2, :, :2], [1])           # row 1 starts over
    went0 = dec.decode(z[0:1, :, 2:], [0])          # row 0 goes on
    alone = dec_factory()
    torch.testing.assert_close(new1, alone.decode(z[1:2, :, :2]), rtol=0, atol=1e-5)
    torch.testing.assert_close(went0, dec_factory().decode(z[0:1])[:, :, 5:], rtol=0, atol=1e-5)
    dec.reset()
    assert dec.state == (0, 0)
    dec.close()
    with pytest.raises(RuntimeError, match="closed"):
        dec.decode(z)
    dec.close()  # idempotent


def test_a_row_snapshot_moves_a_video_to_another_decoder(dec_factory):
    z = latents(5, F_=5, size=(h, w))
    whole = dec_factory().decode(z)
    a = dec_factory(sequences=2)
    assert a.snapshot(1) == {"frames": 0, "cache": [], "latent_size": None}
    head = chunked(a, z[:, :, :3], (2, 1), rows=[1])
    state = a.snapshot(1)
    assert state["frames"] == 3 and state["latent_size"] == (h, w) and len(state["cache"]) == 9
    kept = [t.clone() for t in state["cache"]]
    a.decode(z[:, :, 3:], [1])                       # the row goes on: the snapshot stays
    assert all(torch.equal(t, k) for t, k in zip(state["cache"], kept))
    b = dec_factory(sequences=3)
    b.decode(latents(6, B=3, F_=2, size=(h, w)))
    other = [t[0].clone() for t in b._cache.tensors]
    b.restore(2, state)
    assert b.state == (2, 2, 3)
    assert all(torch.equal(t[0], k) for t, k in zip(b._cache.tensors, other))
    tail = b.decode(z[:, :, 3:], [2])
    assert torch.equal(torch.cat([head, tail], 2), chunked(dec_factory(), z, (2, 1, 2)))
    torch.testing.assert_close(torch.cat([head, tail], 2), whole, rtol=0, atol=1e-5)
    fresh = dec_factory(sequences=1)                 # not decoded yet: sized by the state
    fresh.restore(0, state)
    assert torch.equal(fresh.decode(z[:, :, 3:]), tail)
    small = dec_factory()
    small.decode(latents(7, F_=1, size=(2, 3)))
    with pytest.raises(ValueError, match="another layout, dtype or latent size"):
        small.restore(0, state)
    assert small.state == (1,)
    b.restore(2, a.snapshot(0))                      # an empty video
    assert b.state == (2, 2, 0)


def _encoder_keys() -> dict[str, torch.Tensor]:
    """A TAEHV encoder's keys (random values): a full checkpoint holds them too."""
    g = torch.Generator().manual_seed(0)
    shapes = {"encoder.0.weight": (64, 3, 3, 3), "encoder.0.bias": (64,),
              "encoder.2.conv.weight": (64, 128, 1, 1), "encoder.3.weight": (64, 64, 3, 3),
              "encoder.17.weight": (16, 64, 3, 3), "encoder.17.bias": (16,)}
    for i in (4, 5, 6):
        for j in (0, 2, 4):
            shapes[f"encoder.{i}.conv.{j}.weight"] = (64, 128 if j == 0 else 64, 3, 3)
            shapes[f"encoder.{i}.conv.{j}.bias"] = (64,)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def test_loads_pth_and_safetensors_checkpoints(full_factory, tmp_path):
    from safetensors.torch import save_file

    src = full_factory()
    full = {**_encoder_keys(), **{k: v.clone() for k, v in src.net.taehv_state_dict().items()}}
    assert len(full) - len(_encoder_keys()) == 64     # the taew2_1 decoder's tensor count
    torch.save(full, tmp_path / "taew2_1.pth")
    save_file(full, str(tmp_path / "taew2_1.safetensors"))
    z = latents(8, F_=2, size=(h, w))
    want = src.decode(z)
    for name in ("taew2_1.pth", "taew2_1.safetensors"):
        dec = TinyStreamingDecoder.from_file(tmp_path / name, device="cpu", use_graphs=False)
        assert dec.dtype == torch.float32 and dec.latent_channels == 16 and not dec.use_graphs
        assert torch.equal(dec.decode(z), want), name
    half = TinyStreamingDecoder.from_file(tmp_path / "taew2_1.pth", dtype=torch.bfloat16)
    assert half.decode(z).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"nowhere\.pth.*not a local checkpoint file"):
        TinyStreamingDecoder.from_file(tmp_path / "nowhere.pth")
    (tmp_path / "taew2_1.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"\.pt, \.pth or \.safetensors.*taew2_1\.bin"):
        TinyStreamingDecoder.from_file(tmp_path / "taew2_1.bin")


def test_a_checkpoint_of_another_layout_is_refused_naming_its_keys(full_factory, tmp_path):
    good = {**_encoder_keys(), **full_factory().net.taehv_state_dict()}
    wide = dict(good, **{"decoder.7.conv.weight": torch.zeros(512, 256, 1, 1)})
    check_refused_layouts(TinyStreamingDecoder, good, (wide, (
        r"decoder.7.conv.weight has shape \[512, 256, 1, 1\], this layout's is "
        r"\[256, 256, 1, 1\]")), tmp_path)


def test_random_is_seeded_and_leaves_the_global_rng_alone():
    check_random_draws(TinyStreamingDecoder, latents(9, F_=1, size=(1, 1), C=4), widths=NARROW)


def test_the_graph_path_through_graphcaches_eager_stand_in(dec_factory):
    z = latents(10, B=2, F_=5, size=(h, w))
    dec = dec_factory()
    # first:2, steady:2, steady:1
    check_graph_path(dec, z, (2, 2, 1), dec_factory().decode(z), (h, w), 3, warmup_iters=1)
    check_refusals([(lambda: dec.capture(2, 1, (h, 0)), r"latent_size must be \(H, W\)"),
                    (lambda: dec.capture(3, 1, (h, w)),
                     r"batch must be an integer in \[1, 2\], got 3")])
    dec.close()
    assert dec.graph_count == 0 and dec.arena_bytes == 0


def test_bad_arguments(dec_factory):
    dec = dec_factory(sequences=2)
    z = latents(11, B=2, F_=1, size=(h, w))
    check_common_refusals(dec, z, dec.frames_decoded)
    check_refusals([
        (lambda: dec_factory(sequences=0), r"sequences must be None or an integer"),
        (lambda: dec_factory(use_graphs="yes"), r"use_graphs must be True or False"),
        (lambda: TinyStreamingDecoder(torch.nn.Linear(2, 2)), r"net must be a TinyDecoderNet"),
        (lambda: TinyStreamingDecoder.random(latent_channels=0), r"latent_channels must be"),
        (lambda: TinyDecoderNet(16, (8, 8)), r"widths must be 4 positive integers, got \(8, 8\)")])
    dec.decode(z)
    with pytest.raises(ValueError, match=r"latents must be \[3, 5\] \(H, W\).*got \[3, 6\]"):
        dec.decode(latents(13, B=2, F_=1, size=(3, 6)))
    dec.decode(z[:1], [0])
    dec.reset([1])
    with pytest.raises(ValueError, match=r"rows \[1\] start, rows \[0\] continue"):
        dec.decode(z, [0, 1])
    assert dec.state == (2, 0)


def test_it_has_the_vae_decoders_interface():
    for name in ("decode", "video_frames", "reset", "snapshot", "restore", "frames_decoded",
                 "capture", "close", "state", "arena_bytes", "graph_count"):
        assert hasattr(TinyStreamingDecoder, name) and hasattr(StreamingVAEDecoder, name), name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_chunks_equal_eager_bit_for_bit_on_cuda(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    z = latents(20, B=2, F_=7, size=(6, 10)).to("cuda")
    # first: 1, 2, 3 latent frames; steady: 1, 2, 3, 4
    check_tiny_on_cuda(TinyStreamingDecoder, dtype, z, [(1, 2, 4), (3, 3, 1), (2, 2, 2, 1)],
                       (2, 3, 25, 48, 80), 7, z[:, :, :2])
