"""`framekv.tools.video`: frames to uint8, H.264 MP4 files written chunk by chunk, and
single frames as JPEG / WebP, each read back (PyAV, Pillow) and compared with what went
in."""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")
Image = pytest.importorskip("PIL.Image")

from framekv.engine.serving import to_uint8  # noqa: E402
from framekv.tools.serve.wire import encode_image  # noqa: E402
from framekv.tools.video import MP4Writer  # noqa: E402


def smooth_frames(n: int, h: int, w: int, start: int = 0) -> np.ndarray:
    """uint8 [n, h, w, 3] gradients that move frame to frame (what a codec keeps well)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    out = [np.stack([(x * 4 + 7 * (start + i)) % 256, (y * 3 + 5 * (start + i)) % 256,
                     np.full_like(x, 40 + 10 * (start + i) % 200)], axis=-1)
           for i in range(n)]
    return np.stack(out).astype(np.uint8)


def read_video(path) -> tuple[np.ndarray, object]:
    """All frames of an MP4, uint8 [F, H, W, 3], and its video stream's average rate."""
    with av.open(str(path)) as c:
        rate = c.streams.video[0].average_rate
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]), rate


def mae(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).mean())


# ---------------------------------------------------------------- to_uint8
def test_to_uint8_rounds_clamps_and_moves_channels_last():
    values = torch.tensor([-3.0, -1.0, -0.5, 0.0, 0.25, 0.5, 1.0, 2.0])
    # The rule: round((x + 1) * 127.5), ties to even, clamped; computed here in float64.
    want = [min(255, max(0, round((v + 1) * 127.5))) for v in values.double().tolist()]
    assert want == [0, 0, 64, 128, 159, 191, 255, 255]
    frames = torch.stack([values, -values, torch.zeros(8)]).reshape(3, 1, 1, 8)  # [3, F, H, W]
    out = to_uint8(frames)
    assert out.dtype == torch.uint8 and out.shape == (1, 1, 8, 3) and out.device.type == "cpu"
    assert out[0, 0, :, 0].tolist() == want
    assert out[0, 0, :, 1].tolist() == [min(255, max(0, round((1 - v) * 127.5)))
                                        for v in values.double().tolist()]
    assert out[0, 0, :, 2].tolist() == [128] * 8


def test_to_uint8_keeps_the_batch_and_takes_bf16():
    x = (torch.rand(2, 3, 5, 6, 7) * 2 - 1).bfloat16()                   # [B, 3, F, H, W]
    out = to_uint8(x)
    assert out.shape == (2, 5, 6, 7, 3)
    ref = ((x.double() + 1) * 127.5).round().clamp(0, 255).permute(0, 2, 3, 4, 1)
    assert torch.equal(out, ref.to(torch.uint8))
    assert torch.equal(to_uint8(x[1]), out[1])


@pytest.mark.parametrize("frames, match", [
    (torch.zeros(4, 2, 3, 3), r"\[3, F, H, W\]"),
    (torch.zeros(1, 1, 3, 3, 3, 3), r"\[3, F, H, W\]"),
    (torch.zeros(3, 1, 2, 2, dtype=torch.uint8), "floating point"),
    (torch.full((3, 1, 2, 2), float("nan")), "finite"),
])
def test_to_uint8_refuses(frames, match):
    with pytest.raises(ValueError, match=match):
        to_uint8(frames)


# ---------------------------------------------------------------- MP4Writer
def test_mp4_writer_round_trip_in_chunks(tmp_path):
    path = tmp_path / "v.mp4"
    frames = smooth_frames(7, 34, 50)                                    # odd count, not /16
    with MP4Writer(path, fps=12, width=50, height=34) as w:
        w.write(frames[:3])
        w.write(torch.from_numpy(frames[3:]))
        assert not path.exists()                                         # renamed on close only
    assert w.frames == 7 and os.listdir(tmp_path) == ["v.mp4"]
    got, rate = read_video(path)
    assert got.shape == (7, 34, 50, 3) and rate == 12
    # Smooth gradients at crf 18: a few levels of 255 lost to yuv420p and the codec.
    assert max(mae(g, f) for g, f in zip(got, frames)) < 4
    assert mae(got[0], frames[6]) > 20                                   # the check can fail


