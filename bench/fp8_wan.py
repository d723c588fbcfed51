"""diffusers' Wan transformer rolled out by `WanRollout` in bf16, over an fp8 pool, and
over an fp8 pool with fp8 GEMMs, one model shared: speed beside accuracy.

One model per config (`framekv.engine.wan.CONFIGS`: random weights of a fixed seed,
built in bf16 as ``torch_dtype`` would load it; fp32 on a CPU, or a config dict), one
prompt (random embeddings), the sizes of `framekv.bench.wan` (latent 60x104, 3-frame
chunks, a 1-frame sink, a 21-frame window). Three rollouts, graphed (`fp8_common.RUNS`):
"bf16" (``kv_dtype`` and ``gemm_dtype`` None: the model's dtype), "fp8" (float8 e4m3
K/V, the rollout's default scales) and "fp8-gemm" (the fp8 pool and fp8 GEMMs,
`framekv.engine.fp8_linear`).

    latents   from the first chunk, the same noise for all: per chunk, each fp8 run's
              clean latents' relative L2 distance from the bf16 run's,
              ||x8 - x16|| / ||x16||, over ``chunks`` chunks: median, p90, max
    speed     every window filled (sink and window full), one chunk per round of
              each, CUDA events around each (host timers on a CPU): median ms per
              chunk, latent frames per second, each fp8 run's speed-up (bf16 time /
              its time)
    memory    per run, the weights plus torch's peak allocation while that rollout
              was built (the fp8 GEMMs' weight copies included), captured and run,
              plus its K/V pool; and the process's whole device footprint (torch's
              reserve, the pools, workspaces) after timing

Order: "rotated" keeps every rollout and times them in turn, the order rotated every
round; "sequential" runs one rollout at a time (the latents kept on the host), each
closed before the next and timed alone: for a model whose pools do not fit together
beside its weights. "auto" picks rotated when every pool and `HEADROOM_BYTES` each fit
in the free device memory after the weights (and a run with fp8 GEMMs its weights'
fp8 copies).
"""
from __future__ import annotations

import gc

import torch

from .fp8_common import (
    RUNS,
    PeakMeter,
    fp8_pool_stats,
    latents_from_bf16,
    latents_line,
    ms_summary,
    rotated_times,
    run_speedups,
    saturation_line,
)
from .report import CHUNK_HEAD, chunk_cells, wan_shape

#: `WanRollout` sizes (`framekv.bench.wan`'s).
SIZES = {"latent_size": (60, 104), "frames_per_chunk": 3, "sink_frames": 1, "window_frames": 21}
#: Device memory a rollout needs beyond its K/V pool (activations, graph pools, cuDNN
#: workspaces), an allowance for "auto" order.
HEADROOM_BYTES = 4 << 30
ORDERS = ("auto", "rotated", "sequential")


