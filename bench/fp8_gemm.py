"""One Wan transformer block's linear layers at a chunk's token count, bf16 GEMMs against
fp8 GEMMs as the model runs them, each with the pass that makes its input: the Wan 1.3B
and 14B shapes.

    python -m framekv.bench.fp8_gemm [--configs 1.3b,14b] [--tokens 4680] [--rounds 50]
        [--modes graph,eager] [--no-flush] [--json FILE]

A chunk of 3 latent frames of 60x104 is 3 * 30 * 52 = 4680 tokens (``--tokens``). Per
config (dim, ffn: 1.3b 1536, 8960; 14b 5120, 13824) a block's linears, bf16 weights
N(0, 1/K), bias N(0, 0.01); each reads what the model gives it:

    qkv       dim -> 3 dim   the norm's output (``adaln_``: shift and scale per sequence,
                             over unit-normal tokens)
    cross_q   dim -> dim     the norm's output (norm2; its residual, the same in both
                             runs, is left out)
    out x2    dim -> dim     an attention's output (self- and cross-attention's output
                             projections: unit-normal rows)
    ffn_in    dim -> ffn     the norm's output; bf16 adds the bias and GELU-tanh in the
                             GEMM's epilogue (``torch._addmm_activation``), fp8 writes
                             the pre-activation
    ffn_out   ffn -> dim     the MLP's hidden rows (3 x unit-normal pre-activations):
                             bf16 reads them activated, fp8's quantizer applies GELU

Variants (`framekv.engine.fp8_linear`; each timed with the pass making its input):

    bf16            the norm in bf16 where there is one, then the bf16 GEMM
    fp8             the fp8 input as the model makes it: the norm writing e4m3 and its
                    scales itself (`adaln_for`), else `framekv.ops.quantize_rows` (GELU
                    in it for ffn_out); then ``torch._scaled_mm``, partial sums
                    promoted to fp32
    fp8 fast accum  the same, ``use_fast_accum=True`` (no promotion: faster, its error
                    reported apart)
    fp8 gemm only   ``torch._scaled_mm`` of an input quantized beforehand (promoted)
    fp8 input       the pass making the fp8 input alone (the norm writing e4m3, or the
                    quantizer)
    bf16 input      the norm writing bf16 alone (norm-fed layers): ``fp8 input`` minus
                    this is what quantizing costs the model
    unfused input   the bf16 norm, then ``quantize_rows`` over its output (norm-fed
                    layers): the quantizer as a pass of its own

Each layer is first checked: the relative L2 from fp32 (the norm, the product and the
GELU in fp32 from the same bf16 inputs and weights) of bf16, fp8 and fp8 fast accum,
and of fast accum from fp8 (the same quantized operands: the accumulation's own error).
Timing per mode: "graph", each variant captured in a CUDA graph and replayed, CUDA
events around each replay; "eager", the calls themselves between CUDA events (their
host cost shows where it exceeds the device's); every variant in turn, the order
rotated every round, the L2 flushed before each (``--no-flush``: not), medians. A
block's total counts ``out`` twice; "fp8 as run" takes each layer's accumulation as the
Wan block chooses it (`framekv.engine.wan.blocks.FP8_FAST_ACCUM`); TFLOP/s count
2 T K N per GEMM.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .fp8_common import rotated_times, subset_of
from .timing import Flusher, captured_graph, require_cuda, stderr_progress, summary, write_result

#: (dim, ffn) of each config (`framekv.engine.wan.CONFIGS`' widths).
SHAPES = {"1.3b": (1536, 8960), "14b": (5120, 13824)}
#: 3 latent frames of 60x104 in 2x2 patches.
TOKENS = 3 * 30 * 52
VARIANTS = ("bf16", "fp8", "fp8 fast accum", "fp8 gemm only", "fp8 input", "bf16 input",
            "unfused input")
GEMMS = ("bf16", "fp8", "fp8 fast accum", "fp8 gemm only")
MODES = ("graph", "eager")
#: The Wan block's fp8 layers each bench linear stands for.
LAYERS = {"qkv": ("qkv",), "cross_q": ("cross_q",), "out": ("out", "cross_out"),
          "ffn_in": ("ffn_in",), "ffn_out": ("ffn_out",)}


class Linear(NamedTuple):
    """One of a block's linears: its name, in and out features, count per block, what
    makes its input ("norm", "attention" or "gelu": module doc), and whether bf16
    applies GELU in its epilogue."""
    name: str
    K: int
    N: int
    count: int
    source: str
    epilogue: bool = False


def block_linears(dim: int, ffn: int) -> list[Linear]:
    """The linears of a Wan block of width ``dim`` and MLP width ``ffn`` (module doc)."""
    return [Linear("qkv", dim, 3 * dim, 1, "norm"), Linear("cross_q", dim, dim, 1, "norm"),
            Linear("out", dim, dim, 2, "attention"),
            Linear("ffn_in", dim, ffn, 1, "norm", epilogue=True),
            Linear("ffn_out", ffn, dim, 1, "gelu")]


def fast_as_run(name: str) -> bool:
    """Whether the Wan block runs the linear ``name`` with fast accumulation."""
    from framekv.engine.wan.blocks import FP8_FAST_ACCUM

    fast = {FP8_FAST_ACCUM[n] for n in LAYERS[name]}
    assert len(fast) == 1, name
    return fast.pop()


class Case:
    """One linear's tensors and its variants' calls (module doc)."""

    def __init__(self, lin: Linear, tokens: int, device, seed: int = 0):
        from framekv.engine.fp8_linear import Fp8Linear

        gen = torch.Generator().manual_seed(seed)
        K, N = lin.K, lin.N
        scale = 3.0 if lin.source == "gelu" else 1.0
        self.lin = lin
        self.x = (scale * torch.randn(1, tokens, K, generator=gen)).to(device, torch.bfloat16)
        self.w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(device, torch.bfloat16)
        self.b = (0.1 * torch.randn(N, generator=gen)).to(device, torch.bfloat16)
        self.mods = {k: (0.3 * torch.randn(1, 1, K, generator=gen)).to(device)
                     for k in ("shift", "scale")}
        self.layers = {fast: Fp8Linear(self.w, self.b, name=f"[{N}, {K}]", fast_accum=fast)
                       for fast in (False, True)}
        self.calls = {**self._gemm_calls(), **self._input_calls()}

    def _input_calls(self) -> dict:
        """The passes making the inputs (module doc: fp8, bf16 and unfused input)."""
        from framekv.engine.fp8_linear import adaln_for
        from framekv.ops import quantize_rows

        rows, layer, mods = self.x.view(-1, self.lin.K), self.layers[False], self.mods
        q, s = torch.empty_like(rows, dtype=torch.float8_e4m3fn), rows.new_empty(
            rows.shape[0], 1, dtype=torch.float32)
        if self.lin.source != "norm":
            gelu = self.lin.source == "gelu"
            return {"fp8 input": lambda: quantize_rows(rows, gelu=gelu, out=q, scale=s)}
        return {"fp8 input": lambda: adaln_for(layer, self.x, **mods, eps=1e-6),
                "bf16 input": lambda: adaln_for(None, self.x, **mods, eps=1e-6),
                "unfused input": lambda: quantize_rows(
                    adaln_for(None, self.x, **mods, eps=1e-6).view(-1, self.lin.K), out=q,
                    scale=s)}

    def _fp8_input(self, layer):
        """What an fp8 layer is given: the norm's e4m3 rows, or x as it is."""
        from framekv.engine.fp8_linear import adaln_for

        if self.lin.source == "norm":
            return adaln_for(layer, self.x, **self.mods, eps=1e-6)
        return self.x

    def _gemm_calls(self) -> dict:
        """The four GEMM variants, each with the pass making its input."""
        from framekv.engine.fp8_linear import adaln_for
        from framekv.ops import quantize_rows

        lin, gelu, lay = self.lin, self.lin.source == "gelu", self.layers[False]
        # bf16's ffn_out reads GELU(x) from the epilogue before it: its input is that
        x16 = F.gelu(self.x.float(), approximate="tanh").bfloat16() if gelu else self.x
        if lin.source == "norm":
            pre = self._fp8_input(lay)
            q, s = pre.q.view(-1, lin.K), pre.scale.view(-1, 1)          # [T, K], [T, 1]
        else:
            q, s = quantize_rows(self.x.view(-1, lin.K), gelu=gelu)

        def bf16():
            h = adaln_for(None, self.x, **self.mods, eps=1e-6) if lin.source == "norm" else x16
            if not lin.epilogue:
                return F.linear(h, self.w, self.b)
            if h.device.type == "cuda":      # the bias and GELU in cuBLASLt's epilogue
                return torch._addmm_activation(self.b, h.view(-1, lin.K), self.w.t(),
                                               use_gelu=True)
            return F.gelu(F.linear(h, self.w, self.b), approximate="tanh")

        return {"bf16": bf16,
                "fp8": lambda: lay(self._fp8_input(lay), gelu=gelu),
                "fp8 fast accum": lambda: self.layers[True](self._fp8_input(self.layers[True]),
                                                            gelu=gelu),
                "fp8 gemm only": lambda: torch._scaled_mm(
                    q, lay.weight.t(), s, lay.scale, bias=lay.bias, out_dtype=lay.out_dtype)}

    def rel_l2(self) -> dict[str, float]:
        """Each GEMM variant's output against fp32, and fast accum's against fp8's."""
        from framekv.ops import adaln_reference

        lin, x = self.lin, self.x.float()
        if lin.source == "norm":
            x = adaln_reference(self.x.clone(), **self.mods, eps=1e-6,
                                out=torch.empty_like(x))
        elif lin.source == "gelu":
            x = F.gelu(x, approximate="tanh")
        act = (lambda y: F.gelu(y.float(), approximate="tanh")) if lin.epilogue else (
            lambda y: y.float())                                  # what the next layer reads
        want = act(F.linear(x, self.w.float(), self.b.float()).view(-1, lin.N))
        got = {n: self.calls[n]().float().view(-1, lin.N) for n in GEMMS}
        got.update({n: act(got[n]) for n in GEMMS if n != "bf16"})
        out = {n: float((got[n] - want).norm() / want.norm()) for n in GEMMS}
        out["fast vs promoted"] = float((got["fp8 fast accum"] - got["fp8"]).norm()
                                        / got["fp8"].norm())
        return out


