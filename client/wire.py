"""What `framekv.client.sessions` sends and reads: `ServerError`, chunk messages (`Chunk`,
`decode_chunk`), request bodies and headers, and `SessionState`, what a session's
socket (or long poll) said (chunks not yet streamed, the end message, errors, prompt
acks, refused frames), which the blocking and the asyncio sessions share.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import io
import json
import os

from framekv.specs import wire


class ServerError(Exception):
    """The server refused: ``status`` (HTTP status or WebSocket close code), ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


@dataclasses.dataclass
class Chunk:
    """One chunk message: its JSON ``header`` (type, index, frame0, frames,
    prompt_version, batch, ...: `framekv.tools.serve`'s module doc) and its ``payload``
    (latents, or images back to back)."""

    header: dict
    payload: bytes

    @property
    def index(self) -> int:
        """The chunk's index in its session (0, 1, ...)."""
        return self.header["index"]

    @property
    def prompt_version(self) -> int:
        """The session's prompt changes when the chunk was made."""
        return self.header["prompt_version"]

    @property
    def input(self) -> tuple[int, int] | None:
        """A video session's chunk: (first, count) of the frames it was made from,
        numbered from 0 in the order the server received them (dropped ones counted);
        None for a text session's chunk."""
        got = self.header.get("input")
        return None if got is None else (got["first"], got["count"])

    @functools.cached_property
    def latents(self):
        """A latents chunk's float32 tensor, ``header["shape"]`` ([C, F, H, W]); None for
        a frames chunk."""
        import torch

        if self.header["type"] != "chunk":
            return None
        return torch.frombuffer(bytearray(self.payload), dtype=torch.float32).view(
            self.header["shape"])

    @property
    def images(self) -> list[bytes]:
        """A frames chunk's encoded images (``header["format"]``), in frame order."""
        return wire.split_images(self.header, self.payload)

    def video(self):
        """A frames chunk's images decoded (Pillow) into a numpy uint8 [F', H, W, 3];
        ValueError for a latents chunk."""
        import numpy as np
        from PIL import Image

        if self.header["type"] != "frames":
            raise ValueError(f"video() needs a frames chunk (a server with --output "
                             f"frames), got a {self.header['type']!r} chunk")
        return np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB"))
                         for b in self.images])


def decode_chunk(msg: bytes) -> Chunk:
    """A binary chunk message (`framekv.engine.serving.wire`) as a `Chunk`."""
    return Chunk(*wire.decode(msg))


def env_token(token: str | None) -> str | None:
    """``token``, else FRAMEKV_TOKEN, else None (an empty variable counts as unset)."""
    return token if token is not None else os.environ.get("FRAMEKV_TOKEN") or None


def auth_headers(token: str | None) -> dict:
    """The Authorization header of ``token`` (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


#: the headers of a binary body (a frames_in message)
OCTETS = {"Content-Type": "application/octet-stream"}


def check_response(r):
    """``r`` (an httpx response) when it succeeded, else `ServerError`."""
    if r.status_code < 400:
        return r
    try:
        message = r.json()["error"]
    except (ValueError, KeyError, TypeError):
        message = r.text
    raise ServerError(r.status_code, message)


def create_body(seed, chunks, text, prompt_seed, prompt, paused) -> dict:
    """The ``POST /v1/sessions`` body; a tensor ``prompt`` goes by upload, so its session
    starts paused. ValueError for more than one of text, prompt_seed and prompt."""
    given = [k for k, v in (("text", text), ("prompt_seed", prompt_seed), ("prompt", prompt))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of text, prompt_seed or prompt, got {given}")
    body = {"seed": seed, "paused": paused or prompt is not None}
    for key, value in (("chunks", chunks), ("text", text), ("prompt_seed", prompt_seed)):
        if value is not None:
            body[key] = value
    return body


def prompt_upload(prompt) -> tuple[bytes, dict]:
    """(body, headers) of a prompt upload: [L, D] (or [1, L, D]) as little-endian bf16,
    fp16 (kept) or float32 (anything else)."""
    import torch

    t = torch.as_tensor(prompt).detach().cpu()
    t = t[0] if t.dim() == 3 and t.shape[0] == 1 else t
    if t.dtype == torch.bfloat16:
        raw, dtype = t.contiguous().view(torch.int16).numpy().astype("<i2").tobytes(), "bf16"
    elif t.dtype == torch.float16:
        raw, dtype = t.contiguous().numpy().astype("<f2").tobytes(), "fp16"
    else:
        raw, dtype = t.float().contiguous().numpy().astype("<f4").tobytes(), "fp32"
    return raw, {"X-Prompt-Shape": ",".join(map(str, t.shape)), "X-Prompt-Dtype": dtype,
                 "Content-Type": "application/octet-stream"}


def prompt_message(text, prompt_seed) -> str:
    """A prompt control message of exactly one of ``text``, ``prompt_seed`` (ValueError
    otherwise)."""
    given = {k: v for k, v in (("text", text), ("prompt_seed", prompt_seed)) if v is not None}
    if len(given) != 1:
        raise ValueError(f"give one of text, prompt_seed or prompt, got {sorted(given)}")
    return json.dumps({"type": "prompt", **given})


#: how a client's sessions read their chunks: a WebSocket, else (one that cannot be
#: opened) the long poll; a WebSocket only; the long poll only
TRANSPORTS = ("auto", "websocket", "poll")


def check_transport(transport) -> str:
    """``transport`` if it is one of `TRANSPORTS`, else a ValueError naming it."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    return transport


