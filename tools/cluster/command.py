"""``framekv serve --replicas N`` and ``framekv cluster``: the server on a Ray cluster.

``--replicas N`` (or ``--min-replicas A --max-replicas B``: Ray Serve scales between
them on the sessions open, ``--target-sessions`` a replica, `autoscale`) starts a
local Ray cluster, or joins one (``--ray-address``), and deploys the application
`deployments` builds: N replicas of the scheduler every other ``framekv serve`` flag
describes (one GPU each; on a CPU host ``--replica-cpus`` cores), behind the ingress on
``--host``/``--port`` serving the API and the page of one server. Sessions are kept in
``--state-dir`` (on a local cluster without one, a temporary folder made at start and
removed at exit; joining a cluster of several hosts needs one every host reads), so a
replica that stops hands its sessions on; ``--checkpoint-every`` makes that hold for a
replica killed outright. The cluster extra and the address are checked before Ray
starts (`framekv.tools.serve.preflight`); SIGTERM stops the cluster (exit status 0),
Ctrl-C too, then ends with one line and exit status 130. Every worker drops Ray
Serve's proxy's traceback for a client that went away (`logs`).

``framekv cluster replicas`` lists the replicas; ``framekv cluster drain REPLICA``
moves every session off one, ``framekv cluster undrain REPLICA`` has it take new
sessions again (``--url`` the ingress; the token from FRAMEKV_ADMIN_TOKEN, else
FRAMEKV_TOKEN). ``--admin-token`` (or FRAMEKV_ADMIN_TOKEN) guards those routes and the
move: with it, the session token does not pass them.
Ray is imported only here (``pip install 'framekv[cluster]'``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from urllib.parse import quote

from ..args import bearer_token, int_in, positive_int
from ..serve import command as serve_command
from ..serve.preflight import SERVE_MODULES, check_address, check_extra
from ..serve.tokens import token_of, warn_unguarded
from .autoscale import autoscaling_config
from .logs import HOOK

MAX_REPLICAS = 256
APP = "framekv"
#: the modules of the cluster extra: the server's and Ray Serve
CLUSTER_MODULES = {**SERVE_MODULES, "ray.serve": "ray[serve]"}
#: Ray Serve's proxy checks, lengthened: a host whose cores are busy (replicas starting,
#: a test suite beside them) answers its first check late, and Serve kills the proxy
SLOW_HOST_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
                 "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
                 "RAY_SERVE_PROXY_GRACEFUL_SHUTDOWN_TIMEOUT_S": "30"}


def add_arguments(serve_parser: argparse.ArgumentParser) -> None:
    """The cluster's flags on ``framekv serve``; its command dispatches by them."""
    g = serve_parser.add_argument_group("cluster (pip install 'framekv[cluster]')")
    g.add_argument("--replicas", type=int_in(1, MAX_REPLICAS), default=None, metavar="N",
                   help="serve from N replicas on a Ray cluster, each a scheduler of the "
                        "flags above (one GPU each)")
    g.add_argument("--min-replicas", type=int_in(1, MAX_REPLICAS), default=None, metavar="A",
                   help="with --max-replicas: Ray Serve scales the replicas between A and B")
    g.add_argument("--max-replicas", type=int_in(1, MAX_REPLICAS), default=None, metavar="B")
    g.add_argument("--target-sessions", type=positive_int, default=None, metavar="S",
                   help="autoscaling's sessions per replica: it keeps floor(sessions / S) + 1 "
                        "replicas (default: --max-sessions)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (default: start a local one)")
    g.add_argument("--replica-cpus", type=positive_int, default=1, metavar="N",
                   help="CPU cores a replica takes on a host without GPUs (default 1)")
    g.add_argument("--admin-token", type=bearer_token, default=None, metavar="TOKEN",
                   help="the token the cluster's admin routes (move, drain, undrain, "
                        "replicas) need instead of the session token; prefer the "
                        "FRAMEKV_ADMIN_TOKEN environment variable")
    serve_parser.set_defaults(func=run_serve)


def run_serve(args) -> int:
    """``framekv serve``: one server, or a cluster with ``--replicas`` / autoscaling."""
    if args.replicas is None and args.min_replicas is None and args.max_replicas is None:
        if args.admin_token is not None:
            return serve_command.fail(ValueError(
                "--admin-token guards a cluster's move, drain, undrain and replica routes: "
                "it needs --replicas (or --min-replicas and --max-replicas)"))
        return serve_command.run(args)
    return run_cluster(args)


