"""End to end: diffusers' Wan transformer rolled out, framekv against what users run.

One model (a shipped config, random weights, bf16 as ``torch_dtype`` would load it),
the same prompt and the same chunk noise for every variant:

    framekv-graphs   `WanRollout` over the paged cache, each chunk one graph replay
    framekv-fused-graphs  the same with the blocks' glue, QK norm and rope through
                     framekv's fused ops (``glue="fused"``)
    framekv-eager    the same, every kernel launched from Python
    dense-eager      `WanRollout` over `DenseRollingKV`: per-layer dense K/V rolled by
                     copying, torch SDPA (cuDNN) over it: what Self-Forcing runs
    dense-graphs     the same under CUDA graphs (captured at a full window)
    stock-recompute  the stock model over every visible frame (sink, window, chunk) at
                     every step, full attention, no cache: a diffusers user's loop

The window is filled first, then ``chunks`` chunks are timed host to host with the
device drained around each. Latent frames per second = frames / time; peak memory is
torch's peak allocation plus the K/V arena.

    python -m framekv.bench.wan --json FILE      (also `framekv bench --sections wan`)
"""
from __future__ import annotations

import sys
import time

import torch

from .report import CHUNK_HEAD, chunk_cells, print_report, section_parser, wan_shape
from .timing import require_cuda, stderr_progress, summary

VARIANTS = ("stock-recompute", "framekv-graphs", "framekv-fused-graphs", "framekv-eager",
            "dense-eager", "dense-graphs")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rollout(variant: str, model, kw: dict, kv_dtype=None):
    from framekv.engine import WanRollout
    from framekv.engine.wan import WanShape

    from .dense import DenseRollingKV

    graphs = variant.endswith("graphs")
    if variant.startswith("framekv"):
        return WanRollout(model, use_graphs=graphs, glue="fused" if "fused" in variant else "torch",
                          kv_dtype=kv_dtype, **kw)
    shape = WanShape.of(model, kw["latent_size"], kw["frames_per_chunk"], kw["sink_frames"],
                        kw["window_frames"])
    device = next(model.parameters()).device
    dense = DenseRollingKV(shape.geometry(), num_layers=shape.num_layers,
                           num_kv_heads=shape.heads, head_dim=shape.head_dim,
                           dtype=model.patch_embedding.weight.dtype, device=device,
                           backend="cudnn" if device.type == "cuda" else "math")
    # The baseline's glue is the stock blocks' torch ops and its clean pass runs every
    # layer, as Self-Forcing runs them.
    return WanRollout(model, use_graphs=graphs, kv=dense, glue="torch", trim_clean_pass=False, **kw)


def _timed(step, noises, fill: int, device) -> tuple[list[float], list[torch.Tensor]]:
    """Run ``fill`` untimed chunks, then time one chunk per remaining noise (µs)."""
    times, outs = [], []
    for i, noise in enumerate(noises):
        _sync(device)
        t0 = time.perf_counter()
        out = step(noise)
        _sync(device)
        if i >= fill:
            times.append((time.perf_counter() - t0) * 1e6)
            outs.append(out)
    return times, outs


class StockRecompute:
    """The unmodified model over sink + window + chunk frames at every step (module doc)."""

    def __init__(self, model, text, *, frames_per_chunk, sink_frames, window_frames, timesteps):
        self.model, self.text, self.F = model, text, frames_per_chunk
        self.device, self.dtype = text.device, model.patch_embedding.weight.dtype
        _, ph, pw = model.config.patch_size
        self.patch = ph * pw
        self.sink, self.window = sink_frames, window_frames
        self.ts = [float(t) for t in timesteps]
        self.sig = [t / 1000 for t in self.ts] + [0.0]
        self.frames: list[torch.Tensor] = []     # finished latent frames [1, C, 1, H, W]

    @torch.no_grad()
    def step(self, noise: torch.Tensor) -> torch.Tensor:
        hist = self.frames[:self.sink] + self.frames[self.sink:][-self.window:] \
            if self.window else self.frames[:self.sink]
        x = noise.to(self.device)
        tpf = x.shape[3] * x.shape[4] // self.patch
        for i, t in enumerate(self.ts):
            full = torch.cat([*hist, x], dim=2).to(self.dtype)
            tstep = torch.tensor([[0.0] * (len(hist) * tpf) + [t] * (self.F * tpf)],
                                 device=self.device)
            v = self.model(full, tstep, self.text, return_dict=False)[0][:, :, -self.F:].float()
            x = x + (self.sig[i + 1] - self.sig[i]) * v
        self.frames += list(x.split(1, dim=2))
        return x


