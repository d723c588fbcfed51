"""One session's WebSocket in `framekv serve` (`serve_socket`): its chunks pushed as they
come, its acknowledgements and control messages applied, its end message.

The messages are those of `framekv.tools.serve`'s module doc. The client acknowledges
chunks with ``{"type": "ack", "index": i}`` (every chunk up to i): a chunk stays the
session's until acknowledged, and a session with ``queue_chunks`` chunks unacknowledged
(sent or not) makes no more, so a client that stops reading stops its stream. Other
control messages are JSON text too; a binary one, bad JSON or a bad value is answered
``{"type": "error", "error"}`` and the session goes on. A prompt change is answered
``{"type": "prompt_ack", "prompt_version", "applies_from"}`` once it took (chunks from
index ``applies_from`` on are made under it), or ``{"type": "error"}`` if its re-cache
failed (the session goes on under its old prompt).

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
import functools
import json

from .wire import PROMPT_KEYS, RequestError, json_body, parse_prompt

#: the socket's close code once the server drains (going away)
GOING_AWAY = 1001
#: a socket whose ``after`` is not a chunk index, or none made, is closed with this code
BAD_AFTER = 4422


async def serve_socket(ws, sched, sid: str, encode, draining, *, after: int | None = None,
                       keep_on_drain: bool = False) -> None:
    """Push the session's chunks as they come (``encode(chunk) -> bytes`` on a worker
    thread), from the first one after ``after``; apply its acknowledgements and control
    messages. Once ``draining`` (a `threading.Event`, set with the scheduler held) is
    set, its queued chunks go out, then an end message with reason "shutdown", and the
    socket closes (1001). The session stays open when the socket goes (module doc).
    An ``after`` beyond the chunks made closes the socket `BAD_AFTER`, the reason
    naming the last index made."""
    from fastapi import WebSocketDisconnect

    try:
        reader = await asyncio.to_thread(sched.rewind, sid, after)
    except KeyError:
        reader = None
    except ValueError as exc:                 # at most 123 bytes
        reason = str(exc).encode()[:123].decode(errors="ignore")
        return await ws.close(code=BAD_AFTER, reason=reason)
    tasks = [asyncio.create_task(_send(ws, sched, sid, encode, draining, keep_on_drain, reader)),
             asyncio.create_task(_receive(ws, sched, sid))]
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
                await ws.close(GOING_AWAY if draining.is_set() else 1000)


def _client_gone(ws) -> bool:
    """Whether the client has closed the socket (its close, or the connection lost): a
    proxy in front of the app (Ray Serve's) fails on a message for a client gone."""
    from starlette.websockets import WebSocketState

    return ws.client_state == WebSocketState.DISCONNECTED


def _end(sched, sid: str, reason: str | None = None, kept: bool = False) -> str:
    """The end message of session ``sid``: finished, or stopped by the drain (``reason``
    "shutdown", state "closed"; ``kept``: the server keeps it over its restart, so
    unless it failed it is "resumable"), or closed under the socket (its record's state
    and end reason)."""
    info = sched.session_info(sid) or {"state": "closed", "error": None, "end_reason": None,
                                       "ended": True}
    reason = reason or info["end_reason"]
    state = "closed" if info["state"] == "active" else info["state"]
    end = {"type": "end", "state": state, "error": info["error"]}
    if reason is not None:
        end["reason"] = reason
    if kept and info["state"] != "failed" and not info["ended"]:
        end["resumable"] = True
    return json.dumps(end)


async def _send(ws, sched, sid: str, encode, draining, kept: bool, reader) -> None:
    # ``reader``: a worker thread still waiting in next_chunk after this socket closed
    # takes nothing once a new socket rewound the session.
    take = functools.partial(sched.next_chunk, sid, reader=reader)
    while not draining.is_set():
        chunk = await asyncio.to_thread(take, 0.25)
        if chunk is not None:
            await ws.send_bytes(await asyncio.to_thread(encode, chunk))
            continue
        s = await asyncio.to_thread(sched.sessions.get, sid)
        if s is None:                                       # closed under the socket
            return await ws.send_text(await asyncio.to_thread(_end, sched, sid))
        if reader is not None and s.reader != reader:       # another socket reads it now
            return None
        if s.finished and s.sent >= len(s.queue):
            if s.queue:                                     # sent, not yet acknowledged
                await asyncio.sleep(0.02)
                continue
            end = await asyncio.to_thread(_end, sched, sid)
            with contextlib.suppress(KeyError):             # every chunk is the client's
                await asyncio.to_thread(sched.close_session, sid, s.state)
            return await ws.send_text(end)
    # The scheduler is held: no chunk comes after those queued.
    while (chunk := await asyncio.to_thread(take, 0)) is not None:
        await ws.send_bytes(await asyncio.to_thread(encode, chunk))
    await ws.send_text(await asyncio.to_thread(_end, sched, sid, "shutdown", kept))


async def _receive(ws, sched, sid: str) -> None:
    from fastapi import WebSocketDisconnect

    while True:
        msg = await ws.receive()
        if msg["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(msg.get("code", 1000), msg.get("reason"))
        try:
            if msg.get("text") is None:
                raise RequestError(400, f"a control message must be JSON text, got a binary "
                                        f"message of {len(msg.get('bytes') or b'')} bytes")
            reply = await _control(ws, sched, sid, json_body(msg["text"].encode()))
        except KeyError:  # the session ended meanwhile: the sender says how
            return await asyncio.Event().wait()
        except RequestError as exc:
            reply = {"type": "error", "error": exc.message}
        if reply is not None:
            await ws.send_text(json.dumps(reply))


async def _control(ws, sched, sid: str, msg: dict) -> dict | None:
    """Apply one control message; the reply to send now (a prompt change is answered
    once it took, by `_prompt_reply`)."""
    kind = msg.get("type")
    if kind not in ("ack", "prompt", "pause", "resume"):
        raise RequestError(422, f"type must be ack, prompt, pause or resume, got {kind!r}")
    keys = ({"type", *PROMPT_KEYS} if kind == "prompt"
            else {"type", "index"} if kind == "ack" else {"type"})
    if set(msg) - keys:
        raise RequestError(422, f"a {kind} message takes {sorted(keys)}, got unknown "
                                f"{sorted(set(msg) - keys)}")
    if kind == "ack":
        index = msg.get("index")
        if isinstance(index, bool) or not isinstance(index, int):
            raise RequestError(422, f"an ack message's index must be an integer, got {index!r}")
        await asyncio.to_thread(sched.ack, sid, index)
        return None
    if kind != "prompt":
        await asyncio.to_thread(sched.pause, sid, kind == "pause")
        return None
    prompt = parse_prompt(msg, sched.prompt_shape)
    if prompt is None:
        raise RequestError(422, "a prompt message needs text, prompt_seed or prompt")
    try:
        change = await asyncio.to_thread(sched.set_prompt, sid, prompt)
    except ValueError as exc:
        raise RequestError(422, str(exc)) from None
    asyncio.ensure_future(_prompt_reply(ws, change))
    return None


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
