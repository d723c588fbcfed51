"""One layer's attention at a preset's geometry: framekv against dense torch SDPA.

The window is full (steady state): a chunk of T queries attends P + W + T keys.

    framekv-denoise    `CachedAttention` (cuDNN paged backend), the chunk one block
    framekv-clean      the same call with one-frame blocks (the clean pass), one launch
    sdpa-cudnn         torch SDPA, cuDNN backend, over a contiguous buffer holding exactly
                       the visible keys (write: the chunk's K/V copied into its tail)
    concat-sdpa        history kept contiguous, each forward concatenates the chunk's
                       K/V to it (the write) and runs SDPA cuDNN over the result
    sdpa-flash         torch SDPA, flash backend, over the contiguous buffer (K/V heads
                       expanded outside the timing when flash refuses GQA)
    sdpa-clean-blocks  the clean pass dense, one SDPA cuDNN call per one-frame block, each
                       over a contiguous buffer of exactly that block's visible keys
                       (write: the chunk's K/V up to the block's end copied into each
                       buffer's tail); the blocks' outputs land in one [T, H, D]
    sdpa-clean-masked  the clean pass dense in one call: all T queries over the
                       sdpa-cudnn buffer with a mask giving each block's rows exactly its
                       visible keys (cuDNN; where torch refuses the mask there, efficient,
                       then math: the note names the backend that ran)

The two auto rows (framekv-denoise, framekv-clean) record the layout their backend
chose: ``splits`` (split-KV S) and ``packed`` (the query heads of a K/V head stacked
along the query axis); the split rows (`framekv.bench.split`) pin both. Their ``-call``
twins time the cuDNN launch of the same plan alone (no K/V write, query packing,
sub-row rebuild or merge; not checked, as they write only the partial outputs), so
one run shows the kernel's own rate next to the layer's.

Every variant includes its K/V write, is captured in a CUDA graph, and is checked
against the fp32 exact-window reference of its block size before it is timed (the
clean-pass variants against the clean pass, whose FLOPs they are credited with). The
variants are timed in turn, one replay of each per round (L2 flushed before each), so
that clock changes over the run hit them alike, and each round starts one variant later
than the last (the first replay after the host's sync runs slower, and would always hit
one variant).

The dense rows are built in `framekv.bench.dense_sdpa`, the pinned split rows in
`framekv.bench.split`.
"""
from __future__ import annotations

import statistics

import numpy as np
import torch

from framekv import specs
from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.attention.backend import attend_fp32
from framekv.engine.cache.reference import ExactWindowReference, visible_positions

