"""`framekv serve --state-dir` and ``--slots``, on the CPU: a real server on 127.0.0.1
(`DrainingServer`, as `framekv serve` runs it) with more sessions than slots. Its
shutdown (the SIGTERM path: uvicorn's exit flag, the drain, the lifespan's end) sends
a socket its queued chunks and a resumable end, then writes every open session to the
folder; a second server over the folder opens them again under their ids, and clients
that reconnect go on from their next chunk, undelivered chunks first, every chunk equal
bit for bit to its seed run without the restart. A corrupt file is logged and renamed,
one of another geometry logged (naming the difference) and left; /metrics and
/v1/info show the slots and the swaps; bad options are usage errors.
"""
from __future__ import annotations

import contextlib
import json
import logging
import pathlib
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
from serve_harness import serving  # noqa: E402
from test_scheduler import alone_chunks  # noqa: E402

TOKEN = "state-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TINY = pathlib.Path(__file__).resolve().parents[2] / "specs" / "presets" / "tiny.toml"


def scheduler(preset="tiny", sessions=4, slots=2) -> StreamScheduler:
    return StreamScheduler(preset, max_sessions=sessions, slots=slots, device="cpu",
                           use_graphs=False, queue_chunks=2)


def read(ws, count=None, limit=30.0):
    """((index, latents) of each chunk message, the end message or None) until the end
    message or ``count`` chunks."""
    chunks, deadline = [], time.monotonic() + limit
    while count is None or len(chunks) < count:
        msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(msg, str):
            if json.loads(msg)["type"] == "end":
                return chunks, json.loads(msg)
            continue
        head, payload = wire.decode(msg)
        latents = torch.frombuffer(bytearray(payload), dtype=torch.float32)
        chunks.append((head["index"], latents.view(head["shape"])))
        with contextlib.suppress(ConnectionClosed):   # a draining server closes first
            ws.send(json.dumps({"type": "ack", "index": head["index"]}))
    return chunks, None


def wait_for(cond, limit=30.0):
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def url(port, sid, after=None):
    tail = "" if after is None else f"&after={after}"
    return f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream?token={TOKEN}{tail}"


def foreign_file(tmp_path: pathlib.Path, into: pathlib.Path) -> str:
    """A session file of the tiny model with a 4-frame window (another pool geometry)."""
    preset = tmp_path / "tiny-w4.toml"
    preset.write_text(TINY.read_text().replace('name = "tiny"\ndescription', 'name = "tiny-w4"'
                                               '\ndescription', 1)
                      .replace("window_frames = 3", "window_frames = 4"))
    other = scheduler(str(preset), sessions=1, slots=1)
    try:
        s = other.open_session(seed=1)
        other.step()
        assert other.save_sessions(into) == [s.id]
    finally:
        other.close()
    return s.id


def test_sessions_survive_a_restart_and_go_on_bit_for_bit(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="framekv")
    state = tmp_path / "state"
    sched = scheduler()
    seen = {}
    with serving(sched, token=TOKEN, state_dir=state) as (srv, port):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30) as http:
            ids = {name: http.post("/v1/sessions", json=body).json()["id"] for name, body in (
                ("live", {"seed": 11}), ("unread", {"seed": 12, "chunks": 4}),
                ("paused", {"seed": 13, "chunks": 3, "paused": True}),
                ("other", {"seed": 14, "chunks": 4}))}
            info = http.get("/v1/info").json()
        assert (info["max_sessions"], info["slots"]) == (4, 2)
        with ws_client.connect(url(port, ids["live"]), max_size=None) as ws:
            seen["live"], _ = read(ws, 2)
            by_id = {k: sched.sessions[v] for k, v in ids.items()}
            wait_for(lambda: by_id["unread"].chunks == by_id["other"].chunks == 2)
            assert sched.metrics()["swap_outs"] >= 1          # a full queue gave its slot up
            srv.should_exit = True                            # what SIGTERM sets
            rest, end = read(ws)
        seen["live"] += rest
    assert [i for i, _ in seen["live"]] == list(range(len(seen["live"])))
    assert end == {"type": "end", "state": "closed", "error": None, "reason": "shutdown",
                   "resumable": True}
    assert sorted(p.name for p in state.iterdir()) == sorted(f"{v}.session" for v in ids.values())
    assert "saved 4 of 4 open sessions" in caplog.text

    # names that sort first and last: the file that does not fit takes no room, so
    # the corrupt one is still reached with one place left
    (state / "~corrupt.session").write_bytes(b"not a session file" * 8)
    foreign = foreign_file(tmp_path, state)
    (state / f"{foreign}.session").rename(state / "0-foreign.session")
    again = scheduler(sessions=5)                             # the four and one more
    caplog.clear()
    with serving(again, token=TOKEN, state_dir=state) as (srv, port):
        assert sorted(again.sessions) == sorted(ids.values())
        assert {p.name for p in state.iterdir()} == {"~corrupt.session.corrupt",
                                                     "0-foreign.session"}
        assert "corrupt session file renamed ~corrupt.session.corrupt, not opened: " \
               f"{state / '~corrupt.session'}: header length" in caplog.text
        assert f"session file left as it is, not opened: {state}/0-foreign.session: the " \
               "session does not fit this scheduler's runner: pool.geometry.window_tokens: " \
               "the state has 64, the runner 48" in caplog.text
        got = {}
        last = seen["live"][-1][0]               # the client says what it has
        with ws_client.connect(url(port, ids["live"], after=last), max_size=None) as ws:
            got["live"], _ = read(ws, 3)
        for name in ("unread", "other", "paused"):
            with ws_client.connect(url(port, ids[name]), max_size=None) as ws:
                if name == "paused":
                    ws.send(json.dumps({"type": "resume"}))
                got[name], end = read(ws)
            assert end["state"] == "done", end
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).text
    n = len(seen["live"])
    assert [i for i, _ in got["live"]] == [n, n + 1, n + 2]      # no gap, no repeat
    want = alone_chunks(again, 11, n + 3)
    for i, x in seen["live"] + got["live"]:
        assert torch.equal(x, want[i]), i
    for name, seed, count in (("unread", 12, 4), ("other", 14, 4), ("paused", 13, 3)):
        assert [i for i, _ in got[name]] == list(range(count)), name   # undelivered first
        for (i, x), w in zip(got[name], alone_chunks(again, seed, count)):
            assert torch.equal(x, w), (name, i)
    for line in ("# TYPE framekv_pool_slots gauge", "framekv_pool_slots 2.0",
                 "# HELP framekv_sessions_swapped ", "# TYPE framekv_swap_ins_total counter",
                 "# TYPE framekv_swap_seconds histogram", "# TYPE framekv_swapped_bytes gauge",
                 "# TYPE framekv_failed_swaps_total counter"):
        assert line in metrics, line
    assert "framekv_swap_ins_total 0.0" not in metrics                # restored streams


@pytest.mark.parametrize("argv, words", [
    (["--max-sessions", "2", "--slots", "3"], "--slots must be at most --max-sessions (2), got 3"),
    (["--state-dir", "FILE"], "state_dir must be a folder the server can write"),
])
def test_slots_and_state_dir_options_are_checked_before_anything_is_built(
        tmp_path, capsys, argv, words):
    from framekv.tools.cli import main as cli

    (tmp_path / "FILE").write_text("")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    assert cli(["serve", "--device", "cpu", *argv]) == 2
    assert words in capsys.readouterr().err
