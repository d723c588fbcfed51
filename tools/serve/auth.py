"""Bearer tokens of `framekv serve` (`BearerAuth`), and which pages may open its
WebSockets (`OriginCheck`).

HTTP routes take ``Authorization: Bearer <token>`` through `fastapi.security.HTTPBearer`
(the scheme's case does not matter; /openapi.json documents the scheme); the WebSocket
and the docs pages (a browser sets no header on them) also take ``?token=<token>``.
Tokens compare as bytes in constant time; a non-ASCII one is wrong. A refusal is a 401
``{"error"}`` with ``WWW-Authenticate: Bearer`` (``error="invalid_token"`` for a wrong
one); a refused WebSocket is accepted and closed with code 1008 and the reason.

A browser lets a page of any site open a WebSocket to any server (same-origin rules do
not hold for sockets) and names the page's origin in the Origin header: `OriginCheck`
takes a socket whose Origin is the server's own (its host and port those of the
request's Host header) or one listed, and refuses the others (1008, the reason naming
the origin). A socket with no Origin is not a browser page's, and is taken (its
token, if any, still checked).
(No ``from __future__ import annotations``: FastAPI reads the dependency's annotations.)
"""
import secrets

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param

from .wire import RequestError

#: a WebSocket refused for its token is closed with this code (policy violation)
WS_AUTH_CLOSE = 1008
MISSING = {"WWW-Authenticate": 'Bearer realm="framekv"'}
WRONG = {"WWW-Authenticate": 'Bearer realm="framekv", error="invalid_token"'}


class BearerAuth:
    """The token check of one app; ``token`` None: every request passes."""

    def __init__(self, token: str | None):
        self.token = None if token is None else token.encode()
        self.scheme = HTTPBearer(auto_error=False, description="The server's token "
                                 "(FRAMEKV_TOKEN) when it has one.")

    @property
    def enabled(self) -> bool:
        """Whether requests need a token."""
        return self.token is not None

    def check(self, header: str | None, query: str | None = None) -> None:
        """401 unless ``header`` (an Authorization value) is "Bearer <token>" in any case
        of the scheme, or there is no header and ``query`` (``?token=``) is the token."""
        if self.token is None:
            return
        scheme, given = get_authorization_scheme_param(header)
        if header and scheme.lower() != "bearer":
            raise RequestError(401, f"the Authorization scheme must be Bearer, got "
                                    f"{scheme[:16]!r}", MISSING)
        self._compare(given if header else query)

    def _compare(self, given: str | None) -> None:
        if not given:
            raise RequestError(401, "missing bearer token: send Authorization: Bearer "
                                    "<token>", MISSING)
        if not given.isascii() or not secrets.compare_digest(given.encode(), self.token):
            raise RequestError(401, "wrong bearer token", WRONG)

    def dependency(self):
        """A FastAPI dependency checking an HTTP request's token: the credentials
        `HTTPBearer` parsed, else (none, or another scheme) `check` of its header."""
        async def bearer(request: Request, credentials: HTTPAuthorizationCredentials | None
                         = Depends(self.scheme)) -> None:
            if self.token is not None and credentials is not None:
                self._compare(credentials.credentials)
            else:
                self.check(request.headers.get("authorization"))
        return bearer

    def check_connection(self, conn) -> None:
        """`check` of a WebSocket or a docs page: its header, else its ``?token=``."""
        self.check(conn.headers.get("authorization"), conn.query_params.get("token"))


class OriginCheck:
    """The origins whose pages may open a WebSocket besides the server's own:
    ``allowed``, normalized (`framekv.tools.args.origins`: lower case, no trailing
    slash), or ``"*"`` among them for any."""

    def __init__(self, allowed=()):
        self.allowed = frozenset(allowed)

    @classmethod
    def parse(cls, value) -> "OriginCheck":
        """The check of ``allowed_origins`` (None, a comma-separated string or a list of
        origins, `framekv.tools.args.origins`); a ValueError naming it."""
        import argparse

        from ..args import origins

        if value is None or (isinstance(value, (list, tuple)) and not value):
            return cls()
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        if not isinstance(value, str):
            raise ValueError(f"allowed_origins must be None, a comma-separated string or a "
                             f"list of origins, got a {type(value).__name__}")
        try:
            return cls(origins(value))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"allowed_origins {exc}") from None

    def refusal(self, conn) -> str | None:
        """None when ``conn`` (a WebSocket) may go on, else the close reason (at most
        123 bytes, naming the origin)."""
        origin = conn.headers.get("origin")
        if origin is None or "*" in self.allowed:
            return None
        given = origin.strip().lower().removesuffix("/")
        scheme, sep, netloc = given.partition("://")
        host = (conn.headers.get("host") or "").strip().lower()
        if given in self.allowed or (sep and scheme in ("http", "https") and host
                                     and netloc == host):
            return None
        shown = origin if len(origin) <= 60 else origin[:57] + "..."
        reason = f"origin {shown!r} is not allowed (this server's own, or --allowed-origins)"
        return reason.encode()[:123].decode(errors="ignore")
