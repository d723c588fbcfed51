"""`TinyStreamingEncoder` (fp32 on the CPU unless marked gpu): a video encoded in chunks,
cut every way there is, equals its encode in one call; the network is the TAEHV
encoder's layout (checked against a plain functional encode over the checkpoint's own
key names, the first frame filling its group of 4); frame counts are the Wan VAE
encoder's; rows at different points of their videos batch together; reset, snapshot
and restore move rows; checkpoints load (.pth, .safetensors, the decoder's half beside)
and another layout is refused naming its keys both ways; bad arguments fail. Random
weights throughout."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coder_harness import (check_common_refusals, check_graph_path, check_random_draws,
                           check_refusals, check_refused_layouts,
                           check_rows_at_different_points, check_tiny_on_cuda, chunked,
                           taehv_memory_block, tiny_factory)
from framekv.engine.wan import StreamingVAEEncoder, TinyStreamingDecoder, TinyStreamingEncoder
from framekv.engine.wan.tiny_encoder import TinyEncoderNet
from test_vae_encoder import cuts, frames

H, W = 16, 24   # frame size: latents 2 x 3
NARROW = 8      # the layout's structure at an eighth of its width


@pytest.fixture(scope="module")
def enc_factory():
    """Fresh encoders over one set of random weights."""
    return tiny_factory(TinyStreamingEncoder, NARROW)


@pytest.fixture(scope="module")
def video(enc_factory):
    x = frames(1, B=2)                                   # [2, 3, 17, H, W]
    return x, enc_factory().encode(x)


def test_every_cut_equals_the_whole_video_encode(enc_factory, video):
    x, whole = video
    assert whole.shape == (2, 16, 5, H // 8, W // 8) and whole.std() > 0.01
    for cut in cuts(4):
        enc = enc_factory()
        torch.testing.assert_close(chunked(enc, x, cut), whole, rtol=0, atol=1e-5,
                                   msg=f"cut {cut}")
        assert enc.state == (17, 17) and enc.frames_encoded(0) == 17


def _taehv_reference(sd: dict, x: torch.Tensor) -> torch.Tensor:
    """A whole video through the TAEHV encoder, written over the checkpoint's key names
    in its own order: x [B, 3, T, H, W] in [0, 1] (T a multiple of 4) -> [B, C, T / 4,
    H / 8, W / 8]."""
    def conv(h, i, stride=1):
        return F.conv2d(h, sd[f"encoder.{i}.weight"], sd.get(f"encoder.{i}.bias"), padding=1,
                        stride=stride)

    B, T = x.shape[0], x.shape[2]
    h = F.relu(conv(x.transpose(1, 2).flatten(0, 1), 0))          # [B T, C, H, W]
    for base, k in ((2, 2), (7, 2), (12, 1)):
        h = F.conv2d(h.reshape(-1, k * h.shape[1], *h.shape[2:]), sd[f"encoder.{base}.conv.weight"])
        T //= k
        h = conv(h, base + 1, stride=2)
        for i in range(base + 2, base + 5):
            h = taehv_memory_block(sd, f"encoder.{i}", h, B, T)
    return conv(h, 17).unflatten(0, (B, T)).transpose(1, 2)


@pytest.mark.parametrize("width", [NARROW, 64])
def test_the_network_is_the_taehv_layouts_and_the_first_frame_fills_its_group(width):
    enc = tiny_factory(TinyStreamingEncoder, width)()
    x = frames(2, B=2, F=9)                               # [-1, 1]
    grouped = torch.cat([x[:, :, :1].expand(-1, -1, 4, -1, -1), x[:, :, 1:]], 2)
    ref = _taehv_reference(enc.net.taehv_state_dict(), (grouped + 1) / 2)
    got = enc.encode(x)
    assert got.shape == ref.shape == (2, 16, 3, H // 8, W // 8)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    lone = tiny_factory(TinyStreamingEncoder, width)().encode(x[:, :, :1])   # its own group
    torch.testing.assert_close(lone, ref[:, :, :1], rtol=0, atol=1e-5)


def test_frame_counts_are_the_wan_encoders(enc_factory):
    enc = enc_factory()
    for f, first in ((1, True), (4, False), (8, False)):
        out = enc.encode(frames(3, F=f, size=(8, 16)))
        want = StreamingVAEEncoder.latent_frames(f, first)
        assert enc.latent_frames(f, first) == want and out.shape == (1, 16, want, 1, 2)
    with pytest.raises(ValueError, match=r"4k frames \(k >= 1\) for rows that continue one, got 5"):
        enc.encode(frames(4, F=5, size=(8, 16)))
    assert enc.state == (13,)


def test_rows_at_different_points_of_their_videos_in_one_batch(enc_factory, video):
    """Row 0 has encoded 5 frames of its video, row 1 9 of another: their next chunks,
    encoded together, equal each video's whole encode; what a row encoded before matters."""
    x, whole = video
    both = check_rows_at_different_points(enc_factory, x, whole, (5, 13), (9, 17))
    fresh = enc_factory().encode(torch.cat([x[1:2, :, 8:9], x[1:2, :, 9:17]], 2))
    assert (fresh[:, :, 1:] - both[1:2]).abs().max() > 1e-3   # the past is not zeros


