"""Python clients of `framekv serve` (``framekv.client``): `Client` (blocking) and
`AsyncClient` (asyncio, ``aio.py``), each handing out sessions (`Session`,
`AsyncSession`)::

    from framekv.client import Client

    with Client("http://127.0.0.1:8000") as client:         # token: FRAMEKV_TOKEN
        session = client.create(seed=1, chunks=12, text="a red fox")
        for chunk in session.stream():
            use(chunk.latents)       # --output latents: float32 [C, F, H, W]
            use(chunk.video())       # --output frames: uint8 [F', H, W, 3] (Pillow)
            if chunk.index == 1:
                ack = session.change_prompt(text="a blue whale")   # ack["applies_from"]
        session.close()              # DELETE: True, or False when it had ended

Contracts. An HTTP error raises `ServerError` (``status``, the server's ``error``
message); so does a socket the server refuses (``status`` its close code: 1008 token,
4404 no such session open, 4409 a second socket), or one that closes before its end
message. `Session.stream` yields the chunks in order until the end message, then
stops, acknowledging each as it hands it out (a session whose chunks are not taken
stops making them); after a drop, `Session.reconnect` (or ``client.session(id,
after=last)``) goes on from the chunk after the last one streamed, each index once
(a server resumed from a checkpoint older than the last chunk streamed makes some
again: they are acknowledged and skipped).
``session.end`` holds the end message (``state`` "done", "failed" with ``error``,
or "closed" with a ``reason``). Control messages go over the session's socket (opened
on first use), a tensor prompt over ``PUT /v1/sessions/{id}/prompt`` (bf16 and fp16
as they are, anything else as float32); `Session.change_prompt` returns the server's
``{"type": "prompt_ack", "prompt_version", "applies_from"}``, and the chunks that
arrive while it waits are kept for `stream`; a change no chunk would come under (the
session made its last one) raises `ServerError` with the server's reason. ``create(prompt=tensor)`` opens the
session paused, uploads the prompt, and resumes it once its socket opens, so every
chunk is made under that prompt. One task or thread uses a session at a time (so no
`send_frames` while another thread iterates its `stream`). Needs httpx and websockets
>= 13 (the ``serve`` extra).

Video in (a server with ``--video-strength``): ``create(input="video")`` opens a
session whose chunk i is made from chunk i's frames (``strength``: None, the
server's; a strength outside (0, 1], or one without ``input="video"``, is a ValueError
before any request). `Session.send_frames` encodes them (`framekv.client.frames`: what
it takes, uint8 RGB [N, H, W, 3], PIL images or encoded bytes) into ``frames_in``
messages of at most /v1/info's ``video_in.max_frames`` frames each; /v1/info's
``first`` and ``later`` are the frames of the first chunk and of each later one::

    session = client.create(seed=1, chunks=3, text="a cat in watercolour", input="video")
    session.send_frames(video[:first])                   # uint8 [N, H, W, 3], RGB
    for chunk in session.stream():                       # chunk i once its frames are in
        start = first + later * chunk.index
        if chunk.index + 1 < 3:                          # the next chunk's frames
            session.send_frames(video[start:start + later])
        use(chunk.video())

Frames in faster than chunks are made keep the newest chunk's worth (the server counts
those dropped). On the socket they go unanswered (`send_frames` returns None); a
message the server refuses (a text session, a finished one, a frame too large) is
answered with an error message (``"about": "frames_in"``), which `stream` (or a
wait) files in ``errors`` and the next `send_frames` raises as `ServerError` with the
server's status, sending nothing. On the long poll each
message is a POST: a refusal is a `ServerError` with its status (409: the session
takes no frames) at once, the messages before it taken, and `send_frames` returns the
server's counts after the last (``frames_in``, ``frames_dropped``, ``frames_waiting``,
``input_chunks``, ``frames_needed``).

Transports (``Client(url, transport=...)``): "auto" (the default) opens a WebSocket
and, where one cannot be opened (a proxy or load balancer refusing the upgrade), reads
the session by long poll from then on (`framekv.client.poll`: ``GET
/v1/sessions/{id}/chunks``, control messages by ``POST /v1/sessions/{id}/control``);
"websocket" only (a refused socket is a `ServerError` with its HTTP status); "poll"
only. The chunks, their order, the acknowledgements, reconnects and the end are the
same on both; a refusal on the long poll is its HTTP status (401, 404, 409, 422), a
prompt change not taken within the server's wait answers ``{"type":
"prompt_pending"}``.
"""
from __future__ import annotations