def measure_linear(lin: Linear, *, tokens: int, rounds: int, modes, device, flush: bool) -> dict:
    """One linear: each variant's error and its times in each mode."""
    cuda = torch.device(device).type == "cuda"
    case = Case(lin, tokens, device)
    res = {"K": lin.K, "N": lin.N, "count": lin.count, "source": lin.source,
           "fast_accum_as_run": fast_as_run(lin.name), "rel_l2": case.rel_l2(), "us": {},
           "speedup": {}}
    for mode in modes:
        calls = ({n: captured_graph(c).replay for n, c in case.calls.items()}
                 if mode == "graph" else case.calls)
        times = rotated_times(calls, rounds, cuda=cuda, warmup=2,
                              flush=Flusher(flush) if cuda else None)
        res["us"][mode] = {n: summary(us) for n, us in times.items()}
        run = "fp8 fast accum" if res["fast_accum_as_run"] else "fp8"
        res["speedup"][mode] = statistics.median(times["bf16"]) / statistics.median(times[run])
    flops = 2 * tokens * lin.K * lin.N
    res["tflops"] = {mode: {n: flops / us[n]["median"] / 1e6 for n in GEMMS}
                     for mode, us in res["us"].items()}
    return res


def measure_fp8_gemm(configs=tuple(SHAPES), *, tokens: int = TOKENS, rounds: int = 50,
                     modes=MODES, device="cuda", flush: bool = True, shapes=None,
                     progress=print) -> dict:
    """Every config's block linears (module doc); ``shapes``: {name: (dim, ffn)} over
    `SHAPES` (small ones for a CPU, which times ``"eager"`` with host timers)."""
    shapes = {**SHAPES, **(shapes or {})}
    cuda = torch.device(device).type == "cuda"
    out = {"tokens": tokens, "rounds": rounds, "modes": list(modes), "flush": flush and cuda,
           "timer": "cuda events" if cuda else "host", "configs": {}}
    for config in configs:
        dim, ffn = shapes[config]
        lin = {}
        for linear in block_linears(dim, ffn):
            progress(f"fp8 gemm {config}: {linear.name} [{tokens} x {linear.K}] x "
                     f"[{linear.K} x {linear.N}]")
            lin[linear.name] = measure_linear(linear, tokens=tokens, rounds=rounds,
                                              modes=modes, device=device, flush=flush)
        out["configs"][config] = {"dim": dim, "ffn": ffn, "linears": lin,
                                  "block": {m: block_total(lin, m) for m in modes}}
    return out


