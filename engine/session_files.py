"""Sessions in files: a `StreamScheduler`'s open sessions written when a server stops
(`save_session`) and read back when the next one starts (`read_sessions`).

One file per session, ``<id>.session`` in one folder: a `StreamState` file
(safetensors layout, versioned header, CRC, written to a temporary name and renamed)
whose ``extra`` and ``extra_tensors`` carry what the runner's stream does not::

    extra["session"]   format, version, id, seed, state ("active" or "done"), chunks,
                       frames, budget, prompt_version, paused, video_frames, delivered
    extra["stream"]    "live": the state's sequences are the session's stream;
                       "start": it has made no chunk and starts under ``prompt`` (else
                       the runner's default); "none": done, no chunk comes any more
    extra["decoding"]  whether its chunks carry decoded video
    extra["queue"]     its undelivered chunks, oldest first (index, frame0, frames,
                       seconds, latency, batch, prompt_version, video_frame0); their
                       tensors ``chunk<i>.latents`` and ``chunk<i>.video``
    extra["decoder"]   None, or its decoder row's fields; the row's cache ``decoder.<j>``
    prompt             (a tensor) the prompt in force from its next chunk, when it was
                       changed while the session was swapped out

A file fits a scheduler whose runner describes itself the same way
(`ChunkRunner.describe`: model, shapes, chunk cycle, pool geometry; a refusal names
each field that differs, nested ones by dotted name) and that decodes as the file's
session did. `read_sessions` takes a folder's files in name order: a corrupt one
(`CorruptFile`) is logged and renamed ``*.corrupt``; one that does not fit, or whose
session is open already, is logged and left where it is (another server may take it);
once the room is taken the rest are left unread for a later start; every other one is
read into memory, then its file removed.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
import time

from .cache import CorruptFile
from .sessions import Session, SessionChunk
from .stream_state import StreamState
from .swap import Parked

__all__ = ["SUFFIX", "load_session", "read_sessions", "save_session"]
log = logging.getLogger("framekv.scheduler")

SUFFIX = ".session"
FORMAT, VERSION = "framekv.session", 1
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: the session record's fields besides its id, as `Session` names them (seed, budget first)
_RECORD = ("seed", "budget", "state", "chunks", "frames", "prompt_version", "paused",
           "video_frames", "delivered")
_COUNTS = ("seed", "chunks", "frames", "prompt_version", "video_frames", "delivered")


def save_session(directory, s: Session, parked: Parked | None, model: dict,
                 decoding: bool) -> int:
    """Write session ``s`` to ``<directory>/<id>.session`` atomically (module doc):
    its record, its undelivered chunks and ``parked`` (its stream, or None for a
    finished session); ``model``: the runner's `ChunkRunner.describe`. Returns the
    file's bytes."""
    tensors: dict = {}
    queue = [_chunk_record(j, c, tensors) for j, c in enumerate(s.queue)]
    kind = "none" if parked is None else "start" if parked.stream is None else "live"
    decoder = None
    if parked is not None and parked.decoder is not None:
        decoder = {k: v for k, v in parked.decoder.items() if k != "cache"}
        decoder["cache"] = len(parked.decoder["cache"])
        tensors.update({f"decoder.{j}": t for j, t in enumerate(parked.decoder["cache"])})
    if parked is not None and parked.prompt is not None:
        tensors["prompt"] = parked.prompt
    record = {"format": FORMAT, "version": VERSION, "id": s.id,
              **{k: getattr(s, k) for k in _RECORD}}
    extra = {"session": record, "stream": kind, "decoding": bool(decoding), "queue": queue,
             "decoder": decoder}
    base = (parked.stream if kind == "live"
            else StreamState(model, [], [], None, s.chunks, s.frames, (s.seed, 0)))
    state = dataclasses.replace(base, extra=extra, extra_tensors=tensors)
    return state.save(pathlib.Path(directory) / f"{s.id}{SUFFIX}")


def _chunk_record(j: int, c: SessionChunk, tensors: dict) -> dict:
    """An undelivered chunk's fields; its latents and video go to ``tensors``."""
    tensors[f"chunk{j}.latents"] = c.latents
    if c.video is not None:
        tensors[f"chunk{j}.video"] = c.video
    return {"index": c.index, "frame0": c.frame0, "frames": c.frames, "seconds": c.seconds,
            "latency": c.queued - c.requested, "batch": c.batch,
            "prompt_version": c.prompt_version, "video_frame0": c.video_frame0,
            "video": c.video is not None}


def load_session(path, model: dict, decoding: bool, *,
                 pin_memory: bool = False) -> tuple[Session, Parked | None]:
    """The session `save_session` wrote to ``path``: its record off the pool
    (``sequence`` None) with its undelivered chunks, and what to park for it (None for
    a finished one). `CorruptFile` for a damaged file; ValueError naming every
    difference for one that does not fit ``model`` (`ChunkRunner.describe`) or
    ``decoding``, or for an incomplete or foreign record."""
    state = StreamState.load(path, pin_memory=pin_memory)
    try:
        state.check_fits(model)
    except ValueError as exc:
        raise ValueError(f"{path}: the session does not fit this scheduler's runner: "
                         f"{str(exc).split(': ', 1)[1]}") from None
    try:
        return _session_of(path, state, decoding)
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"{path}: the session record is incomplete: {exc!r}") from None


