"""`StreamScheduler` on the CPU (fp32): batched sessions equal each seed run alone, chunks
in order, bounded queues, faults contained, slots reused, prompt changes re-cached.

With a tiny Wan runner and a tiny VAE decoder: each session's chunks come decoded (the
first 1 + 4 (F - 1) frames, then 4 F) and equal its latents decoded by a fresh decoder
as one video, sessions started at different times and a prompt change included; text
prompts equal the same text set offline; a failing decode is contained; the latency
clock and the histograms of `metrics`.
"""
from __future__ import annotations

import functools
import time

import pytest
import torch

from framekv.engine import Rollout
from framekv.engine.step import chunk_noise
from framekv.engine.serving import (Histogram, PromptTooLate, SchedulerFull, StreamScheduler,
                                    to_uint8)


@pytest.fixture(scope="module")
def sched():
    s = StreamScheduler("tiny", max_sessions=8, device="cpu", queue_chunks=3)
    yield s
    s.close()


def _clear(sched):
    for sid in list(sched.sessions):
        sched.close_session(sid)


def drain(sched, sessions, got):
    """Each session's chunks as its client takes them: handed out, then acknowledged."""
    for s in sessions:
        while (c := sched.next_chunk(s.id, 0)) is not None:
            got.setdefault(s.id, []).append(c)
            sched.ack(s.id, c.index)


def alone_chunks(sched, seed, n, prompt=None, rewrite_at=None, new_prompt=None):
    """The same seed run alone: a one-stream rollout over the same model and noise."""
    r = Rollout("tiny", device="cpu", model=sched.runner.model, use_graphs=False)
    r.set_prompt(r.model.prompt if prompt is None else prompt)
    out = []
    for i in range(n):
        if i == rewrite_at:
            r.set_prompt(new_prompt)            # under way: the pinned prefix rewritten
        out.append(r.step(chunk_noise(seed, i, sched.chunk_shape)[None])[0])
    return out


def test_eight_sessions_each_equal_their_seed_run_alone(sched):
    _clear(sched)
    sessions = [sched.open_session(seed=40 + i, chunks=6) for i in range(8)]
    got = {}
    while not all(s.finished for s in sessions):
        assert sched.step() > 0
        drain(sched, sessions, got)
    drain(sched, sessions, got)
    assert sched.step() == 0  # every budget spent
    for s in sessions:
        chunks = got[s.id]
        assert [c.index for c in chunks] == list(range(6)), "lost, repeated or out of order"
        assert s.state == "done" and chunks[0].batch == 8
        want = alone_chunks(sched, s.seed, 6)
        err = max(float((c.latents - w).abs().max()) for c, w in zip(chunks, want))
        assert err <= 1e-5, (s.seed, err)


def test_a_slow_consumer_pauses_only_its_own_session(sched):
    _clear(sched)
    slow, fast = sched.open_session(seed=1), sched.open_session(seed=2)
    got = {}
    for _ in range(8):
        sched.step()
        drain(sched, [fast], got)
    assert len(slow.delivery.queue) == sched.queue_chunks and slow.chunks == sched.queue_chunks
    assert len(got[fast.id]) == 8
    first = sched.next_chunk(slow.id, timeout=0)
    assert first.index == 0
    sched.step()
    assert slow.chunks == sched.queue_chunks      # handed out, not acknowledged: it waits
    sched.ack(slow.id, first.index)
    sched.step()
    assert slow.chunks == sched.queue_chunks + 1


def test_pause_and_resume(sched):
    _clear(sched)
    s = sched.open_session(seed=3)
    sched.pause(s.id)
    assert sched.step() == 0 and s.chunks == 0
    sched.pause(s.id, False)
    assert sched.step() == 1 and s.chunks == 1


def test_a_failing_step_fails_its_sessions_and_the_others_go_on(sched, monkeypatch):
    _clear(sched)
    a, b = sched.open_session(seed=5), sched.open_session(seed=6)
    sched.step()
    real = sched.runner.step_rows

    def boom(*args, **kwargs):
        raise RuntimeError("injected device fault")
    monkeypatch.setattr(sched.runner, "step_rows", boom)
    assert sched.step() == 0
    monkeypatch.setattr(sched.runner, "step_rows", real)
    for s in (a, b):
        assert s.state == "failed" and "injected device fault" in s.error
    c = sched.open_session(seed=7, chunks=3)
    got = {}
    while not c.finished:
        sched.step()
        drain(sched, [c], got)
    assert a.chunks == b.chunks == 1  # the failed sessions are not stepped again
    want = alone_chunks(sched, 7, 3)
    assert max(float((x.latents - w).abs().max()) for x, w in zip(got[c.id], want)) <= 1e-5


