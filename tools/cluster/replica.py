"""`Replica`: one `StreamScheduler` of a framekv cluster, a Ray Serve deployment's
replica (one GPU each; on a CPU host, CPU cores).

It is built from the arguments of ``framekv serve`` (`checked_options`,
`build_scheduler`: every flag means what it means to one server) and runs the GPU loop
in a thread of its own. The ingress (`framekv.tools.cluster.sessions`) calls it by
session: every method but `describe`, `metrics` and `routing` is about one session and
answers what `StreamScheduler` answers. Calls that wait (a chunk, a prompt change, a
move) wait on a pool of threads sized for every session to have one waiting, so no
replica's event loop ever waits on a step.

Moves go through Ray's object store: `export_session` returns the stream's
`StreamState` (host tensors) with its bytes and seconds; the ingress hands that result
to another replica's `import_session` without fetching it. With a state folder and
``--checkpoint-every``, a stream's file is written there as it goes and as it arrives
(`import_session`, `adopt`), so a replica killed at any moment loses no stream: another
one opens it from the file (`adopt`). A replica that stops (a scale-down, the cluster's
end) writes its open streams there first (`save`), and the ingress adopts them.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pathlib
import threading
import time
import uuid

from .autoscale import SESSIONS

log = logging.getLogger("framekv.cluster")


def replica_id() -> str:
    """This Ray Serve replica's unique id (a fresh one outside Ray Serve)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a replica: a test builds one directly
        return uuid.uuid4().hex[:8]


