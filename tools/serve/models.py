"""The typed API of `framekv serve`: pydantic models of its request and response bodies
(so ``/openapi.json`` states them), the error responses each route documents, and
`validation_message`, which turns a validation error into the server's one-line
``{"error": ...}`` naming the argument, the value expected and the value given.

Request bodies are strict: unknown fields are refused, integers are JSON integers
(``1.0`` and ``true`` are not), strings are strings.
(No ``from __future__ import annotations``: FastAPI and pydantic read the annotations.)
"""
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .wire import MAX_TEXT_CHARS

SEED_RANGE = dict(ge=0, lt=2**31)
#: what a 4xx/5xx of the server means, for the docs
ERROR_MEANINGS = {
    400: "The body is not a JSON object (strict JSON: no NaN or Infinity).",
    401: "Missing or wrong bearer token (WWW-Authenticate: Bearer).",
    404: "No such session open: unknown, or ended (GET /v1/sessions/{id} says how).",
    408: "The body did not arrive in time.",
    409: "The session is finished: no chunk will come any more.",
    411: "No Content-Length, or a Transfer-Encoding: chunked bodies are refused.",
    413: "The body is over its cap (counted as it arrives).",
    422: "A field or header has a wrong value: the message names it, what it must be and "
         "what it was.",
    503: "Every session slot is taken (Retry-After), the GPU loop stopped, or the server "
         "shuts down.",
}


class ErrorBody(BaseModel):
    """Every error the server answers: one message naming the problem."""

    error: str = Field(description="The argument, the value expected and the value given.")


def errors(*codes: int, plain: bool = False) -> dict:
    """The ``responses=`` of a route answering the errors ``codes``: JSON `ErrorBody`
    (``plain``: a route whose own responses are not JSON, e.g. text/plain)."""
    if plain:
        body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
        return {c: {"description": ERROR_MEANINGS[c], "content": body} for c in codes}
    return {c: {"model": ErrorBody, "description": ERROR_MEANINGS[c]} for c in codes}


class EmbeddedPrompt(BaseModel):
    """Prompt embeddings in JSON (bodies of at most 1 MiB; larger prompts: ``PUT
    /v1/sessions/{id}/prompt``)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    shape: list[int] = Field(description="[L, text_dim]: the model's prompt shape "
                                         "(GET /v1/info).")
    data: str = Field(description="Base64 of L x text_dim float32 values, little-endian, "
                                  "C order.")


class CreateSession(BaseModel):
    """``POST /v1/sessions``: a session's seed, budget and prompt (at most one of text,
    prompt_seed, prompt; none: the model's default prompt)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={
        "examples": [{"seed": 1, "chunks": 6}, {"seed": 7, "text": "a red fox in snow"}]})
    seed: int = Field(description="The noise seed: chunk i starts from chunk_noise(seed, i).",
                      **SEED_RANGE)
    chunks: int | None = Field(None, ge=1, description="The chunk budget; none: open-ended.")
    text: str | None = Field(None, min_length=1, max_length=MAX_TEXT_CHARS,
                             description="A text prompt (a model with a text encoder).")
    prompt_seed: int | None = Field(None, description="Random prompt embeddings of this "
                                                      "seed.", **SEED_RANGE)
    prompt: EmbeddedPrompt | None = None
    paused: bool = Field(False, description="Start paused: no chunk is made until a "
                         "resume message on the socket, so a prompt uploaded first "
                         "(PUT .../prompt) applies from chunk 0.")
    input: Literal["text", "video"] = Field("text", description="video: the session takes "
                                            "frames (frames_in messages on its socket, or "
                                            "POST .../frames) and chunk i is made from "
                                            "chunk i's frames (video to video).")
    strength: float | int | None = Field(None, description="With input video: how far back "
                                         "towards noise each chunk's input goes, in (0, 1] "
                                         "(the server's, GET /v1/info video_in.strength).")


