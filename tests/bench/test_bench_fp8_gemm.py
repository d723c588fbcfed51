"""`framekv.bench.fp8_gemm` on the CPU: a block's linears at the Wan shapes with what
makes each one's input, every variant's error against fp32 and its host time at a small
stand-in shape, the block's totals (bf16, fp8 with each layer's accumulation as the
model runs it, the inputs), the table, and its arguments refused before anything runs.
(Without CUDA the module's command says so in one line: tests/tools/test_cli_conventions.py.)"""
from __future__ import annotations

import json

import pytest

from framekv.bench import fp8_gemm


def test_the_wan_shapes_of_a_block():
    assert fp8_gemm.TOKENS == 4680
    lin = fp8_gemm.block_linears(*fp8_gemm.SHAPES["1.3b"])
    assert [(x.name, x.K, x.N, x.count, x.source, x.epilogue) for x in lin] == [
        ("qkv", 1536, 4608, 1, "norm", False), ("cross_q", 1536, 1536, 1, "norm", False),
        ("out", 1536, 1536, 2, "attention", False), ("ffn_in", 1536, 8960, 1, "norm", True),
        ("ffn_out", 8960, 1536, 1, "gelu", False)]
    assert fp8_gemm.SHAPES["14b"] == (5120, 13824)
    # each bench linear runs with the accumulation the Wan block gives its layers
    assert [fp8_gemm.fast_as_run(x.name) for x in lin] == [True, True, True, True, False]


def test_every_variant_is_checked_and_timed_at_a_small_shape():
    res = fp8_gemm.measure_fp8_gemm(("small",), tokens=48, rounds=3, modes=("eager",),
                                    device="cpu", shapes={"small": (64, 128)},
                                    progress=lambda m: None)
    json.loads(json.dumps(res))
    c = res["configs"]["small"]
    assert res["timer"] == "host" and not res["flush"] and list(c["linears"]) == [
        "qkv", "cross_q", "out", "ffn_in", "ffn_out"]
    for name, r in c["linears"].items():
        norm = r["source"] == "norm"
        want = set(fp8_gemm.VARIANTS) - (set() if norm else {"bf16 input", "unfused input"})
        assert set(r["us"]["eager"]) == want, name
        assert all(u["n"] == 3 and u["median"] > 0 for u in r["us"]["eager"].values())
        e = r["rel_l2"]
        # bf16: its rounding; fp8: e4m3's, about 0.037, the GELU's inputs included
        assert e["bf16"] < 1e-2 and 0.02 < e["fp8"] < 0.06, (name, e)
        # a CPU's GEMM has no fast accumulation: the same sums
        assert e["fp8 fast accum"] == e["fp8"] and e["fast vs promoted"] == 0
        assert set(r["tflops"]["eager"]) == set(fp8_gemm.GEMMS)
    b = c["block"]["eager"]
    lin = c["linears"]
    med = {n: {v: u["median"] for v, u in r["us"]["eager"].items()} for n, r in lin.items()}
    count = {n: r["count"] for n, r in lin.items()}
    assert b["bf16_us"] == pytest.approx(sum(count[n] * m["bf16"] for n, m in med.items()))
    assert b["fp8_as_run_us"] == pytest.approx(sum(
        count[n] * m["fp8 fast accum" if n != "ffn_out" else "fp8"] for n, m in med.items()))
    assert b["bf16_input_us"] == pytest.approx(sum(m["bf16 input"] for n, m in med.items()
                                                   if "bf16 input" in m))
    assert b["speedup"] == pytest.approx(b["bf16_us"] / b["fp8_as_run_us"])
    text = fp8_gemm.format_fp8_gemm(res)
    assert "small (dim 64, ffn 128), eager" in text and "out 64->64 x2" in text
    assert "rel L2 vs fp32" in text and "block: bf16" in text and "fp8 as run" in text


@pytest.mark.parametrize("argv, message", [(["--rounds", "2"], "--rounds: expected at least 3"),
                                           (["--tokens", "0"], "--tokens: expected at least 1"),
                                           (["--configs", "2b"], "must be a comma-separated"),
                                           (["--modes", "graph,lazy"], "must be a comma-separated")])
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        fp8_gemm.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
