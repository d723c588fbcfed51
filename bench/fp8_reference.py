"""The reference DiT of a preset in bf16, over an fp8 pool, and over an fp8 pool with
fp8 GEMMs, side by side: the same chunks, speed beside accuracy.

One model (the reference DiT of a preset, its window set to ``window_frames``, every
chunk full), three runs (`fp8_common.RUNS`): "bf16", the model's dtype (bf16 on CUDA;
fp32 on a CPU, where only the code path is exercised), "fp8", a float8 e4m3 pool at
the default scales (1.0), and "fp8-gemm", that pool and fp8 GEMMs
(`framekv.engine.fp8_linear`). Per run:

    attention   (the two pools: "fp8-gemm" has the fp8 one) an eager rollout with an
                attention recorder, its window filled, then one chunk measured: every
                forward's attention output at the measured layers (first, middle,
                last) against the fp32 exact-window reference over the same K/V
                unquantized (`ExactWindowReference`, the oracle of `framekv verify`):
                max and mean |d|
    latents     the graphed rollouts side by side from the first chunk, the same noise:
                per chunk, each fp8 run's clean latents' relative L2 distance from the
                bf16 run's, ||x8 - x16|| / ||x16||, over ``chunks`` chunks (the error
                compounds through the history): median, p90, max
    speed       every window filled, one chunk of each per round, the order rotated
                every round (A B C, B C A, ...: none is always first after the host's
                sync), CUDA events around each (host timers on a CPU): median ms per
                chunk, each run's time over bf16's and its speed-up
    saturation  the fp8 pool's saturated values and its largest |K| and |V|
                (`CausalKVCache.kv_stats`)
"""
from __future__ import annotations

import statistics

import msgspec
import torch

from .fp8_common import (
    POOLS,
    RUNS,
    fp8_pool_stats,
    latents_from_bf16,
    latents_line,
    ms_summary,
    rotated_times,
    run_speedups,
    saturation_line,
)


