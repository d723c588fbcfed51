"""A bad stream never harms another: NaN or inf in one sequence's K/V reaches no other
sequence, neither beside it in a batch nor after it on the same pool slots; the runner
refuses non-finite prompts and noise, and its stream entry points refuse what they could
only coerce (a float frame0, noise of another chunk shape, rows of None).

The GPU variant of the pool-slot test runs the cuDNN backend (whose padding mask is a
-inf score inside a tile: a NaN V row left in a page would leak through 0 * NaN)."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import CausalKVCache, Rollout, WanRollout
from framekv.engine.attention import attend_fp32
from framekv.engine.kv import PagedKV, ReferenceKV
from framekv.engine.wan import CONFIGS, build_model
from framekv.engine.wan.attention import PromptKV
from framekv.specs import Geometry as G

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------- attention
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_masked_keys_contribute_nothing_whatever_they_hold(bad):
    """Masked K and V of NaN or inf give exactly the attention over the visible keys
    alone: a masked V row weighs 0, and 0 * NaN would be NaN."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 4, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2].contiguous(), v[:, :2].contiguous()              # GQA: 4 heads, 2 K/V
    mask = torch.tensor([True, True, False, True, False])
    want = attend_fp32(q, k[mask], v[mask], 0.5)
    k[~mask], v[~mask] = bad, bad
    got = attend_fp32(q, k, v, 0.5, key_mask=mask)
    assert torch.equal(got, want)
    assert v[~mask].isnan().all() or v[~mask].isinf().all()          # the input is untouched
    q1, k1, v1 = torch.ones(1, 1, 4), torch.ones(2, 1, 4), torch.randn(2, 1, 4, generator=gen)
    v1[1] = NAN
    out = attend_fp32(q1, k1, v1, 1.0, key_mask=torch.tensor([True, False]))
    assert torch.equal(out, v1[:1].float())


# ---------------------------------------------------------------------------- the pool
def _pool(N: int = 3) -> CausalKVCache:
    g = G(6, 24, 12, (4, 12))
    cache = CausalKVCache(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                          tokens_per_page=4, device="cpu", num_sequences=N,
                          pool_tokens=CausalKVCache.pool_tokens_for(g, 4, num_sequences=N) + 8)
    cache.open(g)
    return cache


def test_a_reset_zeroes_every_page_of_its_sequences_and_no_other():
    cache = _pool()
    pages = cache._open.plan.total_pages
    span = pages * cache.tokens_per_page                              # slots per sequence
    owned = slice(0, 3 * span)
    assert not cache.k_pool[:, owned].any() and not cache.v_pool[:, owned].any()  # open
    cache.k_pool.fill_(NAN)
    cache.v_pool.fill_(INF)
    cache.reset_sequences([2, 0])
    for i, zero in ((0, True), (1, False), (2, True)):
        k, v = cache.k_pool[:, i * span:(i + 1) * span], cache.v_pool[:, i * span:(i + 1) * span]
        assert (not k.any() and not v.any()) if zero else (k.isnan().all() and v.isinf().all())
    assert cache.k_pool[:, 3 * span:].isnan().all()                    # owned by none: kept
    g = cache.geometry
    cache.close()
    cache.open(g)
    assert not cache.k_pool[:, owned].any() and not cache.v_pool[:, owned].any()


def test_reset_sequences_needs_the_rows():
    cache = _pool()
    with pytest.raises(ValueError, match=r"sequences must name the sequences to reset .*"
                                         r"range\(3\)\), got None"):
        cache.reset_sequences(None)
    with pytest.raises(ValueError, match="got None"):
        PagedKV(cache, cache.geometry).reset_sequences(None)
    ref = ReferenceKV(G(6, 24, 12, (4, 12)), 2)
    with pytest.raises(ValueError, match="rows must be \\(0,\\), got None"):
        ref.reset_sequences(None)


# ---------------------------------------------------------------------------- rollouts
def _poison(r, rows) -> None:
    """NaN prompts for pool sequences ``rows`` past the runner's check (the model's own
    write), chunks run under them, then NaN in every K/V slot those sequences own."""
    r.kv.use_sequences(list(rows))
    bad = torch.full_like(r.default_prompt(), NAN)
    r.chunk_model.write_prompt(r.kv, tuple(rows), bad, rewrite=True)
    cache, span = r.cache, r.cache._open.plan.total_pages * r.cache.tokens_per_page
    for i in rows:
        cache.k_pool[:, i * span:(i + 1) * span] = NAN
        cache.v_pool[:, i * span:(i + 1) * span] = NAN


