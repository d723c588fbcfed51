"""`framekv.tools.video_in`: a video file read as a model's input chunks. Frames are
stamped (each a flat gray of its own level) so an order or grouping mix-up fails; the
fit is checked against its definition; every refusal names the file."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("av")

from framekv.tools.video import MP4Writer  # noqa: E402
from framekv.tools.video_in import VideoInput, chunk_frames, fit_frame, whole_chunks  # noqa: E402


def level(i: int) -> int:
    return 16 + (i * 37) % 224


def stamped_video(path, frames: int, size=(48, 64), fps: int = 16) -> str:
    """A lossless MP4 of ``frames`` flat gray frames, frame i at `level` (i)."""
    h, w = size
    with MP4Writer(path, fps=fps, width=w, height=h, crf=0) as out:
        out.write(np.stack([np.full((h, w, 3), level(i), np.uint8) for i in range(frames)]))
    return str(path)


@pytest.mark.parametrize("frames, F_, whole", [(0, 3, 0), (8, 3, 0), (9, 3, 1), (20, 3, 1),
                                               (21, 3, 2), (33, 3, 3), (1, 1, 1), (5, 1, 2)])
def test_whole_chunks_count_the_first_chunk_apart(frames, F_, whole):
    assert whole_chunks(frames, F_) == whole
    assert chunk_frames(0, F_) == 1 + 4 * (F_ - 1) and chunk_frames(5, F_) == 4 * F_


def test_chunks_come_in_order_grouped_as_the_encoders_count(tmp_path):
    path = stamped_video(tmp_path / "in.mp4", 5 + 8 + 8 + 3)       # 2 latent frames a chunk
    v = VideoInput(path, size=(32, 32), latent_frames=2)
    assert (v.frames, v.chunks, v.fps) == (24, 3, 16.0)
    got = list(v.read())
    assert [c.shape for c in got] == [(3, 5, 32, 32), (3, 8, 32, 32), (3, 8, 32, 32)]
    seen = torch.cat(got, dim=1).mean(dim=(0, 2, 3))                # one level a frame
    want = torch.tensor([level(i) / 255 * 2 - 1 for i in range(21)])
    assert torch.allclose(seen, want, atol=2 / 255)                 # lossless, yuv rounding
    assert [c.shape[1] for c in v.read(chunks=2)] == [5, 8]


def test_a_frame_is_resized_to_cover_then_center_cropped():
    rgb = torch.zeros(40, 80, 3, dtype=torch.uint8)                 # 1:2, target 1:1
    rgb[:, 20:60] = 200                                             # the middle half: gray
    out = fit_frame(rgb, (20, 20))                                  # [3, 20, 20]
    assert out.shape == (3, 20, 20)
    inner = out[:, :, 2:-2]                                         # its edges: antialiasing
    assert torch.allclose(inner, torch.full_like(inner, 200 / 255 * 2 - 1), atol=1e-5)
    assert float(out[:, :, 0].mean()) > -0.5                        # no black half kept
    wide = fit_frame(torch.arange(48 * 64 * 3).reshape(48, 64, 3).remainder(251).to(torch.uint8),
                     (24, 24))
    ref = F.interpolate(torch.arange(48 * 64 * 3).reshape(48, 64, 3).remainder(251).permute(
        2, 0, 1)[None].float(), size=(24, 32), mode="bilinear", antialias=True)[0, :, :, 4:28]
    assert torch.allclose(wide, ref.clamp(0, 255) / 255 * 2 - 1, atol=1e-6)


def test_a_missing_file_a_non_video_and_too_few_frames_are_named(tmp_path):
    with pytest.raises(ValueError, match="video-in must be a video file, got .*nope.mp4.*no such"):
        VideoInput(tmp_path / "nope.mp4", size=(32, 32), latent_frames=3)
    text = tmp_path / "notes.mp4"
    text.write_text("not a video at all\n" * 50)
    with pytest.raises(ValueError, match="notes.mp4' cannot be read as a video"):
        VideoInput(text, size=(32, 32), latent_frames=3)
    short = stamped_video(tmp_path / "short.mp4", 8)
    with pytest.raises(ValueError, match="short.mp4' holds 8 frames; one chunk needs 9"):
        VideoInput(short, size=(32, 32), latent_frames=3)
