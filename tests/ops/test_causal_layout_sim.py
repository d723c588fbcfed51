"""The commit kernels under numba's CUDA simulator: ``advance_commit_``, then
``rotate_rows_`` of the ring by ``counters[2:3]``, then ``causal_layout_``, against the
host model after every commit of a rollout (counters, table, every flat tensor).

Run in their own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``. The
simulator runs one Python thread per CUDA thread, so geometries are tiny; grids are
capped at 3 CTAs of 8 threads, so the grid- and thread-stride loops take several turns.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from framekv.engine.cache import HostLayout
from framekv.ops import _launch
from framekv.ops.causal_layout import causal_layout_
from test_causal_layout import (GEOMETRIES, OUTPUTS, assert_matches_host, device_state,
                                host_at, layout_kwargs, make_plan, random_plan, run_rollout)

pytestmark = pytest.mark.sim

SIM_GEOMETRIES = ("worked-example", "pin-over-forwards", "one-token-pages",
                  "big-pages-tiny", "window-under-a-page")


def test_kernels_run_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


@pytest.mark.parametrize("name", SIM_GEOMETRIES)
def test_kernels_equal_host_model(name):
    plan = make_plan(*GEOMETRIES[name])
    host = run_rollout(plan, 30, seed=zlib.crc32(name.encode()), scribble_every=4)
    assert host.committed > 0


def test_layout_kernel_at_random_states():
    """The layout kernel alone on random geometries and states, outputs scribbled."""
    rng = np.random.default_rng(11)
    for _ in range(4):
        plan = random_plan(rng)
        while sum(bp.num_blocks for bp in plan.blocks) > 12:  # keep the simulator fast
            plan = random_plan(rng)
        host = HostLayout(plan)
        for _ in range(3):
            M = plan.geometry.max_staged_tokens
            for _ in range(int(rng.integers(1, 6))):
                host.note_staged(M)
                host.commit(int(rng.integers(0, M + 1)))
            t = device_state(host, "cpu", garbage=int(rng.integers(-9, 100)))
            causal_layout_(*(t[k] for k in ("counters", "table", "desc") + OUTPUTS),
                           **layout_kwargs(plan))
            assert_matches_host(t, host)


@pytest.mark.parametrize("name", ["pin-over-forwards", "big-pages-tiny"])
def test_kernels_past_2_to_the_32(name):
    plan = make_plan(*GEOMETRIES[name])
    run_rollout(plan, 10, seed=5, scribble_every=3, host=host_at(plan, 2 ** 40 + 77, seed=6))


def test_advance_kernel_reads_n_from_a_tensor():
    """The kernel's tensor form: n read when it runs, 0 leaves C where it was."""
    from framekv.ops.advance_commit import advance_commit_, advance_commit_reference

    rng = np.random.default_rng(5)
    for _ in range(6):
        plan = random_plan(rng)
        kw = dict(pin_tokens=plan.geometry.pin_tokens, window_tokens=plan.geometry.window_tokens,
                  tokens_per_page=plan.tokens_per_page, fixed_pages=plan.fixed_pages)
        for n in (0, int(rng.integers(1, 200))):
            C, base0 = int(rng.integers(0, 400)), int(rng.integers(0, 50))
            got, want = torch.tensor([C, base0, 7, 3]), torch.tensor([C, base0, 7, 3])
            advance_commit_(got, torch.tensor([n]), **kw)
            advance_commit_reference(want, n, **kw)
            assert got.tolist() == want.tolist()
