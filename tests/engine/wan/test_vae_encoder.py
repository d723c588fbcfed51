"""`StreamingVAEEncoder` on the CPU (fp32): a video encoded in chunks, cut every way
there is, equals diffusers' whole-video encode as WanVideoToVideoPipeline normalises it,
through diffusers' modules (``fused=False``) and the fused program; frame counts;
sequences encoded together, apart, or by row subsets equal each encoded alone (each
row's frames stamped apart, so a mix-up shows); reset, snapshot and restore move rows;
the arguments that must fail do, changing nothing. The graph path's plumbing runs
through `GraphCache`'s eager stand-in. The fused program's own tests are
test_vae_encoder_fused.py."""
from __future__ import annotations

import pytest
import torch

from coder_harness import (check_common_refusals, check_graph_path, check_refusals,
                           check_reset, check_row_subsets, chunked, wan22_vae)
from framekv.engine.wan import StreamingVAEEncoder
from test_vae import vae  # noqa: F401  (the fixture: the tiny config's VAE)

H, W = 16, 24   # frame size: latents 2 x 3, not square


def cuts(groups: int) -> list[tuple[int, ...]]:
    """Every way to cut a video of 1 + 4 groups frames into chunks: a first chunk of
    1 + 4a frames, then chunks of 4b (b >= 1)."""
    def rest(n):
        return [()] if n == 0 else [(4 * b, *r) for b in range(1, n + 1) for r in rest(n - b)]
    return [(1 + 4 * a, *r) for a in range(groups + 1) for r in rest(groups - a)]


def frames(seed: int, B: int = 1, F: int = 17, size=(H, W), stamp: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(B, 3, F, *size, generator=g) * 2 - 1) * 0.8 + stamp  # [B, 3, F, H, W]


@torch.no_grad()
def whole(vae, x: torch.Tensor) -> torch.Tensor:
    """The reference: diffusers' whole-video encode, normalised as the v2v pipeline does."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (vae.encode(x).latent_dist.mode() - mean) * inv_std


@pytest.fixture(scope="module")
def video(vae):
    x = frames(1, B=2)
    return x, whole(vae, x)


def test_cuts_are_every_way_to_cut():
    assert cuts(1) == [(1, 4), (5,)]
    assert len(cuts(3)) == 8 and len(cuts(4)) == 16 and len(set(cuts(4))) == 16
    assert all(sum(c) == 17 and c[0] % 4 == 1 and all(f % 4 == 0 for f in c[1:]) for c in cuts(4))


@pytest.mark.parametrize("fused", [False, True])
def test_every_cut_equals_the_whole_video_encode(vae, video, fused):
    x, ref = video
    assert ref.shape == (2, 4, 5, H // 8, W // 8)
    for cut in cuts(4):
        enc = StreamingVAEEncoder(vae, fused=fused)
        got = chunked(enc, x, cut)
        assert got.shape == ref.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5, msg=f"cut {cut}")
        assert enc.state == (17, 17) and enc.frames_encoded(1) == 17
    assert ref.std() > 0.1


def test_the_modules_give_the_v2v_pipelines_latents_exactly(vae):
    """(mean - latents_mean) * (1 / latents_std), in the vae's dtype, as
    WanVideoToVideoPipeline builds them: bit for bit through diffusers' modules."""
    x = frames(2, F=9)
    with torch.no_grad():
        mean = vae.encode(x).latent_dist.mode()
    got = StreamingVAEEncoder(vae, fused=False).encode(x)
    assert torch.equal(got, whole(vae, x))
    assert (got - mean).abs().max() > 1e-2                  # the normalisation is not a no-op


