"""Frames to bytes: H.264 MP4 files written chunk by chunk, single frames as JPEG or
WebP (their uint8 pixels: `framekv.engine.decode_lane.to_uint8`).

- `MP4Writer`: an H.264 (libx264, yuv420p) MP4 written as frames arrive. The file is
  built under a temporary name in the destination's folder and renamed onto the path
  only by a clean close, so a reader never sees a half-written video and a failure
  leaves nothing at the path. yuv420p stores chroma at half resolution, so width and
  height must be even: an odd size is a ValueError (no silent padding: the video has
  exactly the frames' size).
- `encode_image`: one frame as JPEG or WebP bytes (Pillow).

PyAV and Pillow are imported when first used (the ``video`` extra).
"""
from __future__ import annotations

import io
import os
import secrets
import weakref
from fractions import Fraction

from .args import creation_refused

#: x264's constant rate factor by default: 0 is lossless, 51 the worst; 18 is close to
#: visually lossless.
DEFAULT_CRF = 18
IMAGE_FORMATS = {"jpeg": "JPEG", "webp": "WEBP"}


def check_mp4_path(path) -> str:
    """The absolute path of an MP4 this process may write: it ends in ``.mp4``, its
    folder exists and takes new files, it is not a folder. ValueError saying which
    fails."""
    text = os.fspath(path)
    full = os.path.abspath(text)
    folder = os.path.dirname(full)
    if not text.lower().endswith(".mp4"):
        raise ValueError(f"out must be a file ending in .mp4, got {text!r}")
    if os.path.isdir(full):
        raise ValueError(f"out must be a file path, got the folder {text!r}")
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write {text!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write {text!r}: folder {folder!r} is not writable")
    refusal = creation_refused(folder)       # the video is made there under a temporary name
    if refusal is not None:
        raise ValueError(f"cannot write {text!r}: {refusal}")
    return full


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class MP4Writer:
    """An H.264 MP4 written chunk by chunk (module doc); a context manager.

    Args:
        path: the ``.mp4`` to write (its folder must exist and be writable; an existing
            file is replaced only by a clean close).
        fps: frames per second (an integer).
        width, height: the frames' size in pixels; both even (yuv420p).
        crf: x264's constant rate factor, 0 (lossless) to 51.

    ``with MP4Writer(...) as w: w.write(frames)`` leaves the video at ``path`` when the
    body ends cleanly; when it raises, the temporary file is removed and ``path`` is
    left as it was. Outside a ``with``: `close` finishes, `abort` discards.

    Attributes:
        path: the destination (absolute); frames: frames written so far.
    """

    def __init__(self, path, *, fps: int = 16, width: int, height: int, crf: int = DEFAULT_CRF):
        self.path = check_mp4_path(path)
        self.fps = _positive_int("fps", fps)
        self.width, self.height = _positive_int("width", width), _positive_int("height", height)
        if width % 2 or height % 2:
            raise ValueError(f"width and height must be even for yuv420p H.264, got "
                             f"{width}x{height}")
        if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= 51:
            raise ValueError(f"crf must be an integer in [0, 51], got {crf!r}")
        import av

        folder, name = os.path.split(self.path)
        self._tmp = os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.part")
        # Created here (exclusive, mode as umask allows) so the name is ours; the
        # finalizer removes it should the writer be dropped unclosed.
        os.close(os.open(self._tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        self._cleanup = weakref.finalize(self, _remove, self._tmp)
        try:
            self._container = av.open(self._tmp, mode="w", format="mp4",
                                      options={"movflags": "+faststart"})
            self._stream = self._container.add_stream("libx264", rate=self.fps)
            self._stream.width, self._stream.height = width, height
            self._stream.pix_fmt = "yuv420p"
            # Frames are stamped in 1/fps; the muxer may change the stream's time base
            # once it writes the header (at the encoder's first packet), and PyAV
            # rescales each packet from the codec's time base to the stream's.
            self._frame_time_base = Fraction(1, self.fps)
            self._stream.time_base = self._frame_time_base
            self._stream.codec_context.time_base = self._frame_time_base
            self._stream.options = {"crf": str(crf)}
        except BaseException:
            self.abort()
            raise
        self.frames, self.closed = 0, False

    def __enter__(self) -> "MP4Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        else:
            self.close()

    def write(self, frames) -> None:
        """Append frames: uint8 RGB [F, H, W, 3] (a CPU tensor or a numpy array) at the
        writer's size."""
        import av

        self._check_open()
        if hasattr(frames, "detach"):
            frames = frames.detach().cpu().numpy()
        shape = tuple(getattr(frames, "shape", ()))
        if len(shape) != 4 or shape[1:] != (self.height, self.width, 3):
            raise ValueError(f"frames must be [F, {self.height}, {self.width}, 3], got {shape}")
        if str(frames.dtype) != "uint8":
            raise ValueError(f"frames must be uint8, got {frames.dtype}")
        for pixels in frames:  # [H, W, 3]
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts, frame.time_base = self.frames, self._frame_time_base
            self._container.mux(self._stream.encode(frame))
            self.frames += 1

    def close(self) -> None:
        """Flush the encoder, finish the file and rename it onto ``path``. With no
        frame written, nothing is left and ValueError says so. Idempotent."""
        if self.closed:
            return
        try:
            if self.frames == 0:
                raise ValueError(f"no frames were written: {self.path} not created")
            self._container.mux(self._stream.encode(None))
            self._container.close()
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self.closed = True
        self._cleanup.detach()

    def abort(self) -> None:
        """Discard the video: close the file and remove it; ``path`` is untouched."""
        self.closed = True
        container = getattr(self, "_container", None)
        if container is not None:
            try:
                container.close()
            except Exception:  # a broken encoder must not hide the first error
                pass
        self._cleanup()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"MP4Writer for {self.path} is closed")


def encode_image(frame, fmt: str = "jpeg", quality: int = 85) -> bytes:
    """One frame, uint8 RGB [H, W, 3] (a CPU tensor or a numpy array), as ``fmt``
    ("jpeg" or "webp") bytes at ``quality`` (1 to 100)."""
    from PIL import Image

    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"fmt must be one of {sorted(IMAGE_FORMATS)}, got {fmt!r}")
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an integer in [1, 100], got {quality!r}")
    if hasattr(frame, "detach"):
        frame = frame.detach().cpu().numpy()
    shape = tuple(getattr(frame, "shape", ()))
    if len(shape) != 3 or shape[2] != 3 or str(getattr(frame, "dtype", "")) != "uint8":
        raise ValueError(f"frame must be uint8 [H, W, 3], got {shape} "
                         f"{getattr(frame, 'dtype', type(frame).__name__)}")
    buf = io.BytesIO()
    Image.fromarray(frame, "RGB").save(buf, format=IMAGE_FORMATS[fmt], quality=quality)
    return buf.getvalue()
