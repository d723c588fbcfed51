"""The one error shape of `framekv serve`: every error a JSON ``{"error": ...}``
(`error_handlers`), the connection closed where the request's body was not read
(`closes_unread`), and an exception no route handled answered 500 (`InternalErrors`).
"""
import logging

from .wire import BODY_READ, RequestError

log = logging.getLogger("framekv.serve")


def error_handlers(app) -> None:
    """Every error as ``{"error": ...}``: the server's own, FastAPI's validation errors
    (422, one line naming the field, expected and actual value), the router's 404 and
    405, and any exception no route handled (500, `InternalErrors`). Each closes the
    connection when the request's body was not read (`closes_unread`)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    from .models import validation_message

    @app.exception_handler(RequestError)
    async def _err(request, exc: RequestError):
        return _error(request, exc.status, exc.message, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _error(request, 422, validation_message(exc.errors()))

    @app.exception_handler(HTTPException)
    async def _http(request, exc: HTTPException):
        return _http_error(request, exc)

    app.add_middleware(InternalErrors)


def _error(request, status: int, message: str, headers=None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message}, status, headers=closes_unread(request, headers))


def _http_error(request, exc):
    """The router's own errors: 404 (no route has the path), 405 (routes have it, not
    for this method: ``Allow`` names the methods of every route of the path)."""
    from http import HTTPStatus

    from starlette.routing import Match

    method, path, headers = request.method, request.url.path[:200], dict(exc.headers or {})
    if exc.status_code == 404 and exc.detail == HTTPStatus.NOT_FOUND.phrase:
        message = f"no such route: {method} {path} (the API: /docs)"
    elif exc.status_code == 405:
        allowed = sorted({m for route in request.app.router.routes
                          if getattr(route, "methods", None)
                          and route.matches(request.scope)[0] is not Match.NONE
                          for m in route.methods})
        headers["Allow"] = ", ".join(allowed) or headers.get("Allow", "")
        message = f"method {method} is not allowed on {path}: use {headers['Allow']}"
    else:
        message = str(exc.detail)
    return _error(request, exc.status_code, message, headers)


class InternalErrors:
    """ASGI middleware: an exception no route or handler answered becomes a 500
    ``{"error": "internal error: <type>: <message>"}``, its traceback logged once.
    (Not ``exception_handler(Exception)``: Starlette raises the exception again after
    such a handler has answered, so uvicorn would log it twice and drop the
    connection.) An exception once a response has begun goes on to uvicorn, which logs
    it and closes the connection: nothing else can end that response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            if started:
                raise
            log.error("internal error answering %s %s", scope.get("method"),
                      scope.get("path"), exc_info=exc)
            from starlette.requests import Request

            message = " ".join(f"internal error: {type(exc).__name__}: {exc}".split())
            await _error(Request(scope), 500, message[:500])(scope, receive, send)


def closes_unread(request, headers: dict | None = None) -> dict:
    """``headers`` for an error answered to ``request``, with ``Connection: close`` when
    the request declares a body that was not read (`framekv.tools.serve.wire.read_body`):
    a client refused before its upload (a 401, say) must not have the server read, or
    wait for, the rest of it."""
    headers = dict(headers or {})
    length = request.headers.get("content-length")
    declared = "transfer-encoding" in request.headers or (length is not None
                                                          and length.strip() != "0")
    if declared and not request.scope.get(BODY_READ):
        headers["Connection"] = "close"
    return headers
