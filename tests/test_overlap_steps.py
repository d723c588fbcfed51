"""`StreamScheduler(overlap=True)` on the CPU: a step's chunks queued by the next step
(`framekv.engine.serving.overlap`), as on a GPU where the decode runs beside the next
step's transformer. Against the same sessions stepped plainly: every chunk equal
(latents, frames, frame numbers, prompt versions), over swaps and a prompt change; a
client that reads nothing gets no more than ``queue_chunks`` made; an export, a hold
and a close first deliver the step in flight; a decode that fails fails its streams
only; with checkpoints a step is plain.
"""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from framekv.engine.serving import Checkpoints, StreamScheduler  # noqa: E402


@pytest.fixture(scope="module")
def wan():
    from framekv.engine.wan import TextEncoder, build_model, preset_sizes
    from framekv.engine.wan.vae import build_vae

    sizes = preset_sizes("tiny")
    text = TextEncoder.from_config("tiny", max_tokens=sizes["prompt_tokens"], device="cpu")
    return build_model("tiny", device="cpu"), text, build_vae("tiny", device="cpu"), sizes


def scheduler(wan, overlap, slots=2, queue_chunks=8):
    from framekv.engine.wan import StreamingVAEDecoder, WanRollout

    model, text, vae, sizes = wan
    return StreamScheduler(max_sessions=3, slots=slots, queue_chunks=queue_chunks,
                           overlap=overlap, runner_factory=functools.partial(
                               WanRollout, model, use_graphs=False, text_encoder=text, **sizes),
                           decoder_factory=lambda n: StreamingVAEDecoder(vae, sequences=n))


def in_flight(sched) -> bool:
    """Whether a step's chunks are still being decoded."""
    return sched.overlap is not None and len(sched.overlap) > 0


def run(sched, budgets, change_at=2):
    """Sessions of ``budgets`` over the scheduler's slots (swaps when more), a prompt
    change once session 0 has ``change_at`` chunks (None: none), clients reading as
    they go."""
    ss = [sched.open_session(seed=60 + i, chunks=n, prompt="a red fox")
          for i, n in enumerate(budgets)]
    got, changed = {s.id: [] for s in ss}, False
    for _ in range(200):
        if not changed and change_at is not None and ss[0].chunks >= change_at:
            sched.set_prompt(ss[0].id, "a blue whale")
            changed = True
        made = sched.step()
        for s in ss:
            while (c := sched.next_chunk(s.id, 0)) is not None:
                got[s.id].append(c)
                sched.ack(s.id, c.index)
        if made == 0 and all(s.finished for s in ss) and not in_flight(sched):
            break
    return [got[s.id] for s in ss]


def test_overlapped_steps_give_every_chunk_a_plain_step_gives(wan):
    plain, lapped = scheduler(wan, False), scheduler(wan, True)
    try:
        assert plain.overlap is None and lapped.overlap is not None
        assert not lapped.decode_stage.lane.overlap              # a CPU: it decodes at once
        s = lapped.open_session(seed=1, chunks=1)
        assert lapped.step() == 0 and s.inflight == 1 and s.chunks == 1   # made, in flight
        assert lapped.next_chunk(s.id, 0) is None
        assert lapped.step() == 1 and s.inflight == 0 and s.finished      # queued next
        lapped.close_session(s.id)
        want, got = run(plain, [4, 5, 3]), run(lapped, [4, 5, 3])
        assert lapped.pool.counts["swap_outs"] > 0                       # 3 over 2 slots
        for w, g in zip(want, got):
            assert [c.index for c in g] == list(range(len(w))) and len(g) == len(w)
            for a, b in zip(w, g):
                assert torch.equal(a.latents, b.latents) and torch.equal(a.video, b.video)
                assert (a.video_frame0, a.prompt_version) == (b.video_frame0, b.prompt_version)
        assert {c.prompt_version for c in got[0]} == {0, 1}          # the change took
        m, first = lapped.metrics(), 5                    # the one-chunk session's frames
        assert m["chunks"] == sum(map(len, got)) + 1 and m["video_frames"] == first + sum(
            c.video.shape[0] for g in got for c in g)
    finally:
        plain.close()
        lapped.close()


def test_a_client_that_reads_nothing_gets_queue_chunks_made(wan):
    sched = scheduler(wan, True, queue_chunks=2)
    try:
        s = sched.open_session(seed=5)
        for _ in range(8):
            sched.step()
            assert len(s.delivery.queue) + s.inflight <= 2
        assert s.chunks == 2 and len(s.delivery.queue) == 2 and s.inflight == 0
    finally:
        sched.close()


