"""`framekv serve` where a hostile run found a session computing for nobody, on the
CPU: a real server on 127.0.0.1 and real clients.

A socket's ``?after=`` beyond the chunks made is closed 4422 naming the last index
made, the session makes no chunk past its queue for nobody, and GET never reports more
delivered than made; the Python client reconnecting to a stream resumed behind it
(from an older checkpoint) reconnects at the stream's last chunk and takes each index
once.
"""
from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
ws_client = pytest.importorskip("websockets.sync.client")
from websockets.exceptions import ConnectionClosed  # noqa: E402

import framekv.client as fc  # noqa: E402
from framekv.engine.serving import StreamScheduler  # noqa: E402
from serve_harness import ack, create, served_http  # noqa: E402
from test_scheduler import alone_chunks  # noqa: E402

TOKEN = "limits-token"
QUEUE = 2


@pytest.fixture(scope="module")
def server():
    sched = StreamScheduler("tiny", max_sessions=2, device="cpu", use_graphs=False,
                            queue_chunks=QUEUE)
    with served_http(sched, TOKEN, head_timeout=30.0, output="latents") as served:
        yield served


def ws_url(port, sid, after=None) -> str:
    tail = "" if after is None else f"&after={after}"
    return f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream?token={TOKEN}{tail}"


def read(ws, n) -> list[int]:
    """The next ``n`` chunk indices of ``ws``, each acknowledged."""
    return [ack(ws, ws.recv(timeout=60)) for _ in range(n)]


def test_an_after_beyond_the_chunks_made_is_closed_4422_and_nothing_is_made_for_it(server):
    http, port, sched = server
    sid = create(http, seed=4)                                     # open-ended
    with ws_client.connect(ws_url(port, sid), max_size=None) as ws:
        assert read(ws, 2) == [0, 1]
    info = wait_for(http, sid, lambda i: i["chunks"] == 2 + QUEUE)  # its queue full
    with ws_client.connect(ws_url(port, sid, 1_000_000), max_size=None) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert closed.value.rcvd.code == 4422, closed.value.rcvd
    assert closed.value.rcvd.reason == (f"after must be -1 or the index of a chunk made: the "
                                        f"last chunk made is {info['chunks'] - 1}, got 1000000")
    time.sleep(1.0)                                                # a step or ten
    assert http.get(f"/v1/sessions/{sid}").json() == info         # nothing made, none delivered
    http.delete(f"/v1/sessions/{sid}")


def wait_for(http, sid, what, limit=60.0) -> dict:
    """GET /v1/sessions/{sid} once ``what(info)`` holds."""
    deadline = time.monotonic() + limit
    while not what(info := http.get(f"/v1/sessions/{sid}").json()):
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    return info


@pytest.mark.parametrize("transport", ["auto", "poll"])
def test_the_client_reconnects_to_a_stream_resumed_behind_it(server, transport):
    """The client has chunks 0..2; the server's stream goes back to its state after
    chunk 0 (a restart from an older checkpoint). ``client.session(id, after=2)`` goes
    on: chunks 1 and 2, made again, skipped and acknowledged; 3..5 each once, equal to
    the seed run alone. Over the socket and the long poll alike."""
    http, port, sched = server
    sid = create(http, seed=9, chunks=6)
    with ws_client.connect(ws_url(port, sid), max_size=None) as ws:
        assert read(ws, 1) == [0]
    old = sched.export_session(sid)                     # the checkpoint: one chunk made
    sched.import_session(old)
    with ws_client.connect(ws_url(port, sid, 0), max_size=None) as ws:
        assert read(ws, 2) == [1, 2]
    sched.close_session(sid, "test")                    # the crash
    sched.import_session(old)
    with fc.Client(f"http://127.0.0.1:{port}", token=TOKEN, transport=transport) as client:
        s = client.session(sid, after=2)
        got = list(s.stream(timeout=60))
    assert [c.index for c in got] == [3, 4, 5] and s.end["state"] == "done", s.end
    want = alone_chunks(sched, 9, 6)
    for c in got:
        assert torch.equal(c.latents, want[c.index]), c.index
