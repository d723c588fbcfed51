"""`StreamScheduler` with fewer slots than sessions, on the CPU (fp32): sessions swapped
out to host memory and back equal their seed run alone bit for bit, take turns fairly,
give their slots up in the order `pick_victim` says, and a failing swap fails its
session alone; `save_sessions` / `restore_sessions` carry sessions into another
scheduler (another slot count) with nothing lost or repeated; a decoder row restores
into a decoder that has not decoded yet.
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch

from framekv.engine import Rollout
from framekv.engine.step import chunk_noise
from framekv.engine.serving import SchedulerFull, StreamScheduler
from framekv.engine.serving import pick_victim
from test_scheduler import _clear, alone_chunks

SLOTS = 2


@pytest.fixture(scope="module")
def sched():
    s = StreamScheduler("tiny", max_sessions=8, slots=SLOTS, device="cpu", use_graphs=False,
                        queue_chunks=2, swap_quantum=1)     # a turn per step: the most swaps
    yield s
    s.close()


def drain(sched, sessions, got):
    """Take every queued chunk of ``sessions`` as a client does (`next_chunk`, `ack`)."""
    for s in sessions:
        while (chunk := sched.next_chunk(s.id, 0)) is not None:
            got.setdefault(s.id, []).append(chunk)
            sched.ack(s.id, chunk.index)


def run_all(sched, sessions, got, steps=None):
    """Step (draining every queue) until every session finished, or ``steps`` steps."""
    n = 0
    while not all(s.finished for s in sessions) and (steps is None or n < steps):
        sched.step()
        n += 1
        assert sched.metrics()["sessions_resident"] <= sched.slots
        drain(sched, sessions, got)
    return got


def assert_alone(sched, s, chunks, **kw):
    """``chunks`` are indices 0.. in order, each equal (torch.equal) to the seed alone."""
    assert [c.index for c in chunks] == list(range(len(chunks))), "lost, repeated, reordered"
    for c, want in zip(chunks, alone_chunks(sched, s.seed, len(chunks), **kw)):
        assert torch.equal(c.latents, want), (s.seed, c.index)


def test_eight_sessions_over_two_slots_take_turns_and_equal_their_runs_alone(sched):
    _clear(sched)
    m0 = sched.metrics()
    sessions = [sched.open_session(seed=60 + i, chunks=3) for i in range(8)]
    assert all(s.slot is None for s in sessions)              # slots are taken by steps
    got = run_all(sched, sessions, {}, steps=1)
    assert [s.slot is not None for s in sessions] == [True] * SLOTS + [False] * 6
    got = run_all(sched, sessions, got, steps=3)
    assert [len(got.get(s.id, [])) for s in sessions] == [1] * 8     # every one had a turn
    run_all(sched, sessions, got)
    m = sched.metrics()
    assert all(s.state == "done" for s in sessions) and sched.step() == 0
    for s in sessions:
        assert_alone(sched, s, got[s.id])
        assert all(c.batch == SLOTS for c in got[s.id])
    outs, ins = m["swap_outs"] - m0["swap_outs"], m["swap_ins"] - m0["swap_ins"]
    assert outs >= 8 and ins >= 8 and m["swap_bytes"] > m0["swap_bytes"]
    assert m["swap_seconds"]["count"] == m["swap_outs"] + m["swap_ins"]
    assert m["failed_swaps"] == 0 and m["graph_captures"] == m0["graph_captures"]
    assert (m["slots"], m["max_sessions"], m["sessions_resident"]) == (SLOTS, 8, SLOTS)
    assert m["sessions_swapped"] == 6 and m["swapped_bytes"] == 0    # done: nothing kept


def test_a_session_keeps_its_slot_for_its_quantum(sched, monkeypatch):
    """With a quantum of 3 steps, two of four sessions over two slots make 3 chunks
    before the other two get a turn, and so on: 4 swaps out over 16 chunks, not one per
    chunk; every chunk still equals the seed run alone."""
    _clear(sched)
    monkeypatch.setattr(sched, "swap_quantum", 3)
    m0 = sched.metrics()
    sessions = [sched.open_session(seed=80 + i, chunks=4) for i in range(4)]
    got = run_all(sched, sessions, {}, steps=3)
    assert [len(got.get(s.id, [])) for s in sessions] == [3, 3, 0, 0]
    run_all(sched, sessions, got, steps=3)
    assert [len(got.get(s.id, [])) for s in sessions] == [3, 3, 3, 3]
    run_all(sched, sessions, got)
    for s in sessions:
        assert_alone(sched, s, got[s.id])
    m = sched.metrics()
    # out: 0 and 1 after their 3 steps, then 2 and 3 after theirs; the last chunks
    # finish without a swap out (a finished session gives its slot up as it is)
    assert m["swap_outs"] - m0["swap_outs"] == 4
    with pytest.raises(ValueError, match="swap_quantum must be an integer >= 1, got 0"):
        StreamScheduler("tiny", max_sessions=2, slots=1, device="cpu", use_graphs=False,
                        swap_quantum=0)


def test_a_paused_session_gives_its_slot_up_and_comes_back_where_it_was(sched):
    _clear(sched)
    a, b = sched.open_session(seed=71), sched.open_session(seed=72)
    c = sched.open_session(seed=73, chunks=2)            # no slot free: it waits
    got = run_all(sched, [a, b, c], {}, steps=1)
    assert (a.chunks, b.chunks, c.chunks, c.slot) == (1, 1, 0, None)
    slot_a, slot_b, outs = a.slot, b.slot, sched.metrics()["swap_outs"]
    sched.pause(a.id)
    run_all(sched, [a, b, c], got, steps=1)               # c needs a slot: a's (paused)
    assert (a.slot, b.slot, c.slot) == (None, slot_b, slot_a)
    assert sched.metrics()["swap_outs"] == outs + 1 and sched.metrics()["swapped_bytes"] > 0
    sched.pause(a.id, False)
    run_all(sched, [c], got)                              # a and b take turns with c
    sched.pause(b.id)
    run_all(sched, [a], got, steps=3)
    assert_alone(sched, a, got[a.id])
    assert_alone(sched, c, got[c.id])
    with pytest.raises(SchedulerFull, match="all 8 sessions are open"):
        [sched.open_session(seed=i) for i in range(6)]


def test_the_victim_is_not_ready_first_then_least_recently_stepped():
    def s(sid, last, ready, slot=0):
        return SimpleNamespace(id=sid, last_stepped=last, ready=ready, slot=slot)

    ready = [s("old-ready", 1, True), s("new-paused", 9, False), s("mid-paused", 5, False)]
    assert pick_victim(ready, set(), lambda x: x.ready).id == "mid-paused"
    assert pick_victim(ready, {"mid-paused"}, lambda x: x.ready).id == "new-paused"
    assert pick_victim(ready, {"mid-paused", "new-paused"}, lambda x: x.ready).id == "old-ready"
    assert pick_victim(ready + [s("off", 0, False, None)], {"old-ready", "new-paused",
                                                              "mid-paused"}, bool) is None


@pytest.mark.parametrize("method", ["snapshot", "restore"])
def test_a_failing_swap_fails_its_session_alone(sched, monkeypatch, method):
    _clear(sched)
    m0 = sched.metrics()
    real, calls = getattr(sched.runner, method), []

    def once(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 1:
            raise RuntimeError(f"injected {method} fault")
        return real(*args, **kwargs)
    monkeypatch.setattr(sched.runner, method, once)
    sessions = [sched.open_session(seed=80 + i, chunks=3) for i in range(4)]
    got = run_all(sched, sessions, {})
    failed = [s for s in sessions if s.state == "failed"]
    assert len(failed) == 1 and calls, [s.state for s in sessions]
    which = "out" if method == "snapshot" else "in"
    assert f"swapping the session {which} failed: RuntimeError: injected {method} fault" \
        in failed[0].error
    for s in sessions:
        if s is not failed[0]:
            assert s.state == "done"
            assert_alone(sched, s, got[s.id])
    m = sched.metrics()
    assert m["failed_swaps"] == m0["failed_swaps"] + 1 and sched.loop_error is None
    assert m["sessions_resident"] <= SLOTS and len(sched.pool.free) + m["sessions_resident"] == SLOTS


def test_a_prompt_change_while_swapped_out_equals_the_same_change_resident(sched):
    _clear(sched)
    P, dim = sched.prompt_shape
    p1 = torch.randn(P, dim, generator=torch.Generator().manual_seed(3))
    p2 = torch.randn(P, dim, generator=torch.Generator().manual_seed(4))
    s = sched.open_session(seed=91, prompt=p1, chunks=4)
    others = [sched.open_session(seed=92 + i, chunks=4) for i in range(3)]
    got = run_all(sched, [s], {}, steps=2)
    while s.slot is not None:                         # until it is swapped out
        run_all(sched, [s, *others], got, steps=1)
    assert s.chunks < 4 and s.parked is not None
    assert sched.set_prompt(s.id, p2) == (1, s.chunks)
    with pytest.raises(ValueError, match=r"prompt must be a \[1, 6, 32\] tensor \(or \[6, 32\]\), got \[3\]"):
        sched.set_prompt(s.id, torch.zeros(3))
    with pytest.raises(ValueError, match="finite values only"):
        sched.set_prompt(s.id, torch.full((P, dim), float("nan")))
    rewrite_at = s.chunks
    run_all(sched, [s, *others], got)
    assert_alone(sched, s, got[s.id], prompt=p1, rewrite_at=rewrite_at, new_prompt=p2)
    assert [c.prompt_version for c in got[s.id]] == [0] * rewrite_at + [1] * (4 - rewrite_at)


def test_sessions_saved_and_restored_go_on_in_another_scheduler(sched, tmp_path, caplog):
    """Resident, swapped, unstarted, paused and done sessions with undelivered chunks
    and a pending prompt change move to a scheduler of other slots, nothing lost."""
    _clear(sched)
    P, dim = sched.prompt_shape
    p2 = torch.randn(P, dim, generator=torch.Generator().manual_seed(5))
    a, b, c = (sched.open_session(seed=101 + i, chunks=5) for i in range(3))
    done = sched.open_session(seed=104, chunks=1)
    fresh = sched.open_session(seed=105, chunks=2, paused=True)     # parked, never started
    got = run_all(sched, [a, b, c, done], {}, steps=3)
    sched.step()                                          # undelivered chunks stay queued
    assert done.state == "done" and any(x.delivery.queue for x in (a, b, c))
    parked = next(x for x in (a, b, c) if x.slot is None)
    sched.set_prompt(parked.id, p2)                      # applies as it swaps back in
    change_at, failed = parked.chunks, sched.open_session(seed=106)
    failed.state, failed.error = "failed", "injected"
    saved = sched.save_sessions(tmp_path)
    assert sorted(saved) == sorted(x.id for x in (a, b, c, done, fresh))
    assert "is not saved: it failed (injected)" in caplog.text
    other = StreamScheduler("tiny", max_sessions=5, slots=3, device="cpu", use_graphs=False,
                            queue_chunks=2)
    try:
        assert sorted(other.restore_sessions(tmp_path)) == sorted(saved)
        assert not list(tmp_path.iterdir())                         # files read, removed
        moved = {x.id: other.sessions[x.id] for x in (a, b, c, done, fresh)}
        assert all(m.slot is None for m in moved.values()) and moved[fresh.id].paused
        assert moved[done.id].state == "done" and moved[done.id].chunks == 1
        # its change went along, accepted: it is taken as the stream takes a slot
        assert [c.version for c in moved[parked.id].pending] == [1]
        other.pause(fresh.id, False)
        run_all(other, list(moved.values()), got)
        assert moved[parked.id].prompt_version == 1 and not moved[parked.id].pending
        for x in (a, b, c, fresh):
            kw = dict(rewrite_at=change_at, new_prompt=p2) if x is parked else {}
            assert_alone(other, moved[x.id], got[x.id], **kw)
        assert [ch.index for ch in got[done.id]] == [0]
    finally:
        other.close()


def test_a_decoder_row_restores_into_a_decoder_that_has_not_decoded():
    pytest.importorskip("diffusers")
    from framekv.engine.wan.vae import StreamingVAEDecoder, build_vae

    vae = build_vae("tiny", seed=3)
    z = torch.randn(1, 4, 6, 4, 4, generator=torch.Generator().manual_seed(2))
    whole = StreamingVAEDecoder(vae, sequences=1)
    want = torch.cat([whole.decode(z[:, :, i:i + 2]) for i in (0, 2, 4)], 2)
    a = StreamingVAEDecoder(vae, sequences=2)
    head = a.decode(z[:, :, :2], rows=[1])
    state = a.snapshot(1)
    a.decode(z[:, :, 2:4] + 5, rows=[1])               # the row goes on elsewhere: a copy
    b = StreamingVAEDecoder(vae, sequences=3)
    b.restore(2, state)
    assert state["latent_size"] == (4, 4) and b.state == (0, 0, 2)
    tail = torch.cat([b.decode(z[:, :, i:i + 2], rows=[2]) for i in (2, 4)], 2)
    assert torch.equal(torch.cat([head, tail], 2), want)


def test_wan_sessions_with_a_decoder_swap_and_move_as_one_video_each(tmp_path):
    """Three tiny Wan sessions (text prompts, VAE decoder) over two slots, saved half
    way and restored into another scheduler: each one's latents equal its seed run
    alone and its frames its latents decoded as one video."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from framekv.engine.wan import TextEncoder, WanRollout, build_model, preset_sizes
    from framekv.engine.wan.vae import StreamingVAEDecoder, build_vae
    from test_scheduler import assert_same_video, fresh_decode

    sizes = preset_sizes("tiny")
    text = TextEncoder.from_config("tiny", max_tokens=sizes["prompt_tokens"], device="cpu")
    model, vae = build_model("tiny", device="cpu"), build_vae("tiny", device="cpu")

    def make():
        return StreamScheduler(max_sessions=3, slots=2, queue_chunks=8, swap_quantum=1,
                               runner_factory=partial(
                                   WanRollout, model, use_graphs=False, text_encoder=text, **sizes),
                               decoder_factory=lambda n: StreamingVAEDecoder(vae, sequences=n))

    prompts = ["a red fox", "a blue whale", "a green field"]
    first, got = make(), {}
    sessions = [first.open_session(seed=120 + i, chunks=4, prompt=p)
                for i, p in enumerate(prompts)]
    run_all(first, sessions, got, steps=3)                   # 2 chunks each, swapped
    assert [s.chunks for s in sessions] == [2, 2, 2] and first.metrics()["swap_ins"] >= 1
    assert sorted(first.save_sessions(tmp_path)) == sorted(s.id for s in sessions)
    first.close()
    second = make()
    try:
        second.restore_sessions(tmp_path)
        run_all(second, [second.sessions[s.id] for s in sessions], got)
        for s, p in zip(sessions, prompts):
            chunks = got[s.id]
            assert [c.index for c in chunks] == [0, 1, 2, 3]
            alone = WanRollout(model, use_graphs=False, text_encoder=text, **sizes)
            alone.set_prompt(p)
            for c in chunks:
                want = alone.step(chunk_noise(s.seed, c.index, second.chunk_shape)[None])[0]
                assert float((c.latents - want).abs().max()) <= 1e-5, (s.seed, c.index)
            for c, want in zip(chunks, fresh_decode(vae, chunks)):
                assert_same_video(c.video, want)
    finally:
        second.close()


