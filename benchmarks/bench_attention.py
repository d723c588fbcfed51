"""Cached attention at the seed geometry against dense torch SDPA, in one run.

    python benchmarks/bench_attention.py [--json out.json] [--iters 50]

Seed geometry (DESIGN.md): 32 query / 8 K/V heads of 128, bf16, 32-token pages, a
512-token pinned prompt, a 37,824-token window, a 1576-token chunk: the denoising
forward attends 1576 queries over 39,912 keys.

Variants, each with its K/V write included and each captured in a CUDA graph (so
launch overhead is out of every number):
- framekv denoise: ``CachedAttention`` (cuDNN backend) over the cache, one block;
- framekv clean: the same call with 4 one-frame blocks (394 tokens), one launch;
- sdpa-cudnn: torch SDPA, cuDNN backend, over a contiguous buffer of the same keys
  (the write: copy the chunk's K/V into the buffer's tail);
- sdpa-flash: the same with torch's flash backend (K/V expanded to 32 heads outside
  the timing when flash refuses GQA).
Every variant is checked against the fp32 exact-window reference first. Timing: CUDA
events around one replay, L2 flushed before each, warm-up, median and spread of
``--iters``; TFLOP/s against a bf16 8192^3 matmul measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from _timing import captured_graph

from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.attention_backends import attend_fp32
from framekv.engine.reference import ExactWindowReference, visible_positions
from framekv.specs import Geometry

H, HKV, D, TPP, FRAME = 32, 8, 128, 32, 394
GEOM = Geometry(512, 37824, 1576, (394, 1576))
T = GEOM.max_staged_tokens


def timed(fn, iters: int, flush: torch.Tensor) -> list[float]:
    """Per-iteration µs of a graph replay of ``fn``, L2 flushed before each."""
    graph = captured_graph(fn)
    pairs = []
    for _ in range(iters):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in pairs]


def matmul_ceiling(flush) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    us = statistics.median(timed(lambda: torch.matmul(a, b, out=c), 20, flush))
    return 2 * 8192**3 / us / 1e6


def flops(blocks: list[tuple[int, int]]) -> int:
    """QK^T and PV over (queries, keys) per block, every head."""
    return sum(4 * H * D * q * k for q, k in blocks)


def build_cache(gen):
    """A one-layer cache filled until the window is full, with its fp32 record."""
    cache = CausalKVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16,
                          tokens_per_page=TPP, device="cuda",
                          pool_tokens=CausalKVCache.pool_tokens_for(GEOM, TPP))
    cache.open(GEOM)
    ref = ExactWindowReference(GEOM, 1)
    while cache.committed_tokens < GEOM.pin_tokens + GEOM.window_tokens + T:
        kv = torch.randn(2, T, HKV, D, generator=gen).to("cuda", torch.bfloat16)
        cache.write_staged(0, kv[0], kv[1], T)
        ref.write(0, ref.committed, kv[0], kv[1])
        cache.commit(T)
        ref.commit(T)
    return cache, ref


def reference_out(ref, q, b):
    """fp32 exact-window attention of q [T, H, D] (on the GPU; the keys from the record)."""
    out = torch.empty(T, H, D, device="cuda")
    for j in range(T // b):
        pos = visible_positions(GEOM, ref.committed, ref.committed + j * b, b)
        k, v = ref.kv(0, pos)
        out[j * b:(j + 1) * b] = attend_fp32(q[j * b:(j + 1) * b], k.cuda(), v.cuda(), D ** -0.5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    cache, ref = build_cache(gen)
    qkv = torch.randn(1, T, H + 2 * HKV, D, generator=gen).to("cuda", torch.bfloat16)
    q, k_new, v_new = qkv[0, :, :H], qkv[0, :, H:H + HKV], qkv[0, :, H + HKV:]
    ref.write(0, ref.committed, k_new, v_new)
    mod = CachedAttention(H, HKV, D, backend="cudnn", layer_idx=0)
    results, errors = {}, {}
    keys = GEOM.pin_tokens + GEOM.window_tokens + T
    for name, b in (("framekv-denoise", T), ("framekv-clean", FRAME)):
        out = mod(qkv, kv_cache=cache, seq_len=T, causal_block_size=b)
        errors[name] = (out[0].float() - reference_out(ref, q, b)).abs().max().item()
        results[name] = timed(lambda b=b: mod(qkv, kv_cache=cache, seq_len=T, causal_block_size=b),
                              args.iters, flush)
    # Dense baselines: a contiguous [1, H_kv, keys, D] buffer of exactly the visible keys.
    pos = visible_positions(GEOM, ref.committed, ref.committed, T)
    kd, vd = (x.cuda().to(torch.bfloat16).transpose(0, 1)[None].contiguous() for x in ref.kv(0, pos))
    qd = q.transpose(0, 1)[None]
    tail = slice(keys - T, keys)
    want = reference_out(ref, q, T)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def dense(backend, kk, vv):
        gqa = kk.shape[1] != H

        def run():
            g = kk.shape[1] // HKV  # 1 for GQA-native runs, 4 when K/V were expanded
            kk[0, :, tail].copy_(k_new.repeat_interleave(g, 1).transpose(0, 1))
            vv[0, :, tail].copy_(v_new.repeat_interleave(g, 1).transpose(0, 1))
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(qd, kk, vv, enable_gqa=gqa)
        return run

    notes = {}
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        fn = dense(backend, kd, vd)
        try:
            out = fn()
        except RuntimeError as e:  # a backend without GQA: expand K/V to every query head
            notes[name] = f"GQA refused ({str(e).splitlines()[0][:80]}); K/V expanded to {H} heads"
            fn = dense(backend, kd.repeat_interleave(H // HKV, 1), vd.repeat_interleave(H // HKV, 1))
            out = fn()
        errors[name] = (out[0].transpose(0, 1).float() - want).abs().max().item()
        results[name] = timed(fn, args.iters, flush)
    for name, note in notes.items():
        print(f"note: {name}: {note}")
    ceiling = matmul_ceiling(flush)
    work = {"framekv-denoise": flops([(T, keys)]), "sdpa-cudnn": flops([(T, keys)]),
            "sdpa-flash": flops([(T, keys)]),
            # every one-frame block sees the pin, a full window and itself
            "framekv-clean": flops([(FRAME, GEOM.pin_tokens + GEOM.window_tokens + FRAME)] * 4)}
    report(results, errors, work, ceiling, args.json)


def report(results, errors, work, ceiling, path) -> None:
    rows = {}
    print(f"seed geometry: {H}/{HKV} heads of {D}, {T} queries over "
          f"{GEOM.pin_tokens + GEOM.window_tokens + T} keys; matmul ceiling {ceiling:.0f} TFLOP/s")
    print(f"{'variant':<17}{'median us':>11}{'p10-p90 us':>16}{'TFLOP/s':>9}{'of ceil':>9}{'max err':>10}")
    for name, ts in results.items():
        ts = sorted(ts)
        med = statistics.median(ts)
        tf = work[name] / med / 1e6
        rows[name] = {"median_us": med, "p10_us": ts[len(ts) // 10], "p90_us": ts[9 * len(ts) // 10],
                      "tflops": tf, "fraction_of_ceiling": tf / ceiling, "max_error": errors[name]}
        r = rows[name]
        print(f"{name:<17}{med:>11.1f}{r['p10_us']:>8.1f}-{r['p90_us']:<7.1f}{tf:>9.0f}"
              f"{tf / ceiling:>9.2f}{errors[name]:>10.1e}")
    base = rows["sdpa-cudnn"]["median_us"]
    ratios = {"denoise_over_sdpa_cudnn": rows["framekv-denoise"]["median_us"] / base,
              "sdpa_flash_over_denoise": rows["sdpa-flash"]["median_us"] / rows["framekv-denoise"]["median_us"]}
    print(f"framekv denoise / sdpa-cudnn = {ratios['denoise_over_sdpa_cudnn']:.3f}; "
          f"sdpa-flash / framekv denoise = {ratios['sdpa_flash_over_denoise']:.2f}")
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cudnn": torch.backends.cudnn.version(), "matmul_tflops": ceiling,
                       "variants": rows, "ratios": ratios}, f, indent=2)


if __name__ == "__main__":
    main()