def test_reset_snapshot_and_restore_move_rows(enc_factory):
    x = frames(5, F=13)
    whole = enc_factory().encode(x)
    a = enc_factory(sequences=2)
    assert a.snapshot(1) == {"frames": 0, "cache": [], "frame_size": None}
    head = a.encode(x[:, :, :5], [1])
    state = a.snapshot(1)
    assert state["frames"] == 5 and state["frame_size"] == (H, W) and len(state["cache"]) == 9
    b = enc_factory(sequences=3)
    b.encode(frames(6, B=3, F=9, stamp=0.1))
    other = [t[0].clone() for t in b._cache.tensors]
    b.restore(2, state)
    assert b.state == (9, 9, 5)
    assert all(torch.equal(t[0], k) for t, k in zip(b._cache.tensors, other))
    tail = b.encode(x[:, :, 5:], [2])
    torch.testing.assert_close(torch.cat([head, tail], 2), whole, rtol=0, atol=1e-5)
    small = enc_factory()
    small.encode(frames(7, F=1, size=(8, 8)))
    with pytest.raises(ValueError, match="another layout, dtype or frame size"):
        small.restore(0, state)
    assert small.state == (1,)
    b.reset([2])
    assert b.state == (9, 9, 0)
    torch.testing.assert_close(b.encode(x[:, :, :5], [2]), head, rtol=0, atol=1e-5)
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.encode(x[:, :, :5])


def _checkpoint(width: int = 64, channels: int = 16) -> tuple[dict, TinyStreamingEncoder]:
    """A full TAEHV state dict (both halves, random) and the encoder of its encoder half."""
    enc = TinyStreamingEncoder.random(seed=5, latent_channels=channels, width=width)
    dec = TinyStreamingDecoder.random(seed=6, latent_channels=channels)
    return {**dec.net.taehv_state_dict(), **enc.net.taehv_state_dict()}, enc


def test_loads_pth_and_safetensors_checkpoints_beside_the_decoder(tmp_path):
    from safetensors.torch import save_file

    full, src = _checkpoint()
    assert len(src.net.taehv_state_dict()) == 64      # the taew2_1 encoder's tensor count
    torch.save(full, tmp_path / "taew2_1.pth")
    save_file({k: v.contiguous() for k, v in full.items()}, str(tmp_path / "taew2_1.safetensors"))
    x = frames(8, F=5)
    want = src.encode(x)
    for name in ("taew2_1.pth", "taew2_1.safetensors"):
        enc = TinyStreamingEncoder.from_file(tmp_path / name, device="cpu", use_graphs=False)
        assert enc.dtype == torch.float32 and enc.latent_channels == 16 and not enc.use_graphs
        assert torch.equal(enc.encode(x), want), name
        TinyStreamingDecoder.from_file(tmp_path / name)   # the other half of the same file
    half = TinyStreamingEncoder.from_file(tmp_path / "taew2_1.pth", dtype=torch.bfloat16)
    assert half.encode(x).dtype == torch.bfloat16
    four, src4 = _checkpoint(channels=4)
    torch.save({k: v for k, v in four.items() if k.startswith("encoder.")}, tmp_path / "c4.pth")
    enc4 = TinyStreamingEncoder.from_file(tmp_path / "c4.pth")   # channels read from the file
    assert enc4.latent_channels == 4 and torch.equal(enc4.encode(x), src4.encode(x))
    with pytest.raises(ValueError, match=r"nowhere\.pth.*not a local checkpoint file"):
        TinyStreamingEncoder.from_file(tmp_path / "nowhere.pth")


def test_a_checkpoint_of_another_layout_is_refused_naming_its_keys_both_ways(tmp_path):
    good, _ = _checkpoint()
    wide = dict(good, **{"encoder.7.conv.weight": torch.zeros(64, 64, 1, 1)})
    check_refused_layouts(TinyStreamingEncoder, good, (wide, (
        r"encoder.7.conv.weight has shape \[64, 64, 1, 1\], this layout's is "
        r"\[64, 128, 1, 1\]")), tmp_path)


def test_random_is_seeded_and_leaves_the_global_rng_alone():
    check_random_draws(TinyStreamingEncoder, frames(9, F=1, size=(8, 8)), width=NARROW)


def test_the_graph_path_through_graphcaches_eager_stand_in(enc_factory, video):
    x, whole = video
    enc = enc_factory()
    # first: 5 frames, steady: 8, steady: 4
    check_graph_path(enc, x, (5, 8, 4), whole, (H, W), 3, warmup_iters=1)
    enc.close()
    assert enc.graph_count == 0 and enc.arena_bytes == 0


def test_bad_arguments(enc_factory):
    enc = enc_factory(sequences=2)
    x = frames(11, B=2, F=5, size=(8, 8))
    check_common_refusals(enc, x, enc.frames_encoded)
    check_refusals([
        (lambda: enc.encode(frames(12, B=2, F=5, size=(8, 12))), r"multiples of 8.*\[8, 12\]"),
        (lambda: enc.encode(x[:, :, :3]), r"1 \+ 4k frames.*got 3"),
        (lambda: enc_factory(use_graphs="yes"), r"use_graphs must be True or False"),
        (lambda: TinyStreamingEncoder(torch.nn.Linear(2, 2)), r"net must be a TinyEncoderNet"),
        (lambda: TinyStreamingEncoder.random(latent_channels=0), r"latent_channels must be"),
        (lambda: TinyEncoderNet(16, 0), r"width must be a positive integer, got 0")])
    enc.encode(x)
    enc.reset([1])
    with pytest.raises(ValueError, match=r"rows \[1\] start, rows \[0\] continue"):
        enc.encode(x[:, :, :4], [0, 1])
    assert enc.state == (5, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_chunks_equal_eager_bit_for_bit_on_cuda(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    x = frames(20, B=2, F=25, size=(48, 80)).to("cuda")
    # first: 1, 13, 5 frames; steady: 12, 4, 8
    check_tiny_on_cuda(TinyStreamingEncoder, dtype, x, [(1, 12, 12), (13, 4, 8), (5, 8, 12)],
                       (2, 16, 7, 6, 10), 6, x[:, :, :4])