def test_a_closed_session_leaves_a_bounded_record_of_how_it_ended(sched):
    from framekv.engine.serving import EndedSessions

    _clear(sched)
    s = sched.open_session(seed=5, chunks=3)
    sched.step()
    assert sched.next_chunk(s.id, 0).index == 0
    assert sched.ack(s.id, 0) == 1
    change = sched.set_prompt(s.id, sched.runner.model.prompt)
    assert (change.version, change.applies_from) == (1, 1)   # version, from
    sched.step()                                  # re-cached at the step boundary
    assert change.result(0) is change and s.prompt_version == 1 and s.chunks == 2
    sched.close_session(s.id, "idle")
    assert sched.session_info(s.id) == {
        "id": s.id, "state": "closed", "paused": False, "seed": 5, "chunks": 2, "delivered": 1,
        "waiting": 0, "budget": 3, "prompt_version": 1, "error": None, "resident": True,
        "ended": True, "end_reason": "idle", "input": "text"}
    assert not s.delivery.queue and sched.metrics()["ended"]["idle"] >= 1
    assert sched.session_info("x") is None
    kept = EndedSessions(2)
    for i in range(3):
        kept.add({"id": str(i), "end_reason": "deleted"})
    assert [kept.get(str(i)) is not None for i in range(3)] == [False, True, True]
    assert len(kept) == 2 and kept.by_reason == {"deleted": 3}


def test_slots_are_bounded_and_reused_clean(sched):
    _clear(sched)
    sessions = [sched.open_session(seed=i) for i in range(8)]
    with pytest.raises(SchedulerFull):
        sched.open_session(seed=99)
    for _ in range(3):
        sched.step()
        drain(sched, sessions, {})
    sched.close_session(sessions[3].id)
    with pytest.raises(KeyError):
        sched.close_session(sessions[3].id)
    again = sched.open_session(seed=11, chunks=2)
    assert again.slot is None                   # it takes a slot at its first step
    sched.step()
    assert again.slot == sessions[3].slot
    got = {}
    while not again.finished:
        sched.step()
        drain(sched, sessions + [again], got)
    want = alone_chunks(sched, 11, 2)
    assert max(float((x.latents - w).abs().max()) for x, w in zip(got[again.id], want)) <= 1e-5


def test_a_prompt_change_equals_the_same_recache_offline(sched):
    _clear(sched)
    P, dim = sched.runner.model.prompt.shape
    p1 = torch.randn(P, dim, generator=torch.Generator().manual_seed(1))
    p2 = torch.randn(P, dim, generator=torch.Generator().manual_seed(2))
    s = sched.open_session(seed=21, prompt=p1, chunks=5)
    other = sched.open_session(seed=22, chunks=5)
    got = {}
    while not s.finished:
        if s.chunks == 2 and not got.get("changed"):
            sched.set_prompt(s.id, p2)
            got["changed"] = True
        sched.step()
        drain(sched, [s, other], got)
    want = alone_chunks(sched, 21, 5, prompt=p1, rewrite_at=2, new_prompt=p2)
    assert max(float((x.latents - w).abs().max()) for x, w in zip(got[s.id], want)) <= 1e-5
    unchanged = alone_chunks(sched, 21, 5, prompt=p1)
    assert float((got[s.id][4].latents - unchanged[4]).abs().max()) > 1e-3  # it did change
    # The other session never saw the new prompt.
    assert max(float((x.latents - w).abs().max())
               for x, w in zip(got[other.id], alone_chunks(sched, 22, 5))) <= 1e-5


@pytest.mark.parametrize("kwargs,match", [
    (dict(seed=-1), "seed must be"), (dict(seed="1"), "seed must be"),
    (dict(seed=1, chunks=0), "chunks must be"),
    (dict(seed=1, prompt=torch.zeros(3)), "prompt must be"),
    (dict(seed=1, prompt="a cat"), "prompt text needs a runner with a text encoder"),
])
def test_bad_session_arguments_are_named_and_take_no_slot(sched, kwargs, match):
    _clear(sched)
    with pytest.raises(ValueError, match=match):
        sched.open_session(**kwargs)
    assert len(sched.pool.free) == sched.max_sessions


def test_text_needs_a_text_encoder_and_changes_nothing(sched):
    _clear(sched)
    s = sched.open_session(seed=2)
    with pytest.raises(ValueError, match="prompt text needs a runner with a text encoder"):
        sched.set_prompt(s.id, "a dog")
    assert s.prompt_version == 0 and not sched.text_prompts and not sched.decoding


