"""`ClusterSessions`: the scheduler the cluster's ingress serves (`build_app`'s ``sched``),
over the replicas of a Ray Serve deployment (`Replica`).

It keeps where each session lives (session id -> replica id) and nothing of a stream
itself: every call about a session goes to its replica (`ReplicaRouter` sends it to the
replica it names). Placement: a new session goes to the replica with the most free
sessions (ties: the fewest open), never to one draining. A move exports the session
on its replica and imports it on another, the state passing through Ray's object store
from one to the other; meanwhile the session's socket sees it open with nothing to
send, then reads on from the new replica, skipping what it sent already (so a client
sees each index once). A replica that leaves (killed, scaled down) has its sessions
adopted by the others from their files in the shared state folder (`Replica.adopt`); a
session with no file there ends, failed, saying so.

Readers: `rewind` hands out this object's own reader numbers; each maps to the
replica's reader and the move it was made after (``epoch``), so a reader made before a
move rewinds on the session's new replica at its next read.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time

from framekv.engine.serving import SchedulerFull

from .router import live_replicas

log = logging.getLogger("framekv.cluster")
CALL_TIMEOUT_S = 60.0     # a call about a session, its replica gone: it waits this long
ENDED_KEPT = 4096         # ended sessions whose replica is remembered (GET says how)


class MoveConflict(Exception):
    """The session is being moved already."""


class ReplicaGone(Exception):
    """A call's replica did not answer: it died or left."""


@dataclasses.dataclass
class _Reader:
    number: int            # this object's reader number (what `rewind` returned)
    epoch: int             # the session's moves when the replica's reader was made
    replica_reader: int
    handed: int            # the last chunk index handed out through it


@dataclasses.dataclass
class StreamView:
    """What a socket's sender reads of a session (`serve_socket`): its reader, state,
    whether finished, chunks handed out and queued (``queue``: a range as long)."""

    reader: int
    state: str = "active"
    finished: bool = False
    sent: int = 0
    queue: range = range(0)


class _Open(collections.abc.Mapping):
    """Session id -> `StreamView` of each open session (`ClusterSessions.sessions`):
    membership and size from the placement, a view fetched from its replica."""

    def __init__(self, owner: "ClusterSessions"):
        self.owner = owner

    def __getitem__(self, sid):
        view = self.owner.view(sid)
        if view is None:
            raise KeyError(sid)
        return view

    def __contains__(self, sid):
        return sid in self.owner.where

    def __iter__(self):
        return iter(list(self.owner.where))

    def __len__(self):
        return len(self.owner.where)


class _Shim:
    """What the app reads of a runner or decoder: a dtype's name, video frame counts."""

    def __init__(self, dtype: str, video_frames):
        self.dtype, self._video = dtype, video_frames

    def video_frames(self, frames: int, first: bool) -> int:
        return self._video[0 if first else 1]


@dataclasses.dataclass
class _Opened:
    id: str


class _Change:
    """A prompt change on a replica, as `PromptChange` reads to the app."""

    def __init__(self, version: int, applies_from: int):
        self.version, self.applies_from = version, applies_from
        self.future: concurrent.futures.Future = concurrent.futures.Future()


def _named_error(text: str) -> Exception:
    """A replica's ``"Type: message"`` as an exception of that type's name (the message
    the app writes of it is then the one a single server writes)."""
    name, _, message = text.partition(": ")
    return type(name if name.isidentifier() else "RuntimeError", (RuntimeError,), {})(message)