def slots_reused_after_nan(device: str, backend: str | None = None, chunks: int = 3):
    """4 sequences under NaN prompts, then reset: 4 ordinary sequences on the same slots
    against a fresh rollout of the same model, chunk by chunk."""
    r = Rollout("tiny", device=device, backend=backend, sequences=4)
    r.prefill()
    r.step()
    _poison(r, range(4))
    assert r.step().isnan().any() and r.step().isnan().any()          # the poison is in
    r.prefill_rows(range(4))             # reset, then the model's prompt: ordinary streams
    fresh = Rollout("tiny", device=device, sequences=4, model=r.model)
    fresh.prefill()
    return [(r.step(), fresh.step()) for _ in range(chunks)]


def test_slots_of_nan_sequences_serve_ordinary_ones_bit_for_bit():
    for got, want in slots_reused_after_nan("cpu"):
        assert got.isfinite().all() and torch.equal(got, want)


@pytest.mark.gpu
def test_slots_of_nan_sequences_serve_ordinary_ones_bit_for_bit_on_cudnn():
    for got, want in slots_reused_after_nan("cuda", "cudnn", chunks=4):
        assert got.isfinite().all() and torch.equal(got, want)


def test_a_nan_stream_beside_ordinary_ones_leaves_them_bit_for_bit():
    r = Rollout("tiny", device="cpu", sequences=3)
    fresh = Rollout("tiny", device="cpu", sequences=3, model=r.model)
    r.prefill()
    fresh.prefill()
    assert torch.equal(r.step(), fresh.step())          # the first step captures, then resets
    _poison(r, [1])
    for _ in range(3):
        got, want = r.step(), fresh.step()
        assert got[1].isnan().all()
        assert torch.equal(got[[0, 2]], want[[0, 2]])


def test_a_wan_stream_after_and_beside_a_nan_one_is_bit_for_bit(monkeypatch):
    kw = dict(latent_size=(4, 4), frames_per_chunk=2, sink_frames=2, window_frames=4,
              timesteps=(1000, 500), use_graphs=False, sequences=2, prompt_tokens=5)
    model = build_model("tiny", seed=3)
    r, fresh = WanRollout(model, **kw), WanRollout(model, **kw)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randn(5, CONFIGS["tiny"]["text_dim"], generator=gen)
    noise = [torch.randn(2, 4, 2, 4, 4, generator=gen) for _ in range(4)]
    for x in (r, fresh):
        x.prefill_rows([0, 1], prompt)
    r.kv.use_sequences([0])
    r.chunk_model.write_prompt(r.kv, (0,), torch.full_like(prompt, NAN), rewrite=True)
    for i in range(2):
        got, want = (x.step_rows([0, 1], noise[i], [2 * i] * 2) for x in (r, fresh))
        assert got[0].isnan().all() and torch.equal(got[1], want[1])
    for x in (r, fresh):
        x.prefill_rows([0], prompt)                                   # starts over
    for i, frame0 in ((2, [0, 4]), (3, [2, 6])):
        got, want = (x.step_rows([0, 1], noise[i], frame0) for x in (r, fresh))
        assert torch.equal(got, want)
    kept = [(p.k[1].clone(), p.v[1].clone()) for p in r.chunk_model.prompts]

    def fails(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(PromptKV, "write", fails)
    with pytest.raises(RuntimeError, match="injected"):
        r.prefill_rows([0], prompt)                 # reset, then a start that fails
    for p, (k, v) in zip(r.chunk_model.prompts, kept):   # no prompt left in the model
        assert not p.k[0].any() and not p.v[0].any()
        assert torch.equal(p.k[1], k) and torch.equal(p.v[1], v)
    with pytest.raises(ValueError, match=r"sequences without one: \[0\]"):
        r.step_rows([0, 1], noise[0], [0, 0])


# ---------------------------------------------------------------------------- checks
@pytest.fixture(scope="module")
def streams():
    r = Rollout("tiny", device="cpu", sequences=2, batch_sizes=[1, 2])
    r.prefill()
    return r


def _unchanged(r, call, match):
    before = ([r.cache.sequence_committed_tokens(i) for i in range(2)], list(r.sequence_chunks),
              r.cache.k_pool.clone(), list(r._prompts))
    with pytest.raises(ValueError, match=match):
        call()
    after = ([r.cache.sequence_committed_tokens(i) for i in range(2)], list(r.sequence_chunks),
             r.cache.k_pool, list(r._prompts))
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])
    assert all(a is b for a, b in zip(before[3], after[3]))


