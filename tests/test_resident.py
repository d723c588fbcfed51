"""ResidentGraph's host protocol on CPU, with a thread playing the device's gate.

`ThreadGate` runs, on a worker thread, what the parent graph of
`framekv.graphs.resident.device` runs on the device (the gate's waits and its
re-check before leaving, the run, the done counter), over a control block in host
memory. Hooks let a test act at the gate's decision points to replay the races.
"""
from __future__ import annotations

import gc
import queue
import threading
import time

import numpy as np
import pytest
import torch

from framekv.graphs import GraphCache, ResidentGraph, forward_key
from framekv.graphs.resident.protocol import (DONE, EXITED, EXITING, RING, RUNNING, SERVED,
                                              STATE, STOP, WORDS)
from framekv.specs import Geometry
from test_graphs import raises

G = Geometry(4, 16, 8, (4, 8))


class QueuedLoop:
    """A `ResidentLoop` whose launches queue parent-graph runs on a worker thread, in
    order, as launches on one stream do; subclasses define the parent (`_parent`)."""

    def __init__(self, run=None):
        self.control = np.zeros(WORDS, dtype=np.uint64)
        self.run = run
        self.served: list[int] = []
        self.launched = self.loops_ended = 0
        self.released = False
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, daemon=True)
        self._thread.start()

    def launch(self) -> None:
        self.launched += 1
        self._queue.put(True)

    def synchronize(self) -> None:
        self._queue.join()

    def release(self) -> None:
        self.released = True
        self._queue.put(None)
        self._thread.join(5)

    def _work(self) -> None:
        while self._queue.get() is not None:
            try:
                self._parent()
                self.loops_ended += 1
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _served(self, seq: int) -> None:
        """The IF body's work: the run (``run(seq)``), recorded."""
        if self.run is not None:
            self.run(seq)
        self.served.append(seq)

    def _parent(self) -> None:
        raise NotImplementedError


class ThreadGate(QueuedLoop):
    """The device loop on a thread: each launch() queues one parent-graph run.

    ``before_exit``: called when the gate is about to announce it leaves (the host may
    ring there, as if its store landed just before). ``blind``: the gate's re-check
    misses such a ring (a store still on its way), which the host must recover.
    """

    def __init__(self, idle_s: float, run=None, *, before_exit=None, blind: bool = False):
        super().__init__(run)
        self.idle_s, self.before_exit, self.blind = idle_s, before_exit, blind

    def _parent(self) -> None:  # WHILE loop { gate; IF run { child; done } }
        cb = self.control
        while self._gate():
            self._served(int(cb[SERVED]))
            cb[DONE] = cb[SERVED]

    def _gate(self) -> bool:
        cb = self.control
        served, t0 = int(cb[SERVED]), time.perf_counter()
        while True:
            if cb[STOP]:
                break
            if cb[RING] > served:
                cb[SERVED] = served + 1
                return True
            if time.perf_counter() - t0 > self.idle_s:
                if self.before_exit is not None:
                    self.before_exit()
                cb[STATE] = EXITING
                if cb[RING] > served and not cb[STOP] and not self.blind:
                    cb[STATE] = RUNNING
                    cb[SERVED] = served + 1
                    return True
                break
            time.sleep(1e-5)
        cb[STATE] = EXITED
        return False


def entry(device="cpu", after_replay=None):
    """A CPU cache's captured entry (fn doubles x into a static output)."""
    cache = GraphCache(device)
    x = torch.randn(8)
    k = forward_key(1, G, 8, 4, {"x": x})
    e = cache.capture(k, lambda x: x * 2, {"x": x}, after_replay=after_replay)
    return cache, k, e


def resident(gate: ThreadGate, after_replay=None, idle=0.05) -> ResidentGraph:
    _, _, e = entry(after_replay=after_replay)
    return ResidentGraph(e, idle_timeout_s=idle, loop=gate)


# ---------------------------------------------------------------------- runs
def test_runs_in_order_once_per_submit_with_one_launch():
    order = []
    gate = ThreadGate(0.5, run=lambda seq: order.append(seq))
    r = resident(gate)
    seqs = [r.submit() for _ in range(20)]
    assert seqs == list(range(1, 21))
    r.wait()
    assert order == seqs and gate.served == seqs
    assert (r.completed, r.launches, gate.launched) == (20, 1, 1)
    assert r.done(7) and r.done()
    r.close()
    assert gate.released and int(gate.control[STOP]) == 1 and r.state == "exited"
    assert r._cb is not gate.control and r.completed == 20  # read from a copy once freed


