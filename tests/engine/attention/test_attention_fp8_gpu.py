"""The cuDNN backend over an fp8 e4m3 pool on Hopper or newer: cuDNN's fp8 SDPA at the
seed geometry against the fp32 reference over the same (dequantized) pool, split and
unsplit (the clean pass's blocks over ragged Q), packed and not, Q staged by the fused prologue, the merge kernel's e4m3
decoding, and capture / replay bit for bit."""
from __future__ import annotations

import functools

import pytest
import torch

from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.attention.backend import ReferenceBackend
from framekv.engine.attention.cudnn import CudnnBackend
from framekv.ops import merge_split_kv_, merge_split_kv_reference, qk_norm_rope_stage_
from framekv.specs import Geometry as G

pytestmark = pytest.mark.gpu
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
# The seed geometry (specs/presets/seed-bench.toml): 32 / 8 heads of 128, 32-token pages,
# 394 tokens a frame, 4-frame chunks, a 512-token prompt pinned and a 96-frame window.
SEED = G(512, 96 * 394, 4 * 394, (394, 4 * 394))
H, HKV, D, TPP, T, FRAME = 32, 8, 128, 32, 1576, 394
K_AMP = torch.tensor([0.5, 1.0, 0.75, 0.5, 1.0, 0.6, 0.9, 0.8])   # per K/V head
V_AMP = torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0, 0.7, 1.2, 2.0])


@pytest.fixture(autouse=True)
def _hopper():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN's fp8 SDPA needs Hopper or newer")


def seed_cache(layers=1, chunks=25, seed=0):
    """An fp8 pool at the seed geometry, its window filled (``chunks`` chunks committed;
    25 x 1576 > 512 + 37824), K and V scaled per head and the scales set to match."""
    cache = CausalKVCache(num_layers=layers, num_kv_heads=HKV, head_dim=D, dtype=FP8,
                          tokens_per_page=TPP, device="cuda",
                          pool_tokens=CausalKVCache.pool_tokens_for(SEED, TPP))
    scales = torch.stack([K_AMP, V_AMP]) * (8.0 / 448)      # |x| ~ 4 amp at most: no saturation
    cache.set_kv_scales(scales.expand(layers, 2, HKV))
    cache.open(SEED)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    amp = torch.stack([K_AMP, V_AMP]).to("cuda")[:, None, :, None]
    for _ in range(chunks):
        for layer in range(layers):
            kv = torch.randn(2, T, HKV, D, device="cuda", generator=gen) * amp
            cache.write_staged(layer, kv[0].to(BF16), kv[1].to(BF16), T)
        cache.commit(T)
    return cache, gen


def fresh_qkv(gen):
    qkv = torch.randn(1, T, H + 2 * HKV, D, device="cuda", generator=gen)
    qkv[..., H:H + HKV, :] *= K_AMP.to("cuda")[:, None]
    qkv[..., H + HKV:, :] *= V_AMP.to("cuda")[:, None]
    return qkv.to(BF16)


def reference(cache, q, b, scale, layer=0):
    want = torch.empty(T, H, D, device="cuda")
    ReferenceBackend().plan(cache, tokens=T, block_size=b, num_heads=H, scale=scale).run(
        q, layer, want)
    return want


def errors(out, want):
    d = (out.float() - want).abs()
    return {"max": d.max().item(), "mean": d.mean().item()}