@pytest.mark.parametrize("fps", [8, 16, 30])
def test_a_long_video_reads_back_frame_for_frame(tmp_path, fps):
    """157 frames (a 20-chunk tiny video), written in chunks as `generate` writes them:
    past the encoder's lookahead its packets come delayed, each stamped in the stream's
    time base, which the muxer sets once it writes the header."""
    path, frames = tmp_path / "v.mp4", smooth_frames(157, 32, 48)
    with MP4Writer(path, fps=fps, width=48, height=32) as w:
        for i in range(0, 157, 8):
            w.write(frames[i:i + 8])
    got, rate = read_video(path)
    assert got.shape == (157, 32, 48, 3) and rate == fps
    for i, g in enumerate(got):           # each frame in its place: nearest its own source
        own = mae(g, frames[i])
        assert all(own + 1 < mae(g, frames[j]) for j in (i - 1, i + 1) if 0 <= j < 157), i
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        assert stream.frames == 157
        assert float(stream.duration * stream.time_base) == pytest.approx(157 / fps, abs=1e-3)
        pts = [p.pts for p in c.demux(stream) if p.pts is not None]
    assert len(pts) == 157 and len(set(pts)) == 157                     # one stamp a frame


def test_mp4_writer_leaves_nothing_on_an_exception(tmp_path):
    path = tmp_path / "v.mp4"
    path.write_bytes(b"older video")
    with pytest.raises(RuntimeError, match="boom"):
        with MP4Writer(path, width=16, height=16) as w:
            w.write(smooth_frames(2, 16, 16))
            assert len(os.listdir(tmp_path)) == 2                         # the temp file
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["v.mp4"] and path.read_bytes() == b"older video"
    with pytest.raises(RuntimeError, match="closed"):
        w.write(smooth_frames(1, 16, 16))


def test_mp4_writer_without_frames_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="no frames were written"):
        with MP4Writer(tmp_path / "v.mp4", width=16, height=16):
            pass
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(width=15, height=16), "even"),
    (dict(width=16, height=9), "even"),
    (dict(width=0, height=16), "width must be an integer >= 1"),
    (dict(width=16, height=16, fps=0), "fps must be an integer >= 1"),
    (dict(width=16, height=16, crf=52), r"crf must be an integer in \[0, 51\]"),
])
def test_mp4_writer_refuses_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        MP4Writer(tmp_path / "v.mp4", **kwargs)
    assert os.listdir(tmp_path) == []


def test_mp4_writer_refuses_paths_and_frames(tmp_path):
    with pytest.raises(ValueError, match=r"ending in \.mp4"):
        MP4Writer(tmp_path / "v.avi", width=16, height=16)
    with pytest.raises(ValueError, match="does not exist"):
        MP4Writer(tmp_path / "nope" / "v.mp4", width=16, height=16)
    with MP4Writer(tmp_path / "v.mp4", width=16, height=16) as w:
        with pytest.raises(ValueError, match=r"\[F, 16, 16, 3\]"):
            w.write(smooth_frames(1, 16, 18))
        with pytest.raises(ValueError, match="uint8"):
            w.write(smooth_frames(1, 16, 16).astype(np.float32))
        w.write(smooth_frames(1, 16, 16))
    assert read_video(tmp_path / "v.mp4")[0].shape == (1, 16, 16, 3)


# ---------------------------------------------------------------- encode_image
@pytest.mark.parametrize("fmt, name", [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_encode_image_round_trips(fmt, name):
    frame = smooth_frames(1, 37, 29)[0]                                  # odd sizes
    data = encode_image(torch.from_numpy(frame), fmt, quality=90)
    img = Image.open(io.BytesIO(data))
    assert img.format == name and img.size == (29, 37)
    back = np.asarray(img.convert("RGB"))
    assert mae(back, frame) < 4 and mae(back, smooth_frames(1, 37, 29, start=9)[0]) > 20
    low = encode_image(frame, fmt, quality=5)
    assert len(low) < len(data) and mae(np.asarray(Image.open(io.BytesIO(low)).convert("RGB")),
                                        frame) > mae(back, frame)


@pytest.mark.parametrize("args, match", [
    ((np.zeros((4, 4, 3), np.uint8), "png"), "fmt must be one of"),
    ((np.zeros((4, 4, 3), np.uint8), "jpeg", 0), r"quality must be an integer in \[1, 100\]"),
    ((np.zeros((4, 4, 4), np.uint8),), r"uint8 \[H, W, 3\]"),
    ((np.zeros((4, 4, 3), np.float32),), r"uint8 \[H, W, 3\]"),
])
def test_encode_image_refuses(args, match):
    with pytest.raises(ValueError, match=match):
        encode_image(*args)
