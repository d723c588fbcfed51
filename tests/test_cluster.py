"""``framekv serve --replicas 2`` on a local Ray cluster (tiny preset, fp32, the CPU),
real HTTP and WebSocket clients on 127.0.0.1: four sessions spread over the replicas;
one moved mid-stream, then a replica drained (``framekv cluster drain``), then the
replica holding every session killed (SIGKILL) while they stream (the drained one, the
only other, takes them); one of them read by long poll, the others over their sockets.
Autoscaling up and down on the sessions open. Every session's chunks 0..N arrive once
each, equal byte for byte to the same seed's on one single-process server of the same
flags (one slot: every step a batch of one).
And the command's refusals: a replica that cannot start, bad cluster options.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

import framekv.client as fc  # noqa: E402
from framekv.bench.serve_load import free_port, stop_server, wait_serving  # noqa: E402

CHUNKS = 12


def replicas_of(url) -> list:
    """GET /v1/cluster/replicas, or [] while the ingress answers no 200."""
    r = httpx.get(f"{url}/v1/cluster/replicas", timeout=5)
    return r.json() if r.status_code == 200 else []


@contextlib.contextmanager
def cluster(tmp_path, *extra, replicas=2, scale=None):
    """``framekv serve --replicas`` (or ``scale``'s flags) in its own process: its URL
    once ``replicas`` replicas are up."""
    port, log = free_port(), open(tmp_path / "cluster.log", "w")
    scale = ["--replicas", str(replicas)] if scale is None else scale
    proc = subprocess.Popen(
        [sys.executable, "-m", "framekv.tools.cli", "serve", *scale,
         "--device", "cpu", "--output", "latents", "--max-sessions", "4", "--slots", "1",
         "--queue-chunks", "3", "--port", str(port), "--state-dir", str(tmp_path / "state"),
         "--checkpoint-every", "1", *extra], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, lambda: len(replicas_of(url)) == replicas, log.name, 600)
        yield url, proc
    finally:
        stop_server(proc, 90)
        log.close()


def replicas(url) -> dict:
    return {r["id"]: r for r in httpx.get(f"{url}/v1/cluster/replicas", timeout=30).json()}


def reader(url, sid, got, errors, transport="websocket"):
    """Stream session ``sid`` to its end over ``transport``, each chunk's (index,
    payload) into ``got``."""
    try:
        with fc.Client(url, timeout=60, transport=transport) as client:
            s = client.session(sid)
            for chunk in s.stream(timeout=180):
                got.append((chunk.index, bytes(chunk.payload)))
            assert s.end["state"] == "done", s.end
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def wait_until(what, limit=180.0):
    deadline = time.monotonic() + limit
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sessions_move_drain_and_survive_a_killed_replica(tmp_path):
    with cluster(tmp_path) as (url, proc):
        with fc.Client(url) as client:
            sids = [client.create(seed=300 + i, chunks=CHUNKS).id for i in range(4)]
        assert sorted(r["sessions"] for r in replicas(url).values()) == [2, 2]
        got, errors = {sid: [] for sid in sids}, []
        threads = [threading.Thread(target=reader, args=(url, sid, got[sid], errors, transport))
                   for sid, transport in zip(sids, ["websocket"] * 3 + ["poll"])]
        for t in threads:
            t.start()
        wait_until(lambda: len(got[sids[0]]) >= 3)
        before = httpx.get(f"{url}/v1/sessions/{sids[0]}", timeout=30).json()["replica"]
        r = httpx.post(f"{url}/v1/sessions/{sids[0]}/move", json={}, timeout=60)
        assert r.status_code == 200 and r.json()["bytes"] > 0, r.text
        # GET names the replica that holds it: the one it left, then the one it went to
        assert (r.json()["from"], r.json()["to"]) == (
            before, httpx.get(f"{url}/v1/sessions/{sids[0]}", timeout=30).json()["replica"])

        wait_until(lambda: min(len(g) for g in got.values()) >= 5)
        first = min(replicas(url))
        out = subprocess.run([sys.executable, "-m", "framekv.tools.cli", "cluster", "drain",
                              first, "--url", url], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        after = replicas(url)
        assert after[first]["draining"] and after[first]["sessions"] == 0

        wait_until(lambda: min(len(g) for g in got.values()) >= 7)
        holder = next(r for rid, r in after.items() if rid != first)
        os.kill(holder["pid"], signal.SIGKILL)            # every session is there
        for t in threads:
            t.join(timeout=300)
        assert not errors, errors
    want = single_server(tmp_path, [300 + i for i in range(4)])
    for i, sid in enumerate(sids):
        assert [k for k, _ in got[sid]] == list(range(CHUNKS)), sid
        assert [payload for _, payload in got[sid]] == want[i], sid


def test_autoscaling_follows_the_sessions_open(tmp_path):
    """One replica to start; one open session at one per replica asks for a second
    (floor(1 / 1) + 1), where the next session goes; none open, back to one."""
    scale = ["--min-replicas", "1", "--max-replicas", "2", "--target-sessions", "1"]
    with cluster(tmp_path, scale=scale, replicas=1) as (url, proc):
        with fc.Client(url) as client:
            first = client.create(seed=1, paused=True)
            wait_until(lambda: len(replicas_of(url)) == 2, limit=600)
            second = client.create(seed=2, paused=True)
            assert sorted(r["sessions"] for r in replicas(url).values()) == [1, 1]
            first.close()
            second.close()
            wait_until(lambda: len(replicas_of(url)) == 1, limit=600)


def single_server(tmp_path, seeds) -> list[list[bytes]]:
    """The chunk payloads of each seed on one ``framekv serve`` of the same flags."""
    port, log = free_port(), open(tmp_path / "single.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "framekv.tools.cli", "serve", "--device", "cpu", "--output",
         "latents", "--max-sessions", "4", "--slots", "1", "--queue-chunks", "3", "--port",
         str(port)], stdout=log, stderr=subprocess.STDOUT,
        # Ray gives a replica of --replica-cpus 1 one thread; the CPU's sums follow
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200,
                     log.name, 240)
        with fc.Client(url) as client:
            return [[c.payload for c in client.create(seed=seed, chunks=CHUNKS).stream(
                timeout=120)] for seed in seeds]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def test_a_replica_that_cannot_start_is_one_line_naming_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "framekv.tools.cli", "serve", "--replicas",
                          "1", "--device", "cpu", "--model", "wan-diffusers", "--preset",
                          "nosuch", "--port", str(free_port()), "--state-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=600)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith("framekv serve: error: the cluster did not "
                                                   "start"), out.stderr[-2000:]
    assert "nosuch" in last


def test_bad_cluster_options_are_one_line_before_ray_starts():
    for argv, words in ((["--replicas", "2", "--min-replicas", "1", "--max-replicas", "2"],
                         "no --replicas"),
                        (["--min-replicas", "3", "--max-replicas", "2"],
                         "--min-replicas must be at most --max-replicas"),
                        (["--replicas", "0"], "--replicas")):
        out = subprocess.run([sys.executable, "-m", "framekv.tools.cli", "serve", *argv,
                              "--device", "cpu"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and words in out.stderr, (argv, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