import contextlib
import json

from .aio import AsyncClient, AsyncSession
from .frames import DEFAULT_MAX_FRAMES, encode_frames, server_strength, video_fields
from .poll import PollLink
from .wire import (OCTETS, Chunk, ServerError, SessionState, auth_headers, check_response,
                   check_transport, create_body, decode_chunk, env_token, prompt_message,
                   prompt_upload)

__all__ = ["AsyncClient", "AsyncSession", "Chunk", "Client", "ServerError", "Session",
           "decode_chunk"]


class Session(SessionState):
    """A session of a `Client` (module doc): ``id``, ``end``, ``errors`` (error messages
    the socket answered), ``pending`` (chunks received, not yet streamed)."""

    def __init__(self, client, sid: str, resume: bool, after: int | None = None):
        super().__init__(client, sid, resume, after)
        self._exit = contextlib.ExitStack()       # the socket, once open

    def info(self) -> dict:
        """``GET /v1/sessions/{id}``: state, chunks made and delivered, end reason..."""
        return check_response(self.client.http.get(f"/v1/sessions/{self.id}")).json()

    def connect(self) -> None:
        """Open the session's socket (once), or its long poll (module doc); resume a
        session created for an upload."""
        from websockets.exceptions import InvalidHandshake
        from websockets.sync.client import connect

        if self._ws is not None:
            return
        info = None if self.last is None else self._info_or_none()
        if self._transport != "poll":
            try:
                self._ws = self._exit.enter_context(connect(
                    self._ws_url(info), additional_headers=auth_headers(self.client.token),
                    open_timeout=self.client.timeout, max_size=None))
            except InvalidHandshake as exc:
                self._refused(exc)
        if self._ws is None:
            self._ws = PollLink(self.client.http, self.id, self._after(info), self.client.timeout)
        if self._resume:
            self._resume = False
            self.resume()

    def _info_or_none(self) -> dict | None:
        """`info`, or None where the server does not answer it (the socket then says)."""
        r = self.client.http.get(f"/v1/sessions/{self.id}")
        return r.json() if r.status_code == 200 else None

    def _read(self, timeout) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            self._take(self._ws.recv(timeout=timeout))
            while self._outbox:
                self._ws.send(self._outbox.popleft())
        except ConnectionClosed as exc:
            raise self._closed(exc) from None

    def stream(self, timeout: float | None = None):
        """Yield each chunk (`Chunk`) as it comes, until the end message (``end``);
        ``timeout``: seconds to wait for one message (TimeoutError past it)."""
        from websockets.exceptions import ConnectionClosed

        self.connect()
        while True:
            while self.pending:
                chunk = self.pending.popleft()
                with contextlib.suppress(ConnectionClosed):   # a drain closed it: the
                    self._ws.send(self._handed(chunk))        # chunk is ours all the same
                yield chunk
            if self.end is not None:
                return
            self._read(timeout)

    def reconnect(self) -> None:
        """Open the session's socket again (after a drop, or a server's restart): the
        chunks after the last one streamed come, then new ones."""
        self._exit.close()
        self._ws = None
        self.connect()

    def change_prompt(self, text: str | None = None, *, prompt=None,
                      prompt_seed: int | None = None, timeout: float | None = None) -> dict:
        """Change the prompt (text, a seed's random embeddings, or a tensor [L, D]);
        the server's ack ``{"type": "prompt_ack", "prompt_version", "applies_from"}``.
        `ServerError` when the server refuses it (e.g. the session made its last
        chunk: no chunk would come under it)."""
        if prompt is not None:
            raw, headers = prompt_upload(prompt)
            return check_response(self.client.http.put(f"/v1/sessions/{self.id}/prompt",
                                               content=raw, headers=headers)).json()
        message = prompt_message(text, prompt_seed)
        self.connect()
        self._asking = True
        try:
            self._ws.send(message)
            while not self._acks:
                if self.end is not None:
                    raise ServerError(409, f"the session ended ({self.end}) before the ack")
                self._read(timeout)
            return self._ack()
        finally:
            self._asking = False

    def send_frames(self, frames, *, format: str = "jpeg", quality: int = 90) -> dict | None:
        """Send a video session's ``frames`` (`framekv.client.frames`: uint8 [N, H, W, 3]
        RGB, PIL images, or encoded bytes a frame) as ``format``, at most ``max_frames``
        a message; on the socket: None, on the long poll: the server's input counts
        after the last message (``frames_in``, ``frames_waiting``, ...). ValueError for
        a bad argument; `ServerError` for frames refused (module doc)."""
        from websockets.exceptions import ConnectionClosed

        encoded = encode_frames(frames, format, quality)
        messages = encoded.messages(self.client._max_frames())
        self.connect()
        if isinstance(self._ws, PollLink):
            for m in messages:
                r = check_response(self.client.http.post(
                    f"/v1/sessions/{self.id}/frames", content=m, headers=OCTETS))
            return r.json()
        self._refused_frames()
        try:
            for m in messages:
                self._ws.send(m)
        except ConnectionClosed as exc:
            raise self._closed(exc) from None

    def pause(self) -> None:
        """Stop its chunks coming (the server makes none until `resume`)."""
        self.connect()
        self._ws.send(json.dumps({"type": "pause"}))

    def resume(self) -> None:
        """Let its chunks come again."""
        self.connect()
        self._ws.send(json.dumps({"type": "resume"}))

    def close(self) -> bool:
        """``DELETE`` the session, then close its socket: True, or False (404) when it
        had ended already."""
        r = self.client.http.delete(f"/v1/sessions/{self.id}")
        self._exit.close()
        return r.status_code != 404 and check_response(r) is r


