"""Faults injected between the commit kernels, run under numba's CUDA simulator (the
kernels' path on the CPU): the failed commit leaves the cache as before, and the next
forwards are exact against the fp32 exact-window reference."""
from __future__ import annotations

import pytest

from fault_harness import KERNEL_STEPS, Twin, commit_fails_at
from framekv import ops

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("step", sorted(KERNEL_STEPS))
def test_a_commit_failed_between_its_kernels_changes_nothing(monkeypatch, step):
    twin = Twin()
    assert ops.use_kernel(twin.cache.k_pool)  # the kernels' path, not the host upload
    commit_fails_at(monkeypatch, twin, step)
