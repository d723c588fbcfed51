"""Autoscaling of the replica deployment on the sessions it holds, through Ray Serve's
custom autoscaling policies: each replica reports its open sessions
(`Replica.record_autoscaling_stats`), and `sessions_policy` asks for the replicas that
hold them at ``--target-sessions`` a replica with room for one more:
``floor(sessions / target) + 1``, between ``--min-replicas`` and ``--max-replicas``
(Ray Serve applies the bounds and the delays).

Why not Ray Serve's default (ongoing requests per replica): a session's calls are
short polls, so how many are in flight follows the ingress's threads, not the
sessions; and a full replica refuses a session outright rather than queue it, so the
queue that policy watches never grows.
"""
from __future__ import annotations

import math

#: the metric each replica reports (`Replica.record_autoscaling_stats`)
SESSIONS = "sessions"


def autoscaling_config(lo: int, hi: int, target: int) -> dict:
    """Ray Serve's ``autoscaling_config`` between ``lo`` and ``hi`` replicas, ``target``
    sessions a replica (carried as its ``target_ongoing_requests``, which
    `sessions_policy` reads)."""
    return {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
            "target_ongoing_requests": target,
            # the peak over a few seconds, reported each second: up soon, down late
            "metrics_interval_s": 1.0, "look_back_period_s": 5.0,
            "aggregation_function": "max", "upscale_delay_s": 5.0, "downscale_delay_s": 30.0,
            "policy": {"policy_function": f"{__name__}:sessions_policy"}}


def wanted(sessions: float, target: float) -> int:
    """Replicas for ``sessions`` open at ``target`` a replica, one session to spare."""
    return math.floor(sessions / target) + 1


def sessions_policy(ctx) -> tuple[int, dict]:
    """Ray Serve's policy hook: `wanted` of the sessions the replicas reported (the
    replicas it has until any report)."""
    reported = (ctx.aggregated_metrics or {}).get(SESSIONS) or {}
    if not reported:
        return ctx.target_num_replicas, {}
    return wanted(sum(reported.values()), ctx.config.target_ongoing_requests), {}
