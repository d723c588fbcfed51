"""The turns of `StreamScheduler` (`engine.serving.steps`): with more ready sessions than
slots, whole groups rotate at turn boundaries, every step runs a full batch, the first
in is the first out and comes back first, and over any window every session's chunks
are within a quantum of the others'. Replayed step by step on the CPU over a runner
that runs no model (`framekv.bench.swap_model`); on the tiny model, the host memory
reserved at start.
"""
from __future__ import annotations

import collections
import functools

import pytest

from framekv.bench.swap_model import CostModel, drain, model_scheduler, simulate
from framekv.engine import Rollout
from framekv.engine.serving import StreamScheduler

#: (sessions, slots, quantum): a multiple of the slots, and not
CASES = [(6, 3, 2), (5, 3, 2), (4, 3, 3), (9, 8, 3), (11, 4, 3)]
STEPS = 48


def window_spread(log, names) -> int:
    """The largest (max - min) chunks per session over any window of steps."""
    rows = [[names[sid] for sid in r.streams] for r in log]
    worst = 0
    for a in range(len(rows)):
        count = collections.Counter({i: 0 for i in names.values()})
        for b in range(a, len(rows)):
            count.update(rows[b])
            worst = max(worst, max(count.values()) - min(count.values()))
    return worst


def ring(sessions: int, slots: int, rotations: int):
    """The turns as a ring: each rotation the first k = min(waiting, slots) in leave and
    the first k out come in (those never in, in the order they opened)."""
    on, off, k = list(range(slots)), list(range(slots, sessions)), min(sessions - slots, slots)
    for _ in range(rotations):
        out, back = on[:k], off[:k]
        on, off = on[k:] + back, off[k:] + out
        yield set(out), set(back)


@pytest.mark.parametrize("sessions,slots,quantum", CASES)
def test_sessions_rotate_in_groups_every_quantum_with_full_batches(sessions, slots, quantum):
    _, log, names = simulate(sessions, slots, quantum, steps=STEPS, warmup_steps=0)
    assert len(log) == STEPS
    for i, r in enumerate(log):
        # a full batch, no scratch row, every other ready session waiting
        assert (r.rows, r.scratch, r.left_waiting) == (slots, 0, sessions - slots), i
    swapped = [i for i, r in enumerate(log) if r.outs]
    assert swapped == list(range(quantum, STEPS, quantum)), "swaps outside turn boundaries"
    moved = [i for i, r in enumerate(log) if r.ins or r.starts]
    assert moved == [0] + swapped
    num = {v: k for k, v in names.items()}
    for i, (out, back) in zip(swapped, ring(sessions, slots, len(swapped))):
        assert {names[s] for s in log[i].outs} == out, (i, "the first in leaves first")
        assert {names[s] for s in log[i].ins + log[i].starts} == back, (i, "first out back first")
        assert all(num[x] in log[i].streams for x in back)
    assert window_spread(log, names) <= quantum


def test_the_model_prices_a_rotation_as_its_swaps_in_turn():
    """16 over 8, a turn of 16 steps: 16 full steps, one of which also swaps 8 out and
    8 in; the ratio against 8 resident is the steps' share of the time; pipelined, a
    rotation costs its first export and every import, or every export and the last
    import, whichever is longer."""
    cost = CostModel({8: 0.36}, export_s=0.035, import_s=0.076)
    res, log, _ = simulate(16, 8, 16, steps=16 * 6, warmup_steps=32, cost=cost)
    assert res["swap_steps"] == 4 and res["swap_outs"] == res["swap_ins"] == 32
    assert res["batch_sizes"] == {8: 64} and res["scratch_rows_per_step"] == 0
    assert res["vs_resident"] == pytest.approx(16 * 0.36 / (16 * 0.36 + 8 * (0.035 + 0.076)))
    assert res["chunks_per_session_min"] == res["chunks_per_session_max"] == 32
    assert cost.step_seconds(6) == pytest.approx(0.27) and cost.step_seconds(16) == 0.72
    rotation = next(r for r in log[32:] if r.outs)
    # pipelined: the first export, then the imports one after another (the slower)...
    piped = CostModel({8: 0.36}, export_s=0.035, import_s=0.076, pipelined=True)
    assert piped.swap_seconds(rotation) == pytest.approx(0.035 + 8 * 0.076)
    # ... or the exports one after another, then the last import
    piped = CostModel({8: 0.36}, export_s=0.1, import_s=0.01, pipelined=True)
    assert piped.swap_seconds(rotation) == pytest.approx(8 * 0.1 + 0.01)


def test_a_session_that_takes_a_free_slot_mid_turn_keeps_it_its_quantum():
    """Three slots, a turn of 4: a slot freed at step 2 goes at once to the waiting
    session, a later one waits for the boundary at step 4 and takes the slot of the
    first in (not the one that came at step 2), and nothing swaps between boundaries."""
    sched, log = model_scheduler(5, 3, 4)
    try:
        a, b, c, d = (sched.open_session(seed=i) for i in range(4))
        for step in range(12):
            if step == 2:
                sched.close_session(b.id)
                e = sched.open_session(seed=9)
            sched.step()
            drain(sched)
            assert log[-1].rows == 3 and log[-1].scratch == 0, step
        assert log[2].starts == [d.id] and not log[2].outs and log[3].left_waiting == 1
        assert [i for i, r in enumerate(log) if r.outs] == [4, 8]
        assert log[4].outs == [a.id] and log[4].starts == [e.id]
        assert log[8].outs == [c.id] and log[8].ins == [a.id]
        assert d.slot is not None and e.slot is not None
    finally:
        sched.close()


def test_a_session_not_ready_gives_its_slot_up_at_once():
    """A long turn: a resident session paused mid-turn hands its slot to the waiting
    one at the next step (no row runs scratch while it waits); back, it waits its turn."""
    sched, log = model_scheduler(3, 2, 50)
    try:
        a, b, c = (sched.open_session(seed=i) for i in range(3))
        for step in range(6):
            if step == 2:
                sched.pause(a.id)
            if step == 4:
                sched.pause(a.id, False)
            sched.step()
            drain(sched)
        assert [set(r.streams) for r in log] == [{a.id, b.id}] * 2 + [{b.id, c.id}] * 4
        assert log[2].outs == [a.id] and log[2].starts == [c.id]
        assert all(r.scratch == 0 for r in log) and log[4].left_waiting == 1
    finally:
        sched.close()


@pytest.fixture(scope="module")
def tiny_model():
    r = Rollout("tiny", device="cpu", use_graphs=False)
    yield r.model
    r.close()


@pytest.mark.parametrize("sessions,slots,reserved", [(5, 2, 5), (3, 2, 2), (4, 4, None)])
def test_start_reserves_the_host_memory_of_parked_streams_and_a_rotation(
        tiny_model, sessions, slots, reserved):
    """The parked streams' exports, and one rotation's swap outs besides (copied out
    while the streams coming in still hold theirs); nothing without swaps."""
    asked = []

    def make(**kw):
        r = Rollout("tiny", "cpu", model=tiny_model, use_graphs=False, **kw)
        r.cache.reserve_exports = lambda count: asked.append(count) or 0
        return r

    sched = StreamScheduler(max_sessions=sessions, slots=slots, runner_factory=make)
    sched.close()
    assert asked == ([] if reserved is None else [reserved])
