"""The commit kernels on a CUDA GPU against the host model: ``advance_commit_``,
``rotate_rows_`` of the ring by ``counters[2:3]`` and ``causal_layout_`` over long
rollouts (the seed geometry included), every launch path, positions past 2**32, and the
commit sequence captured once in a CUDA graph and replayed for every later commit."""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from framekv.engine.cache import HostLayout
from test_causal_layout import (GEOMETRIES, assert_matches_host, commit_ops, device_state,
                                host_at, make_plan, random_plan, run_rollout)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
SEED_GEOMETRY = (512, 37824, 1576, (394, 1576), 32)
GPU_GEOMETRIES = {
    "seed": SEED_GEOMETRY,
    "seed-16-token-pages": (512, 37824, 1576, (394, 788, 1576), 16),
    "window-over-M": GEOMETRIES["window-over-M"],
    "pin-over-forwards": GEOMETRIES["pin-over-forwards"],
    "one-token-pages": GEOMETRIES["one-token-pages"],
    "128-token-pages": GEOMETRIES["128-token-pages"],
    "M-not-multiple-of-b": GEOMETRIES["M-not-multiple-of-b"],
}


@pytest.mark.parametrize("name", sorted(GPU_GEOMETRIES))
def test_kernels_equal_host_model(name):
    host = run_rollout(make_plan(*GPU_GEOMETRIES[name]), 2000, device=CUDA,
                       seed=zlib.crc32(name.encode()), scribble_every=97)
    assert host.committed > 0


@pytest.mark.parametrize("seed", range(8))
def test_kernels_random_geometries(seed, launch_mode):
    run_rollout(random_plan(np.random.default_rng(900 + seed)), 150, device=CUDA, seed=seed,
                scribble_every=5)


@pytest.mark.parametrize("name", ["seed", "one-token-pages", "128-token-pages"])
def test_kernels_past_2_to_the_32(name):
    plan = make_plan(*GPU_GEOMETRIES[name])
    run_rollout(plan, 100, device=CUDA, seed=3, host=host_at(plan, 2 ** 40 + 4321, seed=4))


def _capture(t, plan, n) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        commit_ops(t, plan, n)
    return graph


def _warm_up(t, plan, host, counts) -> None:
    """One eager commit per count on a side stream (compiles and loads the kernels
    before capture), mirrored on the host."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for n in counts:
            host.note_staged(n)
            host.commit(n)
            commit_ops(t, plan, n)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", ["seed", "window-over-M", "pin-over-forwards",
                                  "M-not-multiple-of-b", "one-token-pages"])
def test_captured_commit_replays(name):
    """Graphs of commit(n) for two constant n, captured once, replayed in a random
    order: after every replay the device state equals the host model's."""
    plan = make_plan(*GPU_GEOMETRIES[name])
    g = plan.geometry
    counts = (g.max_staged_tokens, g.causal_block_sizes[0])
    host = HostLayout(plan)
    t = device_state(host, CUDA)
    _warm_up(t, plan, host, counts)
    graphs = {n: _capture(t, plan, n) for n in counts}
    assert_matches_host(t, host, where="capture must not run the kernels")
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for r in range(300):
        n = counts[int(rng.random() < 0.3)]
        host.note_staged(n)
        shift = host.commit(n)
        graphs[n].replay()
        torch.cuda.synchronize()
        assert_matches_host(t, host, shift, where=f"replay {r}, n {n}")
