"""The reference model: shapes, deterministic weights, rotary positions, prompt prefill."""
from __future__ import annotations

import math

import msgspec
import pytest
import torch

from framekv.engine import CausalKVCache, ForwardContext, PagedKV, ReferenceKV
from framekv.engine.attention import cudnn_frontend_available
from framekv.engine.model import (CausalVideoDiT, default_backend, model_dtype, patchify,
                                  unpatchify)
from framekv.engine.model.blocks import Rope3D, apply_rope, rope_split
from framekv.specs import load_preset

TINY = load_preset("tiny")


def _model(spec=TINY.model, prompt=TINY.rollout.prompt_tokens, **kw):
    return CausalVideoDiT(spec, prompt_tokens=prompt, **kw)


def _latents(frames=2, seed=1):
    m = TINY.model
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, m.in_channels, frames, m.latent_height, m.latent_width, generator=g)


def _frame(i):
    return torch.tensor([i], dtype=torch.int64)


def _dense(i, recorder=None):
    """The context of a forward without a store: dense over its own tokens, at frame i."""
    return ForwardContext(None, seq_len=None, frame0=_frame(i), recorder=recorder)


def test_forward_shapes_and_packed_qkv():
    m, spec = _model(), TINY.model
    seen = []
    record = lambda layer, qkv, out, seq_len, b: seen.append((layer, qkv.shape, out.shape))  # noqa: E731
    x = _latents(frames=3)
    v = m(x, torch.ones(1), _dense(0, record))
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    S = 3 * spec.tokens_per_frame
    H, Hkv, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    assert seen == [(i, (1, S, H + 2 * Hkv, D), (1, S, H, D)) for i in range(spec.num_layers)]


def test_output_depends_on_time_and_input():
    m, x = _model(), _latents()
    v1, v0 = m(x, torch.ones(1), _dense(0)), m(x, torch.zeros(1), _dense(0))
    assert (v1 - v0).abs().max() > 1e-3                      # time conditioning acts
    assert (m(x * 2, torch.ones(1), _dense(0)) - v1).abs().max() > 1e-3


def test_same_seed_same_weights_and_outputs():
    a, b = _model(), _model()
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    x = _latents()
    assert torch.equal(a(x, torch.ones(1), _dense(3)), b(x, torch.ones(1), _dense(3)))
    c = _model(spec=msgspec.structs.replace(TINY.model, seed=1))
    assert not torch.equal(a.blocks[0].qkv.weight, c.blocks[0].qkv.weight)
    assert not torch.equal(a.prompt, c.prompt)


def test_weights_are_non_trivial():
    m = _model()
    for name, p in m.named_parameters():
        assert p.abs().max() > 0, name                       # nothing zero-initialised
    assert m.blocks[0].modulation.abs().max() < 1.0          # modulation starts small


def test_dtype_and_backend_follow_the_device():
    assert model_dtype(TINY.model, "cpu") == torch.float32
    assert model_dtype(TINY.model, "cuda") == torch.bfloat16
    fp16 = msgspec.structs.replace(TINY.model, dtype="float16")
    fp32 = msgspec.structs.replace(TINY.model, dtype="float32")
    assert model_dtype(fp16, "cuda") == torch.float16 and model_dtype(fp16, "cpu") == torch.float32
    assert model_dtype(fp32, "cuda") == torch.bfloat16
    cudnn = "cudnn" if cudnn_frontend_available() else "reference"  # the GPU extra is optional
    assert default_backend("cpu") == "reference" and default_backend("cuda") == cudnn


def test_patchify_round_trip():
    x = _latents(frames=3)
    tokens = patchify(x, TINY.model.patch_size)
    assert tokens.shape == (1, 3 * TINY.model.tokens_per_frame, TINY.model.patch_dim)
    assert torch.equal(unpatchify(tokens, 3, TINY.model), x)


@pytest.mark.parametrize("head_dim", [8, 16, 64, 128])
def test_rope_split_covers_head_dim_in_even_parts(head_dim):
    parts = rope_split(head_dim)
    assert sum(parts) == head_dim and all(p % 2 == 0 and p > 0 for p in parts)


