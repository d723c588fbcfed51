"""The replicas of a cluster and what moves sessions between them (`Moves`, a part of
`ClusterSessions`, whose attributes it uses): their sizes, info and metrics, following
the replicas Ray Serve runs and adopting the sessions of one that left (`refresh`), a
move and a drain (module doc of `framekv.tools.cluster.sessions`).
"""
from __future__ import annotations

import collections
import logging
import threading
import time

from framekv.engine.serving import SchedulerFull

from .router import live_replicas

log = logging.getLogger("framekv.cluster")
ENDED_KEPT = 4096         # ended sessions whose replica is remembered (GET says how)


class MoveConflict(Exception):
    """The session is being moved already."""


class ReplicaGone(Exception):
    """A call's replica did not answer: it died or left."""


class Moves:
    """Replicas followed, sessions adopted, moved and drained (module doc)."""

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

    @property
    def degraded(self) -> str | None:
        """Why no replica takes a new session while some are up (each draining, or its
        loop stopped), else None."""
        with self.lock:
            taking = [rid for rid, r in self.replicas.items()
                      if rid not in self.draining and r["error"] is None]
            drained = sorted(set(self.replicas) & self.draining)
            if not self.replicas or taking:
                return None
        shown = ", ".join(drained[:8]) + (", ..." if len(drained) > 8 else "")
        stopped = len(self.replicas) - len(drained)
        return (f"no replica takes new sessions: {len(drained)} draining ({shown})"
                + (f", {stopped} whose loop stopped" if stopped else "")
                + ": undrain one (framekv cluster undrain REPLICA)")

    def replica_info(self) -> list[dict]:
        """Each replica: id, process id, sessions placed there, max_sessions, slots,
        draining, and whether it takes new sessions (not draining, its loop running)."""
        with self.lock:
            load = collections.Counter(self.where.values())
            return [{"id": rid, "pid": r["pid"], "sessions": load[rid],
                     "max_sessions": r["max_sessions"], "slots": r["slots"],
                     "draining": rid in self.draining,
                     "takes_sessions": rid not in self.draining and r["error"] is None}
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
            target = self._pick(adopting=True)
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
        except ValueError as exc:                        # its file, or its state, is bad
            self._lose(sid, f"its replica {gone} stopped and it could not be opened "
                            f"elsewhere: {exc}")
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
                shown = repr(to) if len(to) <= 64 else f"{to[:64]!r}... ({len(to)} characters)"
                raise ValueError(f"to must be one of the replicas "
                                 f"{sorted(self.replicas)[:16]}, got {shown}")
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
        exported = self._send(src, "export_session", sid)
        try:
            done = self._send(dst, "import_session", exported).result(
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
            if self._call(src, "is_open", sid, timeout=10.0):
                return                                      # the export failed: it stayed
            self._send(src, "import_session", exported).result(timeout_s=self.call_timeout)
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

    def undrain(self, rid: str) -> dict:
        """Replica ``rid`` takes new sessions again (its drain undone; the sessions moved
        off stay where they went). KeyError for an unknown replica."""
        with self.lock:
            if rid not in self.replicas:
                raise KeyError(rid)
            self.draining.discard(rid)
        log.info("replica %s takes new sessions again", rid)
        return {"replica": rid, "draining": False}
