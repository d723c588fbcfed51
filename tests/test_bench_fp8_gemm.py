"""`framekv.bench.fp8_gemm` on the CPU: a block's linears at the Wan shapes, every
variant's error against fp32 and its host time at a small stand-in shape, the block's
total, the table, and its arguments refused before anything runs. (Without CUDA the
module's command says so in one line: tests/test_cli_conventions.py.)"""
from __future__ import annotations

import json

import pytest

from framekv.bench import fp8_gemm


def test_the_wan_shapes_of_a_block():
    assert fp8_gemm.TOKENS == 4680
    assert fp8_gemm.block_linears(*fp8_gemm.SHAPES["1.3b"]) == [
        ("qkv", 1536, 4608, 1, ""), ("proj", 1536, 1536, 3, ""),
        ("ffn_in", 1536, 8960, 1, "epilogue"), ("ffn_out", 8960, 1536, 1, "input")]
    assert fp8_gemm.SHAPES["14b"] == (5120, 13824)


def test_every_variant_is_checked_and_timed_at_a_small_shape():
    res = fp8_gemm.measure_fp8_gemm(("small",), tokens=48, rounds=3, modes=("eager",),
                                    device="cpu", shapes={"small": (64, 128)},
                                    progress=lambda m: None)
    json.loads(json.dumps(res))
    c = res["configs"]["small"]
    assert res["timer"] == "host" and not res["flush"] and list(c["linears"]) == [
        "qkv", "proj", "ffn_in", "ffn_out"]
    for name, r in c["linears"].items():
        assert set(r["us"]["eager"]) == set(fp8_gemm.VARIANTS), name
        assert all(u["n"] == 3 and u["median"] > 0 for u in r["us"]["eager"].values())
        e = r["rel_l2"]
        # bf16: its rounding; fp8: e4m3's, about 0.037, the GELU's inputs included
        assert e["bf16"] < 1e-2 and 0.02 < e["fp8"] < 0.06, (name, e)
        assert e["fp8 gemm only"] == e["fp8"] and e["fp8 fast accum"] < 0.06
        assert "quantize" not in r["tflops"]["eager"]
    b = c["block"]["eager"]
    lin = c["linears"]
    assert b["bf16_us"] == pytest.approx(sum(r["count"] * r["us"]["eager"]["bf16"]["median"]
                                             for r in lin.values()))
    assert b["speedup"] == pytest.approx(b["bf16_us"] / b["fp8_us"])
    text = fp8_gemm.format_fp8_gemm(res)
    assert "small (dim 64, ffn 128), eager" in text and "proj 64->64 x3" in text
    assert "rel L2 vs fp32" in text and "block: bf16" in text


@pytest.mark.parametrize("argv, message", [(["--rounds", "2"], "--rounds: expected at least 3"),
                                           (["--tokens", "0"], "--tokens: expected at least 1"),
                                           (["--configs", "2b"], "must be a comma-separated"),
                                           (["--modes", "graph,lazy"], "must be a comma-separated")])
def test_bad_arguments_are_refused_before_anything_runs(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        fp8_gemm.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
