"""The cluster's ingress: `Ingress`, a Ray Serve deployment serving the HTTP and
WebSocket API and the page of ``framekv serve`` (`build_app` over `ClusterSessions`),
and the routes only a cluster has (`cluster_routes`)::

    POST /v1/sessions/{id}/move         {"to": REPLICA}? -> 200 {"id", "from", "to",
                                        "bytes", "export_s", "transfer_s", "import_s",
                                        "seconds"}; 404 no such session open, 422 no
                                        such replica (or its own), 409 moving already,
                                        503 (Retry-After) no other replica has room
    GET  /v1/cluster/replicas           [{"id", "pid", "sessions", "max_sessions",
                                        "slots", "draining"}]
    POST /v1/cluster/replicas/{id}/drain
                                        no new session there, each of its sessions
                                        moved -> {"replica", "moved", "left"}; 404 no
                                        such replica

/v1/info lists the replicas too; /metrics labels each series with its ``replica``;
/health answers 503 while no replica is up, and POST /v1/sessions 503 with Retry-After.
Every route takes the token as ``framekv serve``'s do.
(No ``from __future__ import annotations``: FastAPI reads the routes' annotations.)
"""
import asyncio
import concurrent.futures

from .moves import MoveConflict
from .sessions import ClusterSessions


class Ingress:
    """The ingress deployment's class (wrapped by ``serve.ingress()`` in `deployments`):
    ``replicas`` the replica deployment's handle, ``settings`` `build_app`'s options
    (token, output, frame_format, fps, idle_timeout, model, allowed_origins)."""

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
    """`build_app` over ``sessions`` with `cluster_routes`."""
    from framekv.tools.serve import build_app

    app = build_app(sessions, **settings)
    cluster_routes(app, sessions, settings.get("token"))
    return app


def cluster_routes(app, sessions: ClusterSessions, token) -> None:
    """The move, the replicas and a drain (module doc)."""
    from fastapi import Body, Depends

    from framekv.engine.serving import SchedulerFull
    from framekv.tools.serve.auth import BearerAuth
    from framekv.tools.serve.models import errors
    from framekv.tools.serve.wire import RequestError

    from .models import MoveBody, MoveReport, ReplicaInfo

    auth = [Depends(BearerAuth(token).dependency())]

    @app.post("/v1/sessions/{sid}/move", response_model=MoveReport, dependencies=auth,
              responses=errors(401, 404, 409, 422, 503),
              summary="Move a session to another replica; its socket stays")
    async def move(sid: str, body: MoveBody = Body(default_factory=MoveBody)):
        try:
            return await asyncio.to_thread(sessions.move, sid, body.to)
        except KeyError:
            raise RequestError(404, f"no such session open: {sid[:64]!r}") from None
        except MoveConflict as exc:
            raise RequestError(409, str(exc)) from None
        except SchedulerFull as exc:
            raise RequestError(503, f"no other replica can take it: {exc}",
                               {"Retry-After": "5"}) from None
        except ValueError as exc:
            raise RequestError(422, str(exc)) from None

    @app.get("/v1/cluster/replicas", response_model=list[ReplicaInfo], dependencies=auth,
             responses=errors(401), summary="The replicas: sessions, slots, draining")
    async def replicas():
        return sessions.replica_info()

    @app.post("/v1/cluster/replicas/{rid}/drain", dependencies=auth,
              responses=errors(401, 404),
              summary="Take no new session there and move each of its sessions off")
    async def drain(rid: str):
        try:
            return await asyncio.to_thread(sessions.drain, rid)
        except KeyError:
            raise RequestError(404, f"no such replica: {rid[:64]!r} (GET "
                                    "/v1/cluster/replicas lists them)") from None
