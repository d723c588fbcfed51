"""Many sequences on one pool on the H200: the cuDNN backend's isolation, batches against
sequences alone, graphs of batched forwards and commits, what a pool maps."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import CachedAttention, CausalKVCache
from framekv.specs import Geometry as G
from sequences_harness import batched_vs_alone, onehot_sequences, pool

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.mark.parametrize("g,tpp,N", [
    (G(5, 13, 6, (2, 3, 6)), 4, 3),
    (G(8, 16, 8, (4, 8)), 8, 4),
    (G(20, 3, 6, (3, 6)), 16, 2),
    (G(3, 40, 12, (4, 12)), 32, 3),
])
@pytest.mark.parametrize("split", [1, 3])
def test_cudnn_onehot_every_sequence_sees_exactly_its_own_window(g, tpp, N, split):
    from framekv.engine.attention.cudnn import CudnnBackend

    seen = onehot_sequences(g, tpp, N=N, steps=40, seed=N, dtype=BF16, device="cuda",
                            backend=CudnnBackend(split=split), tol=2e-3, packed=split == 3)
    assert seen["resets"] >= 1 and seen["batches"] == set(range(1, N + 1))


@pytest.mark.parametrize("g,tpp,chunk,frame,N", [
    (G(64, 1536, 256, (64, 256)), 32, 256, 64, 4),
    (G(77, 1100, 192, (48, 192)), 16, 192, 48, 3),
])
def test_cudnn_batch_equals_each_sequence_alone(g, tpp, chunk, frame, N):
    err = batched_vs_alone(g, tpp, N=N, chunks=8, chunk=chunk, frame=frame, seed=N, H=8, Hkv=2,
                           D=128, dtype=BF16, device="cuda", backend="cudnn")
    print(f"batched vs alone, cuDNN bf16: max |diff| {err:.3e}")
    assert err <= 2e-2


def test_pool_bytes_for_equals_driver_allocation_with_sequences():
    g, tpp = G(512, 37824, 1576, (394, 1576)), 32
    kw = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype=BF16, tokens_per_page=tpp)
    small = G(1, 1, 1, (1,))                 # one-time costs first, an open's included
    warm = CausalKVCache(**kw, device="cuda", num_sequences=2,
                         pool_tokens=CausalKVCache.pool_tokens_for(small, tpp, num_sequences=2))
    warm.open(small)
    warm.shutdown()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    cache = CausalKVCache(**kw, device="cuda", num_sequences=3,
                          pool_tokens=CausalKVCache.pool_tokens_for(g, tpp, num_sequences=3))
    cache.open(g)
    torch.cuda.synchronize()
    used = free0 - torch.cuda.mem_get_info()[0]
    want = CausalKVCache.pool_bytes_for(g, **kw, num_sequences=3)
    print(f"pool_bytes_for(num_sequences=3) {want}, driver measured {used}")
    assert used == want == cache.pool_bytes
    cache.shutdown()


def test_batched_chunk_graphs_replay_bit_for_bit_as_streams_leave_and_join():
    """Rollout(sequences=4) through whole-chunk graphs against the same rollout run
    eagerly, 52 chunks; streams restart (leave and join) along the way."""
    from framekv.engine import Rollout

    graphed = Rollout("tiny", device="cuda", sequences=4)
    eager = Rollout("tiny", device="cuda", sequences=4, use_graphs=False, model=graphed.model)
    graphed.prefill()
    eager.prefill()
    for chunk in range(52):
        if chunk % 9 == 4:
            for r in (graphed, eager):
                r.prefill_rows([chunk % 4, (chunk + 1) % 4])   # they start over
        a, b = graphed.step(), eager.step()
        assert graphed.path == "graphs", chunk
        assert torch.equal(a, b), f"chunk {chunk}: max |diff| {(a - b).abs().max().item()}"
    assert graphed.sequence_chunks == eager.sequence_chunks
    assert len(set(graphed.sequence_chunks)) > 1
    assert graphed.graphs.stats().captures == 1  # one graph for every chunk of every stream


def test_one_captured_forward_and_commit_serve_any_choice_of_sequences():
    """A forward + commit over B = 2 of N = 4 sequences captured once; replays with other
    ids in the static buffer equal eager calls on a twin pool, bit for bit."""
    g, tpp, N, H, Hkv, D = G(40, 300, 96, (24, 96)), 32, 4, 8, 2, 128
    caches = [pool(g, tpp, N, layers=2, Hkv=Hkv, D=D, dtype=BF16, device="cuda") for _ in range(2)]
    mods = [CachedAttention(H, Hkv, D, backend="cudnn", layer_idx=i) for i in range(2)]
    qkv = torch.zeros(2, 96, H + 2 * Hkv, D, device="cuda", dtype=BF16)
    out = torch.zeros(2, 2, 96, H, D, device="cuda", dtype=BF16)

    def step(cache, x, seqs):
        for layer, mod in enumerate(mods):
            out[layer].copy_(mod(x, kv_cache=cache, seq_len=96, causal_block_size=24,
                                 sequences=seqs))
        cache.commit(96, sequences=seqs)

    graphed, twin = caches
    step(graphed, qkv, [0, 1])                   # warm-up: plans, kernels, checks
    graphed.reset_sequences([0, 1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):                # the rows in use are a device buffer
        step(graphed, qkv, [0, 1])
    graphed.reset_sequences([0, 1])              # the capture ran the host half once
    gen = torch.Generator(device="cuda").manual_seed(0)
    choices = [(0, 1), (2, 3), (3, 0), (1, 2), (0, 2), (3, 1)] * 3
    for n, pick in enumerate(choices):
        qkv.copy_(torch.randn(qkv.shape, generator=gen, device="cuda"))
        graphed.use_sequences(pick)              # written into the buffer the graph reads
        graph.replay()
        graphed.note_staged(96)
        graphed.commit_host(96)
        got = out.clone()
        step(twin, qkv, list(pick))
        assert torch.equal(got, out), f"replay {n} with sequences {pick}"
    for i in range(N):
        assert graphed.sequence_committed_tokens(i) == twin.sequence_committed_tokens(i)
        assert torch.equal(graphed._open.seqs[i].counters, twin._open.seqs[i].counters)
