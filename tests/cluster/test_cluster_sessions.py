"""The cluster's ingress logic (`ClusterSessions`, `cluster_app`) over real replicas
(`Replica`: a tiny scheduler each, built from ``framekv serve``'s flags) in this
process, behind a stand-in for Ray Serve's handle that sends each call to the replica
its ``multiplexed_model_id`` names (as `ReplicaRouter` does) and fails a call to one
that is gone. Placement, moves, drains, adoption after a replica's death, held
acknowledgements, the move route's errors, the long poll across a move and a cluster
with no replica: every chunk index once, each chunk equal to its seed run alone; a
session whose every chunk is acknowledged ends. The same over Ray: test_cluster.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading

import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("fastapi")

from framekv.engine.serving import SchedulerFull, StreamScheduler  # noqa: E402
from ray.serve import context as serve_context  # noqa: E402
from framekv.tools.cli import build_parser  # noqa: E402
from framekv.tools.cluster import moves as cluster_moves  # noqa: E402
from framekv.tools.cluster.autoscale import SESSIONS, sessions_policy  # noqa: E402
from framekv.tools.cluster.replica import Replica  # noqa: E402
from framekv.tools.cluster.moves import MoveConflict  # noqa: E402
from framekv.tools.cluster.sessions import ClusterSessions  # noqa: E402
from test_scheduler import alone_chunks  # noqa: E402


class _Response:
    """A call made at once; its result (or exception) kept for `result`."""

    def __init__(self, fn):
        try:
            self.value, self.error = fn(), None
        except BaseException as exc:  # what the replica raised, raised by result()
            self.value, self.error = None, exc

    def result(self, timeout_s=None):
        if self.error is not None:
            raise self.error
        return self.value


class FakeHandle:
    """Ray Serve's handle over ``replicas`` (id -> `Replica`) of this process;
    ``parents``: the internal request id each call was sent under, as Ray Serve reads
    it for the call's metadata."""

    def __init__(self, replicas: dict, target: str = "", parents=None):
        self.replicas, self.target = replicas, target
        self.parents = [] if parents is None else parents

    def running_replicas_populated(self):
        return True

    def options(self, multiplexed_model_id=""):
        return FakeHandle(self.replicas, multiplexed_model_id, self.parents)

    def __getattr__(self, method):
        handle = self

        class _Method:
            def remote(self, *args, **kw):
                handle.parents.append(serve_context._get_serve_request_context()
                                      ._internal_request_id)
                args = [a.result() if isinstance(a, _Response) else a for a in args]
                return _Response(lambda: handle._run(method, args, kw))
        return _Method()

    def _run(self, method, args, kw):
        rep = (self.replicas.get(self.target) if self.target
               else next(iter(self.replicas.values()), None))
        if rep is None:
            raise ConnectionError(f"replica {self.target} is gone")
        out = getattr(rep, method)(*args, **kw)
        return asyncio.run(out) if inspect.iscoroutine(out) else out


def replica(state_dir=None, sessions=4, checkpoint=True) -> Replica:
    argv = ["serve", "--device", "cpu", "--output", "latents", "--max-sessions",
            str(sessions), "--slots", "2", "--queue-chunks", "3"]
    if state_dir is not None:
        argv += ["--state-dir", str(state_dir)]
        if checkpoint:
            argv += ["--checkpoint-every", "1"]
    return Replica(build_parser().parse_args(argv))


@contextlib.contextmanager
def over_replicas(monkeypatch, state_dir, checkpoint=True, make=None):
    """(sessions, the fake handle's replicas) over two replicas sharing ``state_dir``
    (None: no state folder), or two of ``make()``, the replicas closed after."""
    reps = {}
    for _ in range(2):
        r = replica(state_dir, checkpoint=checkpoint) if make is None else make()
        reps[r.id] = r
    monkeypatch.setattr(cluster_moves, "live_replicas", lambda: {k: {} for k in reps})
    handle = FakeHandle(reps)
    cs = ClusterSessions(handle, handle.options("").describe.remote().result(), grace=0.0)
    cs.refresh()
    try:
        yield cs, reps
    finally:
        for r in reps.values():
            r.close()


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    with over_replicas(monkeypatch, tmp_path) as out:
        yield out


@pytest.fixture(scope="module")
def reference():
    sched = StreamScheduler("tiny", max_sessions=1, device="cpu", use_graphs=False)
    yield sched
    sched.close()


def read(cs, sid, n, reader, got):
    """The next ``n`` chunks of ``sid`` through ``cs`` (acknowledged as a client does)."""
    while n:
        c = cs.next_chunk(sid, 0.05, reader=reader)
        if c is None:
            continue
        got.append(c)
        cs.ack(sid, c.index)
        n -= 1
    return got


