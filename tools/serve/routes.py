"""The session routes of `framekv serve` (`session_routes`, `stream_route`): create, read,
delete a session, upload its prompt, stream it.

``POST /v1/sessions`` reads its JSON body itself (`JSONBodyRoute`: the token and the
drain checked first, then at most 1 MiB counted as it arrives, then strict JSON) and
FastAPI validates it against `CreateSession`. ``DELETE`` is idempotent: 204 while the
session is open, 404 after (also when a socket closing ends it first). ``PUT
.../prompt`` takes the raw prompt (`framekv.tools.serve.wire.upload_spec`), its body
capped at the prompt's byte size; it answers once the change took (200, or 500 if its
re-cache failed: the session goes on under its old prompt), or after `PROMPT_WAIT_S`
with 202 ``prompt_pending`` (a paused or swapped-out session takes it as it comes
back). The socket (``?after=i``: the last chunk index the client has) is accepted, then
closed with a code and a reason when refused: 1008 (a page of a foreign origin,
`OriginCheck`; the token), 4404 (no such session
open), 4409 (it still has a socket `TAKEN_WAIT_S` after this one came: a reconnect may
come before the old socket's end is seen), 4422 (an ``after`` that is not the index of
a chunk made: the reason names the last one). A session whose
socket closes stays open, its idle clock running.
(No ``from __future__ import annotations``: FastAPI reads the routes' annotations.)
"""
import asyncio
import time

from fastapi import Depends, Header, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from .auth import WS_AUTH_CLOSE
from .models import CreateSession, PromptAck, SessionCreated, SessionInfo, errors
from .reader import Reader
from .websocket import BAD_AFTER, serve_socket
from .wire import RequestError, json_body, parse_prompt, read_body, upload_prompt, upload_spec

#: a socket for a session that is not open is closed with this code (and a reason)
NO_SESSION = 4404
#: a second socket on a session is closed with this code (and a reason)
SESSION_TAKEN = 4409
#: seconds a second socket waits for the session's socket to end before its 4409
TAKEN_WAIT_S = 3.0
#: seconds PUT .../prompt waits for the change to take before answering 202
PROMPT_WAIT_S = 10.0
RAW_PROMPT = {"requestBody": {"required": True, "description": "L x text_dim values, "
              "little-endian, C order, of X-Prompt-Dtype", "content": {
                  "application/octet-stream": {"schema": {"type": "string",
                                                          "format": "binary"}}}}}


def json_body_route(auth, body_timeout: float, check=None, *, optional: bool = False):
    """An `APIRoute` class whose request body is read before FastAPI parses it: the
    token (``auth``, a `BearerAuth`) and ``check()`` first, then `read_body` (1 MiB,
    counted as it arrives, in ``body_timeout`` s) and `json_body` (strict JSON, a JSON
    object: 400 naming the fault). ``optional``: a request with neither Content-Length
    nor Transfer-Encoding has an empty body (HTTP's rule), taken as ``{}``."""

    class JSONBodyRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def read_first(request: Request):
                auth.check(request.headers.get("authorization"))
                if check is not None:
                    check()
                raw = await read_body(request, body_timeout, optional=optional)
                json_body(raw)
                return await handler(Request(request.scope, _replay(raw, request.receive)))
            return read_first
    return JSONBodyRoute


def _replay(raw: bytes, receive):
    """An ASGI ``receive`` that hands out ``raw`` as the whole body, then defers to
    ``receive`` (a disconnect)."""
    sent = []

    async def replay():
        if sent:
            return await receive()
        sent.append(True)
        return {"type": "http.request", "body": raw, "more_body": False}
    return replay


def not_open(srv, sid: str) -> RequestError:
    """404 for a session that is not open, saying how it ended if the server knows."""
    info = srv.sched.session_info(sid)
    how = f": it ended ({info['end_reason']})" if info else ""
    return RequestError(404, f"no such session open: {sid[:64]!r}{how}")


