"""One transformer block's linear layers, bf16 GEMMs against fp8 GEMMs, at a chunk's
token count: the Wan 1.3B and 14B shapes.

    python -m framekv.bench.fp8_gemm [--configs 1.3b,14b] [--tokens 4680] [--rounds 50]
        [--modes graph,eager] [--no-flush] [--json FILE]

A chunk of 3 latent frames of 60x104 is 3 * 30 * 52 = 4680 tokens (``--tokens``). Per
config (dim, ffn: 1.3b 1536, 8960; 14b 5120, 13824) a block's linears, bf16 weights
N(0, 1/K), inputs of unit-normal rows (T x K, bf16):

    qkv       dim -> 3 dim, bias (the packed q, k, v projection)
    proj      dim -> dim, bias; 3 a block (self-attention's output, cross-attention's
              q and output: one shape)
    ffn_in    dim -> ffn, bias + GELU-tanh: bf16 in the GEMM's epilogue
              (``torch._addmm_activation``); fp8 writes the pre-activation
    ffn_out   ffn -> dim, bias: fp8 applies the GELU in its input quantizer

Variants (`framekv.engine.fp8_linear.Fp8Linear` and its parts):

    bf16            ``F.linear`` (``_addmm_activation`` for ffn_in)
    fp8             the fp8 layer as a model calls it: the input's per-row quantization
                    (`framekv.ops.quantize_rows`, GELU in it for ffn_out) and
                    ``torch._scaled_mm`` with row-wise scales and the bias
    fp8 gemm only   ``torch._scaled_mm`` of an input quantized beforehand
    fp8 fast accum  as fp8, ``use_fast_accum=True`` (Hopper's fp8 accumulation, not
                    promoted to fp32 every few steps: faster, less exact)
    quantize        the input's quantization alone

Each variant is first checked: its output's relative L2 from the fp32 product (``x @
W^T + b``, GELU where the layer has it). Timing per mode: "graph", each variant
captured in a CUDA graph and replayed, CUDA events around each replay; "eager", the
calls themselves between CUDA events (their host cost shows where it exceeds the
device's); every variant in turn, the order rotated every round, the L2 flushed
before each (``--no-flush``: not), medians. A block's total counts proj three times;
TFLOP/s counts 2 T K N per GEMM.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

from .fp8_common import rotated_times, subset_of
from .timing import Flusher, captured_graph, require_cuda, stderr_progress, summary, write_result

#: (dim, ffn) of each config (`framekv.engine.wan.CONFIGS`' widths).
SHAPES = {"1.3b": (1536, 8960), "14b": (5120, 13824)}
#: 3 latent frames of 60x104 in 2x2 patches.
TOKENS = 3 * 30 * 52
VARIANTS = ("bf16", "fp8", "fp8 gemm only", "fp8 fast accum", "quantize")
MODES = ("graph", "eager")


def block_linears(dim: int, ffn: int) -> list[tuple[str, int, int, int, str]]:
    """(name, K, N, count per block, GELU: "" | "epilogue" | "input") of a block."""
    return [("qkv", dim, 3 * dim, 1, ""), ("proj", dim, dim, 3, ""),
            ("ffn_in", dim, ffn, 1, "epilogue"), ("ffn_out", ffn, dim, 1, "input")]


class Case:
    """One linear's tensors and its variants' calls (module doc)."""

    def __init__(self, K: int, N: int, gelu: str, tokens: int, device, seed: int = 0):
        from framekv.engine.fp8_linear import Fp8Linear
        from framekv.ops import quantize_rows

        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(tokens, K, generator=gen).to(device, torch.bfloat16)
        self.w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(device, torch.bfloat16)
        self.b = (0.1 * torch.randn(N, generator=gen)).to(device, torch.bfloat16)
        self.gelu = gelu
        self.layer = Fp8Linear(self.w, self.b, name=f"[{N}, {K}]")
        pre = gelu == "input"
        self.q, self.s = quantize_rows(self.x, gelu=pre)
        q_out, s_out = torch.empty_like(self.q), torch.empty_like(self.s)
        # bf16's ffn_out reads GELU(x) from the epilogue before it: its input is that
        x16 = F.gelu(self.x.float(), approximate="tanh").bfloat16() if pre else self.x
        lay = self.layer
        def bf16():
            if gelu != "epilogue":
                return F.linear(x16, self.w, self.b)
            if self.x.device.type == "cuda":    # the bias and GELU in cuBLASLt's epilogue
                return torch._addmm_activation(self.b, self.x, self.w.t(), use_gelu=True)
            return F.gelu(F.linear(self.x, self.w, self.b), approximate="tanh")

        def fast():
            q, s = quantize_rows(self.x, gelu=pre)
            return torch._scaled_mm(q, lay.weight.t(), s, lay.scale, bias=lay.bias,
                                    out_dtype=lay.out_dtype, use_fast_accum=True)

        self.calls = {
            "bf16": bf16,
            "fp8": lambda: lay(self.x, gelu=pre),
            "fp8 gemm only": lambda: torch._scaled_mm(self.q, lay.weight.t(), self.s, lay.scale,
                                                      bias=lay.bias, out_dtype=lay.out_dtype),
            "fp8 fast accum": fast,
            "quantize": lambda: quantize_rows(self.x, gelu=pre, out=q_out, scale=s_out)}

    def rel_l2(self) -> dict[str, float]:
        """Each GEMM variant's output against the fp32 product (module doc)."""
        x = self.x.float()
        if self.gelu == "input":
            x = F.gelu(x, approximate="tanh")
        want = F.linear(x, self.w.float(), self.b.float())
        if self.gelu == "epilogue":
            want = F.gelu(want, approximate="tanh")
        out = {}
        for name in VARIANTS[:-1]:
            got = self.calls[name]().float()
            if self.gelu == "epilogue" and name != "bf16":
                got = F.gelu(got, approximate="tanh")   # what the next layer reads
            out[name] = float((got - want).norm() / want.norm())
        return out