def test_rope_positions_are_absolute_and_grow():
    rope = Rope3D(16, (2, 2), torch.device("cpu"))
    a0, a9 = rope.angles(_frame(0), 2)[0], rope.angles(_frame(9), 2)[0]    # [8, 8]
    df = rope.dims[0] // 2
    # Frame-axis angles follow the absolute frame; row/col angles do not move.
    assert torch.allclose(a9[:, :df] - a0[:, :df], 9 * rope.inv_freq[0].expand(8, -1))
    assert torch.equal(a9[:, df:], a0[:, df:])
    # Far into a rollout the angles stay exact (float64), and the rotation keeps norms.
    far = rope.angles(_frame(10**7), 1)
    assert float(far[0, 0, 0]) == 10**7 + 1 - 1 == 10**7
    # One row per sequence: each its own first frame.
    both = rope.angles(torch.tensor([0, 9]), 2)                       # [2, 8, 8]
    assert torch.equal(both[0], a0) and torch.equal(both[1], a9)
    q = torch.randn(1, 4, 2, 16)
    rq = apply_rope(q, *Rope3D.cos_sin(far))
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)


def test_rope_scores_depend_on_frame_distance_only():
    rope = Rope3D(16, (1, 1), torch.device("cpu"))
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(fq, fk):
        rq = apply_rope(q, *Rope3D.cos_sin(rope.angles(_frame(fq), 1)))
        rk = apply_rope(k, *Rope3D.cos_sin(rope.angles(_frame(fk), 1)))
        return float((rq * rk).sum())
    assert math.isclose(score(5, 2), score(1005, 1002), rel_tol=1e-4, abs_tol=1e-5)
    assert not math.isclose(score(5, 2), score(5, 4), rel_tol=1e-3)


def test_keys_carry_absolute_frames_while_chunk_outputs_are_shift_invariant():
    m, x = _model(), _latents()
    H = TINY.model.num_heads
    keys = {}
    for f in (0, 50):
        record = lambda layer, qkv, out, n, b, f=f: keys.setdefault((f, layer), qkv[0, :, H:].clone())  # noqa: E731
        keys[f] = m(x, torch.ones(1), _dense(f, record))
    # The K stored for later chunks depends on the absolute frame ...
    assert (keys[(0, 0)] - keys[(50, 0)]).abs().max() > 1e-3
    # ... while attention inside one chunk sees only frame distances.
    torch.testing.assert_close(keys[0], keys[50], atol=1e-4, rtol=1e-4)


def _cache(geometry, spec=TINY.model, num_layers=None):
    tpp = spec.tokens_per_page
    return CausalKVCache(num_layers=num_layers or spec.num_layers, num_kv_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim, dtype=torch.float32, tokens_per_page=tpp,
                         device="cpu", pool_tokens=CausalKVCache.pool_tokens_for(geometry, tpp))


@pytest.mark.parametrize("prompt", [6, 45])  # 45 > max_staged_tokens: staged in pieces
def test_prefill_commits_the_prompt_kv(prompt):
    rollout = msgspec.structs.replace(TINY.rollout, prompt_tokens=prompt)
    g = rollout.geometry()
    m = _model(prompt=prompt)
    cache = _cache(g)
    m.prefill(PagedKV(cache, g))
    assert cache.committed_tokens == prompt
    store = ReferenceKV(g, TINY.model.num_layers)
    m.prefill(store)
    ref = store.reference
    assert ref.committed == prompt
    for layer in range(TINY.model.num_layers):
        k, v = ref.kv(layer, list(range(prompt)))
        slots = torch.tensor([cache.slot_of(p) for p in range(prompt)])
        torch.testing.assert_close(cache.k_pool[layer][slots], k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.v_pool[layer][slots], v, atol=1e-5, rtol=1e-5)


def test_prefill_errors():
    g = TINY.rollout.geometry()
    m = _model()
    with pytest.raises(ValueError, match="kv must be a framekv.engine.kv.KVStore"):
        m.prefill(_cache(g))
    kv = PagedKV(_cache(g), g)
    m.prefill(kv)
    with pytest.raises(ValueError, match="at position 0, C = 6"):
        m.prefill(kv)
    with pytest.raises(ValueError, match="the prompt must hold pin_tokens=6 tokens, got 7"):
        _model(prompt=7).prefill(PagedKV(_cache(g), g))
    with pytest.raises(ValueError, match="prompt_tokens"):
        _model(prompt=-1)
