"""One layer's attention at a preset's geometry: framekv against dense torch SDPA.

The window is full (steady state): a chunk of T queries attends P + W + T keys.

    framekv-denoise   `CachedAttention` (cuDNN paged backend), the chunk one block
    framekv-clean     the same call with one-frame blocks (the clean pass), one launch
    sdpa-cudnn        torch SDPA, cuDNN backend, over a contiguous buffer holding exactly
                      the visible keys (write: the chunk's K/V copied into its tail)
    concat-sdpa       history kept contiguous, each forward concatenates the chunk's
                      K/V to it (the write) and runs SDPA cuDNN over the result
    sdpa-flash        torch SDPA, flash backend, over the contiguous buffer (K/V heads
                      expanded outside the timing when flash refuses GQA)

Every variant includes its K/V write, is captured in a CUDA graph, and is checked
against the fp32 exact-window reference before it is timed. The variants are timed
in turn, one replay of each per round (L2 flushed before each), so that clock changes
over the run hit them alike, and each round starts one variant later than the last (the
first replay after the host's sync runs slower, and would always hit one variant).
"""
from __future__ import annotations

import statistics

import torch

from framekv import specs
from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.attention.backend import attend_fp32
from framekv.engine.cache.reference import ExactWindowReference, visible_positions

from .timing import Flusher, captured_graph, interleaved_device_times, matmul_ceiling, summary