def test_an_export_hold_and_close_deliver_the_step_in_flight(wan, tmp_path):
    a, b = scheduler(wan, True), scheduler(wan, True)
    ref = scheduler(wan, False)
    try:
        want = run(ref, [4], change_at=None)[0]
        s = a.open_session(seed=60, chunks=4, prompt="a red fox")
        a.step()
        a.step()                                  # chunk 0 queued, chunk 1 in flight
        assert s.inflight == 1 and len(s.delivery.queue) == 1
        state = a.export_session(s.id)            # a request: the step in flight first
        assert s.inflight == 0 and state.chunks == 2
        sid = b.import_session(state)
        got = []
        while not b.sessions[sid].finished or in_flight(b):
            b.step()
            while (c := b.next_chunk(sid, 0)) is not None:
                got.append(c)
                b.ack(sid, c.index)
        assert [c.index for c in got] == [0, 1, 2, 3]
        assert all(torch.equal(x.video, y.video) for x, y in zip(got, want))
        t = a.open_session(seed=7, chunks=3)
        a.step()
        a.hold()                                   # a server's drain: nothing in flight
        assert t.inflight == 0 and len(t.delivery.queue) == 1 and a.step() == 0
    finally:
        for x in (a, b, ref):
            x.close()


def test_a_failing_decode_fails_its_streams_only(wan, monkeypatch):
    sched = scheduler(wan, True, slots=3)
    try:
        a, b = sched.open_session(seed=51), sched.open_session(seed=52, chunks=3)
        sched.step()
        sched.pause(b.id)
        real = sched.decoder.decode
        monkeypatch.setattr(sched.decoder, "decode",
                            lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected")))
        sched.step()
        monkeypatch.setattr(sched.decoder, "decode", real)
        assert a.state == "failed" and "injected" in a.error and not in_flight(sched)
        sched.pause(b.id, False)
        while not b.finished or in_flight(sched):
            sched.step()
        assert b.state == "done" and b.chunks == 3 and sched.metrics()["failed_steps"] == 1
    finally:
        sched.close()


def test_with_checkpoints_a_step_is_plain(wan, tmp_path):
    sched = scheduler(wan, True)
    try:
        s = sched.open_session(seed=9, chunks=3)
        sched.step()                               # in flight
        sched.checkpoints = Checkpoints(tmp_path, 1)
        assert sched.step() == 2 and s.inflight == 0  # the one in flight, then a plain one
        sched.checkpoints.flush()
        assert (tmp_path / f"{s.id}.session").exists()
    finally:
        sched.close()


def test_a_request_to_a_running_loop_sees_the_step_in_flight_delivered(wan):
    import threading
    import time

    a, b = scheduler(wan, True, queue_chunks=2), scheduler(wan, True)
    stop = threading.Event()
    loop = threading.Thread(target=a.run, args=(stop,), daemon=True)
    try:
        s = a.open_session(seed=60, chunks=6)
        loop.start()
        deadline = time.monotonic() + 60
        while s.chunks < 2:                      # chunk 1 made: queued or in flight
            assert time.monotonic() < deadline
            time.sleep(0.01)
        state = a.export_session(s.id)           # through the loop's requests
        assert s.inflight == 0 and len(state.extra["queue"]) == state.chunks >= 2
        sid = b.import_session(state)
        got = []
        while not b.sessions[sid].finished or in_flight(b):
            b.step()
            while (c := b.next_chunk(sid, 0)) is not None:
                got.append(c.index)
                b.ack(sid, c.index)
        assert got == list(range(6))
    finally:
        stop.set()
        loop.join(30)
        a.close()
        b.close()


@pytest.mark.gpu
def test_on_cuda_a_step_decodes_beside_the_next_and_gives_the_same_chunks():
    from framekv.engine.wan import (StreamingVAEDecoder, TextEncoder, WanRollout, build_model,
                                    preset_sizes)
    from framekv.engine.wan.vae import build_vae

    sizes = preset_sizes("tiny")
    parts = (build_model("tiny", device="cuda"),
             TextEncoder.from_config("tiny", max_tokens=sizes["prompt_tokens"], device="cuda"),
             build_vae("tiny", device="cuda"), sizes)

    def make(overlap):
        model, text, vae, sizes = parts
        return StreamScheduler(max_sessions=3, slots=2, queue_chunks=8, overlap=overlap,
                               runner_factory=functools.partial(WanRollout, model,
                                                                text_encoder=text, **sizes),
                               decoder_factory=lambda n: StreamingVAEDecoder(vae, sequences=n))

    plain, lapped = make(False), make(None)
    try:
        assert lapped.decode_stage.lane.overlap and plain.overlap is None
        want, got = run(plain, [4, 5, 3]), run(lapped, [4, 5, 3])
        for w, g in zip(want, got):
            assert [c.index for c in g] == [c.index for c in w]
            assert all(torch.equal(a.video, b.video) and torch.equal(a.latents, b.latents)
                       for a, b in zip(w, g))
    finally:
        plain.close()
        lapped.close()


def test_serve_no_overlap_reaches_the_scheduler(monkeypatch):
    import framekv.engine.serving as serving
    from framekv.tools.cli import build_parser
    from framekv.tools.serve.command import build_scheduler, checked_options

    seen = []
    monkeypatch.setattr(serving, "StreamScheduler", lambda *a, **k: seen.append(k["overlap"]))
    for flags, want in (([], None), (["--no-overlap"], False)):
        args = build_parser().parse_args(["serve", "--device", "cpu", *flags])
        build_scheduler(args, checked_options(args))
        assert seen[-1] is want, flags
