"""`framekv serve` and `framekv generate` against the defects of a hostile run, on the CPU.

The command line refuses a bad preset, device, frame rate, port, session count, a
``--checkpoint-every`` without ``--state-dir`` and an ``--out`` no file can be made in
with one line on stderr and exit status 2, before any model is built; the scheduler
refuses a session count past its bound at once (no hang). A real server on 127.0.0.1
answers a 401 to a request carrying a large body without reading it and closes the
connection; 404, 405 and an internal error have the one error shape ``{"error"}``;
a WebSocket from a foreign page (its Origin) is closed 1008 unless allowed; a request
head over 16 KiB is refused (431) and its connection closed. The plain ``framekv
serve`` (the reference model) streams frames: a picture of its latents.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import random
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

for extra in ("fastapi", "uvicorn"):        # the serve extra
    pytest.importorskip(extra)
httpx = pytest.importorskip("httpx")
ws_client = pytest.importorskip("websockets.sync.client")
from websockets.exceptions import ConnectionClosed  # noqa: E402

from framekv.engine.serving import LatentPreview, StreamScheduler  # noqa: E402
from framekv.specs import wire  # noqa: E402
from framekv.tools.cli import main  # noqa: E402
from serve_harness import create, raw_request, read_stream, serving  # noqa: E402

TOKEN = "defect-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: a limit only a hang or a model build reaches: the refusals below take about a
#: second, most of it importing torch, even on a loaded machine
CLI_LIMIT_S = 120
#: seconds a connection may stay open after the server answered and should have closed it
CLOSE_LIMIT_S = 15


@pytest.fixture(scope="module")
def server():
    # a head deadline well past CLOSE_LIMIT_S: a connection closed before it was closed
    # by the server's answer, not by the deadline
    sched = StreamScheduler("tiny", max_sessions=2, device="cpu", use_graphs=False,
                            queue_chunks=2)
    with serving(sched, head_timeout=60.0, token=TOKEN) as (_, port):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH,
                          timeout=30) as http:
            yield http, port, sched


def ws_url(port, sid) -> str:
    return f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream?token={TOKEN}"


def read_to_close(sock, limit: float = CLOSE_LIMIT_S) -> tuple[bytes, bool]:
    """(what ``sock`` received, whether the server closed it) within ``limit`` s."""
    data, deadline = b"", time.monotonic() + limit
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


# 1 ------------------------------------------------------------------ the command line
def _bad_preset_file(tmp_path) -> str:
    path = tmp_path / "bad.toml"
    path.write_bytes(b"[model\nnum_layers = = 2\n\xff\x00")
    return str(path)


CLI_REFUSALS = [
    (["serve", "nosuchpreset", "--device", "cpu"], ["PRESET", "'nosuchpreset'"]),
    (["serve", "{bad_preset}", "--device", "cpu"], ["PRESET", "bad.toml"]),
    (["serve", "--device", "tpu"], ["--device", "'tpu'"]),
    (["serve", "--device", "cuda:x"], ["--device", "'cuda:x'"]),
    (["serve", "--device", "cpu", "--fps", "1000"], ["--fps", "[1, 240]", "1000"]),
    (["serve", "--device", "cpu", "--port", "70000"], ["--port", "[0, 65535]", "70000"]),
    (["serve", "--device", "cpu", "--max-sessions", "1000000"],
     ["--max-sessions", "[1, 4096]", "1000000"]),
    (["serve", "--device", "cpu", "--max-sessions", str(10**12)],
     ["--max-sessions", "[1, 4096]", str(10**12)]),
    (["serve", "--device", "cpu", "--checkpoint-every", "2"],
     ["--checkpoint-every", "--state-dir"]),
    (["serve", "--device", "cpu", "--allowed-origins", "ftp://x"],
     ["--allowed-origins", "'ftp://x'"]),
    (["generate", "--prompt", "x", "--chunks", "1", "--device", "cpu", "--out", "/sys/x.mp4"],
     ["--out", "/sys/x.mp4"]),
    (["serve", "--device", "cpu", "--model", "wan-diffusers", "--decoder", "big"],
     ["--decoder", "wan, tiny or tiny:PATH", "'big'"]),
    (["serve", "--device", "cpu", "--model", "wan-diffusers", "--decoder", "tiny:nope.pth"],
     ["--decoder", "'nope.pth'", "no such file"]),
    (["serve", "--device", "cpu", "--decoder", "tiny"], ["--decoder", "--model wan-diffusers"]),
    (["generate", "--prompt", "x", "--chunks", "1", "--device", "cpu", "--out", "x.mp4",
      "--decoder", "tiny:"], ["--decoder", "'tiny:'"]),
]
if not torch.cuda.is_available():
    CLI_REFUSALS.append((["serve", "--device", "cuda"], ["--device", "'cuda'", "not available"]))


@pytest.mark.parametrize("argv, words", CLI_REFUSALS)
def test_bad_options_are_one_line_and_exit_2_before_anything_is_built(tmp_path, argv, words):
    argv = [a.format(bad_preset=_bad_preset_file(tmp_path)) for a in argv]
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "framekv.tools.cli", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=CLI_LIMIT_S,
                          env={**{k: v for k, v in os.environ.items() if k != "FRAMEKV_TOKEN"},
                               "OMP_NUM_THREADS": "1"})
    seconds = time.monotonic() - t0
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr                     # no usage, no traceback
    assert lines[0].startswith(f"framekv {argv[0]}: error: "), lines
    assert all(w in lines[0] for w in words), (words, lines)
    assert proc.stdout == ""                                # no progress, no header
    assert seconds < CLI_LIMIT_S
    assert sorted(os.listdir(tmp_path)) in ([], ["bad.toml"])


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if a scheduler or a Wan pipeline is built."""
    def built(*a, **k):
        raise AssertionError("built before the options were checked")

    monkeypatch.setattr("framekv.engine.serving.StreamScheduler", built)
    monkeypatch.setattr("framekv.engine.wan.pipeline.WanPipeline.load", built)


