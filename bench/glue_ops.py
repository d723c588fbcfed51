"""Benchmark framekv's glue ops, one call each, at a model's chunk shape.

    python -m framekv.bench.glue_ops [--preset wan-1.3b] [--rounds 20] [--json out.json]

Shapes (bf16, B = 1): S = the preset's tokens per chunk, rows of N = its hidden size,
packed QKV [S, H + 2 H_kv, D]; modulation per frame [1, frames, N]; the rope of the
preset's latent grid (interleaved pairs) at frame 7. Variants:

    adaln_                       LayerNorm, then x (1 + scale) + shift
    adaln_ + gated residual      x += gate y first (stored), then the same
    gated_residual_              x += gate y
    qk_norm_rope in place        per-head QK RMSNorm and rope of Q and K in qkv
    qk_norm_rope all heads       the same with the norm over all heads (Wan's)
    qk_norm_rope staging         per-head, Q in place, K and V into permuted pool slots
    qk_norm_rope all, staging    the same with the norm over all heads (Wan's attention)
    copy_ of x, copy_ of qkv     the bandwidth reference: the same tensors' bytes moved

Each op is called as the model calls it (its public op) and is first checked
against its torch reference on fresh random data (within two bf16 units in the last
place). Timing: a CUDA graph of ``--launches`` calls per variant (launch cost out),
CUDA events around each replay, the variants' order rotated every round; reported:
the median over ``--rounds`` divided by the launch count, and the GB/s of the bytes
the op must move (`op_bytes`). The tensors stay in the L2 between calls, as a GEMM's
output does for the op that follows it in a forward.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from framekv import ops
from framekv.bench.timing import (captured_graph, check_bf16_close, interleaved_device_times,
                                  require_cuda, stderr_progress, write_result)

_BF16 = 2  # bytes


def op_bytes(S: int, N: int, H: int, Hkv: int, D: int) -> dict:
    """Bytes each variant must read plus write (bf16; weights and modulation rows,
    under 0.1% of them, left out)."""
    row, qk = S * N * _BF16, S * (H + Hkv) * D * _BF16
    qkv = S * (H + 2 * Hkv) * D * _BF16
    return {"adaln_": 2 * row, "adaln_ + gated residual": 4 * row, "gated_residual_": 3 * row,
            "qk_norm_rope in place": 2 * qk, "qk_norm_rope all heads": 2 * qk,
            "qk_norm_rope staging": 2 * qkv, "qk_norm_rope all, staging": 2 * qkv,
            "copy_ of x": 2 * row, "copy_ of qkv": 2 * qkv}


def _check(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    """`check_bf16_close` with an absolute slack of one bf16 unit at 1: normed values
    near zero may differ by an fp32 FMA before their rounding."""
    return check_bf16_close(name, got, want, atol=2 ** -7)


def _setup(preset: str, gen: torch.Generator, device: str = "cuda") -> dict:
    """The preset's shapes and random bf16 tensors at them, on ``device``."""
    from framekv.engine.model.blocks import Rope3D
    from framekv.engine.rollout import resolve_specs

    _, m, r = resolve_specs(preset)
    S, N = r.frames_per_chunk * r.tokens_per_frame, m.hidden_size
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).bfloat16()
    grid = (m.latent_height // m.patch_size[1], m.latent_width // m.patch_size[2])
    rope = Rope3D(D, grid, torch.device(device)).grid(torch.tensor([7], device=device))
    dst = torch.randperm(2 * S, generator=gen, device=device)[:S]  # [S] pool slots
    return {"S": S, "N": N, "H": H, "Hkv": Hkv, "D": D, "rope": rope, "dst": dst,
            "x": rand(1, S, N), "y": rand(1, S, N), "out": rand(1, S, N),
            "mods": [rand(1, r.frames_per_chunk, N, scale=0.1) for _ in range(3)],
            "qkv": rand(1, S, H + 2 * Hkv, D), "w_head": rand(2, D, scale=0.1) + 1,
            "w_all": [rand(H * D, scale=0.1) + 1, rand(Hkv * D, scale=0.1) + 1],
            "pools": [torch.zeros(2 * S, Hkv, D, dtype=torch.bfloat16, device=device)
                      for _ in range(2)]}


def _adaln_variants(a: dict) -> dict:
    """(call, checked output, reference output) of the adaLN ops, on fresh copies."""
    shift, scale, gate = a["mods"]
    x1, x2, x3 = (a["x"].clone() for _ in range(3))
    out1, out2 = torch.empty_like(a["x"]), torch.empty_like(a["x"])
    want1 = ops.adaln_reference(a["x"].clone(), shift=shift, scale=scale,
                                out=torch.empty_like(a["x"]))
    want2 = ops.adaln_reference(a["x"].clone(), shift=shift, scale=scale, residual=a["y"],
                                gate=gate, out=torch.empty_like(a["x"]))
    want3 = a["x"].clone()
    ops.gated_residual_reference(want3, a["y"], gate)
    return {"adaln_": (lambda: ops.adaln_(x1, shift=shift, scale=scale, out=out1), out1, want1),
            "adaln_ + gated residual": (lambda: ops.adaln_(x2, shift=shift, scale=scale,
                                                           residual=a["y"], gate=gate,
                                                           out=out2), out2, want2),
            "gated_residual_": (lambda: ops.gated_residual_(x3, a["y"], gate), x3, want3)}


def _qk_variants(a: dict) -> dict:
    """(call, checked output, reference output) of the QK-norm variants."""
    H, Hkv, rope = a["H"], a["Hkv"], a["rope"]
    common = {"num_heads": H, "num_kv_heads": Hkv, "rope": rope}
    qw, kw = a["w_head"]
    staged = {"dst": a["dst"], "k_pool": a["pools"][0], "v_pool": a["pools"][1]}
    specs = {"qk_norm_rope in place": ((qw, kw), {"norm": "head"}),
             "qk_norm_rope all heads": (tuple(a["w_all"]), {"norm": "all"}),
             "qk_norm_rope staging": ((qw, kw), {"norm": "head", **staged}),
             "qk_norm_rope all, staging": (tuple(a["w_all"]), {"norm": "all", **staged})}
    out = {}
    for name, (weights, kw_) in specs.items():
        qkv, want = a["qkv"].clone(), a["qkv"].clone()
        ref_kw = dict(kw_)
        if "k_pool" in kw_:
            ref_kw.update(k_pool=a["pools"][0].clone(), v_pool=a["pools"][1].clone())
        ops.qk_norm_rope_stage_reference(want, *weights, **common, **ref_kw)
        if "k_pool" in kw_:  # Q in qkv, and the staged K / V rows of the pools
            got_t = lambda q=qkv, p=kw_: torch.cat([q[:, :, :H].flatten(), p["k_pool"].flatten(),
                                                   p["v_pool"].flatten()])
            want_t = torch.cat([want[:, :, :H].flatten(), ref_kw["k_pool"].flatten(),
                                ref_kw["v_pool"].flatten()])
        else:
            got_t, want_t = (lambda q=qkv: q), want
        out[name] = (lambda q=qkv, w=weights, k=kw_: ops.qk_norm_rope_stage_(q, *w, **common, **k),
                     got_t, want_t)
    return out


def measure_glue_ops(preset: str = "wan-1.3b", *, rounds: int = 20, launches: int = 20,
                     progress=print) -> dict:
    """Checked, then timed: µs per call and GB/s of every variant (module doc)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = _setup(preset, gen)
    variants = {**_adaln_variants(a), **_qk_variants(a)}
    errors = {}
    for name, (call, got, want) in variants.items():
        call()
        torch.cuda.synchronize()
        errors[name] = _check(name, got() if callable(got) else got, want)
    qkv_src, qkv_dst = a["qkv"].clone(), torch.empty_like(a["qkv"])
    x_dst = torch.empty_like(a["x"])
    calls = {name: v[0] for name, v in variants.items()}
    calls["copy_ of x"] = lambda: x_dst.copy_(a["x"])
    calls["copy_ of qkv"] = lambda: qkv_dst.copy_(qkv_src)
    progress(f"glue ops {preset}: {len(calls)} variants checked, timing {rounds} rounds")
    graphs = {name: captured_graph(fn, launches) for name, fn in calls.items()}
    times = interleaved_device_times({n: g.replay for n, g in graphs.items()}, rounds,
                                     rotate=True)
    nbytes = op_bytes(a["S"], a["N"], a["H"], a["Hkv"], a["D"])
    rows = {}
    for name, ts in times.items():
        us = statistics.median(ts) / launches
        rows[name] = {"us": us, "bytes": nbytes[name], "gb_per_s": nbytes[name] / us / 1e3,
                      "max_abs_error": errors.get(name)}
    return {"preset": preset, "tokens": a["S"], "hidden": a["N"],
            "heads": [a["H"], a["Hkv"], a["D"]], "launches": launches, "rounds": rounds,
            "variants": rows}


def format_glue_ops(res: dict) -> str:
    H, Hkv, D = res["heads"]
    lines = [f"glue ops at {res['preset']}: B = 1, S = {res['tokens']}, N = {res['hidden']}, "
             f"heads {H} / {Hkv} of {D}, bf16 (a graph of {res['launches']} calls, median "
             f"of {res['rounds']} rotated rounds)",
             f"  {'variant':<26}{'us/call':>9}{'MB':>7}{'GB/s':>8}"]
    for name, r in res["variants"].items():
        lines.append(f"  {name:<26}{r['us']:>9.1f}{r['bytes'] / 1e6:>7.1f}{r['gb_per_s']:>8.0f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="wan-1.3b", help="model whose chunk shape to use")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds (>= 5)")
    ap.add_argument("--launches", type=int, default=20, help="calls per graph (>= 1)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.rounds < 5:
        ap.error(f"--rounds: expected at least 5, got {args.rounds}")
    if args.launches < 1:
        ap.error(f"--launches: expected at least 1, got {args.launches}")
    require_cuda("framekv.bench.glue_ops")
    res = measure_glue_ops(args.preset, rounds=args.rounds, launches=args.launches,
                           progress=stderr_progress("glue_ops"))
    print(format_glue_ops(res), flush=True)
    write_result(args.json, glue_ops=res)
    return res


if __name__ == "__main__":
    main()
