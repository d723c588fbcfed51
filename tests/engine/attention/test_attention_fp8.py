"""The cuDNN backend over an fp8 e4m3 pool, on CPU (`cudnn_fake`): the graphs it defines
(cuDNN's fp8 SDPA, its scalars and outputs), the layouts it picks (ragged Q where the
cuDNN takes it), the folded scales, Q quantized by the plan or staged by the fused
prologue, the dequantizing merge, and the refusals; outputs against the fp32 reference
over the same pool."""
from __future__ import annotations

import functools
import types

import pytest
import torch

from cudnn_fake import FakeCudnnBackend, define
from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.attention.backend import ReferenceBackend
from framekv.engine.attention.cudnn import CudnnBackend
from framekv.engine.attention.cudnn_fp8 import FP8_MAX, O_MARGIN, P_SCALE
from framekv.engine.attention.cudnn_graph import FP8_SCALARS, UID, PagedGraphKey
from framekv.ops import qk_norm_rope_stage_
from framekv.specs import Geometry as G

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
H, HKV, D = 6, 2, 16


def key(**kw):
    base = dict(device=0, dtype=str(FP8), num_blocks=2, block_size=12, num_heads=H,
                num_kv_heads=HKV, head_dim=D, q_strides=(0, (H + 2 * HKV) * D, D),
                o_strides=(12 * H * D, H * D, D), num_pages=40, tokens_per_page=4,
                row_pages=9, scale=0.25, splits=2)
    return PagedGraphKey(**{**base, **kw})


# --------------------------------------------------------------------------- graphs

@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_key_defines_cudnns_fp8_sdpa_with_its_scalars(splits):
    g = define(key(splits=splits, num_blocks=splits))
    assert g.io_data_type == "FP8_E4M3"
    [(op, kw)] = g.ops
    assert op == "sdpa_fp8"
    t = {x.name: x for x in g.tensors}
    for name in ("q", "k", "v"):
        assert t[name].data_type == "FP8_E4M3"
    assert t["q"].dim == [splits, H, 12, D] and t["q"].stride == [0, D, (H + 2 * HKV) * D, 1]
    assert t["k"].dim == [40, HKV, 4, D] and t["k"].stride == [4 * HKV * D, D, HKV * D, 1]
    for name in FP8_SCALARS:  # each an fp32 [1, 1, 1, 1] input, passed by its own name
        assert kw[name] is t[name] and t[name].uid == UID[name]
        assert (t[name].dim, t[name].stride, t[name].data_type) == ([1] * 4, [1] * 4, "FLOAT")
    for name in ("amax_s", "amax_o"):
        assert t[name].output and t[name].uid == UID[name] and t[name].data_type == "FLOAT"
        assert t[name].dim == [1, 1, 1, 1]
    o = t["o"]
    assert o.output and o.data_type == "FP8_E4M3" and o.dim == [splits, H, 12, D]
    assert kw["generate_stats"] == (splits > 1) and ("stats" in t) == (splits > 1)
    assert kw["attn_scale"] == 0.25 and kw["use_padding_mask"]
    assert kw["paged_attention_k_table"] is t["k_table"] and kw["paged_attention_max_seq_len_kv"] == 36
    assert "q_offsets" not in t


def test_bf16_key_still_defines_the_plain_sdpa():
    g = define(key(dtype=str(BF16)))
    [(op, kw)] = g.ops
    assert op == "sdpa" and g.io_data_type == "BFLOAT16"
    assert not any(name in kw for name in FP8_SCALARS)
    assert set(g.bound()) == {UID[n] for n in ("q", "k", "v", "o", "k_table", "v_table",
                                                "seq_len_q", "seq_len_kv", "stats")}


def test_fp8_key_with_ragged_q_defines_ragged_rows():
    g = define(key(q_offsets=True))
    t = {x.name: x for x in g.tensors}
    assert g.ops[0][0] == "sdpa_fp8" and t["q"].ragged is t["q_offsets"]
    assert (t["q_offsets"].dim, t["q_offsets"].data_type) == ([3, 1, 1, 1], "INT64")


