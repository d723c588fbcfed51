"""The cluster's logs without a traceback for a client that went away.

Ray Serve's proxy forwards each WebSocket message of the ingress to its client; when
the client has closed its socket (a browser that stops a stream, a page closed) while
a message was on its way, the proxy's send fails, and its response generator, closed
mid-``yield``, logs "Request failed due to unexpected error." with a ``GeneratorExit``
traceback, then asyncio's "Task exception was never retrieved" for the generator's
``RuntimeError: async generator ignored GeneratorExit``. Nothing failed: the client is
gone and its session stays open for it (it reconnects by id). `quiet_client_gone`, run
in every worker of the cluster's job (Ray's ``worker_process_setup_hook``: `HOOK`), drops
exactly those two records; every other record, the proxy's other errors included,
passes.
"""
from __future__ import annotations

import logging

#: the hook's import path, for ``ray.init(runtime_env={"worker_process_setup_hook": HOOK})``
HOOK = f"{__name__}.quiet_client_gone"
#: the loggers the two records come from: Ray Serve's and asyncio's
LOGGERS = ("ray.serve", "asyncio")


class ClientGone(logging.Filter):
    """Drops the proxy's two records of a client that closed its socket (module doc)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, GeneratorExit):
            return False
        return not (isinstance(exc, RuntimeError)
                    and "async generator ignored GeneratorExit" in str(exc))


def quiet_client_gone() -> None:
    """Install one `ClientGone` on each of `LOGGERS` (both records are logged on those
    loggers themselves, so a logger's filter sees them); again: no change."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, ClientGone) for f in logger.filters):
            logger.addFilter(ClientGone())