async def socket_gone(srv, sid: str) -> bool:
    """Whether session ``sid`` has no socket, its socket given `TAKEN_WAIT_S` to end: a
    reconnect can come before the server has seen its old socket go."""
    deadline = time.monotonic() + TAKEN_WAIT_S
    while sid in srv.streams and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return sid not in srv.streams


def session_routes(app, srv) -> None:
    """POST, GET and DELETE /v1/sessions[/{id}] and PUT /v1/sessions/{id}/prompt."""
    auth = [Depends(srv.auth.dependency())]
    app.router.add_api_route(
        "/v1/sessions", _creator(srv), methods=["POST"], status_code=201,
        response_model=SessionCreated, dependencies=auth, strict_content_type=False,
        route_class_override=json_body_route(srv.auth, srv.body_timeout, srv.check_open),
        summary="Open a session",
        responses=errors(400, 401, 408, 411, 413, 422, 503))

    @app.get("/v1/sessions/{sid}", response_model=SessionInfo, dependencies=auth,
             responses=errors(401, 404, 422),
             summary="A session's state, open or ended")
    async def read(sid: str):
        info = await asyncio.to_thread(srv.sched.session_info, sid)
        if info is None:
            raise RequestError(404, f"no such session: {sid[:64]!r} (unknown, or ended "
                                    "too long ago to be kept)")
        return {**info, "connected": sid in srv.streams}

    @app.delete("/v1/sessions/{sid}", status_code=204, response_class=Response,
                dependencies=auth, responses=errors(401, 404, 422),
                summary="End a session and free its slot (idempotent: 404 once ended)")
    async def delete(sid: str):
        srv.unattached.pop(sid, None)
        try:
            await asyncio.to_thread(srv.sched.close_session, sid, "deleted")
        except KeyError:                  # never open, or ended first (its socket closed)
            raise await asyncio.to_thread(not_open, srv, sid) from None
        return Response(status_code=204)

    @app.put("/v1/sessions/{sid}/prompt", response_model=PromptAck, dependencies=auth,
             openapi_extra=RAW_PROMPT, responses=errors(401, 404, 408, 409, 411, 413, 422),
             summary="Upload a prompt: raw bf16, fp16 or fp32 values")
    async def put_prompt(sid: str, request: Request,
                         shape: str = Header(alias="X-Prompt-Shape", description="L,D: the "
                                             "model's prompt shape (GET /v1/info)"),
                         dtype: str = Header(alias="X-Prompt-Dtype", description="bf16, "
                                             "fp16 or fp32")):
        return await _upload(srv, sid, request, shape, dtype)


def _creator(srv):
    async def create(body: CreateSession) -> SessionCreated:
        """Open a session (`CreateSession`); 503 with Retry-After when every slot is
        taken."""
        from framekv.engine.serving import LoopStopped, SchedulerFull

        prompt = parse_prompt(body.model_dump(exclude_none=True), srv.sched.prompt_shape)
        try:
            s = await asyncio.to_thread(srv.sched.open_session, seed=body.seed,
                                        chunks=body.chunks, prompt=prompt, paused=body.paused,
                                        **_video(body))
        except SchedulerFull as exc:
            raise RequestError(503, str(exc), {"Retry-After": "5"}) from None
        except LoopStopped as exc:
            raise RequestError(503, str(exc)) from None
        except ValueError as exc:
            raise RequestError(422, str(exc)) from None
        srv.unattached[s.id] = time.monotonic()
        return SessionCreated(id=s.id)
    return create


def _video(body) -> dict:
    """``open_session``'s ``video`` keyword of a `CreateSession` (none for text input:
    so a scheduler without video input takes it as ever); 422 for a strength without
    video input."""
    if body.input == "video":
        if body.strength is None:
            raise RequestError(422, "strength must be given with input video: a number in "
                                    "(0, 1] (the server's: GET /v1/info video_in.strength)")
        return {"video": body.strength}
    if body.strength is not None:
        raise RequestError(422, f"strength is for input video, got strength={body.strength!r} "
                                f"with input {body.input!r}")
    return {}


