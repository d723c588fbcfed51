"""One stream, one step, on the CPU (fp32): a stream leaves one scheduler as one
`StreamState` (`export_session`) and goes on in another (`import_session`) bit for bit,
swapped or not, decoded or not, euler and self_forcing (whose fresh noise is the
stream's own); acknowledgements bound the work; checkpoints are written off the GPU
thread, atomically; the step contract (`StepPlan`, `ChunkRunner.execute`) on its own;
no reader waits on a step; a frames-only scheduler keeps its chunks' latents where they
were made (to the host for an export only); a decoder row that fails to swap fails its
stream alone, stepped plainly or overlapped."""
from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from framekv.engine.serving import Checkpoints, StreamScheduler
from framekv.engine.step import StepPlan, Swap, chunk_renoise
from test_scheduler import _clear, drain


def take(sched, s, n, got):
    """Step until ``s`` (a stream of ``sched``) made ``n`` chunks, its client taking them."""
    while len(got.get(s.id, [])) < n:
        sched.step()
        drain(sched, [s], got)
    return got


@pytest.fixture(scope="module")
def pair():
    """Two schedulers of one model: a stream leaves the first for the second."""
    a = StreamScheduler("tiny", max_sessions=4, slots=2, device="cpu", use_graphs=False)
    b = StreamScheduler("tiny", max_sessions=3, slots=1, device="cpu", use_graphs=False,
                        runner_factory=functools.partial(_runner_like, a))
    yield a, b
    a.close()
    b.close()


def _runner_like(sched, **kw):
    from framekv.engine import Rollout

    return Rollout("tiny", device="cpu", model=sched.runner.model, use_graphs=False, **kw)


@pytest.mark.parametrize("resident", [True, False])
def test_an_exported_stream_goes_on_in_another_scheduler_bit_for_bit(pair, resident):
    a, b = pair
    _clear(a)
    _clear(b)
    moving, other = a.open_session(seed=7, chunks=6), a.open_session(seed=8)
    got = take(a, moving, 2, {})
    if not resident:                       # off the pool first: its parked state leaves
        a.pause(moving.id)
        extra = [a.open_session(seed=9 + i) for i in range(2)]
        while moving.slot is not None:
            a.step()
            drain(a, [other, *extra], {})
    unacked = a.next_chunk(moving.id, 0)    # made, handed out, not acknowledged
    assert unacked is None or unacked.index >= 2
    state = a.export_session(moving.id)
    assert moving.id not in a.sessions and state.extra["session"]["chunks"] == moving.chunks
    assert a.session_info(moving.id) is None
    sid = b.import_session(state)
    assert sid == moving.id and b.sessions[sid].slot is None
    if not resident:
        b.pause(sid, False)
    s = b.sessions[sid]
    take(b, s, 6, got)                                   # every chunk it had left
    assert [c.index for c in got[sid]] == list(range(6)), "lost, repeated, reordered"
    alone = StreamScheduler("tiny", max_sessions=1, device="cpu", use_graphs=False,
                            runner_factory=functools.partial(_runner_like, a))
    try:
        ref = alone.open_session(seed=7, chunks=6)
        want = take(alone, ref, 6, {})[ref.id]
    finally:
        alone.close()
    for c, w in zip(got[sid], want):
        assert torch.equal(c.latents, w.latents), c.index


def test_an_import_is_refused_naming_what_differs_and_an_id_open_here(pair):
    a, b = pair
    _clear(a)
    _clear(b)
    s = a.open_session(seed=3)
    take(a, s, 1, {})
    state = a.export_session(s.id)
    b.import_session(state)
    with pytest.raises(ValueError, match=f"session {s.id} is open here already"):
        b.import_session(state)
    wrong = StreamScheduler("small-stream", max_sessions=1, device="cpu", use_graphs=False)
    try:
        with pytest.raises(ValueError, match=r"does not fit this scheduler's runner: .*"
                                             r"latent_shape"):
            wrong.import_session(state)
    finally:
        wrong.close()
    with pytest.raises(KeyError):
        a.export_session("nope")


