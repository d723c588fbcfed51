"""One paged attention forward over a bf16 pool and over an fp8 pool holding the same
K/V, side by side at a preset's geometry (seed-bench's by default, the geometry
`framekv.bench.attention` times): speed beside accuracy.

Both pools are one layer with the window filled (P + W keys committed) and one chunk
of T queries staged, so a forward attends P + W + T keys:

    denoise   the whole chunk one causal block (a denoising step's forward)
    clean     one-frame blocks (the clean pass), one launch

K and V look like a model's: K rows of unit RMS over the head dim (as after an
RMSNorm), V unit normal, each K/V head scaled by its own gain from 2^-1 to 2^1 (heads
differ in range); Q as K. The chunk's raw projection has rows of unit RMS; its norm
weights carry the gains. The fp8 pool's scales are calibrated to what it holds
(`CausalKVCache.calibrate_kv_scales`: filled once, reset, calibrated, filled again).

Each forward runs as a model's attention layer runs it: from the raw projection (copied
into the layer's QKV buffer first: each forward starts from the same values), the fused
QK prologue (`framekv.ops.qk_norm_rope_stage_`, an RMSNorm over all heads whose
weights are the head gains, no rope) normalizes Q in place and stages K and V into the
pool (fp8: quantized as written, Q quantized in the same pass with the scale of its
declared bound `framekv.ops.q_bound`), then the attention, the output dequantized. It
is checked first: max and mean |d| of its output against fp32 exact-window attention
over the same K/V unquantized (`ExactWindowReference`); the fp8 denoising block's error
is also split by source (`fp8_budget`). On cuDNN each forward's plan also has its kernel launch
timed alone ("call": Q quantized and packed up front; no K/V write, no merge or
dequantization), as `framekv.bench.attention` times it. Then each is captured in a
CUDA graph and all are timed in turn, one replay of each per round, the order rotated
every round, the L2 flushed before each (CUDA events). On a CPU the same path runs
eagerly with host timers.
"""
from __future__ import annotations

import functools

import torch

from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.attention import get_backend
from framekv.engine.attention.registry import default_backend
from framekv.engine.cache.reference import ExactWindowReference
from framekv.engine.rollout import resolve_specs
from framekv.ops import q_bound, qk_norm_rope_stage_

from .fp8_budget import error_budget, format_budget
from .fp8_common import fp8_pool_stats, rotated_times, saturation_line, speedups
from .timing import Flusher, captured_graph, summary

#: The pools' dtypes (the fp8 one quantizes the bf16 values it is given).
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def head_gains(heads: int) -> torch.Tensor:
    """Per-head gains, 2^-1 to 2^1 evenly in log2: heads differing in range."""
    return 2.0 ** torch.linspace(-1.0, 1.0, heads)