def _session_of(path, state: StreamState, decoding: bool) -> tuple[Session, Parked | None]:
    """The session and what to park from a file's state (`load_session`)."""
    extra, rec = state.extra, state.extra["session"]
    kind = _check_record(path, rec, extra, decoding)
    s = Session(rec["id"], None, rec["seed"], rec["budget"], **{k: rec[k] for k in _RECORD[2:]})
    s.queue.extend(_chunks(state, extra["queue"]))
    tensors, prompt = state.extra_tensors, state.extra_tensors.get("prompt")
    if kind != "live":
        return s, None if kind == "none" else Parked(None, None, prompt)
    decoder = extra["decoder"]
    if decoding and decoder is None:
        raise ValueError(f"{path}: a decoded session's stream without its decoder row")
    if decoder is not None:
        decoder = {**decoder, "cache": [tensors[f"decoder.{j}"] for j in range(decoder["cache"])]}
    stream = dataclasses.replace(state, extra={}, extra_tensors={})
    return s, Parked(stream, decoder, prompt)


def _check_record(path, rec: dict, extra: dict, decoding: bool) -> str:
    """The file's stream kind once its record is one this version wrote, of a valid
    id, state, counts and decoding; else a ValueError naming the field."""
    if (rec.get("format"), rec.get("version")) != (FORMAT, VERSION):
        raise ValueError(f"{path}: a {rec.get('format')!r} record of version "
                         f"{rec.get('version')!r}, not {FORMAT!r} version {VERSION}")
    kind, sid = extra["stream"], rec["id"]
    if not isinstance(sid, str) or not _ID.fullmatch(sid):
        raise ValueError(f"{path}: session id must be 1 to 128 of A-Z a-z 0-9 _ -, got {sid!r}")
    if (rec["state"], kind) not in (("active", "live"), ("active", "start"), ("done", "none")):
        raise ValueError(f"{path}: a session in state {rec['state']!r} with stream {kind!r}")
    bad = [k for k in _COUNTS if isinstance(rec[k], bool) or not isinstance(rec[k], int)
           or rec[k] < 0]
    if bad or not isinstance(rec["paused"], bool) or not (
            rec["budget"] is None or (type(rec["budget"]) is int and rec["budget"] >= 1)):
        raise ValueError(f"{path}: session fields {bad or ['paused', 'budget']} must be "
                         f"integers >= 0 (paused a boolean, budget None or >= 1), got "
                         f"{ {k: rec[k] for k in _RECORD} }")
    if bool(extra["decoding"]) != decoding:
        raise ValueError(f"{path}: the session's chunks carry "
                         f"{'decoded video' if extra['decoding'] else 'latents only'}, this "
                         f"scheduler's {'decoded video' if decoding else 'latents only'}")
    return kind


def _chunks(state: StreamState, queue: list) -> list[SessionChunk]:
    """The undelivered chunks of a file, their latency kept and their clock now."""
    now, out = time.monotonic(), []
    for j, q in enumerate(queue):
        video = state.extra_tensors[f"chunk{j}.video"] if q["video"] else None
        out.append(SessionChunk(q["index"], q["frame0"], state.extra_tensors[f"chunk{j}.latents"],
                                q["seconds"], q["batch"], q["prompt_version"], q["frames"],
                                video, q["video_frame0"], now - q["latency"], now))
    return out


def read_sessions(directory, model: dict, decoding: bool, *, room: int, taken=(),
                  pin_memory: bool = False) -> list[tuple[Session, Parked | None]]:
    """Each session file of ``directory`` read into memory and removed, at most
    ``room`` of them, none whose id is in ``taken`` (module doc for the files skipped
    and what becomes of them). Never raises for a file: each one skipped is logged."""
    out, seen = [], set(taken)
    for path in sorted(pathlib.Path(directory).glob(f"*{SUFFIX}")):
        if len(out) >= room:
            log.warning("%s: left unread for a later start: %d sessions opened, no room "
                        "for more", path, len(out))
            continue
        try:
            s, parked = load_session(path, model, decoding, pin_memory=pin_memory)
        except CorruptFile as exc:
            _set_aside(path, exc)
            continue
        except (ValueError, OSError) as exc:
            log.error("session file left as it is, not opened: %s", exc)
            continue
        if s.id in seen:
            log.error("%s: session file left as it is: session %s is open already", path, s.id)
            continue
        seen.add(s.id)
        out.append((s, parked))
        try:
            path.unlink()
        except OSError as exc:      # opened now; saved over at the next shutdown
            log.error("%s: removing the session file after reading it failed: %s", path, exc)
    return out


def _set_aside(path: pathlib.Path, exc: Exception) -> None:
    """Log a corrupt session file and rename it ``*.corrupt`` (kept for a look)."""
    bad = path.with_name(path.name + ".corrupt")
    try:
        os.replace(path, bad)
    except OSError as err:
        log.error("corrupt session file not opened (renaming it failed: %s): %s", err, exc)
        return
    log.error("corrupt session file renamed %s, not opened: %s", bad.name, exc)