def test_a_client_that_stops_acknowledging_stops_its_stream(pair):
    a, _ = pair
    _clear(a)
    s = a.open_session(seed=4)
    for _ in range(a.queue_chunks + 3):
        a.step()
        while a.next_chunk(s.id, 0) is not None:     # handed out, never acknowledged
            pass
    assert s.chunks == a.queue_chunks and s.delivery.sent == len(s.delivery.queue) == a.queue_chunks
    assert a.ack(s.id, 1) == 2 and s.delivery.delivered == 2
    a.step()
    assert s.chunks == a.queue_chunks + 1
    a.rewind(s.id)                                   # a reconnect: all of them again
    assert a.next_chunk(s.id, 0).index == 2
    a.rewind(s.id, after=3)                          # it has up to 3
    assert a.next_chunk(s.id, 0).index == 4 and s.delivery.delivered == 4
    with pytest.raises(ValueError, match="index must be an integer, got '3'"):
        a.ack(s.id, "3")


def test_a_replaced_reader_takes_nothing(pair):
    """A dropped socket's reader still waiting when the client's new socket rewinds:
    the chunk made next goes to the new reader only (none is lost between them)."""
    a, _ = pair
    _clear(a)
    s = a.open_session(seed=6)
    old = a.rewind(s.id)
    took = []
    waiting = threading.Thread(target=lambda: took.append(a.next_chunk(s.id, 5, reader=old)))
    waiting.start()
    new = a.rewind(s.id)                             # the reconnect, before the chunk
    assert new != old
    a.step()
    waiting.join()
    assert took == [None], "the replaced reader took a chunk"
    assert a.next_chunk(s.id, 0, reader=new).index == 0
    assert a.next_chunk(s.id, 0, reader=old) is None


def test_a_stream_resumed_behind_its_client_refuses_its_after(pair):
    """A stream imported from a state taken two chunks before its client's last one:
    the client's ``after`` (3) is refused naming the last chunk made (0); a reconnect
    after that one gets the chunks made again, then the rest, each equal to the
    uninterrupted run's."""
    a, b = pair
    _clear(a)
    _clear(b)
    s = a.open_session(seed=21, chunks=7)
    want = take(a, s, 1, {})
    old = a.export_session(s.id)                    # the last checkpoint: one chunk made
    a.import_session(old)
    want = take(a, a.sessions[s.id], 4, want)[s.id]  # the client got 0..3, then the kill
    a.close_session(s.id, "test")
    b.import_session(old)
    with pytest.raises(ValueError, match="the last chunk made is 0, got 3"):
        b.rewind(s.id, after=3)
    reader = b.rewind(s.id, after=0)
    got = []
    while len(got) < 6:
        b.step()
        while (c := b.next_chunk(s.id, 0, reader=reader)) is not None:
            got.append(c)
            b.ack(s.id, c.index)
    assert [c.index for c in got] == [1, 2, 3, 4, 5, 6]
    b.close_session(s.id, "test")
    alone = a.open_session(seed=21, chunks=7)
    full = take(a, alone, 7, {})[alone.id]
    for c in got:
        assert torch.equal(c.latents, full[c.index].latents), c.index
    assert [c.index for c in want] == [0, 1, 2, 3]


def test_an_after_or_ack_beyond_the_chunks_made_makes_nothing_for_nobody(pair):
    """``after`` past the chunks made is refused (naming the last one); an ack past them
    counts up to the last one only, so the stream makes no more than --queue-chunks
    ahead of what its client has: none computed and never queued."""
    a, _ = pair
    _clear(a)
    s = a.open_session(seed=3)
    take(a, s, 2, {})
    made = s.chunks
    with pytest.raises(ValueError, match=f"the last chunk made is {made - 1}, got 1000000"):
        a.rewind(s.id, after=1_000_000)
    a.ack(s.id, 10**30)
    assert s.delivery.acked == made - 1 and a.session_info(s.id)["delivered"] == made
    for _ in range(3 * a.queue_chunks):
        a.step()
    assert s.chunks == made + a.queue_chunks and len(s.delivery.queue) == a.queue_chunks
    with pytest.raises(ValueError, match="no chunk is made yet, got 0"):
        a.rewind(a.open_session(seed=4, paused=True).id, after=0)