def test_frame_counts_and_their_helpers(vae):
    enc = StreamingVAEEncoder(vae)
    for f, first, want in ((1, True, 1), (4, False, 1), (12, False, 3), (5, True, 2)):
        if first:
            enc.reset()
        out = enc.encode(frames(3, F=f))
        assert out.shape == (1, 4, want, H // 8, W // 8), (f, first)
        assert enc.latent_frames(f, first) == want and enc.video_frames(want, first) == f
    assert enc.state == (5,)
    for f, first in ((0, True), (2, True), (4, True), (0, False), (1, False), (6, False)):
        with pytest.raises(ValueError, match=f"frames must be .*got {f}"):
            enc.latent_frames(f, first)


def test_sequences_in_one_batch_equal_each_alone(vae):
    x = torch.cat([frames(10 + s, F=13, stamp=0.1 * s) for s in range(3)])   # [3, 3, 13, H, W]
    together = chunked(StreamingVAEEncoder(vae), x, (5, 8))
    for s in range(3):
        alone = chunked(StreamingVAEEncoder(vae), x[s:s + 1], (5, 8))
        torch.testing.assert_close(together[s:s + 1], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_row_subsets_touch_only_their_rows(vae, fused):
    x = [frames(20 + s, F=13, stamp=0.15 * s) for s in range(3)]   # sequence s: its own frames
    solo = [whole(vae, x[s]) for s in range(3)]
    enc = StreamingVAEEncoder(vae, sequences=3, fused=fused)
    check_row_subsets(enc, x, solo, [([1, 2, 0], 0, 5), ([2, 0], 5, 4), ([1], 5, 4),
                                     ([0, 1, 2], 9, 4)])
    # Row 1 starts a new video; rows 0 and 2 are untouched by it.
    enc.reset([1])
    assert enc.state == (13, 0, 13)
    new = frames(30, F=5)
    torch.testing.assert_close(enc.encode(new, [1]), whole(vae, new), rtol=0, atol=1e-5)


def test_reset_reproduces_a_fresh_encoder(vae):
    enc = StreamingVAEEncoder(vae)
    check_reset(enc, StreamingVAEEncoder(vae), frames(7, F=9), (5, 4), frames(8, F=9), (1, 8))
    assert enc.arena_bytes == 0 and enc.graph_count == 0


@pytest.mark.parametrize("fused", [False, True])
def test_a_row_snapshot_moves_a_video_to_another_encoder(vae, fused):
    """A video's encoder row leaves (`snapshot`) and goes on in another encoder's other
    row (`restore`): its latents equal the uninterrupted encode; the restore touches no
    other row; a state of another frame size is refused."""
    x = frames(40, F=13)
    uninterrupted = chunked(StreamingVAEEncoder(vae, fused=fused), x, (5, 4, 4))
    a = StreamingVAEEncoder(vae, sequences=2, fused=fused)
    assert a.snapshot(1) == {"frames": 0, "cache": [], "frame_size": None}
    head = chunked(a, x[:, :, :9], (5, 4), rows=[1])
    state = a.snapshot(1)
    assert state["frames"] == 9 and state["frame_size"] == (H, W)
    assert len(state["cache"]) == len(a._cache.tensors)
    assert any(t.shape[1] == 1 for t in state["cache"])      # the time downsamples' one step
    kept = [t.clone() for t in state["cache"]]
    a.encode(x[:, :, 9:], [1])                                # the row goes on: the copy stays
    assert all(torch.equal(t, k) for t, k in zip(state["cache"], kept))
    b = StreamingVAEEncoder(vae, sequences=3, fused=fused)
    b.encode(frames(41, B=3, F=5, stamp=0.2), [0, 1, 2])
    other = [t[0].clone() for t in b._cache.tensors]
    b.restore(2, state)
    assert b.state == (5, 5, 9)
    assert all(torch.equal(t[0], k) for t, k in zip(b._cache.tensors, other))
    tail = b.encode(x[:, :, 9:], [2])
    assert torch.equal(torch.cat([head, tail], 2), uninterrupted)
    fresh = StreamingVAEEncoder(vae, sequences=1, fused=fused)   # not run yet: sized by it
    fresh.restore(0, state)
    assert torch.equal(fresh.encode(x[:, :, 9:]), tail)
    small = StreamingVAEEncoder(vae, sequences=1, fused=fused)
    small.encode(frames(42, F=1, size=(8, 16)))
    with pytest.raises(ValueError, match="another vae or frame size"):
        small.restore(0, state)
    assert small.state == (1,)
    b.restore(2, a.snapshot(0))                               # row 0 never ran: an empty video
    assert b.state == (5, 5, 0)


def test_the_graph_path_through_graphcaches_eager_stand_in(vae, video):
    x, ref = video
    enc = StreamingVAEEncoder(vae)
    # first: 5 frames (captured), steady: 8 (captured), steady: 4
    check_graph_path(enc, x, (5, 8, 4), ref, (H, W), graphs=3)
    check_refusals([
        (lambda: enc.capture(2, 1, (H, 0)), r"frame_size must be \(H, W\) positive integers"),
        (lambda: enc.capture(2, 1, (12, W)), r"frame_size must be multiples of 8, got \(12, 24\)"),
        (lambda: enc.capture(3, 1, (H, W)), r"batch must be an integer in \[1, 2\], got 3")])


def test_bad_arguments_change_nothing(vae):
    enc = StreamingVAEEncoder(vae, sequences=2)
    x = frames(60, B=2, F=5)
    check_common_refusals(enc, x, enc.frames_encoded)
    check_refusals([
        (lambda: enc.encode(x[..., :12, :]), r"H and W multiples of 8.*got \[12, 24\]"),
        (lambda: enc.encode(x[..., :20]), r"H and W multiples of 8.*got \[16, 20\]"),
        (lambda: enc.encode(x[:, :, :4]), r"frames must be 1 \+ 4k frames.*start a video, got 4"),
        (lambda: enc.encode(x[:, :, :2]), r"1 \+ 4k frames.*got 2"),
        (lambda: StreamingVAEEncoder(vae, sequences=0), r"sequences must be None or an integer"),
        (lambda: StreamingVAEEncoder(torch.nn.Linear(2, 2)),
         r"vae must be a diffusers AutoencoderKLWan, got Linear")])
    assert enc.state == (0, 0) and enc.arena_bytes == 0     # no arena for a refused call
    enc.encode(x)
    check_refusals([
        (lambda: enc.encode(x), r"4k frames \(k >= 1\) for rows that continue one, got 5"),
        (lambda: enc.encode(x[:, :, :0]), r"sizes >= 1"),
        (lambda: enc.encode(frames(62, B=2, F=4, size=(8, 8))),
         r"frames must be \[16, 24\] \(H, W\)")])
    enc.reset([1])
    with pytest.raises(ValueError, match=r"rows \[1\] start, rows \[0\] continue"):
        enc.encode(x[:, :, :4], [0, 1])
    assert enc.state == (5, 0)


def test_wan22_vaes_are_refused():
    with pytest.raises(ValueError, match="vae must be a Wan 2.1 VAE.*patch_size=2"):
        StreamingVAEEncoder(wan22_vae())


def test_it_has_the_decoders_row_interface():
    from framekv.engine.wan import StreamingVAEDecoder, TinyStreamingEncoder

    for name in ("reset", "snapshot", "restore", "capture", "close", "state", "arena_bytes",
                 "graph_count", "video_frames"):
        assert hasattr(StreamingVAEDecoder, name), name
        assert hasattr(StreamingVAEEncoder, name) and hasattr(TinyStreamingEncoder, name), name
    for name in ("encode", "frames_encoded", "latent_frames"):
        assert hasattr(StreamingVAEEncoder, name) and hasattr(TinyStreamingEncoder, name), name
