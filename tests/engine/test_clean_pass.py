"""A clean pass keeps only K/V: its last layer stages them and stops.

Nothing reads a clean pass's velocity, so its last block's attention, projection and
MLP (and the reference model's head) feed nothing. The rollouts skip them; what must
hold is that the K/V every later chunk reads are exactly those of the whole forward,
so whole rollouts are bit for bit what they were, and that a store which cannot skip
the attention still gets its K/V. A planted fault (the last layer's K/V not staged)
must not pass: the cache refuses to commit.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from framekv.engine import CausalKVCache, ForwardContext, ReferenceKV, WanRollout
from framekv.engine.attention import CachedAttention
from framekv.engine.attention.backend import ReferencePlan
from framekv.engine.model import CausalVideoDiT
from framekv.engine.rollout import Rollout
from framekv.engine.wan import CONFIGS, build_model
from framekv.specs import Geometry, load_preset

TINY = load_preset("tiny")


def _runs(monkeypatch):
    """Spy on the reference backend's launches: [(layer, tokens, block_size)]."""
    seen, run = [], ReferencePlan.run

    def spy(self, q, layer, out):
        seen.append((layer, self.tokens, self.block_size))
        return run(self, q, layer, out)
    monkeypatch.setattr(ReferencePlan, "run", spy)
    return seen


@pytest.mark.parametrize("glue", ["torch", "fused"])
def test_reference_rollout_unchanged_and_last_clean_attention_skipped(glue, monkeypatch):
    trimmed = Rollout("tiny", glue=glue, use_graphs=False)
    runs = _runs(monkeypatch)
    got = trimmed.run(3)
    L, steps = TINY.model.num_layers, TINY.rollout.denoising_steps
    tpf = TINY.rollout.tokens_per_frame
    clean = [r for r in runs if r[2] == tpf]
    assert [layer for layer, *_ in clean] == list(range(L - 1)) * 3    # no last layer
    assert len(runs) == 3 * (steps * L + L - 1)
    runs.clear()
    want = Rollout("tiny", glue=glue, use_graphs=False, model=trimmed.model,
                   trim_clean_pass=False).run(3)
    assert len(runs) == 3 * (steps + 1) * L
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _unstaged_last(only_frames: bool):
    """`ForwardContext.attention` with a planted fault: a last layer that stops (a
    forward kept for its K/V) stages nothing; ``only_frames``: not in a prompt forward
    (which has no rope frames)."""
    real = ForwardContext.attention

    def planted(self, attn, qkv, prologue=None, *, last=False):
        if last and not self.output and (self.frame0 is not None or not only_frames):
            return None                                   # the K/V never staged
        return real(self, attn, qkv, prologue, last=last)
    return planted


def test_a_last_layer_not_staged_is_refused_or_shows(monkeypatch):
    """The controls: without the last block's staging the prompt's commit refuses
    (nothing staged for it); a clean pass without it leaves the last denoising step's
    K/V at those positions, and the next chunks change."""
    good = Rollout("tiny", use_graphs=False).run(3)
    with monkeypatch.context() as m:
        m.setattr(ForwardContext, "attention", _unstaged_last(only_frames=False))
        last = TINY.model.num_layers - 1
        with pytest.raises(ValueError, match=rf"layers \[{last}\] staged \[0\]"):
            Rollout("tiny", use_graphs=False).run(1)
    monkeypatch.setattr(ForwardContext, "attention", _unstaged_last(only_frames=True))
    bad = Rollout("tiny", use_graphs=False).run(3)
    assert torch.equal(good[0], bad[0])                   # the first chunk reads no history
    assert max(float((a - b).abs().max()) for a, b in zip(good[1:], bad[1:])) > 1e-3


def test_graph_replay_with_the_trimmed_clean_pass_equals_eager():
    a = Rollout("tiny", use_graphs=True)
    b = Rollout("tiny", use_graphs=False, model=a.model)
    assert all(torch.equal(x, y) for x, y in zip(a.run(), b.run(), strict=True))


def test_a_store_that_cannot_skip_still_gets_the_last_kv():
    """ReferenceKV cannot skip: it attends, the model drops the output, and every
    layer's K/V are recorded, the last one's equal to what a whole forward records."""
    spec, tpf = TINY.model, TINY.rollout.tokens_per_frame
    m = CausalVideoDiT(spec, prompt_tokens=0)
    x = torch.randn(1, spec.in_channels, 2, spec.latent_height, spec.latent_width,
                    generator=torch.Generator().manual_seed(3))
    geometry = Rollout("tiny", use_graphs=False).geometry
    stores = [ReferenceKV(geometry, spec.num_layers) for _ in range(2)]
    outs = [m(x, torch.zeros(1), ForwardContext(kv, seq_len=2 * tpf, block_size=tpf,
                                                frame0=torch.tensor([0]), output=output))
            for kv, output in zip(stores, (True, False))]
    assert outs[0].shape == x.shape and outs[1] is None
    positions = np.arange(2 * tpf)
    for layer in range(spec.num_layers):
        (ka, va), (kb, vb) = (kv.reference.kv(layer, positions) for kv in stores)
        assert torch.equal(ka, kb) and torch.equal(va, vb) and ka.abs().max() > 0, layer