def test_no_reader_waits_on_a_step(pair, monkeypatch):
    """A step whose chunk takes 0.5 s: session_info, metrics, set_prompt, pause and ack
    answer at once meanwhile (the lock is held for host work only)."""
    a, _ = pair
    _clear(a)
    s = a.open_session(seed=5)
    take(a, s, 1, {})
    real = a.runner.step_rows

    def slow(*args, **kw):
        time.sleep(0.5)
        return real(*args, **kw)
    monkeypatch.setattr(a.runner, "step_rows", slow)
    stepper = threading.Thread(target=a.step)
    stepper.start()
    time.sleep(0.1)                                  # the step is under way
    waits = []
    for call in (lambda: a.session_info(s.id), a.metrics, lambda: a.pause(s.id, False),
                 lambda: a.ack(s.id, 0), lambda: a.set_prompt(s.id, a.runner.model.prompt)):
        t0 = time.perf_counter()
        call()
        waits.append(time.perf_counter() - t0)
    assert stepper.is_alive()                        # every call above ran during it
    stepper.join()
    assert max(waits) < 0.25, waits


def test_checkpoints_write_the_latest_state_atomically_and_drop_ended_streams(pair, tmp_path):
    a, _ = pair
    _clear(a)
    cp = Checkpoints(tmp_path, 2)
    a.checkpoints = cp
    try:
        s, t = a.open_session(seed=11), a.open_session(seed=12, chunks=4)
        got = take(a, s, 5, {})
        drain(a, [t], got)
        assert cp.flush(10)
        files = sorted(p.name for p in tmp_path.iterdir())
        assert files == sorted(f"{x.id}.session" for x in (s, t))
        from framekv.engine.stream_state import StreamState

        kept = StreamState.load(tmp_path / f"{s.id}.session")
        assert kept.extra["session"]["chunks"] == 4          # its last even chunk count
        a.close_session(t.id)
        assert cp.flush(10) and not (tmp_path / f"{t.id}.session").exists()
        assert cp.written >= 3 and cp.failed == 0
    finally:
        a.checkpoints = None
        cp.close()
    with pytest.raises(ValueError, match="every must be an integer >= 1, got 0"):
        Checkpoints(tmp_path, 0)
    with pytest.raises(ValueError, match="directory must be an existing folder"):
        Checkpoints(tmp_path / "missing", 1)


def test_execute_runs_a_plan_and_a_failed_swap_fails_its_stream_alone(pair, monkeypatch):
    """The step contract alone: a plan of a start, a swap out, a swap in and a chunk."""
    a, _ = pair
    _clear(a)
    r = a.runner
    plan = StepPlan(swap_ins=[Swap("x", 0, None, None)])
    res = r.execute(plan)
    assert res.latents is None and not res.failed and res.error is None
    plan = StepPlan(rows=[0], streams=["x"], keys=[(3, 0)], frame0=[0])
    plan.draw_noise(a.chunk_shape)
    first = r.execute(plan).latents
    out = r.execute(StepPlan(swap_outs=[Swap("x", 0)]))
    state = out.parked["x"]
    assert state.sequences[0].committed > 0 and out.swap_seconds["x"] >= 0
    monkeypatch.setattr(r, "restore", lambda *a_, **k: (_ for _ in ()).throw(
        RuntimeError("injected")))
    bad = r.execute(StepPlan(swap_ins=[Swap("x", 1, state, None)]))
    assert bad.failed == {"x": "swapping the session in failed: RuntimeError: injected"}
    assert torch.isfinite(first).all()


def test_renoise_is_the_streams_own():
    shape = (2, 1, 2, 2)
    a, b = chunk_renoise(5, 3, 4, shape), chunk_renoise(5, 3, 4, shape)
    assert a.shape == (3, *shape) and torch.equal(a, b)
    assert not torch.equal(a, chunk_renoise(5, 4, 4, shape))
    assert not torch.equal(a, chunk_renoise(6, 3, 4, shape))
    assert chunk_renoise(5, 3, 1, shape).shape == (0, *shape)