class SessionCreated(BaseModel):
    """A new session: connect to ``WS /v1/sessions/{id}/stream``."""

    id: str


class PromptAck(BaseModel):
    """A prompt change taken: chunks from ``applies_from`` on are made under it."""

    type: Literal["prompt_ack"] = "prompt_ack"
    prompt_version: int = Field(description="The session's prompt changes so far.")
    applies_from: int = Field(description="The index of the first chunk made under it.")


class SessionInfo(BaseModel):
    """A session, open or ended (the server keeps the last ended ones)."""

    id: str
    state: Literal["active", "done", "failed", "closed"]
    paused: bool
    connected: bool = Field(description="A socket streams it now.")
    seed: int
    chunks: int = Field(description="Chunks made.")
    delivered: int = Field(description="Chunks handed to its socket.")
    budget: int | None
    prompt_version: int
    error: str | None = Field(description="Why it failed, if it did.")
    ended: bool = Field(description="It left the server: its slot is free.")
    end_reason: str | None = Field(description="deleted, idle, disconnected, done, failed, "
                                               "shutdown or closed; null while open.")
    replica: str | None = Field(None, description="On a cluster (framekv serve --replicas): "
                                                  "the replica that holds it, or held it "
                                                  "last; null on one server.")
    input: Literal["text", "video"] = Field("text", description="What its chunks are made "
                                            "from besides the prompt.")
    frames_in: int | None = Field(None, description="Input video: frames received.")
    frames_dropped: int | None = Field(None, description="Input video: frames dropped "
                                       "because newer ones came before a chunk took them.")
    frames_waiting: int | None = Field(None, description="Input video: frames waiting for "
                                       "the next chunk (at most one chunk's).")
    input_chunks: int | None = Field(None, description="Input video: chunks of input taken "
                                     "(the next one's index).")
    frames_needed: int | None = Field(None, description="Input video: frames the next "
                                      "chunk takes.")


class PromptSpec(BaseModel):
    shape: list[int] = Field(description="[L, text_dim].")
    dtype: str = Field(description="The model's compute dtype.")
    upload_dtypes: list[str] = Field(description="X-Prompt-Dtype values PUT .../prompt takes.")
    text: bool = Field(description="Whether prompts may be text.")


class LatentSpec(BaseModel):
    layout: list[str] = Field(description="The axes of a chunk's latents.")
    shape: list[int]
    dtype: str = Field(description="What a latents message carries.")


class VideoFrames(BaseModel):
    first: int = Field(description="Frames of a session's first chunk (a VAE's: 1 + 4 (F - "
                                   "1); a picture of the latents: F).")
    later: int = Field(description="Frames of every later chunk (a VAE's: 4 F; a picture "
                                   "of the latents: F).")


class FramesIn(BaseModel):
    """A video session's input after ``POST .../frames``."""

    frames_in: int = Field(description="Frames received.")
    frames_dropped: int = Field(description="Frames dropped (newer ones came first).")
    frames_waiting: int = Field(description="Frames waiting for the next chunk.")
    input_chunks: int = Field(description="Chunks of input taken.")
    frames_needed: int = Field(description="Frames the next chunk takes.")


class VideoIn(BaseModel):
    strength: float = Field(description="The strength video sessions ask for.")
    width: int = Field(description="The model's video width (frames are fitted to it).")
    height: int = Field(description="The model's video height.")
    first: int = Field(description="Frames of a session's first chunk of input.")
    later: int = Field(description="Frames of each later chunk of input.")
    formats: list[str] = Field(description="frames_in formats taken.")
    max_frames: int = Field(description="Frames one frames_in message may carry.")


