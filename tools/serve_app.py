"""The FastAPI app of `framekv serve` (`build_app`): its routes, the page at ``/``. The
routes and messages are those of `framekv.tools.serve`'s module doc; a session's socket
is `framekv.tools.serve_stream`'s, the chunk messages `framekv.tools.serve_wire`'s.

The GPU loop (`StreamScheduler.run`) runs in a thread the app's lifespan starts and
stops; should it end by an exception, /health answers 503 and new sessions are refused
(503), both with the reason. A session has at most one socket: a second is closed 4409.
With a token, every route but / and /health needs it, the docs (/docs, /redoc,
/openapi.json) included; tokens compare as bytes, a non-ASCII one is wrong (401).
``app.state.drain`` ends every stream cleanly on shutdown (`DrainingServer`).
(No ``from __future__ import annotations``: FastAPI reads the routes' annotations.)
"""
import asyncio
import contextlib
import secrets
import threading
import time
import urllib.parse

from .serve_metrics import metrics_registry, render
from .serve_stream import serve_socket
from .serve_wire import (BODY_TIMEOUT_S, RequestError, chunk_frame, frames_message, json_body,
                         parse_prompt, read_body)

OUTPUTS = ("frames", "latents")
FRAME_FORMATS = ("jpeg", "webp")
SESSION_KEYS = {"seed", "chunks", "text", "prompt", "prompt_seed"}
#: a second socket on a session is closed with this code (and a reason)
SESSION_TAKEN = 4409


def page_html() -> str:
    """The page served at ``/`` (``tools/page/index.html``, package data)."""
    from importlib.resources import files

    return (files("framekv.tools") / "page" / "index.html").read_text(encoding="utf-8")


def _check_options(sched, output, frame_format, fps, quality, token) -> str:
    import argparse

    from .args import bearer_token

    output = output or ("frames" if sched.decoding else "latents")
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    if output == "frames" and not sched.decoding:
        raise ValueError("output='frames' needs a scheduler with a decoder "
                         "(decoder_factory), got one without")
    if frame_format not in FRAME_FORMATS:
        raise ValueError(f"frame_format must be one of {FRAME_FORMATS}, got {frame_format!r}")
    for name, v, hi in (("fps", fps, 240), ("quality", quality, 100)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise ValueError(f"{name} must be an integer in [1, {hi}], got {v!r}")
    if token is not None and not isinstance(token, str):
        raise ValueError(f"token must be a string or None, got a {type(token).__name__}")
    if token is not None:
        try:
            bearer_token(token)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"token {exc}") from None
    return output


class _Server:
    """What the routes share: the scheduler, the options, the sockets open (session
    ids), whether the server drains."""

    def __init__(self, sched, token, body_timeout, output, encode, fps):
        self.sched, self.body_timeout, self.output, self.fps = sched, body_timeout, output, fps
        self.encode, self.streams, self.draining = encode, set(), threading.Event()
        self.token = None if token is None else f"Bearer {token}".encode()

    def check_token(self, auth: str | None) -> None:
        """401 unless ``auth`` is "Bearer <token>" (no token set: anything goes)."""
        if self.token is None:
            return
        if not auth:
            raise RequestError(401, "missing bearer token: send Authorization: Bearer <token>")
        if not auth.isascii() or not secrets.compare_digest(auth.encode(), self.token):
            raise RequestError(401, "wrong bearer token")

    def check_request(self, request) -> None:
        """The token of an HTTP request: its Authorization header, else ``?token=``."""
        self.check_token(request.headers.get("authorization") or (
            f"Bearer {request.query_params['token']}" if "token" in request.query_params
            else None))

    async def drain(self, timeout: float) -> None:
        """End every open stream (`serve_socket`: queued chunks, then an end message
        with reason "shutdown") and wait for their sockets, at most ``timeout`` s."""
        self.draining.set()
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def health(self):
        """/health: 200 while the GPU loop runs and the server takes sessions, else 503
        with ``error`` saying why."""
        from fastapi.responses import JSONResponse

        s = self.sched
        body = {"sessions": len(s.sessions), "max_sessions": s.max_sessions,
                "output": self.output, "fps": self.fps, "token": self.token is not None,
                "text": s.text_prompts}
        error = (f"the GPU loop stopped: {s.loop_error}" if s.loop_error is not None
                 else "the server is shutting down" if self.draining.is_set() else None)
        if error is None:
            return {"status": "ok", **body}
        return JSONResponse({"status": "error", "error": error, **body}, 503)