def test_a_self_forcing_decoded_stream_moves_bit_for_bit():
    """Wan (tiny), the self_forcing sampler and the VAE decoder: two streams exported
    mid-way (their decoder rows, unacknowledged chunks and fresh noise going with them)
    make in another scheduler the chunks and frames they make unmoved, batched alike."""
    pytest.importorskip("diffusers")
    from framekv.engine.wan import WanRollout, build_model, preset_sizes
    from framekv.engine.wan.vae import StreamingVAEDecoder, build_vae

    sizes = preset_sizes("tiny")
    model, vae = build_model("tiny", device="cpu"), build_vae("tiny", device="cpu")

    def sched():
        return StreamScheduler(max_sessions=2, queue_chunks=3, runner_factory=functools.partial(
            WanRollout, model, use_graphs=False, sampler="self_forcing", **sizes),
            decoder_factory=lambda k: StreamingVAEDecoder(vae, sequences=k))

    def run(moved):
        src, dst = sched(), sched()
        try:
            pair = [src.open_session(seed=21, chunks=5), src.open_session(seed=22, chunks=5)]
            got = {}
            for _ in range(2):
                src.step()
                drain(src, pair, got)
            src.step()                                     # made, not yet taken
            live = src
            if moved:
                ids = [dst.import_session(src.export_session(s.id)) for s in pair]
                pair, live = [dst.sessions[i] for i in ids], dst
            while not all(s.finished for s in pair):
                live.step()
                drain(live, pair, got)
            drain(live, pair, got)
            return {s.seed: got[s.id] for s in pair}
        finally:
            src.close()
            dst.close()
    got, want = run(True), run(False)
    for seed, chunks in want.items():
        assert [c.index for c in got[seed]] == list(range(5)) == [c.index for c in chunks]
        for c, w in zip(got[seed], chunks):
            assert torch.equal(c.latents, w.latents) and torch.equal(c.video, w.video), c.index


def test_a_latent_preview_is_one_image_per_latent_frame_in_range():
    from framekv.engine.serving import LatentPreview

    p = LatentPreview(3, scale=4)
    z = torch.randn(2, 4, 3, 5, 7, generator=torch.Generator().manual_seed(0)) * 10
    out = p.decode(z, rows=[2, 0])
    assert out.shape == (2, 3, 3, 20, 28) and out.abs().max() <= 1     # tanh: 1 in fp32 at most
    # red is channels 0 and 3, each pixel 4x4 the same
    want = torch.tanh((z[:, 0] + z[:, 3]) / 2 ** 0.5)
    torch.testing.assert_close(out[:, 0, :, ::4, ::4], want)
    assert torch.equal(out[:, :, :, 1::4, 2::4], out[:, :, :, ::4, ::4])
    assert p.snapshot(2)["frames"] == 3 and p.snapshot(1)["frames"] == 0
    p.restore(1, {"frames": 7, "cache": []})
    p.reset(rows=[2])
    assert [p.snapshot(r)["frames"] for r in range(3)] == [3, 7, 0]
    assert p.video_frames(3, True) == p.video_frames(3, False) == 3
    with pytest.raises(ValueError, match=r"rows must be 2 of \[0, 3\), got \[0, 3\]"):
        p.decode(z, rows=[0, 3])
    with pytest.raises(ValueError, match="scale must be an integer >= 1, got 0"):
        LatentPreview(1, scale=0)


def _previewed(host_latents=None, device="cpu"):
    """The tiny reference model's scheduler whose decoder is the latents' preview."""
    from framekv.engine.serving import LatentPreview

    return StreamScheduler("tiny", max_sessions=2, device=device, queue_chunks=4,
                           use_graphs=device != "cpu", decoder_factory=LatentPreview,
                           host_latents=host_latents)


def _made(sched, n: int) -> list:
    """The chunks of two streams (seeds 7 and 8) stepped together, ``n`` each, in turn."""
    ss = [sched.open_session(seed=seed, chunks=n) for seed in (7, 8)]
    for _ in range(4 * n):                    # an overlapped step's chunks come a step late
        if all(s.finished and len(s.queue) == n for s in ss):
            break
        sched.step()
    assert [(s.state, len(s.queue)) for s in ss] == [("done", n)] * 2
    return [c for s in ss for c in s.queue]


