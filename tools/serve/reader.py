"""One reader of a session's chunks in `framekv serve` (`Reader`), whatever carries them:
the WebSocket (`framekv.tools.serve.websocket`) and the long poll
(`framekv.tools.serve.poll`) each only frame what it hands out.

A reader opens by rewinding the session (`StreamScheduler.rewind`: ``after``, the last
index its client has, acknowledged, never beyond the chunks made; a new reader, so any
before it takes nothing), then asks for the next message (`Reader.next`):

    bytes   a chunk's binary message (``encode(chunk)`` on a worker thread: the same
            message whatever carries it)
    dict    the end message (`end_message`): the session finished and its client
            acknowledged every chunk (the session is closed), or it ended under the
            reader, or the server drains: its queued chunks first, then the end with
            reason "shutdown" (``"resumable"`` where the server keeps its sessions)
    None    nothing within the wait

and raises `Superseded` once another reader took the session. It reads through the
scheduler's transport-neutral calls only (`StreamScheduler.handout`, `rewind`, `ack`,
`session_info`), which the cluster's ingress answers alike (`ClusterSessions`).
"""
from __future__ import annotations

import asyncio
import time

from framekv.engine.serving import end_message

#: the longest one wait on the scheduler lasts: a drain is seen within it
POLL_S = 0.25


class Superseded(Exception):
    """Another reader took the session (a reconnect, a later poll)."""


class Reader:
    """One reader of session ``sid`` of ``sched`` (module doc): ``encode(chunk) ->
    bytes``, ``draining`` (a `threading.Event`, set with the scheduler held), ``kept``
    (the server keeps its sessions over a restart)."""

    def __init__(self, sched, sid: str, encode, draining, kept: bool = False):
        self.sched, self.sid, self.encode = sched, sid, encode
        self.draining, self.kept = draining, kept
        self.number: int | None = None       # the scheduler's reader number, once open

    async def open(self, after: int | None = None) -> None:
        """Rewind the session after ``after`` (None: every unacknowledged chunk again).
        KeyError for a session not open, ValueError for an ``after`` that is not -1
        or a chunk made (the message names the last one)."""
        self.number = await asyncio.to_thread(self.sched.rewind, self.sid, after)

    async def next(self, wait: float | None = None) -> bytes | dict | None:
        """The next message (module doc), waiting up to ``wait`` seconds (None: until
        there is one); `Superseded` once another reader took the session."""
        deadline = None if wait is None else time.monotonic() + wait
        while True:
            draining = self.draining.is_set()
            left = POLL_S if deadline is None else max(0.0, deadline - time.monotonic())
            h = await asyncio.to_thread(self.sched.handout, self.sid,
                                        0.0 if draining else min(POLL_S, left),
                                        reader=self.number)
            if h.superseded:
                raise Superseded(f"another reader took session {self.sid[:64]!r}")
            if h.chunk is not None:
                return await asyncio.to_thread(self.encode, h.chunk)
            if h.end is not None:
                return h.end
            if draining:        # the scheduler is held: no chunk comes after those queued
                info = await asyncio.to_thread(self.sched.session_info, self.sid)
                return end_message(info, "shutdown", self.kept)
            if deadline is not None and time.monotonic() >= deadline:
                return None
