"""Streams that survive: real servers on 127.0.0.1 (CPU), real clients.

- No route waits on a step: with a step of 0.5 s and 4 sessions streaming, /health,
  /metrics and GET /v1/sessions/{id} answer within 50 ms at p99.
- A client that drops reconnects by id (``after``: the last index it has) and gets the
  next chunks; so after a drop and a SIGTERM restart over ``--state-dir``, and after a
  SIGKILL with ``--checkpoint-every 1``: chunks 0..N arrive once each and equal, byte
  for byte, the same seed run uninterrupted, over a WebSocket and over the long poll.
  Both samplers: euler (the reference model) and self_forcing (the tiny Wan), whose
  fresh noise is the stream's own.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("websockets")

import framekv.client.sessions as fc  # noqa: E402
from framekv.engine.serving import StreamScheduler  # noqa: E402
from serve_harness import create, serving  # noqa: E402

#: the served models: their `framekv serve` arguments by sampler
MODELS = {"euler": ["tiny"],
          "self_forcing": ["--model", "wan-diffusers", "--config", "tiny",
                           "--sampler", "self_forcing"]}
CHUNKS = 6
#: the restarted servers' flags: a checkpoint every chunk, one slot
KEPT = ("--checkpoint-every", "1", "--slots", "1")


def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_no_route_waits_on_a_slow_step(monkeypatch):
    sched = StreamScheduler("tiny", max_sessions=4, device="cpu", use_graphs=False,
                            queue_chunks=2)
    real = sched.runner.step_rows

    def slow(*args, **kw):                 # a GPU step of 0.5 s, the GIL free meanwhile
        time.sleep(0.5)
        return real(*args, **kw)
    monkeypatch.setattr(sched.runner, "step_rows", slow)
    with serving(sched) as (_, port):
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=30) as http:
            ids = [create(http, seed=i) for i in range(4)]
            stop = threading.Event()

            def reader(sid):
                with fc.Client(url) as client:
                    for _ in client.session(sid).stream(timeout=60):
                        if stop.is_set():
                            return
            threads = [threading.Thread(target=reader, args=(sid,), daemon=True) for sid in ids]
            for t in threads:
                t.start()
            while sched.metrics()["steps"] < 2:              # streaming, steps under way
                time.sleep(0.05)
            waits = {"/health": [], "/metrics": [], f"/v1/sessions/{ids[0]}": []}
            t_end = time.monotonic() + 4.0                   # eight slow steps
            while time.monotonic() < t_end:
                for path in waits:
                    t0 = time.perf_counter()
                    assert http.get(path).status_code == 200
                    waits[path].append(time.perf_counter() - t0)
                time.sleep(0.02)
            stop.set()
    p99 = {path: _percentile(w, 0.99) for path, w in waits.items()}
    assert all(len(w) >= 40 for w in waits.values())
    assert max(p99.values()) < 0.05, p99


# --- restarts ---------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(args, state_dir, tmp_path, *extra):
    """``framekv serve`` in its own process over ``state_dir``: its URL."""
    port = _free_port()
    log = open(tmp_path / f"serve-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "framekv.tools.cli", "serve", *args,
                             "--device", "cpu", "--output", "latents", "--max-sessions", "2",
                             "--port", str(port), "--state-dir", str(state_dir), *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / f"serve-{port}.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


def take(session, n: int) -> list:
    """The next ``n`` chunks of a session (acknowledged as they come)."""
    out = []
    for chunk in session.stream(timeout=120):
        out.append(chunk)
        if len(out) == n:
            break
    return out


def uninterrupted(args, tmp_path) -> list[bytes]:
    """The payloads of seed 5's chunks 0..CHUNKS-1 on one server, never interrupted."""
    with server(args, tmp_path / "plain", tmp_path) as (url, _):
        with fc.Client(url) as client:
            s = client.create(seed=5, chunks=CHUNKS)
            return [c.payload for c in s.stream(timeout=120)]


@pytest.mark.parametrize("sampler", sorted(MODELS))
def test_a_stream_survives_drops_a_sigterm_restart_and_a_sigkill(sampler, tmp_path):
    """Two sessions of one seed, one read over its socket, one by long poll, on one
    slot (a step of both would be a batch of two: the Wan model's CPU sums follow the
    batch size)."""
    if sampler == "self_forcing":
        pytest.importorskip("diffusers")
    args, state = MODELS[sampler], tmp_path / "state"
    want = uninterrupted(args, tmp_path)
    got, ids = {"websocket": [], "poll": []}, {}
    with server(args, state, tmp_path, *KEPT) as (url, proc):
        for transport, chunks in got.items():
            with fc.Client(url, transport=transport) as client:
                s = client.create(seed=5, chunks=CHUNKS)
                ids[transport] = s.id
                chunks += take(s, 1)
                s.reconnect()                              # a drop: the same session again
                chunks += take(s, 1)
        os.kill(proc.pid, signal.SIGTERM)                  # drained and saved
        assert proc.wait(timeout=60) == 0
    with server(args, state, tmp_path, *KEPT) as (url, proc):
        for transport, chunks in got.items():
            with fc.Client(url, transport=transport) as client:
                chunks += take(client.session(ids[transport], after=chunks[-1].index), 2)
        proc.kill()                                        # SIGKILL: no drain, no save
        proc.wait(timeout=60)
    with server(args, state, tmp_path, *KEPT) as (url, _):
        for transport, chunks in got.items():
            with fc.Client(url, transport=transport) as client:
                s = client.session(ids[transport], after=chunks[-1].index)
                chunks += list(s.stream(timeout=120))
                assert s.end["state"] == "done", (transport, s.end)
    for transport, chunks in got.items():
        assert [c.index for c in chunks] == list(range(CHUNKS)), (transport, "lost, repeated")
        assert [c.payload for c in chunks] == want, transport
