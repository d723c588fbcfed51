"""The control messages of a session in `framekv serve`, whatever carries them
(`apply_control`): the socket's text messages and the long poll's ``POST
/v1/sessions/{id}/control`` bodies are the same JSON objects::

    {"type": "ack", "index": i}                every chunk up to i is the client's
    {"type": "prompt", "text" | "prompt_seed" | "prompt": ...}
                                               a new prompt from the next chunk on
    {"type": "pause"}, {"type": "resume"}      no chunk is made until resumed

Exactly those keys: anything else is a 422 naming it (`RequestError`). A prompt change
is accepted at once and taken at the session's next step boundary; how each transport
answers it is its own (the socket once it took, the POST as ``PUT .../prompt`` does).
"""
import asyncio

from .wire import PROMPT_KEYS, RequestError, parse_prompt

#: the control messages' types
CONTROL_TYPES = ("ack", "prompt", "pause", "resume")


async def apply_control(sched, sid: str, msg: dict):
    """Apply one control message (module doc) to session ``sid`` of ``sched``: the
    `PromptChange` of a prompt message, else None. `RequestError` (422) for a message
    that is not one; KeyError once the session is not open."""
    kind = msg.get("type")
    if kind not in CONTROL_TYPES:
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
        return await asyncio.to_thread(sched.set_prompt, sid, prompt)
    except ValueError as exc:
        raise RequestError(422, str(exc)) from None
