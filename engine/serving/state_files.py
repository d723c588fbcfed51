"""A `Stream` as one `StreamState`, and folders of them: how a stream leaves a process
(`StreamScheduler.export_session`: a move, a restart, a checkpoint) and how it comes
back (`StreamScheduler.import_session`).

The state's sequences, prompts and history are the runner's stream (empty when it has
made no chunk); its ``extra`` and ``extra_tensors`` carry the rest of the record::

    extra["session"]   format, version, id, seed, state ("active" or "done"), chunks,
                       frames, budget, prompt_version, paused, video_frames, acked
    extra["stream"]    "live": the state's sequences are its stream; "start": it has
                       made no chunk and starts under ``prompt`` (else the runner's
                       default); "none": done, no chunk comes any more
    extra["pending"]   the prompt version of a change not yet taken, its prompt
                       ``pending``, re-cached as the stream takes a slot (else None)
    extra["decoding"]  whether its chunks carry decoded video
    extra["queue"]     its unacknowledged chunks, oldest first (index, frame0, frames,
                       seconds, latency, batch, prompt_version, video_frame0, input:
                       a video stream's [first, count] of its input frames, else None
                       or absent); their tensors ``chunk<i>.latents`` and
                       ``chunk<i>.video``
    extra["decoder"]   None, or its decoder row's fields; the row's cache ``decoder.<j>``
    extra["encoder"]   a video stream's encoder row (as the decoder's; ``encoder.<j>``)
    extra["input"]     None (a text stream), or its `Intake`'s fields: the input
                       cursor (``taken``: chunks of input taken, the next one's index;
                       ``used``), the counts (``received``, ``dropped``), the geometry
                       (``size``, ``first``, ``later``); the frames waiting ``input``
                       [n, 3, H, W] (so a restart loses none it had)

A state fits a scheduler whose runner describes itself the same way
(`ChunkRunner.describe`; a refusal names each field that differs, nested ones by dotted
name) and that decodes as the stream did. Files: ``<id>.session`` in one folder,
written atomically (`StreamState.save`). `read_states` takes a folder's files in name
order: one that cannot be read as a state of this version (`load_state`: whatever its
bytes, or not a regular file at all: a FIFO, a device, a folder, never opened for
reading) is renamed ``*.corrupt`` with one log line saying why; one that does not fit,
or whose stream is open already, is logged and left (another server may take it); once
the room is taken the rest are left for a later start; every other one is read, then
removed.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import re
import time

from ..cache import CorruptFile
from ..stream_state import StreamState
from .delivery import Delivery
from .intake import Intake
from .records import PromptChange, SessionChunk
from .stream import Stream

__all__ = ["SUFFIX", "load_state", "read_states", "remove", "set_aside", "stream_of",
           "stream_state", "write_state"]
log = logging.getLogger("framekv.scheduler")

SUFFIX = ".session"
FORMAT, VERSION = "framekv.session", 2
_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
#: the record's fields besides its id, as `Stream` names them (seed, budget first; acked
#: last, its `Delivery`'s)
_RECORD = ("seed", "budget", "state", "chunks", "frames", "prompt_version", "paused",
           "video_frames", "acked")
_COUNTS = ("seed", "chunks", "frames", "prompt_version", "video_frames")


def stream_state(s: Stream, stream: StreamState | None, decoder: dict | None, model: dict,
                 decoding: bool, encoder: dict | None = None) -> StreamState:
    """``s`` as one `StreamState` (module doc): ``stream`` its runner state (None: it
    has none, "start" or "none"), ``decoder`` and ``encoder`` its coder rows, ``model``
    the runner's `ChunkRunner.describe`. Host tensors only: nothing is copied but the
    latents of chunks that keep theirs on a device."""
    tensors: dict = {}
    queue = [_chunk_record(j, c, tensors) for j, c in enumerate(s.delivery.queue)]
    kind = "none" if s.finished else "live" if stream is not None else "start"
    decoder = _row_out("decoder", decoder if kind == "live" else None, tensors)
    encoder = _row_out("encoder", encoder if kind == "live" else None, tensors)
    video = None
    if s.intake is not None:
        video, waiting = s.intake.state()
        if waiting is not None:
            tensors["input"] = waiting
    start = s.prompt if kind == "start" else None
    for name, t in (("prompt", start), ("pending", s.pending_prompt if s.pending else None)):
        if t is not None:
            tensors[name] = t.detach().cpu()
    record = {"format": FORMAT, "version": VERSION, "id": s.id,
              **{k: getattr(s, k) for k in _RECORD[:-1]}, "acked": s.delivery.acked}
    record["state"] = "done" if kind == "none" else "active"
    extra = {"session": record, "stream": kind, "decoding": bool(decoding), "queue": queue,
             "decoder": decoder, "encoder": encoder, "input": video,
             "pending": s.pending[-1].version if s.pending else None}
    base = (stream if kind == "live" else
            StreamState(model, [], [], None, s.chunks, s.frames, (s.seed, 0)))
    return dataclasses.replace(base, chunks=s.chunks, frames=s.frames, noise=(s.seed, 0),
                               extra=extra, extra_tensors=tensors)


def _row_out(name: str, row: dict | None, tensors: dict) -> dict | None:
    """A coder row's fields, its cache's tensors into ``tensors`` as ``<name>.<j>``."""
    if row is None:
        return None
    tensors.update({f"{name}.{j}": t for j, t in enumerate(row["cache"])})
    return {**{k: v for k, v in row.items() if k != "cache"}, "cache": len(row["cache"])}


def _row_in(name: str, row: dict | None, tensors: dict) -> dict | None:
    """The coder row `_row_out` wrote."""
    if row is None:
        return None
    return {**row, "cache": [tensors[f"{name}.{j}"] for j in range(row["cache"])]}


def _chunk_record(j: int, c: SessionChunk, tensors: dict) -> dict:
    """An unacknowledged chunk's fields; its latents (copied to the host where they are
    on a device) and video go to ``tensors``."""
    tensors[f"chunk{j}.latents"] = c.latents.to("cpu")
    if c.video is not None:
        tensors[f"chunk{j}.video"] = c.video
    return {"index": c.index, "frame0": c.frame0, "frames": c.frames, "seconds": c.seconds,
            "latency": c.queued - c.requested, "batch": c.batch,
            "prompt_version": c.prompt_version, "video_frame0": c.video_frame0,
            "video": c.video is not None, "input": None if c.input is None else list(c.input)}


def stream_of(state: StreamState, model: dict, decoding: bool, where: str = "state") -> Stream:
    """The `Stream` a state holds, off the pool (``parked`` its runner state, ``decoder``
    its row), its unacknowledged chunks queued. ValueError naming every difference for
    one that does not fit ``model`` or ``decoding``, or for an incomplete or foreign
    record (``where``: what the messages call it, a file's path)."""
    try:
        state.check_fits(model)
    except ValueError as exc:
        raise ValueError(f"{where}: the session does not fit this scheduler's runner: "
                         f"{str(exc).split(': ', 1)[1]}") from None
    try:
        return _stream_of(where, state, decoding)
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"{where}: the session record is incomplete: {exc!r}") from None