def block_total(lin: dict, mode: str) -> dict:
    """A block's linears together in ``mode``: µs of bf16, of fp8 promoted, fast and as
    run (each layer's choice), of their inputs, and bf16 over fp8 as run."""
    def total(pick) -> float:
        return sum(r["count"] * r["us"][mode][pick(r)]["median"] for r in lin.values()
                   if pick(r) in r["us"][mode])

    out = {"bf16_us": total(lambda r: "bf16"), "fp8_us": total(lambda r: "fp8"),
           "fp8_fast_accum_us": total(lambda r: "fp8 fast accum"),
           "fp8_as_run_us": total(lambda r: "fp8 fast accum" if r["fast_accum_as_run"]
                                  else "fp8"),
           "fp8_input_us": total(lambda r: "fp8 input"),
           "bf16_input_us": total(lambda r: "bf16 input")}
    out["speedup"] = out["bf16_us"] / out["fp8_as_run_us"]
    return out


def _table(c: dict, mode: str) -> list[str]:
    """One config's per-linear rows in ``mode``, then its block line."""
    lines = [f"    {'linear':<20}" + "".join(f"{v:>15}" for v in VARIANTS) + f"{'speed-up':>10}"]
    for name, r in c["linears"].items():
        label = f"{name} {r['K']}->{r['N']}" + (f" x{r['count']}" if r["count"] > 1 else "")
        us = r["us"][mode]
        lines.append(f"    {label:<20}" + "".join(
            f"{us[v]['median']:>15.1f}" if v in us else f"{'-':>15}" for v in VARIANTS)
            + f"{r['speedup'][mode]:>10.3f}")
    b = c["block"][mode]
    lines.append(f"    block: bf16 {b['bf16_us']:.1f} µs; fp8 as run {b['fp8_as_run_us']:.1f} "
                 f"(promoted {b['fp8_us']:.1f}, fast accum {b['fp8_fast_accum_us']:.1f}), "
                 f"speed-up {b['speedup']:.3f}; inputs fp8 {b['fp8_input_us']:.1f}, "
                 f"bf16 norms {b['bf16_input_us']:.1f}")
    return lines