def build_app(sched, *, token: str | None = None, body_timeout: float = BODY_TIMEOUT_S,
              output: str | None = None, frame_format: str = "jpeg", fps: int = 16,
              quality: int = 85):
    """The FastAPI app over ``sched``; its lifespan runs the GPU loop thread.

    ``output``: "frames" (images of the decoded video, ``frame_format`` at JPEG/WebP
    ``quality``; needs a scheduler with a decoder) or "latents"; default frames where
    the scheduler decodes. ``fps``: the video's frame rate, which the page plays at.
    ``token``: printable ASCII without spaces (ValueError otherwise), or None: no auth.
    """
    from fastapi import FastAPI

    output = _check_options(sched, output, frame_format, fps, quality, token)
    encode = (chunk_frame if output == "latents"
              else lambda c: frames_message(c, frame_format, quality))
    srv = _Server(sched, token, body_timeout, output, encode, fps)
    stop = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = threading.Thread(target=sched.run, args=(stop,), name="framekv-gpu", daemon=True)
        loop.start()
        yield
        stop.set()
        loop.join()
        for sid in list(sched.sessions):
            sched.close_session(sid)

    docs = {} if token is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="framekv", lifespan=lifespan, **docs)
    app.state.drain = srv.drain
    _http_routes(app, srv, page_html())
    _stream_route(app, srv)
    if token is not None:
        _docs_routes(app, srv)
    return app


def _http_routes(app, srv: _Server, page: str) -> None:
    from fastapi import Request
    from fastapi.responses import HTMLResponse, JSONResponse, Response

    registry = metrics_registry(srv.sched)

    @app.exception_handler(RequestError)
    async def _err(request, exc: RequestError):
        return JSONResponse({"error": exc.message}, exc.status, headers=exc.headers)

    @app.get("/")
    async def index():
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/health")
    async def health():
        return srv.health()

    @app.get("/metrics")
    async def metrics(request: Request):
        srv.check_token(request.headers.get("authorization"))
        body, content_type = await asyncio.to_thread(render, registry,
                                                     request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.post("/v1/sessions", status_code=201)
    async def create(request: Request):
        srv.check_token(request.headers.get("authorization"))
        if srv.draining.is_set():
            raise RequestError(503, "the server is shutting down: no new sessions")
        body = json_body(await read_body(request, srv.body_timeout))
        return {"id": await _create(srv.sched, body)}

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str, request: Request):
        srv.check_token(request.headers.get("authorization"))
        if sid not in srv.sched.sessions:
            raise RequestError(404, "no such session")
        await asyncio.to_thread(srv.sched.close_session, sid)
        return Response(status_code=204)


def _stream_route(app, srv: _Server) -> None:
    from fastapi import WebSocket

    @app.websocket("/v1/sessions/{sid}/stream")
    async def stream(ws: WebSocket, sid: str):
        try:
            srv.check_request(ws)
            if sid not in srv.sched.sessions:
                raise RequestError(404, "no such session")
        except RequestError as exc:
            await ws.close(code=1008, reason=exc.message)
            return
        if sid in srv.streams:              # checked and taken with no await between
            await ws.accept()
            await ws.close(code=SESSION_TAKEN, reason="session already has a stream: one "
                                                      "socket per session")
            return
        srv.streams.add(sid)
        try:
            await ws.accept()
            await serve_socket(ws, srv.sched, sid, srv.encode, srv.draining)
        finally:
            srv.streams.discard(sid)


def _docs_routes(app, srv: _Server) -> None:
    """/openapi.json, /docs and /redoc behind the token (header or ``?token=``, which
    the docs pages pass on to their fetch of /openapi.json)."""
    from fastapi import Request
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.responses import JSONResponse

    def schema_url(request) -> str:
        token = request.query_params.get("token")
        return "/openapi.json" + ("" if token is None else
                                  "?" + urllib.parse.urlencode({"token": token}))

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        srv.check_request(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        srv.check_request(request)
        return get_swagger_ui_html(openapi_url=schema_url(request), title="framekv - docs")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request):
        srv.check_request(request)
        return get_redoc_html(openapi_url=schema_url(request), title="framekv - ReDoc")


async def _create(sched, body: dict) -> str:
    """Open the session a POST body asks for; its id."""
    from framekv.engine.scheduler import LoopStopped, SchedulerFull

    unknown = set(body) - SESSION_KEYS
    if unknown or "seed" not in body:
        takes = sorted(SESSION_KEYS - {"seed"})
        raise RequestError(422, f"body needs \"seed\" and takes {takes}; unknown: "
                                f"{sorted(unknown)}")
    prompt = parse_prompt(body, sched.prompt_shape)
    try:
        s = await asyncio.to_thread(sched.open_session, seed=body["seed"],
                                    chunks=body.get("chunks"), prompt=prompt)
    except SchedulerFull as exc:
        raise RequestError(503, str(exc), {"Retry-After": "5"}) from None
    except LoopStopped as exc:
        raise RequestError(503, str(exc)) from None
    except ValueError as exc:
        raise RequestError(422, str(exc)) from None
    return s.id
