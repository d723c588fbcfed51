"""Faults with a device half, on the GPU: the commit kernels, the staging scatter, and a
captured whole-chunk graph whose replay is refused or fails. Each leaves the cache as
before; the next eager forwards are exact against the fp32 exact-window reference
(bf16 tolerance) and the next replayed chunks equal eager ones bit for bit."""
from __future__ import annotations

import types

import pytest
import torch

from fault_harness import (GEOMETRY, KERNEL_STEPS, InjectedFault, Twin, commit_fails_at,
                           first_scatter_fails)
from framekv.engine import Rollout

pytestmark = pytest.mark.gpu
M = GEOMETRY.max_staged_tokens


def cuda_twin() -> Twin:
    return Twin("cuda", torch.bfloat16, "cudnn", tol=2e-2, head_dim=64)


@pytest.mark.parametrize("step", sorted(KERNEL_STEPS))
def test_a_commit_failed_between_its_kernels_changes_nothing(monkeypatch, step):
    twin = cuda_twin()
    commit_fails_at(monkeypatch, twin, step, chunks=4)
    print(f"{step}: max error over the next forwards {max(twin.errors):.2e}")


def test_a_scatter_that_wrote_but_failed_to_note_is_not_committed(monkeypatch):
    faults = first_scatter_fails(monkeypatch)
    twin = cuda_twin()
    with pytest.raises(InjectedFault):
        twin.forward(M)
    assert faults[0].fired
    with pytest.raises(ValueError, match=r"staged=0"):
        twin.cache.commit(M)
    twin.verify()


def test_inputs_that_require_grad_never_reach_the_cuda_cache():
    twin = cuda_twin()
    twin.chunk()
    x = twin.qkv().requires_grad_(True)
    out = twin.attn[0](x, kv_cache=twin.cache, seq_len=M, causal_block_size=M)
    assert out.grad_fn is None and not twin.cache.k_pool.requires_grad
    twin.forward(M)
    twin.verify(chunks=2)


def _pair():
    r = Rollout("tiny", "cuda")
    eager = Rollout("tiny", "cuda", use_graphs=False, model=r.model)
    for x in (r, eager):
        x.prefill()
    return r, eager


def test_a_refused_replay_changes_nothing_and_later_chunks_replay_exactly():
    r, eager = _pair()
    for _ in range(3):
        assert torch.equal(r.step(), eager.step())
    key = r.capture_request(32).key
    static = r.graphs.get_static_inputs(key)
    before = {k: v.clone() for k, v in static.items()}
    with pytest.raises(ValueError, match="input 'noise'"):
        r.graphs.replay(key, {"frame0": torch.tensor([99], device="cuda"),
                              "noise": torch.zeros(1, 4, 8, 8, device="cuda")})
    assert all(torch.equal(static[k], v) for k, v in before.items())
    for _ in range(30):                               # the window slides several times
        assert torch.equal(r.step(), eager.step())


def test_a_failed_replay_leaves_the_cache_as_before_and_the_chunk_runs_again():
    r, eager = _pair()
    for _ in range(3):
        assert torch.equal(r.step(), eager.step())
    entry = r.graphs.get(r.capture_request(32).key)

    def refuse():
        raise InjectedFault("the launch failed")

    graph, entry.graph = entry.graph, types.SimpleNamespace(replay=refuse)
    C = r.cache.committed_tokens
    with pytest.raises(InjectedFault):
        r.step()
    assert r.cache.committed_tokens == C and r.chunk_index == 3
    entry.graph = graph
    for _ in range(30):
        assert torch.equal(r.step(), eager.step())
    torch.cuda.synchronize()
    assert int(r.cache._open.seqs[0].counters[0]) == r.cache.committed_tokens
