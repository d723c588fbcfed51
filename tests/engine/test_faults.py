"""Faults injected into every public mutation, on the CPU: the cache is left as before or
as after the call, never in between, and the next forwards are exact against the fp32
exact-window reference (`fault_harness.Twin.verify`). Prompt changes: `test_faults_prompt.py`.

The simulator suite (`test_faults_sim.py`) injects into the commit kernels' steps, the
GPU suite (`test_faults_gpu.py`) into the device halves and captured chunks.
"""
from __future__ import annotations

import pytest
import torch

from fault_harness import (GEOMETRY, LAYERS, Fault, InjectedFault, Twin, first_scatter_fails,
                           half_copy, patch_method)
from framekv import ops
from framekv.engine import CachedAttention, CausalKVCache, Rollout
from framekv.engine.cache import GeometryState, HostLayout
from framekv.engine.cache.sequences import PoolState

M = GEOMETRY.max_staged_tokens
COPY = ops.copy_kv_slots_  # the real op, for faults that do part of its work


def table_only(state):
    """A layout upload cut in the middle: the table written, the per-block tensors not."""
    state.table.copy_(torch.from_numpy(state.host.table))


def staged_twin(chunks: int = 4) -> Twin:
    """A twin past a full window, with one chunk's forwards staged and not committed."""
    twin = Twin()
    for _ in range(chunks):
        twin.chunk()
    twin.forward(M)
    twin.forward(min(GEOMETRY.causal_block_sizes))
    return twin


# ---------------------------------------------------------------------------- commit
COMMIT_FAULTS = {
    "host half, before it runs": lambda mp: patch_method(mp, HostLayout, "commit", Fault(None)),
    "between the host and device halves":
        lambda mp: patch_method(mp, PoolState, "commit_device", Fault(None)),
    "layout upload cut after the table":
        lambda mp: patch_method(mp, GeometryState, "upload_layout", Fault(None, when=table_only)),
    "committed copies cut in the middle": lambda mp: _patch_copy(mp, half_copy),
    "after the committed copies": lambda mp: _patch_copy(mp, "after"),
}


def _patch_copy(monkeypatch, when) -> Fault:
    fault = Fault(COPY, when=when)
    monkeypatch.setattr(ops, "copy_kv_slots_", fault)
    return fault


@pytest.mark.parametrize("retry", [False, True], ids=["forward-again", "retry-commit"])
@pytest.mark.parametrize("point", sorted(COMMIT_FAULTS))
def test_a_failed_commit_changes_nothing(monkeypatch, point, retry):
    twin = staged_twin()
    before = (twin.cache.committed_tokens, twin.cache.staged_tokens)
    fault = COMMIT_FAULTS[point](monkeypatch)
    with pytest.raises(InjectedFault):
        twin.cache.commit(M)
    assert fault.fired
    assert twin.settle(before[0], M) == "before"
    assert (twin.cache.committed_tokens, twin.cache.staged_tokens) == before
    monkeypatch.undo()
    if retry:  # the same commit again, with no forward in between
        twin.commit()
    twin.verify()


# ---------------------------------------------------------------------------- staging
def test_a_forward_that_failed_between_layers_cannot_be_committed(monkeypatch):
    twin = staged_twin()
    C = twin.cache.committed_tokens
    twin.commit()
    twin.forward_layer(0, M)                                        # layer 0 staged
    patch_method(monkeypatch, CausalKVCache, "write_staged", Fault(None))
    with pytest.raises(InjectedFault):
        twin.forward_layer(1, M)                                    # layer 1 raised
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"every layer to have staged 8 tokens.*layers \[1\]"):
        twin.cache.commit(M)
    assert twin.cache.committed_tokens == C + M
    twin.verify()


def test_a_scatter_that_wrote_but_failed_to_note_is_not_committed(monkeypatch):
    faults = first_scatter_fails(monkeypatch)
    twin = Twin()
    with pytest.raises(InjectedFault):
        twin.forward(M)                                  # layer 0's scatter wrote, then raised
    assert faults[0].fired and twin.cache.staged_tokens == 0
    with pytest.raises(ValueError, match="n must be an integer in \\[0, staged=0\\]"):
        twin.cache.commit(M)
    twin.verify()


