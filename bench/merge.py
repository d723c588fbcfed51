"""Benchmark the fused split-KV merge against the same merge written as torch ops.

    python -m framekv.bench.merge [--json out.json] [--iters 100]

Shapes (bf16): the seed geometry's query side, 1576 tokens x 32 heads of 128, merged
from S = 2, 3 and 4 splits, as one 1576-token causal block (the denoising forward) and
as four 394-token blocks (the clean pass). Every sub-row has keys and seq_len = T, so
the naive torch merge (softmax of the statistics over the splits, weighted sum) is
exact too.

Variants, each captured in a CUDA graph (launch cost out of every number):
- kernel: ``merge_split_kv_`` (one numba kernel);
- torch reference: ``merge_split_kv_reference`` (fp32, empty-sub-row masks, padding);
- torch naive: softmax over the splits, fp32 weighted sum, ``copy_`` into the output;
- torch copy_: a plain copy of the same byte count (the bandwidth ceiling).

Timing: CUDA events around one replay, L2 flushed (a 256 MB ``zero_``) before each,
after warm-up; median and p10-p90 of ``--iters`` (at least 50). GB/s counts the bytes
the merge must move: partial read + lse read + out write (kv_lens, 4 bytes a sub-row,
left out). Every merge is checked against the reference before it is timed.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from framekv.bench.report import dump_json, kernel_results
from framekv.bench.timing import captured_graph, check_bf16_close, require_cuda
from framekv.ops import merge_split_kv_, merge_split_kv_reference

T, H, D = 1576, 32, 128
SHAPES = [(S, nb) for nb in (1, 4) for S in (2, 3, 4, 6, 8)]  # (splits, causal blocks)


def timed(fn, iters: int, flush: torch.Tensor) -> list[float]:
    """Per-iteration µs of a graph replay of ``fn``, L2 flushed before each."""
    graph = captured_graph(fn)
    pairs = []
    for _ in range(iters):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in pairs]


def make_inputs(S: int, nb: int, gen: torch.Generator) -> dict:
    """partial [S, T, H, D] bf16, lse [S * nb, H, b] fp32, kv_lens [S * nb] int32, and
    out as the [T, H, D] view of a packed [T, H * D] output."""
    b = T // nb
    return {"out": torch.empty(T, H * D, dtype=torch.bfloat16, device="cuda").view(T, H, D),
            "partial": torch.randn(S, T, H, D, generator=gen, device="cuda").bfloat16(),
            "lse": torch.randn(S * nb, H, b, generator=gen, device="cuda") * 3 + 8,
            "kv_lens": torch.full((S * nb,), 9000, dtype=torch.int32, device="cuda"),
            "block_size": b, "seq_len": T}


def naive_merge(a: dict):
    """The merge as a caller would write it in torch (no masks: every sub-row has keys)."""
    S, b = a["partial"].shape[0], a["block_size"]
    nb = T // b

    def run():
        stats = a["lse"].view(S, nb, H, b).permute(0, 1, 3, 2).reshape(S, T, H)  # [S, T, H]
        w = torch.softmax(stats, 0)
        a["out"].copy_((w.unsqueeze(-1) * a["partial"].float()).sum(0))       # [T, H, D]
    return run


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error; stop unless within two bf16 units in the last place."""
    torch.cuda.synchronize()
    return check_bf16_close(name, got, want, atol=1e-5)


def variants(a: dict) -> tuple[dict, dict]:
    """Callables to time, each checked against the reference first; and their errors."""
    want = torch.empty_like(a["out"])
    ref_args = dict(a, out=want)
    merge_split_kv_reference(**ref_args)
    def kernel():
        merge_split_kv_(**a)

    naive = naive_merge(a)
    errors = {}
    for name, fn in (("kernel", kernel), ("torch naive", naive)):
        a["out"].fill_(float("nan"))
        fn()
        errors[name] = check(name, a["out"], want)
    nbytes = merged_bytes(a)
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    fns = {"kernel": kernel, "torch reference": lambda: merge_split_kv_reference(**ref_args),
           "torch naive": naive, "torch copy_ (same bytes)": lambda: dst.copy_(src)}
    return fns, errors


def merged_bytes(a: dict) -> int:
    """partial read + lse read + out write."""
    return (a["partial"].numel() * a["partial"].element_size() + a["lse"].numel() * 4
            + a["out"].numel() * a["out"].element_size())


def bench_shape(S: int, nb: int, iters: int, flush, gen) -> dict:
    a = make_inputs(S, nb, gen)
    fns, errors = variants(a)
    nbytes = merged_bytes(a)
    rows = {}
    for name, fn in fns.items():
        ts = sorted(timed(fn, iters, flush))
        med = statistics.median(ts)
        rows[name] = {"median_us": med, "p10_us": ts[len(ts) // 10],
                      "p90_us": ts[9 * len(ts) // 10], "gb_per_s": nbytes / med / 1e3}
        if name in errors:
            rows[name]["max_abs_error"] = errors[name]
    kernel_us = rows["kernel"]["median_us"]
    return {"splits": S, "blocks": nb, "block_size": T // nb, "bytes": nbytes, "variants": rows,
            "torch_naive_over_kernel": rows["torch naive"]["median_us"] / kernel_us,
            "kernel_fraction_of_copy": rows["torch copy_ (same bytes)"]["median_us"] / kernel_us}


def report(results: dict) -> None:
    print(f"split-KV merge, {T} tokens x {H} heads of {D}, bf16; L2 flushed before each replay")
    print(f"{'S':>2}{'nb':>4}{'MB':>7}  {'variant':<26}{'median us':>10}{'p10-p90 us':>16}"
          f"{'GB/s':>8}{'x kernel':>10}")
    for r in results["shapes"]:
        k = r["variants"]["kernel"]["median_us"]
        for name, v in r["variants"].items():
            spread = f"{v['p10_us']:.1f}-{v['p90_us']:.1f}"
            print(f"{r['splits']:>2}{r['blocks']:>4}{r['bytes'] / 1e6:>7.1f}  {name:<26}"
                  f"{v['median_us']:>10.1f}{spread:>16}{v['gb_per_s']:>8.0f}"
                  f"{v['median_us'] / k:>10.2f}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--iters", type=int, default=100, help="timed replays per variant (>= 50)")
    args = ap.parse_args(argv)
    if args.iters < 50:
        ap.error("--iters: expected at least 50")
    require_cuda("framekv.bench.merge")
    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    shapes = [bench_shape(S, nb, args.iters, flush, gen) for S, nb in SHAPES]
    results = kernel_results(geometry={"tokens": T, "heads": H, "head_dim": D,
                                       "dtype": "bfloat16"}, iters=args.iters, shapes=shapes)
    report(results)
    dump_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
