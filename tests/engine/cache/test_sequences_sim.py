"""Many sequences under numba's CUDA simulator: the batched staging scatter and the pool
commit (every sequence's counters advanced by its own device-read count, its ring
rotated, its layout rebuilt) through the kernels, checked by the one-hot test.

Run in their own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``.
"""
from __future__ import annotations

import pytest
import torch

from framekv.ops import _launch
from framekv.specs import Geometry as G
from sequences_harness import onehot_sequences

pytestmark = pytest.mark.sim


def test_kernels_run_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


@pytest.mark.parametrize("g,tpp,N", [(G(5, 13, 6, (2, 3, 6)), 4, 3), (G(0, 7, 4, (1, 4)), 2, 2)])
def test_pool_commit_kernels_keep_every_window_exact(g, tpp, N):
    seen = onehot_sequences(g, tpp, N=N, steps=14, seed=3, D=32, Hkv=2)
    assert seen["batches"] == set(range(1, N + 1))
