"""The connections of `framekv serve`: uvicorn's config with deadlines (`server_config`)
and a server that ends every stream cleanly before it closes them (`DrainingServer`).

Deadlines: a connection must send each request head within ``head_timeout`` seconds of
opening, or of its previous response ending (`HeadDeadline`), however slowly it
trickles, else it is closed; an idle keep-alive connection closes after ``keep_alive``
seconds (uvicorn's ``timeout_keep_alive``); a request body has the app's
``body_timeout`` (`build_app`). A request head is at most `MAX_HEAD_BYTES` (16 KiB),
counted as it arrives (`HeadDeadline`: h11's own bound holds only while a head is
incomplete, so a large head that arrives at once would pass it): a longer one is
answered 431 ``{"error"}`` and its connection closed, before the app sees it.

Shutdown (SIGTERM): `DrainingServer` stops accepting, then awaits the app's
``state.drain`` (every socket gets its queued chunks and an end message with reason
"shutdown"), at most ``drain_timeout`` seconds, then shuts down as uvicorn does.

Sockets: no permessage-deflate. Every binary message is a chunk of fp32 latents or of
JPEG / WebP frames, which do not compress, and deflating them runs on the event loop
that answers every route.

Logs: uvicorn's access and error loggers print a request's path with its query, and a
browser's WebSocket and docs pages carry ``?token=``; `redact_tokens` installs
`RedactTokens` on both, so no token value reaches a log line.
"""
from __future__ import annotations

import json
import logging
import re

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0     # seconds a client may take to send a request head
KEEP_ALIVE_S = 5          # seconds an idle keep-alive connection stays open
DRAIN_TIMEOUT_S = 10.0    # seconds the streams get to end on shutdown
MAX_HEAD_BYTES = 16 * 1024   # a request head's bytes at most: its line and headers
#: the loggers uvicorn writes request paths to (access lines; WebSocket lines)
UVICORN_LOGGERS = ("uvicorn.access", "uvicorn.error")


class RedactTokens(logging.Filter):
    """Rewrites a record's message and string arguments so that the value of every
    ``token=`` query parameter reads ``[redacted]``; never drops a record."""

    PATTERN = re.compile(r"(token=)[^&\s\"'#]*", re.IGNORECASE)

    def _clean(self, x):
        return self.PATTERN.sub(r"\1[redacted]", x) if isinstance(x, str) else x

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self._clean(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self._clean(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: self._clean(v) for k, v in record.args.items()}
        return True


def redact_tokens() -> None:
    """Install one `RedactTokens` on each of `UVICORN_LOGGERS` (again: no change)."""
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactTokens) for f in logger.filters):
            logger.addFilter(RedactTokens())


class HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline and a size bound on each request head
    (module doc); the subclasses `server_config` makes set ``head_timeout``."""

    head_timeout = HEAD_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._deadline = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        # Armed: a head is awaited, so these bytes are (the start of) one.
        if self._deadline is not None and self._head_too_long(data):
            return self._refuse_head()
        super().data_received(data)
        if self.cycle is not self._waiting or self.transport.get_protocol() is not self:
            self._disarm()                     # a request began, or a WebSocket took over

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        if self.cycle is cycle and not self.transport.is_closing():
            self._arm()                        # no pipelined request began: wait for one

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._waiting = self.cycle
        self._head_bytes, self._head_tail = 0, b""
        self._deadline = self.loop.call_later(self.head_timeout, self._expired)

    def _head_too_long(self, data: bytes) -> bool:
        """Whether the head being received, with ``data``, is over `MAX_HEAD_BYTES`:
        its bytes up to the blank line that ends it, or all of them while none came."""
        window = self._head_tail + data          # the end may straddle two reads
        end = window.find(b"\r\n\r\n")
        if end >= 0:
            return self._head_bytes - len(self._head_tail) + end + 4 > MAX_HEAD_BYTES
        self._head_bytes += len(data)
        self._head_tail = window[-3:]
        return self._head_bytes > MAX_HEAD_BYTES

    def _refuse_head(self) -> None:
        """431 and the connection closed; h11 never saw the head, so the answer is
        written as is."""
        self._disarm()
        self.logger.info("refusing a request head over %d bytes", MAX_HEAD_BYTES)
        body = json.dumps({"error": f"the request head (its line and headers) must be at "
                                    f"most {MAX_HEAD_BYTES} bytes, got more"}).encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                             b"content-type: application/json\r\n"
                             b"content-length: " + str(len(body)).encode() + b"\r\n"
                             b"connection: close\r\n\r\n" + body)
        self.transport.close()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request head took over %s s",
                             self.head_timeout)
            self.transport.close()


def server_config(app, *, host: str = "127.0.0.1", port: int = 8000,
                  head_timeout: float = HEAD_TIMEOUT_S, keep_alive: int = KEEP_ALIVE_S,
                  log_level: str = "info") -> uvicorn.Config:
    """uvicorn's config for ``app`` with the deadlines of the module doc (h11)."""
    if not head_timeout > 0 or not keep_alive > 0:
        raise ValueError(f"head_timeout and keep_alive must be > 0 seconds, got "
                         f"{head_timeout} and {keep_alive}")
    protocol = type("HeadDeadline", (HeadDeadline,), {"head_timeout": head_timeout})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            timeout_keep_alive=keep_alive, ws_per_message_deflate=False,
                            h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    redact_tokens()              # after uvicorn's logging setup, which keeps filters
    return config


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown ends every stream first (module doc)."""

    def __init__(self, config: uvicorn.Config, drain_timeout: float = DRAIN_TIMEOUT_S):
        super().__init__(config)
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets=None) -> None:
        for server in getattr(self, "servers", []):
            server.close()                     # no new connection while the streams end
        drain = getattr(getattr(self.config.app, "state", None), "drain", None)
        if drain is not None:
            await drain(self.drain_timeout)
        await super().shutdown(sockets=sockets)