def measured_layers(num_layers: int) -> list[int]:
    """The layers whose attention is checked: first, middle and last."""
    return sorted({0, num_layers // 2, num_layers - 1})


class AttentionErrors:
    """An attention recorder (`ChunkRunner.attention_recorder`): keeps the measured
    layers' K/V in an `ExactWindowReference` at every forward and, while ``measure``,
    the max and the sum of |d| of their outputs against it."""

    def __init__(self, geometry, layers: list[int]):
        from framekv.engine.cache import ExactWindowReference

        self.index = {layer: i for i, layer in enumerate(layers)}
        self.reference = ExactWindowReference(geometry, len(layers))
        self.measure = False
        self.max, self.total, self.count = 0.0, 0.0, 0

    def __call__(self, layer, qkv, out, seq_len, block_size) -> None:
        i = self.index.get(layer)
        if i is None:
            return
        H = out.shape[2]                                                 # out [1, S, H, D]
        Hkv = (qkv.shape[2] - H) // 2
        ref = self.reference
        ref.write(i, ref.committed, qkv[0, :seq_len, H:H + Hkv], qkv[0, :seq_len, H + Hkv:])
        if self.measure:
            want = ref.attention(i, qkv[0, :, :H], seq_len, block_size, device=qkv.device)
            d = (out[0, :seq_len].float() - want[:seq_len]).abs()
            self.max = max(self.max, float(d.max()))
            self.total += float(d.sum())
            self.count += d.numel()

    def result(self) -> dict:
        return {"max_abs": self.max, "mean_abs": self.total / max(self.count, 1)}


def _pair(preset, window_frames: int | None):
    """(model spec, rollout spec) of ``preset`` at ``window_frames``, every chunk full."""
    from .e2e import with_window

    mspec, rspec = with_window(preset, window_frames)
    return mspec, msgspec.structs.replace(rspec, last_chunk_frames=0)


def _fill(rspec) -> int:
    """Chunks that fill the window (and one more: every forward then sees P + W + T)."""
    return -(-rspec.window_frames // rspec.frames_per_chunk) + 1


def _attention_accuracy(pair, device, backend, layers, progress):
    """Per pool: the measured layers' attention errors over one chunk after the fill;
    (errors by pool, the model the rollouts built)."""
    from framekv.engine.rollout import Rollout

    rspec = pair[1]
    out, model = {}, None
    for name, kv_dtype in POOLS.items():
        progress(f"fp8 reference: attention of the {name} pool vs the fp32 reference, "
                 f"layers {layers}")
        r = Rollout(pair, device, backend=backend, use_graphs=False, model=model,
                    kv_dtype=kv_dtype)
        model = r.model
        rec = AttentionErrors(r.geometry, layers)
        r.attention_recorder = rec
        r.prefill()
        rec.reference.commit(rspec.prompt_tokens)
        fill = _fill(rspec)
        for i in range(fill + 1):
            rec.measure = i == fill
            x = r.step()
            rec.reference.commit(x.shape[2] * rspec.tokens_per_frame)
        out[name] = {"layers": layers, **rec.result()}
        r.close()
    return out, model


def _latents_side_by_side(rollouts: dict, chunks: int, fill: int) -> dict[str, dict]:
    """Per chunk from the first, each fp8 run's latents' relative L2 from bf16's over
    ``chunks`` chunks (`latents_from_bf16`); then all go on until ``fill`` chunks ran."""
    lat = {n: [r.step() for _ in range(chunks)] for n, r in rollouts.items()}
    for _ in range(max(0, fill - chunks)):
        for r in rollouts.values():
            r.step()
    return latents_from_bf16(lat)


def _start(r) -> None:
    """Capture (graphs), then restart the fp8 statistics (the captures' warm-up chunks
    are not the rollout's) and prefill."""
    if r.use_graphs:
        r.capture()
    if r.cache is not None:
        r.cache.reset_kv_stats()
    r.prefill()


def measure_reference(preset="wan-1.3b", *, window_frames: int | None = 21, chunks: int = 8,
                      rounds: int = 10, device="cuda", backend=None, layers=None,
                      progress=print) -> dict:
    """The bf16, fp8 and fp8-gemm runs of the reference DiT side by side (module doc):
    accuracy, then speed.

    Args:
        preset: the reference model's preset (a name, path or `Preset`).
        window_frames: the window (None: the preset's).
        chunks: chunks whose latents are compared, from the first (>= 1).
        rounds: timed rounds (one chunk of each pool per round).
        device, backend: as for `Rollout` (a CPU runs the same code with host timers).
        layers: layers whose attention is checked (default first, middle, last).
    """
    from framekv.engine.rollout import Rollout

    pair = _pair(preset, window_frames)
    mspec, rspec = pair
    device = torch.device(device)
    layers = measured_layers(mspec.num_layers) if layers is None else sorted(set(layers))
    accuracy, model = _attention_accuracy(pair, device, backend, layers, progress)
    rollouts = {name: Rollout(pair, device, backend=backend, model=model, kv_dtype=kv_dtype,
                              gemm_dtype=gemm_dtype)
                for name, (kv_dtype, gemm_dtype) in RUNS.items()}
    progress(f"fp8 reference: {chunks} chunks of every run, latents compared")
    for r in rollouts.values():
        _start(r)
    rel = _latents_side_by_side(rollouts, chunks, _fill(rspec))
    progress(f"fp8 reference: {rounds} rounds, windows filled")
    times = rotated_times({name: r.step for name, r in rollouts.items()}, rounds,
                          cuda=device.type == "cuda")
    pools = {name: {"dtype": str(r.kv_dtype).removeprefix("torch."),
                    "gemm_dtype": str(r.gemm_dtype).removeprefix("torch."),
                    "pool_bytes": r.cache.pool_bytes, "chunk_ms": ms_summary(times[name]),
                    "attention": accuracy[name if name in accuracy else "fp8"],
                    "over_bf16": statistics.median(times[name]) / statistics.median(times["bf16"])}
             for name, r in rollouts.items()}
    for name, d in rel.items():
        pools[name]["latents_rel_l2"] = d
    pools["fp8"].update(fp8_pool_stats(rollouts["fp8"].cache.kv_stats()))
    name = rollouts["bf16"].name
    for r in rollouts.values():
        r.close()
    return {"preset": name, **_sizes(mspec, rspec), "chunks": chunks, "rounds": rounds,
            "device": str(device), "timer": "cuda events" if device.type == "cuda" else "host",
            "pools": pools, **run_speedups(times),
            "fp8_over_bf16": pools["fp8"]["over_bf16"],
            "fp8_pool_fraction": pools["fp8"]["pool_bytes"] / pools["bf16"]["pool_bytes"]}


def _sizes(mspec, rspec) -> dict:
    """Layers, window, chunk and frame sizes, and keys per forward (prompt, window and
    chunk)."""
    return {"layers": mspec.num_layers, "window_frames": rspec.window_frames,
            "frames_per_chunk": rspec.frames_per_chunk, "tokens_per_frame": rspec.tokens_per_frame,
            "keys": rspec.prompt_tokens + (rspec.window_frames + rspec.frames_per_chunk)
            * rspec.tokens_per_frame}


def format_reference(res: dict) -> str:
    """The reference part's table."""
    p = res["pools"]
    lines = [f"fp8 reference DiT: {res['preset']} ({res['layers']} layers), window "
             f"{res['window_frames']} frames ({res['keys']} keys per forward), "
             f"{res['frames_per_chunk']}-frame chunks, {res['rounds']} rounds rotated "
             f"({res['timer']}), {res['device']}",
             f"  {'run':<9}{'K/V dtype':<15}{'ms/chunk':>10}{'p10':>9}{'p90':>9}{'pool MiB':>10}"
             f"{'attn max|d|':>13}{'attn mean|d|':>14}"]
    for name, r in p.items():
        c, a = r["chunk_ms"], r["attention"]
        lines.append(f"  {name:<9}{r['dtype']:<15}{c['median']:>10.2f}{c['p10']:>9.2f}"
                     f"{c['p90']:>9.2f}{r['pool_bytes'] / 2**20:>10.1f}{a['max_abs']:>13.2e}"
                     f"{a['mean_abs']:>14.2e}")
    for name, r in p.items():
        if name != "bf16":
            key = name.replace("-", "_")
            lines.append(f"  {name} / bf16 ms per chunk = {r['over_bf16']:.3f} ({name} speed-up "
                         f"{res[key + '_speedup']:.3f}, per round "
                         f"{res[key + '_speedup_paired']:.3f}); " + latents_line(r, name))
    lines.append(f"  fp8 pool bytes {res['fp8_pool_fraction']:.3f} of bf16's")
    lines.append("  " + saturation_line(p["fp8"]))
    return "\n".join(lines)
