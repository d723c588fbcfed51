"""`AttentionStack` on CPU: chained and plain forwards, the whole-chunk program, its key."""
from __future__ import annotations

import pytest
import torch

from framekv import specs
from framekv.engine.attention.backend import attend_fp32
from framekv.bench.stack import AttentionStack, KVShape
from framekv.engine.cache.reference import visible_positions
from framekv.graphs import GraphCache

KV = KVShape(num_layers=3, num_kv_heads=2, head_dim=16, dtype="float32", tokens_per_page=4)
GEOM = specs.Geometry(5, 12, 8, (4, 8))
T = 8


def stack(**kw) -> AttentionStack:
    s = AttentionStack(KV, [GEOM], device="cpu", num_heads=4, **kw)
    s.ensure_open(GEOM)
    return s


def test_plain_forward_is_every_layer_over_the_same_input():
    s = stack()
    x = s.qkv_input(T)["qkv"]
    out, nxt = s.forward(x, T, 4)
    assert nxt is x and out.shape == (1, T, 4, 16)
    # Block 0 of 4 tokens at position 0 sees only itself: dense causal-block attention.
    q, k, v = x[0, :4, :4], x[0, :4, 4:6], x[0, :4, 6:]
    want = attend_fp32(q, k, v, s.layers[-1].scale)
    torch.testing.assert_close(out[0, :4], want, atol=1e-5, rtol=1e-5)
    s.cache.shutdown()


def test_chained_forward_feeds_each_layer_the_last_output():
    s = stack()
    x = s.qkv_input(T)["qkv"]
    out, nxt = s.forward(x, T, T, chain=True)
    manual = x
    for layer in s.layers:
        o = attend_fp32(manual[0, :, :4], manual[0, :, 4:6], manual[0, :, 6:], layer.scale)
        manual = (manual + o[None][:, :, [0, 1, 2, 3, 0, 1, 2, 3]]) * 0.5
    torch.testing.assert_close(nxt, manual, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], o, atol=1e-5, rtol=1e-5)
    s.cache.shutdown()


def test_chunk_commits_and_later_chunks_see_it():
    s = stack()
    xs = [s.qkv_input(T)["qkv"] for _ in range(3)]
    for i, x in enumerate(xs):
        denoised, clean = s.chunk(x, T, denoise_steps=2, clean_block=4)
        assert s.cache.committed_tokens == (i + 1) * T
        assert torch.isfinite(denoised).all() and torch.isfinite(clean).all()
    # The last clean block (positions 20..23) attends exactly its visible set V(j),
    # whose K/V every layer wrote from the same input (plain forwards).
    keys = torch.cat([x[0, :, 4:6] for x in xs])             # [24, H_kv, D]
    vals = torch.cat([x[0, :, 6:] for x in xs])
    vis = torch.tensor(visible_positions(GEOM, 2 * T, 2 * T + 4, 4))
    want = attend_fp32(xs[2][0, 4:, :4], keys[vis], vals[vis], s.layers[-1].scale)
    torch.testing.assert_close(clean[0, 4:], want, atol=1e-5, rtol=1e-5)
    s.cache.shutdown()


def test_chunk_key_bakes_steps_blocks_and_chaining():
    s = stack()
    plain = s.chunk_key(GEOM, T, denoise_steps=4, clean_block=4)
    assert plain.program == "chunk:4x8+clean4+commit"
    assert plain.block_sizes == (8, 8, 8, 8, 4)
    chained = s.chunk_key(GEOM, T, denoise_steps=4, clean_block=4, chain=True)
    assert chained.program == "chunk-chained:4x8+clean4+commit"
    assert chained.block_sizes == plain.block_sizes
    assert plain.inputs[0].shape == (1, T, 8, 16)
    changed = [s.chunk_key(GEOM, T, denoise_steps=3, clean_block=4),
               s.chunk_key(GEOM, T, denoise_steps=4, clean_block=8),
               s.chunk_key(GEOM, T, denoise_steps=4, clean_block=4, chain=True),
               s.chunk_key(specs.Geometry(5, 16, 8, (4, 8)), T, denoise_steps=4, clean_block=4)]
    assert len({plain, *changed}) == 5
    with pytest.raises(ValueError, match="block_sizes"):
        s.chunk_key(GEOM, T, denoise_steps=1, clean_block=2)  # not a geometry block size
    s.cache.shutdown()


def test_forward_and_commit_keys():
    s = stack()
    f = s.forward_key(GEOM, T, 4)
    assert (f.program, f.tokens, f.block_sizes, f.splits, f.packed) == ("forward", T, (4,), (), ())
    assert [i.name for i in f.inputs] == ["qkv"] and f.inputs[0].shape == (1, T, 8, 16)
    assert f.owner == s.owner and f != s.forward_key(GEOM, T, 8)
    c = s.commit_key(GEOM, T)
    assert (c.program, c.tokens, c.block_sizes, c.inputs) == ("commit:8", T, (), ())
    assert s.commit_key(GEOM, 4) != c
    s.cache.shutdown()


def test_chunk_request_runs_eagerly_on_cpu_with_the_whole_commit():
    s, graphs = stack(), GraphCache("cpu")
    req = s.chunk_request(GEOM, T, denoise_steps=1, clean_block=4, chain=True)
    assert req.key == s.chunk_key(GEOM, T, denoise_steps=1, clean_block=4, chain=True)
    out = graphs.run(req.key, req.fn, req.inputs, after_replay=req.after_replay)
    assert s.cache.committed_tokens == 3 * T  # two warm-up calls and the run, each a chunk
    assert len(out) == 2 and out[1].shape == (1, T, 4, 16)
    s.cache.shutdown()


def test_stack_needs_a_geometry():
    with pytest.raises(ValueError, match="at least one geometry"):
        AttentionStack(KV, [], device="cpu")


def test_for_preset_takes_the_model_heads_and_opens_the_geometry():
    from framekv.specs import load_preset

    s = AttentionStack.for_preset("tiny", device="cpu")
    tiny = load_preset("tiny")
    m = tiny.model
    assert s.kv == KVShape(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype, m.tokens_per_page)
    assert s.kv == KVShape.of(m) and s.num_heads == m.num_heads
    assert s.cache.geometry == tiny.rollout.geometry() and s.cache.committed_tokens == 0
    s.cache.shutdown()
