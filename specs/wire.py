"""The chunk message of `framekv serve`'s WebSocket, both ways: one binary message per
chunk, a 4-byte big-endian header length, the JSON header, the payload::

    [n: uint32 BE][header: n bytes of JSON][payload]

A latents chunk's header is ``{"type": "chunk", "index", "frame0", "frames", "dtype":
"float32", "shape": [C, F, H, W], "seconds", "batch", "prompt_version"}`` and its
payload the latents' bytes; a frames chunk's ``{"type": "frames", "index", "frame0",
"frames", "width", "height", "format", "sizes", "seconds", "latency", "batch",
"prompt_version"}`` and its payload the encoded images one after the other (``sizes``
their lengths). A video session's chunk of either kind adds ``"input": {"first",
"count"}``: the input frames it was made from, ``first`` to ``first + count - 1``,
numbered from 0 in the order the session received them, dropped ones counted. The
server (`framekv.tools.serve`), the client (`framekv.client`) and the load benchmark
(`framekv.bench.serve_load`) encode and decode through these; a spec at the bottom
floor, importable by all of them without torch.
"""
from __future__ import annotations

import json
import struct

__all__ = ["FRAMES_IN_FORMATS", "FRAMES_IN_MAX_BYTES", "FRAMES_IN_MAX_FRAMES", "HEADER",
           "decode", "encode", "split_images"]

#: the header length's layout
HEADER = struct.Struct(">I")
#: the formats a ``frames_in`` message (a video session's frames, client to server)
#: may carry, and Pillow's name of each image format (rgb24: raw pixels)
FRAMES_IN_FORMATS = {"jpeg": "JPEG", "webp": "WEBP", "png": "PNG", "rgb24": None}
#: the most frames one ``frames_in`` message carries: a few chunks' worth
FRAMES_IN_MAX_FRAMES = 64
#: the most bytes of one ``frames_in`` message, header included
FRAMES_IN_MAX_BYTES = 16 * 1024 * 1024


def encode(header: dict, payload: bytes = b"") -> bytes:
    """One chunk message of ``header`` (JSON-able) and ``payload``."""
    raw = json.dumps(header).encode()
    return HEADER.pack(len(raw)) + raw + payload


def decode(msg: bytes) -> tuple[dict, bytes]:
    """(header, payload) of a chunk message; ValueError for bytes that are not one (too
    short, a length past the end, a header that is not a JSON object)."""
    if not isinstance(msg, (bytes, bytearray, memoryview)) or len(msg) < HEADER.size:
        raise ValueError(f"a chunk message starts with a {HEADER.size}-byte header length, "
                         f"got {len(msg) if hasattr(msg, '__len__') else type(msg).__name__}")
    (n,) = HEADER.unpack_from(msg)
    if HEADER.size + n > len(msg):
        raise ValueError(f"a chunk message's header of {n} bytes runs past its "
                         f"{len(msg)} bytes")
    try:
        header = json.loads(bytes(msg[HEADER.size:HEADER.size + n]))
    except ValueError as exc:
        raise ValueError(f"a chunk message's header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError(f"a chunk message's header must be a JSON object, got "
                         f"{type(header).__name__}")
    return header, bytes(msg[HEADER.size + n:])


def split_images(header: dict, payload: bytes) -> list[bytes]:
    """A frames chunk's encoded images, in frame order (by ``header["sizes"]``)."""
    out, at = [], 0
    for size in header.get("sizes", []):
        out.append(payload[at:at + size])
        at += size
    return out
