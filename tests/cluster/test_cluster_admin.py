"""The cluster's admin routes as careful as the rest, over the replicas of
tests/cluster/test_cluster_sessions.py (real schedulers in this process, no Ray cluster).

A move's body is read as ``POST /v1/sessions``' is: a body that is no JSON object is
the same 400 naming the JSON fault, one over 1 MiB a 413 before it is read, and no
error echoes more than a short prefix of a value. A drain is undone (``undrain``, the
route and ``framekv cluster undrain``); while every replica drains /health says
"degraded" with the reason and /v1/info which replicas take sessions. With an admin
token the move, drain, undrain and replica routes need it and the session token does
not pass them; the flag is refused without a cluster, or equal to the session token.
A dead replica's session whose file cannot be read is renamed ``.corrupt`` and ends
failed saying so (the ingress's follower goes on).
"""
from __future__ import annotations

import contextlib
import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from framekv.tools.cli import build_parser, main  # noqa: E402
from framekv.tools.cluster import command as cluster_command  # noqa: E402
from state_file_harness import pack  # noqa: E402
from test_cluster_sessions import cluster, read  # noqa: E402,F401  (the fixture)

SESSION, ADMIN = "session-token", "admin-token"


def app_of(cs, **settings):
    from fastapi.testclient import TestClient

    from framekv.tools.cluster.ingress import cluster_app

    return TestClient(cluster_app(cs, {"output": "latents", "model": "reference:tiny",
                                       **settings}))


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_a_move_body_that_is_no_json_object_is_the_400_of_a_new_session(cluster):
    cs, _ = cluster
    with app_of(cs) as http:
        sid = http.post("/v1/sessions", json={"seed": 1}).json()["id"]
        for body in (b"[1", b"[1,2]", b"null", b'"x"', b"{", b"1e999x"):
            moved = http.post(f"/v1/sessions/{sid}/move", content=body)
            created = http.post("/v1/sessions", content=body)
            assert moved.status_code == created.status_code == 400, (body, moved.text)
            assert moved.json() == created.json(), body
            assert moved.json()["error"].startswith(
                ("the body is not JSON", "the body must be a JSON object, got a")), body


def test_a_move_body_is_capped_and_no_error_echoes_a_long_value(cluster):
    cs, _ = cluster
    with app_of(cs) as http:
        sid = http.post("/v1/sessions", json={"seed": 1}).json()["id"]
        big = http.post(f"/v1/sessions/{sid}/move", json={"to": "x" * (20 << 20)})
        assert big.status_code == 413 and len(big.content) < 300, big.text[:300]
        long = http.post(f"/v1/sessions/{sid}/move", json={"to": "y" * 5000})
        assert long.status_code == 422 and len(long.content) < 500, long.text[:600]
        assert "(5000 characters)" in long.json()["error"]
        assert http.post(f"/v1/sessions/{sid}/move").status_code == 200   # no body: {}
        drained = http.post(f"/v1/cluster/replicas/{'z' * 5000}/drain")
        assert drained.status_code == 404 and len(drained.content) < 300


def test_a_drain_is_undone_and_health_says_degraded_while_every_replica_drains(cluster):
    cs, reps = cluster
    with app_of(cs) as http:
        assert http.get("/health").json()["status"] == "ok"
        for rid in reps:
            assert http.post(f"/v1/cluster/replicas/{rid}/drain").status_code == 200
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "no replica takes new sessions: 2 draining (" in health.json()["reason"]
        refused = http.post("/v1/sessions", json={"seed": 2})
        assert refused.status_code == 503 and "undrain" in refused.json()["error"]
        info = http.get("/v1/info").json()["replicas"]
        assert [r["takes_sessions"] for r in info] == [False, False]
        assert all("pid" not in r for r in info)
        rid = sorted(reps)[0]
        r = http.post(f"/v1/cluster/replicas/{rid}/undrain")
        assert r.status_code == 200 and r.json() == {"replica": rid, "draining": False}
        assert http.get("/health").json()["status"] == "ok"
        assert http.post("/v1/sessions", json={"seed": 3}).status_code == 201
        listed = {r["id"]: r for r in http.get("/v1/cluster/replicas").json()}
        assert listed[rid]["takes_sessions"] and not listed[rid]["draining"]
        assert http.post("/v1/cluster/replicas/nosuch/undrain").status_code == 404


