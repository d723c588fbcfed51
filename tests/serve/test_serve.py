"""`framekv serve` on the CPU: a real server on 127.0.0.1, real HTTP and WebSocket clients.

8 concurrent sessions stream their chunks in order, each equal to its seed run alone
(fp32); a prompt change mid-stream equals the same re-cache offline; disconnects,
overload, bad JSON, bad tokens, unknown ids, oversized uploads, text for a model without
a text encoder and a failing step are clear errors while the other sessions go on.
(``--output frames``: test_serve_frames.py; the page in a browser: test_serve_page.py.)
"""
from __future__ import annotations

import base64
import json
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
ws_client = pytest.importorskip("websockets.sync.client")

from framekv.specs import wire  # noqa: E402
from framekv.engine.step import chunk_noise  # noqa: E402
from framekv.engine.serving import StreamScheduler  # noqa: E402
from framekv.tools.serve import MAX_BODY_BYTES, build_app  # noqa: E402
from test_scheduler import alone_chunks  # noqa: E402

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server():
    sched = StreamScheduler("tiny", max_sessions=8, device="cpu", queue_chunks=2)
    srv = uvicorn.Server(uvicorn.Config(build_app(sched, token=TOKEN), host="127.0.0.1",
                                        port=0, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30) as http:
        yield http, f"ws://127.0.0.1:{port}", sched
    srv.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive(), "the server did not drain and exit"


def create(http, **body) -> str:
    r = http.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def stream(ws_base, sid, *, on_chunk=None, limit=60.0, token=TOKEN):
    """Every message of a session's socket until its end message: (chunks, end)."""
    chunks = []
    query = f"?token={token}" if token else ""
    with ws_client.connect(f"{ws_base}/v1/sessions/{sid}/stream{query}",
                           open_timeout=10, max_size=None) as ws:
        deadline = time.monotonic() + limit
        while True:
            msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(msg, str):
                end = json.loads(msg)
                if end["type"] == "end":
                    return chunks, end
                continue
            header, payload = wire.decode(msg)
            lat = torch.frombuffer(bytearray(payload), dtype=torch.float32)
            chunks.append((header, lat.view(header["shape"])))
            ws.send(json.dumps({"type": "ack", "index": header["index"]}))
            if on_chunk is not None:
                on_chunk(ws, header)


def wait_sessions(http, n, limit=10.0):
    deadline = time.monotonic() + limit
    while http.get("/health").json()["sessions"] != n:
        assert time.monotonic() < deadline, http.get("/health").json()
        time.sleep(0.05)


def test_eight_concurrent_sessions_stream_in_order_and_equal_each_seed_alone(server):
    http, ws, sched = server
    ids = {create(http, seed=300 + i, chunks=6): 300 + i for i in range(8)}
    results = {}

    def client(sid):
        results[sid] = stream(ws, sid)
    threads = [threading.Thread(target=client, args=(sid,)) for sid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for sid, seed in ids.items():
        chunks, end = results[sid]
        assert end["state"] == "done" and end["error"] is None
        assert [h["index"] for h, _ in chunks] == list(range(6)), "lost, repeated or reordered"
        want = alone_chunks(sched, seed, 6)
        err = max(float((lat - w).abs().max()) for (_, lat), w in zip(chunks, want))
        assert err <= 1e-5, (seed, err)
    assert max(h["batch"] for sid in ids for h, _ in results[sid][0]) > 1  # batched steps
    wait_sessions(http, 0)
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    m = sched.metrics()
    assert fams["framekv_chunks"].type == "counter"
    assert fams["framekv_chunks"].samples[0].value == m["chunks"] >= 48
    assert fams["framekv_chunk_seconds"].type == "histogram"
    assert "framekv_video_frames" not in fams and not m["decoding"]     # latents only


def test_a_prompt_change_mid_stream_equals_the_same_recache_offline(server):
    http, ws, sched = server
    P, dim = sched.runner.model.prompt.shape
    # A budget well past the change: it applies at the next step the server takes after
    # reading it, which races the chunks already under way.
    sid = create(http, seed=77, chunks=16, prompt_seed=1)

    def change(sock, header):
        if header["index"] == 1:
            sock.send(json.dumps({"type": "prompt", "prompt_seed": 2}))
    chunks, end = stream(ws, sid, on_chunk=change)
    assert end["state"] == "done" and [h["index"] for h, _ in chunks] == list(range(16)), \
        (end, [h["index"] for h, _ in chunks])
    first_new = next(h["index"] for h, _ in chunks if h["prompt_version"] == 1)
    seeded = [torch.randn(P, dim, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    want = alone_chunks(sched, 77, 16, prompt=seeded[0], rewrite_at=first_new,
                        new_prompt=seeded[1])
    assert max(float((lat - w).abs().max()) for (_, lat), w in zip(chunks, want)) <= 1e-5


def test_uploaded_embeddings_are_the_prompt(server):
    http, ws, sched = server
    P, dim = sched.runner.model.prompt.shape
    emb = torch.randn(P, dim, generator=torch.Generator().manual_seed(5))
    data = base64.b64encode(emb.numpy().tobytes()).decode()
    sid = create(http, seed=8, chunks=2, prompt={"shape": [P, dim], "data": data})
    chunks, end = stream(ws, sid)
    want = alone_chunks(sched, 8, 2, prompt=emb)
    assert max(float((lat - w).abs().max()) for (_, lat), w in zip(chunks, want)) <= 1e-5


def test_errors_are_clear_and_change_nothing(server):
    http, ws, sched = server
    wait_sessions(http, 0)
    base = str(http.base_url).rstrip("/")
    bad = [
        (http.post("/v1/sessions", content=b"{not json", headers=AUTH), 400, "not JSON"),
        (http.post("/v1/sessions", json={"chunks": 2}), 422, "seed"),
        (http.post("/v1/sessions", json={"seed": 1, "bogus": 1}), 422, "bogus"),
        (http.post("/v1/sessions", json={"seed": -4}), 422, "seed must be"),
        (http.post("/v1/sessions", json={"seed": 1, "prompt": {"shape": [1, 1], "data": "x"}}),
         422, "prompt must be"),
        (http.post("/v1/sessions", content=b" " * (MAX_BODY_BYTES + 1)), 413, "bytes"),
        (httpx.post(f"{base}/v1/sessions", json={"seed": 1}), 401, "token"),
        (httpx.post(f"{base}/v1/sessions", json={"seed": 1},
                    headers={"Authorization": "Bearer wrong"}), 401, "token"),
        (httpx.get(f"{base}/metrics"), 401, "token"),
        (http.delete("/v1/sessions/nope"), 404, "no such session"),
        (http.post("/v1/sessions", json={"seed": 1, "text": "a cat"}), 422, "text encoder"),
        (http.post("/v1/sessions", json={"seed": 1, "text": "a", "prompt_seed": 1}), 422,
         "give one of text, prompt_seed or prompt, not text and prompt_seed"),
        (http.post("/v1/sessions", json={"seed": 1, "text": 5}), 422, "text must be a string"),
        (http.post("/v1/sessions", json={"seed": 1, "text": ""}), 422,
         "text must be a string of 1 or more characters, got ''"),
        (http.post("/v1/sessions", json={"seed": 1, "text": " \n\t "}), 422,
         "text must hold at least one word (a character other than white space), "
         "got ' \\n\\t '"),
    ]
    for r, status, words in bad:
        assert r.status_code == status and words in r.json()["error"], (status, r.text)
    assert httpx.get(f"{base}/health").status_code == 200  # no token needed
    page = httpx.get(f"{base}/")                           # nor for the page
    assert page.status_code == 200 and 'id="status"' in page.text
    assert httpx.get(f"{base}/health").json()["output"] == "latents"
    with pytest.raises(Exception):
        with ws_client.connect(f"{ws}/v1/sessions/nope/stream?token={TOKEN}") as sock:
            sock.recv(timeout=5)
    sid = create(http, seed=1)
    with pytest.raises(Exception):
        with ws_client.connect(f"{ws}/v1/sessions/{sid}/stream?token=wrong") as sock:
            sock.recv(timeout=5)
    assert http.get("/health").json()["sessions"] == 1
    http.delete(f"/v1/sessions/{sid}")
    wait_sessions(http, 0)


def test_overload_is_a_503_and_a_disconnect_keeps_the_session_until_delete(server):
    http, ws, sched = server
    wait_sessions(http, 0)
    ids = [create(http, seed=i) for i in range(8)]
    r = http.post("/v1/sessions", json={"seed": 99})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    with ws_client.connect(f"{ws}/v1/sessions/{ids[0]}/stream?token={TOKEN}",
                           max_size=None) as sock:
        sock.recv(timeout=30)                        # one chunk, then the client goes
    time.sleep(0.3)
    assert http.get("/health").json()["sessions"] == 8     # open: its client may come back
    info = http.get(f"/v1/sessions/{ids[0]}").json()
    assert info["state"] == "active" and not info["connected"] and info["delivered"] == 0
    assert http.delete(f"/v1/sessions/{ids[0]}").status_code == 204
    wait_sessions(http, 7)
    create(http, seed=100)                           # the freed slot is taken again
    for sid in ids[1:]:
        assert http.delete(f"/v1/sessions/{sid}").status_code == 204
    for sid in list(sched.sessions):
        http.delete(f"/v1/sessions/{sid}")
    wait_sessions(http, 0)


def test_a_failing_step_ends_its_sessions_with_the_error_and_the_others_go_on(server,
                                                                              monkeypatch):
    http, ws, sched = server
    wait_sessions(http, 0)
    waiting = create(http, seed=11, chunks=3)
    sched.pause(waiting, True)                       # not in the failing step:
    sched.hold(True)                                 # a step planned before the pause
    sched.hold(False)                                # has ended once hold returns
    real, fired = sched.runner._step_plan, []

    def once(*args, **kwargs):
        if not fired:
            fired.append(True)
            raise RuntimeError("injected device fault")
        return real(*args, **kwargs)
    monkeypatch.setattr(sched.runner, "_step_plan", once)
    victim = create(http, seed=12, chunks=3)
    chunks, end = stream(ws, victim)
    assert end["state"] == "failed" and "injected device fault" in end["error"] and not chunks
    sched.pause(waiting, False)
    chunks, end = stream(ws, waiting)
    assert end["state"] == "done" and [h["index"] for h, _ in chunks] == [0, 1, 2]
    want = alone_chunks(sched, 11, 3)
    assert max(float((lat - w).abs().max()) for (_, lat), w in zip(chunks, want)) <= 1e-5


def test_the_load_script_streams_and_counts_no_capture():
    from framekv.bench.serve_load import measure_load

    res = measure_load("tiny", sessions=3, seconds=2.0, scrape=0.25, device="cpu",
                       progress=lambda m: None)
    assert res["chunks"] > 0 and res["frames_per_second"] > 0
    assert res["captures_after_start"] == 0 and max(res["batch_sizes_seen"]) >= 2
    # scraped while streaming: the registry's text does not grow with the chunks served
    assert res["scrapes"] >= 4 and res["scrape_seconds_p99"] < 2.0
    assert res["health_seconds_p99"] < 2.0
    assert res["metrics_bytes_last"] <= res["metrics_bytes_first"] * 1.05


def test_wan_diffusers_mode_streams_sessions_and_recaches_a_prompt_change():
    """``--model wan-diffusers --config tiny``: the CLI's rollout factory behind a real
    server; two sessions stream, one changes its prompt mid-stream, each equals its seed
    run alone (the change re-cached offline the same way)."""
    import argparse

    from framekv.engine import WanRollout
    from framekv.engine.wan import preset_sizes
    from framekv.tools.serve import wan_factory

    args = argparse.Namespace(config="tiny", preset=None, weights=None, device="cpu",
                              cache_dir=None)
    factory = wan_factory(args, use_graphs=False)
    sched = StreamScheduler(max_sessions=2, device="cpu", queue_chunks=2, runner_factory=factory)
    srv = uvicorn.Server(uvicorn.Config(build_app(sched), host="127.0.0.1", port=0,
                                        log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        while not srv.started:
            time.sleep(0.05)
        port = srv.servers[0].sockets[0].getsockname()[1]
        L, dim = sched.prompt_shape
        new = torch.randn(L, dim, generator=torch.Generator().manual_seed(5))
        data = base64.b64encode(new.numpy().tobytes()).decode()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            ids = [http.post("/v1/sessions", json={"seed": s, "chunks": 6}).json()["id"]
                   for s in (11, 12)]
            got = {}

            def change(ws, header):
                if header["index"] == 1:
                    ws.send(json.dumps({"type": "prompt",
                                        "prompt": {"shape": [L, dim], "data": data}}))

            def client(sid, hook):
                got[sid] = stream(f"ws://127.0.0.1:{port}", sid, on_chunk=hook, token=None)
            threads = [threading.Thread(target=client, args=(sid, h))
                       for sid, h in zip(ids, (None, change))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
        sizes = preset_sizes("tiny")                 # the config's preset: one size table
        frames = sizes["frames_per_chunk"]
        for sid, seed in zip(ids, (11, 12)):
            chunks, end = got[sid]
            assert end["state"] == "done" and [h["index"] for h, _ in chunks] == list(range(6))
            assert all(h["frames"] == frames and h["shape"] == list(sched.chunk_shape)
                       for h, _ in chunks)
            r = WanRollout(sched.runner.model, use_graphs=False, **sizes)
            r.set_prompt(sched.runner.default_prompt()[None])
            versions = [h["prompt_version"] for h, _ in chunks]
            for h, lat in chunks:
                if h["prompt_version"] and h["index"] == versions.index(1):
                    r.set_prompt(new[None], recache=True)
                want = r.step(chunk_noise(seed, h["index"], sched.chunk_shape)[None])[0]
                assert float((lat - want).abs().max()) <= 1e-5, (seed, h["index"])
        versions = [h["prompt_version"] for h, _ in got[ids[1]][0]]
        assert versions == sorted(versions) and versions[1] == 0 and versions[-1] == 1
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        sched.close()



def test_the_cli_serves_wan_and_drains_on_sigterm():
    """``framekv serve --model wan-diffusers --config tiny`` as its own process: it
    answers, streams a session's chunks, and exits 0 on SIGTERM with the session open."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "framekv.tools.cli", "serve", "--model",
                             "wan-diffusers", "--config", "tiny", "--device", "cpu", "--port",
                             str(port), "--max-sessions", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        sid = httpx.post(f"{base}/v1/sessions", json={"seed": 3}).json()["id"]
        with ws_client.connect(f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream",
                               open_timeout=10, max_size=None) as ws:
            msg = ws.recv(timeout=60)
            assert wire.decode(msg)[0]["index"] == 0
            os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Application shutdown complete" in proc.stdout.read()
