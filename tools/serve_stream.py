"""One session's WebSocket in `framekv serve` (`serve_socket`): its chunks pushed as they
come, its control messages applied, its end message, its slot freed when it goes.

The messages are those of `framekv.tools.serve`'s module doc. Control messages are
JSON text; a binary one, bad JSON or a bad value is answered ``{"type": "error",
"error"}`` and the session goes on. A prompt change is answered ``{"type":
"prompt_ack", "prompt_version", "applies_from"}``: chunks from index ``applies_from`` on
are made under it. The last message is ``{"type": "end", "state", "error"}``, with a
``"reason"`` when the session did not end by itself: "shutdown" when the server drains,
"deleted" or "idle" when it was closed under the socket. When the socket goes, its
session ends (reason: its state if it had finished, "disconnected" if not, "shutdown"
on a drain), except on a drain of a server that keeps its sessions over a restart
(``keep_on_drain``): the session stays open to be saved, and its end message says
``"resumable": true`` (unless it failed): the client reconnects to the same session
id once the server is back.
"""
import asyncio
import contextlib
import json

from .serve_wire import PROMPT_KEYS, RequestError, json_body, parse_prompt

#: the socket's close code once the server drains (going away)
GOING_AWAY = 1001


async def serve_socket(ws, sched, sid: str, encode, draining, *,
                       keep_on_drain: bool = False) -> None:
    """Push the session's chunks as they come (``encode(chunk) -> bytes`` on a worker
    thread); apply its control messages; free the slot when the client goes. Once
    ``draining`` (a `threading.Event`, set with the scheduler held) is set, its queued
    chunks go out, then an end message with reason "shutdown", and the socket closes
    (1001); the session ends too, unless ``keep_on_drain`` (module doc)."""
    from fastapi import WebSocketDisconnect

    tasks = [asyncio.create_task(_send(ws, sched, sid, encode, draining, keep_on_drain)),
             asyncio.create_task(_receive(ws, sched, sid))]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t.exception() is not None and not isinstance(t.exception(), WebSocketDisconnect):
                raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        s = sched.sessions.get(sid)
        reason = ("shutdown" if draining.is_set() else s.state if s is not None and s.finished
                  else "disconnected")
        if not (keep_on_drain and draining.is_set()):
            with contextlib.suppress(KeyError):      # closed meanwhile (DELETE, idle)
                await asyncio.to_thread(sched.close_session, sid, reason)
        with contextlib.suppress(Exception):
            await ws.close(GOING_AWAY if draining.is_set() else 1000)


def _end(sched, sid: str, reason: str | None = None, kept: bool = False) -> str:
    """The end message of session ``sid``: open and finished, or open and stopped by
    the drain (``reason`` "shutdown", state "closed"; ``kept``: the server keeps it
    over its restart, so unless it failed it is "resumable"), or closed under the
    socket (its record's state and end reason)."""
    info = sched.session_info(sid) or {"state": "closed", "error": None, "end_reason": None}
    reason = reason or info["end_reason"]
    state = "closed" if info["state"] == "active" else info["state"]
    end = {"type": "end", "state": state, "error": info["error"]}
    if reason is not None:
        end["reason"] = reason
    if kept and info["state"] != "failed" and not info["ended"]:
        end["resumable"] = True
    return json.dumps(end)


async def _send(ws, sched, sid: str, encode, draining, kept: bool) -> None:
    while not draining.is_set():
        chunk = await asyncio.to_thread(sched.next_chunk, sid, 0.25)
        if chunk is not None:
            await ws.send_bytes(await asyncio.to_thread(encode, chunk))
            continue
        s = sched.sessions.get(sid)
        if s is None or s.finished:
            return await ws.send_text(_end(sched, sid))
    # The scheduler is held: no chunk comes after those queued.
    while (chunk := await asyncio.to_thread(sched.next_chunk, sid, 0)) is not None:
        await ws.send_bytes(await asyncio.to_thread(encode, chunk))
    await ws.send_text(_end(sched, sid, "shutdown", kept))


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
            reply = await _control(sched, sid, json_body(msg["text"].encode()))
        except KeyError:  # the session ended meanwhile: the sender says how
            return await asyncio.Event().wait()
        except RequestError as exc:
            reply = {"type": "error", "error": exc.message}
        if reply is not None:
            await ws.send_text(json.dumps(reply))


async def _control(sched, sid: str, msg: dict) -> dict | None:
    """Apply one control message; the reply to send (a prompt change: its ack)."""
    kind = msg.get("type")
    if kind not in ("prompt", "pause", "resume"):
        raise RequestError(422, f"type must be prompt, pause or resume, got {kind!r}")
    keys = {"type", *PROMPT_KEYS} if kind == "prompt" else {"type"}
    if set(msg) - keys:
        raise RequestError(422, f"a {kind} message takes {sorted(keys)}, got unknown "
                                f"{sorted(set(msg) - keys)}")
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
    return {"type": "prompt_ack", "prompt_version": change.version,
            "applies_from": change.applies_from}
