"""The long-poll transport of `framekv serve` on the CPU: a real server on 127.0.0.1, raw
HTTP and WebSocket clients.

``GET /v1/sessions/{id}/chunks?after=I&wait=S`` answers the next chunk after I, byte for
byte the socket's binary message (the same seed's chunks equal the socket's), each
index once, the same chunk again for a request whose answer was lost; 204 when none
came; the socket's end message once every chunk is acknowledged, then 404. It is
refused as the socket is: an I beyond the chunks made with the socket's 4422 message,
bad values 422, an unknown session 404, no token 401, a foreign page 403, a session
with a socket 409, and a request a later one took 409. ``POST .../control`` takes the
socket's control messages. A polled session is not idle; a drain answers a waiting
poll with the end (reason "shutdown").
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
ws_client = pytest.importorskip("websockets.sync.client")
from websockets.exceptions import ConnectionClosed  # noqa: E402

from framekv.engine.serving import StreamScheduler  # noqa: E402
from framekv.specs import wire  # noqa: E402
from framekv.tools.serve.wire import chunk_frame  # noqa: E402
from serve_harness import ack, create, index_of, served_http, serving  # noqa: E402
from test_scheduler import alone_chunks  # noqa: E402

TOKEN = "poll-token"
END = {"type": "end", "state": "done", "error": None}
FOREIGN = {"Origin": "http://elsewhere.example"}


@pytest.fixture(scope="module")
def server():
    sched = StreamScheduler("tiny", max_sessions=3, device="cpu", use_graphs=False,
                            queue_chunks=2)
    with served_http(sched, TOKEN, head_timeout=30.0, output="latents") as served:
        yield served


def poll(http, sid, after=None, wait=10.0, **kw):
    """``GET /v1/sessions/{sid}/chunks``."""
    params = {"wait": wait, **({} if after is None else {"after": after})}
    return http.get(f"/v1/sessions/{sid}/chunks", params=params, **kw)


def control(http, sid, body, **kw):
    """``POST /v1/sessions/{sid}/control``."""
    return http.post(f"/v1/sessions/{sid}/control", json=body, **kw)


def ws_url(port, sid, after=None) -> str:
    tail = "" if after is None else f"&after={after}"
    return f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream?token={TOKEN}{tail}"


def poll_all(http, sid, after=None) -> tuple[list[bytes], dict]:
    """(each chunk message, the end message) of ``sid`` by long poll, each chunk
    acknowledged by the next request's ``after``."""
    got = []
    while True:
        r = poll(http, sid, after)
        assert r.status_code in (200, 204), r.text
        assert r.headers["cache-control"] == "no-store"
        if r.status_code == 204:
            continue
        if r.headers["content-type"] == "application/json":
            return got, r.json()
        assert r.headers["content-type"] == "application/octet-stream"
        got.append(r.content)
        after = index_of(r.content)


def socket_all(port, sid) -> tuple[list[bytes], dict]:
    """(each chunk message, the end message) of ``sid`` by its socket, acknowledged."""
    import json

    got = []
    with ws_client.connect(ws_url(port, sid), max_size=None) as ws:
        while isinstance(msg := ws.recv(timeout=60), bytes):
            got.append(msg)
            ack(ws, msg)
    return got, json.loads(msg)


def same_message(a: bytes, b: bytes) -> bool:
    """Two chunk messages alike but for the step's clock and batch size."""
    (ha, pa), (hb, pb) = wire.decode(a), wire.decode(b)
    clock = ("seconds", "batch")
    return pa == pb and {k: v for k, v in ha.items() if k not in clock} == {
        k: v for k, v in hb.items() if k not in clock}


def test_a_long_poll_hands_out_the_sockets_messages_each_index_once(server):
    http, port, sched = server
    polled, socketed = create(http, seed=21, chunks=4), create(http, seed=21, chunks=4)
    first = poll(http, polled)                                      # no after: the oldest
    assert first.status_code == 200 and index_of(first.content) == 0
    queued = sched.sessions[polled].delivery.queue[0]               # not acknowledged yet
    assert first.content == chunk_frame(queued)                     # the socket's encoding
    assert poll(http, polled, after=-1).content == first.content    # an answer lost: again
    got, end = poll_all(http, polled, after=-1)
    want, want_end = socket_all(port, socketed)
    assert [index_of(m) for m in got] == [index_of(m) for m in want] == [0, 1, 2, 3]
    assert all(same_message(a, b) for a, b in zip(got, want))
    assert end == want_end == END
    r = poll(http, polled, after=3)
    assert r.status_code == 404 and r.json()["error"].endswith("it ended (done)")