class ClusterSessions:
    """The sessions of every replica as one scheduler (module doc). ``handle``: the
    replica deployment's handle (routed by `ReplicaRouter`); ``described``: what one
    replica's `Replica.describe` returned."""

    checkpoints = None        # the replicas keep theirs

    def __init__(self, handle, described: dict, *, call_timeout: float = CALL_TIMEOUT_S,
                 grace: float = 10.0):
        self.handle, self.call_timeout, self.grace = handle, call_timeout, grace
        self.prompt_shape = tuple(described["prompt_shape"])
        self.chunk_shape = tuple(described["chunk_shape"])
        self.frames_per_chunk, self.decoding = described["frames_per_chunk"], described["decoding"]
        self.text_prompts, self.queue_chunks = described["text"], described["queue_chunks"]
        self.runner = self.decoder = _Shim(described["dtype"], described["video_frames"])
        self.lock = threading.RLock()
        self.where: dict[str, str] = {}            # session id -> replica id
        self.budgets: dict[str, tuple] = {}        # session id -> (seed, chunks budget)
        self.epoch: collections.Counter = collections.Counter()   # session id -> moves
        self.readers: dict[str, _Reader] = {}
        self.acks: dict[str, int] = {}             # acknowledgements held over a move
        self.moving: set[str] = set()
        self.replicas: dict[str, dict] = {}        # replica id -> its `Replica.routing`
        self.left: dict[str, float] = {}           # replica id -> when it was seen gone
        self.draining: set[str] = set()
        self.placing: collections.Counter = collections.Counter()
        self.ended: collections.OrderedDict = collections.OrderedDict()
        self.sessions = _Open(self)
        self._handles: dict[str, object] = {}

    # ------------------------------------------------------------------ calls
    def _handle(self, rid: str | None):
        if rid not in self._handles:
            self._handles[rid] = self.handle.options(multiplexed_model_id=rid or "")
        return self._handles[rid]

    def _call(self, rid: str | None, method: str, *args, timeout: float | None = None, **kw):
        """``method`` of replica ``rid`` (any for None); what it raised, raised here;
        `ReplicaGone` when it died or did not answer in time."""
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        response = getattr(self._handle(rid), method).remote(*args, **kw)
        try:
            return response.result(timeout_s=self.call_timeout if timeout is None else timeout)
        except RayTaskError as exc:
            raise exc.cause from None
        except (TimeoutError, ConnectionError, RayActorError, ActorUnavailableError) as exc:
            raise ReplicaGone(f"replica {rid} did not answer {method}: "
                              f"{type(exc).__name__}") from None

    def _on_session(self, sid: str, method: str, *args, wait: bool = True, **kw):
        """``method`` on the replica of session ``sid``, waiting out a move or an
        adoption (KeyError once it is not open); ``wait=False``: `ReplicaGone` at once
        when its replica died (the caller makes do until the session is adopted)."""
        deadline = time.monotonic() + (self.call_timeout if wait else 0.0)
        while True:
            with self.lock:
                rid, busy = self.where.get(sid), sid in self.moving
            if rid is None:
                raise KeyError(sid)
            if not busy:
                try:
                    return self._call(rid, method, sid, *args, **kw)
                except ReplicaGone:   # its replica died: the session is adopted elsewhere
                    if time.monotonic() > deadline:
                        raise
                except KeyError:
                    with self.lock:   # moved or adopted under the call: again
                        again = sid in self.moving or self.where.get(sid, rid) != rid
                    if not again or time.monotonic() > deadline:
                        raise
            time.sleep(0.05)

    # ------------------------------------------------------------------ replicas
    @property
    def max_sessions(self) -> int:
        return sum(r["max_sessions"] for r in list(self.replicas.values()))

    @property
    def slots(self) -> int:
        return sum(r["slots"] for r in list(self.replicas.values()))

    @property
    def loop_error(self) -> str | None:
        """Why no session can be served (no replica up), else None."""
        return None if self.replicas else "no replica is up"

    def replica_info(self) -> list[dict]:
        """Each replica: id, process id, sessions placed there, max_sessions, slots,
        draining."""
        with self.lock:
            load = collections.Counter(self.where.values())
            return [{"id": rid, "pid": r["pid"], "sessions": load[rid],
                     "max_sessions": r["max_sessions"], "slots": r["slots"],
                     "draining": rid in self.draining}
                    for rid, r in sorted(self.replicas.items())]

    def metrics_by_replica(self) -> dict[str, dict]:
        """Replica id -> its `Replica.metrics` (a replica that does not answer: none)."""
        out = {}
        for rid in sorted(self.replicas):
            try:
                out[rid] = self._call(rid, "metrics", timeout=5.0)
            except ReplicaGone:
                continue
        return out

    def run(self, stop: threading.Event, period: float = 0.5) -> None:
        """Until ``stop``: follow the replicas Ray Serve runs and adopt the sessions of
        those that left (the app's loop thread)."""
        while not stop.is_set():
            try:
                self.refresh()
            except Exception:
                log.exception("following the replicas failed; trying again")
            stop.wait(period)

    def refresh(self) -> None:
        """One look at the replicas: new ones added, those gone dropped, orphaned
        sessions adopted."""
        live = live_replicas()
        if live is None:                      # no router yet: a call makes one
            self._call(None, "routing", timeout=10.0)
            live = live_replicas() or {}
        if not live and not self.handle.running_replicas_populated():
            return                            # the router has not heard of any yet
        for rid in live:
            try:
                info = self._call(rid, "routing", timeout=5.0)
            except ReplicaGone:
                continue
            with self.lock:
                self.replicas[rid] = info
        with self.lock:
            gone = [r for r in self.replicas if r not in live]
            for rid in gone:
                del self.replicas[rid]
                self.draining.discard(rid)
                self.left[rid] = time.monotonic()
                log.warning("replica %s left: its sessions go to the others", rid)
            orphans = [(sid, rid) for sid, rid in self.where.items()
                       if rid not in self.replicas and sid not in self.moving]
        for sid, rid in orphans:
            self._adopt(sid, rid)

    def _adopt(self, sid: str, gone: str) -> None:
        """Session ``sid`` of the replica ``gone`` opened on another from its file."""
        with self.lock:
            self.moving.add(sid)
        try:
            target = self._pick()
            if self._call(target, "adopt", sid):
                with self.lock:
                    self.where[sid] = target
                    self.epoch[sid] += 1
                log.info("session %s adopted by replica %s (replica %s left)", sid, target, gone)
            elif time.monotonic() - self.left.get(gone, 0.0) > self.grace:
                self._lose(sid, f"its replica {gone} stopped and no checkpoint of it was kept "
                                "(--state-dir with --checkpoint-every keeps one)")
        except (SchedulerFull, ReplicaGone) as exc:     # tried again at the next look
            log.warning("session %s waits for a replica to adopt it: %s", sid, exc)
        finally:
            with self.lock:
                self.moving.discard(sid)
            self._release_acks(sid)

    def _lose(self, sid: str, why: str) -> None:
        with self.lock:
            self.where.pop(sid, None)
            seed, budget = self.budgets.pop(sid, (0, None))
            r = self.readers.pop(sid, None)
            made = 0 if r is None else r.handed + 1
            self._remember(sid, {"id": sid, "state": "failed", "paused": False, "seed": seed,
                                 "chunks": made, "delivered": made, "waiting": 0,
                                 "budget": budget, "prompt_version": 0, "error": why,
                                 "resident": False, "ended": True, "end_reason": "failed"})
        log.error("session %s ended: %s", sid, why)

    def _remember(self, sid: str, how) -> None:
        self.ended[sid] = how
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def _pick(self, exclude=()) -> str:
        """The replica with the most free sessions (not draining, not ``exclude``)."""
        with self.lock:
            load = collections.Counter(self.where.values()) + self.placing
            free = [(r["max_sessions"] - load[rid], -load[rid], rid)
                    for rid, r in self.replicas.items()
                    if rid not in self.draining and rid not in exclude and r["error"] is None]
        if not free:
            raise SchedulerFull("no replica is up to take a session: try again later")
        best = max(free)
        if best[0] <= 0:
            raise SchedulerFull(f"all sessions of the {len(free)} replicas taking sessions "
                                "are open")
        return best[2]

    # ------------------------------------------------------------------ sessions
    def open_session(self, *, seed: int, chunks=None, prompt=None, paused: bool = False):
        """A new session on the replica with the most free sessions; `SchedulerFull`
        when none has room (or none is up). Returns a record with its ``id``."""
        with self.lock:
            rid = self._pick()
            self.placing[rid] += 1
        try:
            sid = self._call(rid, "open_session", seed=seed, chunks=chunks, prompt=prompt,
                             paused=paused)
        except ReplicaGone as exc:
            raise SchedulerFull(f"{exc}: try again") from None
        finally:
            with self.lock:
                self.placing[rid] -= 1
        with self.lock:
            self.where[sid] = rid
            self.budgets[sid] = (seed, chunks)
        return _Opened(sid)

    def view(self, sid: str) -> StreamView | None:
        """`StreamView` of an open session (nothing to send while it moves); None
        once it is not open."""
        with self.lock:
            rid, r, busy = self.where.get(sid), self.readers.get(sid), sid in self.moving
        if rid is None:
            return None
        number = 0 if r is None else r.number
        try:
            v = None if busy else self._call(rid, "view", sid, timeout=5.0)
        except ReplicaGone:
            v = None
        if v is None:                    # moving, adopted or gone under the call
            return None if sid not in self.where else StreamView(number)
        return StreamView(number, v["state"], v["finished"], v["sent"], range(v["queued"]))

    def session_info(self, sid: str) -> dict | None:
        """Its replica's `StreamScheduler.session_info`; for an ended session the
        replica it ended on says, or this object (a session lost with its replica)."""
        with self.lock:
            open_here, how = sid in self.where, self.ended.get(sid)
        if open_here:
            try:
                return self._on_session(sid, "session_info")
            except (KeyError, ReplicaGone):
                return None
        if isinstance(how, str):
            try:
                return self._call(how, "session_info", sid, timeout=10.0)
            except ReplicaGone:
                return None
        return how

    def close_session(self, sid: str, reason: str = "closed") -> None:
        """End session ``sid`` on its replica (KeyError once it is not open)."""
        with self.lock:
            rid = self.where.get(sid)
        self._on_session(sid, "close_session", reason)
        with self.lock:
            rid = self.where.pop(sid, rid)
            self.budgets.pop(sid, None)
            self.readers.pop(sid, None)
            self.acks.pop(sid, None)
            self._remember(sid, rid)

    def pause(self, sid: str, paused: bool = True) -> None:
        self._on_session(sid, "pause", paused)

    def hold(self, held: bool = True) -> None:
        """Hold (or release) every replica: no chunk is made (the ingress drains)."""
        for rid in list(self.replicas):
            try:
                self._call(rid, "hold", held)
            except ReplicaGone:
                continue

    def ack(self, sid: str, index: int) -> int:
        """The client has every chunk up to ``index``; held over a move and applied on
        the session's replica once it is there."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"index must be an integer, got {index!r}")
        with self.lock:
            if sid not in self.where:
                raise KeyError(sid)
            busy = sid in self.moving
        if not busy:
            try:
                return self._on_session(sid, "ack", index, wait=False)
            except ReplicaGone:           # held until the session is adopted
                pass
        with self.lock:
            self.acks[sid] = max(index, self.acks.get(sid, index))
        if not busy and sid not in self.moving:   # adopted meanwhile: apply it now
            self._release_acks(sid)
        return 0

    def _release_acks(self, sid: str) -> None:
        with self.lock:
            index = self.acks.pop(sid, None)
        if index is not None:
            try:
                self._on_session(sid, "ack", index)
            except (KeyError, ReplicaGone):
                pass

    def rewind(self, sid: str, after: int | None = None) -> int:
        """A socket (re)connects (`StreamScheduler.rewind`); this object's reader."""
        with self.lock:
            epoch = self.epoch[sid]
        try:
            theirs = self._on_session(sid, "rewind", after, wait=False)
        except ReplicaGone:              # its replica died: rewound once it is adopted
            theirs, epoch = 0, -1
        with self.lock:
            old = self.readers.get(sid)
            r = _Reader(1 if old is None else old.number + 1, epoch, theirs,
                        -1 if after is None else after)
            self.readers[sid] = r
            return r.number

    def next_chunk(self, sid: str, timeout: float | None = None, *, reader=None):
        """The session's next chunk for ``reader`` (`StreamScheduler.next_chunk`),
        across moves: a reader made before one rewinds on the new replica and skips
        what it handed out already."""
        deadline = time.monotonic() + (0.0 if timeout is None else timeout)
        while True:
            with self.lock:
                r, rid = self.readers.get(sid), self.where.get(sid)
                if rid is None or r is None or (reader is not None and r.number != reader):
                    return None
                busy, epoch = sid in self.moving, self.epoch[sid]
            left = deadline - time.monotonic()
            chunk = None
            try:
                if busy:
                    time.sleep(min(0.05, max(left, 0.0)))
                elif r.epoch != epoch:        # moved: read on from its new replica
                    theirs = self._call(rid, "rewind", sid, None if r.handed < 0 else r.handed)
                    with self.lock:
                        r.replica_reader, r.epoch = theirs, epoch
                    continue
                else:
                    chunk = self._call(rid, "next_chunk", sid, max(left, 0.0),
                                       reader=r.replica_reader, timeout=max(left, 0.0) + 5)
            except (KeyError, ReplicaGone):
                # a chunk the replica handed out may be lost with the call: read again
                # from after the last one this reader has (a rewind at the next read)
                with self.lock:
                    r.epoch = -1
                time.sleep(min(0.05, max(left, 0.0)))
            if chunk is not None and chunk.index > r.handed:
                r.handed = chunk.index
                return chunk
            if chunk is None and (not busy or time.monotonic() >= deadline):
                return None                   # the replica waited its part already

    def set_prompt(self, sid: str, prompt) -> _Change:
        """A prompt change on the session's replica; its ``future`` settles as it takes."""
        version, applies = self._on_session(sid, "set_prompt", prompt)
        change = _Change(version, applies)
        threading.Thread(target=self._settle, args=(sid, change), daemon=True,
                         name="framekv-prompt").start()
        return change

    def _settle(self, sid: str, change: _Change) -> None:
        while True:
            try:
                got = self._on_session(sid, "prompt_result", change.version, 5.0)
            except (KeyError, ReplicaGone):
                got = {"ended": True}
            if "pending" in got:
                continue
            if "error" in got:
                change.future.set_exception(_named_error(got["error"]))
            elif "ended" in got:
                change.future.set_exception(KeyError(sid))
            else:
                change.applies_from = got["applies_from"]
                change.future.set_result(change)
            return

    # ------------------------------------------------------------------ moves
    def move(self, sid: str, to: str | None = None) -> dict:
        """Session ``sid`` exported on its replica and imported on ``to`` (default: the
        one with the most free sessions), its state through the object store; its socket
        reads on from there. KeyError: not open; ValueError: ``to`` is no replica, or
        its own; `MoveConflict`: moving already. Returns the move's bytes and seconds
        (export, transfer, import, all of it)."""
        with self.lock:
            if sid not in self.where:
                raise KeyError(sid)
            if sid in self.moving:
                raise MoveConflict(f"session {sid[:64]!r} is being moved already")
            src = self.where[sid]
            if to is not None and to not in self.replicas:
                raise ValueError(f"to must be one of the replicas {sorted(self.replicas)}, "
                                 f"got {to!r}")
            if to == src:
                raise ValueError(f"to must be another replica than the session's own, got "
                                 f"{to!r}, where it is")
            self.moving.add(sid)
        try:
            dst = to or self._pick(exclude={src})
            return {"id": sid, "from": src, "to": dst, **self._carry(sid, src, dst)}
        finally:
            with self.lock:
                self.moving.discard(sid)
            self._release_acks(sid)

    def _carry(self, sid: str, src: str, dst: str) -> dict:
        from ray.exceptions import RayTaskError

        t = time.perf_counter()
        exported = self._handle(src).export_session.remote(sid)
        try:
            done = self._handle(dst).import_session.remote(exported).result(
                timeout_s=self.call_timeout)
        except Exception as exc:
            self._bring_back(sid, src, exported)
            if isinstance(exc, RayTaskError):
                raise exc.cause from None
            raise
        with self.lock:
            self.where[sid] = dst
            self.epoch[sid] += 1
        done.pop("id", None)
        return {**done, "seconds": time.perf_counter() - t}

    def _bring_back(self, sid: str, src: str, exported) -> None:
        """A move whose import failed: the session back on its replica (if it left)."""
        try:
            if self._call(src, "view", sid, timeout=10.0) is not None:
                return                                      # the export failed: it stayed
            self._handle(src).import_session.remote(exported).result(timeout_s=self.call_timeout)
        except Exception as exc:
            self._lose(sid, f"a move from replica {src} failed and the session could not go "
                            f"back: {type(exc).__name__}: {exc}")

    def drain(self, rid: str) -> dict:
        """No new session on replica ``rid``; each of its sessions moved to the others.
        KeyError for an unknown replica. Returns the moves and the sessions left there
        (with why)."""
        with self.lock:
            if rid not in self.replicas:
                raise KeyError(rid)
            self.draining.add(rid)
            here = [sid for sid, r in self.where.items() if r == rid]
        moved, left = [], {}
        for sid in here:
            try:
                moved.append(self.move(sid))
            except (KeyError, MoveConflict):          # ended, or moving already
                continue
            except Exception as exc:
                left[sid] = f"{type(exc).__name__}: {exc}"
        return {"replica": rid, "moved": moved, "left": left}
