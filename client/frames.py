"""Frames in, for a video session of `framekv serve` (``client.create(input="video")``):
`video_fields` checks what ``create`` asks for (`server_strength`: the strength where
none is given), `encode_frames` turns the frames given
to ``Session.send_frames`` into ``frames_in`` messages (`FramesIn.messages`).

Frames are RGB: a uint8 numpy array or torch tensor [N, H, W, 3] (any device), a list
of PIL images (converted to RGB), or a list of images already encoded, one ``bytes``
a frame, in the ``format`` named (jpeg, webp or png: read, not decoded, to check their
format and size). Every frame of one call is W x H, any aspect (the server fits it to
the model's video size). ``format`` is what goes over the wire: "jpeg" and "webp" at
``quality`` (1-100), "png", or "rgb24" (raw pixels). A message carries at most
``max_frames`` frames (the server's ``/v1/info`` ``video_in.max_frames``) in at most
`MAX_MESSAGE_BYTES`; more frames go as several messages, in order. A bad argument is
a ValueError naming it, the value expected and the value given, before anything is
sent.
"""
from __future__ import annotations

import dataclasses
import io
import numbers

from framekv.specs import wire

#: the formats a frames_in message carries (`wire.FRAMES_IN_FORMATS`)
FORMATS = wire.FRAMES_IN_FORMATS
#: what a session takes besides its prompt
INPUTS = ("text", "video")
#: frames a message carries where the server does not say (its /v1/info video_in)
DEFAULT_MAX_FRAMES = wire.FRAMES_IN_MAX_FRAMES
#: the most bytes of one message's images: what the server takes, less room for the
#: header
MAX_MESSAGE_BYTES = wire.FRAMES_IN_MAX_BYTES - 64 * 1024
BYTES = (bytes, bytearray, memoryview)


def video_fields(input: str, strength) -> dict:
    """The ``POST /v1/sessions`` fields of ``input`` and ``strength`` (none for text;
    a video session's strength None: the server's, filled in by the client). ValueError
    for an input not in `INPUTS`, a strength outside (0, 1] or one without video."""
    if input not in INPUTS:
        raise ValueError(f"input must be one of {INPUTS}, got {input!r}")
    if strength is None:
        return {"input": "video"} if input == "video" else {}
    if isinstance(strength, bool) or not isinstance(strength, numbers.Real) \
            or not 0 < strength <= 1:
        raise ValueError(f"strength must be a number in (0, 1], got {strength!r}")
    if input != "video":
        raise ValueError(f"strength is for input='video', got strength={strength!r} with "
                         f"input={input!r}")
    return {"input": "video", "strength": float(strength)}       # numpy's too: JSON


def server_strength(video_in: dict | None) -> float:
    """The strength of a server's video sessions (``video_in``: its /v1/info's);
    ValueError where it takes no frames."""
    if not video_in:
        raise ValueError("input='video' needs a server with video input (framekv serve "
                         "--video-strength), got one whose /v1/info video_in is null")
    return video_in["strength"]


@dataclasses.dataclass
class FramesIn:
    """Frames encoded as ``format`` (``images``: one ``bytes`` a frame), each W x H."""

    format: str
    width: int
    height: int
    images: list[bytes]

    def messages(self, max_frames: int) -> list[bytes]:
        """The frames_in messages of these frames, in order: at most ``max_frames``
        frames and `MAX_MESSAGE_BYTES` each."""
        groups, size = [[]], 0
        for j, image in enumerate(self.images):
            if len(image) > MAX_MESSAGE_BYTES:
                raise ValueError(f"frames[{j}] must be at most {MAX_MESSAGE_BYTES} bytes as "
                                 f"{self.format}, got {len(image)}: send smaller frames")
            if groups[-1] and (len(groups[-1]) >= max_frames
                               or size + len(image) > MAX_MESSAGE_BYTES):
                groups.append([])
                size = 0
            groups[-1].append(image)
            size += len(image)
        return [self._message(g) for g in groups]

    def _message(self, images: list[bytes]) -> bytes:
        header = {"type": "frames_in", "format": self.format, "width": self.width,
                  "height": self.height, "count": len(images)}
        if self.format != "rgb24":
            header["sizes"] = [len(b) for b in images]
        return wire.encode(header, b"".join(images))


