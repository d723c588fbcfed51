"""ResidentGraph on a CUDA device: runs submitted by a host store equal eager calls.

The control block, the gate kernel (NVRTC), the conditional parent graph and its
idle exit, against eager arithmetic (a recurrent step) and against the eager seed
stack over 104 chunks, bit for bit.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from framekv.engine.attention.cudnn import CudnnBackend
from framekv.graphs import GraphCache, GraphKey
from test_graphs_gpu import recurrent_state, recurrent_step
from test_stack_gpu import FRAME, GEOM, KV, T, capture_chunk, chunk_input, make_pair

pytestmark = pytest.mark.gpu

DEV = "cuda"


def step(state, x):
    """`recurrent_step` at scale 1 (eager reference)."""
    return recurrent_step(state, x, torch.ones(1, device=DEV))


def same(got, want) -> bool:
    return all(torch.equal(got[k], want[k]) for k in want)


def captured(state, idle=0.05):
    """The recurrent step captured (scale 1 over ``state``), and a resident runner."""
    cache = GraphCache(DEV)
    x0 = {"x": torch.zeros(64, 256, device=DEV), "scale": torch.zeros(1, device=DEV)}
    key = GraphKey.build(owner=1, program="recurrent", inputs=x0)
    cache.capture(key, lambda x, scale: recurrent_step(state, x, scale), x0)
    # warm-up on zeros from h = 0 left h = 0; runs go at scale 1
    cache.get_static_inputs(key)["scale"].fill_(1)
    torch.cuda.synchronize()
    return cache, key, cache.resident(key, idle_timeout_s=idle)


def test_each_run_sees_the_inputs_written_before_its_submit():
    state, eager = recurrent_state(), recurrent_state()
    gen = torch.Generator(device=DEV).manual_seed(9)
    # The reference's kernels are loaded first: under lazy module loading a kernel's
    # first load waits for what runs on the device, here the polling loop's idle exit.
    warm = step(recurrent_state(), torch.randn(64, 256, device=DEV, generator=gen))
    assert same(warm, {k: v.clone() for k, v in warm.items()})  # torch.equal's kernels too
    cache, key, r = captured(state, idle=5.0)
    assert not r.eager
    x = cache.get_static_inputs(key)["x"]
    for i in range(20):
        xi = torch.randn(64, 256, device=DEV, generator=gen)
        x.copy_(xi)
        torch.cuda.current_stream().synchronize()  # the contract: inputs on the device
        r.submit()
        got = r.wait(timeout_s=10)
        want = step(eager, xi)
        assert same(got, want), f"run {i + 1}: resident output differs from eager"
    assert (r.completed, r.launches) == (20, 1)
    with pytest.raises(RuntimeError, match="runs resident"):
        cache.replay(key)
    r.close()
    assert same(cache.replay(key), step(eager, xi))  # replays again once closed


def test_submits_queue_without_waiting_and_close_lets_them_finish():
    state, eager = recurrent_state(), recurrent_state()
    cache, key, r = captured(state)
    x = cache.get_static_inputs(key)["x"]
    x.fill_(0.25)
    torch.cuda.synchronize()
    for _ in range(50):
        r.submit()
    r.close()  # drains the 50 runs, then stops the loop
    assert r.completed == 50
    for _ in range(50):
        want = step(eager, torch.full((64, 256), 0.25, device=DEV))
    assert torch.equal(state["h"], eager["h"]) and same(cache.get_static_outputs(key), want)


def test_the_loop_leaves_when_idle_and_the_next_submit_relaunches():
    state, eager = recurrent_state(), recurrent_state()
    cache, key, r = captured(state, idle=0.01)
    x = cache.get_static_inputs(key)["x"]
    x.fill_(-0.5)
    torch.cuda.synchronize()
    r.submit()
    r.wait()
    deadline = time.perf_counter() + 5
    while r.state != "exited" and time.perf_counter() < deadline:
        time.sleep(0.002)
    assert r.state == "exited"
    torch.cuda.synchronize()  # returns: nothing is left polling on the device
    r.submit()
    assert r.launches == 2
    got = r.wait()
    for _ in range(2):
        want = step(eager, torch.full((64, 256), -0.5, device=DEV))
    assert same(got, want)
    r.close()


def test_a_thread_that_never_used_cuda_submits_and_relaunches():
    state, eager = recurrent_state(), recurrent_state()
    cache, key, r = captured(state, idle=0.01)
    cache.get_static_inputs(key)["x"].fill_(0.125)
    torch.cuda.synchronize()
    errors = []

    def serve() -> None:  # no torch CUDA call on this thread: the loop makes the context
        try:
            for _ in range(2):
                r.submit()  # launches: the first, then after the idle exit
                r.wait()
                deadline = time.perf_counter() + 5
                while r.state != "exited" and time.perf_counter() < deadline:
                    time.sleep(0.002)
        except Exception as exc:  # reported on the test's thread
            errors.append(exc)

    worker = threading.Thread(target=serve)
    worker.start()
    worker.join(30)
    assert not errors, errors
    assert (r.completed, r.launches) == (2, 2)
    for _ in range(2):
        want = step(eager, torch.full((64, 256), 0.125, device=DEV))
    assert same(cache.get_static_outputs(key), want)
    r.close()


def test_seed_stack_resident_runs_equal_eager_bit_for_bit_over_104_chunks():
    eager, graphed, graphs = make_pair(KV, [GEOM], CudnnBackend())
    key = capture_chunk(graphs, graphed, GEOM)
    graphed.reset()
    graphed.cache.open(GEOM)
    r = graphs.resident(key)
    qkv = graphs.get_static_inputs(key)["qkv"]
    for index in range(104):
        if index == 60:  # a new rollout over the same tensors, as in the replay test
            for stack in (eager, graphed):
                stack.cache.close()
                stack.cache.open(GEOM)
        x = chunk_input(eager, index)
        want = eager.chunk(x, T, denoise_steps=1, clean_block=FRAME, chain=True)
        qkv.copy_(x)
        torch.cuda.current_stream().synchronize()
        r.submit()
        got = r.wait(timeout_s=30)
        for name, w, g in zip(("denoise", "clean"), want, got):
            if not torch.equal(w, g):
                err = (w.float() - g.float()).abs().max().item()
                pytest.fail(f"chunk {index}: resident {name} output differs from eager "
                            f"(max abs error {err:.3g})")
    assert eager.cache.committed_tokens == graphed.cache.committed_tokens == 44 * T
    r.close()
    torch.cuda.synchronize()
    assert int(graphed.cache._open.seqs[0].counters[0]) == 44 * T  # the device's own counter
    assert torch.equal(eager.cache.k_pool, graphed.cache.k_pool)
    assert torch.equal(eager.cache.v_pool, graphed.cache.v_pool)
    for stack in (eager, graphed):
        stack.cache.shutdown()
