"""An fp8 e4m3 pool on the CPU (reference backend): exact visible sets, error against the
fp32 exact-window reference, the quantization formula and its statistics, scales,
edits, snapshots, sizing and refusals."""
from __future__ import annotations

import pytest
import torch

from attention_harness import make, onehot_visible_sets, rollout_vs_reference
from framekv.engine import CausalKVCache
from framekv.engine.cache import SequenceSnapshot
from framekv.engine.cache.quant import FP8, FP8_MAX, dequantize, quantize
from framekv.specs import Geometry as G

GEOMETRIES = [  # (geometry, tokens per page, chunk, frame)
    (G(6, 24, 12, (4, 12)), 4, 12, 4),
    (G(3, 40, 8, (2, 8)), 8, 8, 2),
    (G(0, 10, 9, (3, 9)), 2, 9, 3),
]


def _cache(g, tpp=4, *, layers=2, Hkv=2, D=16, sequences=1):
    c = CausalKVCache(num_layers=layers, num_kv_heads=Hkv, head_dim=D, dtype=FP8,
                      tokens_per_page=tpp, device="cpu", num_sequences=sequences,
                      pool_tokens=CausalKVCache.pool_tokens_for(g, tpp, num_sequences=sequences))
    c.open(g)
    return c


@pytest.mark.parametrize("g,tpp,sizes", [
    (G(5, 13, 6, (2, 3, 6)), 4, (6, 3, 2)),
    (G(8, 16, 8, (4, 8)), 8, (8, 4)),
    (G(0, 7, 4, (1, 4)), 2, (4, 1)),
    (G(20, 3, 6, (3, 6)), 16, (6, 3)),
])
def test_onehot_visible_set_is_exact_with_an_fp8_pool(g, tpp, sizes):
    M = g.max_staged_tokens
    cache = onehot_visible_sets(g, tpp, block_sizes=sizes, commits=(128 - M) // M, kv_dtype=FP8)
    assert cache.kv_stats()["saturated"] == [[0, 0]]


@pytest.mark.parametrize("g,tpp,chunk,frame", GEOMETRIES)
@pytest.mark.parametrize("D", [16, 64])
def test_fp8_rollout_stays_within_the_documented_error_of_the_fp32_reference(g, tpp, chunk,
                                                                            frame, D):
    """quant.py's bound: unit-normal q, k, v over a few dozen keys, max |d| <= 0.2 and
    mean |d| <= 0.0125; the same rollout on an fp32 pool is exact to 2e-5."""
    fp8 = rollout_vs_reference(g, tpp, chunk=chunk, frame=frame, chunks=8, D=D, kv_dtype=FP8)
    assert fp8["max_error"] <= 0.2 and fp8["mean_error"] <= 0.0125, fp8
    assert fp8["mean_error"] > 1e-4, "an fp8 pool that rounds nothing is not fp8"
    fp32 = rollout_vs_reference(g, tpp, chunk=chunk, frame=frame, chunks=2, D=D)
    assert fp32["max_error"] < 2e-5, fp32


def test_uniform_attention_error_is_the_mean_of_the_value_rounding():
    """q = 0: each output is the mean of V(j), so its error is at most e4m3's step of
    the largest value: 2^-4 max|v| + 2^-10 (half the smallest subnormal step)."""
    g, tpp = G(4, 16, 8, (8,)), 4
    cache, (mod,) = make(g, tpp, layers=1, H=2, Hkv=1, D=16, dtype=torch.float32,
                         device="cpu", backend="reference", kv_dtype=FP8)
    gen, vs = torch.Generator().manual_seed(1), []
    for _ in range(4):
        v = torch.randn(1, 8, 1, 16, generator=gen) * 3
        vs.append(v[0])
        out = mod(torch.zeros(1, 8, 2, 16), torch.randn(1, 8, 1, 16, generator=gen), v,
                  kv_cache=cache, seq_len=8, causal_block_size=8)
        cache.commit(8)
    allv = torch.cat(vs)                                           # [32, 1, 16]
    want = torch.cat([allv[:4], allv[-24:]]).mean(0)               # pin 4, window 16, own 8
    err = (out[0, 0] - want).abs().max().item()
    assert err <= 2**-4 * allv.abs().max().item() + 2**-10, err


def test_stored_bytes_follow_the_formula_and_statistics_count_saturation():
    g = G(0, 8, 4, (4,))
    c = _cache(g, layers=2, Hkv=2, D=8)
    c.set_kv_scales(torch.tensor([[[0.5, 2.0], [1.0, 0.25]], [[1.0, 1.0], [1.0, 1.0]]]))
    k = torch.randn(4, 2, 8) * 4
    v = torch.randn(4, 2, 8)
    k[1, 0, 3], k[2, 1, 0] = 1e4, float("inf")           # both saturate (> 448 * s)
    v[0, 1, 5] = float("nan")                             # kept as NaN, not counted
    c.write_staged(0, k, v, 4)
    slots = torch.tensor([c.slot_of(x) for x in range(4)])
    for kind, x, pool in ((0, k, c.k_pool), (1, v, c.v_pool)):
        s = c.kv_scales[0, kind]
        want = (x * torch.reciprocal(s)[None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        got = pool[0, slots]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), kind
    stats = c.kv_stats()
    assert stats["saturated"] == [[2, 0], [0, 0]]
    finite = torch.where(v.isnan(), 0.0, v.abs()).amax(dim=(0, 2))
    assert stats["amax"][0][1] == pytest.approx(finite.tolist())
    assert stats["amax"][0][0][1] == float("inf") and stats["amax"][1] == [[0, 0], [0, 0]]
    assert torch.isnan(c.v_pool[0, slots[0], 1, 5].float())
    c.reset_kv_stats()
    assert c.kv_stats()["saturated"] == [[0, 0], [0, 0]]


def test_quantize_dequantize_round_trip_bound():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, generator=gen) * torch.tensor([0.01, 1.0, 100.0])[None, :, None]
    scale = torch.tensor([0.01, 1.0, 0.5])
    amax, sat = torch.zeros(3), torch.zeros((), dtype=torch.int64)
    back = dequantize(quantize(x, scale, amax, sat), scale)
    inside = x.abs() <= FP8_MAX * scale[None, :, None]
    bound = 2**-4 * x.abs() + 2**-10 * scale[None, :, None]
    assert bool(((back - x).abs() <= bound)[inside].all())
    assert bool((back.abs() == FP8_MAX * scale[None, :, None].expand_as(x))[~inside].all())
    assert int(sat) == int((x.abs() * torch.reciprocal(scale)[None, :, None] > 448).sum()) > 0


def test_scales_are_refused_while_a_sequence_holds_kv_and_checked():
    g = G(0, 8, 4, (4,))
    c = _cache(g)
    for bad, what in ((0.0, "positive"), (float("nan"), "positive"), (torch.ones(3), "broadcast"),
                      ("x", "broadcast")):
        with pytest.raises(ValueError, match=what):
            c.set_kv_scales(bad)
    c.write_staged(0, torch.randn(4, 2, 16), torch.randn(4, 2, 16), 4)
    with pytest.raises(ValueError, match=r"sequences \[0\] hold K/V"):
        c.set_kv_scales(2.0)
    with pytest.raises(ValueError, match="hold K/V"):
        c.calibrate_kv_scales()
    assert c.kv_scales.eq(1.0).all()
    c.reset_sequences([0])
    with pytest.raises(ValueError, match="margin"):
        c.calibrate_kv_scales(0.5)
    c.calibrate_kv_scales(2.0)   # layer 0 was seen: amax * 2 / 448; layer 1 keeps 1.0
    assert torch.equal(c.kv_scales[1], torch.ones(2, 2))
    assert bool((c.kv_scales[0] < 0.1).all()) and c.kv_stats()["amax"][0] == [[0, 0], [0, 0]]
    bf16 = CausalKVCache(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16,
                         tokens_per_page=4, pool_tokens=16, device="cpu")
    with pytest.raises(ValueError, match="needs an fp8 pool"):
        bf16.set_kv_scales(1.0)
    assert bf16.kv_stats() is None and bf16.kv_scales is None


def test_scales_reach_the_attention():
    """The same K/V under scale 1 and scale 4 attend to the same values (within e4m3)."""
    g, tpp = G(0, 8, 4, (4,)), 4
    outs = []
    for s in (1.0, 4.0):
        cache, (mod,) = make(g, tpp, layers=1, H=2, Hkv=2, D=16, dtype=torch.float32,
                             device="cpu", backend="reference", kv_dtype=FP8)
        cache.set_kv_scales(s)
        gen = torch.Generator().manual_seed(3)
        qkv = torch.randn(1, 4, 6, 16, generator=gen)
        outs.append(mod(qkv, kv_cache=cache, seq_len=4, causal_block_size=4))
    assert (outs[0] - outs[1]).abs().max().item() < 0.2
    assert not torch.equal(outs[0], outs[1])  # other bytes, same meaning


def test_edits_quantize_and_roll_back_on_failure():
    g = G(4, 8, 4, (4,))
    c = _cache(g, Hkv=1, D=8)
    for _ in range(3):
        c.write_staged(0, torch.randn(4, 1, 8), torch.randn(4, 1, 8), 4)
        c.write_staged(1, torch.randn(4, 1, 8), torch.randn(4, 1, 8), 4)
        c.commit(4)
    k = torch.full((2, 1, 8), 3.0)
    c.write_range(0, 5, k, k * 2)
    s = c.slot_of(5)
    assert c.k_pool[0, s].float().eq(3.0).all() and c.v_pool[0, s].float().eq(6.0).all()
    c.zero_values(1, 4, 2)
    assert c.v_pool[1, c.slot_of(4)].float().eq(0).all()
    before = c._pool.view(torch.uint8).clone()
    with pytest.raises(RuntimeError, match="injected"):
        with c.keeping(0, 8, sequences=[0]):
            c.write_range(1, 0, torch.ones(8, 1, 8), torch.ones(8, 1, 8))
            raise RuntimeError("injected")
    assert torch.equal(c._pool.view(torch.uint8), before)


def test_fp8_snapshot_round_trip_and_scales_must_match(tmp_path):
    g = G(4, 8, 4, (4,))
    a = _cache(g, Hkv=2, D=8)
    a.set_kv_scales(0.5)
    for _ in range(4):
        for layer in range(2):
            a.write_staged(layer, torch.randn(4, 2, 8), torch.randn(4, 2, 8), 4)
        a.commit(4)
    snap = a.export_sequence(0)
    assert snap.k.dtype == FP8 and snap.describe()["kv_scales"][0][0] == [0.5, 0.5]
    snap.save(tmp_path / "s.safetensors")
    back = SequenceSnapshot.load(tmp_path / "s.safetensors")
    b = _cache(g, tpp=8, Hkv=2, D=8)
    with pytest.raises(ValueError, match="kv_scales"):
        b.import_sequence(0, back)
    b.set_kv_scales(0.5)
    b.import_sequence(0, back)
    again = b.export_sequence(0)
    assert again.committed == 16
    assert torch.equal(again.k.view(torch.uint8), snap.k.view(torch.uint8))
    assert torch.equal(again.v.view(torch.uint8), snap.v.view(torch.uint8))


def test_pool_bytes_count_one_byte_a_value():
    g = G(64, 1024, 256, (64, 256))
    kw = dict(num_layers=30, num_kv_heads=12, head_dim=128, tokens_per_page=64)
    bf16 = CausalKVCache.pool_bytes_for(g, dtype=torch.bfloat16, **kw)
    fp8 = CausalKVCache.pool_bytes_for(g, dtype=FP8, **kw)
    assert 0.49 < fp8 / bf16 < 0.52, (fp8, bf16)


def test_bad_dtypes_are_named():
    kw = dict(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_page=4, pool_tokens=16,
              device="cpu")
    for bad in (torch.float8_e5m2, torch.int8, torch.float64):
        with pytest.raises(ValueError, match="float8_e4m3fn"):
            CausalKVCache(dtype=bad, **kw)
    c = _cache(G(0, 8, 4, (4,)), Hkv=1, D=8)
    with pytest.raises(ValueError, match="an fp8 pool quantizes them"):
        c.write_staged(0, torch.zeros(4, 1, 8, dtype=FP8), torch.zeros(4, 1, 8, dtype=FP8), 4)
    with pytest.raises(ValueError, match="same dtype"):
        c.write_staged(0, torch.zeros(4, 1, 8), torch.zeros(4, 1, 8, dtype=torch.bfloat16), 4)
    k = torch.zeros(4, 1, 8, dtype=torch.bfloat16)
    c.write_staged(0, k, k, 4)   # bf16 K/V into an fp8 pool on the CPU
