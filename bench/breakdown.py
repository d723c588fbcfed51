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

The ceiling is a burst at the maximum SM clock; a chunk runs long enough to meet the
board's power limit. So the timed chunks run beside a `clocks.ClockSampler`, and each
record also gives the mean SM clock, draw and power-capped share, and the fraction of
the roofline at that clock (the ceiling scaled by mean / maximum clock).
"""
from __future__ import annotations

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


def reference_chunk_flops(pair) -> dict:
    """`chunk_flops` of one stream's chunk of the reference model, (model, rollout) spec
    pair, at steady state: the denoising forwards over the whole chunk, the clean pass in
    one-frame blocks."""
    m, r = pair
    T, tpf = r.frames_per_chunk * r.tokens_per_frame, r.tokens_per_frame
    return chunk_flops(layers=m.num_layers, heads=m.num_heads, head_dim=m.head_dim,
                       pin=r.prompt_tokens, window=r.window_frames * tpf, tokens=T,
                       blocks=[T] * r.denoising_steps + [tpf],
                       linear_per_token=_linear_reference(m))


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


def measure_wan(config: str = "1.3b", *, latent_size=(60, 104), frames_per_chunk: int = 3,
                sink_frames: int = 1, window_frames: int = 21, chunks: int = 5,
                ceiling: float | None = None, glues=("torch", "fused"),
                progress=print) -> list[dict]:
    """The breakdown of one chunk of `WanRollout` over diffusers' Wan, one record per
    glue (one model for all; module doc)."""
    from framekv.engine import WanRollout
    from framekv.engine.wan import WanShape, build_model

    from .timing import matmul_ceiling
    from .wan import _timed

    model = build_model(config, device="cuda")
    cfg = model.config
    kw = dict(latent_size=tuple(latent_size), frames_per_chunk=frames_per_chunk,
              sink_frames=sink_frames, window_frames=window_frames)
    gen = torch.Generator().manual_seed(0)
    text = torch.randn(1, 512, cfg.text_dim, generator=gen)
    C, (H, W) = cfg.in_channels, latent_size
    fill = -(-(sink_frames + window_frames) // frames_per_chunk) + 1
    noises = [torch.randn(1, C, frames_per_chunk, H, W, generator=gen) for _ in range(fill + chunks)]
    s = WanShape.of(model, latent_size, frames_per_chunk, sink_frames, window_frames)
    hid, tpf, T = s.heads * s.head_dim, s.tokens_per_frame, s.chunk_tokens
    flops = chunk_flops(layers=s.num_layers, heads=s.heads, head_dim=s.head_dim,
                        pin=sink_frames * tpf, window=window_frames * tpf, tokens=T,
                        blocks=[T] * 5,  # 4 steps and a one-block clean pass (the defaults)
                        linear_per_token=s.num_layers * (6 * hid * hid + 2 * hid * cfg.ffn_dim)
                        + 2 * C * 4 * hid, cross_keys=text.shape[1])
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
                    **summarise(prof, flops, ceiling, times, clocks.summary())})
    return out