def assert_alone(reference, seed, chunks):
    assert [c.index for c in chunks] == list(range(len(chunks)))
    want = alone_chunks(reference, seed, len(chunks))
    for c, w in zip(chunks, want):
        assert torch.equal(c.latents, w), (seed, c.index)


def test_sessions_spread_and_a_move_keeps_every_index_once(cluster, reference):
    cs, reps = cluster
    sids = [cs.open_session(seed=70 + i, chunks=8).id for i in range(4)]
    assert sorted(r["sessions"] for r in cs.replica_info()) == [2, 2]   # most free first
    assert cs.max_sessions == 8 and len(cs.sessions) == 4
    sid = sids[0]
    reader, got = cs.rewind(sid), []
    read(cs, sid, 3, reader, got)
    src = cs.where[sid]
    report = cs.move(sid)
    assert report["from"] == src and report["to"] != src and cs.where[sid] == report["to"]
    assert report["bytes"] > 0 and min(report[k] for k in ("export_s", "import_s")) >= 0
    assert sid not in reps[src].sched.sessions and sid in reps[report["to"]].sched.sessions
    read(cs, sid, 5, reader, got)
    assert_alone(reference, 70, got)
    assert cs.session_info(sid)["state"] == "done"
    end = cs.handout(sid, 5.0, reader=reader)      # every chunk acknowledged: it ends
    assert end.end == {"type": "end", "state": "done", "error": None} and not end.gone
    assert sid not in cs.sessions and cs.session_info(sid)["end_reason"] == "done"


def test_a_move_is_refused_for_an_unknown_session_replica_or_one_moving(cluster):
    cs, reps = cluster
    sid = cs.open_session(seed=80).id
    with pytest.raises(KeyError):
        cs.move("nosuch")
    with pytest.raises(ValueError, match="to must be one of the replicas"):
        cs.move(sid, to="nosuch")
    with pytest.raises(ValueError, match="another replica than the session's own"):
        cs.move(sid, to=cs.where[sid])
    cs.moving.add(sid)
    with pytest.raises(MoveConflict, match="being moved already"):
        cs.move(sid)
    cs.moving.discard(sid)
    cs.move(sid)


def test_a_drain_moves_every_session_off_and_places_none_there(cluster, reference):
    cs, reps = cluster
    sids = [cs.open_session(seed=90 + i, chunks=6).id for i in range(3)]
    readers = {sid: cs.rewind(sid) for sid in sids}
    got = {sid: read(cs, sid, 2, readers[sid], []) for sid in sids}
    rid = max(reps, key=lambda r: sum(v == r for v in cs.where.values()))
    here = [sid for sid in sids if cs.where[sid] == rid]
    out = cs.drain(rid)
    assert sorted(m["id"] for m in out["moved"]) == sorted(here) and not out["left"]
    assert all(cs.where[sid] != rid for sid in sids) and not reps[rid].sched.sessions
    assert cs.where[cs.open_session(seed=99).id] != rid             # draining: none there
    for i, sid in enumerate(sids):
        assert_alone(reference, 90 + i, read(cs, sid, 4, readers[sid], got[sid]))
    with pytest.raises(KeyError):
        cs.drain("nosuch")


def test_a_dead_replicas_sessions_go_on_from_their_checkpoints(cluster, reference):
    """Chunks made after the last checkpoint are lost with the replica and made again
    elsewhere; the reader skips those it handed out, so its client sees each once."""
    cs, reps = cluster
    sids = [cs.open_session(seed=60 + i, chunks=7).id for i in range(2)]
    readers = {sid: cs.rewind(sid) for sid in sids}
    got = {sid: read(cs, sid, 3, readers[sid], []) for sid in sids}
    dead = cs.where[sids[0]]
    victim = reps.pop(dead)                 # killed: no save, its loop just stops
    victim.stop.set()
    victim.loop.join()
    held = got[sids[0]][-1].index
    cs.ack(sids[0], held)                   # to a dead replica: held for the adopter
    cs.refresh()                            # it left: its sessions adopted
    assert dead not in cs.replicas and all(cs.where[s] in reps for s in sids)
    for i, sid in enumerate(sids):
        assert_alone(reference, 60 + i, read(cs, sid, 4, readers[sid], got[sid]))
    victim.sched.close()


