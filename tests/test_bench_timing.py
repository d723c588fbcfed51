"""The host-timing loops of framekv.bench.timing, on CPU over a fake device queue."""
from __future__ import annotations

import pytest
import torch

from framekv.bench import timing


class FakeDevice:
    """Records launches and waits: which earlier calls had finished at each launch."""

    def __init__(self, monkeypatch):
        self.launched: list[int] = []   # call indices in launch order
        self.finished: set[int] = set()
        self.seen_at_launch: list[set[int]] = []
        device = self

        class Event:
            def record(self):
                self.index = len(device.launched) - 1

            def synchronize(self):
                device.finished.update(range(self.index + 1))

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize",
                            lambda *a: device.finished.update(range(len(device.launched))))

    def call(self):
        self.seen_at_launch.append(set(self.finished))
        self.launched.append(len(self.launched))


def test_double_buffered_loop_launches_each_call_once_its_second_predecessor_finished(
        monkeypatch):
    dev = FakeDevice(monkeypatch)
    out = timing.double_buffered_host_times(dev.call, 5)
    assert len(out) == 5 and all(t >= 0 for t in out)
    assert len(dev.launched) == 7  # two untimed calls start the loop
    for k, finished in enumerate(dev.seen_at_launch):
        # call k - 2 has finished, call k - 1 has not: one call always in flight
        assert (k - 2 in finished or k < 2) and k - 1 not in finished, (k, finished)


@pytest.mark.parametrize("depth", [2, 6])
def test_pipelined_loop_drains_once_per_run_and_drops_the_first_call(monkeypatch, depth):
    dev = FakeDevice(monkeypatch)
    out = timing.pipelined_host_times({"a": dev.call, "b": dev.call}, rounds=3, depth=depth)
    assert [len(v) for v in out.values()] == [3 * (depth - 1)] * 2
    for k, finished in enumerate(dev.seen_at_launch):
        first_of_run = k % depth == 0
        # a run starts from a drained device; inside it every earlier call is still queued
        assert (set(range(k)) <= finished) if first_of_run else (k - 1 not in finished)


def test_double_buffered_sequence_times_each_step_and_keeps_one_step_in_flight(monkeypatch):
    dev = FakeDevice(monkeypatch)
    out = timing.double_buffered_sequence_times({"lead": dev.call, "main": dev.call}, 4)
    assert list(out) == ["lead", "main"] and [len(v) for v in out.values()] == [4, 4]
    assert len(dev.launched) == 2 * 6
    for k, finished in enumerate(dev.seen_at_launch):
        step, first = divmod(k, 2)[0], k % 2 == 0
        # a step starts once the step before the previous one finished, never later
        if step >= 2 and first:
            assert set(range(2 * step - 2)) <= finished and 2 * step - 1 not in finished
        if not first:  # the second call is issued right behind the first: nothing waited
            assert finished == dev.seen_at_launch[k - 1]


def test_after_wait_sequence_times_drains_before_each_step_only(monkeypatch):
    dev = FakeDevice(monkeypatch)
    out = timing.after_wait_sequence_times({"lead": dev.call, "main": dev.call}, 3)
    assert [len(v) for v in out.values()] == [3, 3]
    for k, finished in enumerate(dev.seen_at_launch):
        assert finished == set(range(k - k % 2)), (k, finished)


class FakeResident:
    """A resident runner whose runs finish only when waited for; logs (submitted, done)
    at each submit, and the replays and syncs between."""

    def __init__(self):
        self.submitted = self.done = 0
        self.log: list = []

    def submit(self):
        self.submitted += 1
        self.log.append(("submit", self.submitted, self.done))
        return self.submitted

    def wait(self, seq=None):
        self.done = max(self.done, self.submitted if seq is None else seq)
        self.log.append(("wait", self.done))


def test_resident_submit_times_one_run_in_flight_after_a_wait_two_when_double_buffered():
    r = FakeResident()
    out = timing.resident_submit_times(r, 4)
    assert len(out["after_wait"]) == len(out["double_buffered"]) == 4
    submits = [(s, d) for kind, *rest in r.log if kind == "submit" for s, d in [rest]]
    assert r.submitted == 10 and r.done == 10
    after, double = submits[1:5], submits[6:]  # the loop-starting submits are untimed
    assert all(s - d == 1 for s, d in after), after      # the previous run had finished
    assert all(s - d == 2 for s, d in double), double    # one run still queued ahead


def test_resident_wall_times_alternate_rounds_and_keep_replays_off_inflight_runs():
    r, events = FakeResident(), []
    r.log = events
    out = timing.resident_wall_times(r, lambda: events.append(("replay", r.submitted - r.done)),
                                     lambda: events.append(("sync",)), runs=3, rounds=2)
    assert len(out["resident"]) == len(out["replayed"]) == 2
    assert [e[1] for e in events if e[0] == "replay"] == [0] * 6  # nothing in flight
    kinds = [e[0] for e in events]
    assert kinds.count("replay") == 6 and kinds.count("sync") == 4


def test_resident_timing_loops_run_an_eager_resident():
    from framekv.graphs import GraphCache, forward_key
    from framekv.specs import Geometry

    cache = GraphCache("cpu")
    x = torch.randn(4)
    key = forward_key(1, Geometry(4, 16, 8, (4, 8)), 8, 4, {"x": x})
    calls = []
    cache.capture(key, lambda x: (calls.append(1), x + 1)[1], {"x": x})
    r = cache.resident(key)
    warmups = len(calls)
    out = timing.resident_submit_times(r, 3)
    assert len(out["after_wait"]) == 3 and r.completed == r.submitted == 8 == len(calls) - warmups
    r.close()


def test_rotated_rounds_start_each_variant_first_equally_often():
    from framekv.bench.timing import round_order

    names = ["a", "b", "c"]
    rounds = [round_order(names, r, True) for r in range(6)]
    assert rounds[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert sorted(o[0] for o in rounds) == ["a", "a", "b", "b", "c", "c"]
    assert all(sorted(o) == names for o in rounds)
    assert round_order(names, 4, False) == names and round_order([], 3, True) == []