def test_a_prompt_change_no_chunk_would_come_under_is_refused(sched, monkeypatch):
    """A session that made its last chunk takes no prompt change: it would apply from a
    chunk that never comes. One asked for while its last chunk is being made fails so
    once that chunk is made, and re-caches nothing."""
    _clear(sched)
    prompt = sched.runner.model.prompt + 1
    s = sched.open_session(seed=3, chunks=2)
    while not s.finished:
        sched.step()
    with pytest.raises(PromptTooLate, match=r"has made all 2 of its chunks: a prompt change "
                                            r"would apply from chunk 2, which will not come"):
        sched.set_prompt(s.id, prompt)
    assert s.prompt_version == 0 and not s.pending
    t, asked, execute = sched.open_session(seed=4, chunks=2), [], sched.runner.execute

    def mid_step(plan):                              # the client asks during the last step
        if (4, 1) in plan.keys and not asked:
            asked.append(sched.set_prompt(t.id, prompt))
        return execute(plan)
    monkeypatch.setattr(sched.runner, "execute", mid_step)
    while not t.finished:
        sched.step()
    assert asked and not asked[0].done() and t.pending       # accepted: it was not done yet
    sched.step()                                             # the next plan settles it
    with pytest.raises(PromptTooLate, match="has made all 2 of its chunks"):
        asked[0].result(0)
    assert t.prompt_version == 0 and not t.pending and t.pending_prompt is None


def test_the_latency_clock_runs_while_a_session_is_ready_and_not_while_paused(sched):
    _clear(sched)
    s = sched.open_session(seed=3)
    time.sleep(0.05)
    sched.step()
    first = sched.next_chunk(s.id, timeout=0)
    assert first.queued - first.requested >= 0.05 and first.requested <= first.queued
    sched.pause(s.id)
    time.sleep(0.2)                             # paused: no clock
    sched.pause(s.id, False)
    sched.step()
    second = sched.next_chunk(s.id, timeout=0)
    # its clock started once it was resumed: the paused time is not in its latency
    assert second.requested - first.queued >= 0.2 and second.requested <= second.queued
    m = sched.metrics()
    assert m["chunk_seconds"]["count"] == m["chunks"] and m["step_seconds"]["count"] == m["steps"]


def test_histogram_counts_are_cumulative():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.snapshot() == {"buckets": [(0.1, 2), (1.0, 3)], "sum": pytest.approx(3.65),
                            "count": 4}


# ---------------------------------------------------------------- Wan + VAE decoder
@pytest.fixture(scope="module")
def wan():
    """The tiny Wan transformer, text encoder and VAE (random, fp32) and their sizes."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from framekv.engine.wan import TextEncoder, build_model, preset_sizes
    from framekv.engine.wan.vae import build_vae

    sizes = preset_sizes("tiny")
    text = TextEncoder.from_config("tiny", max_tokens=sizes["prompt_tokens"], device="cpu")
    return build_model("tiny", device="cpu"), text, build_vae("tiny", device="cpu"), sizes


@pytest.fixture(scope="module")
def wan_sched(wan):
    from framekv.engine.wan import WanRollout
    from framekv.engine.wan.vae import StreamingVAEDecoder

    model, text, vae, sizes = wan
    s = StreamScheduler(max_sessions=3, queue_chunks=8, runner_factory=functools.partial(
        WanRollout, model, use_graphs=False, text_encoder=text, **sizes),
        decoder_factory=lambda n: StreamingVAEDecoder(vae, sequences=n))
    yield s
    s.close()


def fresh_decode(vae, chunks) -> list[torch.Tensor]:
    """Chunks' latents decoded as one video by a fresh one-sequence decoder: uint8."""
    from framekv.engine.wan.vae import StreamingVAEDecoder

    dec = StreamingVAEDecoder(vae, sequences=1)
    return [to_uint8(dec.decode(c.latents[None].to(dec.device)))[0].cpu() for c in chunks]