def measure_linear(K: int, N: int, gelu: str, *, tokens: int, rounds: int, modes, device,
                   flush: bool) -> dict:
    """One linear: each variant's error and its times in each mode."""
    cuda = torch.device(device).type == "cuda"
    case = Case(K, N, gelu, tokens, device)
    res = {"K": K, "N": N, "gelu": gelu, "rel_l2": case.rel_l2(), "us": {}, "speedup": {}}
    for mode in modes:
        calls = ({n: captured_graph(c).replay for n, c in case.calls.items()}
                 if mode == "graph" else case.calls)
        times = rotated_times(calls, rounds, cuda=cuda, warmup=2,
                              flush=Flusher(flush) if cuda else None)
        res["us"][mode] = {n: summary(us) for n, us in times.items()}
        res["speedup"][mode] = statistics.median(times["bf16"]) / statistics.median(times["fp8"])
    flops = 2 * tokens * K * N
    res["tflops"] = {mode: {n: flops / u["median"] / 1e6 for n, u in us.items() if n != "quantize"}
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
           "timer": "cuda events" if cuda else "host",
           "configs": {}}
    for config in configs:
        dim, ffn = shapes[config]
        lin = {}
        for name, K, N, count, gelu in block_linears(dim, ffn):
            progress(f"fp8 gemm {config}: {name} [{tokens} x {K}] x [{K} x {N}]")
            lin[name] = {**measure_linear(K, N, gelu, tokens=tokens, rounds=rounds, modes=modes,
                                          device=device, flush=flush), "count": count}
        out["configs"][config] = {"dim": dim, "ffn": ffn, "linears": lin,
                                  "block": {m: _block(lin, m) for m in modes}}
    return out


def _block(lin: dict, mode: str) -> dict:
    """A block's linears together in ``mode``: µs of bf16 and of fp8, and the speed-up."""
    total = {v: sum(r["count"] * r["us"][mode][v]["median"] for r in lin.values())
             for v in ("bf16", "fp8", "fp8 fast accum")}
    return {"bf16_us": total["bf16"], "fp8_us": total["fp8"],
            "fp8_fast_accum_us": total["fp8 fast accum"], "speedup": total["bf16"] / total["fp8"]}


def format_fp8_gemm(res: dict) -> str:
    """Per config and mode: each linear's variants, then the block's total."""
    lines = [f"fp8 GEMMs, {res['tokens']} tokens, {res['rounds']} rounds rotated "
             f"({res['timer']}{', L2 flushed' if res['flush'] else ''}); µs median"]
    for config, c in res["configs"].items():
        for mode in res["modes"]:
            lines.append(f"  {config} (dim {c['dim']}, ffn {c['ffn']}), {mode}")
            lines.append(f"    {'linear':<22}" + "".join(f"{v:>16}" for v in VARIANTS)
                         + f"{'speed-up':>10}")
            for name, r in c["linears"].items():
                label = f"{name} {r['K']}->{r['N']}" + (f" x{r['count']}" if r["count"] > 1 else "")
                lines.append(f"    {label:<22}" + "".join(
                    f"{r['us'][mode][v]['median']:>16.1f}" for v in VARIANTS)
                    + f"{r['speedup'][mode]:>10.3f}")
            b = c["block"][mode]
            lines.append(f"    block: bf16 {b['bf16_us']:.1f} µs, fp8 {b['fp8_us']:.1f} µs "
                         f"(fast accum {b['fp8_fast_accum_us']:.1f}), speed-up {b['speedup']:.3f}")
        errs = ", ".join(f"{n} " + "/".join(f"{r['rel_l2'][v]:.1e}" for v in VARIANTS[:-1])
                         for n, r in c["linears"].items())
        lines.append(f"    rel L2 vs fp32 (bf16/fp8/gemm only/fast accum): {errs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m framekv.bench.fp8_gemm",
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
