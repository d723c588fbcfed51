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
encoded). A video session's chunks (either kind) end their header with ``"input":
{"first", "count"}``: the input frames the chunk was made from, frames ``first`` to
``first + count - 1`` numbered from 0 in the order the session received them, every
frame received counted, dropped ones too (``count`` is 1 + 4k for chunk 0, 4k after;
frames dropped before chunk i are ``first`` of chunk i less the end of chunk i - 1's).
A text session's chunks have no ``input``. It is recorded as the chunk's frames are
taken, so a chunk sent again (a reconnect, a restart, a move) carries the same one.

A prompt is at most one of ``"text"`` (a string, for a runner with a text encoder),
``"prompt_seed"`` (random embeddings of that seed) or ``"prompt"`` (uploaded float32
embeddings). A binary prompt upload (``PUT /v1/sessions/{id}/prompt``) is the
raw little-endian values, ``X-Prompt-Shape: L,D`` and ``X-Prompt-Dtype: bf16 | fp16 |
fp32`` (`upload_spec`, `upload_prompt`).
"""
from __future__ import annotations

import asyncio
import base64
import json
import io
import time

from framekv.specs import wire
from framekv.specs.checks import check_text

#: the image formats of a frames message: its name -> Pillow's
IMAGE_FORMATS = {"jpeg": "JPEG", "webp": "WEBP"}

MAX_BODY_BYTES = 1 << 20   # a request body or control message: JSON, at most 1 MiB
BODY_TIMEOUT_S = 10.0      # seconds a client may take to send its body
MAX_TEXT_CHARS = 2000      # a text prompt's length
#: the ASGI scope key `read_body` sets once a request's body is read whole: an error
#: answered to a request with a body not read closes the connection
#: (`framekv.tools.serve.errors.closes_unread`)
BODY_READ = "framekv.body_read"
PROMPT_KEYS = ("text", "prompt_seed", "prompt")
#: X-Prompt-Dtype -> (canonical name, numpy little-endian dtype of the raw values)
PROMPT_DTYPES = {"bf16": ("bf16", "<u2"), "bfloat16": ("bf16", "<u2"),
                 "fp16": ("fp16", "<f2"), "float16": ("fp16", "<f2"),
                 "fp32": ("fp32", "<f4"), "float32": ("fp32", "<f4")}


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
        try:
            return check_text("text", text)
        except ValueError as exc:
            raise RequestError(422, str(exc)) from None
    if "prompt_seed" in body:
        seed = body["prompt_seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise RequestError(422, f"prompt_seed must be an integer in [0, 2**31), got {seed!r}")
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return _embeddings(body["prompt"], shape) if "prompt" in body else None


def _embeddings(p, shape):
    """An uploaded prompt ``{"shape": [L, D], "data": base64 float32}`` as a tensor
    ``shape``: exactly those keys, integer sizes equal to ``shape``, finite values."""
    import torch

    want = f"{{\"shape\": {list(shape)}, \"data\": base64 float32}}"
    if not isinstance(p, dict):
        raise RequestError(422, f"prompt must be {want}, got a {_json_kind(p)}")
    unknown = sorted(set(p) - {"shape", "data"})
    if unknown:
        raise RequestError(422, f"prompt takes the keys shape and data, got unknown {unknown}")
    got = p.get("shape")
    if not isinstance(got, list) or any(type(n) is not int for n in got) \
            or got != list(shape) or not isinstance(p.get("data"), str):
        raise RequestError(422, f"prompt must be {want}, got shape {got!r} and data a "
                                f"{_json_kind(p.get('data'))}")
    try:
        raw = base64.b64decode(p["data"], validate=True)
    except ValueError:
        raise RequestError(422, "prompt.data is not base64") from None
    if len(raw) != 4 * shape[0] * shape[1]:
        raise RequestError(422, f"prompt.data must hold {shape[0] * shape[1]} float32 "
                                f"values, got {len(raw)} bytes")
    emb = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(*shape)
    bad = int((~torch.isfinite(emb)).sum())
    if bad:
        raise RequestError(422, f"prompt.data must hold finite float32 values, got {bad} "
                                f"NaN or infinite of {emb.numel()}")
    return emb


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (JSON numbers are finite)")


def json_body(raw: bytes) -> dict:
    """A request body or control message as a JSON object (400/413 otherwise): strict
    JSON, so NaN, Infinity and -Infinity (which Python's json takes) are refused."""
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"body over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw or b"{}", parse_constant=_no_constant)
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


#: the unread rest of a refused body is not worth reading: the connection closes
CLOSE = {"Connection": "close"}


async def read_body(request, timeout: float, cap: int = MAX_BODY_BYTES, *,
                    optional: bool = False) -> bytes:
    """The request body: a Content-Length in [0, cap] and no Transfer-Encoding (411/413
    before any byte is read), then at most ``cap`` bytes counted as they arrive (413),
    within ``timeout`` seconds (408). The headers never bound the read: a body longer
    than its Content-Length stops at the cap all the same. ``optional``: neither header
    is an empty body."""
    length = request.headers.get("content-length")
    if optional and length is None and "transfer-encoding" not in request.headers:
        request.scope[BODY_READ] = True
        return b""
    if length is None or "transfer-encoding" in request.headers:
        raise RequestError(411, "a Content-Length and no Transfer-Encoding are needed: "
                                "chunked request bodies are not accepted, got Transfer-"
                                f"Encoding {request.headers.get('transfer-encoding')!r} and "
                                f"Content-Length {length!r}", CLOSE)
    if not length.isdigit() or int(length) > cap:
        raise RequestError(413, f"Content-Length must be in [0, {cap}] bytes, got {length}",
                           CLOSE)
    try:
        body = await asyncio.wait_for(_read_capped(request, length, cap), timeout)
    except asyncio.TimeoutError:
        raise RequestError(408, f"the body did not arrive within {timeout} s", CLOSE) from None
    request.scope[BODY_READ] = True          # an error answered now keeps the connection
    return body


async def _read_capped(request, length: str, cap: int) -> bytes:
    parts, n = [], 0
    async for piece in request.stream():
        n += len(piece)
        if n > cap:
            raise RequestError(413, f"the body must be at most {cap} bytes, got {n} and "
                                    f"more (Content-Length said {length})", CLOSE)
        parts.append(piece)
    return b"".join(parts)


def upload_spec(shape: str | None, dtype: str | None, want) -> tuple[str, int]:
    """(canonical dtype, body bytes) of a binary prompt upload's headers: X-Prompt-Shape
    must be the model's prompt shape ``want`` as "L,D", X-Prompt-Dtype one of
    `PROMPT_DTYPES` (422 otherwise)."""
    import numpy as np

    want_text = ",".join(str(n) for n in want)
    got = [p.strip() for p in (shape or "").split(",")]
    if not all(p.isdigit() for p in got) or [int(p) for p in got] != list(want):
        raise RequestError(422, f"X-Prompt-Shape must be {want_text} (the model's prompt "
                                f"shape [L, text_dim]), got {shape!r}")
    if (dtype or "").lower() not in PROMPT_DTYPES:
        raise RequestError(422, f"X-Prompt-Dtype must be one of bf16, fp16 or fp32, got "
                                f"{dtype!r}")
    name, np_dtype = PROMPT_DTYPES[dtype.lower()]
    return name, int(np.prod(want)) * np.dtype(np_dtype).itemsize


def upload_prompt(raw: bytes, dtype: str, shape):
    """A binary prompt upload (``dtype`` from `upload_spec`) as float32 [L, D]: exactly
    L·D little-endian values of ``dtype`` and all finite (422 otherwise). bf16 and fp16
    widen to float32 exactly."""
    import numpy as np
    import torch

    np_dtype = np.dtype(PROMPT_DTYPES[dtype][1])
    want = int(np.prod(shape)) * np_dtype.itemsize
    if len(raw) != want:
        raise RequestError(422, f"the body must be {want} bytes ({'x'.join(map(str, shape))} "
                                f"{dtype} values), got {len(raw)}")
    values = np.frombuffer(raw, np_dtype)
    if dtype == "bf16":                      # the high half of a float32
        values = (values.astype("<u4") << 16).view("<f4")
    emb = torch.from_numpy(values.astype(np.float32)).view(*shape)
    bad = int((~torch.isfinite(emb)).sum())
    if bad:
        raise RequestError(422, f"the prompt must hold finite values, got {bad} NaN or "
                                f"infinite of {emb.numel()}")
    return emb


def _with_input(header: dict, chunk) -> dict:
    """``header`` and, for a video session's chunk, its ``input`` (module doc)."""
    if chunk.input is not None:
        header["input"] = {"first": chunk.input[0], "count": chunk.input[1]}
    return header


def chunk_frame(chunk) -> bytes:
    """A chunk's latents as one binary WebSocket message (module doc)."""
    lat = chunk.latents.contiguous()
    return wire.encode(_with_input(
        {"type": "chunk", "index": chunk.index, "frame0": chunk.frame0,
         "frames": chunk.frames, "dtype": "float32", "shape": list(lat.shape),
         "seconds": chunk.seconds, "batch": chunk.batch,
         "prompt_version": chunk.prompt_version}, chunk), lat.numpy().tobytes())


def frames_message(chunk, fmt: str = "jpeg", quality: int = 85) -> bytes:
    """A chunk's decoded frames (``chunk.video`` uint8 [F', H, W, 3]) as one binary
    WebSocket message of ``fmt`` images (module doc). Encodes on the calling thread."""
    video = chunk.video
    if video is None:
        raise ValueError("frames_message needs a chunk with decoded frames (a scheduler "
                         "with a decoder), got chunk.video=None")
    images = [encode_image(frame, fmt, quality) for frame in video]   # each [H, W, 3]
    F, H, W, _ = video.shape
    return wire.encode(_with_input(
        {"type": "frames", "index": chunk.index, "frame0": chunk.video_frame0,
         "frames": F, "width": W, "height": H, "format": fmt,
         "sizes": [len(b) for b in images], "seconds": chunk.seconds,
         "latency": time.monotonic() - chunk.requested, "batch": chunk.batch,
         "prompt_version": chunk.prompt_version}, chunk), b"".join(images))


def encode_image(frame, fmt: str = "jpeg", quality: int = 85) -> bytes:
    """One frame (a frames message's image), uint8 RGB [H, W, 3] (a CPU tensor or a numpy array), as ``fmt``
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
