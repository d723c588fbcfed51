"""Where a chunk's GPU time goes, and how far it is from its roofline.

One chunk of a rollout in steady state (the window filled first) is profiled eagerly
with the torch profiler (CUDA kernels only); every kernel falls in one category by its
name (`category`):

    attention   cuDNN / flash SDPA kernels (framekv's paged SDPA, the cross-attention)
    gemm        cuBLAS / cuBLASLt / CUTLASS matmuls (nvjet, xmma, cutlass, gemm)
    framekv     framekv's numba-cuda kernels (mangled symbols carry numba's ``cudapy``;
                the profiler shows them demangled, ``framekv::ops::...``)
    other       everything else: torch elementwise, reductions, copies, cat, norms

The useful work of the chunk is its GEMM and attention FLOPs, counted from the shapes
(`chunk_flops`), and its roofline time is that work at the bf16 matmul ceiling measured
in the same run (`timing.matmul_ceiling`). The chunk's fraction of its roofline is
roofline time / the chunk's measured time (a whole-chunk graph replay, host to host,
device drained around it):

    GEMM       2 * tokens * sum(in * out) over every projection of every forward
    attention  4 * H * D * sum over blocks j of (queries_j * keys_j), keys_j the
               block's exact visible set at steady state (P + W + keys of the chunk up
               to block j); Wan adds 4 * H * D * S * L for its cross-attention

less what a clean pass kept for its K/V only does not run (`clean_tail_flops`: its last
layer after the QKV): the roofline counts the work the chunk needs.

The ceiling is a burst at the maximum SM clock; a chunk runs long enough to meet the
board's power limit. So the timed chunks run beside a `clocks.ClockSampler`, and each
record also gives the mean SM clock, draw and power-capped share, and the fraction of
the roofline at that clock (the ceiling scaled by mean / maximum clock).
"""
from __future__ import annotations

import math
import statistics

import torch

from .clocks import ClockSampler, device_id

CATEGORIES = ("attention", "gemm", "framekv", "other")
_ATTENTION = ("sdpa", "fmha", "flash", "attention", "attn")
_GEMM = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "gemv", "matmul")


def category(kernel: str) -> str:
    """The category of a CUDA kernel, from its (mangled or demangled) name."""
    n = kernel.lower()
    if "cudapy" in n or n.startswith("framekv::"):
        return "framekv"
    if any(k in n for k in _ATTENTION):
        return "attention"
    if any(k in n for k in _GEMM):
        return "gemm"
    return "other"


def profile_kernels(run) -> dict:
    """Run ``run()`` once under the profiler: {"us": {category: µs}, "kernels": count,
    "top_other": [(name, µs)] the ten largest kernels of "other"}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    us = dict.fromkeys(CATEGORIES, 0.0)
    other: dict[str, float] = {}
    count = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = float(e.device_time_total)
        cat = category(e.name)
        us[cat] += t
        count += 1
        if cat == "other":
            other[e.name] = other.get(e.name, 0.0) + t
    top = sorted(other.items(), key=lambda kv: -kv[1])[:10]
    return {"us": us, "kernels": count, "top_other": [(k[:120], v) for k, v in top]}


def attention_flops(*, heads: int, head_dim: int, pin: int, window: int, tokens: int,
                    block: int) -> int:
    """FLOPs of one layer's self-attention over a forward of ``tokens`` queries in blocks
    of ``block`` at steady state (module doc)."""
    return sum(4 * heads * head_dim * block * (pin + window + (j + 1) * block)
               for j in range(tokens // block))


def chunk_flops(*, layers: int, heads: int, head_dim: int, pin: int, window: int, tokens: int,
                blocks: list[int], linear_per_token: int, cross_keys: int = 0) -> dict:
    """GEMM and attention FLOPs of one chunk: one forward per entry of ``blocks`` (its
    block size), each of ``tokens`` tokens; ``linear_per_token``: sum(in * out) of one
    token's projections over the whole model; ``cross_keys``: text tokens of a
    cross-attention (0: none)."""
    gemm = 2 * tokens * linear_per_token * len(blocks)
    attn = sum(attention_flops(heads=heads, head_dim=head_dim, pin=pin, window=window,
                               tokens=tokens, block=b) for b in blocks) * layers
    attn += 4 * heads * head_dim * tokens * cross_keys * layers * len(blocks)
    return {"gemm": gemm, "attention": attn}


def without(flops: dict, skipped: dict) -> dict:
    """``flops`` less the work a chunk skips (per category)."""
    return {k: v - skipped.get(k, 0) for k, v in flops.items()}


def clean_tail_flops(*, heads: int, head_dim: int, pin: int, window: int, tokens: int,
                     block: int, tail_per_token: int, cross_keys: int = 0) -> dict:
    """FLOPs a clean pass kept for its K/V only skips (``trim_clean_pass``): its last
    layer's self-attention (blocks of ``block``) and cross-attention, and the
    projections after that layer's QKV (``tail_per_token``: their sum(in * out) per
    token, the head's included where it is skipped too)."""
    attn = attention_flops(heads=heads, head_dim=head_dim, pin=pin, window=window,
                           tokens=tokens, block=block)
    return {"gemm": 2 * tokens * tail_per_token,
            "attention": attn + 4 * heads * head_dim * tokens * cross_keys}