def _stream_of(where, state: StreamState, decoding: bool) -> Stream:
    extra, rec = state.extra, state.extra["session"]
    kind = _check_record(where, rec, extra, decoding)
    s = Stream(rec["id"], rec["seed"], rec["budget"], **{k: rec[k] for k in _RECORD[2:-1]},
               delivery=Delivery(_chunks(state, extra["queue"]), rec["acked"]))
    tensors = state.extra_tensors
    s.prompt = tensors.get("prompt")
    if extra.get("input") is not None:
        s.intake = Intake.from_state(extra["input"], tensors.get("input"))
    if extra["pending"] is not None:
        change = PromptChange(int(extra["pending"]), s.chunks)
        change.settle(s.chunks)  # accepted before it left: it takes as the stream comes back
        s.pending, s.pending_prompt = [change], tensors["pending"]
    if kind != "live":
        return s
    decoder = extra["decoder"]
    if decoding and decoder is None:
        raise ValueError(f"{where}: a decoded stream without its decoder row")
    s.decoder = _row_in("decoder", decoder, tensors)
    if s.intake is not None:
        if extra["encoder"] is None:
            raise ValueError(f"{where}: a video stream without its encoder row")
        s.encoder = _row_in("encoder", extra["encoder"], tensors)
    s.parked = dataclasses.replace(state, extra={}, extra_tensors={})
    return s