# ---------------------------------------------------------------------------- edits
@pytest.mark.parametrize("when", ["after", "half"])
def test_a_failed_write_range_puts_every_slot_back(monkeypatch, when):
    twin = staged_twin()
    twin.commit()
    real = ops.scatter_kv_slots_

    def half(k_pool, v_pool, k, v, dst, dst2=None, src_rows=None):
        n = dst.shape[0] // 2
        real(k_pool, v_pool, k, v, dst[:n], None, src_rows[:n])

    monkeypatch.setattr(ops, "scatter_kv_slots_", Fault(real, when="after" if when == "after" else half))
    start = twin.cache.committed_tokens - 6                 # committed, with private copies
    k = torch.full((5, 2, twin.head_dim), 7.0)
    with pytest.raises(InjectedFault):
        twin.cache.write_range(1, start, k, -k)
    monkeypatch.undo()
    twin.verify()


def test_a_failed_zero_values_puts_every_slot_back(monkeypatch):
    twin = staged_twin()
    twin.commit()
    real = torch.Tensor.index_fill_

    def half(self, dim, index, value):
        return real(self, dim, index[:index.shape[0] // 2], value)

    patch_method(monkeypatch, torch.Tensor, "index_fill_", Fault(None, when=half))
    with pytest.raises(InjectedFault):
        twin.cache.zero_values(0, twin.cache.committed_tokens - 6, 6)
    monkeypatch.undo()
    twin.verify()


# ---------------------------------------------------------------------------- open
def test_a_failed_open_leaves_the_cache_closed_and_the_next_open_exact(monkeypatch):
    twin = staged_twin()
    twin.cache.close()
    patch_method(monkeypatch, GeometryState, "upload_layout", Fault(None, when=table_only))
    with pytest.raises(InjectedFault):
        twin.cache.open(GEOMETRY)
    assert not twin.cache.is_open
    monkeypatch.undo()
    twin.cache.open(GEOMETRY)
    fresh = Twin(seed=3)
    fresh.cache.shutdown()
    fresh.cache = twin.cache            # position 0 again: a fresh reference to match
    fresh.verify()


# ---------------------------------------------------------------------------- rollouts
def _rollout_pair(**kw):
    a = Rollout("tiny", **kw)
    b = Rollout("tiny", use_graphs=False, model=a.model)
    return a, b


def _same(a, b):
    assert max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) == 0.0


def test_a_chunk_that_failed_midway_is_run_again_exactly(monkeypatch):
    r, twin = _rollout_pair()
    want = twin.run(6)
    got = r.run(2)
    fault = patch_method(monkeypatch, CachedAttention, "forward", Fault(None, at=5))
    with pytest.raises(InjectedFault):
        r.step()                                           # its third forward's first layer
    assert fault.fired and r.chunk_index == 2
    monkeypatch.undo()
    got += [r.step() for _ in range(4)]
    _same(got, want)


def test_a_failed_reset_is_retried_and_the_rollout_is_exact(monkeypatch):
    r, twin = _rollout_pair()
    r.run(3)
    patch_method(monkeypatch, GeometryState, "upload_layout", Fault(None, when=table_only))
    with pytest.raises(InjectedFault):
        r.reset()
    monkeypatch.undo()
    r.reset()
    _same(r.run(4), twin.run(4))


def test_a_failed_capture_keeps_earlier_graphs_and_the_rollout_exact(monkeypatch):
    import msgspec
    from framekv.specs import load_preset

    tiny = load_preset("tiny")
    spec = (tiny.model, msgspec.structs.replace(tiny.rollout, chunks=4, last_chunk_frames=1))
    r = Rollout(spec)
    twin = Rollout(spec, use_graphs=False, model=r.model)
    chunk = r.chunk
    calls = []

    def second_length_fails(noise, frame0):
        calls.append(noise.shape[2])                                # frames
        if noise.shape[2] == 1:
            raise InjectedFault("capture of the short chunk")
        return chunk(noise, frame0)

    monkeypatch.setattr(r, "chunk", second_length_fails)
    with pytest.raises(Exception, match="capture of the short chunk"):
        r.capture(progress=False)
    assert len(r.graphs) == 1 and r.cache.committed_tokens == 0 and 1 in calls
    monkeypatch.undo()
    _same(r.run(), twin.run())                      # the first step captures what is missing
    assert len(r.graphs) == 2


def test_every_layer_commit_needs_every_layer_on_a_fresh_cache():
    twin = Twin()
    twin.forward_layer(0, M)
    with pytest.raises(ValueError, match=r"layers \[1\] staged \[0\]"):
        twin.cache.commit(M)
    assert twin.cache.committed_tokens == 0
    for layer in range(LAYERS):
        twin.forward_layer(layer, M)
    twin.commit()
    twin.verify()