def roofline(flops: dict, ceiling_tflops: float, chunk_us: float) -> dict:
    """The chunk's roofline time (µs) and its fraction of it."""
    ideal = (flops["gemm"] + flops["attention"]) / (ceiling_tflops * 1e6)
    return {"roofline_us": ideal, "fraction": ideal / chunk_us}


def summarise(profile: dict, flops: dict, ceiling_tflops: float, chunk_us: list[float],
              clocks: dict | None = None) -> dict:
    """One breakdown record: category µs and shares, FLOPs, ceiling, chunk time, roofline;
    with ``clocks`` (`clocks.summarise_samples` over the timed chunks) also the fraction
    of the roofline at the sampled SM clock (the ceiling scaled by mean / max clock: the
    matmul ceiling is a burst at the maximum clock)."""
    total = sum(profile["us"].values())
    median = statistics.median(chunk_us)
    out = {"kernel_us": profile["us"], "kernel_total_us": total,
           "share": {k: v / total for k, v in profile["us"].items()},
           "kernels": profile["kernels"], "top_other": profile["top_other"],
           "flops": flops, "ceiling_tflops": ceiling_tflops, "chunk_us": median,
           **roofline(flops, ceiling_tflops, median), "clocks": clocks}
    if clocks:
        out["fraction_at_clock"] = out["fraction"] * clocks["sm_mhz_max"] / clocks["sm_mhz_mean"]
    return out


def format_breakdown(name: str, r: dict) -> str:
    s = r["share"]
    return (f"  {name}: chunk {r['chunk_us'] / 1e3:.1f} ms (kernels {r['kernel_total_us'] / 1e3:.1f} ms, "
            f"{r['kernels']} launches): attention {s['attention']:.1%}, GEMM {s['gemm']:.1%}, "
            f"framekv {s['framekv']:.1%}, other {s['other']:.1%}; roofline "
            f"{r['roofline_us'] / 1e3:.1f} ms at {r['ceiling_tflops']:.0f} TFLOP/s = "
            f"{r['fraction']:.2f} of the chunk{_format_clocks(r)}")


def _format_clocks(r: dict) -> str:
    c = r.get("clocks")
    if not c:
        return ""
    return (f"; SMs at {c['sm_mhz_mean']:.0f} of {c['sm_mhz_max']:.0f} MHz, "
            f"{c['power_w_mean']:.0f} of {c['power_limit_w']:.0f} W, power-capped "
            f"{c['power_capped_share']:.0%} of samples: {r['fraction_at_clock']:.2f} of the "
            f"roofline at that clock")


def _linear_reference(m) -> int:
    """sum(in * out) of one token's projections through the reference model."""
    H, Hkv, D, hid = m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size
    per_layer = hid * (H + 2 * Hkv) * D + H * D * hid + 2 * hid * m.ffn_size
    return m.num_layers * per_layer + 2 * m.patch_dim * hid


def reference_chunk_flops(pair, *, trimmed: bool = True) -> dict:
    """`chunk_flops` of one stream's chunk of the reference model, (model, rollout) spec
    pair, at steady state: the denoising forwards over the whole chunk, the clean pass in
    one-frame blocks; ``trimmed``: less what a K/V-only clean pass skips (its last
    block after the QKV, and the head)."""
    m, r = pair
    T, tpf = r.frames_per_chunk * r.tokens_per_frame, r.tokens_per_frame
    geo = dict(heads=m.num_heads, head_dim=m.head_dim, pin=r.prompt_tokens,
               window=r.window_frames * tpf, tokens=T)
    flops = chunk_flops(layers=m.num_layers, **geo, blocks=[T] * r.denoising_steps + [tpf],
                        linear_per_token=_linear_reference(m))
    if not trimmed:
        return flops
    hid = m.hidden_size
    tail = m.num_heads * m.head_dim * hid + 2 * hid * m.ffn_size + m.patch_dim * hid
    return without(flops, clean_tail_flops(**geo, block=tpf, tail_per_token=tail))