def _check_record(where, rec: dict, extra: dict, decoding: bool) -> str:
    """The state's stream kind once its record is one this version wrote, of a valid
    id, state, counts and decoding; else a ValueError naming the field."""
    if (rec.get("format"), rec.get("version")) != (FORMAT, VERSION):
        raise ValueError(f"{where}: a {str(rec.get('format'))[:40]!r} record of version "
                         f"{str(rec.get('version'))[:16]}, not {FORMAT!r} version {VERSION}")
    kind, sid = extra["stream"], rec["id"]
    if not isinstance(sid, str) or not _ID.fullmatch(sid):
        raise ValueError(f"{where}: session id must be 1 to 128 of A-Z a-z 0-9 _ -, got "
                         f"{str(sid)[:140]!r}")
    if (rec["state"], kind) not in (("active", "live"), ("active", "start"), ("done", "none")):
        raise ValueError(f"{where}: a stream in state {str(rec['state'])[:24]!r} with stream "
                         f"{str(kind)[:24]!r}")
    bad = [k for k in _COUNTS if isinstance(rec[k], bool) or not isinstance(rec[k], int)
           or rec[k] < 0]
    # an acknowledgement never runs ahead of what was made: one that did would make
    # chunks that are never queued, for nobody
    bad += [k for k, ok in (
        ("acked", type(rec["acked"]) is int and "chunks" not in bad
         and -1 <= rec["acked"] < rec["chunks"]),
        ("paused", isinstance(rec["paused"], bool)),
        ("budget", rec["budget"] is None or (type(rec["budget"]) is int and rec["budget"] >= 1)),
    ) if not ok]
    if bad:
        shown = {k: str(rec[k])[:24] for k in _RECORD}
        raise ValueError(f"{where}: stream fields {bad} must be integers >= 0 (acked in [-1, "
                         f"chunks), paused a boolean, budget None or >= 1), got {shown}")
    _check_queue(where, rec, extra["queue"])
    if bool(extra["decoding"]) != decoding:
        raise ValueError(f"{where}: the stream's chunks carry "
                         f"{'decoded video' if extra['decoding'] else 'latents only'}, this "
                         f"scheduler's {'decoded video' if decoding else 'latents only'}")
    return kind


def _check_queue(where, rec: dict, queue: list) -> None:
    """ValueError unless the queued chunks' indices rise within (acked, chunks) and
    each one's input is None or [first >= 0, count >= 1]."""
    indices = [q["index"] for q in queue]
    if any(type(i) is not int for i in indices) or indices != sorted(set(indices)) or (
            indices and not rec["acked"] < indices[0] <= indices[-1] < rec["chunks"]):
        raise ValueError(f"{where}: the queued chunks' indices must rise within (acked, "
                         f"chunks) = ({rec['acked']}, {rec['chunks']}), got "
                         f"{str(indices)[:80]}")
    spans = [q.get("input") for q in queue]
    if not all(v is None or (isinstance(v, list) and len(v) == 2
                             and all(type(n) is int for n in v) and v[0] >= 0 and v[1] >= 1)
               for v in spans):
        raise ValueError(f"{where}: a queued chunk's input must be None or [first >= 0, "
                         f"count >= 1], got {str(spans)[:80]}")