class WanPools:
    """The rollouts of one model (module doc): building, running, timing each."""

    def __init__(self, model, sizes: dict, *, chunks: int, rounds: int, seed: int,
                 prompt_tokens: int, backend, progress):
        from framekv.engine.wan import WanShape

        self.model, self.sizes, self.backend, self.progress = model, sizes, backend, progress
        self.chunks, self.rounds = chunks, rounds
        self.shape = WanShape.of(model, **sizes)
        self.device = next(model.parameters()).device
        self.cuda = self.device.type == "cuda"
        dtype = model.patch_embedding.weight.dtype
        gen = torch.Generator().manual_seed(seed + 1)
        self.text = torch.randn(1, prompt_tokens, model.config.text_dim,
                                generator=gen).to(self.device, dtype)
        F, (H, W) = sizes["frames_per_chunk"], sizes["latent_size"]
        self.fill = -(-(sizes["sink_frames"] + sizes["window_frames"]) // F) + 1
        self.noises = [torch.randn(1, self.shape.channels, F, H, W, generator=gen)
                       for _ in range(max(chunks, self.fill))]
        self.weights_bytes = torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def pool_bytes(self, name: str) -> int:
        """Device bytes the pool of run ``name`` (`RUNS`) maps once opened."""
        from framekv.engine import CausalKVCache
        from framekv.engine.rollout import resolve_kv_dtype

        s = self.shape
        dtype = resolve_kv_dtype(RUNS[name][0], self.model.patch_embedding.weight.dtype)
        return CausalKVCache.pool_bytes_for(s.geometry(), num_layers=s.num_layers,
                                            num_kv_heads=s.heads, head_dim=s.head_dim,
                                            dtype=dtype, tokens_per_page=s.tokens_per_page)

    def choose(self, order: str) -> str:
        """``order``, "auto" resolved (module doc)."""
        if order != "auto":
            return order
        if not self.cuda:
            return "rotated"
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info(self.device)[0]
        # a run with fp8 GEMMs also holds a byte per weight of the blocks' matrices
        fp8 = sum(p.numel() for p in self.model.blocks.parameters() if p.dim() == 2)
        need = sum(self.pool_bytes(n) + HEADROOM_BYTES + (fp8 if RUNS[n][1] else 0)
                   for n in RUNS)
        return "rotated" if need <= free else "sequential"

    def build(self, name: str):
        """The rollout of run ``name``, prompted and captured; (rollout, its meter)."""
        from framekv.engine import WanRollout

        self.progress(f"fp8 wan: building and capturing the {name} rollout")
        meter = PeakMeter(self.device)
        kv_dtype, gemm_dtype = RUNS[name]
        r = WanRollout(self.model, kv_dtype=kv_dtype, gemm_dtype=gemm_dtype,
                       backend=self.backend, **self.sizes)
        r.set_prompt(self.text)
        if r.use_graphs:
            r.capture()
        r.cache.reset_kv_stats()  # the captures' warm-up chunks are not the rollout's
        return r, meter

    def latents(self, name: str, r, meter: PeakMeter) -> list[torch.Tensor]:
        """The clean latents (on the host) of the first ``chunks`` chunks; then the
        rollout goes on until its window is full, and ``meter`` stops."""
        self.progress(f"fp8 wan: {len(self.noises)} chunks of the {name} rollout")
        out = [r.step(noise).cpu() for noise in self.noises]
        meter.stop()
        return out[:self.chunks]

    def timed(self, rollouts: dict) -> dict[str, list[float]]:
        """µs per chunk of each rollout, one chunk of each per round, rotated."""
        self.progress(f"fp8 wan: {self.rounds} rounds of {' and '.join(rollouts)}")
        noise = self.noises[0]
        calls = {name: (lambda r=r: r.step(noise)) for name, r in rollouts.items()}
        return rotated_times(calls, self.rounds, cuda=self.cuda)

    def pool_result(self, r, meter: PeakMeter, us: list[float]) -> dict:
        ms = ms_summary(us)
        out = {"dtype": str(r.kv_dtype).removeprefix("torch."),
               "gemm_dtype": str(r.gemm_dtype).removeprefix("torch."),
               "pool_bytes": r.cache.pool_bytes,
               "chunk_ms": ms, "path": r.path,
               "frames_per_second": self.sizes["frames_per_chunk"] / (ms["median"] / 1e3),
               "peak_bytes": self.weights_bytes + meter.peak() + r.cache.pool_bytes,
               "device_used_bytes": _device_used(self.device)}
        if r.cache.quantized:
            out.update(fp8_pool_stats(r.cache.kv_stats()))
        return out

    def rotated(self) -> tuple[dict, dict, dict]:
        """Every rollout alive, timed in turn: (run results, latents, µs) by run."""
        built, lat = {}, {}
        for name in RUNS:
            built[name] = self.build(name)
            lat[name] = self.latents(name, *built[name])
        times = self.timed({name: r for name, (r, _) in built.items()})
        res = {name: self.pool_result(r, m, times[name]) for name, (r, m) in built.items()}
        for r, _ in built.values():
            r.close()
        return res, lat, times

    def sequential(self) -> tuple[dict, dict, dict]:
        """One rollout at a time, each timed alone: as `rotated`."""
        res, lat, times = {}, {}, {}
        for name in RUNS:
            r, meter = self.build(name)
            lat[name] = self.latents(name, r, meter)
            times.update(self.timed({name: r}))
            res[name] = self.pool_result(r, meter, times[name])
            r.close()
            del r
            release(self.device)
        return res, lat, times


def release(device: torch.device) -> None:
    """Collect garbage (arenas freed with their owners) and, on CUDA, hand torch's
    cached blocks back to the driver, which maps the next pool outside torch."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _device_used(device: torch.device) -> int:
    """Device bytes in use by anyone (total - free); 0 on a CPU."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def measure_wan_pools(config="1.3b", *, chunks: int = 20, rounds: int = 10, order="auto",
                      device="cuda", backend=None, seed: int = 0, prompt_tokens: int = 512,
                      progress=print, **sizes) -> dict:
    """The bf16, fp8 and fp8-gemm runs of one Wan config side by side (module doc).

    Args:
        config: a `framekv.engine.wan.CONFIGS` name ("tiny", "1.3b", "14b") or a config
            dict (reported as "custom").
        chunks: chunks whose latents are compared, from the first (>= 1).
        rounds: timed chunks of each pool.
        order: "auto", "rotated" or "sequential" (module doc).
        device, backend: where the model runs and the rollouts' attention backend.
        seed: the weights' seed (the prompt and noise: seed + 1).
        prompt_tokens: L of the random prompt embeddings.
        sizes: `WanRollout` sizes over `SIZES` (latent_size, frames_per_chunk,
            sink_frames, window_frames).
    """
    from framekv.engine.wan import build_model

    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    device, sizes = torch.device(device), {**SIZES, **sizes}
    progress(f"fp8 wan {config}: building the model (random weights, seed {seed})")
    release(device)
    model = build_model(config, device=device, seed=seed,  # fp32 on a CPU
                        dtype=torch.bfloat16 if device.type == "cuda" else None)
    release(device)  # the fp32 init's blocks
    wp = WanPools(model, sizes, chunks=chunks, rounds=rounds, seed=seed,
                  prompt_tokens=prompt_tokens, backend=backend, progress=progress)
    order = wp.choose(order)
    pools, lat, times = wp.rotated() if order == "rotated" else wp.sequential()
    for name, d in latents_from_bf16(lat).items():
        pools[name]["latents_rel_l2"] = d
    res = {"config": config if isinstance(config, str) else "custom", **_sizes(wp.shape),
           "chunks": chunks, "rounds": rounds,
           "order": order, "device": str(device),
           "timer": "cuda events" if device.type == "cuda" else "host",
           "model_dtype": str(model.patch_embedding.weight.dtype).removeprefix("torch."),
           "weights_bytes": wp.weights_bytes, "pools": pools, **run_speedups(times),
           "fp8_pool_fraction": pools["fp8"]["pool_bytes"] / pools["bf16"]["pool_bytes"]}
    del wp, model
    release(device)
    return res


