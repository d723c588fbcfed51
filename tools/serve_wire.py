"""What `framekv serve` reads and writes: request bodies, prompts, chunk messages.

A chunk is one binary WebSocket message: a 4-byte big-endian header length, the JSON
header, then the payload::

    latents  {"type": "chunk", index, frame0, frames, dtype, shape, seconds, batch,
              prompt_version}; the latents fp32, C order
    frames   {"type": "frames", index, frame0 (its first frame's number in the
              video), frames, width, height, format ("jpeg" | "webp"), sizes (bytes of
              each image), seconds, latency, batch, prompt_version}; the images back to
              back, in frame order

``seconds``: the batched step that made the chunk, its decode included; ``latency``:
from the moment the session was ready for the chunk to the message built (images
encoded). A prompt is at most one of ``"text"`` (a string, for a runner with a text
encoder), ``"prompt_seed"`` (random embeddings of that seed) or ``"prompt"`` (uploaded
float32 embeddings).
"""
from __future__ import annotations

import asyncio
import base64
import json
import struct
import time

MAX_BODY_BYTES = 1 << 20   # a request body or control message: JSON, at most 1 MiB
BODY_TIMEOUT_S = 10.0      # seconds a client may take to send its body
MAX_TEXT_CHARS = 2000      # a text prompt's length
PROMPT_KEYS = ("text", "prompt_seed", "prompt")


class RequestError(Exception):
    """A request error: HTTP ``status`` and a message naming the problem."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def parse_prompt(body: dict, shape):
    """The prompt a request names (module doc): the text, a tensor [L, text_dim], or
    None when it names none (the model's)."""
    import torch

    given = [k for k in PROMPT_KEYS if k in body]
    if len(given) > 1:
        raise RequestError(422, f"give one of text, prompt_seed or prompt, not "
                                f"{' and '.join(given)}")
    if "text" in body:
        text = body["text"]
        if not isinstance(text, str) or not 0 < len(text) <= MAX_TEXT_CHARS:
            got = f"a string of {len(text)}" if isinstance(text, str) else f"a {_json_kind(text)}"
            raise RequestError(422, f"text must be a string of 1 to {MAX_TEXT_CHARS} "
                                    f"characters, got {got}")
        return text
    if "prompt_seed" in body:
        seed = body["prompt_seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise RequestError(422, f"prompt_seed must be an integer in [0, 2**31), got {seed!r}")
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if "prompt" not in body:
        return None
    p = body["prompt"]
    if not isinstance(p, dict) or list(p.get("shape", [])) != list(shape) \
            or not isinstance(p.get("data"), str):
        raise RequestError(422, f"prompt must be {{\"shape\": {list(shape)}, "
                                f"\"data\": base64 float32}}")
    try:
        raw = base64.b64decode(p["data"], validate=True)
    except ValueError:
        raise RequestError(422, "prompt.data is not base64") from None
    if len(raw) != 4 * shape[0] * shape[1]:
        raise RequestError(422, f"prompt.data must hold {shape[0] * shape[1]} float32 "
                                f"values, got {len(raw)} bytes")
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(*shape)


def json_body(raw: bytes) -> dict:
    """A request body or control message as a JSON object (400/413 otherwise)."""
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"body over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise RequestError(400, "the body is nested too deeply") from None
    except ValueError as exc:
        raise RequestError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the body must be a JSON object, got a {_json_kind(body)}")
    return body


def _json_kind(x) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null", dict: "object"}.get(type(x), type(x).__name__)


async def read_body(request, timeout: float) -> bytes:
    """The request body, after its Content-Length says it may be read."""
    length = request.headers.get("content-length")
    if length is None:
        raise RequestError(411, "a Content-Length is needed: chunked request bodies are not "
                                "accepted")
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        raise RequestError(413, f"Content-Length must be in [0, {MAX_BODY_BYTES}] bytes, "
                                f"got {length}")
    try:
        return await asyncio.wait_for(request.body(), timeout)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the body did not arrive within {timeout} s") from None


def _message(header: dict, payload: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw + payload


def chunk_frame(chunk) -> bytes:
    """A chunk's latents as one binary WebSocket message (module doc)."""
    lat = chunk.latents.contiguous()
    return _message({"type": "chunk", "index": chunk.index, "frame0": chunk.frame0,
                     "frames": chunk.frames, "dtype": "float32", "shape": list(lat.shape),
                     "seconds": chunk.seconds, "batch": chunk.batch,
                     "prompt_version": chunk.prompt_version}, lat.numpy().tobytes())


def frames_message(chunk, fmt: str = "jpeg", quality: int = 85) -> bytes:
    """A chunk's decoded frames (``chunk.video`` uint8 [F', H, W, 3]) as one binary
    WebSocket message of ``fmt`` images (module doc). Encodes on the calling thread."""
    from .video import encode_image

    video = chunk.video
    if video is None:
        raise ValueError("frames_message needs a chunk with decoded frames (a scheduler "
                         "with a decoder), got chunk.video=None")
    images = [encode_image(frame, fmt, quality) for frame in video]   # each [H, W, 3]
    F, H, W, _ = video.shape
    return _message({"type": "frames", "index": chunk.index, "frame0": chunk.video_frame0,
                     "frames": F, "width": W, "height": H, "format": fmt,
                     "sizes": [len(b) for b in images], "seconds": chunk.seconds,
                     "latency": time.monotonic() - chunk.requested, "batch": chunk.batch,
                     "prompt_version": chunk.prompt_version}, b"".join(images))


def parse_message(msg: bytes) -> tuple[dict, bytes]:
    """(header, payload) of a binary chunk message."""
    (n,) = struct.unpack(">I", msg[:4])
    return json.loads(msg[4:4 + n]), msg[4 + n:]
