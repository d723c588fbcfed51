"""A video session's frames in (`take_frames`): the ``frames_in`` message, decoded and
fitted to the model's video size, fed to the session's input.

A video session (``POST /v1/sessions`` with ``{"input": "video", "strength": S}``) takes
frames as one binary message each, on its socket or as the body of ``POST
/v1/sessions/{id}/frames``, framed as every chunk message is (`framekv.specs.wire`)::

    [n: uint32 BE][header: n bytes of JSON][payload]
    header   {"type": "frames_in", "format": "jpeg" | "webp" | "png" | "rgb24",
              "width": W, "height": H, "count": N, "sizes": [bytes of each image],
              "id": the sender's name for the message}
             (``sizes`` may be left out for one image, and is for rgb24; ``id``, an
             integer or a string of at most `MAX_ID` characters, may be left out)
    payload  the N images back to back in frame order (``sizes``: their lengths; not
             given for rgb24), or for rgb24 N x H x W x 3 bytes (row-major RGB)

Each frame is W x H as sent (at most `MAX_SIDE` a side), any aspect: it is resized to
cover the model's video size and center-cropped (`framekv.tools.video_in.fit_frame`),
then waits for its chunk (`framekv.engine.serving.intake`: at most one chunk waits; older
frames are dropped and counted). A message carries 1 to `MAX_FRAMES` frames in at most
`MAX_FRAMES_BYTES`. The POST answers the session's input counts (`FramesIn`); the
socket answers nothing. A bad
message (truncated, a header that is no JSON object, an unknown format, a count that
does not match the sizes or the payload, an image that does not decode or is not W x
H, more frames than `MAX_FRAMES`, an ``id`` of another kind) is a `RequestError` naming
the fault (the socket answers ``{"type": "error", "error", "status", "about":
"frames_in"}``, with the message's ``id`` where its header has a valid one, so a
sender that numbers its messages knows which frames the session never received; the
POST its status) and the session goes on.
"""
from __future__ import annotations

import asyncio
import io
import time

from framekv.specs import wire

from ..video_in import fit_frame
from .wire import RequestError

__all__ = ["FORMATS", "MAX_FRAMES", "MAX_FRAMES_BYTES", "MAX_ID", "MAX_SIDE", "NoFrames",
           "decode_frames", "frames_id", "take_frames", "video_in"]

#: the formats a frames_in message may carry (`wire.FRAMES_IN_FORMATS`)
FORMATS = wire.FRAMES_IN_FORMATS
#: the most frames one message carries (more: 413)
MAX_FRAMES = wire.FRAMES_IN_MAX_FRAMES
#: the longest side of a frame as sent
MAX_SIDE = 4096
#: the most bytes of one message: a socket's (uvicorn's ws_max_size) and a POST body's
MAX_FRAMES_BYTES = wire.FRAMES_IN_MAX_BYTES
#: the longest string a message's ``id`` may be
MAX_ID = 64


class NoFrames(RequestError):
    """A session that takes no frames (text input, or a server without video input): 409."""


def _count(header: dict, key: str, top: int, status: int = 422) -> int:
    v = header.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top:
        raise RequestError(status, f"frames_in {key} must be an integer in [1, {top}], got "
                                   f"{str(v)[:40]}")
    return v


def _valid_id(header: dict) -> bool:
    ident = header.get("id")
    return (ident is None or (type(ident) is int)
            or (isinstance(ident, str) and len(ident) <= MAX_ID))


def frames_id(msg: bytes) -> int | str | None:
    """The ``id`` of a frames_in message's header (module doc), None where the message
    has no header, no id or one of another kind."""
    try:
        header, _ = wire.decode(msg)
    except ValueError:
        return None
    return header.get("id") if _valid_id(header) else None


def _header(msg: bytes) -> tuple[dict, bytes, str, int, int, int]:
    """(header, payload, format, width, height, count) of a frames_in message."""
    try:
        header, payload = wire.decode(msg)
    except ValueError as exc:
        raise RequestError(400, f"a frames_in message: {exc}") from None
    if header.get("type") != "frames_in":
        raise RequestError(400, f"a binary message must be frames_in ({{\"type\": "
                                f"\"frames_in\", ...}}), got type {str(header.get('type'))[:40]!r}")
    if not _valid_id(header):
        raise RequestError(422, f"frames_in id must be an integer or a string of at most "
                                f"{MAX_ID} characters, got {str(header['id'])[:40]!r}")
    fmt = header.get("format")
    if fmt not in FORMATS:
        raise RequestError(422, f"frames_in format must be one of {list(FORMATS)}, got "
                                f"{str(fmt)[:40]!r}")
    count = _count(header, "count", MAX_FRAMES, 413 if type(header.get("count")) is int
                   and header["count"] > MAX_FRAMES else 422)
    return (header, payload, fmt, _count(header, "width", MAX_SIDE),
            _count(header, "height", MAX_SIDE), count)