@pytest.mark.parametrize("argv, words", CLI_REFUSALS)
def test_the_refusals_come_before_any_model(tmp_path, capsys, monkeypatch, nothing_built,
                                           argv, words):
    monkeypatch.delenv("FRAMEKV_TOKEN", raising=False)
    argv = [a.format(bad_preset=_bad_preset_file(tmp_path)) for a in argv]
    try:
        status = main(argv)
    except SystemExit as exc:                      # a usage error of the parser
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and all(w in err for w in words), err


def test_the_schedulers_session_bound_is_the_commands():
    from framekv.engine.serving import sizes
    from framekv.tools.serve import command

    assert command.MAX_SESSIONS == sizes.MAX_SESSIONS == 4096


def test_the_scheduler_refuses_too_many_sessions_at_once():
    errors = []

    def build():
        try:
            StreamScheduler("tiny", max_sessions=10**12, device="cpu", use_graphs=False)
        except ValueError as exc:
            errors.append(str(exc))
    thread = threading.Thread(target=build, daemon=True)     # a hang fails, not blocks
    thread.start()
    thread.join(timeout=CLI_LIMIT_S)
    assert not thread.is_alive(), "StreamScheduler(max_sessions=10**12) hangs"
    assert errors and "max_sessions must be an integer in [1, 4096]" in errors[0], errors
    assert str(10**12) in errors[0]


def test_the_scratch_rows_are_the_widest_padding_of_any_batch():
    from framekv.engine.serving.sizes import scratch_rows

    rng = random.Random(5)
    for _ in range(300):
        slots = rng.randint(1, 40)
        sizes = sorted(set(rng.sample(range(1, 60), rng.randint(1, 6))) | {rng.randint(slots, 60)})
        want = max(min(b for b in sizes if b >= k) - k for k in range(1, slots + 1))
        assert scratch_rows(tuple(sizes), slots) == want, (sizes, slots)
    t0 = time.monotonic()
    assert scratch_rows((1, 2, 4, 2**40), 2**40) == 2**40 - 5
    assert time.monotonic() - t0 < 5


