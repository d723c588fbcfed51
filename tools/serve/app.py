"""The FastAPI app of `framekv serve` (`build_app`): the server's state, its lifespan (the
GPU loop thread, the idle-session reaper), the routes outside a session (the page at
``/`` and its camera script /camera.js, /health, /metrics, /v1/info, the docs) and the
error shape. The routes and
messages are those of `framekv.tools.serve`'s module doc; the session routes and the
WebSocket are `framekv.tools.serve.routes`', the long poll
`framekv.tools.serve.poll`'s, the chunk messages
`framekv.tools.serve.wire`'s, the models `framekv.tools.serve.models`'.

The GPU loop (`StreamScheduler.run`) runs in a thread the app's lifespan starts and
stops; should it end by an exception, /health answers 503 and new sessions are refused
(503), both with the reason. Every error is ``{"error": ...}`` (`error_handlers`): a
validation error (422), an unknown route (404), a wrong method (405, ``Allow`` naming
the right ones) and an internal error (500 "internal error: <type>: <message>", its
traceback logged) included; an error answered to a request whose body was not read (a
401 before an upload, say) closes the connection (`closes_unread`). A WebSocket from a
browser page of another origin than the server's is closed 1008 (a long poll answered
403) unless ``allowed_origins`` lists it (`OriginCheck`). With a token, every route but /,
/camera.js and /health needs it (`BearerAuth`), the docs (/docs, /openapi.json) included. /docs is a
local page (``page/docs.html``) that renders /openapi.json and loads nothing from
elsewhere. A session with no socket and no long poll for ``idle_timeout`` seconds
(created and never connected, or its socket or last poll gone) is ended with reason
"idle"; a socket that ends leaves its session open for its client to reconnect.
``app.state.drain`` ends every stream cleanly on shutdown (`DrainingServer`): the
scheduler is held (`StreamScheduler.hold`: no chunk is made any more), every socket
(and long poll) sends its queued chunks and an end message with reason "shutdown".
With a ``state_dir`` the sessions then stay open: once the loop has stopped they are
written there (`StreamScheduler.save_sessions`), and the next app over the same folder
opens them again at startup (`StreamScheduler.restore_sessions`), each waiting
``idle_timeout`` seconds for its client to reconnect. With ``checkpoint_every`` N too,
every session is also written there every N chunks as it goes (`Checkpoints`), so a
server killed outright (SIGKILL, out of memory) restarts them from their last
checkpoint.
(No ``from __future__ import annotations``: FastAPI reads the routes' annotations.
FastAPI, pydantic and uvicorn are imported when an app is built, so the command line
parses without the ``serve`` extra.)
"""
import asyncio
import collections
import contextlib
import functools
import logging
import os
import pathlib
import threading
import time

import framekv

from .errors import error_handlers
from .frames_in import video_in
from .metrics import metrics_registry, render
from .wire import BODY_TIMEOUT_S, PROMPT_DTYPES, RequestError, chunk_frame, frames_message

OUTPUTS = ("frames", "latents")
FRAME_FORMATS = ("jpeg", "webp")
MAX_FPS = 240            # the page's frame rate at most
IDLE_TIMEOUT_S = 60.0    # seconds a session may go without a socket
API_DOC = ("Streaming sessions of an autoregressive video model. Create a session (POST "
           "/v1/sessions), then connect to WS /v1/sessions/{id}/stream: one binary message "
           "per chunk (a 4-byte big-endian header length, a JSON header, the payload), "
           "each acknowledged by the client {\"type\": \"ack\", \"index\"}; text "
           "control messages {\"type\": \"prompt\" | \"pause\" | \"resume\"}, a "
           "prompt change answered {\"type\": \"prompt_ack\", \"prompt_version\", "
           "\"applies_from\"} once it took, a last {\"type\": \"end\"}. A session "
           "outlives its socket: reconnect with ?after=<last index>. The socket takes "
           "?token= where the server has a token; it closes 1008 for a bad token, 4404 "
           "for an unknown session, 4409 for a second socket. Without WebSockets: GET "
           "/v1/sessions/{id}/chunks?after=<last index>&wait=<s>, a long poll answering "
           "the next chunk (the same binary message), 204 when none came, the end "
           "message as JSON.")
log = logging.getLogger("framekv.serve")