async def _upload(srv, sid: str, request, shape: str, dtype: str) -> PromptAck:
    """PUT .../prompt: the headers checked, the body read (capped at the prompt's
    bytes), the prompt set; its version and the first chunk under it."""
    from framekv.engine.serving import PromptTooLate

    s = await asyncio.to_thread(srv.sched.sessions.get, sid)
    if s is None:
        raise await asyncio.to_thread(not_open, srv, sid)
    dtype, nbytes = upload_spec(shape, dtype, srv.sched.prompt_shape)
    raw = await read_body(request, srv.body_timeout, cap=nbytes)
    prompt = upload_prompt(raw, dtype, srv.sched.prompt_shape)
    try:
        change = await asyncio.to_thread(srv.sched.set_prompt, sid, prompt)
    except KeyError:
        raise await asyncio.to_thread(not_open, srv, sid) from None
    except PromptTooLate as exc:                  # its last chunk is made: none would come
        raise RequestError(409, str(exc)) from None
    except ValueError as exc:
        raise RequestError(422, str(exc)) from None
    return await prompt_answer(srv, sid, change)


async def prompt_answer(srv, sid: str, change):
    """An HTTP answer to a prompt change of session ``sid``: its `PromptAck` once it
    took; 202 ``prompt_pending`` after `PROMPT_WAIT_S`; 404 when the session ended
    first; 500 when its re-cache failed (the session goes on under its old prompt)."""
    from framekv.engine.serving import PromptTooLate

    try:  # it takes at the session's next step boundary (off the pool: as it comes back)
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(change.future)),
                               PROMPT_WAIT_S)
    except asyncio.TimeoutError:
        return JSONResponse({"type": "prompt_pending", "prompt_version": change.version,
                             "applies_from": change.applies_from}, 202)
    except KeyError:
        raise await asyncio.to_thread(not_open, srv, sid) from None
    except PromptTooLate as exc:
        raise RequestError(409, str(exc)) from None
    except Exception as exc:
        raise RequestError(500, f"the prompt change failed, the session goes on under its "
                                f"old prompt: {type(exc).__name__}: {exc}") from None
    return PromptAck(prompt_version=change.version, applies_from=change.applies_from)


def stream_route(app, srv) -> None:
    """WS /v1/sessions/{id}/stream (`serve_socket`), one socket per session."""

    @app.websocket("/v1/sessions/{sid}/stream")
    async def stream(ws: WebSocket, sid: str):
        await ws.accept()
        refusal = srv.origins.refusal(ws)
        if refusal is not None:             # a page of another site: before anything else
            return await ws.close(code=WS_AUTH_CLOSE, reason=refusal)
        try:
            srv.auth.check_connection(ws)
        except RequestError as exc:
            return await ws.close(code=WS_AUTH_CLOSE, reason=exc.message)
        if sid not in srv.sched.sessions:
            why = (await asyncio.to_thread(not_open, srv, sid)).message
            reason = why.encode()[:123].decode(errors="ignore")     # at most 123 bytes
            return await ws.close(code=NO_SESSION, reason=reason)
        if not await socket_gone(srv, sid):   # checked, then taken with no await between
            return await ws.close(code=SESSION_TAKEN, reason="session already has a stream: "
                                                             "one socket per session")
        after = ws.query_params.get("after")
        if after is not None:
            try:
                after = int(after)
            except ValueError:
                return await ws.close(code=BAD_AFTER, reason="after must be a chunk index "
                                                             f"(an integer), got {after[:40]!r}")
        srv.streams.add(sid)
        srv.unattached.pop(sid, None)
        try:
            await serve_socket(ws, Reader(srv.sched, sid, srv.encode, srv.draining,
                                          srv.state_dir is not None), after=after)
        finally:
            srv.streams.discard(sid)
            if sid in srv.sched.sessions:   # it waits for its client: the idle clock runs
                srv.unattached[sid] = time.monotonic()