def _chunks(state: StreamState, queue: list) -> list[SessionChunk]:
    """The unacknowledged chunks of a state, their latency kept and their clock now."""
    now, out = time.monotonic(), []
    for j, q in enumerate(queue):
        video = state.extra_tensors[f"chunk{j}.video"] if q["video"] else None
        span = q.get("input")
        out.append(SessionChunk(q["index"], q["frame0"], state.extra_tensors[f"chunk{j}.latents"],
                                q["seconds"], q["batch"], q["prompt_version"], q["frames"],
                                video, q["video_frame0"], now - q["latency"], now,
                                input=None if span is None else tuple(span)))
    return out


def write_state(directory, state: StreamState) -> int:
    """Write ``state`` as ``<directory>/<id>.session`` atomically; its bytes."""
    sid = state.extra["session"]["id"]
    return state.save(pathlib.Path(directory) / f"{sid}{SUFFIX}")


def load_state(path, *, pin_memory: bool = False, max_bytes: int | None = None) -> StreamState:
    """The state of file ``path`` once its record is one this version wrote (whether it
    fits a scheduler is `stream_of`'s check). `CorruptFile` for a file that is not such
    a state, whatever its bytes (`StreamState.load`, ``max_bytes`` included), or no
    regular file; OSError where it cannot be read."""
    state = StreamState.load(path, pin_memory=pin_memory, max_bytes=max_bytes)
    try:
        _stream_of(str(path), state, bool(state.extra["decoding"]))
    except ValueError as exc:                  # it names the path and the field
        raise CorruptFile(str(exc)) from None
    except (KeyError, TypeError, IndexError, AttributeError, OverflowError) as exc:
        raise CorruptFile(f"{path}: the session record is incomplete: "
                          f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return state


def read_states(directory, *, room, taken=(), pin_memory: bool = False,
                max_bytes: int | None = None):
    """Yield (path, state) for each state file of ``directory`` in name order while
    ``room()`` is true (the caller counts what it opened: a file that does not fit
    takes no place), none whose id is in ``taken`` (module doc for the files skipped
    and what becomes of them). ``max_bytes``: the most tensor bytes a file may declare
    (`load_state`). Never raises for a file: each one skipped is logged. Whether a
    state fits is the caller's check (`stream_of`); it removes a file once its stream
    is open (`remove`)."""
    seen = set(taken)
    for path in sorted(pathlib.Path(directory).glob(f"*{SUFFIX}")):
        if not room():
            log.warning("%s: left unread for a later start: no room for more sessions", path)
            continue
        try:
            state = load_state(path, pin_memory=pin_memory, max_bytes=max_bytes)
        except CorruptFile as exc:
            set_aside(path, exc)
            continue
        except (OSError, RuntimeError, MemoryError) as exc:   # the file may be fine
            log.error("session file left as it is, not opened: %s: %s: %s", path,
                      type(exc).__name__, " ".join(str(exc).split())[:300])
            continue
        sid = state.extra["session"]["id"]
        if sid in seen:
            log.error("%s: session file left as it is: session %s is open already", path, sid)
            continue
        seen.add(sid)
        yield path, state


def remove(path) -> None:
    """Remove a state file once its stream is open here (logged if that fails: the
    stream is open; the file is written over at its next checkpoint or shutdown)."""
    try:
        pathlib.Path(path).unlink()
    except OSError as exc:
        log.error("%s: removing the session file after reading it failed: %s", path, exc)


def set_aside(path: pathlib.Path, exc: Exception) -> None:
    """Log a corrupt session file and rename it ``*.corrupt`` (kept for a look)."""
    bad = path.with_name(path.name + ".corrupt")
    why = " ".join(str(exc).split())[:600]          # one line, whatever the file held
    try:
        os.replace(path, bad)
    except OSError as err:
        log.error("corrupt session file not opened (renaming it failed: %s): %s", err, why)
        return
    log.error("corrupt session file renamed %s, not opened: %s", bad.name, why)
