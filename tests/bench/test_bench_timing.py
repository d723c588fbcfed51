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


def test_rotated_rounds_start_each_variant_first_equally_often():
    from framekv.bench.timing import round_order

    names = ["a", "b", "c"]
    rounds = [round_order(names, r, True) for r in range(6)]
    assert rounds[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert sorted(o[0] for o in rounds) == ["a", "a", "b", "b", "c", "c"]
    assert all(sorted(o) == names for o in rounds)
    assert round_order(names, 4, False) == names and round_order([], 3, True) == []