class _Built(Exception):
    """Raised by a stand-in build_app: the command got as far as the app."""


@pytest.fixture
def built(monkeypatch):
    """What `framekv serve` hands the scheduler and the app (neither is built)."""
    from framekv.tools.serve import command

    monkeypatch.delenv("FRAMEKV_TOKEN", raising=False)
    seen = {}

    def scheduler(*args, **kwargs):
        seen["scheduler"] = (args, kwargs)
        return object()

    def app(sched, **kwargs):
        seen["app"] = kwargs
        raise _Built
    monkeypatch.setattr("framekv.engine.serving.StreamScheduler", scheduler)
    monkeypatch.setattr(command, "build_app", app)
    return seen


def test_checkpoint_every_reaches_the_app_with_the_state_dir(tmp_path, built):
    with pytest.raises(_Built):
        main(["serve", "--device", "cpu", "--state-dir", str(tmp_path / "state"),
              "--checkpoint-every", "3"])
    assert built["app"]["checkpoint_every"] == 3
    assert built["app"]["state_dir"] == tmp_path / "state" and (tmp_path / "state").is_dir()
    with pytest.raises(_Built):
        main(["serve", "--device", "cpu"])
    assert built["app"]["checkpoint_every"] is None and built["app"]["state_dir"] is None


def test_the_reference_model_streams_frames_by_default_and_latents_on_request(built):
    with pytest.raises(_Built):
        main(["serve", "--device", "cpu"])
    factory = built["scheduler"][1]["decoder_factory"]
    assert built["app"]["output"] == "frames" and isinstance(factory(3), LatentPreview)
    assert factory(3).sequences == 3
    with pytest.raises(_Built):
        main(["serve", "--device", "cpu", "--output", "latents"])
    assert built["app"]["output"] == "latents"
    assert built["scheduler"][1]["decoder_factory"] is None


def test_allowed_origins_reach_the_app(built):
    with pytest.raises(_Built):
        main(["serve", "--device", "cpu", "--allowed-origins",
              "https://App.example:8443/, http://other.example"])
    assert built["app"]["allowed_origins"] == ("https://app.example:8443",
                                               "http://other.example")
    with pytest.raises(_Built):
        main(["serve", "--device", "cpu"])
    assert built["app"]["allowed_origins"] is None


def test_the_default_server_streams_pictures_of_its_latents(monkeypatch):
    """The scheduler and app `framekv serve` builds by default, served: frames messages
    of JPEGs, one per latent frame, 8x the latents' size; /v1/info says so."""
    Image = pytest.importorskip("PIL.Image")
    from framekv.tools.serve import command

    monkeypatch.delenv("FRAMEKV_TOKEN", raising=False)
    made = {}

    def scheduler(*args, **kwargs):
        made["sched"] = StreamScheduler(*args, **{**kwargs, "use_graphs": False,
                                                  "progress": False})
        return made["sched"]

    def app(sched, **kwargs):
        made["app"] = kwargs
        raise _Built
    monkeypatch.setattr("framekv.engine.serving.StreamScheduler", scheduler)
    monkeypatch.setattr(command, "build_app", app)
    with pytest.raises(_Built):
        main(["serve", "--device", "cpu", "--max-sessions", "1"])
    sched, kwargs = made["sched"], made["app"]
    C, F, H, W = sched.chunk_shape
    with serving(sched, **kwargs) as (_, port):
        base = f"http://127.0.0.1:{port}"
        info = httpx.get(f"{base}/v1/info").json()
        assert info["output"] == "frames" and info["frame_format"] == "jpeg"
        assert info["video_frames_per_chunk"] == {"first": F, "later": F}
        sid = httpx.post(f"{base}/v1/sessions", json={"seed": 3, "chunks": 2}).json()["id"]
        headers = []
        with ws_client.connect(f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream",
                               max_size=None) as ws:
            while isinstance(msg := ws.recv(timeout=60), bytes):
                header, payload = wire.decode(msg)
                headers.append(header)
                ws.send(json.dumps({"type": "ack", "index": header["index"]}))
                img = Image.open(io.BytesIO(payload[:header["sizes"][0]]))
                assert img.format == "JPEG" and img.size == (8 * W, 8 * H)
                colours = np.unique(np.asarray(img.convert("RGB")).reshape(-1, 3), axis=0)
                assert len(colours) > 4                                 # a picture
        assert json.loads(msg)["state"] == "done"
    assert [(h["type"], h["index"], h["frame0"], h["frames"]) for h in headers] == [
        ("frames", 0, 0, F), ("frames", 1, F, F)]