# --------------------------------------------------------------------------- refusals

def _cuda_cache(dtype):
    return types.SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype)


@pytest.mark.parametrize("cc,ok", [((8, 9), False), ((8, 0), False), ((9, 0), True),
                                   ((10, 0), True)])
def test_check_cache_takes_fp8_on_hopper_or_newer(monkeypatch, cc, ok):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cc)
    backend = CudnnBackend()
    if ok:
        backend.check_cache(_cuda_cache(FP8))
        return
    with pytest.raises(ValueError, match=rf"compute capability 9\.0 \(Hopper\) or newer; "
                                         rf"cuda:0 has {cc[0]}\.{cc[1]}"):
        backend.check_cache(_cuda_cache(FP8))
    backend.check_cache(_cuda_cache(BF16))  # bf16 needs no fp8 SDPA


def test_check_cache_refusals_name_the_dtypes_and_device():
    backend = CudnnBackend()
    with pytest.raises(ValueError, match="bfloat16, float16 or float8_e4m3fn kv_cache, got "
                                         "torch.float32"):
        backend.check_cache(_cuda_cache(torch.float32))
    cpu = CausalKVCache(num_layers=1, num_kv_heads=1, head_dim=8, dtype=FP8, tokens_per_page=4,
                        pool_tokens=16, device="cpu")
    with pytest.raises(ValueError, match="needs a CUDA kv_cache, got one on cpu"):
        backend.check_cache(cpu)
    with pytest.raises(ValueError, match="set_q_bounds needs a float8_e4m3fn kv_cache"):
        backend.set_q_bounds(types.SimpleNamespace(dtype=BF16), [1.0])


def test_set_q_bounds_checks_its_values():
    backend = FakeCudnnBackend()
    cache = CausalKVCache(num_layers=2, num_kv_heads=1, head_dim=8, dtype=FP8,
                          tokens_per_page=4, pool_tokens=16, device="cpu")
    with pytest.raises(ValueError, match=r"one entry per layer \(2\), got 1"):
        backend.set_q_bounds(cache, [1.0])
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match=r"bounds\[1\] must be a positive finite number"):
            backend.set_q_bounds(cache, [1.0, bad])
    backend.set_q_bounds(cache, [3.0, None])
    st = backend.q_state(cache)
    assert st.known == [True, False] and st.bound.tolist() == [3.0, 1.0]
    backend.set_q_bounds(cache, None)
    assert st.known == [False, False]
    assert backend.q_saturated(cache) == [0, 0]


# --------------------------------------------------------------------------- layouts

def test_fp8_forwards_of_several_blocks_split_where_cudnn_takes_ragged_q():
    g = G(394, 36 * 394, 1576, (394, 1576))
    cache = CausalKVCache(num_layers=1, num_kv_heads=8, head_dim=128, dtype=FP8,
                          tokens_per_page=32, pool_tokens=CausalKVCache.pool_tokens_for(g, 32),
                          device="cpu")
    cache.open(g)

    def splits(backend, block, batch=1):
        return backend.plan(cache, tokens=1576, block_size=block, num_heads=32,
                            scale=128 ** -0.5, batch=batch).splits

    for split in ("auto", 5, {394: 3}):
        new, old = FakeCudnnBackend(split=split), FakeCudnnBackend(split=split)
        old.cudnn_version = 91800
        want = 3 if isinstance(split, dict) else 5
        # seed clean pass: four blocks, sub-rows at ragged offsets as bf16's
        assert splits(new, 394) == want
        # an older cuDNN: no ragged fp8 Q, so several blocks stay unsplit
        assert splits(old, 394) == 1
        assert old.layout_for(g, 32, 32, 1576, 1576, num_kv_heads=8, batch=2, fp8=True)[1] == 1
    assert FakeCudnnBackend().layout_for(g, 32, 32, 1576, 394, num_kv_heads=8) == (True, 5)
    # one block (the denoising forward) splits on any: its sub-rows broadcast Q
    assert FakeCudnnBackend().layout_for(g, 32, 32, 1576, 1576, num_kv_heads=8, fp8=True) == (True, 5)
    assert FakeCudnnBackend(split=3).split_for(g, 32, 32, 1576, 1576, fp8=True) == 3