def test_submit_runs_the_host_hook_and_counts_a_hit():
    hooks = []
    gate = ThreadGate(0.5)
    r = resident(gate, after_replay=lambda: hooks.append(1))
    hits = r.entry.hits
    for _ in range(3):
        r.submit()
    assert len(hooks) == 3 and r.entry.hits == hits + 3
    r.close()


def test_done_is_false_while_a_run_is_in_flight():
    release = threading.Event()
    gate = ThreadGate(0.5, run=lambda seq: release.wait(5))
    r = resident(gate)
    r.submit()
    assert not r.done()
    release.set()
    r.wait()
    assert r.done(1)
    r.close()


def test_idle_exit_then_a_submit_relaunches():
    gate = ThreadGate(0.01)
    r = resident(gate, idle=0.01)
    r.submit()
    r.wait()
    deadline = time.perf_counter() + 5
    while r.state != "exited" and time.perf_counter() < deadline:
        time.sleep(0.005)
    assert r.state == "exited" and gate.loops_ended == 1
    r.submit()
    assert r.launches == 2  # by the submit itself, not by a later wait
    r.wait()
    assert (r.launches, gate.served) == (2, [1, 2])
    r.close()


def _ring_as_the_gate_leaves(blind: bool):
    """A runner whose gate, after run 1, gets the host's submit of run 2 just before it
    announces that it leaves (the host reads the gate running, so it does not launch);
    ``blind``: the gate's re-check misses that ring."""
    box: dict = {}

    def ring_once():
        if box.pop("armed", False):
            assert box["r"].state == "running"
            box["r"].submit()
            box["rang"] = True

    gate = ThreadGate(0.01, before_exit=ring_once, blind=blind)
    r = box["r"] = resident(gate, idle=0.01)
    r.submit()
    r.wait()
    box["armed"] = True
    _until(lambda: box.get("rang") and r.state in ("exited", "running") and
           (not blind or r.state == "exited"))
    return r, gate


def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while not cond():
        assert time.perf_counter() < deadline, "condition not reached"
        time.sleep(0.002)


def test_a_ring_stored_as_the_gate_leaves_is_served_by_its_recheck():
    r, gate = _ring_as_the_gate_leaves(blind=False)
    r.wait(2, timeout_s=5)
    assert gate.served == [1, 2] and r.launches == 1  # served without a relaunch
    r.close()


@pytest.mark.parametrize("finish", ["wait", "done", "close"])
def test_a_ring_the_leaving_gate_missed_is_recovered(finish):
    r, gate = _ring_as_the_gate_leaves(blind=True)
    assert (r.submitted, int(gate.control[SERVED]), r.state) == (2, 1, "exited")  # left behind
    if finish == "wait":
        r.wait(2, timeout_s=5)
    elif finish == "done":
        _until(lambda: r.done(2))
    r.close()
    assert gate.served == [1, 2] and r.launches == 2


def test_close_lets_submitted_runs_finish():
    gate = ThreadGate(0.5, run=lambda seq: time.sleep(0.005))
    r = resident(gate)
    for _ in range(5):
        r.submit()
    r.close()
    assert gate.served == [1, 2, 3, 4, 5] and r.completed == 5 and r.closed
    r.close()  # idempotent


def test_close_of_a_never_launched_loop_does_not_wait_for_it():
    gate = ThreadGate(0.5)
    r = resident(gate)
    r.close()
    assert gate.launched == 0 and gate.released


# ---------------------------------------------------------------------- errors
def test_wait_times_out_naming_the_counters():
    class Dead(ThreadGate):
        def launch(self):  # a device that never runs the loop
            self.launched += 1

    gate = Dead(0.5)
    r = resident(gate)
    r.submit()
    with raises(TimeoutError, "run 1 not done after 0.05 s", "submitted 1, served 0, done 0",
                "gate running"):
        r.wait(timeout_s=0.05)
    gate.release()


@pytest.mark.parametrize("bad", [0, -1.0, 61, True, "0.1", None])
def test_idle_timeout_must_be_a_positive_number(bad):
    _, _, e = entry()
    with raises(ValueError, "idle_timeout_s must be a number in (0, 60]", repr(bad)):
        ResidentGraph(e, idle_timeout_s=bad, loop=ThreadGate(0.1))