def format_fp8_gemm(res: dict) -> str:
    """Per config and mode: each linear's variants, then the block's total; the errors."""
    lines = [f"fp8 GEMMs, {res['tokens']} tokens, {res['rounds']} rounds rotated "
             f"({res['timer']}{', L2 flushed' if res['flush'] else ''}); µs median; "
             "speed-up: bf16 over fp8 with the layer's accumulation as run"]
    for config, c in res["configs"].items():
        for mode in res["modes"]:
            lines.append(f"  {config} (dim {c['dim']}, ffn {c['ffn']}), {mode}")
            lines += _table(c, mode)
        lines.append("    rel L2 vs fp32 (bf16 / fp8 / fp8 fast accum; fast vs promoted; "
                     "accumulation as run):")
        for n, r in c["linears"].items():
            e = r["rel_l2"]
            lines.append(f"      {n:<10}{e['bf16']:.1e} / {e['fp8']:.1e} / "
                         f"{e['fp8 fast accum']:.1e}; {e['fast vs promoted']:.1e}; "
                         + ("fast" if r["fast_accum_as_run"] else "promoted"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.fp8_gemm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", type=subset_of(tuple(SHAPES)), default=tuple(SHAPES),
                   help=f"comma-separated: {','.join(SHAPES)} (default all)")
    p.add_argument("--tokens", type=int, default=TOKENS,
                   help=f"rows of every GEMM's input (default {TOKENS}: a 3-frame chunk)")
    p.add_argument("--rounds", type=int, default=50, help="timed rounds, at least 3 (default 50)")
    p.add_argument("--modes", type=subset_of(MODES), default=MODES,
                   help="comma-separated: graph,eager (default both)")
    p.add_argument("--no-flush", action="store_true", help="leave the L2 as it is between calls")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    for name, value, low in (("--tokens", args.tokens, 1), ("--rounds", args.rounds, 3)):
        if value < low:
            p.error(f"{name}: expected at least {low}, got {value}")
    require_cuda("framekv.bench.fp8_gemm")
    res = measure_fp8_gemm(args.configs, tokens=args.tokens, rounds=args.rounds,
                           modes=args.modes, flush=not args.no_flush,
                           progress=stderr_progress("fp8_gemm"))
    print(format_fp8_gemm(res))
    write_result(args.json_path, fp8_gemm=res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