@pytest.mark.gpu
def test_swapping_on_the_gpu_replays_graphs_and_equals_the_sessions_without_swaps(tmp_path):
    """CUDA, graphs: six sessions over two slots, saved half way and restored into
    another scheduler, equal bit for bit the same seeds run two by two with no swap
    (every step a batch of two); no graph is captured after the start."""
    seeds, got, want = list(range(130, 136)), {}, {}
    plain = StreamScheduler("tiny", max_sessions=2, device="cuda", queue_chunks=8)
    try:
        for pair in (seeds[0:2], seeds[2:4], seeds[4:6]):
            sessions = [plain.open_session(seed=seed, chunks=4) for seed in pair]
            run_all(plain, sessions, got)
            want.update({s.seed: [c.latents for c in got[s.id]] for s in sessions})
            for s in sessions:
                plain.close_session(s.id)
        model = plain.runner.model
    finally:
        plain.close()

    def swapping():
        return StreamScheduler(max_sessions=6, slots=2, queue_chunks=8, swap_quantum=1,
                               runner_factory=partial(Rollout, "tiny", "cuda", model=model))

    first = swapping()
    sessions = [first.open_session(seed=seed, chunks=4) for seed in seeds]
    run_all(first, sessions, got, steps=6)                   # two chunks each
    assert first.metrics()["swap_ins"] >= 4 and first.metrics()["chunks_eager"] == 0
    first.save_sessions(tmp_path)
    first.close()
    second = swapping()
    try:
        captures = second.metrics()["graph_captures"]
        assert len(second.restore_sessions(tmp_path)) == 6
        run_all(second, [second.sessions[s.id] for s in sessions], got)
        m = second.metrics()
        assert m["graph_captures"] == captures and m["chunks_eager"] == 0
        for s in sessions:
            assert [c.index for c in got[s.id]] == [0, 1, 2, 3]
            for c, w in zip(got[s.id], want[s.seed]):
                assert torch.equal(c.latents, w), (s.seed, c.index)
    finally:
        second.close()
