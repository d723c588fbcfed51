"""The cluster's ingress: `Ingress`, a Ray Serve deployment serving the HTTP and
WebSocket API and the page of ``framekv serve`` (`build_app` over `ClusterSessions`),
and the routes only a cluster has (`cluster_routes`)::

    POST /v1/sessions/{id}/move         {"to": REPLICA}? -> 200 {"id", "from", "to",
                                        "bytes", "export_s", "transfer_s", "import_s",
                                        "seconds"}; 404 no such session open, 422 no
                                        such replica (or its own), 409 moving already,
                                        503 (Retry-After) no other replica has room
    GET  /v1/cluster/replicas           [{"id", "pid", "sessions", "max_sessions",
                                        "slots", "draining", "takes_sessions"}]
    POST /v1/cluster/replicas/{id}/drain
                                        no new session there, each of its sessions
                                        moved -> {"replica", "moved", "left"}; 404 no
                                        such replica
    POST /v1/cluster/replicas/{id}/undrain
                                        new sessions there again -> {"replica",
                                        "draining": false}; 404 no such replica

These are the admin routes: with an admin token (``--admin-token``,
``FRAMEKV_ADMIN_TOKEN``) each needs it and the session token does not pass; without
one they take the session token as every other route does. A POST's body is read as
``POST /v1/sessions``' is (at most 1 MiB counted as it arrives, strict JSON, a JSON
object: 400 naming the fault; no body at all is ``{}``), and no error echoes more than
a short prefix of a value. /v1/info lists the replicas too (without their process
ids); /metrics labels each series with its ``replica``; /health answers 503 while no
replica is up, 200 "degraded" with the reason while none takes new sessions (each
draining), and POST /v1/sessions 503 with Retry-After.
(No ``from __future__ import annotations``: FastAPI reads the routes' annotations.)
"""
import asyncio
import concurrent.futures

from framekv.tools.serve.wire import BODY_TIMEOUT_S

from .moves import MoveConflict
from .sessions import ClusterSessions


class Ingress:
    """The ingress deployment's class (wrapped by ``serve.ingress()`` in `deployments`):
    ``replicas`` the replica deployment's handle, ``settings`` `build_app`'s options
    (token, output, frame_format, fps, idle_timeout, model, allowed_origins) and the
    ``admin_token``."""

    async def __init__(self, replicas, settings: dict):
        # every socket's sender waits on a replica in a thread: room for all of them
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max_workers=512,
                                                  thread_name_prefix="framekv-ingress"))
        described = await replicas.options(multiplexed_model_id="").describe.remote()
        self.sessions = ClusterSessions(replicas, described)
        self.settings = settings

    def __serve_build_asgi_app__(self):
        return cluster_app(self.sessions, self.settings)


def cluster_app(sessions: ClusterSessions, settings: dict):
    """`build_app` over ``sessions`` (``settings``: its options, and ``admin_token``)
    with `cluster_routes`."""
    from framekv.tools.serve import build_app

    settings = dict(settings)
    admin = settings.pop("admin_token", None)
    app = build_app(sessions, **settings)
    cluster_routes(app, sessions, settings.get("token"), admin,
                   settings.get("body_timeout", BODY_TIMEOUT_S))
    return app


def cluster_routes(app, sessions: ClusterSessions, token, admin_token=None,
                   body_timeout: float = BODY_TIMEOUT_S) -> None:
    """The move, the replicas, a drain and its undoing (module doc): behind
    ``admin_token`` where there is one, else ``token``."""
    from fastapi import Body, Depends

    from framekv.tools.serve.auth import BearerAuth
    from framekv.tools.serve.models import errors
    from framekv.tools.serve.routes import json_body_route

    from .models import MoveBody, MoveReport, ReplicaInfo

    auth = BearerAuth(token if admin_token is None else admin_token)
    guard, body_route = [Depends(auth.dependency())], json_body_route(
        auth, body_timeout, optional=True)

    async def move(sid: str, body: MoveBody = Body(default_factory=MoveBody)):
        return await asyncio.to_thread(_move, sessions, sid, body.to)

    app.router.add_api_route(
        "/v1/sessions/{sid}/move", move, methods=["POST"], response_model=MoveReport,
        dependencies=guard, route_class_override=body_route, strict_content_type=False,
        responses=errors(400, 401, 404, 409, 411, 413, 422, 503),
        summary="Move a session to another replica; its socket stays")

    @app.get("/v1/cluster/replicas", response_model=list[ReplicaInfo], dependencies=guard,
             responses=errors(401), summary="The replicas: sessions, slots, draining")
    async def replicas():
        return sessions.replica_info()

    for action, summary in (("drain", "Take no new session there and move each of its "
                                      "sessions off"),
                            ("undrain", "Take new sessions there again")):
        app.router.add_api_route(
            f"/v1/cluster/replicas/{{rid}}/{action}", _replica_action(sessions, action),
            methods=["POST"], dependencies=guard, route_class_override=body_route,
            strict_content_type=False, responses=errors(400, 401, 404, 411, 413),
            summary=summary)


def _move(sessions: ClusterSessions, sid: str, to):
    """`ClusterSessions.move`, its refusals as the route's errors."""
    from framekv.engine.serving import SchedulerFull
    from framekv.tools.serve.wire import RequestError

    try:
        return sessions.move(sid, to)
    except KeyError:
        raise RequestError(404, f"no such session open: {sid[:64]!r}") from None
    except MoveConflict as exc:
        raise RequestError(409, str(exc)) from None
    except SchedulerFull as exc:
        raise RequestError(503, f"no other replica can take it: {exc}",
                           {"Retry-After": "5"}) from None
    except ValueError as exc:
        raise RequestError(422, str(exc)) from None


def _replica_action(sessions: ClusterSessions, action: str):
    """The route of ``POST /v1/cluster/replicas/{rid}/<action>`` (drain, undrain)."""
    from framekv.tools.serve.wire import RequestError

    async def act(rid: str):
        try:
            return await asyncio.to_thread(getattr(sessions, action), rid)
        except KeyError:
            raise RequestError(404, f"no such replica: {rid[:64]!r} (GET "
                                    "/v1/cluster/replicas lists them)") from None
    act.__name__ = action
    return act
