"""`framekv serve` under abuse and faults, on the CPU: a real server on 127.0.0.1
(`DrainingServer` with a short head deadline), raw sockets where the framing matters.

A chunked body with a lying Content-Length is refused before it is read, and the body
cap counts the bytes that arrive whatever the headers say; a failing start-over after a
failed step is logged and the loop goes on; a loop that dies turns /health and new
sessions into 503s with the reason; a second socket on a session is closed 4409 while
the first gets every chunk; tokens compare as bytes (non-ASCII: 401, at startup: a
usage error); a binary control frame is answered and the session goes on; the docs
need the token; a trickled request head is closed at its deadline; non-finite numbers
and loose prompt objects are 4xx; on shutdown (SIGTERM too) a socket gets its queued
chunks and an end message with reason "shutdown".
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
ws_client = pytest.importorskip("websockets.sync.client")
from websockets.exceptions import ConnectionClosed  # noqa: E402

from framekv.engine.serving import StreamScheduler  # noqa: E402
from framekv.specs import wire  # noqa: E402
from framekv.tools.serve import build_app  # noqa: E402
from framekv.tools.serve.wire import MAX_BODY_BYTES, RequestError, read_body  # noqa: E402
from serve_harness import (ack, create, index_of, no_sessions, raw_request, read_stream,  # noqa: E402
                           serving, trickle)
from test_scheduler import alone_chunks  # noqa: E402

TOKEN = "hard-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEAD_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server():
    # batch_sizes (2,): a lone session's step takes one scratch row
    sched = StreamScheduler("tiny", max_sessions=2, device="cpu", use_graphs=False,
                            queue_chunks=2, batch_sizes=(2,))
    with serving(sched, HEAD_TIMEOUT, token=TOKEN, body_timeout=2.0) as (_, port):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH,
                          timeout=30) as http:
            yield http, port, sched


def ws_url(port, sid, token=TOKEN) -> str:
    return f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream?token={token}"


# 2 -------------------------------------------------------------------------- body cap
def test_a_chunked_body_with_a_lying_length_is_refused_before_it_is_read(server):
    _, port, sched = server
    head = ("POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN +
            "\r\nTransfer-Encoding: chunked\r\nContent-Length: 20\r\n\r\n").encode()
    piece, pieces, sent = b"10000\r\n" + b" " * 65536 + b"\r\n", 1024, [0]   # 64 MiB offered
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)

    def upload():
        with contextlib.suppress(OSError):
            sock.sendall(head)
            for _ in range(pieces):
                sock.sendall(piece)
                sent[0] += 1
    uploader = threading.Thread(target=upload, daemon=True)
    uploader.start()
    reply, at_reply = b"", None
    try:
        while chunk := sock.recv(65536):
            at_reply = sent[0] if at_reply is None else at_reply
            reply += chunk
    except ConnectionResetError:     # closed with the upload unread: allowed too
        pass
    at_reply = sent[0] if at_reply is None else at_reply
    uploader.join(timeout=30)
    sock.close()
    assert at_reply < pieces, "the server read the whole upload before answering"
    if reply:
        assert reply.startswith(b"HTTP/1.1 411") and b"connection: close" in reply.lower()
        assert b"chunked request bodies are not accepted" in reply, reply[:300]
    assert not sched.sessions


def test_the_body_cap_counts_the_bytes_that_arrive_not_the_length_header():
    """A body longer than its Content-Length (no Transfer-Encoding) stops at the cap."""
    from starlette.requests import Request

    piece, pulled = b" " * 65536, []

    async def receive():                 # 64 MiB at most, so a broken cap still ends
        pulled.append(len(piece))
        return {"type": "http.request", "body": piece, "more_body": len(pulled) < 1024}
    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-length", b"20")]}
    with pytest.raises(RequestError) as exc:
        asyncio.run(read_body(Request(scope, receive), 10.0))
    assert exc.value.status == 413 and exc.value.headers == {"Connection": "close"}
    assert f"at most {MAX_BODY_BYTES} bytes" in exc.value.message
    assert "Content-Length said 20" in exc.value.message
    assert sum(pulled) <= MAX_BODY_BYTES + len(piece), sum(pulled)


# 3 -------------------------------------------------------------------------- GPU loop
def test_a_failing_start_over_after_a_failed_step_keeps_the_loop(server, monkeypatch, caplog):
    http, port, sched = server
    no_sessions(sched)
    runner, armed, calls = sched.runner, [], []
    step_rows, prefill_rows = runner._step_plan, runner.prefill_rows

    def failing_step(*args, **kwargs):
        if not armed:
            armed.append(True)
            raise RuntimeError("injected device fault")
        return step_rows(*args, **kwargs)

    def failing_prefill(rows, *args, **kwargs):
        calls.append(list(rows))
        if armed == [True]:              # the start-over right after the failed step
            armed.append(True)
            raise RuntimeError("injected reset fault")
        return prefill_rows(rows, *args, **kwargs)
    failed0 = sched.metrics()["failed_resets"]
    monkeypatch.setattr(runner, "prefill_rows", failing_prefill)
    monkeypatch.setattr(runner, "_step_plan", failing_step)
    victim = create(http, seed=21, chunks=2)
    with ws_client.connect(ws_url(port, victim), max_size=None) as ws:
        indices, texts = read_stream(ws)
    assert not indices and texts[-1]["state"] == "failed"
    assert "injected device fault" in texts[-1]["error"]
    assert sched.metrics()["failed_resets"] == failed0 + 1 and sched.loop_error is None
    assert "injected reset fault" in caplog.text                           # logged
    sid, got = create(http, seed=22, chunks=3), []                       # the loop goes on
    with ws_client.connect(ws_url(port, sid), max_size=None) as ws:
        while isinstance(msg := ws.recv(timeout=30), bytes):
            header, payload = wire.decode(msg)
            ack(ws, msg)
            got.append(torch.frombuffer(bytearray(payload), dtype=torch.float32).view(
                header["shape"]))
    assert json.loads(msg)["state"] == "done" and len(got) == 3
    assert [sched.max_sessions] in calls          # the stale scratch row, started over
    want = alone_chunks(sched, 22, 3)                                     # and right
    assert max(float((g - w).abs().max()) for g, w in zip(got, want)) <= 1e-5
    assert http.get("/health").status_code == 200


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_loop_that_dies_turns_health_and_new_sessions_into_503s(monkeypatch):
    sched = StreamScheduler("tiny", max_sessions=1, device="cpu", use_graphs=False)
    with serving(sched) as (_, port):
        base = f"http://127.0.0.1:{port}"
        sid = httpx.post(f"{base}/v1/sessions", json={"seed": 1}).json()["id"]

        def dead():
            raise RuntimeError("injected loop death")
        monkeypatch.setattr(sched, "step", dead)
        with ws_client.connect(ws_url(port, sid, ""), max_size=None) as ws:
            _, texts = read_stream(ws)
        assert texts[-1]["state"] == "failed" and "injected loop death" in texts[-1]["error"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "error"
        assert "GPU loop stopped: RuntimeError: injected loop death" in health.json()["error"]
        r = httpx.post(f"{base}/v1/sessions", json={"seed": 2})
        assert r.status_code == 503 and "injected loop death" in r.json()["error"], r.text
        no_sessions(sched)


# 4 -------------------------------------------------------------------------- one socket
def test_a_second_socket_is_refused_and_the_first_gets_every_chunk(server):
    http, port, sched = server
    no_sessions(sched)
    sid = create(http, seed=31, chunks=8)
    with ws_client.connect(ws_url(port, sid), max_size=None) as first:
        head = index_of(first.recv(timeout=30))
        with ws_client.connect(ws_url(port, sid), max_size=None) as second:
            with pytest.raises(ConnectionClosed) as exc:
                second.recv(timeout=10)
        assert exc.value.rcvd.code == 4409 and "already has a stream" in exc.value.rcvd.reason
        indices, texts = read_stream(first, first=head)
    assert indices == list(range(8)) and texts[-1]["state"] == "done"


def test_a_reconnect_before_the_old_socket_is_seen_gone_is_taken(server, monkeypatch):
    """The server sees a dropped socket go late (a busy host): the client's new socket,
    come first, waits for it instead of a 4409, and gets the chunks after the last."""
    import framekv.tools.serve.routes as routes

    http, port, sched = server
    no_sessions(sched)
    sid = create(http, seed=32, chunks=4)
    real = routes.serve_socket

    async def late(ws, *args, **kw):      # its end is seen a second after it closed
        try:
            await real(ws, *args, **kw)
        finally:
            await asyncio.sleep(1.0)

    monkeypatch.setattr(routes, "serve_socket", late)
    with ws_client.connect(ws_url(port, sid), max_size=None) as first:
        head = index_of(first.recv(timeout=30))
    with ws_client.connect(ws_url(port, sid) + f"&after={head}", max_size=None) as second:
        indices, texts = read_stream(second)
    assert head == 0 and indices == [1, 2, 3] and texts[-1]["state"] == "done"


# 5 -------------------------------------------------------------------------- tokens
def test_tokens_compare_as_bytes_and_non_ascii_ones_are_refused(server, capsys):
    from framekv.tools.cli import main as cli

    http, port, sched = server
    status, body = raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close"
                                     b"\r\nAuthorization: Bearer h\xc3\xa4rd\r\n\r\n")
    assert status == 401 and "wrong bearer token" in json.loads(body)["error"]
    for token in ("h%C3%A4rd-token", "%FF"):
        with pytest.raises(ConnectionClosed) as exc:
            with ws_client.connect(ws_url(port, "nope", token)) as ws:
                ws.recv(timeout=5)
        assert (exc.value.rcvd.code, exc.value.rcvd.reason) == (1008, "wrong bearer token")
    assert http.get("/health").status_code == 200
    with pytest.raises(SystemExit) as exc:
        cli(["serve", "--token", "t\u00f6ken"])
    assert exc.value.code == 2
    assert "--token: must be 1 or more printable ASCII characters" in capsys.readouterr().err
    with pytest.raises(ValueError, match="token must be 1 or more printable ASCII"):
        build_app(sched, token="a token")


def test_a_binary_or_loose_control_message_is_answered_and_the_session_goes_on(server):
    http, port, sched = server
    no_sessions(sched)
    sid = create(http, seed=41)                                  # open-ended
    indices, errors = [], []
    with ws_client.connect(ws_url(port, sid), max_size=None) as ws:
        ws.send(b"\x00\x01binary")
        ws.send(json.dumps({"type": "pause", "bogus": 1}))
        while len(errors) < 2 or len(indices) < 2:               # chunks after both
            msg = ws.recv(timeout=30)
            if isinstance(msg, str):
                errors.append(json.loads(msg))
            elif len(errors) == 2:
                indices.append(index_of(msg))
    assert [e["type"] for e in errors] == ["error", "error"], errors
    assert "must be JSON text, got a binary message of 8 bytes" in errors[0]["error"]
    assert "pause message takes ['type'], got unknown ['bogus']" in errors[1]["error"]
    assert indices == list(range(indices[0], indices[0] + len(indices)))   # in order
    assert http.delete(f"/v1/sessions/{sid}").status_code == 204   # it outlives its socket
    no_sessions(sched)


def test_the_docs_need_the_token_and_health_and_the_page_do_not(server):
    http, port, _ = server
    base = f"http://127.0.0.1:{port}"
    for path in ("/docs", "/openapi.json"):
        r = httpx.get(base + path)
        assert r.status_code == 401 and "token" in r.json()["error"], path
        assert http.get(path).status_code == 200, path
    r = httpx.get(f"{base}/docs?token={TOKEN}")                # the page passes ?token= on
    assert r.status_code == 200 and '"openapi.json" + (token ? "?token="' in r.text
    assert "/v1/sessions" in httpx.get(f"{base}/openapi.json?token={TOKEN}").json()["paths"]
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/").status_code == 200


def test_a_trickled_request_head_is_closed_at_its_deadline(server):
    http, port, _ = server
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40 + b"\r\n\r\n"
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(30)]
    for s in idle:
        s.sendall(b"GET /health HTTP/1.1\r\nHo")       # half a head, then nothing
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        took = trickle(s, head)
    assert took is not None and HEAD_TIMEOUT * 0.8 <= took <= HEAD_TIMEOUT + 1.5, took
    for s in idle:                                       # their deadline passed too
        s.settimeout(2)
        assert s.recv(1024) == b""
        s.close()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")   # keep-alive: one answer,
        assert s.recv(65536).startswith(b"HTTP/1.1 200")        # then the next head is
        took = trickle(s, head)                                # on the clock again
    assert took is not None and took <= HEAD_TIMEOUT + 1.5, took
    assert http.get("/health").status_code == 200


# 1, 7 ----------------------------------------------------------------------- prompts
def test_non_finite_numbers_and_loose_prompt_objects_are_4xx(server, monkeypatch):
    http, port, sched = server
    L, D = sched.prompt_shape
    nan = torch.full((L, D), float("nan")).numpy().tobytes()
    ok = base64.b64encode(torch.zeros(L, D).numpy().tobytes()).decode()
    cases = [
        (b'{"seed": NaN}', 400, "NaN is not JSON"),
        (b'{"seed": 1, "chunks": -Infinity}', 400, "-Infinity is not JSON"),
        ({"seed": 1, "prompt": {"shape": [L, D], "data": base64.b64encode(nan).decode()}},
         422, f"finite float32 values, got {L * D} NaN or infinite of {L * D}"),
        ({"seed": 1, "prompt": {"shape": [L, D], "data": ok, "scale": 2}}, 422,
         "prompt.scale is not a field this takes, got prompt.scale=2"),
        ({"seed": 1, "prompt": {"shape": [float(L), float(D)], "data": ok}}, 422,
         f"prompt.shape.0 must be an integer, got {float(L)}"),
    ]
    for body, status, words in cases:
        r = (http.post("/v1/sessions", content=body) if isinstance(body, bytes)
             else http.post("/v1/sessions", json=body))
        assert r.status_code == status and words in r.json()["error"], (body, r.text)
    nan_prompt = torch.full((L, D), float("nan"))
    with pytest.raises(ValueError, match="prompt must hold finite values"):
        sched.open_session(seed=1, prompt=nan_prompt)         # refused before any GPU work
    sid = create(http, seed=2)
    with pytest.raises(ValueError, match="prompt must hold finite values"):
        sched.set_prompt(sid, nan_prompt)
    assert http.delete(f"/v1/sessions/{sid}").status_code == 204
    no_sessions(sched)


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), ValueError("late")])
def test_a_prompt_change_whose_recache_fails_answers_an_error_and_streams_on(server,
                                                                             monkeypatch,
                                                                             error):
    """A re-cache that raises (out of memory, anything) leaves the session streaming under
    its old prompt: the socket answers {"type": "error"}, PUT answers 500 {"error"}; the
    socket stays open and the chunks go on, their prompt version unchanged."""
    http, port, sched = server
    no_sessions(sched)
    real = sched.runner.prefill_rows

    def failing(rows, prompt=None, *, rewrite=False):
        if rewrite:
            raise error
        return real(rows, prompt, rewrite=rewrite)
    sid = create(http, seed=5)
    with ws_client.connect(ws_url(port, sid), max_size=None) as ws:
        first = ack(ws, ws.recv(timeout=30))
        monkeypatch.setattr(sched.runner, "prefill_rows", failing)
        ws.send(json.dumps({"type": "prompt", "prompt_seed": 4}))
        versions, reply = [], None
        while reply is None or len(versions) < 3:
            msg = ws.recv(timeout=30)
            if isinstance(msg, str):
                reply = json.loads(msg)
                continue
            versions.append(wire.decode(msg)[0]["prompt_version"])
            ack(ws, msg)
        assert reply["type"] == "error" and type(error).__name__ in reply["error"]
        assert "goes on under its old prompt" in reply["error"] and first == 0
        assert versions == [0, 0, 0]
        L, D = sched.prompt_shape
        raw = torch.zeros(L, D).numpy().tobytes()
        r = http.put(f"/v1/sessions/{sid}/prompt", content=raw,
                     headers={"X-Prompt-Shape": f"{L},{D}", "X-Prompt-Dtype": "fp32"})
        assert r.status_code == 500 and "goes on under its old prompt" in r.json()["error"]
        assert http.get(f"/v1/sessions/{sid}").json()["prompt_version"] == 0
        ack(ws, ws.recv(timeout=30))                        # it streams on
    assert http.delete(f"/v1/sessions/{sid}").status_code == 204
    no_sessions(sched)


# 5 -------------------------------------------------------------------------- shutdown
def test_shutdown_sends_the_queued_chunks_and_an_end_with_its_reason():
    sched = StreamScheduler("tiny", max_sessions=1, device="cpu", use_graphs=False,
                            queue_chunks=3)
    with serving(sched) as (srv, port):
        sid = httpx.post(f"http://127.0.0.1:{port}/v1/sessions", json={"seed": 5}).json()["id"]
        with ws_client.connect(ws_url(port, sid, ""), max_size=None) as ws:
            first = index_of(ws.recv(timeout=30))
            time.sleep(0.5)                                  # chunks pile up meanwhile
            srv.should_exit = True
            indices, texts = read_stream(ws, first=first)
            with pytest.raises(ConnectionClosed) as exc:
                ws.recv(timeout=10)
    assert indices == list(range(len(indices))) and len(indices) >= 2, indices
    assert texts[-1] == {"type": "end", "state": "closed", "error": None, "reason": "shutdown"}
    assert exc.value.rcvd.code == 1001


def test_the_client_streams_every_queued_chunk_through_a_drain():
    """The server drains while a `framekv.client` session streams slowly: every chunk
    it sent comes out of ``stream`` in order, then the end (its acks may meet a socket
    the server closed already)."""
    import framekv.client.sessions as fc

    sched = StreamScheduler("tiny", max_sessions=1, device="cpu", use_graphs=False,
                            queue_chunks=3)
    with serving(sched) as (srv, port):
        with fc.Client(f"http://127.0.0.1:{port}") as client:
            s = client.create(seed=5)
            got = []
            for chunk in s.stream(timeout=30):
                got.append(chunk.index)
                if len(got) == 1:
                    time.sleep(0.5)                          # chunks pile up meanwhile
                    srv.should_exit = True
                time.sleep(0.05)                             # a slow reader
    assert got == list(range(len(got))) and len(got) >= 2, got
    assert s.end["reason"] == "shutdown", s.end


def test_sigterm_ends_a_stream_with_its_queued_chunks_and_a_shutdown_end():
    """``framekv serve --preset tiny`` as its own process, SIGTERM mid-stream."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "framekv.tools.cli", "serve", "--preset",
                             "tiny", "--device", "cpu", "--port", str(port), "--max-sessions",
                             "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.1)
        sid = httpx.post(f"{base}/v1/sessions", json={"seed": 3}).json()["id"]
        with ws_client.connect(ws_url(port, sid, ""), max_size=None) as ws:
            first = index_of(ws.recv(timeout=30))
            time.sleep(0.3)
            os.kill(proc.pid, signal.SIGTERM)
            indices, texts = read_stream(ws, first=first)
        assert indices == list(range(len(indices))) and texts[-1]["reason"] == "shutdown"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
