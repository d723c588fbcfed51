"""A video file in, as a model's input chunks: `VideoInput` (PyAV).

A video-to-video run reads its input with PyAV and shapes every frame to the model's
video size (H, W): the frame is resized, its aspect kept, until it covers H x W (the
side that is short for the target fits exactly, the other overhangs), bilinear with
antialiasing, then center-cropped to H x W; pixels map to [-1, 1] as (v / 255) * 2 - 1.

Chunks follow the streaming encoders' counts for chunks of F latent frames: the first
takes 1 + 4 (F - 1) video frames, each later one 4 F (a video of n frames holds
``whole_chunks(n, F)`` whole chunks; what is left over is not read). Frames are decoded
as they are read, so memory holds one chunk, however long the video.

PyAV is imported when first used (the ``video`` extra). A file that is missing, is no
video, or holds too few frames for one chunk is a ValueError naming it, raised by
`VideoInput` before anything else is read.
"""
from __future__ import annotations

import os

__all__ = ["VideoInput", "chunk_frames", "fit_frame", "whole_chunks"]


def chunk_frames(index: int, latent_frames: int) -> int:
    """Video frames of chunk ``index`` of ``latent_frames`` latent frames: 1 + 4 (F - 1)
    for the first, 4 F after."""
    return 1 + 4 * (latent_frames - 1) if index == 0 else 4 * latent_frames


def whole_chunks(frames: int, latent_frames: int) -> int:
    """Whole chunks of ``latent_frames`` a video of ``frames`` frames holds."""
    first = chunk_frames(0, latent_frames)
    return 0 if frames < first else 1 + (frames - first) // chunk_frames(1, latent_frames)


def fit_frame(rgb, size: tuple[int, int]):
    """uint8 [h, w, 3] -> fp32 [3, H, W] in [-1, 1] of ``size`` (H, W): resized to cover,
    aspect kept, then center-cropped (module doc). Tensors in and out (torch is imported
    on use: the command line's parsers import this module)."""
    import torch.nn.functional as F

    H, W = size
    h, w = rgb.shape[:2]
    scale = max(H / h, W / w)
    rh, rw = max(H, round(h * scale)), max(W, round(w * scale))
    x = rgb.permute(2, 0, 1)[None].float()                                # [1, 3, h, w]
    if (rh, rw) != (h, w):
        x = F.interpolate(x, size=(rh, rw), mode="bilinear", antialias=True,
                          align_corners=False)
    top, left = (rh - H) // 2, (rw - W) // 2
    x = x[0, :, top:top + H, left:left + W]                                # [3, H, W]
    return (x.clamp(0, 255) / 255) * 2 - 1


class VideoInput:
    """The frames of the video file ``path`` as chunks of ``latent_frames`` latent
    frames at the video size ``size`` (H, W) (module doc).

    Attributes:
        path, size, latent_frames; frames: the file's video frames (counted by decoding
        when the container does not say); fps: its average frame rate (or None);
        chunks: the whole chunks it holds.
    """

    def __init__(self, path, *, size: tuple[int, int], latent_frames: int):
        self.path = os.fspath(path)
        self.size, self.latent_frames = tuple(size), latent_frames
        if not os.path.isfile(self.path):
            raise ValueError(f"video-in must be a video file, got {self.path!r} (no such file)")
        self.frames, self.fps = self._probe()
        self.chunks = whole_chunks(self.frames, latent_frames)
        if self.chunks == 0:
            raise ValueError(f"video-in {self.path!r} holds {self.frames} frames; one chunk "
                             f"needs {chunk_frames(0, latent_frames)}")

    def _open(self):
        import av

        try:
            container = av.open(self.path)
        except (av.error.FFmpegError, OSError, ValueError) as exc:
            raise ValueError(f"video-in {self.path!r} cannot be read as a video: "
                             f"{' '.join(str(exc).split())}") from None
        if not container.streams.video:
            container.close()
            raise ValueError(f"video-in {self.path!r} holds no video stream")
        return container

    def _probe(self) -> tuple[int, float | None]:
        """(frames, fps): the stream's own count, else the frames decoded."""
        import av

        with self._open() as c:
            s = c.streams.video[0]
            fps = float(s.average_rate) if s.average_rate else None
            if s.frames:
                return int(s.frames), fps
            try:
                return sum(1 for _ in c.decode(s)), fps
            except av.error.FFmpegError as exc:
                raise ValueError(f"video-in {self.path!r} cannot be decoded: "
                                 f"{' '.join(str(exc).split())}") from None

    def read(self, chunks: int | None = None):
        """Yield the first ``chunks`` whole chunks (None: all), each fp32 [3, F', H, W]
        in [-1, 1] (F' = `chunk_frames`), decoded as they are read."""
        import av
        import torch

        count = self.chunks if chunks is None else min(chunks, self.chunks)
        index, held = 0, []
        with self._open() as c:
            try:
                for frame in c.decode(c.streams.video[0]):
                    if index >= count:
                        return
                    rgb = torch.from_numpy(frame.to_ndarray(format="rgb24"))
                    held.append(fit_frame(rgb, self.size))
                    if len(held) == chunk_frames(index, self.latent_frames):
                        yield torch.stack(held, dim=1)                  # [3, F', H, W]
                        index, held = index + 1, []
            except av.error.FFmpegError as exc:
                raise ValueError(f"video-in {self.path!r} cannot be decoded past chunk "
                                 f"{index}: {' '.join(str(exc).split())}") from None
        if index < count:
            raise ValueError(f"video-in {self.path!r} ended after {index} of {count} chunks")