from .dense_sdpa import clean_variants, dense_variants
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
        dev = self.q.device
        out = torch.empty(self.T, self.H, self.D, device=dev)
        for j in range(self.T // b):
            pos = visible_positions(self.g, self.ref.committed, self.ref.committed + j * b, b)
            k, v = self.ref.kv(0, pos)
            out[j * b:(j + 1) * b] = attend_fp32(self.q[j * b:(j + 1) * b], k.to(dev), v.to(dev),
                                                 self.scale)
        return out

    def visible_keys(self) -> np.ndarray:
        """Positions of every key the chunk sees (the union of its blocks' V(j)), sorted:
        the columns of `dense_kv`'s buffer."""
        return visible_positions(self.g, self.ref.committed, self.ref.committed, self.T)

    def dense_kv(self, positions: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous [1, H_kv, keys, D] K and V of ``positions`` (default: exactly the
        chunk's visible keys, `visible_keys`)."""
        pos = self.visible_keys() if positions is None else positions
        return tuple(x.to(self.qkv.device, self.qkv.dtype).transpose(0, 1)[None].contiguous()
                     for x in self.ref.kv(0, pos))

    def flops(self, b: int) -> int:
        """QK^T and PV of every head over each block's visible keys."""
        total = 0
        for j in range(self.T // b):
            s = self.ref.committed + j * b
            total += 4 * self.H * self.D * b * len(visible_positions(self.g, self.ref.committed, s, b))
        return total


def framekv_variants(st: Setup) -> tuple[dict, dict]:
    """name -> (callable, block size) of framekv's paged path, and name -> the layout its
    backend chose ({"splits": S, "packed": bool})."""
    mod = CachedAttention(st.H, st.HKV, st.D, backend="cudnn", layer_idx=0)

    def call(b):
        return lambda: mod(st.qkv, kv_cache=st.cache, seq_len=st.T, causal_block_size=b)[0]
    out, layouts = {}, {}
    for name, b in (("framekv-denoise", st.T), ("framekv-clean", st.frame)):
        # The backend keeps one plan per forward shape: this is the plan the call runs.
        plan = mod.plan_for(st.cache, st.T, b)
        out[name] = (call(b), b)
        # getattr: backends without query-head packing have no such attribute
        layouts[name] = {"splits": int(plan.splits), "packed": bool(getattr(plan, "packed", False))}
        out[name + "-call"] = (cudnn_call(mod.backend, plan, st), b)
    return out, layouts


def cudnn_call(backend, plan, st: "Setup"):
    """A callable of ``plan``'s cuDNN launch alone (a prepared `CudnnPlan` of st's
    cache), returning None: the queries are packed (and row offsets set) once here; the
    layer row of the same plan keeps its sub-rows current, timed in the same rounds."""
    plan.prepare(None)
    exe, pack = plan.launch(st.q, 0, torch.empty_like(st.q))

    def call():
        # the handle follows the current stream, so a capture records the launch
        exe.graph.execute(pack, exe.workspace, handle=backend.handle_on_stream(st.q.device))
    return call


def measure_attention(preset: specs.Preset, *, iters: int = 50, flush: bool = True,
                      extra: dict | None = None, progress=print) -> dict:
    """Every variant: error against the fp32 reference, then device time (see module doc).

    ``extra``: more name -> (callable, block size) variants built over the same `Setup`
    by a function ``extra(setup)`` (the split-KV rows).
    """
    st = Setup(preset)
    flusher = Flusher(flush)
    variants, layouts = framekv_variants(st)
    notes = {}
    for build in (dense_variants, clean_variants):
        more, more_notes = build(st)
        variants.update(more)
        notes.update(more_notes)
    if extra is not None:
        variants.update(extra(st))
    want = {b: st.reference(b) for b in {b for _, b in variants.values()}}
    graphs, errors = {}, {}
    for name, (fn, b) in variants.items():
        progress(f"attention: {name}: checking, capturing")
        got = fn()
        errors[name] = None if got is None else (got.float() - want[b]).abs().max().item()
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
                      "tflops": st.flops(b) / statistics.median(times[name]) / 1e6,
                      **layouts.get(name, {})}
    ceiling = matmul_ceiling(flusher)
    for r in rows.values():
        r["fraction_of_ceiling"] = r["tflops"] / ceiling
    res = {"heads": st.H, "kv_heads": st.HKV, "head_dim": st.D, "tokens": st.T, "keys": st.keys,
           "frame": st.frame, "matmul_tflops": ceiling, "notes": notes, "variants": rows}
    res["ratios"] = ratios(rows)  # reads denoise's fraction of the ceiling, set just above
    # Per round (the two timed next to each other), then the median over rounds.
    res["ratios"]["denoise_over_sdpa_cudnn_paired"] = statistics.median(
        a / b for a, b in zip(times["framekv-denoise"], times["sdpa-cudnn"]))
    st.cache.shutdown()
    return res


def ratios(rows: dict) -> dict:
    """The comparisons the project's targets are stated in (rows that a result lacks,
    such as the clean-pass or pinned rows of an older run, leave their ratios out)."""
    med = {k: v["us"]["median"] for k, v in rows.items()}
    out = {"denoise_over_sdpa_cudnn": med["framekv-denoise"] / med["sdpa-cudnn"],
           "sdpa_flash_over_denoise": med["sdpa-flash"] / med["framekv-denoise"],
           "concat_over_denoise": med["concat-sdpa"] / med["framekv-denoise"]}
    if "fraction_of_ceiling" in rows["framekv-denoise"]:
        out["denoise_fraction_of_ceiling"] = rows["framekv-denoise"]["fraction_of_ceiling"]
    if "framekv-denoise-S1" in med:  # the unsplit paged forward
        out["denoise_s1_over_sdpa_cudnn"] = med["framekv-denoise-S1"] / med["sdpa-cudnn"]
        out["sdpa_flash_over_denoise_s1"] = med["sdpa-flash"] / med["framekv-denoise-S1"]
    out.update(_clean_ratios(rows, med))
    out.update(_call_ratios(rows, med))
    out.update(_best_pinned(med))
    if "best_denoise" in out:
        out["best_denoise_over_sdpa_cudnn"] = med[out["best_denoise"]] / med["sdpa-cudnn"]
    return out


def _clean_ratios(rows: dict, med: dict) -> dict:
    """framekv's clean pass against the denoising forward per FLOP (time per FLOP is
    1 / TFLOP/s, so the ratio is denoise's TFLOP/s over clean's) and against its dense
    equivalents."""
    if "framekv-clean" not in rows:
        return {}
    out = {"clean_over_denoise_per_flop":
           rows["framekv-denoise"]["tflops"] / rows["framekv-clean"]["tflops"]}
    for dense in ("sdpa-clean-blocks", "sdpa-clean-masked"):
        if dense in med:
            out["clean_over_" + dense.replace("-", "_")] = med["framekv-clean"] / med[dense]
    return out


def _call_ratios(rows: dict, med: dict) -> dict:
    """Each auto row over its cuDNN call alone (what the layer adds), the denoising
    call's fraction of the ceiling, and the clean call per FLOP over the denoising one."""
    out = {}
    for name in ("denoise", "clean"):
        if f"framekv-{name}-call" in med:
            out[f"{name}_layer_over_call"] = med[f"framekv-{name}"] / med[f"framekv-{name}-call"]
    call = rows.get("framekv-denoise-call", {})
    if "fraction_of_ceiling" in call:
        out["denoise_call_fraction_of_ceiling"] = call["fraction_of_ceiling"]
    if "clean_layer_over_call" in out and "denoise_layer_over_call" in out:
        out["clean_call_over_denoise_call_per_flop"] = (
            call["tflops"] / rows["framekv-clean-call"]["tflops"])
    return out


def _best_pinned(med: dict) -> dict:
    """The fastest pinned row of each forward (``framekv-{name}-S<k>`` and its
    ``-packed`` twin), and the fastest packed one, each over the unpacked S=1 row."""
    out = {}
    for name in ("denoise", "clean"):
        pinned = [k for k in med if k.startswith(f"framekv-{name}-S")]
        if not pinned:
            continue
        s1 = med[f"framekv-{name}-S1"]
        best = min(pinned, key=med.get)
        out[f"best_{name}"], out[f"best_{name}_over_s1"] = best, med[best] / s1
        packed = [k for k in pinned if k.endswith("-packed")]
        if packed:
            best = min(packed, key=med.get)
            out[f"best_{name}_packed"], out[f"best_{name}_packed_over_s1"] = best, med[best] / s1
    return out


def format_attention(res: dict) -> str:
    """The attention section as text: the variant table, notes and ratios."""
    lines = [f"attention, one layer: {res['heads']}/{res['kv_heads']} heads of {res['head_dim']}, "
             f"{res['tokens']} queries over {res['keys']} keys; matmul ceiling "
             f"{res['matmul_tflops']:.0f} TFLOP/s (bf16 8192^3, same run)",
             f"  {'variant':<28}{'block':>6}{'S/pack':>7}{'median µs':>11}{'p10-p90 µs':>18}"
             f"{'TFLOP/s':>9}{'of ceil':>8}{'max err':>10}"]
    for name, r in res["variants"].items():
        u = r["us"]
        # the layout the backend chose, on the auto rows: "S/p" packed, "S/-" not
        layout = f"{r['splits']}/{'p' if r.get('packed') else '-'}" if "splits" in r else ""
        lines.append(f"  {name:<28}{r['block_size']:>6}{layout:>7}{u['median']:>11.1f}"
                     f"{u['p10']:>9.1f}-{u['p90']:<8.1f}{r['tflops']:>9.0f}"
                     f"{r['fraction_of_ceiling']:>8.2f}"
                     + (f"{r['max_error']:>10.1e}" if r["max_error"] is not None else f"{'-':>10}"))
    for name, note in res["notes"].items():
        lines.append(f"  note: {name}: {note}")
    return "\n".join(lines + _ratio_lines(res["ratios"]))


def _ratio_lines(rt: dict) -> list[str]:
    lines = [f"  framekv denoise (auto S) / sdpa-cudnn = {rt['denoise_over_sdpa_cudnn']:.3f}; "
             f"sdpa-flash / framekv denoise = {rt['sdpa_flash_over_denoise']:.2f}; "
             f"concat-sdpa / framekv denoise = {rt['concat_over_denoise']:.2f}"]
    if "denoise_over_sdpa_cudnn_paired" in rt:
        lines.append(f"  framekv denoise / sdpa-cudnn, per round then median = "
                     f"{rt['denoise_over_sdpa_cudnn_paired']:.3f}")
    if "denoise_fraction_of_ceiling" in rt:
        lines.append(f"  framekv denoise at {rt['denoise_fraction_of_ceiling']:.2f} "
                     f"of the matmul ceiling")
    if "denoise_s1_over_sdpa_cudnn" in rt:
        lines.append(f"  unsplit (S=1) denoise / sdpa-cudnn = {rt['denoise_s1_over_sdpa_cudnn']:.3f}; "
                     f"sdpa-flash / unsplit denoise = {rt['sdpa_flash_over_denoise_s1']:.2f}")
    clean = [f"framekv clean / {d} = {rt[k]:.3f}" for d, k in (
        ("sdpa-clean-blocks", "clean_over_sdpa_clean_blocks"),
        ("sdpa-clean-masked", "clean_over_sdpa_clean_masked")) if k in rt]
    if clean:
        lines.append("  " + "; ".join(clean))
    if "clean_over_denoise_per_flop" in rt:
        lines.append(f"  framekv clean / framekv denoise, time per FLOP = "
                     f"{rt['clean_over_denoise_per_flop']:.3f}")
    calls = [f"{n} layer / its cuDNN call = {rt[f'{n}_layer_over_call']:.3f}"
             for n in ("denoise", "clean") if f"{n}_layer_over_call" in rt]
    if "denoise_call_fraction_of_ceiling" in rt:
        calls.append(f"denoise call at {rt['denoise_call_fraction_of_ceiling']:.2f} of the ceiling")
    if "clean_call_over_denoise_call_per_flop" in rt:
        calls.append(f"clean call / denoise call per FLOP = "
                     f"{rt['clean_call_over_denoise_call_per_flop']:.3f}")
    if calls:
        lines.append("  " + "; ".join(calls))
    for name in ("denoise", "clean"):
        if f"best_{name}" in rt:
            lines.append(f"  best {name}: {rt[f'best_{name}']}, {rt[f'best_{name}_over_s1']:.3f} "
                         f"of its S=1 time")
        if f"best_{name}_packed" in rt:
            lines.append(f"  best packed {name}: {rt[f'best_{name}_packed']}, "
                         f"{rt[f'best_{name}_packed_over_s1']:.3f} of the unpacked S=1 time")
    return lines