class Replica:
    """A scheduler built from ``args`` (``framekv serve``'s namespace) and its GPU loop
    (module doc)."""

    def __init__(self, args):
        from framekv.engine.serving import Checkpoints

        from ..serve.command import build_scheduler, checked_options

        self.options = checked_options(args)
        self.sched = build_scheduler(args, self.options)
        self.state_dir = self.options["state_dir"]
        if self.state_dir is not None and args.checkpoint_every is not None:
            self.sched.checkpoints = Checkpoints(self.state_dir, args.checkpoint_every)
        self.id = replica_id()
        self.changes: dict[tuple[str, int], object] = {}   # (sid, version) -> PromptChange
        self.waits = concurrent.futures.ThreadPoolExecutor(
            max_workers=2 * self.sched.max_sessions + 8, thread_name_prefix="framekv-wait")
        self.stop = threading.Event()
        self.loop = threading.Thread(target=self.sched.run, args=(self.stop,),
                                     name="framekv-gpu", daemon=True)
        self.loop.start()
        log.info("replica %s: %d sessions, %d slots on %s", self.id, self.sched.max_sessions,
                 self.sched.slots, self.options["device"])

    async def _wait(self, fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(
            self.waits, lambda: fn(*args, **kw))

    # ------------------------------------------------------------------ the replica
    def describe(self) -> dict:
        """What every replica shares (the ingress's /v1/info) and this one's id."""
        s = self.sched
        F = s.frames_per_chunk
        return {"id": self.id, "prompt_shape": list(s.prompt_shape),
                "chunk_shape": list(s.chunk_shape), "frames_per_chunk": F,
                "decoding": s.decoding, "text": s.text_prompts,
                "dtype": str(s.runner.dtype).removeprefix("torch."),
                "video_frames": ([s.decoder.video_frames(F, True), s.decoder.video_frames(F, False)]
                                 if s.decoding else None),
                "output": self.options["output"], "queue_chunks": s.queue_chunks,
                "video_in": None if s.video_size is None else {
                    "strength": s.video_strength, "size": list(s.video_size),
                    "chunk_frames": list(s.video_chunk_frames)}}

    def routing(self) -> dict:
        """Its id, process id, sessions open and allowed, slots, and why its loop
        stopped (or None)."""
        s = self.sched
        return {"id": self.id, "pid": os.getpid(), "sessions": len(s.sessions),
                "max_sessions": s.max_sessions,
                "slots": s.slots, "error": None if s.loop_error is None else str(s.loop_error)}

    def record_routing_stats(self) -> dict:
        """Ray Serve's routing stats of this replica: `routing`."""
        return self.routing()

    def record_autoscaling_stats(self) -> dict:
        """Ray Serve's autoscaling metrics of this replica: its open sessions
        (`framekv.tools.cluster.autoscale`)."""
        return {SESSIONS: float(len(self.sched.sessions))}

    def metrics(self) -> dict:
        """`StreamScheduler.metrics` (on CUDA with the GPU's allocated bytes)."""
        return self.sched.metrics()

    async def hold(self, held: bool = True) -> None:
        await self._wait(self.sched.hold, held)

    # ------------------------------------------------------------------ a session
    async def open_session(self, *, seed: int, chunks=None, prompt=None, paused=False,
                           video=None) -> str:
        s = await self._wait(self.sched.open_session, seed=seed, chunks=chunks, prompt=prompt,
                             paused=paused, video=video)
        return s.id

    def feed(self, sid: str, frames) -> dict:
        """A video session's frames in (`StreamScheduler.feed`), received now."""
        return self.sched.feed(sid, frames)

    def session_info(self, sid: str) -> dict | None:
        return self.sched.session_info(sid)

    def is_open(self, sid: str) -> bool:
        """Whether session ``sid`` is open here."""
        return sid in self.sched.sessions

    async def close_session(self, sid: str, reason: str) -> None:
        await self._wait(self.sched.close_session, sid, reason)

    async def pause(self, sid: str, paused: bool) -> None:
        await self._wait(self.sched.pause, sid, paused)

    def ack(self, sid: str, index: int) -> int:
        return self.sched.ack(sid, index)

    def rewind(self, sid: str, after=None) -> int:
        return self.sched.rewind(sid, after)

    def reread(self, sid: str, handed: int) -> int:
        """The ingress's reader reads on here (a move, an adoption) after ``handed``, the
        last chunk it handed its socket (-1: none), or after the stream's last chunk made
        where the stream is behind it (adopted from an older checkpoint: the ingress
        skips and acknowledges the chunks made again). The new reader's number."""
        made = self.sched.sessions[sid].chunks         # only grows: a rewind takes it
        return self.sched.rewind(sid, min(handed, made - 1))

    async def handout(self, sid: str, timeout: float, reader=None):
        """`StreamScheduler.handout` (a session it ends is closed here)."""
        return await self._wait(self.sched.handout, sid, timeout, reader=reader)

    def set_prompt(self, sid: str, prompt) -> tuple[int, int]:
        """The change's version and its first chunk (so far); `prompt_result` waits."""
        change = self.sched.set_prompt(sid, prompt)
        self.changes[(sid, change.version)] = change
        return change.version, change.applies_from

    async def prompt_result(self, sid: str, version: int, timeout: float) -> dict:
        """``{"applies_from"}`` once the change took, ``{"error"}`` if its re-cache failed
        (or the session ended first: ``{"ended": true}``), ``{"pending": true}`` after
        ``timeout`` s."""
        change = self.changes.get((sid, version))
        if change is None:
            return {"ended": True}
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(change.future)), timeout)
        except asyncio.TimeoutError:
            return {"pending": True}
        except KeyError:
            return {"ended": True}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            if change.done():
                self.changes.pop((sid, version), None)
        return {"applies_from": change.applies_from}

    # ------------------------------------------------------------------ moves
    async def export_session(self, sid: str) -> dict:
        """The session leaves this replica: ``{"state", "bytes", "export_s", "sent"}``
        (``sent``: `time.time` as it left, for the transfer's seconds)."""
        t = time.perf_counter()
        state = await self._wait(self.sched.export_session, sid)
        if self.sched.checkpoints is not None:   # its file removed before another writes it
            await self._wait(self.sched.checkpoints.flush)
        return {"state": state, "bytes": state.nbytes, "export_s": time.perf_counter() - t,
                "sent": time.time()}

    async def import_session(self, moved: dict) -> dict:
        """The session `export_session` gave goes on here: ``{"id", "bytes",
        "export_s", "transfer_s", "import_s"}``. Where checkpoints are kept it returns
        once the session's file is written: its source dropped its own, so a replica
        killed between the two would lose the session."""
        arrived, t = time.time(), time.perf_counter()
        state = moved["state"]
        sid = await self._wait(self.sched.import_session, state)
        seconds = time.perf_counter() - t
        if self.sched.checkpoints is not None:
            self.sched.checkpoints.put(sid, state)
            await self._wait(self.sched.checkpoints.flush)
        return {"id": sid, "bytes": moved["bytes"], "export_s": moved["export_s"],
                "transfer_s": max(0.0, arrived - moved["sent"]), "import_s": seconds}

    async def adopt(self, sid: str) -> bool:
        """Open session ``sid`` from its file in the state folder (its replica is gone);
        False when there is no file of it (nothing to resume from). ValueError for a
        file that cannot be read as a session (renamed ``.corrupt``, as a start does)."""
        from framekv.engine.cache import CorruptFile
        from framekv.engine.memory import host_room
        from framekv.engine.serving import state_files

        if sid in self.sched.sessions:           # adopted here already (a call retried)
            return True
        if self.state_dir is None:
            return False
        path = pathlib.Path(self.state_dir) / f"{sid}.session"
        if not path.exists():
            return False
        try:
            state = await self._wait(state_files.load_state, path, max_bytes=host_room())
        except CorruptFile as exc:
            state_files.set_aside(path, exc)
            raise ValueError(f"its file {path.name} cannot be read: {exc}") from None
        await self._wait(self.sched.import_session, state)
        log.info("replica %s adopted session %s from %s", self.id, sid, path)
        return True

    def save(self) -> list[str]:
        """Write every open session to the state folder (a replica that stops)."""
        if self.state_dir is None:
            return []
        self.sched.hold()
        if self.sched.checkpoints is not None:   # older states land first
            self.sched.checkpoints.flush()
        return self.sched.save_sessions(self.state_dir)

    def close(self) -> None:
        """Stop the loop, write what the checkpoints hold, free the scheduler."""
        if self.stop.is_set():
            return
        self.stop.set()
        self.loop.join(timeout=30)
        if self.sched.checkpoints is not None:
            self.sched.checkpoints.close()
            self.sched.checkpoints = None
        self.sched.close()
        self.waits.shutdown(wait=False)

    def __del__(self):
        # Ray Serve stops a replica (scale-down, shutdown) through its destructor: its
        # sessions are written for the ingress to open on the other replicas.
        if getattr(self, "loop", None) is None or self.stop.is_set():
            return
        try:
            saved = self.save()
            log.info("replica %s stopping: %d sessions saved", self.id, len(saved))
        finally:
            self.close()
