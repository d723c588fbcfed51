"""Faults injected between the commit kernels, run under numba's CUDA simulator (the
kernels' path on the CPU): the failed commit leaves the cache as before, and the next
forwards are exact against the fp32 exact-window reference."""
from __future__ import annotations

import pytest

from fault_harness import GEOMETRY, Fault, InjectedFault, Twin
from framekv import ops

pytestmark = pytest.mark.sim
M = GEOMETRY.max_staged_tokens


def half_copy(k_pool, v_pool, src, dst):
    n = src.shape[0] // 2
    COPY(k_pool, v_pool, src[:n], dst[:n])


COPY = ops.copy_kv_slots_
STEPS = {"after advancing the counters": ("advance_commit_", "after"),
         "after rotating the ring": ("rotate_rows_", "after"),
         "after rebuilding the layout": ("causal_layout_", "after"),
         "committed copies cut in the middle": ("copy_kv_slots_", half_copy)}


@pytest.mark.parametrize("step", sorted(STEPS))
def test_a_commit_failed_between_its_kernels_changes_nothing(monkeypatch, step):
    assert ops.use_kernel(Twin().cache.k_pool)  # the kernels' path, not the host upload
    twin = Twin()
    for _ in range(3):
        twin.chunk()
    twin.forward(M)
    C = twin.cache.committed_tokens
    name, when = STEPS[step]
    fault = Fault(getattr(ops, name), when=when)
    monkeypatch.setattr(ops, name, fault)
    with pytest.raises(InjectedFault):
        twin.cache.commit(M)
    assert fault.fired and twin.settle(C, M) == "before"
    monkeypatch.undo()
    twin.commit()
    twin.verify(chunks=2)
