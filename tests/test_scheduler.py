"""`StreamScheduler` on the CPU (fp32): batched sessions equal each seed run alone, chunks
in order, bounded queues, faults contained, slots reused, prompt changes re-cached."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import Rollout
from framekv.engine.runner import chunk_noise
from framekv.engine.scheduler import SchedulerFull, StreamScheduler


@pytest.fixture(scope="module")
def sched():
    s = StreamScheduler("tiny", max_sessions=8, device="cpu", queue_chunks=3)
    yield s
    s.close()


def _clear(sched):
    for sid in list(sched.sessions):
        sched.close_session(sid)


def drain(sched, sessions, got):
    for s in sessions:
        while s.queue:
            got.setdefault(s.id, []).append(s.queue.popleft())


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
    assert len(slow.queue) == sched.queue_chunks and slow.chunks == sched.queue_chunks
    assert len(got[fast.id]) == 8
    first = sched.next_chunk(slow.id, timeout=0)
    assert first.index == 0
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
    assert again.sequence == sessions[3].sequence
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
])
def test_bad_session_arguments_are_named_and_take_no_slot(sched, kwargs, match):
    _clear(sched)
    with pytest.raises(ValueError, match=match):
        sched.open_session(**kwargs)
    assert len(sched._free) == sched.max_sessions
