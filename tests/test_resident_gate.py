"""The resident gate's own source, built for the host with g++, under ResidentGraph.

`framekv.graphs.resident.device` writes the gate and done kernels against a few FK_*
primitives; here they become host code (a steady clock, a yield, fences, and handle
values in an array) and a worker thread plays the parent graph around them:
``WHILE loop { gate; IF run { run; done } }``. So the protocol the device will run is
exercised on CPU: ordering, idle exit and relaunch, draining on close, and submits
racing the gate's exit, against the real code rather than a re-implementation.
"""
from __future__ import annotations

import ctypes
import random
import shutil
import subprocess
import time

import pytest

from framekv.graphs import ResidentGraph
from framekv.graphs.resident.device import kernel_source
from framekv.graphs.resident.protocol import SERVED
from test_resident import QueuedLoop, entry

HOST_PRELUDE = r"""
#include <atomic>
#include <chrono>
#include <thread>
typedef unsigned long long u64;
#define FK_KERNEL extern "C"
#define FK_INLINE static inline
#define FK_FENCE() std::atomic_thread_fence(std::memory_order_seq_cst)
#define FK_FENCE_SYSTEM() std::atomic_thread_fence(std::memory_order_seq_cst)
#define FK_PAUSE() std::this_thread::yield()
extern "C" { volatile u64 fk_handles[2]; }  // [loop, run]: the conditional handles' values
#define FK_SET(handle, value) (fk_handles[handle] = (value))
extern "C" { void (*fk_before_exit)(void) = 0; }  // set by a test
#define FK_BEFORE_EXIT() do { if (fk_before_exit) fk_before_exit(); } while (0)
FK_INLINE u64 fk_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count();
}
"""

LOOP, RUN = 0, 1


@pytest.fixture(scope="module")
def gate_lib(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("needs a C++ compiler (g++) to build the gate for the host")
    d = tmp_path_factory.mktemp("gate")
    src, lib = d / "gate.cc", d / "gate.so"
    src.write_text(kernel_source(HOST_PRELUDE))
    subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", "-o", str(lib), str(src)],
                   check=True, capture_output=True, text=True)
    so = ctypes.CDLL(str(lib))
    so.framekv_resident_gate.argtypes = [ctypes.c_void_p] + [ctypes.c_uint64] * 3
    so.framekv_resident_done.argtypes = [ctypes.c_void_p]
    return so


class HostGateLoop(QueuedLoop):
    """`ResidentLoop` whose parent graph runs on a worker thread around the built gate."""

    def __init__(self, so, idle_s: float, run=None):
        super().__init__(run)
        self.so, self.idle_ns = so, int(idle_s * 1e9)
        self.handles = (ctypes.c_uint64 * 2).in_dll(so, "fk_handles")

    def _parent(self) -> None:
        cb = self.control.ctypes.data
        self.handles[LOOP], self.handles[RUN] = 1, 0  # CU_GRAPH_COND_ASSIGN_DEFAULT
        while self.handles[LOOP]:
            self.so.framekv_resident_gate(cb, LOOP, RUN, self.idle_ns)  # GIL released
            if self.handles[RUN]:
                self._served(int(self.control[SERVED]))
                self.so.framekv_resident_done(cb)


def runner(so, idle_s: float, run=None) -> tuple[ResidentGraph, HostGateLoop]:
    _, _, e = entry()
    loop = HostGateLoop(so, idle_s, run)
    return ResidentGraph(e, idle_timeout_s=idle_s, loop=loop), loop


def test_built_gate_serves_each_submit_once_in_order(gate_lib):
    r, loop = runner(gate_lib, 1.0)
    for _ in range(50):
        r.submit()
    r.wait(timeout_s=10)
    assert loop.served == list(range(1, 51)) and r.completed == 50 and r.launches == 1
    r.close()
    assert r.state == "exited"


def test_built_gate_leaves_when_idle_and_a_submit_relaunches(gate_lib):
    r, loop = runner(gate_lib, 0.005)
    r.submit()
    r.wait(timeout_s=5)
    deadline = time.perf_counter() + 5
    while r.state != "exited" and time.perf_counter() < deadline:
        time.sleep(0.001)
    assert r.state == "exited"
    r.submit()
    assert r.launches == 2
    r.wait(timeout_s=5)
    assert loop.served == [1, 2]
    r.close()


def test_built_gate_drains_on_close(gate_lib):
    r, loop = runner(gate_lib, 1.0, run=lambda seq: time.sleep(0.002))
    for _ in range(8):
        r.submit()
    r.close()
    assert loop.served == list(range(1, 9)) and r.completed == 8


def test_built_gate_loses_no_submit_racing_its_exit(gate_lib):
    """Submits spaced around the idle limit land before, during and after the gate's
    exit; every one is served once, in order, whatever the interleaving."""
    rng = random.Random(5)
    r, loop = runner(gate_lib, 0.001)
    for _ in range(300):
        time.sleep(rng.choice([0.0, 0.0005, 0.0009, 0.001, 0.0011, 0.0015]))
        r.submit()
        if rng.random() < 0.3:
            r.wait(timeout_s=5)
    r.wait(timeout_s=5)
    assert loop.served == list(range(1, 301)), "a run was lost, repeated or reordered"
    assert 1 <= r.launches <= 300 and r.launches == loop.launched
    r.close()


HOOK = ctypes.CFUNCTYPE(None)


def test_built_gate_serves_a_ring_stored_just_before_it_announces_its_exit(gate_lib):
    """The host stores run 2's ring when the gate has seen none and is about to leave:
    the host reads the gate running (no launch); the gate's re-check must serve it."""
    box: dict = {}

    def before_exit():
        if box.pop("armed", False):
            assert box["r"].state == "running"
            box["r"].submit()

    hook = HOOK(before_exit)
    slot = ctypes.c_void_p.in_dll(gate_lib, "fk_before_exit")
    slot.value = ctypes.cast(hook, ctypes.c_void_p).value
    try:
        r, loop = runner(gate_lib, 0.005)
        box["r"] = r
        r.submit()
        r.wait(timeout_s=5)
        box["armed"] = True
        deadline = time.perf_counter() + 5
        while r.submitted < 2 and time.perf_counter() < deadline:
            time.sleep(0.001)
        r.wait(2, timeout_s=5)
        assert loop.served == [1, 2] and r.launches == 1  # served by the re-check
        r.close()
    finally:
        slot.value = None