def scaling(args) -> dict:
    """Ray Serve's replica count: ``num_replicas``, or ``autoscaling_config``;
    ValueError naming the flags for a bad combination."""
    lo, hi = args.min_replicas, args.max_replicas
    if lo is None and hi is None:
        return {"num_replicas": args.replicas}
    if args.replicas is not None or lo is None or hi is None:
        raise ValueError(f"autoscaling takes both --min-replicas and --max-replicas and no "
                         f"--replicas, got --replicas {args.replicas}, --min-replicas {lo}, "
                         f"--max-replicas {hi}")
    if lo > hi:
        raise ValueError(f"--min-replicas must be at most --max-replicas ({hi}), got {lo}")
    return {"autoscaling_config": autoscaling_config(
        lo, hi, args.target_sessions or args.max_sessions)}


def settings(args, options: dict) -> dict:
    """`build_app`'s options for the ingress (resolved here: a worker does not see this
    process's environment, FRAMEKV_TOKEN included)."""
    return {"token": options["token"], "admin_token": options.get("admin_token"),
            "output": options["output"],
            "frame_format": args.frame_format, "fps": args.fps,
            "idle_timeout": args.session_idle_timeout, "model": serve_command.model_name(args),
            "allowed_origins": args.allowed_origins}


def deployments(args, options: dict):
    """The Ray Serve application: the ingress bound to the replica deployment."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .ingress import Ingress
    from .replica import Replica
    from .router import ReplicaRouter

    gpu = str(options["device"]).startswith("cuda")
    replica = serve.deployment(
        Replica, name="replica", max_ongoing_requests=100_000,
        ray_actor_options={"num_gpus": 1} if gpu else {"num_cpus": args.replica_cpus},
        # named, not pickled: the ingress reads this very module's routers (`live_replicas`)
        request_router_config=RequestRouterConfig(
            request_router_class=f"{ReplicaRouter.__module__}.{ReplicaRouter.__name__}",
            request_routing_stats_period_s=1.0),
        graceful_shutdown_timeout_s=60, health_check_period_s=2,
        max_constructor_retry_count=2, **scaling(args))   # a replica that cannot start: fail
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress",
                               max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
    return ingress.bind(replica.bind(args), settings(args, options))


def _cluster_args(args, stack: contextlib.ExitStack) -> tuple[argparse.Namespace, dict]:
    """``args`` checked (`checked_options`), with a state folder every replica uses: on
    a local cluster without ``--state-dir`` a temporary one, which ``stack`` removes."""
    temporary = args.state_dir is None and args.ray_address is None
    if temporary:
        args.state_dir = stack.enter_context(tempfile.TemporaryDirectory(
            prefix="framekv-sessions-", ignore_cleanup_errors=True))
    options = serve_command.checked_options(args)
    options["state_note"] = ", a temporary folder removed at exit" if temporary else ""
    scaling(args)
    admin = token_of(args, option="admin_token", env="FRAMEKV_ADMIN_TOKEN")
    if admin is not None and admin == options["token"]:
        raise ValueError("the admin token (--admin-token, FRAMEKV_ADMIN_TOKEN) must differ "
                         "from the session token: the session token must not pass the "
                         "admin routes")
    options["admin_token"] = admin
    if options["state_dir"] is None:
        print("framekv serve: warning: no --state-dir on a joined cluster: a replica "
              "that stops ends its sessions", file=sys.stderr)
    args.state_dir = None if options["state_dir"] is None else str(options["state_dir"])
    return args, options


def start_ray(args, options: dict) -> None:
    """Join ``--ray-address`` or start a local cluster with room for every replica;
    ValueError when it has fewer GPUs than replicas asked for."""
    import ray
    from ray import serve

    want = args.replicas or args.min_replicas or 1
    for name, value in SLOW_HOST_ENV.items():     # a busy host must not fail Serve's checks
        os.environ.setdefault(name, value)
    env = {"worker_process_setup_hook": HOOK}      # no traceback for a client gone
    if args.ray_address is None:
        cpus = max(os.cpu_count() or 1, want * args.replica_cpus + 1,
                   (args.max_replicas or want) * args.replica_cpus + 1)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, namespace=APP,
                 logging_level="WARNING", configure_logging=False, runtime_env=env)
    else:
        ray.init(address=args.ray_address, namespace=APP, logging_level="WARNING",
                 runtime_env=env)
    if str(options["device"]).startswith("cuda"):
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if gpus < want:
            raise ValueError(f"--replicas needs a GPU per replica: the cluster has {gpus}, "
                             f"{want} asked for")
    serve.start(http_options={"host": args.host, "port": args.port})


def run_cluster(args) -> int:
    """Deploy, print where, serve until SIGTERM or Ctrl-C (module doc); 2 for a bad
    option, a missing extra, an address in use, or a replica that cannot start (its
    error named). A temporary state folder is removed at exit, however it ends."""
    with contextlib.ExitStack() as stack:
        try:
            check_extra("cluster", CLUSTER_MODULES)
            args, options = _cluster_args(args, stack)
            check_address(args.host, args.port)
        except ValueError as exc:
            return serve_command.fail(exc)
        return _serve_cluster(args, options)


def _serve_cluster(args, options: dict) -> int:
    """Start Ray, deploy and serve (`run_cluster`)."""
    import signal

    from ray import serve

    warn_unguarded(args.host, options["token"])
    stop = []
    try:
        start_ray(args, options)
        # before the deploy: the ingress answers while the last replica still starts, so
        # a SIGTERM may come then (Ray's own handlers are in place once it started)
        signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
        serve.run(deployments(args, options), name=APP, route_prefix="/")
    except (ValueError, RuntimeError) as exc:
        if isinstance(exc, RuntimeError):     # a replica or the ingress failed to start
            exc = RuntimeError(f"the cluster did not start: {_why_not_started(exc)}")
        _disconnect()
        return serve_command.fail(exc)
    print(f"framekv cluster: serving on http://{args.host}:{args.port} (state in "
          f"{args.state_dir}{options['state_note']})", flush=True)
    try:
        while not stop:
            time.sleep(0.5)
    finally:                      # Ctrl-C: stopped as by SIGTERM, then its one line
        serve.shutdown()
        _disconnect()
    return 0


def _disconnect() -> None:
    """Leave Ray (a cluster this process started stops with it) before a failure is
    printed: the driver's thread that prints the replicas' forwarded logs is joined,
    so none of their lines comes after the error line."""
    import ray

    try:
        ray.shutdown()
    except Exception:       # the error line matters more than a clean disconnect
        pass


def _why_not_started(exc: Exception) -> str:
    """The failed deployment's own error (a replica's constructor: its last line)."""
    from ray import serve

    try:
        app = serve.status().applications[APP]
        for name, d in app.deployments.items():
            if str(d.status).endswith("UNHEALTHY") or "DEPLOY_FAILED" in str(d.status):
                return f"deployment {name!r}: {_last_line(d.message)}"
    except Exception:  # the status itself is gone: the exception says what it can
        pass
    return _last_line(exc)


def _last_line(exc) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


# ---------------------------------------------------------------------- framekv cluster
def add_parser(subparsers) -> argparse.ArgumentParser:
    """``framekv cluster replicas|drain|undrain``."""
    from ..conventions import one_line_errors

    p = one_line_errors(subparsers.add_parser(
        "cluster", help="a serving cluster's replicas: list them, drain one, undo a drain"))
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (("replicas", "list the replicas: sessions, slots, draining"),
                       ("drain", "move every session off a replica; it takes no new one"),
                       ("undrain", "a drained replica takes new sessions again")):
        a = one_line_errors(sub.add_parser(name, help=text))
        if name != "replicas":
            a.add_argument("replica", help="the replica's id (framekv cluster replicas)")
        a.add_argument("--url", default="http://127.0.0.1:8000",
                       help="the cluster's ingress (default http://127.0.0.1:8000)")
        a.set_defaults(func=run_admin)
    return p


def run_admin(args) -> int:
    """One call to the ingress; its JSON answer printed; 1 for an error it answered."""
    import httpx

    token = os.environ.get("FRAMEKV_ADMIN_TOKEN") or os.environ.get("FRAMEKV_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    path = ("/v1/cluster/replicas" if args.action == "replicas"
            else f"/v1/cluster/replicas/{quote(args.replica, safe='')}/{args.action}")
    try:
        r = httpx.request("GET" if args.action == "replicas" else "POST", args.url + path,
                          headers=headers, timeout=600)
    except httpx.HTTPError as exc:
        print(f"framekv cluster: error: {args.url}: {exc}", file=sys.stderr)
        return 2
    if r.status_code >= 400:
        print(f"framekv cluster: error: {r.status_code}: {r.json().get('error', r.text)}",
              file=sys.stderr)
        return 1
    print(json.dumps(r.json(), indent=2))
    return 0