def test_a_long_poll_is_refused_as_the_socket_is(server, monkeypatch):
    import framekv.tools.serve.routes as routes

    http, port, sched = server
    sid = create(http, seed=5, paused=True)
    r = poll(http, sid, after=0)
    with ws_client.connect(ws_url(port, sid, after=0)) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert r.status_code == 422 and closed.value.rcvd.code == 4422
    assert r.json()["error"] == closed.value.rcvd.reason == (
        "after must be -1 or the index of a chunk made: no chunk is made yet, got 0")
    assert poll(http, sid, wait=0.1).status_code == 204                 # paused: none came
    for params, words in (({"wait": 61}, "query wait must be <= 60"),
                          ({"wait": "nan"}, "query wait must be"),
                          ({"after": "x"}, "query after must be an integer, got 'x'")):
        r = http.get(f"/v1/sessions/{sid}/chunks", params=params)
        assert r.status_code == 422 and r.json()["error"].startswith(words), r.text
    r = poll(http, "nosuch")
    assert r.status_code == 404 and r.json() == {"error": "no such session open: 'nosuch'"}
    r = httpx.get(f"http://127.0.0.1:{port}/v1/sessions/{sid}/chunks")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    r = poll(http, sid, headers=FOREIGN)
    assert r.status_code == 403 and "'http://elsewhere.example' is not allowed" in r.text
    monkeypatch.setattr(routes, "TAKEN_WAIT_S", 0.2)
    with ws_client.connect(ws_url(port, sid), max_size=None):
        r = poll(http, sid, wait=0.1)
    assert r.status_code == 409 and "already has a stream" in r.json()["error"]
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(poll(http, sid, wait=20)))
    readers = sched.sessions[sid].delivery.reader
    waiting.start()
    while sched.sessions[sid].delivery.reader == readers:          # it waits: its rewind
        time.sleep(0.02)
    assert poll(http, sid, wait=0.1).status_code == 204                 # takes the session
    waiting.join(timeout=30)
    assert answers[0].status_code == 409 and "a later request" in answers[0].json()["error"]
    assert http.delete(f"/v1/sessions/{sid}").status_code == 204


def test_control_messages_go_by_post(server):
    http, port, sched = server
    L, D = sched.prompt_shape
    sid = create(http, seed=8, chunks=3, paused=True)
    r = control(http, sid, {"type": "prompt", "prompt_seed": 2})
    assert r.status_code == 200 and r.json() == {"type": "prompt_ack", "prompt_version": 1,
                                                 "applies_from": 0}
    assert control(http, sid, {"type": "resume"}).status_code == 204
    first = poll(http, sid, after=-1)
    assert control(http, sid, {"type": "ack", "index": index_of(first.content)}).status_code == 204
    assert sched.session_info(sid)["delivered"] == 1
    got, end = poll_all(http, sid)                                   # the oldest not acked
    assert [index_of(m) for m in got] == [1, 2] and end == END
    seeded = torch.randn(L, D, generator=torch.Generator().manual_seed(2))
    want = alone_chunks(sched, 8, 3, prompt=seeded)
    for m in [first.content, *got]:
        head, payload = wire.decode(m)
        lat = torch.frombuffer(bytearray(payload), dtype=torch.float32).view(head["shape"])
        assert head["prompt_version"] == 1
        assert float((lat - want[head["index"]]).abs().max()) <= 1e-5
    live = create(http, seed=9, paused=True)
    for body, status, words in (({"type": "nah"}, 422, "type must be ack, prompt, pause or "
                                                       "resume, got 'nah'"),
                                ({"type": "pause", "x": 1}, 422, "a pause message takes"),
                                ({"type": "ack", "index": "1"}, 422, "an ack message's index")):
        r = control(http, live, body)
        assert r.status_code == status and r.json()["error"].startswith(words), r.text
    r = http.post(f"/v1/sessions/{live}/control", content=b"[1")
    assert r.status_code == 400 and r.json()["error"].startswith("the body is not JSON")
    assert control(http, live, {"type": "resume"}, headers=FOREIGN).status_code == 403
    assert control(http, "nosuch", {"type": "resume"}).status_code == 404
    assert http.delete(f"/v1/sessions/{live}").status_code == 204


def test_a_polled_session_is_not_idle_and_a_drain_ends_a_waiting_poll():
    sched = StreamScheduler("tiny", max_sessions=2, device="cpu", use_graphs=False)
    with serving(sched, idle_timeout=1.0, output="latents") as (srv, port):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            idle, polled = create(http, seed=1, paused=True), create(http, seed=2, paused=True)
            assert poll(http, polled, wait=2.0).status_code == 204       # past the timeout
            assert http.get(f"/v1/sessions/{polled}").json()["end_reason"] is None
            deadline = time.monotonic() + 10
            while http.get(f"/v1/sessions/{idle}").json()["end_reason"] != "idle":
                assert time.monotonic() < deadline, "the unpolled session was not ended"
                time.sleep(0.05)
            answers = []
            waiting = threading.Thread(target=lambda: answers.append(poll(http, polled)))
            readers = sched.sessions[polled].delivery.reader
            waiting.start()
            while sched.sessions[polled].delivery.reader == readers:    # it waits
                time.sleep(0.02)
            srv.should_exit = True                                       # what SIGTERM sets
            waiting.join(timeout=30)
    assert answers[0].status_code == 200 and answers[0].json() == {
        "type": "end", "state": "closed", "error": None, "reason": "shutdown"}