@pytest.mark.parametrize("split,pack", [("auto", "auto"), (1, False), (1, True), (5, False)])
@pytest.mark.parametrize("b", [T, FRAME])  # denoising forward; clean pass
def test_seed_geometry_matches_the_reference_over_the_pool(split, pack, b):
    cache, gen = seed_cache()
    backend = CudnnBackend(split=split, pack=pack)
    mod = CachedAttention(H, HKV, D, backend=backend)
    qkv = fresh_qkv(gen)
    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + HKV], qkv[:, :, H + HKV:]
    out = mod(q, k, v, kv_cache=cache, seq_len=T, causal_block_size=b)
    err = errors(out[0], reference(cache, q[0], b, mod.scale))
    (plan,) = backend._plans.values()
    print(f"b={b} split={split} pack={pack}: S={plan.splits} packed={plan.packed}: {err}")
    assert err["max"] <= 5e-2 and err["mean"] <= 5e-3, err
    # the clean pass's four blocks split too: their sub-rows read ragged Q (cuDNN 9.19+)
    ragged = backend.fp8_ragged_q()
    assert plan.splits == (1 if b == FRAME and not ragged else (5 if split == 5 else plan.splits))
    if b == FRAME and split == 5:
        assert {k.q_offsets for k in backend._executables} == ({True} if ragged else {False})
    assert cache.kv_stats()["saturated"] == [[0, 0]]


@pytest.mark.parametrize("split,pack", [(5, True), (1, True), (1, False)])
def test_staged_q_at_the_seed_geometry(split, pack):
    """The fused prologue (per-head RMSNorm with unit weights: |q| <= sqrt(128)) stages
    fp8 Q; the plan reads it."""
    cache, gen = seed_cache()
    backend = CudnnBackend(split=split, pack=pack)
    backend.set_q_bounds(cache, [D ** 0.5])
    mod = CachedAttention(H, HKV, D, backend=backend)
    w = torch.ones(D, device="cuda", dtype=BF16)
    prologue = functools.partial(qk_norm_rope_stage_, q_weight=w, k_weight=w, num_heads=H,
                                 num_kv_heads=HKV, norm="head")
    qkv = fresh_qkv(gen)
    out = mod(qkv, kv_cache=cache, seq_len=T, causal_block_size=T, prologue=prologue)
    err = errors(out[0], reference(cache, qkv[0, :, :H], T, mod.scale))  # q normed in place
    print(f"staged S={split} pack={pack}: {err}")
    assert err["max"] <= 5e-2 and err["mean"] <= 5e-3, err
    assert backend.q_saturated(cache) == [0]


@pytest.mark.parametrize("split,b", [(5, T), (1, T), (1, FRAME)])
def test_capture_replays_bit_for_bit(split, b):
    """A captured forward (prepare, staging, fp8 attention, dequantizing merge) replays
    to the eager result bit for bit, also after a commit with new K/V."""
    cache, gen = seed_cache()
    backend = CudnnBackend(split=split)
    mod = CachedAttention(H, HKV, D, backend=backend)
    qkv = fresh_qkv(gen)
    split_qkv = lambda: (qkv[:, :, :H], qkv[:, :, H:H + HKV], qkv[:, :, H + HKV:])  # noqa: E731

    def forward():
        plan = mod.plan_for(cache, T, b)
        plan.prepare()
        return mod(*split_qkv(), kv_cache=cache, seq_len=T, causal_block_size=b, plan=plan)

    eager = forward().clone()  # also builds the cuDNN plan and compiles the merge
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward()
    for step in range(3):
        graph.replay()
        cache.note_staged(T)
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), f"replay {step} differs from the eager forward"
        cache.commit(T)
        qkv.copy_(fresh_qkv(gen))
        eager = forward().clone()
        cache.note_staged(T)


def test_merge_kernel_decodes_every_e4m3_byte():
    """S = 1 over all 256 e4m3 bytes (NaN for 0x7F / 0xFF), dequantized: the kernel's
    decoding equals torch's."""
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    o8 = raw.repeat(4).view(1, 8, 2, 64).cuda()                      # [1, T, H, D]
    out = torch.empty(8, 2, 64, device="cuda", dtype=BF16)
    want = torch.empty_like(out)
    args = (o8, torch.zeros(2, 2, 4, device="cuda"), torch.ones(2, dtype=torch.int32, device="cuda"))
    kw = dict(block_size=4, seq_len=8, scale=torch.tensor([0.5], device="cuda"),
              head_scale=torch.tensor([2.0, 0.25], device="cuda"))
    merge_split_kv_(out, *args, **kw)
    merge_split_kv_reference(want, *args, **kw)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~out.isnan()], want[~want.isnan()])
