"""`Delivery`: one stream's chunks on their way to its client, whatever carries them (a
WebSocket, a long poll); `Handout`, what one reader of them gets next; `end_message`,
the last thing every transport sends; `Deliveries`, the scheduler's calls every
transport reads through:

    handout          what a reader gets next: a chunk (it stays until acknowledged),
                     the end, or word that another reader took the stream (`Handout`)
    next_chunk       the oldest chunk not yet handed out, alone
    ack, rewind      the client has chunks up to an index (never past the last one
                     made); sends them all again, to a new reader

A `Delivery` keeps::

    queue     the chunks made and not yet acknowledged, oldest first (they stay until
              acknowledged: a client that drops gets them again)
    sent      how many of them the current reader took (handed out, on their way)
    reader    the current reader's number: a client that (re)connects makes a new one
              (`rewind`), and a reader before it takes nothing any more, so no chunk
              goes to a dead connection while its successor skips it
    acked     the last index acknowledged (-1: none), every one before it too

Contracts. An acknowledgement is cumulative and never runs ahead of the chunks made
(`ack` counts up to the last one); a rewind's ``after`` (the last index its client
has) is -1 or a chunk made (`check_after`: one beyond would have the stream make
chunks that are never sent, for nobody); a chunk made again at or below ``acked`` (a
stream resumed from an older state) is not queued. No lock here: the scheduler's lock
guards every `Delivery` (`StreamScheduler.lock`).

This is the outgoing direction of a stream. An incoming one (frames its client sends
in) is a record of its own beside it on the `Stream`, with its own bound and its own
acknowledgements; a transport carries both, neither knows the other's fields.
"""
from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass

from .records import SessionChunk

__all__ = ["Deliveries", "Delivery", "Handout", "check_after", "end_message"]