def _rms_rows(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


#: The prologue's RMSNorm epsilon (`qk_norm_rope_stage_`'s default).
EPS = 1e-6


def norm_all(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 RMSNorm over all heads of x [T, h, D] with weights [h * D]: the prologue's
    ``norm="all"`` in fp32, rounded nowhere."""
    xf = x.float()
    ms = xf.flatten(1).pow(2).mean(-1)[:, None, None]                  # [T, 1, 1]
    return xf * torch.rsqrt(ms + EPS) * weight.float().view(x.shape[1], x.shape[2])


def model_like_kv(gen: torch.Generator, tokens: int, heads: int, dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 K [tokens, heads, dim] with unit-RMS rows and V unit normal, each head
    times its `head_gains` (V's in reverse head order)."""
    k, v = torch.randn(2, tokens, heads, dim, generator=gen)
    g = head_gains(heads)
    return _rms_rows(k) * g[:, None], v * g.flip(0)[:, None]


class PoolPair:
    """A bf16 and an fp8 one-layer cache of one geometry holding the same filled window,
    the fp32 record of it, and one staged chunk of packed QKV (module doc).

    Args:
        preset: a `Preset`, a preset name or path (its model's heads and page size,
            its rollout's geometry and frame).
        device: where the caches live ("cpu" or CUDA).
        seed: the K/V and Q generators' seed.
        calibrate: calibrate the fp8 pool's scales (else they stay 1.0).
    """

    def __init__(self, preset, device, *, seed: int = 0, calibrate: bool = True):
        self.name, m, r = resolve_specs(preset)
        self.H, self.HKV, self.D, self.tpp = m.num_heads, m.num_kv_heads, m.head_dim, m.tokens_per_page
        self.g, self.frame = r.geometry(), r.tokens_per_frame
        self.T = self.g.max_staged_tokens
        self.keys = self.g.pin_tokens + self.g.window_tokens + self.T
        self.device, self.seed, self.calibrated = torch.device(device), seed, calibrate
        self.ref = ExactWindowReference(self.g, 1)
        self.caches = {name: self._cache(dtype) for name, dtype in DTYPES.items()}
        self._fill(self.caches["bf16"], record=True)
        fp8 = self.caches["fp8"]
        self._fill(fp8)
        if calibrate:
            fp8.reset_sequences(range(1))
            fp8.calibrate_kv_scales()
            self._fill(fp8)
        gen = torch.Generator().manual_seed(seed + 1)
        q = _rms_rows(torch.randn(self.T, self.H, self.D, generator=gen))
        k = _rms_rows(torch.randn(self.T, self.HKV, self.D, generator=gen))
        v = torch.randn(self.T, self.HKV, self.D, generator=gen) * head_gains(self.HKV).flip(0)[:, None]
        #: the chunk's raw projection [1, T, H + 2 H_kv, D] bf16, and its norm weights
        self.qkv = torch.cat([q, k, v], dim=1)[None].to(self.device, torch.bfloat16)
        self.q_weight = head_gains(self.H).repeat_interleave(self.D).to(self.device)
        self.k_weight = head_gains(self.HKV).repeat_interleave(self.D).to(self.device)
        #: Q and K as the prologue stages them, in fp32 [T, h, D]
        self.q = norm_all(self.qkv[0, :, :self.H], self.q_weight)
        k = norm_all(self.qkv[0, :, self.H:self.H + self.HKV], self.k_weight)
        self.ref.write(0, self.ref.committed, k, self.qkv[0, :, self.H + self.HKV:])

    def _cache(self, dtype) -> CausalKVCache:
        cache = CausalKVCache(num_layers=1, num_kv_heads=self.HKV, head_dim=self.D, dtype=dtype,
                              tokens_per_page=self.tpp, device=self.device,
                              pool_tokens=CausalKVCache.pool_tokens_for(self.g, self.tpp))
        cache.open(self.g)
        return cache

    def _fill(self, cache: CausalKVCache, record: bool = False) -> None:
        """Commit chunks of `model_like_kv` (the same ones on every call) until the
        window is full; ``record``: into the fp32 reference too."""
        gen = torch.Generator().manual_seed(self.seed)
        while cache.committed_tokens < self.g.pin_tokens + self.g.window_tokens:
            k, v = (x.to(self.device, torch.bfloat16)
                    for x in model_like_kv(gen, self.T, self.HKV, self.D))
            cache.write_staged(0, k, v, self.T)
            cache.commit(self.T)
            if record:
                self.ref.write(0, self.ref.committed, k, v)
                self.ref.commit(self.T)

    def reference(self, b: int) -> torch.Tensor:
        """fp32 exact-window attention of the chunk's queries in blocks of ``b`` over
        the unquantized K/V: [T, H, D] on the caches' device."""
        return self.ref.attention(0, self.q, self.T, b, device=self.device)

    def shutdown(self) -> None:
        for cache in self.caches.values():
            cache.shutdown()


def forwards(pp: PoolPair, backend=None) -> tuple[dict, dict]:
    """name -> (callable, block size, checked) of each pool and pass ("bf16-denoise",
    "fp8-clean", ...; each returns the output [T, H, D]), and name -> the layout the
    backend chose ({"splits": S, "packed": bool}). Where the backend's plans launch one
    kernel (cuDNN), a "-call" twin of each ("fp8-denoise-call") launches the same plan
    alone: its queries quantized and packed once up front, no K/V write, no merge or
    dequantization, its output partial (not checked)."""
    be = get_backend(backend if backend is not None else default_backend(pp.device, pp.D),
                     device=pp.device)
    prologue = functools.partial(qk_norm_rope_stage_, q_weight=pp.q_weight,
                                 k_weight=pp.k_weight, num_heads=pp.H, num_kv_heads=pp.HKV,
                                 norm="all", eps=EPS)
    calls, layouts = {}, {}
    for pool, cache in pp.caches.items():
        if cache.quantized and hasattr(be, "set_q_bounds"):  # Q quantized as it is staged
            be.set_q_bounds(cache, [q_bound(pp.q_weight, "all", pp.D)])
        mod = CachedAttention(pp.H, pp.HKV, pp.D, layer_idx=0, backend=be)
        for pas, b in (("denoise", pp.T), ("clean", pp.frame)):
            name = f"{pool}-{pas}"
            plan = mod.plan_for(cache, pp.T, b)  # the plan the call runs
            layouts[name] = {"splits": int(getattr(plan, "splits", 1)),
                             "packed": bool(getattr(plan, "packed", False))}
            calls[name] = (_call(mod, pp, cache, b, prologue), b, True)
            if hasattr(plan, "launch"):
                # q in the forward's layout (the packed projection's strides): a plan's
                # ragged row offsets follow them, and the forward's replays rewrite them
                q = pp.qkv[0, :, :pp.H]
                calls[name + "-call"] = (launch_only(be, plan, q), b, False)
    return calls, layouts


def _call(mod, pp: PoolPair, cache, b: int, prologue):
    work = pp.qkv.clone()  # the layer's QKV buffer: the prologue writes Q in place

    def call():
        work.copy_(pp.qkv)
        return mod(work, kv_cache=cache, seq_len=pp.T, causal_block_size=b,
                   prologue=prologue)[0]
    return call


def launch_only(backend, plan, q: torch.Tensor):
    """A callable of ``plan``'s kernel launch alone (a `CudnnPlan`), returning None: the
    plan prepared and ``q`` [T, H, D] quantized (fp8) and packed into it once, here."""
    plan.prepare(None)
    exe, pack = plan.launch(q, 0, torch.empty_like(q))

    def call() -> None:
        # the handle follows the current stream, so a capture records the launch
        exe.graph.execute(pack, exe.workspace, handle=backend.handle_on_stream(q.device))
    return call


def measure_forward(preset="seed-bench", *, iters: int = 50, device="cuda", backend=None,
                    calibrate: bool = True, flush: bool = True, progress=print) -> dict:
    """Both pools' denoising and clean-pass forwards: errors against the fp32
    reference, then time side by side (module doc); ``iters`` timed rounds."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    progress(f"fp8 forward: filling a bf16 and an fp8 pool at {getattr(preset, 'name', preset)}")
    pp = PoolPair(preset, device, calibrate=calibrate)
    try:
        calls, layouts = forwards(pp, backend)
        want = {b: pp.reference(b) for b in (pp.T, pp.frame)}
        errors, timed = {}, {}
        for name, (fn, b, checked) in calls.items():
            progress(f"fp8 forward: {name}: " + ("checking, " if checked else "")
                     + ("capturing" if cuda else "running"))
            got = fn()
            if checked:
                d = (got.float() - want[b]).abs()
                errors[name] = {"max_abs": float(d.max()), "mean_abs": float(d.mean())}
            timed[name] = captured_graph(fn).replay if cuda else fn
        progress("fp8 forward: where the error enters (each rounding alone, fp32)")
        budget = error_budget(pp)
        progress(f"fp8 forward: timing the {len(timed)} forwards in turn, {iters} rounds")
        times = rotated_times(timed, iters, cuda=cuda, warmup=2,
                              flush=Flusher(flush) if cuda else None)
        return dict(_result(pp, calls, errors, layouts, times, iters), error_budget=budget)
    finally:
        pp.shutdown()


def _result(pp: PoolPair, calls, errors, layouts, times, iters) -> dict:
    pools, speed = {}, {}
    for pool, cache in pp.caches.items():
        passes = {}
        for pas in ("denoise", "clean"):
            name = f"{pool}-{pas}"
            passes[pas] = {"block_size": calls[name][1], "us": summary(times[name]),
                           **errors[name], **layouts[name]}
            if name + "-call" in times:
                passes[pas]["call_us"] = summary(times[name + "-call"])
        pools[pool] = {"dtype": str(cache.dtype).removeprefix("torch."),
                       "pool_bytes": cache.pool_bytes, "passes": passes}
    for pas in ("denoise", "clean"):
        for row in (pas, pas + "-call"):
            if f"bf16-{row}" in times:
                speed[row.replace("-", "_")] = speedups(times[f"bf16-{row}"], times[f"fp8-{row}"])
    return {"preset": pp.name, "heads": pp.H, "kv_heads": pp.HKV, "head_dim": pp.D,
            "tokens": pp.T, "frame": pp.frame, "keys": pp.keys, "iters": iters,
            "device": str(pp.device), "timer": "cuda events" if pp.device.type == "cuda" else "host",
            "calibrated": pp.calibrated, "pools": pools,
            "fp8": fp8_pool_stats(pp.caches["fp8"].kv_stats()), "speedups": speed}


def format_forward(res: dict) -> str:
    """The forward part's table: per pass and pool the layer (write, attention, merge)
    and, where timed, its kernel launch alone ("call")."""
    lines = [f"fp8 forward, one layer at {res['preset']}: {res['heads']}/{res['kv_heads']} heads "
             f"of {res['head_dim']}, {res['tokens']} queries over {res['keys']} keys; fp8 scales "
             f"{'calibrated' if res['calibrated'] else '1.0'}; {res['iters']} rounds rotated "
             f"({res['timer']}), {res['device']}",
             f"  {'pass':<14}{'block':>6}  {'pool':<6}{'dtype':<15}{'S/pack':>7}{'median µs':>11}"
             f"{'p10-p90 µs':>18}{'max|d|':>10}{'mean|d|':>10}"]
    for pas in ("denoise", "clean"):
        for key, label in (("us", pas), ("call_us", pas + " call")):
            for pool, p in res["pools"].items():
                r = p["passes"][pas]
                if key in r:
                    lines.append(_row(label, pool, p["dtype"], r, r[key], key == "us"))
    s = res["speedups"]
    lines.append("  fp8 speed-up (bf16 time / fp8 time; per round in brackets): " + ", ".join(
        f"{row.replace('_', ' ')} {v['fp8_speedup']:.3f} ({v['fp8_speedup_paired']:.3f})"
        for row, v in s.items()))
    lines.append("  " + saturation_line(res["fp8"]))
    if "error_budget" in res:
        lines.append(format_budget(res["error_budget"], res["pools"]["fp8"]["passes"]["denoise"]))
    return "\n".join(lines)


def _row(label: str, pool: str, dtype: str, r: dict, u: dict, checked: bool) -> str:
    layout = f"{r['splits']}/{'p' if r['packed'] else '-'}"
    err = (f"{r['max_abs']:>10.2e}{r['mean_abs']:>10.2e}" if checked else f"{'-':>10}{'-':>10}")
    return (f"  {label:<14}{r['block_size']:>6}  {pool:<6}{dtype:<15}{layout:>7}"
            f"{u['median']:>11.1f}{u['p10']:>9.1f}-{u['p90']:<8.1f}{err}")
