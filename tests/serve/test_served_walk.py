"""docs/DESIGN.md's walk of one served Wan chunk is true: a real server (tiny Wan, its
text encoder and VAE decoder, CPU) streams to a real WebSocket client under a profiler
(`threading.setprofile`), and every non-kernel file of the package whose Python runs
for a chunk must be named by the walk.

A chunk on CUDA is one graph replay of the transformer and one per decoder stage: the
Python inside them runs at capture only. On a CPU the same callables run eagerly, so
the profiler marks what runs inside them (`CapturedGraph._call_eagerly`, a decoder's
chunk program called by `DecoderRows._run`) as graph work: that may be named by the
walk or by its list of files that run at capture only; everything outside them must be
in the walk itself, which names at most 24 files. Every file the walk names must run
(inside or outside a graph), so a walk entry left behind by a change fails too. The
kernels (``ops/``) are left out: they are what the walk's files launch.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("diffusers")
httpx = pytest.importorskip("httpx")
ws_client = pytest.importorskip("websockets.sync.client")

from serve_harness import ack, serving  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTION = "### One served Wan chunk"
TOKEN = "walk-token"
#: the most files the walk may name
MOST = 24


def walk_lists() -> tuple[list[str], list[str]]:
    """(the walk's files in order, the files named as running at capture only): the
    first and second code blocks of DESIGN.md's section."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ")]
    blocks = re.findall(r"```\n(.*?)```", section, re.S)
    walk = re.findall(r"^\s*\d+ ([\w/]+\.py)", blocks[0], re.M)
    capture = re.findall(r"([\w/]+\.py)", blocks[1])
    return walk, capture


class Tracer:
    """Package files entered per thread while ``on``, apart inside and outside graph
    work (module doc); what the server's timers run (`TIMERS`: on their own clock, not
    a chunk's) left out."""

    def __init__(self):
        self.on = False
        self.outside: set[str] = set()
        self.inside: set[str] = set()
        self._depth = threading.local()

    def __call__(self, frame, event, arg):
        if event not in ("call", "return"):
            return
        kind = _kind(frame)
        graph, timer = getattr(self._depth, "graph", 0), getattr(self._depth, "timer", 0)
        step = 1 if event == "call" else -1
        graph += step * (kind == "graph")
        timer += step * (kind == "timer")
        self._depth.graph, self._depth.timer = graph, timer
        code = frame.f_code
        if (event == "call" and self.on and not timer
                and code.co_filename.startswith(str(ROOT))):
            rel = str(pathlib.Path(code.co_filename).relative_to(ROOT))
            (self.inside if graph else self.outside).add(rel)


#: the server's timers, (file, function): the idle-session reaper wakes on its own clock
TIMERS = {("tools/serve/app.py", "reap_idle")}


def _kind(frame) -> str | None:
    """"graph" where ``frame`` is graph work's outermost call (an eager stand-in's call
    of its callable, or a decoder's chunk program), "timer" for a timer, else None."""
    code, caller = frame.f_code, frame.f_back
    if code.co_name == "_call_eagerly" and code.co_filename.endswith("graphs/captured.py"):
        return "graph"
    if (caller is not None and caller.f_code.co_name == "_run"
            and caller.f_code.co_filename.endswith("engine/wan/coder_rows.py")
            and not code.co_filename.endswith("engine/wan/coder_rows.py")
            and "/graphs/" not in code.co_filename):
        return "graph"
    if any(code.co_name == name and code.co_filename.endswith(f) for f, name in TIMERS):
        return "timer"
    return None


def kernel(rel: str) -> bool:
    return rel.startswith("ops/")


@pytest.fixture(scope="module")
def traced():
    """What a served chunk's Python entered on the CPU (`trace_served`)."""
    return trace_served("cpu")


def trace_served(device: str) -> Tracer:
    """The files a served chunk's Python entered on ``device`` (chunks 2 and 3 of 5:
    the graphs and the decoder's arena are built by then), as a `Tracer`."""
    from framekv.engine.serving import StreamScheduler
    from framekv.tools.serve import wan_factory

    tracer = Tracer()
    threading.setprofile(tracer)
    try:
        parts = wan_factory(argparse.Namespace(config="tiny", preset=None, weights=None,
                                               device=device, cache_dir=None))
        sched = StreamScheduler(max_sessions=1, queue_chunks=1, runner_factory=parts,
                                decoder_factory=parts.decoder)
        with serving(sched, token=TOKEN, output="frames") as (_, port):
            stream_five(port, tracer)
    finally:
        threading.setprofile(None)
    return tracer


def stream_five(port: int, tracer: Tracer) -> None:
    """Five chunks read and acknowledged; the profiler on from chunk 1's arrival to
    chunk 3's."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/sessions", json={"seed": 3, "chunks": 5},
                   headers=headers, timeout=30)
    assert r.status_code == 201, r.text
    url = f"ws://127.0.0.1:{port}/v1/sessions/{r.json()['id']}/stream?token={TOKEN}"
    chunks, deadline = 0, time.monotonic() + 120
    with ws_client.connect(url, open_timeout=10, max_size=None) as ws:
        while True:
            msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(msg, str):
                if json.loads(msg)["type"] == "end":
                    break
                continue
            tracer.on = chunks in (1, 2)
            ack(ws, msg)
            chunks += 1
    assert chunks == 5


def test_the_walk_names_at_most_24_files_that_exist():
    walk, capture = walk_lists()
    assert 10 <= len(walk) <= MOST, walk
    assert len(set(walk)) == len(walk) and not set(walk) & set(capture)
    for rel in walk + capture:
        assert (ROOT / rel).is_file(), rel


def test_every_file_a_served_chunk_runs_outside_a_graph_is_in_the_walk(traced):
    walk, _ = walk_lists()
    stray = sorted(f for f in traced.outside if not kernel(f) and f not in walk)
    assert not stray, f"files a replayed chunk runs that the walk does not name: {stray}"


def test_graph_work_is_named_by_the_walk_or_as_capture_only(traced):
    walk, capture = walk_lists()
    stray = sorted(f for f in traced.inside
                   if not kernel(f) and f not in walk and f not in capture)
    assert not stray, f"files a chunk's graphs run that DESIGN.md does not name: {stray}"


def test_every_file_the_walk_names_runs(traced):
    walk, capture = walk_lists()
    ran = traced.outside | traced.inside
    assert not [f for f in walk if f not in ran], "the walk names files no chunk runs"
    assert not [f for f in capture if f not in ran], "capture-only files no chunk runs"


@pytest.mark.gpu
def test_on_cuda_a_replayed_chunk_runs_the_walk_and_no_graph_python():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    walk, _ = walk_lists()
    tracer = trace_served("cuda")
    assert not tracer.inside, f"eager graph work ran on CUDA: {sorted(tracer.inside)}"
    stray = sorted(f for f in tracer.outside if not kernel(f) and f not in walk)
    assert not stray, f"files a replayed chunk runs that the walk does not name: {stray}"
