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
adopted by the others from their files in the shared state folder (`Replica.adopt`;
by a draining one only when no other has room); a session with no file there ends,
failed, saying so.

Readers: `rewind` hands out this object's own reader numbers; each maps to the
replica's reader and the move it was made after (``epoch``), so a reader made before a
move rewinds on the session's new replica at its next read.
"""
from __future__ import annotations

import collections
import contextvars
import dataclasses
import logging
import threading
import time

from framekv.engine.serving import Handout, SchedulerFull, end_message

from .moves import Moves, ReplicaGone
from .views import OpenSessions, Opened, PartsShim, ReplicaPromptChange, named_error

log = logging.getLogger("framekv.cluster")
CALL_TIMEOUT_S = 60.0     # a call about a session, its replica gone: it waits this long
#: a reader's calls (read, rewind, ack): one sent to a replica as it died may
#: hang rather than fail, and the socket tries again once the session is adopted
SOCKET_CALL_S = 5.0


@dataclasses.dataclass
class _Reader:
    number: int            # this object's reader number (what `rewind` returned)
    epoch: int             # the session's moves when the replica's reader was made
    replica_reader: int
    handed: int            # the last chunk index handed out through it


class ClusterSessions(Moves):
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
        self.runner = self.decoder = PartsShim(described["dtype"], described["video_frames"])
        video = described.get("video_in")       # what a video session takes, or None
        self.video_strength = None if video is None else video["strength"]
        self.video_size = None if video is None else tuple(video["size"])
        self.video_chunk_frames = None if video is None else tuple(video["chunk_frames"])
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
        self.sessions = OpenSessions(self)
        self._handles: dict[str, object] = {}

    # ------------------------------------------------------------------ calls
    def _handle(self, rid: str | None):
        if rid not in self._handles:
            self._handles[rid] = self.handle.options(multiplexed_model_id=rid or "")
        return self._handles[rid]

    def _send(self, rid: str | None, method: str, *args, **kw):
        """The `DeploymentResponse` of ``method`` sent to replica ``rid``, sent outside
        any request's context: a call made while serving a request carries that
        request's internal id, and Ray Serve's router keys its pending calls by it, so
        two calls of one WebSocket at once, or one after a call of it failed, would
        wait on each other's entry and never be routed."""
        handle = self._handle(rid)
        return contextvars.Context().run(lambda: getattr(handle, method).remote(*args, **kw))

    def _call(self, rid: str | None, method: str, *args, timeout: float | None = None, **kw):
        """``method`` of replica ``rid`` (any for None); what it raised, raised here;
        `ReplicaGone` when it died or did not answer in time."""
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        response = self._send(rid, method, *args, **kw)
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

    def _pick(self, exclude=(), adopting: bool = False) -> str:
        """The replica with the most free sessions (not draining, not ``exclude``).
        ``adopting``: a draining replica too when no other has room, since an orphan
        would otherwise wait for Ray Serve's replacement replica (minutes on a busy
        host); a later drain or its stop moves it on."""
        with self.lock:
            load = collections.Counter(self.where.values()) + self.placing
            free = [(rid not in self.draining, r["max_sessions"] - load[rid], -load[rid], rid)
                    for rid, r in self.replicas.items()
                    if rid not in exclude and r["error"] is None
                    and (adopting or rid not in self.draining)]
        free = [f for f in free if f[1] > 0] or free
        if not free:
            raise SchedulerFull(self.degraded or "no replica is up to take a session: try "
                                "again later")
        best = max(free)
        if best[1] <= 0:
            raise SchedulerFull(f"all sessions of the {len(free)} replicas taking sessions "
                                "are open")
        return best[3]

    # ------------------------------------------------------------------ sessions
    def open_session(self, *, seed: int, chunks=None, prompt=None, paused: bool = False,
                     video=None):
        """A new session on the replica with the most free sessions (``video``: a
        video session's strength); `SchedulerFull` when none has room (or none is up).
        Returns a record with its ``id``."""
        with self.lock:
            rid = self._pick()
            self.placing[rid] += 1
        try:
            sid = self._call(rid, "open_session", seed=seed, chunks=chunks, prompt=prompt,
                             paused=paused, **({} if video is None else {"video": video}))
        except ReplicaGone as exc:
            raise SchedulerFull(f"{exc}: try again") from None
        finally:
            with self.lock:
                self.placing[rid] -= 1
        with self.lock:
            self.where[sid] = rid
            self.budgets[sid] = (seed, chunks)
        return Opened(sid)

    def session_info(self, sid: str) -> dict | None:
        """Its replica's `StreamScheduler.session_info` and ``"replica"``, that
        replica's id; for an ended session the replica it ended on says, or this object
        (a session lost with its replica)."""
        with self.lock:
            open_here, how = sid in self.where, self.ended.get(sid)
        if open_here:
            try:
                info = self._on_session(sid, "session_info")
            except (KeyError, ReplicaGone):
                return None
            with self.lock:
                rid = self.where.get(sid)
            return None if info is None else {**info, "replica": rid}
        if isinstance(how, str):
            try:
                info = self._call(how, "session_info", sid, timeout=10.0)
            except ReplicaGone:
                return None
            return None if info is None else {**info, "replica": how}
        return how

    def close_session(self, sid: str, reason: str = "closed") -> None:
        """End session ``sid`` on its replica (KeyError once it is not open)."""
        with self.lock:
            rid = self.where.get(sid)
        self._on_session(sid, "close_session", reason)
        self._forget(sid, rid)

    def _forget(self, sid: str, rid: str | None) -> None:
        """Session ``sid`` ended on its replica (``rid``, where it was last seen): not
        open here any more; its replica answers how it ended."""
        with self.lock:
            rid = self.where.pop(sid, rid)
            self.budgets.pop(sid, None)
            self.readers.pop(sid, None)
            self.acks.pop(sid, None)
            self._remember(sid, rid)

    def feed(self, sid: str, frames, when=None) -> dict:
        """A video session's frames to its replica (`StreamScheduler.feed`; their
        latency runs from the replica's receipt): its input counts."""
        return self._on_session(sid, "feed", frames)

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
                return self._on_session(sid, "ack", index, wait=False, timeout=SOCKET_CALL_S)
            except ReplicaGone:           # held until the session is adopted
                pass
        with self.lock:       # applied by the session's next read, or as a move ends
            self.acks[sid] = max(index, self.acks.get(sid, index))
        return 0

    def _release_acks(self, sid: str) -> None:
        """Apply the acknowledgement held for ``sid`` (kept again if its replica does
        not answer)."""
        with self.lock:
            index = self.acks.pop(sid, None)
        if index is None:
            return
        try:
            self._on_session(sid, "ack", index, wait=False, timeout=SOCKET_CALL_S)
        except KeyError:
            pass
        except ReplicaGone:
            with self.lock:
                self.acks[sid] = max(index, self.acks.get(sid, index))

    def rewind(self, sid: str, after: int | None = None) -> int:
        """A socket (re)connects (`StreamScheduler.rewind`: ValueError for an ``after``
        beyond the chunks made); this object's reader."""
        with self.lock:
            epoch = self.epoch[sid]
        handed = -1 if after is None else after
        try:
            theirs = self._on_session(sid, "rewind", after, wait=False, timeout=SOCKET_CALL_S)
        except ReplicaGone:              # its replica died: rewound once it is adopted
            theirs, epoch = 0, -1
            with self.lock:              # unchecked: no further than this object handed out
                old = self.readers.get(sid)
                handed = min(handed, -1 if old is None else old.handed)
        with self.lock:
            old = self.readers.get(sid)
            r = _Reader(1 if old is None else old.number + 1, epoch, theirs, handed)
            self.readers[sid] = r
            return r.number

    def next_chunk(self, sid: str, timeout: float | None = None, *, reader=None):
        """The chunk `handout` hands ``reader``, or None."""
        return self.handout(sid, timeout, reader=reader).chunk

    def handout(self, sid: str, timeout: float | None = None, *, reader=None) -> Handout:
        """What ``reader`` gets next (`StreamScheduler.handout`), across moves: a reader
        made before one rewinds on the new replica and skips what it handed out
        already; a session its replica ended (every chunk acknowledged) is forgotten
        here too; one not open here (any more) is ``gone``, its end message what
        `session_info` says."""
        deadline = time.monotonic() + (0.0 if timeout is None else timeout)
        while True:
            with self.lock:
                r, rid = self.readers.get(sid), self.where.get(sid)
                busy, epoch, held = sid in self.moving, self.epoch[sid], sid in self.acks
            if rid is None:
                return Handout(end=end_message(self.session_info(sid)), gone=True)
            if r is None or (reader is not None and r.number != reader):
                return Handout(superseded=r is not None)
            if held and not busy:
                self._release_acks(sid)
            left = max(deadline - time.monotonic(), 0.0)
            if not busy and r.epoch != epoch:      # moved: read on from its new replica
                if self._reread(sid, rid, r, epoch):
                    continue
                h = None
            else:
                h = None if busy else self._replica_handout(sid, rid, r, left)
            if h is not None and h.chunk is not None:
                if h.chunk.index > r.handed:
                    r.handed = h.chunk.index
                    return h
                self._skip(sid, rid, h.chunk.index)   # made again (an adoption): its client
                continue                              # has it
            if h is not None and h.end is not None and not h.gone:
                self._forget(sid, rid)                # ended there, every chunk acknowledged
                return h
            if h is not None and not (h.gone or h.superseded):
                return h                              # the replica waited its part already
            # moving, or not (or no longer) this reader's there: wait a moment, again
            time.sleep(min(0.05, left))
            if time.monotonic() >= deadline:
                return Handout()

    def _reread(self, sid: str, rid: str, r: _Reader, epoch: int) -> bool:
        """``r`` reads on from replica ``rid`` after what it handed out (`Replica.reread`);
        False when that replica does not answer or no longer has the session."""
        try:
            theirs = self._call(rid, "reread", sid, r.handed, timeout=SOCKET_CALL_S)
        except (KeyError, ReplicaGone):
            return False
        with self.lock:
            r.replica_reader, r.epoch = theirs, epoch
        return True

    def _replica_handout(self, sid: str, rid: str, r: _Reader, left: float) -> Handout | None:
        """`Replica.handout` for ``r``; None when the call failed (a chunk the replica
        handed out may be lost with it: ``r`` rewinds at its next read, after the last
        chunk it has)."""
        try:
            return self._call(rid, "handout", sid, left, reader=r.replica_reader,
                              timeout=left + SOCKET_CALL_S)
        except (KeyError, ReplicaGone):
            with self.lock:
                r.epoch = -1
            return None

    def _skip(self, sid: str, rid: str, index: int) -> None:
        """Acknowledge chunk ``index``, made again on replica ``rid`` and skipped: its
        queue must not fill with chunks its client has."""
        try:
            self._call(rid, "ack", sid, index, timeout=SOCKET_CALL_S)
        except (KeyError, ReplicaGone):   # moved or gone: the next read rewinds
            pass

    def set_prompt(self, sid: str, prompt) -> ReplicaPromptChange:
        """A prompt change on the session's replica; its ``future`` settles as it takes."""
        version, applies = self._on_session(sid, "set_prompt", prompt)
        change = ReplicaPromptChange(version, applies)
        threading.Thread(target=self._settle, args=(sid, change), daemon=True,
                         name="framekv-prompt").start()
        return change

    def _settle(self, sid: str, change: ReplicaPromptChange) -> None:
        while True:
            try:
                got = self._on_session(sid, "prompt_result", change.version, 5.0)
            except (KeyError, ReplicaGone):
                got = {"ended": True}
            if "pending" in got:
                continue
            if "error" in got:
                change.future.set_exception(named_error(got["error"]))
            elif "ended" in got:
                change.future.set_exception(KeyError(sid))
            else:
                change.applies_from = got["applies_from"]
                change.future.set_result(change)
            return