def test_a_draining_replica_adopts_when_no_other_can(cluster, reference):
    """The replica holding every session dies while the only other one drains: the
    drained one takes the orphans rather than leave them waiting for a new replica,
    and takes no new session still."""
    cs, reps = cluster
    sids = [cs.open_session(seed=40 + i, chunks=6).id for i in range(2)]
    readers = {sid: cs.rewind(sid) for sid in sids}
    got = {sid: read(cs, sid, 2, readers[sid], []) for sid in sids}
    drained = next(iter(reps))
    cs.drain(drained)
    holder = cs.where[sids[0]]
    assert holder != drained and all(cs.where[s] == holder for s in sids)
    victim = reps.pop(holder)
    victim.stop.set()
    victim.loop.join()
    cs.refresh()
    assert all(cs.where[s] == drained for s in sids) and drained in cs.draining
    for i, sid in enumerate(sids):
        assert_alone(reference, 40 + i, read(cs, sid, 4, readers[sid], got[sid]))
    with pytest.raises(SchedulerFull, match="no replica takes new sessions: 1 draining"):
        cs.open_session(seed=1)
    victim.sched.close()


def test_a_moved_session_survives_its_new_replica_dying_at_once(cluster, reference,
                                                                monkeypatch):
    """The move returns once the target wrote the session's file (the source dropped
    its own): a target killed right after, its writes slow, loses nothing."""
    import time

    cs, reps = cluster
    sid = cs.open_session(seed=33, chunks=6).id
    reader, got = cs.rewind(sid), []
    read(cs, sid, 2, reader, got)
    src = cs.where[sid]
    dst = next(r for r in reps if r != src)
    writer = reps[dst].sched.checkpoints
    real = writer._write
    monkeypatch.setattr(writer, "_write", lambda *a: (time.sleep(0.5), real(*a)))
    cs.move(sid, to=dst)
    victim = reps.pop(dst)
    victim.stop.set()
    victim.loop.join()
    cs.refresh()
    assert cs.where[sid] == src
    assert_alone(reference, 33, read(cs, sid, 4, reader, got))
    victim.sched.close()


def test_a_dead_replicas_session_without_a_checkpoint_ends_failed(monkeypatch):
    with over_replicas(monkeypatch, None) as (cs, reps):
        sid = cs.open_session(seed=3, chunks=4).id
        victim = reps.pop(cs.where[sid])
        cs.refresh()
        info = cs.session_info(sid)
        assert sid not in cs.sessions and info["state"] == "failed"
        assert "no checkpoint of it was kept" in info["error"]
        assert cs.next_chunk(sid, 0.0) is None and sid not in cs.sessions
        assert cs.handout(sid, 0.0).end["state"] == "failed"
        victim.close()


def test_a_replica_that_stops_hands_its_sessions_on(tmp_path, monkeypatch, reference):
    """A scale-down: the replica Ray Serve stops writes its sessions as it goes (its
    destructor, `Replica.save`), no checkpoints kept, and the others adopt them."""
    with over_replicas(monkeypatch, tmp_path, checkpoint=False) as (cs, reps):
        sid = cs.open_session(seed=55, chunks=6).id
        reader, got = cs.rewind(sid), []
        read(cs, sid, 2, reader, got)
        leaving = reps.pop(cs.where[sid])
        leaving.__del__()                       # what Ray Serve's stop runs
        assert leaving.stop.is_set()
        cs.refresh()
        assert cs.where[sid] in reps
        assert_alone(reference, 55, read(cs, sid, 4, reader, got))


def test_placement_is_refused_when_every_replica_is_full_or_gone(cluster):
    cs, reps = cluster
    for i in range(8):
        cs.open_session(seed=i)
    with pytest.raises(SchedulerFull, match="are open"):
        cs.open_session(seed=7)
    cs.replicas.clear()
    with pytest.raises(SchedulerFull, match="no replica is up"):
        cs.open_session(seed=8)
    assert cs.loop_error == "no replica is up"


def test_calls_made_while_serving_a_request_leave_its_context(cluster):
    """A socket's calls run in its request's context (asyncio.to_thread copies it);
    Ray Serve's router keys pending calls by the context's internal request id, so
    calls sent under it wait on each other's entry (after a call to a dead replica,
    forever). Every call goes out under none."""
    cs, reps = cluster
    sid = cs.open_session(seed=6, chunks=3).id
    parent = serve_context._RequestContext(request_id="ws", _internal_request_id="ws-1")
    token = serve_context._serve_request_context.set(parent)
    try:
        reader = cs.rewind(sid)
        read(cs, sid, 1, reader, [])
        cs.handout(sid, 0.0, reader=reader)
        cs.move(sid)
    finally:
        serve_context._serve_request_context.reset(token)
    handle = cs.handle
    assert len(handle.parents) > 5 and "ws-1" not in handle.parents, handle.parents


