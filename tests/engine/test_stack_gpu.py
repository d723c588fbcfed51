"""Whole chunks of the seed geometry's 36-layer attention stack: graph replay against
eager, bit for bit, across the window filling, a close/reopen and two geometries."""
from __future__ import annotations

import pytest
import torch

from framekv import specs
from framekv.engine.attention.cudnn import CudnnBackend
from framekv.bench.stack import AttentionStack, KVShape
from framekv.graphs import GraphCache

pytestmark = pytest.mark.gpu

DEV = "cuda"
SEED = specs.load_preset("seed-bench")
KV = KVShape.of(SEED.model)
GEOM = SEED.rollout.geometry()
T, FRAME = GEOM.max_staged_tokens, SEED.rollout.tokens_per_frame
WINDOW_CHUNKS = GEOM.window_tokens // T


def chunk_input(stack: AttentionStack, index: int, scale: float = 1.0) -> torch.Tensor:
    """Fresh random packed QKV for chunk ``index`` (the same on every stack)."""
    gen = torch.Generator(device=DEV).manual_seed(1000 + index)
    return torch.randn(stack.qkv_shape(T), device=DEV, generator=gen).to(stack.dtype) * scale


def make_pair(kv, geometries, backend):
    """(eager stack, graphed stack, graph cache), both at position 0 of geometries[0]."""
    eager = AttentionStack(kv, geometries, device=DEV, num_heads=SEED.model.num_heads,
                           backend=backend)
    graphed = AttentionStack(kv, geometries, device=DEV, num_heads=SEED.model.num_heads,
                             backend=backend)
    for stack in (eager, graphed):
        stack.reset()
        stack.cache.open(geometries[0])
    return eager, graphed, GraphCache(DEV, debug=True)


def capture_chunk(graphs, stack, geometry, denoise_steps=1):
    req = stack.chunk_request(geometry, T, denoise_steps=denoise_steps, clean_block=FRAME,
                              chain=True)
    graphs.capture(req.key, req.fn, req.inputs, after_replay=req.after_replay)
    return req.key


def run_both(eager, graphed, graphs, key, index, denoise_steps=1):
    x = chunk_input(eager, index)
    want = eager.chunk(x, T, denoise_steps=denoise_steps, clean_block=FRAME, chain=True)
    got = graphs.replay(key, {"qkv": x})
    for name, w, g in zip(("denoise", "clean"), want, got):
        assert torch.isfinite(w).all(), f"chunk {index}: eager {name} output not finite"
        if not torch.equal(w, g):
            err = (w.float() - g.float()).abs().max().item()
            pytest.fail(f"chunk {index}: replayed {name} output differs from eager "
                        f"(max abs error {err:.3g})")


def test_seed_stack_replays_bit_for_bit_over_100_chunks_and_a_reopen():
    assert KV.num_layers == 36 and WINDOW_CHUNKS < 44  # the window fills in both parts
    eager, graphed, graphs = make_pair(KV, [GEOM], CudnnBackend())
    key = capture_chunk(graphs, graphed, GEOM)
    graphed.reset()  # capture ran the chunk: back to position 0
    graphed.cache.open(GEOM)
    for index in range(104):
        if index == 60:
            # close/open starts a new rollout at position 0 over the same tensors: the
            # graph captured before replays it (the window fills again)
            for stack in (eager, graphed):
                stack.cache.close()
                stack.cache.open(GEOM)
        run_both(eager, graphed, graphs, key, index)
    assert eager.cache.committed_tokens == graphed.cache.committed_tokens == 44 * T
    assert int(graphed.cache._open.seqs[0].counters[0]) == 44 * T  # the device's own counter
    assert torch.equal(eager.cache.k_pool, graphed.cache.k_pool)
    assert torch.equal(eager.cache.v_pool, graphed.cache.v_pool)
    s = graphs.stats()
    assert (s.graphs, s.captures, s.hits) == (1, 1, 104)
    for stack in (eager, graphed):
        stack.cache.shutdown()


def test_a_graph_is_never_served_for_another_geometry():
    short = specs.Geometry(GEOM.pin_tokens, GEOM.window_tokens // 4, T, GEOM.causal_block_sizes)
    kv = KV._replace(num_layers=4)
    eager, graphed, graphs = make_pair(kv, [GEOM, short], CudnnBackend())
    long_key = capture_chunk(graphs, graphed, GEOM)
    short_key = graphed.chunk_key(short, T, denoise_steps=1, clean_block=FRAME, chain=True)
    assert short_key != long_key and short_key not in graphs
    with pytest.raises(KeyError):
        graphs.replay(short_key)
    short_key2 = capture_chunk(graphs, graphed, short)
    assert short_key2 == short_key and len(graphs) == 2
    graphed.reset()
    for geometry, key in ((short, short_key), (GEOM, long_key)):
        for stack in (eager, graphed):
            stack.ensure_open(geometry)
        for index in range(2 * WINDOW_CHUNKS // 4 + 3):  # past the short window's fill
            run_both(eager, graphed, graphs, key, index)
    for stack in (eager, graphed):
        stack.cache.shutdown()


def test_plans_loaded_from_disk_give_the_built_plans_output(tmp_path):
    kv = KV._replace(num_layers=2)
    outputs = []
    for expect_loaded in (False, True):
        backend = CudnnBackend(plan_dir=tmp_path)
        stack = AttentionStack(kv, [GEOM], device=DEV, num_heads=SEED.model.num_heads,
                               backend=backend)
        stack.ensure_open(GEOM)
        x = chunk_input(stack, 0)
        outputs.append(stack.chunk(x, T, denoise_steps=1, clean_block=FRAME, chain=True))
        assert (backend.plans_loaded > 0) == expect_loaded
        assert (backend.plans_built == 0) == expect_loaded
        stack.cache.shutdown()
    assert len(list(tmp_path.glob("*.plan"))) == 2  # one per block size
    for built, loaded in zip(*outputs):
        assert torch.equal(built, loaded)