def _read(cache: CausalKVCache, layer: int, n: int):
    """K and V [n, H_kv, D] of positions [0, n) of sequence 0."""
    slots = torch.tensor([cache.slot_of(p) for p in range(n)])
    return cache.k_pool[layer][slots], cache.v_pool[layer][slots]


def test_cached_attention_output_false_stages_and_returns_none():
    H, Hkv, D, T = 4, 2, 8, 16
    g = Geometry(pin_tokens=0, window_tokens=32, max_staged_tokens=T, causal_block_sizes=(T,))
    caches = [CausalKVCache(num_layers=1, num_kv_heads=Hkv, head_dim=D, dtype=torch.float32,
                            tokens_per_page=8, device="cpu", pool_tokens=128) for _ in range(2)]
    attn = CachedAttention(H, Hkv, D, backend="reference", layer_idx=0)
    qkv = torch.randn(1, T, H + 2 * Hkv, D, generator=torch.Generator().manual_seed(5))
    outs = []
    for cache, output in zip(caches, (True, False)):
        cache.open(g)
        outs.append(attn(qkv.clone(), kv_cache=cache, seq_len=T, output=output))
        cache.commit(T)
    assert outs[0].shape == (1, T, H, D) and outs[1] is None
    (ka, va), (kb, vb) = (_read(c, 0, T) for c in caches)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert torch.equal(ka, qkv[0, :, H:H + Hkv]) and torch.equal(vb, qkv[0, :, H + Hkv:])
    with pytest.raises(ValueError, match="output=False needs a kv_cache"):
        attn(qkv, output=False)


@pytest.mark.parametrize("bad", [None, 1, "kv"])
def test_trim_clean_pass_must_be_a_bool(bad):
    with pytest.raises(ValueError, match=f"trim_clean_pass must be True or False, got {bad!r}"):
        Rollout("tiny", use_graphs=False, trim_clean_pass=bad)
    with pytest.raises(ValueError, match=f"trim_clean_pass must be True or False, got {bad!r}"):
        _wan(build_model("tiny", seed=0), trim_clean_pass=bad)


def test_output_false_needs_a_store():
    with pytest.raises(ValueError, match="output=False needs a K/V store"):
        ForwardContext(None, seq_len=None, frame0=torch.tensor([0]), output=False)


# ---------------------------------------------------------------- diffusers' Wan
TEXT = torch.randn(1, 7, CONFIGS["tiny"]["text_dim"], generator=torch.Generator().manual_seed(9))


def _wan(model, **kw):
    r = WanRollout(model, latent_size=(4, 4), frames_per_chunk=2, sink_frames=1,
                   window_frames=2, use_graphs=False, glue="fused", **kw)
    r.set_prompt(TEXT)
    return r


def _wan_chunks(r, n=4):
    gen = torch.Generator().manual_seed(1)
    return [r.step(torch.randn(1, 4, 2, 4, 4, generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("clean_block", ["chunk", "frame"])
def test_wan_rollout_unchanged_and_last_clean_attention_skipped(clean_block, monkeypatch):
    m = build_model("tiny", seed=0)
    runs = _runs(monkeypatch)
    r = _wan(m, clean_block=clean_block)
    seen = []
    r.recorder = lambda label, v: seen.append((label, v))
    got = _wan_chunks(r)
    assert [v is None for label, v in seen if label == "clean"] == [True] * 4
    L, steps = len(m.blocks), 4
    assert len(runs) == 4 * (steps * L + L - 1)
    runs.clear()
    want = _wan_chunks(_wan(m, clean_block=clean_block, trim_clean_pass=False))
    assert len(runs) == 4 * (steps + 1) * L
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_wan_last_layer_not_staged_shows_in_the_latents(monkeypatch):
    """The control: a clean pass whose last layer stages nothing leaves the last
    denoising step's K/V there, and the next chunks change."""
    m = build_model("tiny", seed=0)
    good = _wan_chunks(_wan(m))
    monkeypatch.setattr(ForwardContext, "attention", _unstaged_last(only_frames=True))
    bad = _wan_chunks(_wan(m))
    assert torch.equal(good[0], bad[0])
    assert max(float((a - b).abs().max()) for a, b in zip(good[1:], bad[1:])) > 1e-3