@pytest.mark.parametrize("bad", [NAN, INF])
def test_non_finite_prompts_and_noise_are_refused_before_anything_is_written(streams, bad):
    r, shape = streams, streams.chunk_shape
    prompt = r.default_prompt().clone()
    prompt[2, 3] = bad
    noise = torch.zeros(2, *shape)
    noise[1, 0, 1, 2, 3] = bad
    cases = [(lambda: r.set_prompt(prompt), "prompt must hold finite values only, got 1 NaN or inf"),
             (lambda: r.prefill_rows([1], prompt), "prompt must hold finite"),
             (lambda: r.prefill_rows([0], prompt[None], rewrite=True), "prompt must hold finite"),
             (lambda: r.step(noise), "noise must hold finite values only, got 1 NaN or inf of"),
             (lambda: r.step_rows([1, 0], noise, [0, 0]), "noise must hold finite")]
    for call, match in cases:
        _unchanged(r, call, match)


def test_stream_entry_points_refuse_what_they_would_have_to_coerce(streams):
    r, (C, F, H, W) = streams, streams.chunk_shape
    ok = torch.zeros(2, C, F, H, W)
    cases = [
        (lambda: r.step_rows([0, 1], torch.zeros(2, C, 7, H, W), [0, 0]),
         rf"noise must be a \[2, {C}, {F}, {H}, {W}\] tensor, got \[2, {C}, 7, {H}, {W}\]"),
        (lambda: r.chunk(torch.zeros(2, C, 7, H, W), torch.zeros(2, dtype=torch.int64)),
         rf"noise must be a \[2, {C}, {F}, {H}, {W}\] tensor, got \[2, {C}, 7, {H}, {W}\]"),
        (lambda: r.step_rows([0, 1], ok.long(), [0, 0]), "noise must be a floating-point tensor"),
        (lambda: r.step(ok.long()), "noise must be a floating-point tensor, got torch.int64"),
        (lambda: r.step_rows([0, 1], ok, [0.5, 3.0]), r"frame0 must be 2 integers >= 0 .*0\.5"),
        (lambda: r.step_rows([0, 1], ok, torch.tensor([0.0, 2.0])), "frame0 must be 2 integers"),
        (lambda: r.step_rows([0, 1], ok, [0]), "frame0 must be 2 integers"),
        (lambda: r.step_rows([0, 1], ok, [0, -2]), "frame0 must be 2 integers >= 0"),
        (lambda: r.step_rows([0, 1], ok, [True, 0]), "frame0 must be 2 integers"),
        (lambda: r.chunk(ok, torch.zeros(2)), r"frame0 must be an int64 \[2\] tensor"),
        (lambda: r.step_rows([0, 2], ok, [0, 0]), r"rows must name 1 to 2 sequences in \[0, 2\)"),
        (lambda: r.step_rows([1, 1], ok, [0, 0]), "rows must be distinct"),
        (lambda: r.step_rows(None, ok, [0, 0]), "rows must name as many sequences"),
        (lambda: r.prefill_rows([-1]), r"rows must name 1 to 2 sequences"),
        (lambda: r.prefill_rows(torch.tensor([0])), "rows must be host ints"),
        (lambda: r.prefill_rows(None), "rows must be host ints"),
        (lambda: r.prefill_rows([0], rewrite=1), "rewrite must be True or False, got 1"),
        (lambda: r.set_prompt(r.default_prompt(), recache="yes"), "recache must be True or False"),
    ]
    for call, match in cases:
        _unchanged(r, call, match)
    r.step_rows([0, 1], ok, torch.tensor([0, 0], dtype=torch.int32))   # integer tensors do
    r.step_rows([1], ok[:1], (4,))