class Client:
    """A blocking client of the server at ``url``; ``token`` default ``FRAMEKV_TOKEN``;
    ``timeout``: seconds for an HTTP request or a socket to open; ``transport``: how
    its sessions read their chunks, "auto" (a WebSocket, else the long poll),
    "websocket" or "poll" (module doc)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, token: str | None = None,
                 timeout: float = 30.0, transport: str = "auto"):
        import httpx

        self.transport = check_transport(transport)
        self.url, self.token, self.timeout = url.rstrip("/"), env_token(token), timeout
        self.http = httpx.Client(base_url=self.url, headers=auth_headers(self.token),
                                 timeout=timeout)
        self._video: dict | None | bool = False        # /v1/info's video_in, once read

    def info(self) -> dict:
        """``GET /v1/info``: model, prompt shape and dtype, chunk layout, output."""
        return check_response(self.http.get("/v1/info")).json()

    def create(self, *, seed: int, chunks: int | None = None, text: str | None = None,
               prompt=None, prompt_seed: int | None = None, paused: bool = False,
               input: str = "text", strength: float | None = None) -> Session:
        """Open a session (at most one of ``text``, ``prompt`` (a tensor [L, D]) or
        ``prompt_seed``); ``paused``: no chunk until `Session.resume`; ``input``
        "video": a video session (`Session.send_frames`) at ``strength`` in (0, 1]
        (None: the server's)."""
        body = {**create_body(seed, chunks, text, prompt_seed, prompt, paused),
                **video_fields(input, strength)}
        if body.get("input") == "video" and strength is None:
            body["strength"] = server_strength(self._video_in())
        sid = check_response(self.http.post("/v1/sessions", json=body)).json()["id"]
        s = Session(self, sid, resume=prompt is not None and not paused)
        if prompt is not None:
            s.change_prompt(prompt=prompt)
        return s

    def _video_in(self) -> dict | None:
        """/v1/info's ``video_in`` (None: the server takes no frames), read once."""
        if self._video is False:
            self._video = self.info().get("video_in")
        return self._video

    def _max_frames(self) -> int:
        return (self._video_in() or {}).get("max_frames", DEFAULT_MAX_FRAMES)

    def session(self, sid: str, *, after: int | None = None) -> Session:
        """A `Session` for an id opened elsewhere (or before a drop): its chunks after
        index ``after`` (None: every one not yet acknowledged)."""
        return Session(self, sid, resume=False, after=after)

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