class Setup:
    """A one-layer cache of a preset's geometry with a full window, its fp32 record, and a
    fresh chunk of packed QKV staged in the record."""

    def __init__(self, preset: specs.Preset, seed: int = 0):
        m, r = preset.model, preset.rollout
        self.H, self.HKV, self.D, self.tpp = m.num_heads, m.num_kv_heads, m.head_dim, m.tokens_per_page
        self.g = r.geometry()
        self.T, self.frame = self.g.max_staged_tokens, r.tokens_per_frame
        self.keys = self.g.pin_tokens + self.g.window_tokens + self.T
        gen = torch.Generator().manual_seed(seed)
        self.cache, self.ref = self._fill(gen)
        qkv = torch.randn(1, self.T, self.H + 2 * self.HKV, self.D, generator=gen)
        self.qkv = qkv.to("cuda", torch.bfloat16)                  # [1, T, H + 2 H_kv, D]
        H, HKV = self.H, self.HKV
        self.q = self.qkv[0, :, :H]                                   # [T, H, D] views
        self.k_new, self.v_new = self.qkv[0, :, H:H + HKV], self.qkv[0, :, H + HKV:]
        self.ref.write(0, self.ref.committed, self.k_new, self.v_new)
        self.scale = self.D ** -0.5

    def _fill(self, gen):
        cache = CausalKVCache(num_layers=1, num_kv_heads=self.HKV, head_dim=self.D,
                              dtype=torch.bfloat16, tokens_per_page=self.tpp, device="cuda",
                              pool_tokens=CausalKVCache.pool_tokens_for(self.g, self.tpp))
        cache.open(self.g)
        ref = ExactWindowReference(self.g, 1)
        while cache.committed_tokens < self.g.pin_tokens + self.g.window_tokens:
            kv = torch.randn(2, self.T, self.HKV, self.D, generator=gen).to("cuda", torch.bfloat16)
            cache.write_staged(0, kv[0], kv[1], self.T)
            ref.write(0, ref.committed, kv[0], kv[1])
            cache.commit(self.T)
            ref.commit(self.T)
        return cache, ref

    def reference(self, b: int) -> torch.Tensor:
        """fp32 exact-window attention of the chunk's queries in blocks of ``b``: [T, H, D]."""
        out = torch.empty(self.T, self.H, self.D, device="cuda")
        for j in range(self.T // b):
            pos = visible_positions(self.g, self.ref.committed, self.ref.committed + j * b, b)
            k, v = self.ref.kv(0, pos)
            out[j * b:(j + 1) * b] = attend_fp32(self.q[j * b:(j + 1) * b], k.cuda(), v.cuda(),
                                                 self.scale)
        return out

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous [1, H_kv, keys, D] K and V of exactly the chunk's visible keys."""
        pos = visible_positions(self.g, self.ref.committed, self.ref.committed, self.T)
        return tuple(x.cuda().to(torch.bfloat16).transpose(0, 1)[None].contiguous()
                     for x in self.ref.kv(0, pos))

    def flops(self, b: int) -> int:
        """QK^T and PV of every head over each block's visible keys."""
        total = 0
        for j in range(self.T // b):
            s = self.ref.committed + j * b
            total += 4 * self.H * self.D * b * len(visible_positions(self.g, self.ref.committed, s, b))
        return total


def framekv_variants(st: Setup) -> dict:
    """name -> (callable, block size) of framekv's paged path."""
    mod = CachedAttention(st.H, st.HKV, st.D, backend="cudnn", layer_idx=0)

    def call(b):
        return lambda: mod(st.qkv, kv_cache=st.cache, seq_len=st.T, causal_block_size=b)[0]
    return {"framekv-denoise": (call(st.T), st.T), "framekv-clean": (call(st.frame), st.frame)}


def dense_variants(st: Setup) -> tuple[dict, dict]:
    """name -> (callable, block size) of the dense baselines, and notes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kd, vd = st.dense_kv()
    qd = st.q.transpose(0, 1)[None]                                   # [1, H, T, D]
    tail = slice(st.keys - st.T, st.keys)
    hist_k, hist_v = kd[:, :, :tail.start].clone(), vd[:, :, :tail.start].clone()
    new_k, new_v = (x.transpose(0, 1)[None] for x in (st.k_new, st.v_new))  # [1, H_kv, T, D]

    def sdpa(backend, k, v):
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(
                qd, k, v, scale=st.scale, enable_gqa=k.shape[1] != st.H)
        return out[0].transpose(0, 1)                                 # [T, H, D]

    def in_place(backend, k, v):
        group = k.shape[1] // st.HKV  # 1, or H / H_kv when K/V were expanded

        def run():
            k[0, :, tail].copy_(new_k[0].repeat_interleave(group, 0))
            v[0, :, tail].copy_(new_v[0].repeat_interleave(group, 0))
            return sdpa(backend, k, v)
        return run

    def concat():
        return sdpa(SDPBackend.CUDNN_ATTENTION, torch.cat([hist_k, new_k], 2),
                    torch.cat([hist_v, new_v], 2))

    out, notes = {"sdpa-cudnn": (in_place(SDPBackend.CUDNN_ATTENTION, kd, vd), st.T),
                  "concat-sdpa": (concat, st.T)}, {}
    flash = in_place(SDPBackend.FLASH_ATTENTION, kd.clone(), vd.clone())
    try:
        flash()
    except RuntimeError as e:
        notes["sdpa-flash"] = (f"GQA refused ({str(e).splitlines()[0][:80]}); K/V expanded to "
                               f"{st.H} heads outside the timing")
        group = st.H // st.HKV
        flash = in_place(SDPBackend.FLASH_ATTENTION, kd.repeat_interleave(group, 1),
                         vd.repeat_interleave(group, 1))
    out["sdpa-flash"] = (flash, st.T)
    return out, notes


def measure_attention(preset: specs.Preset, *, iters: int = 50, flush: bool = True,
                      extra: dict | None = None, progress=print) -> dict:
    """Every variant: error against the fp32 reference, then device time (see module doc).

    ``extra``: more name -> (callable, block size) variants built over the same `Setup`
    by a function ``extra(setup)`` (the split-KV rows).
    """
    st = Setup(preset)
    flusher = Flusher(flush)
    variants = framekv_variants(st)
    dense, notes = dense_variants(st)
    variants.update(dense)
    if extra is not None:
        variants.update(extra(st))
    want = {b: st.reference(b) for b in {b for _, b in variants.values()}}
    graphs, errors = {}, {}
    for name, (fn, b) in variants.items():
        progress(f"attention: {name}: checking, capturing")
        errors[name] = (fn().float() - want[b]).abs().max().item()
        graphs[name] = captured_graph(fn)
    progress(f"attention: timing the {len(graphs)} variants in turn, {iters} rounds")
    # In turn (A B C, B C A, ...): the GPU's clock moves between two levels over
    # seconds of full load, and variants timed one after another would each catch a
    # different mix of them; rotating who goes first spreads the slower first replay.
    times = interleaved_device_times({n: g.replay for n, g in graphs.items()}, iters, flusher,
                                     rotate=True)
    del graphs
    rows = {}
    for name, (_, b) in variants.items():
        rows[name] = {"block_size": b, "max_error": errors[name], "us": summary(times[name]),
                      "tflops": st.flops(b) / statistics.median(times[name]) / 1e6}
    ceiling = matmul_ceiling(flusher)
    for r in rows.values():
        r["fraction_of_ceiling"] = r["tflops"] / ceiling
    res = {"heads": st.H, "kv_heads": st.HKV, "head_dim": st.D, "tokens": st.T, "keys": st.keys,
           "frame": st.frame, "matmul_tflops": ceiling, "notes": notes, "variants": rows}
    res["ratios"] = ratios(rows)
    # Per round (the two timed next to each other), then the median over rounds.
    res["ratios"]["denoise_over_sdpa_cudnn_paired"] = statistics.median(
        a / b for a, b in zip(times["framekv-denoise"], times["sdpa-cudnn"]))
    st.cache.shutdown()
    return res


def ratios(rows: dict) -> dict:
    """The comparisons the project's targets are stated in."""
    med = {k: v["us"]["median"] for k, v in rows.items()}
    out = {"denoise_over_sdpa_cudnn": med["framekv-denoise"] / med["sdpa-cudnn"],
           "sdpa_flash_over_denoise": med["sdpa-flash"] / med["framekv-denoise"],
           "concat_over_denoise": med["concat-sdpa"] / med["framekv-denoise"]}
    if "framekv-denoise-S1" in med:  # the unsplit paged forward
        out["denoise_s1_over_sdpa_cudnn"] = med["framekv-denoise-S1"] / med["sdpa-cudnn"]
        out["sdpa_flash_over_denoise_s1"] = med["sdpa-flash"] / med["framekv-denoise-S1"]
    for name in ("denoise", "clean"):
        pinned = [k for k in med if k.startswith(f"framekv-{name}-S")]
        if pinned:
            best = min(pinned, key=med.get)
            out[f"best_{name}"] = best
            out[f"best_{name}_over_s1"] = med[best] / med[f"framekv-{name}-S1"]
    if "best_denoise" in out:
        out["best_denoise_over_sdpa_cudnn"] = med[out["best_denoise"]] / med["sdpa-cudnn"]
    return out


def format_attention(res: dict) -> str:
    lines = [f"attention, one layer: {res['heads']}/{res['kv_heads']} heads of {res['head_dim']}, "
             f"{res['tokens']} queries over {res['keys']} keys; matmul ceiling "
             f"{res['matmul_tflops']:.0f} TFLOP/s (bf16 8192^3, same run)",
             f"  {'variant':<26}{'block':>6}{'median µs':>11}{'p10-p90 µs':>18}{'TFLOP/s':>9}"
             f"{'of ceil':>8}{'max err':>10}"]
    for name, r in res["variants"].items():
        u = r["us"]
        lines.append(f"  {name:<26}{r['block_size']:>6}{u['median']:>11.1f}"
                     f"{u['p10']:>9.1f}-{u['p90']:<8.1f}{r['tflops']:>9.0f}"
                     f"{r['fraction_of_ceiling']:>8.2f}{r['max_error']:>10.1e}")
    for name, note in res["notes"].items():
        lines.append(f"  note: {name}: {note}")
    rt = res["ratios"]
    lines.append(f"  framekv denoise (auto S) / sdpa-cudnn = {rt['denoise_over_sdpa_cudnn']:.3f}; "
                 f"sdpa-flash / framekv denoise = {rt['sdpa_flash_over_denoise']:.2f}; "
                 f"concat-sdpa / framekv denoise = {rt['concat_over_denoise']:.2f}")
    if "denoise_over_sdpa_cudnn_paired" in rt:
        lines.append(f"  framekv denoise / sdpa-cudnn, per round then median = "
                     f"{rt['denoise_over_sdpa_cudnn_paired']:.3f}")
    if "denoise_s1_over_sdpa_cudnn" in rt:
        lines.append(f"  unsplit (S=1) denoise / sdpa-cudnn = {rt['denoise_s1_over_sdpa_cudnn']:.3f}; "
                     f"sdpa-flash / unsplit denoise = {rt['sdpa_flash_over_denoise_s1']:.2f}")
    for name in ("denoise", "clean"):
        if f"best_{name}" in rt:
            lines.append(f"  best {name}: {rt[f'best_{name}']}, {rt[f'best_{name}_over_s1']:.3f} "
                         f"of its S=1 time")
    return "\n".join(lines)