def state_dir_path(state_dir) -> pathlib.Path:
    """``state_dir`` as a folder that exists (made, parents too, if it does not); a
    ValueError naming ``state_dir`` for a path that is not a folder or cannot be made."""
    path = pathlib.Path(os.fspath(state_dir))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"state_dir must be a folder the server can write, got "
                         f"{str(path)!r}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"state_dir must be a folder the server can write, got "
                         f"{str(path)!r}: not writable")
    return path


def page_html(name: str = "index.html") -> str:
    """A page of ``tools/serve/page/`` (package data): the page at ``/`` by default."""
    from importlib.resources import files

    return (files("framekv.tools.serve") / "page" / name).read_text(encoding="utf-8")


def _check_options(sched, output, frame_format, fps, quality, token, idle_timeout) -> str:
    import argparse
    import math

    from ..args import bearer_token

    output = output or ("frames" if sched.decoding else "latents")
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
    if output == "frames" and not sched.decoding:
        raise ValueError("output='frames' needs a scheduler with a decoder "
                         "(decoder_factory), got one without")
    if output == "latents" and not getattr(sched, "host_latents", True):
        raise ValueError("output='latents' needs a scheduler whose chunks carry their latents "
                         "to the host (host_latents=True), got one whose decoder keeps them "
                         "on the device")
    if frame_format not in FRAME_FORMATS:
        raise ValueError(f"frame_format must be one of {FRAME_FORMATS}, got {frame_format!r}")
    for name, v, hi in (("fps", fps, MAX_FPS), ("quality", quality, 100)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise ValueError(f"{name} must be an integer in [1, {hi}], got {v!r}")
    if isinstance(idle_timeout, bool) or not isinstance(idle_timeout, (int, float)) \
            or not (math.isfinite(idle_timeout) and idle_timeout > 0):
        raise ValueError(f"idle_timeout must be a finite number of seconds > 0, got "
                         f"{idle_timeout!r}")
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
    ids), the long polls waiting (session id -> how many), the sessions created and
    not yet connected or polled (id -> since when), whether the server drains, the
    folder sessions are kept in over a restart (None: they end)."""

    def __init__(self, sched, auth, *, body_timeout, output, encode, fps, frame_format,
                 idle_timeout, model, state_dir=None, origins=None):
        self.sched, self.auth, self.body_timeout, self.output = sched, auth, body_timeout, output
        self.origins = origins
        self.encode, self.fps, self.frame_format = encode, fps, frame_format
        self.idle_timeout, self.model, self.state_dir = float(idle_timeout), model, state_dir
        self.streams: set[str] = set()
        self.polling: collections.Counter = collections.Counter()
        self.unattached: dict[str, float] = {}
        self.draining = threading.Event()

    def check_open(self) -> None:
        """503 once the server drains: no new sessions."""
        if self.draining.is_set():
            raise RequestError(503, "the server is shutting down: no new sessions")

    async def drain(self, timeout: float) -> None:
        """Hold the scheduler (no chunk is made from here on), end every open stream
        (`Reader`: queued chunks, then an end message with reason "shutdown") and wait
        for their sockets and long polls, at most ``timeout`` s."""
        await asyncio.to_thread(self.sched.hold)
        self.draining.set()
        deadline = time.monotonic() + timeout
        while (self.streams or self.polling) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def reap_idle(self) -> None:
        """Forever: end (reason "idle") each session without a socket or a long poll
        for ``idle_timeout`` s (never connected, or its socket or last poll gone);
        forget those that ended otherwise."""
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout / 4))
            now, idle = time.monotonic(), []
            for sid, since in list(self.unattached.items()):
                gone = sid not in self.sched.sessions
                if gone or now - since >= self.idle_timeout:
                    del self.unattached[sid]
                    if not gone:
                        idle.append(sid)
            if idle:
                await asyncio.to_thread(self._close_all, idle, "idle", self.streams)

    def restore_sessions(self) -> None:
        """Open the sessions kept in ``state_dir`` again; each waits ``idle_timeout``
        seconds for its client (then it ends, reason "idle")."""
        ids = self.sched.restore_sessions(self.state_dir,
                                          keep_files=self.sched.checkpoints is not None)
        now = time.monotonic()
        for sid in ids:
            self.unattached[sid] = now
        log.info("restored %d sessions from %s", len(ids), self.state_dir)

    def save_sessions(self) -> None:
        """Write the open sessions to ``state_dir`` (the loop stopped)."""
        saved = self.sched.save_sessions(self.state_dir)
        log.info("saved %d of %d open sessions to %s", len(saved), len(self.sched.sessions),
                 self.state_dir)

    def _close_all(self, ids, reason: str, skip=(), keep_files: bool = False) -> None:
        """Close the sessions ``ids`` not in ``skip`` (a socket took them meanwhile) nor
        polled now, and still open; ``keep_files``: their saved files stay (a shutdown
        that kept them)."""
        if keep_files:
            self.sched.checkpoints = None   # closed: a close must not remove the files
        for sid in ids:
            if sid not in skip and not self.polling.get(sid):
                with contextlib.suppress(KeyError):       # ended meanwhile
                    self.sched.close_session(sid, reason)

    def health(self):
        """/health: 200 while the GPU loop runs and the server takes sessions ("ok", or
        "degraded" with the ``reason`` where a cluster's replicas are up but none takes
        new sessions), else 503 with ``error`` saying why."""
        from fastapi.responses import JSONResponse

        s = self.sched
        body = {"sessions": len(s.sessions), "max_sessions": s.max_sessions,
                "output": self.output, "fps": self.fps, "token": self.auth.enabled,
                "text": s.text_prompts}
        error = (f"the GPU loop stopped: {s.loop_error}" if s.loop_error is not None
                 else "the server is shutting down" if self.draining.is_set() else None)
        if error is not None:
            return JSONResponse({"status": "error", "error": error, **body}, 503)
        degraded = getattr(s, "degraded", None)     # a cluster whose replicas all drain
        return {"status": "ok", **body} if degraded is None else {
            "status": "degraded", "reason": degraded, **body}

    def info(self) -> dict:
        """/v1/info (`ServerInfo`)."""
        s, F = self.sched, self.sched.frames_per_chunk
        video = ({"first": s.decoder.video_frames(F, True),
                  "later": s.decoder.video_frames(F, False)} if s.decoding else None)
        return {"model": self.model,
                "prompt": {"shape": list(s.prompt_shape), "dtype": str(s.runner.dtype).removeprefix("torch."),
                           "upload_dtypes": sorted({v[0] for v in PROMPT_DTYPES.values()}),
                           "text": s.text_prompts},
                "latents": {"layout": ["C", "F", "H", "W"], "shape": list(s.chunk_shape),
                            "dtype": "float32"},
                "frames_per_chunk": F, "video_frames_per_chunk": video, "fps": self.fps,
                "output": self.output,
                "frame_format": self.frame_format if self.output == "frames" else None,
                "max_sessions": s.max_sessions, "slots": s.slots,
                "queue_chunks": s.queue_chunks,
                "session_idle_timeout": self.idle_timeout, "video_in": video_in(s),
                **({"replicas": [{k: v for k, v in r.items() if k != "pid"}
                                 for r in s.replica_info()]}
                   if hasattr(s, "replica_info") else {})}


def build_app(sched, *, token: str | None = None, body_timeout: float = BODY_TIMEOUT_S,
              output: str | None = None, frame_format: str = "jpeg", fps: int = 16,
              quality: int = 85, idle_timeout: float = IDLE_TIMEOUT_S,
              model: str | None = None, state_dir=None, checkpoint_every: int | None = None,
              allowed_origins=None):
    """The FastAPI app over ``sched``; its lifespan runs the GPU loop thread and the idle
    reaper, and at its end closes every session left (reason "shutdown").

    ``output``: "frames" (images of the decoded video, ``frame_format`` at JPEG/WebP
    ``quality``; needs a scheduler with a decoder) or "latents"; default frames where
    the scheduler decodes. ``fps``: the video's frame rate, which the page plays at.
    ``token``: printable ASCII without spaces (ValueError otherwise), or None: no auth.
    ``idle_timeout``: seconds a session may go without a socket. ``model``: its name in
    /v1/info (default the runner's class). ``state_dir``: None, or a folder (made if
    missing; ValueError if it cannot be) the open sessions are written to on shutdown
    and opened again from at startup (module doc); ``checkpoint_every``: None, or N:
    each session written there every N chunks too (needs ``state_dir``).
    ``allowed_origins``: None, or origins (``http(s)://host[:port]``, or ``*`` for any;
    a list, or a comma-separated string) whose pages may open WebSockets besides the
    server's own origin; a client that sends no Origin is not checked. Installs
    `redact_tokens` on uvicorn's loggers.
    """
    from fastapi import FastAPI

    from .auth import BearerAuth, OriginCheck
    from .net import redact_tokens
    from .poll import poll_routes
    from .routes import session_routes, stream_route

    output = _check_options(sched, output, frame_format, fps, quality, token, idle_timeout)
    origins = OriginCheck.parse(allowed_origins)
    state_dir = None if state_dir is None else state_dir_path(state_dir)
    if checkpoint_every is not None:
        from framekv.engine.serving import Checkpoints

        if state_dir is None:
            raise ValueError(f"checkpoint_every needs a state_dir to write to, got "
                             f"checkpoint_every={checkpoint_every!r} and no state_dir")
        sched.checkpoints = Checkpoints(state_dir, checkpoint_every)
    encode = (chunk_frame if output == "latents"
              else functools.partial(frames_message, fmt=frame_format, quality=quality))
    srv = _Server(sched, BearerAuth(token), body_timeout=body_timeout, output=output,
                  encode=encode, fps=fps, frame_format=frame_format,
                  idle_timeout=idle_timeout, model=model or type(sched.runner).__name__,
                  state_dir=state_dir, origins=origins)
    app = FastAPI(title="framekv", version=framekv.__version__, description=API_DOC,
                  lifespan=_lifespan(srv), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.drain = srv.drain
    redact_tokens()
    error_handlers(app)
    _http_routes(app, srv, page_html())
    session_routes(app, srv)
    stream_route(app, srv)
    poll_routes(app, srv)
    _docs_routes(app, srv, page_html("docs.html"))
    return app


def _lifespan(srv: _Server):
    """The app's lifespan: the sessions kept in ``state_dir`` opened again, then the GPU
    loop thread and the idle reaper run while it serves; then both stop, the open
    sessions are written to ``state_dir`` and every session left is closed (reason
    "shutdown")."""
    sched, stop = srv.sched, threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if srv.state_dir is not None:
            await asyncio.to_thread(srv.restore_sessions)
        loop = threading.Thread(target=sched.run, args=(stop,), name="framekv-gpu", daemon=True)
        loop.start()
        reaper = asyncio.create_task(srv.reap_idle())
        yield
        reaper.cancel()
        stop.set()
        loop.join()
        if sched.checkpoints is not None:
            sched.checkpoints.close()       # what it was writing lands first
        if srv.state_dir is not None:
            await asyncio.to_thread(srv.save_sessions)
        await asyncio.to_thread(srv._close_all, list(sched.sessions), "shutdown",
                                keep_files=srv.state_dir is not None)
    return lifespan


def _http_routes(app, srv: _Server, page: str) -> None:
    from fastapi import Depends, Request
    from fastapi.responses import HTMLResponse, PlainTextResponse, Response

    from .models import Health, ServerInfo, errors

    registry, auth = metrics_registry(srv.sched), [Depends(srv.auth.dependency())]

    @app.get("/", response_class=HTMLResponse, summary="The page: watch and steer a stream")
    async def index():
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    script = page_html("camera.js")

    @app.get("/camera.js", include_in_schema=False)
    async def camera_js():                   # the page's camera source
        return Response(script, media_type="text/javascript",
                        headers={"Cache-Control": "no-store"})

    @app.get("/health", response_model=Health, response_model_exclude_none=True,
             responses={503: {"model": Health}},
             summary="Liveness: 503 once the GPU loop died or while shutting down")
    async def health():
        return srv.health()

    @app.get("/metrics", response_class=PlainTextResponse, dependencies=auth,
             responses=errors(401, plain=True),
             summary="Prometheus metrics (text or OpenMetrics)")
    async def metrics(request: Request):
        body, content_type = await asyncio.to_thread(render, registry,
                                                     request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/v1/info", response_model=ServerInfo, dependencies=auth, responses=errors(401),
             response_model_exclude_unset=True,
             summary="What the server streams: model, prompt and chunk shapes, output")
    async def info():
        return await asyncio.to_thread(srv.info)


def _docs_routes(app, srv: _Server, page: str) -> None:
    """/openapi.json and /docs (the local page), behind the token where there is one
    (header or ``?token=``, which the page passes on to its fetch of /openapi.json)."""
    from fastapi import Request
    from fastapi.responses import HTMLResponse, JSONResponse

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request):
        srv.auth.check_connection(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request):
        srv.auth.check_connection(request)
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})