def measure_wan(config: str = "1.3b", *, latent_size=(60, 104), frames_per_chunk: int = 3,
                sink_frames: int = 1, window_frames: int = 21, chunks: int = 5,
                recompute_chunks: int = 3, variants=VARIANTS, device="cuda",
                progress=print, kv_dtype=None) -> dict:
    """Per-chunk latency, latent frames per second and peak memory of each variant;
    ``kv_dtype``: the pool of the framekv variants (`WanRollout`'s; the baselines keep
    the model's dtype)."""
    from framekv.engine.wan import build_model

    device = torch.device(device)
    cuda = device.type == "cuda"
    model = build_model(config, device=device)
    kw = dict(latent_size=tuple(latent_size), frames_per_chunk=frames_per_chunk,
              sink_frames=sink_frames, window_frames=window_frames)
    gen = torch.Generator().manual_seed(0)
    text = torch.randn(1, 512, model.config.text_dim, generator=gen).to(
        device, model.patch_embedding.weight.dtype)
    fill = -(-(sink_frames + window_frames) // frames_per_chunk) + 1
    C, (H, W) = model.config.in_channels, latent_size
    noises = [torch.randn(1, C, frames_per_chunk, H, W, generator=gen) for _ in range(fill + chunks)]
    results, latents = {}, {}
    for variant in variants:
        progress(f"wan {config} window {window_frames} frames: {variant}")
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if variant == "stock-recompute":
            runner = StockRecompute(model, text, timesteps=(1000, 750, 500, 250), **{
                k: kw[k] for k in ("frames_per_chunk", "sink_frames", "window_frames")})
            times, outs = _timed(runner.step, noises[:fill + recompute_chunks], fill, device)
            arena, path = 0, "eager"
        else:
            r = _rollout(variant, model, kw, kv_dtype)
            r.set_prompt(text)
            if r.use_graphs:
                r.capture()
            times, outs = _timed(r.step, noises, fill, device)
            arena = r.cache.pool_bytes if r.cache is not None else r.kv.buffer_bytes
            path = "graphs" if r.use_graphs else "eager"
        latents[variant] = outs
        results[variant] = {
            "chunk_us": summary(times), "path": path,
            "frames_per_second": frames_per_chunk * len(times) / (sum(times) / 1e6),
            "peak_bytes": (torch.cuda.max_memory_allocated() if cuda else 0) + arena}
    _compare(results, latents)
    _, ph, pw = model.config.patch_size
    tpf = (H // ph) * (W // pw)
    return {"config": config, "layers": len(model.blocks), "latent_size": list(latent_size),
            "kv_dtype": kv_dtype or "bf16",
            "frames_per_chunk": frames_per_chunk, "sink_frames": sink_frames,
            "window_frames": window_frames, "tokens_per_frame": tpf,
            "keys": (sink_frames + window_frames + frames_per_chunk) * tpf, "chunks": chunks,
            "variants": results}


def _compare(results: dict, latents: dict) -> None:
    """Max abs difference of each variant's latents from framekv-eager's (the dense
    paths compute the same math in another order; stock-recompute is other math)."""
    base = latents.get("framekv-eager")
    for name, outs in latents.items():
        if base is not None and name != "stock-recompute":
            results[name]["max_abs_diff_vs_framekv_eager"] = max(
                float((a - b).abs().max()) for a, b in zip(base, outs))


def format_wan(res: dict) -> str:
    lines = [f"end to end: Wan {res['config']} ({res['layers']} layers), {wan_shape(res)}",
             f"  {'variant':<17}{CHUNK_HEAD}{'peak GiB':>10}{'vs eager diff':>15}  path"]
    for name, r in res["variants"].items():
        ms = {k: v / 1e3 for k, v in r["chunk_us"].items()}
        lines.append(f"  {name:<17}{chunk_cells(ms, r['frames_per_second'], 1)}"
                     f"{r['peak_bytes'] / 2**30:>10.2f}"
                     f"{r.get('max_abs_diff_vs_framekv_eager', float('nan')):>15.2e}  {r['path']}")
    v = res["variants"]
    # framekv-fused-graphs is `WanRollout`'s default (glue="fused"); framekv-graphs keeps
    # the stock blocks' torch glue, as the dense baselines do.
    for a, b in (("framekv-fused-graphs", "dense-eager"), ("framekv-fused-graphs", "dense-graphs"),
                 ("framekv-graphs", "dense-eager"), ("framekv-graphs", "dense-graphs"),
                 ("framekv-graphs", "stock-recompute")):
        if a in v and b in v:
            lines.append(f"  {a} / {b} frames per second = "
                         f"{v[a]['frames_per_second'] / v[b]['frames_per_second']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = section_parser("wan", __doc__)
    p.add_argument("--config", default="1.3b", help="tiny or 1.3b (default 1.3b)")
    p.add_argument("--chunks", type=int, default=5, help="timed chunks per variant")
    args = p.parse_args(argv)
    require_cuda("framekv.bench.wan")
    res = measure_wan(args.config, window_frames=args.window, chunks=args.chunks,
                      progress=stderr_progress("wan"))
    return print_report(format_wan(res), args.json_path, wan=res)


if __name__ == "__main__":
    sys.exit(main())
