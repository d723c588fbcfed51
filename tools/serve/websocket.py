"""One session's WebSocket in `framekv serve` (`serve_socket`): the framing and the socket
only. What it sends is what the session's `Reader` hands out (its chunks as they come,
binary; its end message, text); what it receives, acknowledgements and control
messages, it applies.

The messages are those of `framekv.tools.serve`'s module doc. The client acknowledges
chunks with ``{"type": "ack", "index": i}`` (every chunk up to i): a chunk stays the
session's until acknowledged, and a session with ``queue_chunks`` chunks unacknowledged
(sent or not) makes no more, so a client that stops reading stops its stream. Other
control messages are JSON text too; bad JSON or a bad value is answered
``{"type": "error", "error", "status"}`` (the HTTP status the same fault has on the
long poll) and the session goes on. A binary message from the client is a video
session's frames (``frames_in``, `framekv.tools.serve.frames_in`): taken without an
answer, or, when bad (or the session takes no frames), answered ``{"type": "error",
"error", "status", "about": "frames_in"}`` (``about`` tells a refusal of frames from
a control message's answer, which a client may be waiting for), with the message's
``"id"`` where its header gave one; the session goes on.
A prompt change is answered ``{"type": "prompt_ack", "prompt_version",
"applies_from"}`` once it took (chunks from index ``applies_from`` on are made under
it), or ``{"type": "error"}`` if its re-cache failed (the session goes on under its old
prompt).

A socket that closes leaves its session open: it ends by DELETE, its chunk budget (once
every chunk is acknowledged: then the end message), the idle timeout, or an error. A
client reconnects by id (``?after=i``: the last index it has) and gets the
unacknowledged chunks after i, then new ones; an i beyond the last chunk made (a
server resumed from a checkpoint older than what the client got) is closed 4422, the
reason naming the last index made: the client reconnects after that one and skips,
acknowledging them, the chunks it has. The last message is ``{"type": "end",
"state", "error"}``, with a ``"reason"`` when the session did not end by itself:
"shutdown" when the server drains (``"resumable": true`` where the server keeps its
sessions over a restart), "deleted" or "idle" when it was closed under the socket.
"""
import asyncio
import contextlib
import json

from .frames_in import NoFrames, frames_id, take_frames
from .reader import Superseded, apply_control
from .wire import RequestError, json_body

#: the socket's close code once the server drains (going away)
GOING_AWAY = 1001
#: a socket whose ``after`` is not a chunk index, or none made, is closed with this code
BAD_AFTER = 4422


async def serve_socket(ws, reader, *, after: int | None = None) -> None:
    """Send what ``reader`` (a `framekv.tools.serve.reader.Reader` of the session) hands
    out, from the first chunk after ``after``: each chunk as a binary message, then the
    end message as text; apply the client's acknowledgements and control messages.
    Once the server drains, its queued chunks go out, then an end message with reason
    "shutdown", and the socket closes (1001). The session stays open when the socket
    goes (module doc). An ``after`` beyond the chunks made closes the socket
    `BAD_AFTER`, the reason naming the last index made."""
    from fastapi import WebSocketDisconnect

    try:
        await reader.open(after)
    except KeyError:                          # closed meanwhile: the end says how
        pass
    except ValueError as exc:                 # at most 123 bytes
        reason = str(exc).encode()[:123].decode(errors="ignore")
        return await ws.close(code=BAD_AFTER, reason=reason)
    tasks = [asyncio.create_task(_send(ws, reader)),
             asyncio.create_task(_receive(ws, reader.sched, reader.sid))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t.exception() is not None and not isinstance(t.exception(), WebSocketDisconnect):
                raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        if not _client_gone(ws):   # a close sent after the client's own goes nowhere
            with contextlib.suppress(Exception):
                await ws.close(GOING_AWAY if reader.draining.is_set() else 1000)


def _client_gone(ws) -> bool:
    """Whether the client has closed the socket (its close, or the connection lost): a
    proxy in front of the app (Ray Serve's) fails on a message for a client gone."""
    from starlette.websockets import WebSocketState

    return ws.client_state == WebSocketState.DISCONNECTED


async def _send(ws, reader) -> None:
    """Each message ``reader`` hands out, until the end; a socket replaced by another
    reader of its session sends nothing more."""
    while True:
        try:
            msg = await reader.next()
        except Superseded:
            return
        if isinstance(msg, bytes):
            await ws.send_bytes(msg)
        elif msg is not None:
            return await ws.send_text(json.dumps(msg))


async def _receive(ws, sched, sid: str) -> None:
    from fastapi import WebSocketDisconnect

    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(msg.get("code", 1000), msg.get("reason"))
        try:
            if msg.get("text") is None:           # a video session's frames
                await _frames(sched, sid, msg.get("bytes") or b"")
                continue
            change = await apply_control(sched, sid, json_body(msg["text"].encode()))
        except KeyError:  # the session ended meanwhile: the sender says how
            return await asyncio.Event().wait()
        except RequestError as exc:
            reply = {"type": "error", "error": exc.message, "status": exc.status}
            if msg.get("text") is None:
                reply["about"] = "frames_in"
                ident = frames_id(msg.get("bytes") or b"")
                if ident is not None:
                    reply["id"] = ident
            await ws.send_text(json.dumps(reply))
            continue
        if change is not None:          # answered once it took
            asyncio.ensure_future(_prompt_reply(ws, change))


async def _frames(sched, sid: str, raw: bytes) -> None:
    """A binary message: a video session's frames; for a session that takes none, the
    error says what the socket takes from it instead."""
    try:
        await take_frames(sched, sid, raw)
    except NoFrames as exc:
        raise RequestError(400, f"a control message must be JSON text, got a binary message "
                                f"of {len(raw)} bytes ({exc.message})") from None


async def _prompt_reply(ws, change) -> None:
    """Once ``change`` took: its ack, or the error its re-cache raised."""
    try:
        await asyncio.wrap_future(change.future)
        reply = {"type": "prompt_ack", "prompt_version": change.version,
                 "applies_from": change.applies_from}
    except KeyError:                    # the session ended first: the sender says how
        return
    except Exception as exc:
        reply = {"type": "error", "error": f"the prompt change failed, the session goes on "
                                           f"under its old prompt: {type(exc).__name__}: {exc}"}
    with contextlib.suppress(Exception):
        await ws.send_text(json.dumps(reply))