# --------------------------------------------------------------------------- rollouts

def fp8_cache(g, tpp, layers=2, k_scales=None, v_scales=None):
    cache = CausalKVCache(num_layers=layers, num_kv_heads=HKV, head_dim=D, dtype=FP8,
                          tokens_per_page=tpp, device="cpu",
                          pool_tokens=CausalKVCache.pool_tokens_for(g, tpp))
    if k_scales is not None:
        scales = torch.ones(layers, 2, HKV)
        scales[:, 0], scales[:, 1] = torch.tensor(k_scales), torch.tensor(v_scales)
        cache.set_kv_scales(scales)
    cache.open(g)
    return cache


def reference_over_pool(cache, q, layer, T, b, scale):
    """fp32 attention of q [T, H, D] over the dequantized pool (the reference backend)."""
    want = torch.empty(T, H, D)
    ReferenceBackend().plan(cache, tokens=T, block_size=b, num_heads=H, scale=scale).run(
        q, layer, want)
    return want


def fp8_rollout(backend, g, tpp, *, chunk, frame, chunks, layers=2, prologue=None, scale_qkv=1.0,
                k_scales=None, v_scales=None, seed=0, check=None):
    """Denoising forwards (one block of ``chunk``, twice) and a clean pass (blocks of
    ``frame``) per chunk over an fp8 pool, each layer's output against the reference over
    the same pool. ``prologue``: a staging callable (fused QK path), else plain q.
    Returns (cache, {"max": max |d| / max |want|, "mean": mean |d| / max |want|})."""
    gen = torch.Generator().manual_seed(seed)
    cache = fp8_cache(g, tpp, layers, k_scales, v_scales)
    mods = [CachedAttention(H, HKV, D, backend=backend, layer_idx=i) for i in range(layers)]
    worst, total, count = 0.0, 0.0, 0
    for _ in range(chunks):
        for b in (chunk, chunk, frame):
            plan = mods[0].plan_for(cache, chunk, b)
            plan.prepare()
            for layer, mod in enumerate(mods):
                qkv = (torch.randn(1, chunk, H + 2 * HKV, D, generator=gen) * scale_qkv).to(BF16)
                if prologue is None:
                    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + HKV], qkv[:, :, H + HKV:]
                    out = mod(q, k, v, kv_cache=cache, seq_len=chunk, causal_block_size=b, plan=plan)
                else:
                    out = mod(qkv, kv_cache=cache, seq_len=chunk, causal_block_size=b, plan=plan,
                              prologue=prologue)
                q = qkv[0, :, :H]  # as staged: normed in place by a prologue
                want = reference_over_pool(cache, q, layer, chunk, b, mod.scale)
                d = (out[0].float() - want).abs()
                top = want.abs().max().item()
                worst = max(worst, d.max().item() / top)
                total, count = total + d.sum().item() / top, count + d.numel()
                if check is not None:
                    check(plan, layer, q)
        cache.commit(chunk)
    return cache, {"max": worst, "mean": total / count}


CASES = [  # geometry, page size, chunk, frame
    (G(5, 40, 12, (4, 12)), 4, 12, 4),
    (G(3, 37, 16, (8, 16)), 8, 16, 8),
]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("g,tpp,chunk,frame", CASES)
def test_fp8_plans_equal_the_reference_over_the_same_pool(g, tpp, chunk, frame, split, pack):
    backend = FakeCudnnBackend(split=split, pack=pack)
    _, err = fp8_rollout(backend, g, tpp, chunk=chunk, frame=frame, chunks=6, seed=split)
    # e4m3 Q and O (3 mantissa bits: up to 2^-5 relative rounding each, a few values
    # near the output's largest add up); a wrong scale or layout is off by O(1)
    assert err["max"] <= 0.15 and err["mean"] <= 0.01, err
    assert err["mean"] > 1e-4, "fp8 attention that rounds nothing is not fp8"
    keys = list(backend._executables)
    assert keys and all(k.fp8 for k in keys)
    # split forwards of several blocks read ragged Q rows; nothing else does
    assert {k.q_offsets for k in keys} == ({False, True} if split > 1 else {False})
    assert all(e.graph.defined.ops[0][0] == "sdpa_fp8" for e in backend._executables.values())
    assert all(k.query_group == (3 if pack else 1) for k in keys)
    for plan in backend._plans.values():  # every forward the pinned split
        assert plan.splits == split
        assert plan.fp8.direct == (pack and plan.num_blocks == 1)


