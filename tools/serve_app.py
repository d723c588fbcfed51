"""The FastAPI app of `framekv serve` (`build_app`): its routes, the WebSocket stream of
a session and its control messages, the page at ``/``. The routes and messages are
those of `framekv.tools.serve`'s module doc; the chunk messages those of
`framekv.tools.serve_wire`.

The GPU loop (`StreamScheduler.run`) runs in a thread the app's lifespan starts and
stops. A session's sender fetches its chunks with `StreamScheduler.next_chunk` and
encodes images on a worker thread (never on the GPU loop, never on the event loop).
(No ``from __future__ import annotations``: FastAPI reads the routes' annotations.)
"""
import asyncio
import contextlib
import json
import secrets
import threading

from .serve_metrics import metrics_registry, render
from .serve_wire import (BODY_TIMEOUT_S, RequestError, chunk_frame, frames_message, json_body,
                         parse_prompt, read_body)

OUTPUTS = ("frames", "latents")
FRAME_FORMATS = ("jpeg", "webp")
SESSION_KEYS = {"seed", "chunks", "text", "prompt", "prompt_seed"}


def page_html() -> str:
    """The page served at ``/`` (``tools/page/index.html``, package data)."""
    from importlib.resources import files

    return (files("framekv.tools") / "page" / "index.html").read_text(encoding="utf-8")


def _check_options(sched, output, frame_format, fps, quality) -> str:
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
    return output


def build_app(sched, *, token: str | None = None, body_timeout: float = BODY_TIMEOUT_S,
              output: str | None = None, frame_format: str = "jpeg", fps: int = 16,
              quality: int = 85):
    """The FastAPI app over ``sched``; its lifespan runs the GPU loop thread.

    ``output``: "frames" (images of the decoded video, ``frame_format`` at JPEG/WebP
    ``quality``; needs a scheduler with a decoder) or "latents"; default frames where
    the scheduler decodes. ``fps``: the video's frame rate, which the page plays at.
    """
    from fastapi import FastAPI, Request, WebSocket
    from fastapi.responses import HTMLResponse, JSONResponse, Response

    output = _check_options(sched, output, frame_format, fps, quality)
    stop, registry, page = threading.Event(), metrics_registry(sched), page_html()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = threading.Thread(target=sched.run, args=(stop,), name="framekv-gpu", daemon=True)
        loop.start()
        yield
        stop.set()
        loop.join()
        for sid in list(sched.sessions):
            sched.close_session(sid)

    app = FastAPI(title="framekv", lifespan=lifespan)

    def check_token(auth: str | None) -> None:
        if token is not None and not (auth and secrets.compare_digest(auth, f"Bearer {token}")):
            raise RequestError(401, "missing or wrong bearer token")

    @app.exception_handler(RequestError)
    async def _err(request, exc: RequestError):
        return JSONResponse({"error": exc.message}, exc.status, headers=exc.headers)

    @app.get("/")
    async def index():
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/health")
    async def health():
        return {"status": "ok", "sessions": len(sched.sessions),
                "max_sessions": sched.max_sessions, "output": output, "fps": fps,
                "token": token is not None, "text": sched.text_prompts}

    @app.get("/metrics")
    async def metrics(request: Request):
        check_token(request.headers.get("authorization"))
        body, content_type = await asyncio.to_thread(render, registry,
                                                     request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.post("/v1/sessions", status_code=201)
    async def create(request: Request):
        check_token(request.headers.get("authorization"))
        return {"id": await _create(sched, json_body(await read_body(request, body_timeout)))}

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str, request: Request):
        check_token(request.headers.get("authorization"))
        if sid not in sched.sessions:
            raise RequestError(404, "no such session")
        await asyncio.to_thread(sched.close_session, sid)
        return Response(status_code=204)

    @app.websocket("/v1/sessions/{sid}/stream")
    async def stream(ws: WebSocket, sid: str):
        try:
            auth = ws.headers.get("authorization") or (
                f"Bearer {ws.query_params['token']}" if "token" in ws.query_params else None)
            check_token(auth)
            if sid not in sched.sessions:
                raise RequestError(404, "no such session")
        except RequestError as exc:
            await ws.close(code=1008, reason=exc.message)
            return
        await ws.accept()
        encode = (chunk_frame if output == "latents"
                  else lambda c: frames_message(c, frame_format, quality))
        await _serve_socket(ws, sched, sid, encode)

    return app


async def _create(sched, body: dict) -> str:
    """Open the session a POST body asks for; its id."""
    from framekv.engine.scheduler import SchedulerFull

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
    except ValueError as exc:
        raise RequestError(422, str(exc)) from None
    return s.id


async def _serve_socket(ws, sched, sid: str, encode) -> None:
    """Push the session's chunks as they come (``encode(chunk) -> bytes`` on a worker
    thread); apply its control messages; free the slot when the client goes."""
    from fastapi import WebSocketDisconnect

    async def send():
        while True:
            chunk = await asyncio.to_thread(sched.next_chunk, sid, 0.25)
            if chunk is not None:
                await ws.send_bytes(await asyncio.to_thread(encode, chunk))
                continue
            s = sched.sessions.get(sid)
            if s is None or s.finished:
                await ws.send_text(json.dumps({"type": "end", "state": s.state if s else "closed",
                                               "error": s.error if s else None}))
                return

    async def receive():
        while True:
            text = await ws.receive_text()
            try:
                reply = await _control(sched, sid, json_body(text.encode()))
            except KeyError:  # the session ended meanwhile: the sender says how
                return await asyncio.Event().wait()
            except RequestError as exc:
                reply = {"type": "error", "error": exc.message}
            if reply is not None:
                await ws.send_text(json.dumps(reply))

    tasks = [asyncio.create_task(send()), asyncio.create_task(receive())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t.exception() is not None and not isinstance(t.exception(), WebSocketDisconnect):
                raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        if sid in sched.sessions:
            await asyncio.to_thread(sched.close_session, sid)
        with contextlib.suppress(Exception):
            await ws.close()


async def _control(sched, sid: str, msg: dict) -> dict | None:
    """Apply one control message; the reply to send (a prompt change: its version)."""
    kind = msg.get("type")
    if kind == "pause" or kind == "resume":
        await asyncio.to_thread(sched.pause, sid, kind == "pause")
        return None
    if kind != "prompt":
        raise RequestError(422, f"type must be prompt, pause or resume, got {kind!r}")
    prompt = parse_prompt(msg, sched.prompt_shape)
    if prompt is None:
        raise RequestError(422, "a prompt message needs text, prompt_seed or prompt")
    try:
        version = await asyncio.to_thread(sched.set_prompt, sid, prompt)
    except ValueError as exc:
        raise RequestError(422, str(exc)) from None
    return {"type": "prompt", "prompt_version": version}