def measure_reference(preset: str = "wan-1.3b", *, window_frames: int = 21, chunks: int = 5,
                      ceiling: float | None = None, glues=("torch", "fused"),
                      progress=print) -> list[dict]:
    """The breakdown of one chunk of the reference model's rollout, one record per glue
    (one model for all; module doc)."""
    from framekv.engine.rollout import Rollout

    from .e2e import time_rollout, with_window
    from .timing import matmul_ceiling

    pair = with_window(preset, window_frames)
    r = pair[1]
    flops = reference_chunk_flops(pair)
    ceiling = ceiling or matmul_ceiling()
    model, out = None, []
    for glue in glues:
        progress(f"breakdown {preset} window {r.window_frames}, {glue} glue: an eager chunk")
        eager = Rollout(pair, "cuda", use_graphs=False, glue=glue, model=model)
        model = eager.model
        time_rollout(eager, 1)
        prof = profile_kernels(eager.step)
        eager.close()
        graphs = Rollout(pair, "cuda", model=model, glue=glue)
        with ClockSampler(device_id(torch.cuda.current_device())) as clocks:
            times, _, _ = time_rollout(graphs, chunks)
        graphs.close()
        out.append({"model": f"reference {preset}, {glue} glue", "window_frames": r.window_frames,
                    **summarise(prof, flops, ceiling, times, clocks.summary())})
    return out


def wan_chunk(config: str, *, latent_size, frames_per_chunk: int, sink_frames: int,
              window_frames: int):
    """What a Wan measurement runs on: (a random ``WanTransformer3DModel`` on CUDA, the
    `WanRollout` geometry keywords, a 512-token prompt, the generator that drew it,
    for the noise that follows)."""
    from framekv.engine.wan import build_model

    model = build_model(config, device="cuda")
    kw = dict(latent_size=tuple(latent_size), frames_per_chunk=frames_per_chunk,
              sink_frames=sink_frames, window_frames=window_frames)
    gen = torch.Generator().manual_seed(0)
    return model, kw, torch.randn(1, 512, model.config.text_dim, generator=gen), gen


def wan_chunk_flops(model, kw: dict, text_tokens: int) -> tuple[dict, dict]:
    """(`chunk_flops` of one `WanRollout` chunk at steady state: 4 steps and a one-block
    clean pass, the defaults; the `clean_tail_flops` its clean pass skips: its last
    block after the QKV, and the head)."""
    from framekv.engine.wan import WanShape

    s = WanShape.of(model, kw["latent_size"], kw["frames_per_chunk"], kw["sink_frames"],
                    kw["window_frames"])
    hid, tpf, T, ffn = s.heads * s.head_dim, s.tokens_per_frame, s.chunk_tokens, model.config.ffn_dim
    geo = dict(heads=s.heads, head_dim=s.head_dim, pin=kw["sink_frames"] * tpf,
               window=kw["window_frames"] * tpf, tokens=T, cross_keys=text_tokens)
    flops = chunk_flops(layers=s.num_layers, **geo, blocks=[T] * 5,
                        linear_per_token=s.num_layers * (6 * hid * hid + 2 * hid * ffn)
                        + 2 * model.config.in_channels * 4 * hid)
    head = hid * model.config.out_channels * math.prod(s.patch_size)          # proj_out
    return flops, clean_tail_flops(**geo, block=T,
                                   tail_per_token=3 * hid * hid + 2 * hid * ffn + head)


def measure_wan(config: str = "1.3b", *, latent_size=(60, 104), frames_per_chunk: int = 3,
                sink_frames: int = 1, window_frames: int = 21, chunks: int = 5,
                ceiling: float | None = None, glues=("torch", "fused"),
                progress=print) -> list[dict]:
    """The breakdown of one chunk of `WanRollout` over diffusers' Wan, one record per
    glue (one model for all; module doc)."""
    from framekv.engine import WanRollout

    from .timing import matmul_ceiling
    from .wan import _timed

    model, kw, text, gen = wan_chunk(config, latent_size=latent_size,
                                     frames_per_chunk=frames_per_chunk,
                                     sink_frames=sink_frames, window_frames=window_frames)
    C, (H, W) = model.config.in_channels, latent_size
    fill = -(-(sink_frames + window_frames) // frames_per_chunk) + 1
    noises = [torch.randn(1, C, frames_per_chunk, H, W, generator=gen) for _ in range(fill + chunks)]
    flops, tail = wan_chunk_flops(model, kw, text.shape[1])
    ceiling = ceiling or matmul_ceiling()
    out = []
    for glue in glues:
        progress(f"breakdown wan {config} window {window_frames}, {glue} glue: an eager chunk")
        eager = WanRollout(model, use_graphs=False, glue=glue, **kw)
        eager.set_prompt(text)
        _timed(eager.step, noises[:fill], fill, eager.device)
        prof = profile_kernels(lambda: eager.step(noises[fill]))
        eager.close()
        r = WanRollout(model, glue=glue, **kw)
        r.set_prompt(text)
        r.capture()
        with ClockSampler(device_id(torch.cuda.current_device())) as clocks:
            times, _ = _timed(r.step, noises, fill, r.device)
        r.close()
        out.append({"model": f"diffusers Wan {config} (WanRollout), {glue} glue",
                    "window_frames": window_frames,
                    **summarise(prof, without(flops, tail) if glue == "fused" else flops,
                                ceiling, times, clocks.summary())})
    return out