def assert_same_video(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to a rounding flip (a batched decode sums in another order)."""
    assert got.shape == want.shape and got.dtype == torch.uint8
    diff = (got.int() - want.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01, int(diff.max())


def test_sessions_get_their_chunks_decoded_as_one_video_each(wan, wan_sched):
    _clear(wan_sched)
    vae = wan[2]
    F, (H, W) = wan[3]["frames_per_chunk"], wan[3]["latent_size"]
    a = wan_sched.open_session(seed=31, chunks=5)
    got = {}
    for _ in range(2):                                  # a alone: chunks 0, 1
        wan_sched.step()
    b = wan_sched.open_session(seed=32, chunks=4, prompt="a red fox")  # b joins later
    wan_sched.step()                                    # a steady, b first: two decodes
    wan_sched.set_prompt(a.id, "a blue whale")          # the video goes on
    while not (a.finished and b.finished):
        wan_sched.step()
    drain(wan_sched, [a, b], got)
    for s in (a, b):
        chunks = got[s.id]
        counts = [c.video.shape[0] for c in chunks]
        assert counts == [1 + 4 * (F - 1)] + [4 * F] * (len(chunks) - 1), counts
        assert [c.video_frame0 for c in chunks] == [sum(counts[:i]) for i in range(len(counts))]
        assert all(c.video.shape[1:] == (8 * H, 8 * W, 3) for c in chunks)
        for c, want in zip(chunks, fresh_decode(vae, chunks)):
            assert_same_video(c.video, want)
    assert [c.prompt_version for c in got[a.id]] == [0, 0, 0, 1, 1]
    # The check can fail: b's chunks decoded after a's video are not b's frames.
    mixed = fresh_decode(vae, got[a.id][:1] + got[b.id][1:2])[1]
    assert int((mixed.int() - got[b.id][1].video.int()).abs().max()) > 8
    m = wan_sched.metrics()
    assert m["decoding"] and m["video_frames"] == sum(
        c.video.shape[0] for c in got[a.id] + got[b.id])


def test_text_prompts_equal_the_same_text_set_offline(wan, wan_sched):
    from framekv.engine.wan import WanRollout

    _clear(wan_sched)
    model, text, _, sizes = wan
    s = wan_sched.open_session(seed=41, chunks=4, prompt="a red fox")
    got = {}
    while not s.finished:
        if s.chunks == 2 and s.prompt_version == 0:
            change = wan_sched.set_prompt(s.id, "a blue whale")
            assert (change.version, change.applies_from) == (1, 2)   # version, from
        wan_sched.step()
        drain(wan_sched, [s], got)
    r = WanRollout(model, use_graphs=False, text_encoder=text, **sizes)
    r.set_prompt("a red fox")
    for i, c in enumerate(got[s.id]):
        if i == 2:
            r.set_prompt("a blue whale", recache=True)
        want = r.step(chunk_noise(41, i, wan_sched.chunk_shape)[None])[0]
        assert float((c.latents - want).abs().max()) <= 1e-5, i
    r.close()


def test_a_failing_decode_fails_its_sessions_and_the_others_go_on(wan, wan_sched, monkeypatch):
    _clear(wan_sched)
    a, b = wan_sched.open_session(seed=51), wan_sched.open_session(seed=52, chunks=3)
    wan_sched.step()
    wan_sched.pause(b.id)
    real = wan_sched.decoder.decode

    def boom(*args, **kwargs):
        raise RuntimeError("injected decode fault")
    monkeypatch.setattr(wan_sched.decoder, "decode", boom)
    assert wan_sched.step() == 0
    monkeypatch.setattr(wan_sched.decoder, "decode", real)
    assert a.state == "failed" and "injected decode fault" in a.error
    wan_sched.pause(b.id, False)
    got = {}
    while not b.finished:
        wan_sched.step()
        drain(wan_sched, [b], got)
    assert a.chunks == 1 and wan_sched.metrics()["failed_steps"] >= 1
    for c, want in zip(got[b.id], fresh_decode(wan[2], got[b.id])):
        assert_same_video(c.video, want)


def test_a_bad_decoder_factory_is_named():
    with pytest.raises(ValueError, match="decoder_factory must be a callable"):
        StreamScheduler("tiny", max_sessions=1, device="cpu", decoder_factory=3)


@pytest.mark.gpu
def test_wan_decoding_on_the_gpu_replays_graphs_captured_up_front():
    """CUDA, bf16, graphs: the decoder is captured for every batch before the first
    session, decodes without a capture after, and matches a fresh eager decoder. The
    tiny model's head dim (12) is no multiple of 8, which cuDNN needs: its attention
    runs on the reference backend, in the same graphs."""
    import argparse

    from framekv.tools.serve import wan_factory

    parts = wan_factory(argparse.Namespace(config="tiny", preset=None, weights=None,
                                           device="cuda", cache_dir=None))
    parts.backend = "reference"
    s = StreamScheduler(max_sessions=2, queue_chunks=8, runner_factory=parts,
                        decoder_factory=parts.decoder)
    try:
        graphs = s.decoder.graph_count
        assert graphs == 4                              # batches 1 and 2, both stages
        a = s.open_session(seed=1, chunks=3)
        s.step()
        b = s.open_session(seed=2, chunks=2, prompt="a cat")
        while not (a.finished and b.finished):
            s.step()
        assert s.decoder.graph_count == graphs
        for sess in (a, b):
            chunks = list(sess.delivery.queue)
            for c, want in zip(chunks, fresh_decode(parts.vae, chunks)):
                diff = (c.video.int() - want.int()).abs().float()
                assert float(diff.mean()) < 1.0, float(diff.mean())
    finally:
        s.close()