def _images(header: dict, payload: bytes, count: int) -> list[bytes]:
    """The payload cut by ``sizes``, which must be ``count`` lengths summing to it (one
    image may leave it out: the whole payload)."""
    sizes = header.get("sizes", [len(payload)] if count == 1 else None)
    if (not isinstance(sizes, list) or len(sizes) != count
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)):
        raise RequestError(400, f"frames_in sizes must be {count} (count) byte lengths >= 1, "
                                f"got {str(sizes)[:80]}")
    if sum(sizes) != len(payload):
        raise RequestError(400, f"frames_in sizes sum to {sum(sizes)} bytes, the payload "
                                f"has {len(payload)} (truncated?)")
    return wire.split_images({"sizes": sizes}, payload)


def _pixels(image: bytes, fmt: str, width: int, height: int, j: int):
    """One image as uint8 [H, W, 3]; RequestError unless it is a ``fmt`` of W x H."""
    import numpy as np
    import torch
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(image))
        kind, size = img.format, img.size       # read from the header: nothing decoded yet
        if kind == FORMATS[fmt] and size == (width, height):
            rgb = np.asarray(img.convert("RGB"))
    except Exception as exc:
        raise RequestError(400, f"frames_in frame {j} does not decode as {fmt}: "
                                f"{type(exc).__name__}: {str(exc)[:120]}") from None
    if kind != FORMATS[fmt]:
        raise RequestError(422, f"frames_in frame {j} must be {fmt}, got {kind}")
    if size != (width, height):
        raise RequestError(422, f"frames_in frame {j} must be {width}x{height} (width x "
                                f"height), got {size[0]}x{size[1]}")
    return torch.from_numpy(rgb.copy())                                   # [H, W, 3]


def decode_frames(msg: bytes, size: tuple[int, int]):
    """A frames_in message's frames fitted to ``size`` (H, W): fp32 [N, 3, H, W] in
    [-1, 1]. RequestError naming a bad message (module doc)."""
    import numpy as np
    import torch

    header, payload, fmt, width, height, count = _header(msg)
    if fmt == "rgb24":
        want = count * width * height * 3
        if len(payload) != want:
            raise RequestError(400, f"frames_in rgb24 payload must be count x height x width "
                                    f"x 3 = {want} bytes, got {len(payload)}")
        rgb = torch.from_numpy(np.frombuffer(payload, np.uint8).reshape(
            count, height, width, 3).copy())                              # [N, H, W, 3]
        frames = list(rgb)
    else:
        frames = [_pixels(image, fmt, width, height, j)
                  for j, image in enumerate(_images(header, payload, count))]
    return torch.stack([fit_frame(f, size) for f in frames])             # [N, 3, H, W]


async def take_frames(sched, sid: str, msg: bytes) -> dict:
    """Decode a frames_in message (on a worker thread) into session ``sid``'s input
    (`StreamScheduler.feed`); its input's counts. RequestError: 404 for a session not
    open, 409 for one that takes no frames (text input, or finished), the message's
    fault otherwise."""
    when = time.monotonic()
    size = getattr(sched, "video_size", None)
    if sid not in sched.sessions:
        raise KeyError(sid)
    record = getattr(sched.sessions, "get", lambda _: None)(sid)    # none on a cluster
    if size is None or (record is not None and record.intake is None):
        raise NoFrames(409, f"session {sid[:64]!r} takes no frames: it was opened with text "
                            "input (a video session: {\"input\": \"video\"})")
    frames = await asyncio.to_thread(decode_frames, msg, size)
    try:
        return await asyncio.to_thread(sched.feed, sid, frames, when)
    except ValueError as exc:                     # text input, or finished meanwhile
        raise NoFrames(409, str(exc)) from None


def video_in(sched) -> dict | None:
    """/v1/info's ``video_in``: what a video session takes (`VideoIn`), None where the
    server takes no frames."""
    size = getattr(sched, "video_size", None)
    if size is None:
        return None
    first, later = sched.video_chunk_frames
    return {"strength": sched.video_strength, "width": size[1], "height": size[0],
            "first": first, "later": later, "formats": list(FORMATS), "max_frames": MAX_FRAMES}
