"""The long-poll transport of `framekv.client` (`PollLink`, `AsyncPollLink`): a session's
chunks by ``GET /v1/sessions/{id}/chunks?after=I&wait=S``, its control messages by
``POST /v1/sessions/{id}/control``, where a WebSocket cannot be opened (a proxy or a
load balancer that refuses the upgrade).

A link carries the socket's messages, so a session reads and writes it as it does its
socket: ``recv`` the next message (a chunk's binary message, byte for byte the
socket's; the end message, JSON text; first, a prompt change's answer where one
came), ``send`` a control message. An ack is the next request's ``after`` (nothing is
sent for it); any other message is POSTed, and its answer (``prompt_ack``, or
``prompt_pending`` past the server's wait) is the next ``recv``'s. Each request is a
reader of its own on the server: one cut off (a timeout, a proxy's) is asked again
with the same ``after`` and answers the same chunk, so none is lost.
"""
from __future__ import annotations

import collections
import json
import time

from .wire import check_response

#: seconds one request waits on the server for a chunk (its most: 60)
POLL_WAIT_S = 10.0
JSON = {"Content-Type": "application/json"}


class Poll:
    """A link's state, no I/O (module doc): the session's path, the ``after`` its next
    request names (None: none yet), the answers to control messages not yet read, and
    the seconds a request may take besides its wait."""

    def __init__(self, sid: str, after: int | None, timeout: float):
        self.path, self.after, self.timeout = f"/v1/sessions/{sid}", after, timeout
        self.replies: collections.deque = collections.deque()

    def request(self, deadline: float | None) -> dict:
        """The next GET's arguments (url, params, timeout) for a wait up to
        ``deadline`` (`time.monotonic`; None: none); TimeoutError once it passed."""
        wait = POLL_WAIT_S
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError("no message came within the timeout")
        params = {"wait": round(wait, 3)}
        if self.after is not None:
            params["after"] = self.after
        return {"url": f"{self.path}/chunks", "params": params, "timeout": wait + self.timeout}

    def answer(self, r) -> bytes | str | None:
        """A GET's message: a chunk (bytes), the end (text), or None (204: none came);
        `ServerError` for a refusal."""
        check_response(r)
        if r.status_code == 204:
            return None
        return r.text if r.headers.get("content-type", "").startswith("application/json") \
            else r.content

    def reply(self) -> str | None:
        """The oldest answer to a control message not yet read, or None."""
        return self.replies.popleft() if self.replies else None

    def sent(self, text: str) -> dict | None:
        """A control message to send: an ack noted for the next GET (None: nothing to
        send), any other the POST's arguments."""
        msg = json.loads(text)
        if msg.get("type") == "ack":
            self.after = max(msg["index"], -1 if self.after is None else self.after)
            return None
        return {"url": f"{self.path}/control", "content": text, "headers": JSON}

    def replied(self, r) -> None:
        """A POST's answer: kept for `reply` (204: none); `ServerError` for a refusal."""
        if check_response(r).status_code != 204:
            self.replies.append(r.text)


class PollLink:
    """The long poll of one session over a blocking `httpx.Client` (module doc)."""

    def __init__(self, http, sid: str, after: int | None, timeout: float):
        self.http, self.poll = http, Poll(sid, after, timeout)

    def recv(self, timeout: float | None = None) -> bytes | str:
        """The next message, waiting up to ``timeout`` seconds (TimeoutError past it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        msg = self.poll.reply()
        while msg is None:
            msg = self.poll.answer(self.http.get(**self.poll.request(deadline)))
        return msg

    def send(self, text: str) -> None:
        """Send a control message (an ack: with the next request)."""
        post = self.poll.sent(text)
        if post is not None:
            self.poll.replied(self.http.post(**post))


class AsyncPollLink:
    """The long poll of one session over an `httpx.AsyncClient` (module doc); its
    ``recv`` waits until a message comes (bound it with ``asyncio.wait_for``: a request
    cut off is asked again)."""

    def __init__(self, http, sid: str, after: int | None, timeout: float):
        self.http, self.poll = http, Poll(sid, after, timeout)

    async def recv(self) -> bytes | str:
        msg = self.poll.reply()
        while msg is None:
            msg = self.poll.answer(await self.http.get(**self.poll.request(None)))
        return msg

    async def send(self, text: str) -> None:
        post = self.poll.sent(text)
        if post is not None:
            self.poll.replied(await self.http.post(**post))

    async def close(self) -> None:
        """Nothing to close: every request ended."""