@pytest.mark.parametrize("pack", [False, True])
def test_fp8_unsplit_several_blocks_under_an_older_cudnn(pack):
    backend = FakeCudnnBackend(split=3, pack=pack)
    backend.cudnn_version = 91800
    g, tpp, chunk, frame = CASES[0]
    _, err = fp8_rollout(backend, g, tpp, chunk=chunk, frame=frame, chunks=4, seed=5)
    assert err["max"] <= 0.15 and err["mean"] <= 0.01, err
    assert not any(k.q_offsets for k in backend._executables)
    for plan in backend._plans.values():  # several blocks: unsplit; one: the pinned split
        assert plan.splits == (3 if plan.num_blocks == 1 else 1)


def test_folded_per_head_scales():
    """K/V heads with scales far from 1 and from each other: K's fold into Q, V's into
    the dequantization; the scalars are what the module doc says."""
    k_scales, v_scales = [0.004, 0.05], [0.01, 0.2]
    backend = FakeCudnnBackend(split=2, pack=True)
    seen = []

    def check(plan, layer, q):
        f, c = plan.fp8, plan.cache
        sk = c.kv_scales[layer, 0].repeat_interleave(H // HKV)
        amax = q.float().abs().amax(dim=(0, 2))
        qs = (amax * sk).max() / FP8_MAX
        torch.testing.assert_close(f.descale_q[layer], qs)
        torch.testing.assert_close(f.q_scale[layer], qs / sk)
        vb = (c.kv_amax[layer, 1] / c.kv_scales[layer, 1]).max().clamp(max=FP8_MAX)
        torch.testing.assert_close(f.descale_o[layer], vb * O_MARGIN / FP8_MAX)
        torch.testing.assert_close(f.scale_o[layer] * f.descale_o[layer], torch.tensor(1.0))
        assert f.consts.tolist() == [1.0, P_SCALE, 1 / P_SCALE]
        assert 0 < float(f.amax[layer, 1]) <= float(vb) * O_MARGIN  # amax_o of the launch
        seen.append(layer)

    cache, err = fp8_rollout(backend, G(5, 40, 12, (4, 12)), 4, chunk=12, frame=4, chunks=4,
                             scale_qkv=0.3, k_scales=k_scales, v_scales=v_scales, check=check)
    assert err["max"] <= 0.15 and err["mean"] <= 0.01, err
    assert seen and cache.kv_stats()["saturated"] == [[0, 0], [0, 0]]


def test_wrong_folding_would_show(monkeypatch):
    """The same rollout with V's scales left out of the dequantization is off by O(1):
    the tolerance above catches a folding mistake."""
    from framekv.engine.attention import cudnn

    real = cudnn.merge_split_kv_
    monkeypatch.setattr(cudnn, "merge_split_kv_",
                        lambda *a, head_scale=None, **kw: real(*a, **kw))
    _, err = fp8_rollout(FakeCudnnBackend(split=1), G(5, 40, 12, (4, 12)), 4, chunk=12,
                         frame=4, chunks=2, k_scales=[0.01, 0.05], v_scales=[0.02, 0.1])
    assert err["max"] > 0.5, err


# --------------------------------------------------------------------------- staged Q

def _prologue():
    w = torch.ones(D)
    return functools.partial(qk_norm_rope_stage_, q_weight=w, k_weight=w, num_heads=H,
                             num_kv_heads=HKV, norm="head")


@pytest.mark.parametrize("split,pack", [(1, False), (1, True), (3, True), (3, False)])
def test_staged_q_is_read_from_the_prologues_output(split, pack):
    """With a bound per layer the fused prologue quantizes Q (q_out, q_scale) and the
    plan reads it; RMSNorm with unit weights bounds |q| by sqrt(D): nothing saturates."""
    backend = FakeCudnnBackend(split=split, pack=pack)
    g = G(5, 40, 12, (4, 12))
    staged = []

    def check(plan, layer, q):
        f, c = plan.fp8, plan.cache
        qs = D ** 0.5 * c.kv_scales[layer, 0].max() / FP8_MAX
        torch.testing.assert_close(f.descale_q[layer], qs)
        staged.append(layer not in plan._staged)  # run consumed it

    orig = backend.plan

    def plan_with_bounds(cache, **kw):
        backend.set_q_bounds(cache, [D ** 0.5, D ** 0.5])
        return orig(cache, **kw)

    backend.plan = plan_with_bounds
    cache, err = fp8_rollout(backend, g, 4, chunk=12, frame=4, chunks=4, prologue=_prologue(),
                             k_scales=[0.02, 0.05], v_scales=[0.03, 0.01], check=check)
    assert err["max"] <= 0.15 and err["mean"] <= 0.01, err
    assert staged and all(staged)
    assert backend.q_saturated(cache) == [0, 0]


def test_plan_reads_q_out_not_q():
    """A prologue that writes q_out from 2 q (and leaves q): the output is attention of
    2 q, so the plan read what the staging wrote."""
    backend = FakeCudnnBackend(split=1)
    g, T = G(5, 40, 12, (4, 12)), 12
    cache = fp8_cache(g, 4, layers=1)
    backend.set_q_bounds(cache, [8.0])
    mod = CachedAttention(H, HKV, D, backend=backend)
    real = _prologue()

    def doubled(qkv, *, q_out, q_scale, q_saturated, **kw):
        real(qkv, **kw)  # norm, stage K/V
        x = qkv[..., :H, :].float() * 2 * torch.reciprocal(q_scale)[:, None]
        q_out.copy_(x.clamp(-FP8_MAX, FP8_MAX))

    qkv = torch.randn(1, T, H + 2 * HKV, D).to(BF16)
    out = mod(qkv, kv_cache=cache, seq_len=T, causal_block_size=T, prologue=doubled)
    want2 = reference_over_pool(cache, qkv[0, :, :H] * 2, 0, T, T, mod.scale)
    want1 = reference_over_pool(cache, qkv[0, :, :H], 0, T, T, mod.scale)
    assert (out[0].float() - want2).abs().max() < 0.1 * want2.abs().max()
    assert (out[0].float() - want1).abs().max() > 0.2 * want1.abs().max()


def test_a_bound_too_small_saturates_and_is_counted():
    backend = FakeCudnnBackend(split=1)
    g, T = G(5, 40, 12, (4, 12)), 12
    cache = fp8_cache(g, 4, layers=1)
    backend.set_q_bounds(cache, [0.25])  # |q| reaches sqrt(D) = 4 after the norm
    mod = CachedAttention(H, HKV, D, backend=backend)
    qkv = torch.randn(1, T, H + 2 * HKV, D).to(BF16)
    mod(qkv, kv_cache=cache, seq_len=T, causal_block_size=T, prologue=_prologue())
    assert backend.q_saturated(cache)[0] > 0


def test_without_a_bound_nothing_is_staged():
    backend = FakeCudnnBackend()
    cache = fp8_cache(G(5, 40, 12, (4, 12)), 4, layers=2)
    backend.set_q_bounds(cache, [None, 2.0])
    plan = backend.plan(cache, tokens=12, block_size=12, num_heads=H, scale=0.25)
    plan.prepare()
    assert plan.stage_outputs(0) == {}
    outs = plan.stage_outputs(1)
    assert set(outs) == {"q_out", "q_scale", "q_saturated"}
    assert outs["q_out"].shape == (1, 12, H, D) and outs["q_out"].dtype == FP8
    assert outs["q_scale"].shape == (H,) and outs["q_saturated"].shape == (1,)