class SessionState:
    """What a session's socket said: chunks not yet streamed, the end, errors, acks."""

    def __init__(self, client, sid: str, resume: bool, after: int | None = None):
        if after is not None and (isinstance(after, bool) or not isinstance(after, int)):
            raise ValueError(f"after must be None or a chunk index (an int), got {after!r}")
        self.client, self.id, self._resume = client, sid, resume
        self._transport = client.transport     # "auto" turns "poll" once a socket fails
        #: the index of the last chunk handed out by ``stream`` (None: none yet)
        self.last: int | None = after
        self.pending: collections.deque = collections.deque()
        self.end: dict | None = None
        self.errors: list[dict] = []
        self._acks: collections.deque = collections.deque()
        self._outbox: collections.deque = collections.deque()   # acks of chunks skipped
        self._asking = False                  # a prompt change waits for its answer
        self._refusals: list[dict] = []       # frames messages the socket refused
        self._ws = None

    def _after(self, info: dict | None = None) -> int | None:
        """Where a (re)connect goes on: after the last chunk handed out, or the
        session's last chunk made where ``info`` (its GET) says it made fewer (a server
        resumed from an older checkpoint: the server refuses an ``after`` beyond them,
        and the chunks made again are skipped as they come); None: from the first chunk
        not acknowledged."""
        after = self.last
        if after is not None and isinstance(info, dict) and isinstance(info.get("chunks"), int):
            after = min(after, info["chunks"] - 1)
        return None if after is None or after < 0 else after

    def _ws_url(self, info: dict | None = None) -> str:
        """The socket's URL: ``?after=`` where `_after` says."""
        base = self.client.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        after = self._after(info)
        tail = "" if after is None else f"?after={after}"
        return f"{base}/v1/sessions/{self.id}/stream{tail}"

    def _refused(self, exc) -> None:
        """The socket could not be opened (``exc``: websockets' InvalidHandshake: a
        proxy that refuses the upgrade, say): `ServerError` with its HTTP status where
        the transport is "websocket", else the long poll from here on."""
        if self._transport == "websocket":
            response = getattr(exc, "response", None)
            status = getattr(response, "status_code", 400)
            raise ServerError(status, f"the socket was refused: {exc}") from None
        self._transport = "poll"

    def _handed(self, chunk) -> str:
        """Note ``chunk`` handed out; the ack message to send for it."""
        self.last = chunk.index
        return json.dumps({"type": "ack", "index": chunk.index})

    def _take(self, msg) -> None:
        """File one socket message: a chunk to ``pending`` (one at or below the newest
        streamed or pending, sent again after a reconnect, is dropped; one at or below
        the last streamed is acknowledged, through ``_outbox``), the end to
        ``end``, an ack to the acks, an error to ``errors`` and: a refusal of frames
        (``"about": "frames_in"``) to the refused frames, another, while a prompt
        change waits, to the acks (its answer)."""
        if isinstance(msg, bytes):
            chunk = decode_chunk(msg)
            newest = self.pending[-1].index if self.pending else self.last
            if newest is None or chunk.index > newest:
                self.pending.append(chunk)
            elif self.last is not None and chunk.index <= self.last:   # handed out before
                self._outbox.append(json.dumps({"type": "ack", "index": chunk.index}))
            return
        m = json.loads(msg)
        if m["type"] == "end":
            self.end = m
        elif m["type"] in ("prompt_ack", "prompt_pending"):
            self._acks.append(m)
        elif m["type"] == "error":
            self.errors.append(m)
            if m.get("about") == "frames_in":
                self._refusals.append(m)
            elif self._asking:               # a control message's answer: the change's
                self._acks.append(m)

    def _closed(self, exc) -> ServerError:
        """The `ServerError` of a socket closed before its end message (``exc``:
        websockets' ConnectionClosed): its close code and reason."""
        rcvd = getattr(exc, "rcvd", None)
        code, reason = (rcvd.code, rcvd.reason) if rcvd is not None else (1006, "")
        return ServerError(code, reason or "the socket closed before the end message")

    def _refused_frames(self) -> None:
        """`ServerError` (the first refusal's status) for frames messages the socket
        refused since the last call, which ``stream`` (or a wait) has read; none:
        nothing."""
        if self._refusals:
            first, more = self._refusals[0], len(self._refusals) - 1
            self._refusals.clear()
            raise ServerError(first.get("status", 422), first["error"] + (
                f" (and {more} more refused)" if more else ""))

    def _ack(self) -> dict:
        """The oldest ack; `ServerError` (422) when the server answered an error."""
        m = self._acks.popleft()
        if m["type"] == "error":
            raise ServerError(422, m["error"])
        return m
