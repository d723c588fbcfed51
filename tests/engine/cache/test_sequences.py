"""Many sequences on one pool (CPU, reference backend): exact per-sequence windows,
batches equal to sequences alone, bad ids refused without a change."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import CachedAttention, CausalKVCache
from framekv.specs import Geometry as G
from sequences_harness import batched_vs_alone, onehot_sequences, pool


@pytest.mark.parametrize("g,tpp,N", [
    (G(5, 13, 6, (2, 3, 6)), 4, 3),    # pin and window unaligned, three block sizes
    (G(8, 16, 8, (4, 8)), 8, 4),       # aligned
    (G(0, 7, 4, (1, 4)), 2, 3),        # no pin, one-token blocks
    (G(20, 3, 6, (3, 6)), 16, 2),      # window under a page, pin over forwards
])
def test_onehot_every_sequence_sees_exactly_its_own_window(g, tpp, N):
    seen = onehot_sequences(g, tpp, N=N, steps=45, seed=N)
    assert seen["resets"] >= 2 and seen["batches"] == set(range(1, N + 1))
    assert seen["max_commits"] >= 3


@pytest.mark.parametrize("packed,pad", [(True, 0), (False, 3), (True, 5)])
def test_onehot_packed_and_padded(packed, pad):
    onehot_sequences(G(5, 13, 6, (2, 3, 6)), 4, N=3, steps=25, seed=7, packed=packed, pad=pad)


@pytest.mark.parametrize("g,tpp,chunk,frame,N", [
    (G(6, 24, 12, (4, 12)), 4, 12, 4, 3),
    (G(3, 40, 8, (2, 8)), 8, 8, 2, 4),
    (G(0, 10, 9, (3, 9)), 2, 9, 3, 2),
])
def test_a_batch_equals_each_sequence_alone(g, tpp, chunk, frame, N):
    assert batched_vs_alone(g, tpp, N=N, chunks=10, chunk=chunk, frame=frame, seed=N) <= 1e-5


def test_one_sequence_pool_is_todays_cache():
    g, tpp = G(6, 24, 12, (4, 12)), 4
    assert CausalKVCache.pool_tokens_for(g, tpp, num_sequences=1) == \
        CausalKVCache.pool_tokens_for(g, tpp)
    assert CausalKVCache.pool_tokens_for(g, tpp, num_sequences=3) == \
        3 * CausalKVCache.pool_tokens_for(g, tpp)
    kw = dict(num_layers=30, num_kv_heads=12, head_dim=128, dtype=torch.bfloat16,
              tokens_per_page=tpp)
    one = CausalKVCache.pool_bytes_for(g, **kw)
    assert 3.9 * one < CausalKVCache.pool_bytes_for(g, **kw, num_sequences=4) < 4.1 * one
    cache = pool(g, tpp, 1, D=16)
    mod = CachedAttention(4, 2, 16)
    qkv = torch.randn(1, 12, 8, 16)
    a = mod(qkv, kv_cache=cache, seq_len=12, causal_block_size=4)
    b = mod(qkv, kv_cache=cache, seq_len=12, causal_block_size=4, sequences=[0])
    assert torch.equal(a, b)
    cache.commit(12)
    assert cache.committed_tokens == cache.sequence_committed_tokens(0) == 12


def test_a_pool_too_small_for_its_sequences_is_refused():
    g, tpp = G(6, 24, 12, (4, 12)), 4
    cache = CausalKVCache(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16,
                          tokens_per_page=tpp, device="cpu", num_sequences=3,
                          pool_tokens=CausalKVCache.pool_tokens_for(g, tpp, num_sequences=2))
    with pytest.raises(ValueError, match="x 3 sequences"):
        cache.open(g)
    assert not cache.is_open


BAD_IDS = [  # sequences are host ints, one type everywhere
    (lambda: [0, 3], r"in \[0, 3\)"),
    (lambda: [-1], r"in \[0, 3\)"),
    (lambda: [1, 1], "distinct"),
    (lambda: [0.0, 1.0], r"in \[0, 3\)"),
    (lambda: torch.tensor([0, 1]), "host ints"),
    (lambda: [0, 1, 2, 0], r"1 to 3 sequences"),
    (lambda: [], r"1 to 3 sequences"),
    (lambda: "0,1", "host ints"),
]


def _state(cache):
    return (cache.k_pool.clone(), cache.v_pool.clone(),
            [cache.sequence_committed_tokens(i) for i in range(3)],
            [cache.sequence_staged_tokens(i) for i in range(3)],
            [s.counters.clone() for s in cache._open.seqs])


def _same(a, b):
    return (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:4] == b[2:4]
            and all(torch.equal(x, y) for x, y in zip(a[4], b[4])))


@pytest.mark.parametrize("i", range(len(BAD_IDS)))
@pytest.mark.parametrize("call", ["attention", "commit", "reset"])
def test_bad_ids_are_clear_errors_that_change_nothing(i, call):
    g = G(6, 24, 12, (4, 12))
    cache = pool(g, 4, 3, D=16)
    mod = CachedAttention(4, 2, 16)
    ok = [2, 0]
    mod(torch.randn(2, 12, 8, 16), kv_cache=cache, seq_len=12, causal_block_size=12, sequences=ok)
    cache.commit(12, sequences=ok)
    mod(torch.randn(2, 12, 8, 16), kv_cache=cache, seq_len=12, causal_block_size=12, sequences=ok)
    before = _state(cache)
    make, match = BAD_IDS[i]
    ids = make()
    B = len(ids) if isinstance(ids, list) and 1 <= len(ids) <= 3 else 2
    with pytest.raises(ValueError, match=match):
        if call == "attention":
            mod(torch.randn(B, 12, 8, 16), kv_cache=cache, seq_len=12, causal_block_size=12,
                sequences=ids)
        elif call == "commit":
            cache.commit(12, sequences=ids)
        else:
            cache.reset_sequences(ids)
    assert _same(before, _state(cache))


def test_commit_moves_only_the_named_sequences_and_checks_each():
    g = G(6, 24, 12, (4, 12))
    cache = pool(g, 4, 3, D=16)
    mod = CachedAttention(4, 2, 16)
    mod(torch.randn(2, 12, 8, 16), kv_cache=cache, seq_len=12, causal_block_size=12,
        sequences=[1, 2])
    before = _state(cache)
    # Sequence 0 staged nothing: committing it with 1 and 2 fails for all three.
    with pytest.raises(ValueError, match="staged=0"):
        cache.commit(12, sequences=[1, 0, 2])
    assert _same(before, _state(cache))
    cache.commit(12, sequences=[2])
    assert [cache.sequence_committed_tokens(i) for i in range(3)] == [0, 0, 12]
    cache.reset_sequences([2])
    assert cache.sequence_committed_tokens(2) == 0 and cache.sequence_staged_tokens(1) == 12


def test_a_plan_prepared_for_other_sequences_is_refused():
    g = G(6, 24, 12, (4, 12))
    cache = pool(g, 4, 3, D=16)
    mod = CachedAttention(4, 2, 16)
    plan = mod.plan_for(cache, 12, 12, batch=2)
    plan.prepare([1, 2])
    qkv = torch.randn(2, 12, 8, 16)
    mod(qkv, kv_cache=cache, seq_len=12, causal_block_size=12, plan=plan, sequences=[1, 2])
    with pytest.raises(ValueError, match="prepared, with the sequences"):
        mod(qkv, kv_cache=cache, seq_len=12, causal_block_size=12, plan=plan,
            sequences=[2, 1])
    with pytest.raises(ValueError, match="plan is for a batch of 2"):
        plan.prepare([1])
    with pytest.raises(ValueError, match="batch 3"):
        mod(torch.randn(3, 12, 8, 16), kv_cache=cache, seq_len=12, causal_block_size=12,
            plan=plan)


def test_a_rollout_of_streams_equals_each_stream_alone():
    """Rollout(sequences=3): every sequence's chunks equal a one-sequence rollout fed the
    same noise, also after one sequence restarts mid-rollout (the sequences then sit at
    different chunks and frame positions)."""
    from framekv.engine import Rollout
    from framekv.engine.step import chunk_noise

    r = Rollout("tiny", device="cpu", sequences=3)
    alone = [Rollout("tiny", device="cpu", model=r.model) for _ in range(3)]
    r.prefill()
    for a in alone:
        a.prefill()
    worst, shape = 0.0, r.chunk_shape
    for chunk in range(5):
        if chunk == 2:
            r.prefill_rows([1])          # sequence 1 starts over under the model's prompt
            alone[1].reset()             # back to position 0 under its prompt
        noise = [chunk_noise(r.seed, i, shape, s) for s, i in enumerate(r.sequence_chunks)]
        frames = list(r.sequence_frames)
        out = r.step()                                               # [3, C, F, H, W]
        assert out.shape == (3, *shape)
        for s, a in enumerate(alone):
            want = a.chunk(noise[s][None], torch.tensor([frames[s]]))
            worst = max(worst, (out[s] - want[0]).abs().max().item())
    assert r.sequence_chunks == [5, 3, 5] and r.sequence_frames[1] == 3 * r.spec.frames_per_chunk
    assert r.kv.cache.sequence_committed_tokens(0) == alone[0].cache.committed_tokens
    assert r.kv.cache.sequence_committed_tokens(1) == alone[1].cache.committed_tokens
    assert worst <= 1e-5, worst
    # Each sequence draws its own noise; sequence 0's is the one-sequence rollout's.
    one = Rollout("tiny", device="cpu", model=r.model, use_graphs=False)
    one.prefill()
    many = Rollout("tiny", device="cpu", model=r.model, sequences=2, use_graphs=False)
    many.prefill()
    a, b = one.step(), many.step()
    assert torch.equal(a[0], b[0]) and not torch.equal(b[0], b[1])


def test_rollout_streams_refusals():
    from framekv.engine import Rollout

    with pytest.raises(ValueError, match="integer >= 1"):
        Rollout("tiny", device="cpu", sequences=0)
    with pytest.raises(ValueError, match="kv='paged'"):
        Rollout("tiny", device="cpu", sequences=2, kv="reference", use_graphs=False)
    r = Rollout("tiny", device="cpu")
    r.prefill()
    with pytest.raises(ValueError, match="batch sizes"):
        r.step_rows([0, 1], torch.zeros(2, *r.chunk_shape), [0, 0])


def test_chunk_noise_differs_by_seed_sequence_and_chunk():
    """Every (seed, sequence, chunk) draws its own noise, also for seeds whose shifted
    sums would share their low 32 bits (the generator reads only those), and the same
    triple draws the same noise again."""
    from framekv.engine.step import chunk_noise, noise_seed

    shape = (2, 3, 4)
    triples = [(0, 0, 0), (1, 0, 0), (1 << 8, 0, 0), (1 << 32, 0, 0), (0, 1, 0), (0, 0, 1),
               (1, 0, 1), (1 << 16, 0, 0), (2**63 - 1, 7, 3)]
    seeds = {noise_seed(seed, index, seq) for seed, seq, index in triples}
    assert len(seeds) == len(triples)
    draws = [chunk_noise(seed, index, shape, seq) for seed, seq, index in triples]
    for i in range(len(draws)):
        for j in range(i + 1, len(draws)):
            assert not torch.equal(draws[i], draws[j]), (triples[i], triples[j])
    assert torch.equal(chunk_noise(5, 2, shape, 1), chunk_noise(5, 2, shape, 1))
    assert all(0 <= s < 1 << 32 for s in seeds)


def test_runner_seed_changes_the_noise():
    """Two rollouts seeded differently start their chunks from different noise."""
    from framekv.engine import Rollout

    outs = []
    for seed in (0, 1):
        r = Rollout("tiny", device="cpu", use_graphs=False)
        r.seed = seed                    # the runner's attribute `step` reads
        r.prefill()
        outs.append(r.step())
    assert not torch.allclose(outs[0], outs[1])