def test_a_frames_only_scheduler_keeps_each_chunks_latents_apart_where_they_were_made():
    """A decoder's chunks keep their latents where the runner made them (copied out for
    an export only), each chunk its own memory; the same latents and frames as a
    scheduler that copies every chunk's to the host. A pickled chunk leaves device
    latents behind."""
    import pickle

    from framekv.engine.serving import SessionChunk

    frames_only, host = _previewed(), _previewed(host_latents=True)
    try:
        assert (frames_only.host_latents, host.host_latents) == (False, True)
        for a, b in zip(_made(frames_only, 3), _made(host, 3), strict=True):
            assert torch.equal(a.latents, b.latents) and torch.equal(a.video, b.video)
            assert a.latents.untyped_storage().nbytes() == a.latents.numel() * 4
            assert b.latents.untyped_storage().nbytes() > b.latents.numel() * 4   # a view
    finally:
        frames_only.close()
        host.close()
    chunk = SessionChunk(0, 0, torch.ones(2, 3), 0.1, 1, video=torch.zeros(1, 8, 8, 3))
    back = pickle.loads(pickle.dumps(chunk))
    assert torch.equal(back.latents, chunk.latents) and torch.equal(back.video, chunk.video)
    chunk.latents = torch.empty(2, 3, device="meta")
    back = pickle.loads(pickle.dumps(chunk))
    assert back.latents is None and torch.equal(back.video, chunk.video)
    assert chunk.latents.device.type == "meta"            # the chunk itself keeps them


def test_host_latents_is_checked_before_anything_is_built():
    with pytest.raises(ValueError, match="host_latents must be None, True or False, got 'yes'"):
        StreamScheduler("tiny", device="cpu", host_latents="yes")
    with pytest.raises(ValueError, match="host_latents=False needs a decoder_factory"):
        StreamScheduler("tiny", device="cpu", host_latents=False)


@pytest.mark.gpu
def test_on_cuda_frames_only_latents_stay_on_the_gpu_and_leave_it_for_an_export():
    frames_only, host = _previewed(device="cuda"), _previewed(host_latents=True, device="cuda")
    try:
        got, want = _made(frames_only, 3), _made(host, 3)
        assert all(c.latents.is_cuda for c in got) and not any(c.latents.is_cuda for c in want)
        assert all(torch.equal(a.latents.cpu(), b.latents) and torch.equal(a.video, b.video)
                   for a, b in zip(got, want))
        sid = next(iter(frames_only.sessions))
        state = frames_only.export_session(sid)
        for j, w in enumerate(want[:3]):
            t = state.extra_tensors[f"chunk{j}.latents"]
            assert t.device.type == "cpu" and torch.equal(t, w.latents)
    finally:
        frames_only.close()
        host.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_decoder_row_that_fails_to_swap_out_fails_its_stream_alone(monkeypatch, overlap):
    from framekv.engine.serving import LatentPreview

    sched = StreamScheduler("tiny", max_sessions=3, slots=2, device="cpu", use_graphs=False,
                            swap_quantum=1, queue_chunks=8, decoder_factory=LatentPreview,
                            overlap=overlap)
    try:
        ss = [sched.open_session(seed=seed, chunks=4) for seed in (1, 2, 3)]
        real, calls = sched.decoder.snapshot, []

        def once(row):
            calls.append(row)
            if len(calls) == 1:
                raise RuntimeError("no host memory")
            return real(row)
        monkeypatch.setattr(sched.decoder, "snapshot", once)
        for _ in range(60):
            if sched.step() == 0 and all(s.finished for s in ss):
                break
        failed = [s for s in ss if s.state == "failed"]
        assert len(failed) == 1 and failed[0].error == (
            "swapping the session out failed: its decoder row: RuntimeError('no host memory')")
        assert all(s.state == "done" and len(s.queue) == 4 for s in ss if s not in failed)
        assert sched.metrics()["failed_swaps"] == 1 and len(calls) == 1
    finally:
        sched.close()
