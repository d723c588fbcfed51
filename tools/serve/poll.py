"""The long-poll transport of `framekv serve` (`poll_routes`), for scripts, proxies and
load balancers that do not take WebSockets: chunks out by ``GET
/v1/sessions/{id}/chunks?after=I&wait=S``, control messages in by ``POST
/v1/sessions/{id}/control``, a video session's frames in by ``POST
/v1/sessions/{id}/frames``.

One request answers the next chunk after index I (the last index the client has;
absent: the oldest chunk not yet acknowledged) and acknowledges every index up to I::

    200 application/octet-stream  the chunk: byte for byte the socket's binary message
    204                           no chunk came within S seconds (default 10, at most 60)
    200 application/json          the socket's end message, once the session finished
                                  and every chunk is acknowledged (or it ended under
                                  the request, or the server drains: its queued chunks
                                  first, then the end with reason "shutdown")
    404                           no such session open (GET /v1/sessions/{id}: how it
                                  ended)
    409                           a socket streams the session (it gets `TAKEN_WAIT_S`
                                  to end first, as for a second socket), or a later
                                  request or a socket took it while this one waited
    422                           an I beyond the chunks made (the message names the
                                  last one, as the socket's 4422), a bad I or S
    403                           a browser page of another origin (`OriginCheck`)

Each request is a reader of its own (`Reader`): a request whose answer was lost is
asked again with the same I and answers the same chunk, and a later request takes the
session from one still waiting. A session polled is not idle; its idle clock runs from
the end of its last request. The token and the error shape are every route's; every
answer carries ``Cache-Control: no-store``.

``POST .../control`` takes one of the socket's control messages as its JSON body
(`framekv.tools.serve.reader.apply_control`; read as ``POST /v1/sessions``' body is): an ack, a
pause or a resume is answered 204; a prompt as ``PUT .../prompt`` answers (200
``prompt_ack`` once it took, 202 ``prompt_pending``, 500 if its re-cache failed).
``POST .../frames`` takes a video session's frames, one ``frames_in`` message (the
socket's binary message, `framekv.tools.serve.frames_in`) as its raw body (at most
`MAX_FRAMES_BYTES`): 200 with the session's input counts (`FramesIn`); 400, 413 or 422
for a bad message, 409 for a session that takes no frames, 404 for one not open.
A browser page of another origin is refused 403 on every route.
(No ``from __future__ import annotations``: FastAPI reads the routes' annotations.)
"""
import asyncio
import contextlib
import time

from fastapi import Body, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from .frames_in import MAX_FRAMES_BYTES, take_frames
from .models import ErrorBody, FramesIn, PromptAck, errors
from .reader import Reader, Superseded, apply_control
from .routes import json_body_route, not_open, prompt_answer, socket_gone
from .wire import RequestError, read_body

#: seconds a long poll waits for a chunk by default, and at most
POLL_WAIT_S, MAX_POLL_WAIT_S = 10.0, 60.0
NO_STORE = {"Cache-Control": "no-store"}
RESPONSES = {
    200: {"description": "The chunk (its binary message), or the end message (JSON).",
          "content": {"application/octet-stream": {"schema": {"type": "string",
                                                              "format": "binary"}},
                      "application/json": {"schema": {"type": "object"}}}},
    204: {"description": "No chunk came within the wait: ask again with the same after."},
    409: {"model": ErrorBody, "description": "A socket streams the session, or a later "
                                             "request took it: one reader at a time."},
    403: {"model": ErrorBody, "description": "A browser page of another origin than the "
                                             "server's (or --allowed-origins)."},
    **errors(401, 404, 422)}
FRAMES_BODY = {"requestBody": {"required": True, "description": "One frames_in message "
               "(framekv.tools.serve.frames_in): [uint32 BE header length][JSON header]"
               "[images or rgb24 bytes]", "content": {"application/octet-stream": {
                   "schema": {"type": "string", "format": "binary"}}}}}
CONTROL_EXAMPLES = [{"type": "ack", "index": 3}, {"type": "pause"}, {"type": "resume"},
                    {"type": "prompt", "text": "a red fox in snow"}]