def test_a_graph_known_to_draw_random_numbers_is_refused():
    _, _, e = entry()
    e.draws_random = True  # what replays that moved the generator conclude
    with raises(ValueError, "draws random numbers", "would repeat the same numbers"):
        ResidentGraph(e, idle_timeout_s=0.5, loop=ThreadGate(0.5))
    e.draws_random = None  # unknown (no replay yet) is allowed
    ResidentGraph(e, idle_timeout_s=0.5, loop=ThreadGate(0.5)).close()


def test_seq_must_be_a_submitted_run_and_a_closed_runner_refuses():
    gate = ThreadGate(0.5)
    r = resident(gate)
    r.submit()
    r.submit()
    for bad in (3, -1, 1.5, True):
        with raises(ValueError, "seq must be a submitted run in [0, 2]", repr(bad)):
            r.wait(bad)
        with raises(ValueError, "seq must be a submitted run in [0, 2]"):
            r.done(bad)
    r.close()
    with raises(ValueError, "is closed"):
        r.submit()


# ---------------------------------------------------------------------- through the cache
def test_eager_entry_submits_call_the_callable():
    cache, k, e = entry()
    r = cache.resident(k)
    assert r.eager
    x = cache.get_static_inputs(k)["x"]
    x.copy_(torch.arange(8.0))
    assert r.submit() == 1
    out = r.wait()
    assert torch.equal(out, torch.arange(8.0) * 2) and r.completed == 1 and r.done(1)
    x.copy_(torch.full((8,), 3.0))
    r.submit()
    assert torch.equal(r.wait(), torch.full((8,), 6.0))
    r.close()


def test_cache_keeps_one_open_resident_per_key_and_drop_closes_it():
    cache, k, e = entry()
    r = cache.resident(k)
    with raises(ValueError, "already has an open ResidentGraph"):
        cache.resident(k)
    with pytest.raises(KeyError, match="no graph captured"):
        cache.resident(forward_key(2, G, 8, 4, {"x": torch.randn(8)}))
    cache.drop(k)
    assert r.closed and k not in cache
    cache2, k2, _ = entry()
    r2 = cache2.resident(k2)
    cache2.clear()
    assert r2.closed


def test_replay_refuses_while_a_graph_runs_resident_and_replays_again_once_closed():
    from test_graphs import FakeGraph

    _, _, e = entry()
    graph = FakeGraph()
    e.set_captured(graph, e.static_outputs)  # stands in for a captured graph
    r = ResidentGraph(e, idle_timeout_s=0.5, loop=ThreadGate(0.5))
    with raises(RuntimeError, "runs resident", "close it before replaying"):
        e.replay()
    r.close()
    e.replay()
    assert graph.replays == 1 and e.launcher is None  # torch's replay, as before


def test_closing_a_runner_gives_back_the_launcher_it_found():
    from test_graphs import FakeGraph

    _, _, e = entry()
    graph, launched = FakeGraph(), []
    e.set_captured(graph, e.static_outputs)
    e.launcher = direct = launched.append  # an opt-in launcher (a direct launch)
    r = ResidentGraph(e, idle_timeout_s=0.5, loop=ThreadGate(0.5))
    assert e.launcher is not direct
    r.close()
    e.replay()
    assert e.launcher is direct and launched == [e] and graph.replays == 0


def test_a_runner_dropped_without_close_gives_replays_back():
    from test_graphs import FakeGraph

    _, _, e = entry()
    graph = FakeGraph()
    e.set_captured(graph, e.static_outputs)
    r = ResidentGraph(e, idle_timeout_s=0.5, loop=ThreadGate(0.5))
    del r
    gc.collect()
    e.replay()
    assert graph.replays == 1


def test_state_names_follow_the_control_block():
    gate = ThreadGate(0.5)
    r = resident(gate)
    assert r.state == "not launched"
    r.submit()
    r.wait()
    assert r.state == "running"
    r._cb[STATE] = EXITED
    assert r.state == "exited"
    r.close()


def test_a_runner_dropped_without_close_stops_and_frees_its_loop():
    gate = ThreadGate(0.5)
    r = resident(gate)
    r.submit()
    r.wait()
    cb = gate.control
    del r
    gc.collect()
    assert gate.released and int(cb[STOP]) == 1 and gate.loops_ended == 1
