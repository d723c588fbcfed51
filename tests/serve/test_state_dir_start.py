"""``framekv serve --state-dir D`` (its own process, the CPU) over a folder holding one of
each bad file a hostile run left (tests/state_file_harness.py: headers that are no JSON
object, nesting 200,000 deep, a record acknowledging past its chunks, a FIFO, a
folder, a device, a link to nothing, a sparse file declaring 30 GiB) beside two good
sessions: the server starts (no hang, no failed startup), every bad file is renamed
``.corrupt`` with one log line, and the two sessions resume bit for bit.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
pytest.importorskip("websockets")

import framekv.client as fc  # noqa: E402
from framekv.bench.serve_load import free_port  # noqa: E402
from framekv.engine.serving import StreamScheduler  # noqa: E402
from state_file_harness import bad_files  # noqa: E402
from test_scheduler import alone_chunks, drain  # noqa: E402

#: a limit only a hang reaches (the start itself takes seconds)
START_LIMIT_S = 120
SEEDS, CHUNKS = (31, 32), 5


def good_sessions(folder) -> tuple[dict, StreamScheduler]:
    """Two sessions saved in ``folder`` by a scheduler of `framekv serve`'s model (two
    chunks made, the first acknowledged): seed -> id; and the scheduler."""
    sched = StreamScheduler("tiny", max_sessions=2, device="cpu", use_graphs=False)
    streams = [sched.open_session(seed=seed, chunks=CHUNKS) for seed in SEEDS]
    sched.step()
    drain(sched, streams, {})
    sched.step()
    assert sorted(sched.save_sessions(folder)) == sorted(s.id for s in streams)
    return {s.seed: s.id for s in streams}, sched


def test_a_start_over_every_bad_file_resumes_the_good_sessions_bit_for_bit(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    ids, sched = good_sessions(state)
    try:
        want = {seed: alone_chunks(sched, seed, CHUNKS) for seed in SEEDS}
        wrong = bad_files(state, (state / f"{ids[SEEDS[0]]}.session").read_bytes())
    finally:
        sched.close()
    port, log_path = free_port(), tmp_path / "serve.log"
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "framekv.tools.cli", "serve", "--device", "cpu",
             "--output", "latents", "--max-sessions", "4", "--slots", "1", "--port", str(port),
             "--state-dir", str(state)],
            stdout=log, stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if k != "FRAMEKV_TOKEN"})
    url = f"http://127.0.0.1:{port}"
    try:
        while not _up(url):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() - t0 < START_LIMIT_S, log_path.read_text()[-3000:]
            time.sleep(0.1)
        print(f"framekv serve started over {len(wrong)} bad files in "
              f"{time.monotonic() - t0:.1f} s")
        assert sorted(p.name for p in state.iterdir() if p.name.endswith(".corrupt")) == \
            sorted(f"{name}.corrupt" for name in wrong)
        text = log_path.read_text()
        for name in wrong:
            assert text.count(f"corrupt session file renamed {name}.corrupt, ") == 1, name
        assert "Traceback" not in text and "startup failed" not in text
        assert not [p for p in state.iterdir() if p.name.endswith(".session")]   # all read
        with fc.Client(url) as client:
            for seed in SEEDS:
                got = list(client.session(ids[seed], after=0).stream(timeout=60))
                assert [c.index for c in got] == list(range(1, CHUNKS)), seed
                for c in got:
                    assert torch.equal(c.latents, want[seed][c.index]), (seed, c.index)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _up(url) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