def test_the_autoscaling_policy_keeps_room_for_one_more_session():
    """floor(sessions / target) + 1 replicas over what the replicas reported; the
    replicas it has while none reported."""
    from types import SimpleNamespace

    def ctx(reported, target=2, now=3):
        return SimpleNamespace(aggregated_metrics=reported, target_num_replicas=now,
                               config=SimpleNamespace(target_ongoing_requests=target))

    assert sessions_policy(ctx(None)) == (3, {}) and sessions_policy(ctx({})) == (3, {})
    for sessions, want in (([0.0, 0.0], 1), ([1.0, 0.0], 1), ([1.0, 1.0], 2),
                           ([2.0, 1.0], 2), ([2.0, 2.0], 3)):
        reported = {SESSIONS: {f"r{i}": n for i, n in enumerate(sessions)}}
        assert sessions_policy(ctx(reported)) == (want, {}), sessions


def test_a_prompt_change_settles_through_its_replica(cluster):
    cs, reps = cluster
    sid = cs.open_session(seed=5, chunks=4).id
    P, D = cs.prompt_shape
    change = cs.set_prompt(sid, torch.randn(P, D))
    done = threading.Event()
    change.future.add_done_callback(lambda f: done.set())
    reader = cs.rewind(sid)
    read(cs, sid, 2, reader, [])
    assert done.wait(30) and change.future.result() is change and change.version == 1
    with pytest.raises(ValueError):
        cs.set_prompt(sid, torch.randn(P + 1, D))


def test_the_routes_answer_moves_replicas_metrics_and_no_replica(cluster, reference):
    from fastapi.testclient import TestClient

    from framekv.tools.cluster.ingress import cluster_app

    cs, reps = cluster
    app = cluster_app(cs, {"output": "latents", "model": "reference:tiny"})
    with TestClient(app) as http:
        long_poll_across_a_move(http, cs, reference)
        sid = http.post("/v1/sessions", json={"seed": 4}).json()["id"]
        info = http.get("/v1/info").json()
        assert sorted(r["id"] for r in info["replicas"]) == sorted(reps)
        assert info["max_sessions"] == 8
        r = http.post(f"/v1/sessions/{sid}/move", json={})
        assert r.status_code == 200 and r.json()["from"] != r.json()["to"], r.text
        assert http.post("/v1/sessions/nosuch/move").status_code == 404
        r = http.post(f"/v1/sessions/{sid}/move", json={"to": "nosuch"})
        assert r.status_code == 422 and "to must be one of the replicas" in r.json()["error"]
        assert http.post(f"/v1/sessions/{sid}/move", json={"to": 3}).status_code == 422
        cs.moving.add(sid)
        assert http.post(f"/v1/sessions/{sid}/move").status_code == 409
        cs.moving.discard(sid)
        assert len(http.get("/v1/cluster/replicas").json()) == 2
        assert http.post("/v1/cluster/replicas/nosuch/drain").status_code == 404
        metrics = http.get("/metrics").text
        for rid in reps:
            assert f'framekv_sessions{{replica="{rid}"}}' in metrics
        cs.replicas.clear()                  # every replica gone: the ingress answers
        r = http.post("/v1/sessions", json={"seed": 5})
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        health = http.get("/health")
        assert health.status_code == 503 and "no replica is up" in health.json()["error"]


def long_poll_across_a_move(http, cs, reference) -> None:
    """``GET .../chunks`` through the ingress (``http``): each index once across a move,
    equal to the seed run alone, then the end message and a 404; an after beyond the
    chunks made is the 422 of one server."""
    from framekv.client.wire import decode_chunk

    sid = http.post("/v1/sessions", json={"seed": 72, "chunks": 5}).json()["id"]
    r = http.get(f"/v1/sessions/{sid}/chunks", params={"after": 7})
    assert r.status_code == 422 and "after must be -1 or the index of a chunk made" in r.text
    got, params = [], {"wait": 10}
    while (r := http.get(f"/v1/sessions/{sid}/chunks", params=params)).headers[
            "content-type"] == "application/octet-stream":
        got.append(decode_chunk(r.content))
        params["after"] = got[-1].index
        if len(got) == 2:
            assert http.post(f"/v1/sessions/{sid}/move", json={}).status_code == 200
    assert r.json() == {"type": "end", "state": "done", "error": None}
    assert sid not in cs.sessions and cs.session_info(sid)["end_reason"] == "done"
    assert http.get(f"/v1/sessions/{sid}/chunks", params=params).status_code == 404
    assert_alone(reference, 72, got)