class Delivery:
    """One stream's outgoing chunks (module doc): ``queue`` of unacknowledged chunks
    (``queue`` given: those, oldest first), ``sent``, ``reader``, ``acked``."""

    def __init__(self, queue=(), acked: int = -1):
        self.queue: collections.deque = collections.deque(queue)
        self.sent, self.reader, self.acked = 0, 0, acked

    @property
    def delivered(self) -> int:
        """Chunks its client acknowledged."""
        return self.acked + 1

    @property
    def unsent(self) -> bool:
        """Whether a queued chunk waits for the current reader."""
        return self.sent < len(self.queue)

    def current(self, reader: int | None) -> bool:
        """Whether ``reader`` (None: whoever reads) is the current reader."""
        return reader is None or reader == self.reader

    def put(self, chunk: SessionChunk) -> bool:
        """Queue a chunk made, unless its client acknowledged it already (a chunk made
        again); whether it was queued."""
        if chunk.index <= self.acked:
            return False
        self.queue.append(chunk)
        return True

    def take(self, reader: int | None = None) -> SessionChunk | None:
        """The oldest chunk not yet handed out, now handed out (it stays queued until
        acknowledged); None when there is none or ``reader`` is not the current one."""
        if not self.current(reader) or not self.unsent:
            return None
        self.sent += 1
        return self.queue[self.sent - 1]

    def ack(self, index: int, made: int) -> int:
        """Every chunk up to ``index`` is its client's: they leave the queue; ``acked``
        goes no further than the last of the ``made`` chunks. How many left. ValueError
        for an index that is not an integer."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"index must be an integer, got {index!r}")
        n = 0
        while self.queue and self.queue[0].index <= index:
            self.queue.popleft()
            n += 1
        self.sent = max(0, self.sent - n)
        self.acked = max(self.acked, min(index, made - 1))
        return n

    def rewind(self, after: int | None, made: int) -> int:
        """A reader (re)connects: those up to ``after`` (None: none new) acknowledged,
        every other queued chunk to be sent again, to a new reader; its number.
        ValueError for an ``after`` that is not -1 or one of the ``made`` chunks."""
        if after is not None:
            check_after(after, made)
            self.ack(after, made)
        self.sent = 0
        self.reader += 1
        return self.reader

    def clear(self) -> None:
        """Drop every queued chunk (a stream that ends)."""
        self.queue.clear()
        self.sent = 0

    def copy(self) -> "Delivery":
        """A copy whose queue is its own (the chunks are shared)."""
        d = Delivery(self.queue, self.acked)
        d.sent, d.reader = self.sent, self.reader
        return d


@dataclass(frozen=True)
class Handout:
    """What a reader of a stream gets next (`StreamScheduler.handout`): a ``chunk``; or
    the ``end`` message (`end_message`: no chunk will come any more), ``gone`` when the
    stream was not open (ended under the reader, or moved away: its info says how);
    or ``superseded`` (another reader took the stream); or none of them (no chunk came
    in time, or the chunks handed out wait for their acknowledgement)."""

    chunk: SessionChunk | None = None
    end: dict | None = None
    superseded: bool = False
    gone: bool = False


def end_message(info: dict | None, reason: str | None = None, kept: bool = False) -> dict:
    """A stream's end message, ``{"type": "end", "state", "error"}`` and a ``"reason"``
    where it did not end by itself: ``reason`` (a drain's "shutdown"), else the end
    reason of ``info`` (`Stream.info`; None: a stream nobody knows, "closed"). A stream
    still active reads "closed". ``kept``: the server keeps its streams over a
    restart, so one open that has not failed is ``"resumable"``."""
    info = info or {"state": "closed", "error": None, "end_reason": None, "ended": True}
    reason = reason or info["end_reason"]
    state = "closed" if info["state"] == "active" else info["state"]
    end = {"type": "end", "state": state, "error": info["error"]}
    if reason is not None:
        end["reason"] = reason
    if kept and info["state"] != "failed" and not info["ended"]:
        end["resumable"] = True
    return end


def check_after(after, chunks: int) -> None:
    """ValueError unless ``after`` (the last index a client has) is -1 (none) or the
    index of one of the ``chunks`` chunks a stream made: one beyond would have it make
    chunks that are never sent, for nobody. The message names the last index made."""
    if isinstance(after, bool) or not isinstance(after, int) or not -1 <= after < max(chunks, 0):
        last = (f"the last chunk made is {chunks - 1}" if chunks > 0 else "no chunk is made yet")
        raise ValueError(f"after must be -1 or the index of a chunk made: {last}, got "
                         f"{str(after)[:40]}")


class Deliveries:
    """The scheduler's side of its streams' deliveries (module doc); its attributes are
    the scheduler's, every `Delivery` guarded by its lock."""

    def next_chunk(self, session_id: str, timeout: float | None = None, *,
                   reader: int | None = None) -> SessionChunk | None:
        """The stream's oldest chunk not yet handed out (it stays queued until `ack`),
        waiting up to ``timeout`` seconds for one; None when none came (then see the
        stream's state), the stream is gone or finished, or ``reader`` (what `rewind`
        returned) is no longer its reader: a socket that was replaced takes nothing, so
        no chunk goes to a dead socket while its successor skips it."""
        return self._next(session_id, timeout, reader, settle=False).chunk

    def handout(self, session_id: str, timeout: float | None = None, *,
                reader: int | None = None) -> Handout:
        """What ``reader`` (what `rewind` returned; None: whoever reads) gets next,
        waiting up to ``timeout`` seconds: the stream's oldest chunk not yet handed out;
        the end once the stream is finished and its client acknowledged every chunk
        (the stream is then closed, its end reason its state), or once it is not open
        (``gone``: ended under the reader, or exported); ``superseded`` once another
        reader took it; else nothing (`Handout`). Every transport reads through it."""
        h = self._next(session_id, timeout, reader, settle=True)
        if h.end is not None and not h.gone:
            with contextlib.suppress(KeyError):       # closed meanwhile: ended all the same
                self.close_session(session_id, h.end["state"])
        return h

    def _next(self, session_id: str, timeout, reader, settle: bool) -> Handout:
        """`handout`'s wait (``settle``: a finished stream whose chunks wait for their
        acknowledgement is waited on, else answered at once), the stream left open."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.ready:
            s = self.sessions.get(session_id)
            while True:
                if s is None or self.sessions.get(session_id) is not s:
                    return Handout(end=end_message(self.session_info(session_id)), gone=True)
                d = s.delivery
                if not d.current(reader):
                    return Handout(superseded=True)
                chunk = d.take()
                if chunk is not None:
                    if chunk.received is not None:      # its input's latency, once
                        self._input_seconds.observe(time.monotonic() - chunk.received)
                        chunk.received = None
                    return Handout(chunk=chunk)
                if s.finished and not d.queue:
                    return Handout(end=end_message(s.info()))
                left = None if deadline is None else deadline - time.monotonic()
                if (s.finished and not settle) or (left is not None and left <= 0):
                    return Handout()
                self.ready.wait(left)

    def ack(self, session_id: str, index: int) -> int:
        """The client has every chunk up to ``index``: they leave the queue (a place
        freed: the stream may be ready again); its acknowledged index goes no further
        than the last chunk made (`Delivery.ack`). Returns how many left. KeyError for
        an id that is not open, ValueError for an index that is not an integer."""
        with self.lock:
            s = self.sessions[session_id]
            n = s.delivery.ack(index, s.chunks)
            self._mark_waiting(s)
            self.ready.notify_all()
            return n

    def rewind(self, session_id: str, after: int | None = None) -> int:
        """A client (re)connects: every unacknowledged chunk is sent again, after those
        up to ``after`` (the last index it has) are acknowledged. ``after`` must lie
        within the chunks made (`check_after`: a stream resumed from a checkpoint older
        than what its client got is behind it; the client reconnects at the stream's
        last chunk and takes the chunks made again). Returns the new reader's number for
        `next_chunk` and `handout` (any reader before it takes no more). KeyError for an
        id that is not open, ValueError for an ``after`` that is not a chunk made."""
        with self.lock:
            s = self.sessions[session_id]
            reader = s.delivery.rewind(after, s.chunks)
            self._mark_waiting(s)
            self.ready.notify_all()
            return reader
