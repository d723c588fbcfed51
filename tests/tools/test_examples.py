"""The examples run as shipped: the cached-attention rollout, the embedded scheduler, and
the client against a real `framekv serve` (its own process, as the example's doc starts
it). Each ends every session it opened, also when it fails or is interrupted (Ctrl-C).
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def test_cached_attention_example_runs_and_matches_reference():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "cached_attention.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 6 and lines[-1].startswith("chunk 5: committed 192 tokens")
    errors = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert max(errors) < 1e-5


@pytest.mark.parametrize("model", ["reference", "wan-diffusers"])
def test_streaming_example_embeds_the_scheduler(model):
    """Both models' chunks in one layout: frame numbers read from [C, F, H, W]."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "streaming.py"), "--device",
                          "cpu", "--model", model], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    for seed in (1, 2, 3):
        mine = [line for line in lines if line.startswith(f"session {seed}:")]
        assert mine[:3] == [f"session {seed}: chunk {i}, frames {2 * i}..{2 * i + 1} of 4x8x8, "
                            f"batch of {line.rsplit(' ', 1)[1]}" for i, line in enumerate(mine[:3])]
        assert mine[-1] == f"session {seed}: done"
    assert len((ROOT / "examples" / "streaming.py").read_text().splitlines()) < 40


def test_the_streaming_example_stops_its_loop_when_interrupted():
    """Ctrl-C mid-stream: the GPU loop stops and the process ends (no loop thread left
    running it forever)."""
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "streaming.py"), "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout.readline().startswith("session 1: chunk 0"), proc.stderr.read()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``framekv serve --preset tiny --max-sessions 2`` in its own process: its URL."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from framekv.bench.serve_load import free_port, stop_server, wait_serving

    port, log = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "framekv.tools.cli", "serve", "--preset",
                                 "tiny", "--max-sessions", "2", "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, lambda: httpx.get(f"{url}/health").status_code == 200, str(log), 300)
        yield url
    finally:
        stop_server(proc, 60)
    assert proc.returncode == 0, log.read_text()


def sessions_open(url) -> int:
    import httpx

    deadline = time.monotonic() + 15       # a DELETE answered: its session gone at once
    while (n := httpx.get(f"{url}/health").json()["sessions"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_the_client_example_streams_from_a_real_server_and_closes_its_sessions(server):
    """Two sessions fit (the third is answered 503, which the example says and goes on),
    the prompt change takes within session 1, and none is left open."""
    out = subprocess.run([sys.executable, str(EXAMPLES / "client.py"), "--url", server],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "session 3: not opened, the server is full (all 2 sessions are open)"
    for seed in (1, 2):
        mine = [ln for ln in lines if ln.startswith(f"session {seed}: chunk")]
        assert [ln.split(", prompt")[0] for ln in mine] == [
            f"session {seed}: chunk {i} of [2, 64, 64, 3]" for i in range(8)]  # frames
        assert f"session {seed}: done" in lines
    applies = int(next(ln for ln in lines if "from chunk" in ln).rsplit(" ", 1)[1])
    versions = [ln.endswith("version 1") for ln in lines if ln.startswith("session 1: chunk")]
    assert 1 < applies < 8 and versions == [i >= applies for i in range(8)]
    assert sessions_open(server) == 0


def test_the_client_example_closes_its_sessions_when_interrupted(server):
    # sessions too long to end on their own: both are open at any point of the stream
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "client.py"), "--url", server,
                             "--chunks", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while "chunk 2" not in (line := proc.stdout.readline()):       # mid-stream, both open
        assert line, proc.stderr.read()
    import httpx

    assert httpx.get(f"{server}/health").json()["sessions"] == 2
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert sessions_open(server) == 0