def poll_routes(app, srv) -> None:
    """GET /v1/sessions/{id}/chunks, POST /v1/sessions/{id}/control and POST
    /v1/sessions/{id}/frames (module doc)."""

    async def control(request: Request, sid: str,
                      msg: dict = Body(..., examples=CONTROL_EXAMPLES)):
        _check_origin(srv, request)
        if sid not in srv.sched.sessions:
            raise await asyncio.to_thread(not_open, srv, sid)
        try:
            change = await apply_control(srv.sched, sid, msg)
        except KeyError:
            raise await asyncio.to_thread(not_open, srv, sid) from None
        if change is None:
            return Response(status_code=204, headers=NO_STORE)
        return await prompt_answer(srv, sid, change)

    app.router.add_api_route(
        "/v1/sessions/{sid}/control", control, methods=["POST"], response_model=PromptAck,
        dependencies=[Depends(srv.auth.dependency())], strict_content_type=False,
        route_class_override=json_body_route(srv.auth, srv.body_timeout),
        responses={204: {"description": "An ack, pause or resume applied."},
                   403: RESPONSES[403], **errors(400, 401, 404, 408, 411, 413, 422)},
        summary="A control message (ack, prompt, pause, resume) without a socket")

    @app.post("/v1/sessions/{sid}/frames", response_model=FramesIn, openapi_extra=FRAMES_BODY,
              dependencies=[Depends(srv.auth.dependency())],
              responses={403: RESPONSES[403], **errors(400, 401, 404, 408, 409, 411, 413, 422)},
              summary="A video session's frames: one frames_in message as the body")
    async def frames(request: Request, sid: str):
        _check_origin(srv, request)
        if sid not in srv.sched.sessions:
            raise await asyncio.to_thread(not_open, srv, sid)
        raw = await read_body(request, srv.body_timeout, cap=MAX_FRAMES_BYTES)
        try:
            return await take_frames(srv.sched, sid, raw)
        except KeyError:
            raise await asyncio.to_thread(not_open, srv, sid) from None

    @app.get("/v1/sessions/{sid}/chunks", response_class=Response, responses=RESPONSES,
             dependencies=[Depends(srv.auth.dependency())],
             summary="Long poll: the next chunk after index after (acknowledging up to "
                     "it), 204 when none came, or the end message")
    async def chunks(request: Request, sid: str,
                     after: int | None = Query(None, description="The last chunk index "
                                               "the client has (-1: none); absent: the "
                                               "oldest chunk not yet acknowledged."),
                     wait: float = Query(POLL_WAIT_S, ge=0, le=MAX_POLL_WAIT_S,
                                         description="Seconds to wait for a chunk.")):
        _check_origin(srv, request)
        if sid not in srv.sched.sessions:
            raise await asyncio.to_thread(not_open, srv, sid)
        if not await socket_gone(srv, sid):
            raise RequestError(409, f"session {sid[:64]!r} already has a stream (a "
                                    "socket): one reader at a time")
        with _polled(srv, sid):
            msg = await _next(srv, sid, after, wait)
        if msg is None:
            return Response(status_code=204, headers=NO_STORE)
        if isinstance(msg, bytes):
            return Response(msg, media_type="application/octet-stream", headers=NO_STORE)
        return JSONResponse(msg, headers=NO_STORE)


def _check_origin(srv, request) -> None:
    """403 for a browser page of another origin (`OriginCheck`, as for a socket)."""
    refusal = srv.origins.refusal(request)
    if refusal is not None:
        raise RequestError(403, refusal)


async def _next(srv, sid: str, after, wait: float):
    """A new reader of ``sid`` after ``after``, and what it hands out within ``wait`` s;
    the refusals as the route's errors."""
    reader = Reader(srv.sched, sid, srv.encode, srv.draining, srv.state_dir is not None)
    try:
        await reader.open(after)
    except KeyError:
        raise await asyncio.to_thread(not_open, srv, sid) from None
    except ValueError as exc:
        raise RequestError(422, str(exc)) from None
    try:
        return await reader.next(wait)
    except Superseded:
        raise RequestError(409, f"a later request or a socket took session {sid[:64]!r} "
                                "while this one waited: one reader at a time") from None


@contextlib.contextmanager
def _polled(srv, sid: str):
    """Session ``sid`` counted polled while the block runs (not idle); its idle clock
    restarted after the last poll, where no socket took it."""
    srv.polling[sid] += 1
    srv.unattached.pop(sid, None)
    try:
        yield
    finally:
        srv.polling[sid] -= 1
        if srv.polling[sid] <= 0:
            del srv.polling[sid]
            if sid not in srv.streams and sid in srv.sched.sessions:
                srv.unattached[sid] = time.monotonic()