def test_with_an_admin_token_the_session_token_does_not_pass_the_admin_routes(cluster):
    cs, reps = cluster
    rid = sorted(reps)[0]
    with app_of(cs, token=SESSION, admin_token=ADMIN) as http:
        sid = http.post("/v1/sessions", json={"seed": 1}, headers=bearer(SESSION)).json()["id"]
        admin = [("POST", f"/v1/sessions/{sid}/move"), ("GET", "/v1/cluster/replicas"),
                 ("POST", f"/v1/cluster/replicas/{rid}/drain"),
                 ("POST", f"/v1/cluster/replicas/{rid}/undrain")]
        for method, path in admin:
            for who in ({}, bearer(SESSION)):
                r = http.request(method, path, headers=who)
                assert r.status_code == 401, (method, path, who, r.text)
        for method, path in admin:
            r = http.request(method, path, headers=bearer(ADMIN))
            assert r.status_code == 200, (method, path, r.text)
        assert http.get(f"/v1/sessions/{sid}", headers=bearer(ADMIN)).status_code == 401
        assert http.get(f"/v1/sessions/{sid}", headers=bearer(SESSION)).status_code == 200
        paths = http.get("/openapi.json", headers=bearer(SESSION)).json()["paths"]
        assert "/v1/cluster/replicas/{rid}/undrain" in paths


def test_framekv_cluster_undrain_calls_its_route_with_the_admin_token(monkeypatch, capsys):
    import httpx

    calls = []

    def request(method, url, headers, timeout):
        calls.append((method, url, headers))
        return httpx.Response(200, json={"replica": "r/1", "draining": False})
    monkeypatch.setattr(httpx, "request", request)
    monkeypatch.setenv("FRAMEKV_TOKEN", SESSION)
    monkeypatch.setenv("FRAMEKV_ADMIN_TOKEN", ADMIN)
    assert main(["cluster", "undrain", "r/1", "--url", "http://h:1"]) == 0
    assert calls == [("POST", "http://h:1/v1/cluster/replicas/r%2F1/undrain", bearer(ADMIN))]
    assert json.loads(capsys.readouterr().out)["draining"] is False


def test_the_admin_token_is_refused_without_a_cluster_or_equal_to_the_session_token(
        monkeypatch, capsys, tmp_path):
    monkeypatch.delenv("FRAMEKV_TOKEN", raising=False)
    monkeypatch.delenv("FRAMEKV_ADMIN_TOKEN", raising=False)
    assert main(["serve", "--device", "cpu", "--admin-token", ADMIN]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--admin-token" in err and "--replicas" in err, err
    monkeypatch.setenv("FRAMEKV_TOKEN", SESSION)
    monkeypatch.setenv("FRAMEKV_ADMIN_TOKEN", SESSION)
    args = build_parser().parse_args(["serve", "--device", "cpu", "--replicas", "2",
                                      "--state-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="must differ from the session token"):
        cluster_command._cluster_args(args, contextlib.ExitStack())


def test_a_dead_replicas_session_whose_file_is_corrupt_ends_failed_saying_so(cluster, tmp_path):
    cs, reps = cluster
    sid = cs.open_session(seed=8, chunks=4).id
    read(cs, sid, 1, cs.rewind(sid), [])
    victim = reps.pop(cs.where[sid])
    victim.stop.set()
    victim.loop.join()
    victim.sched.checkpoints.flush()                 # its last checkpoint, spoilt
    (tmp_path / f"{sid}.session").write_bytes(pack(b'"x"'))
    cs.refresh()
    info = cs.session_info(sid)
    assert sid not in cs.where and info["state"] == "failed", info
    assert "the header is a JSON string, not an object" in info["error"], info["error"]
    assert (tmp_path / f"{sid}.session.corrupt").exists()
    victim.sched.close()