class ServerInfo(BaseModel):
    """``GET /v1/info``: what the server streams."""

    model: str
    prompt: PromptSpec
    latents: LatentSpec
    frames_per_chunk: int = Field(description="Latent frames per chunk (F).")
    video_frames_per_chunk: VideoFrames | None = Field(description="null unless decoding.")
    fps: int
    output: Literal["frames", "latents"]
    frame_format: str | None = Field(description="jpeg or webp with output frames.")
    max_sessions: int = Field(description="Sessions open at once.")
    slots: int = Field(description="Sessions on the pool at once; the others wait swapped "
                                   "out to host memory.")
    queue_chunks: int = Field(description="Undelivered chunks a session holds at most.")
    session_idle_timeout: float = Field(description="Seconds a session may go without a "
                                                    "socket before it is ended (idle).")
    video_in: VideoIn | None = Field(None, description="What a video session takes "
                                     "(frames in); null where the server takes none.")
    replicas: list[dict] | None = Field(None, description="A cluster's replicas (id, "
                                        "sessions, max_sessions, slots, draining, "
                                        "takes_sessions: whether new sessions go there); "
                                        "absent for one server.")


class Health(BaseModel):
    status: Literal["ok", "degraded", "error"] = Field(description="degraded: a cluster "
                                                       "none of whose replicas takes new "
                                                       "sessions (reason).")
    sessions: int
    max_sessions: int
    output: str
    fps: int
    token: bool = Field(description="Whether routes need a bearer token.")
    text: bool = Field(description="Whether prompts may be text.")
    error: str | None = Field(None, description="Why the server is down (503 only).")
    reason: str | None = Field(None, description="Why no new session is taken (degraded "
                                                 "only).")


_EXPECTED = {"int_type": "an integer", "int_parsing": "an integer", "string_type": "a string",
             "bool_type": "a boolean", "list_type": "a list", "dict_type": "an object",
             "model_type": "an object", "model_attributes_type": "an object",
             "float_type": "a number", "float_parsing": "a number"}
_BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"),
           "less_than": ("<", "lt"), "less_than_equal": ("<=", "le")}


def _expected(e: dict) -> str:
    kind, ctx = e.get("type", ""), e.get("ctx") or {}
    if kind in _EXPECTED:
        return _EXPECTED[kind]
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return f"{op} {ctx.get(key)}"
    if kind == "string_too_short":
        return f"a string of {ctx.get('min_length')} or more characters"
    if kind == "string_too_long":
        return f"a string of at most {ctx.get('max_length')} characters"
    msg = str(e.get("msg", ""))
    return msg.removeprefix("Input should be ") if msg.startswith("Input should be ") else \
        msg[:1].lower() + msg[1:]


def _actual(x) -> str:
    if isinstance(x, str):
        return repr(x) if len(x) <= 40 else f"a string of {len(x)} characters"
    if isinstance(x, dict):
        return f"an object with keys {sorted(x)[:8]}"
    if isinstance(x, (list, bytes)):
        return f"a {type(x).__name__} of {len(x)}"
    return json.dumps(x) if isinstance(x, (int, float, bool, type(None))) else type(x).__name__


def _one(e: dict) -> str:
    loc = [str(p) for p in e.get("loc", ())]
    where, path = (loc[0], loc[1:]) if loc and loc[0] in ("body", "header", "query",
                                                            "path") else ("body", loc)
    name = ".".join(path) if where == "body" else f"{where} {'.'.join(path)}"
    if not path:
        return "the body is required: a JSON object, got none"
    if e.get("type") == "missing":
        return f"{name} is required, got none"
    if e.get("type") == "extra_forbidden":
        return f"{name} is not a field this takes, got {name}={_actual(e.get('input'))}"
    return f"{name} must be {_expected(e)}, got {_actual(e.get('input'))}"


def validation_message(errs) -> str:
    """One line for pydantic / FastAPI validation errors (``exc.errors()``): each error as
    "<name> must be <expected>, got <actual>" (or "is required", "is not a field"),
    at most four of them, "; "-joined."""
    errs = list(errs)
    more = f"; and {len(errs) - 4} more" if len(errs) > 4 else ""
    return "; ".join(_one(e) for e in errs[:4]) + more