# 2 ------------------------------------------------------------------ 401 with a body
def test_a_401_with_a_large_body_is_answered_unread_and_the_connection_closed(server):
    _, port, sched = server
    for auth in (b"", b"Authorization: Bearer wrong\r\n"):
        head = (b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\n" + auth +
                b"Content-Type: application/json\r\nContent-Length: 52428800\r\n\r\n")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + b"{" + b" " * 4095)               # 4 KiB of 50 MiB
            reply, closed = read_to_close(sock)
        assert reply.startswith(b"HTTP/1.1 401 "), reply[:200]
        head_in, body = reply.split(b"\r\n\r\n", 1)
        assert b"connection: close" in head_in.lower()
        assert b"bearer token" in json.loads(body)["error"].encode()
        assert closed, "the connection stayed open waiting for the body"
    assert not sched.sessions


def test_an_error_before_the_body_is_read_closes_and_one_after_keeps_alive(server):
    http, port, sched = server
    # 404 before the upload is read: closed
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"PUT /v1/sessions/nope/prompt HTTP/1.1\r\nHost: x\r\nAuthorization: "
                     b"Bearer " + TOKEN.encode() + b"\r\nX-Prompt-Shape: 6,32\r\n"
                     b"X-Prompt-Dtype: fp32\r\nContent-Length: 768\r\n\r\n")
        reply, closed = read_to_close(sock)
    assert reply.startswith(b"HTTP/1.1 404 ") and closed, reply[:200]
    assert b"connection: close" in reply.split(b"\r\n\r\n")[0].lower()
    # a 422 of a body read whole: the connection is kept
    r = http.post("/v1/sessions", json={"seed": -1})
    assert r.status_code == 422 and r.headers.get("connection") != "close"


# 3 ------------------------------------------------------------------ one error shape
def test_an_unknown_route_is_a_404_error(server):
    http, _, _ = server
    for method in ("GET", "POST", "DELETE"):
        r = http.request(method, "/no/such/route")
        assert r.status_code == 404 and r.headers["content-type"] == "application/json"
        assert r.json() == {"error": f"no such route: {method} /no/such/route (the API: "
                                     "/docs)"}, r.text


def test_a_wrong_method_is_a_405_error_naming_the_allowed_ones(server):
    http, _, _ = server
    r = http.delete("/v1/info")
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    assert r.json() == {"error": "method DELETE is not allowed on /v1/info: use GET"}, r.text
    r = http.put("/v1/sessions")
    assert r.status_code == 405 and r.json()["error"].endswith("use POST"), r.text