def _sizes(s) -> dict:
    """A `WanShape`'s sizes, and keys per forward (sink, window and chunk)."""
    return {"layers": s.num_layers, "heads": s.heads, "head_dim": s.head_dim,
            "latent_size": list(s.latent_size), "frames_per_chunk": s.frames_per_chunk,
            "sink_frames": s.sink_frames, "window_frames": s.window_frames,
            "tokens_per_frame": s.tokens_per_frame,
            "keys": (s.sink_frames + s.window_frames + s.frames_per_chunk) * s.tokens_per_frame}


def format_wan_pools(res: dict) -> str:
    """One config's table."""
    lines = [f"fp8 wan {res['config']} ({res['layers']} layers, {res['heads']} heads of "
             f"{res['head_dim']}, {res['model_dtype']}), {wan_shape(res)}, {res['rounds']} "
             f"rounds {res['order']} ({res['timer']}), {res['device']}",
             f"  {'run':<9}{'K/V dtype':<15}{CHUNK_HEAD}"
             f"{'pool GiB':>10}{'peak GiB':>10}{'device GiB':>12}  path"]
    for name, r in res["pools"].items():
        cells = chunk_cells(r["chunk_ms"], r["frames_per_second"], 2)
        lines.append(f"  {name:<9}{r['dtype']:<15}{cells}"
                     f"{r['pool_bytes'] / 2**30:>10.2f}{r['peak_bytes'] / 2**30:>10.2f}"
                     f"{r['device_used_bytes'] / 2**30:>12.2f}  {r['path']}")
    paired = "per round" if res["order"] == "rotated" else "round by round, timed apart"
    for name, r in res["pools"].items():
        if name == "bf16":
            continue
        key = name.replace("-", "_")
        lines.append(f"  {name} speed-up (bf16 time / {name} time) {res[key + '_speedup']:.3f} "
                     f"({paired} {res[key + '_speedup_paired']:.3f}); "
                     + latents_line(r, name))
    lines.append(f"  fp8 pool bytes {res['fp8_pool_fraction']:.3f} of bf16's; weights "
                 f"{res['weights_bytes'] / 2**30:.2f} GiB")
    lines.append("  " + saturation_line(res["pools"]["fp8"]))
    return "\n".join(lines)