def encode_frames(frames, format: str = "jpeg", quality: int = 90) -> FramesIn:
    """``frames`` (module doc) encoded as ``format``; ValueError naming a bad argument."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an integer in [1, 100], got {quality!r}")
    if isinstance(frames, (list, tuple)) and frames and isinstance(frames[0], BYTES):
        return _encoded(list(frames), format)
    pixels = _pixels(frames)                                      # [N, H, W, 3] uint8
    _, height, width, _ = pixels.shape
    images = [_image(f, format, quality) for f in pixels]
    return FramesIn(format, width, height, images)


def _pixels(frames):
    """``frames`` as a numpy uint8 [N, H, W, 3]; ValueError naming what is wrong."""
    import numpy as np

    want = "a uint8 array or tensor [N, H, W, 3] (RGB), a list of PIL images or a list " \
           "of encoded images (bytes)"
    if isinstance(frames, (list, tuple)):
        if not frames:
            raise ValueError(f"frames must be {want}, got an empty {type(frames).__name__}")
        return np.stack(_pil_frames(frames, want))
    if type(frames).__module__.startswith("torch"):
        if str(getattr(frames, "dtype", "")) != "torch.uint8":
            raise ValueError(f"frames must be uint8 (0-255), got a tensor of dtype "
                             f"{getattr(frames, 'dtype', None)}")
        frames = frames.detach().cpu().numpy()
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"frames must be {want}, got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (0-255), got dtype {frames.dtype}")
    if frames.ndim != 4 or frames.shape[-1] != 3 or 0 in frames.shape:
        raise ValueError(f"frames must be [N, H, W, 3] (N, H, W >= 1; RGB), got shape "
                         f"{list(frames.shape)}")
    return frames


def _pil_frames(frames, want: str) -> list:
    """A list of PIL images as uint8 [H, W, 3] arrays, all of the first one's size."""
    import numpy as np
    from PIL import Image

    out = []
    for j, f in enumerate(frames):
        if not isinstance(f, Image.Image):
            raise ValueError(f"frames must be {want}; frames[{j}] is {type(f).__name__}")
        if f.size != frames[0].size:
            raise ValueError(f"frames must all be {frames[0].size[0]}x{frames[0].size[1]} "
                             f"(width x height), frames[{j}] is {f.size[0]}x{f.size[1]}")
        out.append(np.asarray(f.convert("RGB")))
    return out


def _image(frame, format: str, quality: int) -> bytes:
    """One uint8 [H, W, 3] frame as ``format``."""
    import numpy as np
    from PIL import Image

    if format == "rgb24":
        return np.ascontiguousarray(frame).tobytes()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame), "RGB").save(
        buf, format=FORMATS[format], **({} if format == "png" else {"quality": quality}))
    return buf.getvalue()


def _encoded(images: list, format: str) -> FramesIn:
    """Images already encoded, checked (their headers read) to be ``format`` and one size."""
    from PIL import Image

    if format == "rgb24":
        raise ValueError("format must be jpeg, webp or png for encoded images (bytes), got "
                         "'rgb24': pass rgb24 frames as a uint8 array [N, H, W, 3]")
    size = None
    for j, b in enumerate(images):
        if not isinstance(b, BYTES):
            raise ValueError(f"frames must all be encoded images (bytes) as frames[0] is; "
                             f"frames[{j}] is {type(b).__name__}")
        try:
            with Image.open(io.BytesIO(b)) as img:
                kind, got = img.format, img.size
        except Exception as exc:
            raise ValueError(f"frames[{j}] must be a {format} image, got {len(b)} bytes that "
                             f"do not open ({type(exc).__name__})") from None
        if kind != FORMATS[format]:
            raise ValueError(f"frames[{j}] must be a {format} image (format={format!r}), "
                             f"got {kind}")
        if size is not None and got != size:
            raise ValueError(f"frames must all be {size[0]}x{size[1]} (width x height), "
                             f"frames[{j}] is {got[0]}x{got[1]}")
        size = got
    return FramesIn(format, size[0], size[1], [bytes(b) for b in images])