def test_an_internal_error_is_a_500_error_and_its_traceback_is_logged(server, monkeypatch,
                                                                      caplog):
    http, _, sched = server

    def broken(sid):
        raise RuntimeError("injected\nfault")
    monkeypatch.setattr(sched, "session_info", broken)
    caplog.set_level(logging.ERROR, logger="framekv.serve")
    r = http.get("/v1/sessions/abc")
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": "internal error: RuntimeError: injected fault"}, r.text
    logged = [rec for rec in caplog.records if rec.name == "framekv.serve" and rec.exc_info]
    assert logged and "GET /v1/sessions/abc" in logged[0].getMessage()
    monkeypatch.undo()
    assert http.get("/health").status_code == 200                 # the server goes on


# 4 ------------------------------------------------------------------ WebSocket Origin
def _streams(url, origin=None) -> bool:
    """Whether a socket from ``origin`` gets its session's chunk; False if it is closed
    1008 (the reason must name the origin)."""
    try:
        with ws_client.connect(url, origin=origin, max_size=None, open_timeout=10) as ws:
            indices, texts = read_stream(ws, limit=60)
    except ConnectionClosed as exc:
        assert exc.rcvd.code == 1008 and origin in exc.rcvd.reason, exc.rcvd
        assert "not allowed" in exc.rcvd.reason
        return False
    assert indices == [0] and texts[-1]["state"] == "done"
    return True


def test_a_socket_from_a_foreign_page_is_refused(server):
    http, port, sched = server
    same = f"http://127.0.0.1:{port}"
    for origin, allowed in ((None, True), (same, True), ("http://evil.example", False),
                            (f"http://127.0.0.1:{port + 1}", False), ("null", False)):
        sid = create(http, seed=1, chunks=1)
        assert _streams(ws_url(port, sid), origin) is allowed, origin
        if not allowed:
            assert http.delete(f"/v1/sessions/{sid}").status_code == 204


def test_allowed_origins_let_those_pages_in():
    sched = StreamScheduler("tiny", max_sessions=1, device="cpu", use_graphs=False)
    with serving(sched, allowed_origins="https://app.example, http://other.example:81") \
            as (_, port):
        base = f"http://127.0.0.1:{port}"
        for origin, allowed in (("https://app.example", True), ("http://other.example:81", True),
                                (base, True), (None, True), ("http://app.example", False)):
            sid = httpx.post(f"{base}/v1/sessions", json={"seed": 2, "chunks": 1}).json()["id"]
            url = f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream"
            assert _streams(url, origin) is allowed, origin
            if not allowed:
                assert httpx.delete(f"{base}/v1/sessions/{sid}").status_code == 204


@pytest.mark.parametrize("bad", ["ftp://x", "https://x/path", "app.example", "", 5])
def test_build_app_names_a_bad_allowed_origin(bad):
    sched = type("Sched", (), {"decoding": False})()
    from framekv.tools.serve import build_app

    with pytest.raises(ValueError, match="allowed_origins must be"):
        build_app(sched, allowed_origins=bad)


# 5 ------------------------------------------------------------------ head size
def test_a_request_head_over_16_kib_is_refused_and_closed(server):
    _, port, _ = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 100 * 1024 +
                     b"\r\n\r\n")
        reply, closed = read_to_close(sock)
    assert reply.split(b" ", 2)[1] in (b"431", b"400"), reply[:200]
    assert closed, "the connection stayed open"
    assert "16384 bytes" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    # in pieces, as a slow client sends it: refused too
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            for _ in range(20):
                sock.sendall(b"X-Pad: " + b"a" * 1024 + b"\r\n")
        reply, closed = read_to_close(sock)
    assert reply.split(b" ", 2)[1] in (b"431", b"400") and closed, reply[:200]
    # a head under the bound is served
    status, body = raw_request(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close"
                                     b"\r\nX-Pad: " + b"a" * 12 * 1024 + b"\r\n\r\n")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_keep_alive_heads_are_each_bounded(server):
    """Each request on a kept-alive connection has its own 16 KiB."""
    _, port, _ = server
    one = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10 * 1024 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for _ in range(3):
            sock.sendall(one)
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, data
                data += chunk
            assert data.startswith(b"HTTP/1.1 200 "), data[:200]
