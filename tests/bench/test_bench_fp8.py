"""The bf16-vs-fp8 bench section on CPU: every part's whole code path with the reference
backend and tiny sizes (the forward at the tiny geometry, the reference DiT of the tiny
preset, its held-out forward, diffusers' Wan at a tiny config whose features are
multiples of 16, as fp8 GEMMs need), host timers standing in for CUDA events; its
tables, its options, and how ``framekv bench`` reaches it."""
from __future__ import annotations

import json
import math

import pytest
import torch

from framekv.bench import fp8
from framekv.bench.fp8 import check_options, format_fp8, measure_fp8, summary_rows
from framekv.bench.fp8_common import distribution, run_speedups, speedups
from framekv.bench.fp8_forward import format_forward, measure_forward
from framekv.bench.fp8_reference import measured_layers
from framekv.bench.fp8_wan import measure_wan_pools
from framekv.engine.wan import CONFIGS
from framekv.tools import bench as tools_bench
from framekv.tools.bench import SECTIONS, sections_of
from framekv.tools.cli import build_parser

pytest.importorskip("diffusers")

#: Tiny Wan sizes: 4 tokens a frame, 2-frame chunks, sink 1 + window 3.
WAN_SIZES = {"latent_size": (4, 4), "frames_per_chunk": 2, "window_frames": 3,
             "prompt_tokens": 8}
#: The tiny Wan config with heads of 16 (width 32) and an MLP of 64: fp8 GEMMs need
#: features that are multiples of 16 (the shipped tiny config's width is 24).
TINY16 = {**CONFIGS["tiny"], "attention_head_dim": 16, "ffn_dim": 64}
RUNS = ["bf16", "fp8", "fp8-gemm"]


@pytest.fixture(scope="module")
def result():
    return measure_fp8("tiny", forward_preset="tiny", window_frames=None, chunks=4, rounds=3,
                       iters=3, wan_configs=(TINY16,), wan_chunks=3, wan_sizes=WAN_SIZES,
                       device="cpu", progress=lambda msg: None)


def test_every_part_is_in_the_result_and_the_json(result):
    assert result["parts"] == ["forward", "dit", "reference", "wan"]
    assert set(result) == {"parts", "forward", "dit", "reference", "wan"}
    assert len(result["wan"]) == 1
    json.loads(json.dumps(result))


def test_dit_checks_both_gemms_against_fp32_on_a_held_out_chunk(result):
    d = result["dit"]
    assert (d["preset"], d["layers"], d["tokens"], d["timer"]) == ("tiny", 2, 32, "host")
    assert d["held_out"]["seed"] not in (0, 1) and d["model_dtype"] == "float32"
    # on a CPU the model is fp32: its own GEMMs are the twin's (the glue's rounding
    # aside); fp8 GEMMs are off by e4m3's rounding of every operand
    bf16, f8 = d["check"]["bf16"], d["check"]["fp8-gemm"]
    assert bf16["max_abs"] < 1e-4 and 1e-3 < f8["mean_abs"] <= f8["max_abs"] < 0.1 * d["max_abs_want"]
    assert set(d["us"]) == {"bf16", "fp8-gemm"} and all(u["n"] == 3 for u in d["us"].values())
    assert d["fp8_gemm_speedup"] > 0 and d["fp8_gemm_over_bf16"] > 0


def test_dit_fp32_twin_runs_off_the_cpu():
    """The dit part's fp32 twin on a device that is not the CPU (meta, shapes only,
    standing in for CUDA, where cuDNN takes no fp32): its attention is the reference
    backend's, which takes fp32 anywhere."""
    from framekv.bench import fp8_dit
    from framekv.engine.rollout import resolve_specs

    _, mspec, rspec = resolve_specs("tiny")
    inputs = fp8_dit._held_out(mspec, rspec.frames_per_chunk, "meta")
    v = fp8_dit._fp32_velocity(mspec, rspec.prompt_tokens, inputs, "meta")
    assert v.device.type == "meta" and v.dtype == torch.float32 and v.shape == inputs[0].shape


def test_forward_both_pools_timed_and_checked_against_fp32(result):
    f = result["forward"]
    assert (f["heads"], f["kv_heads"], f["head_dim"], f["tokens"], f["frame"]) == (4, 2, 16, 32, 16)
    assert f["keys"] == 6 + 48 + 32 and f["timer"] == "host" and f["calibrated"]
    bf16, f8 = f["pools"]["bf16"], f["pools"]["fp8"]
    assert bf16["dtype"] == "bfloat16" and f8["dtype"] == "float8_e4m3fn"
    assert f8["pool_bytes"] < bf16["pool_bytes"]
    for pas, block in (("denoise", 32), ("clean", 16)):
        a, b = bf16["passes"][pas], f8["passes"][pas]
        for r in (a, b):
            assert r["block_size"] == block and r["us"]["n"] == 3 and r["us"]["median"] > 0
            assert math.isfinite(r["max_abs"]) and 0 < r["mean_abs"] <= r["max_abs"]
        # bf16 holds the reference's values exactly (only the output is rounded); fp8
        # rounds every K, V by up to 2^-4 of itself.
        assert a["max_abs"] < 1e-2 and a["max_abs"] < b["max_abs"] < 0.25
        assert a["mean_abs"] < b["mean_abs"]
        s = f["speedups"][pas]
        assert s["fp8_speedup"] > 0 and s["fp8_speedup_paired"] > 0
    # calibrated: the largest |K| of the fill, times the margin 2, maps to 448 (the
    # staged chunk, written after, may pass the fill's largest, never the margin)
    st = f["fp8"]
    assert st["saturated"] == 0
    for kind in "kv":
        assert st["amax"][kind] / 448 < st["scales"][kind][1] <= 2 * st["amax"][kind] / 448


def test_forward_over_the_cudnn_plans_times_the_launch_alone_too():
    """The cuDNN backend's own plans (over the stand-in for cuDNN): each pass also has its
    kernel launch alone timed ("call" rows); fp8 Q is quantized by the plan."""
    from cudnn_fake import FakeCudnnBackend

    f = measure_forward("tiny", iters=2, device="cpu", backend=FakeCudnnBackend(),
                        calibrate=False, progress=lambda msg: None)
    assert set(f["speedups"]) == {"denoise", "denoise_call", "clean", "clean_call"}
    assert all(s["fp8_speedup"] > 0 for s in f["speedups"].values())
    for pas in ("denoise", "clean"):
        a, b = (f["pools"][p]["passes"][pas] for p in ("bf16", "fp8"))
        assert a["call_us"]["n"] == b["call_us"]["n"] == 2 and b["call_us"]["median"] > 0
        assert a["max_abs"] < 1e-2 and a["max_abs"] < b["max_abs"] < 0.25
    assert f["fp8"]["scales"] == {"k": [1.0, 1.0], "v": [1.0, 1.0]} and not f["calibrated"]
    text = format_forward(f)
    assert "fp8 scales 1.0" in text and "denoise call" in text and "clean call" in text
    assert [r[0] for r in summary_rows({"forward": f})] == [
        "forward denoise µs", "forward denoise call µs", "forward clean µs", "forward clean call µs"]


def test_reference_every_run_is_timed_and_checked_side_by_side(result):
    r = result["reference"]
    pools = r["pools"]
    assert list(pools) == RUNS
    assert [p["dtype"] for p in pools.values()] == ["float32", "float8_e4m3fn", "float8_e4m3fn"]
    assert [p["gemm_dtype"] for p in pools.values()] == ["float32", "float32", "float8_e4m3fn"]
    for p in pools.values():
        assert p["chunk_ms"]["median"] > 0 and p["chunk_ms"]["n"] == 3
        assert p["attention"]["layers"] == [0, 1]
    for name in RUNS[1:]:
        key = name.replace("-", "_")
        assert pools[name]["over_bf16"] == pytest.approx(
            pools[name]["chunk_ms"]["median"] / pools["bf16"]["chunk_ms"]["median"])
        assert r[key + "_speedup"] == pytest.approx(1 / pools[name]["over_bf16"])
    assert r["fp8_over_bf16"] == pools["fp8"]["over_bf16"]
    assert r["timer"] == "host" and r["fp8_pool_fraction"] < 1


def test_reference_accuracy_is_the_quantization_error(result):
    bf16, f8 = (result["reference"]["pools"][n]["attention"] for n in ("bf16", "fp8"))
    # The model's-dtype pool (fp32 on CPU) matches the fp32 reference to rounding; fp8
    # rounds each stored value by up to 2^-4 of itself.
    assert bf16["max_abs"] < 1e-5 and 1e-4 < f8["max_abs"] < 0.25
    assert 0 < f8["mean_abs"] <= f8["max_abs"]
    for name in RUNS[1:]:
        d = result["reference"]["pools"][name]["latents_rel_l2"]
        assert d["n"] == 4 and len(d["per_chunk"]) == 4
        assert 0 < d["median"] <= d["p90"] <= d["max"] < 2e-2
    # fp8 GEMMs add their rounding to the pool's
    gemm, kv = (result["reference"]["pools"][n]["latents_rel_l2"] for n in RUNS[:0:-1])
    assert gemm["median"] > kv["median"]
    assert result["reference"]["pools"]["fp8"]["saturated"] == 0


def test_wan_every_rollout_on_one_model(result):
    (w,) = result["wan"]
    assert (w["config"], w["layers"], w["heads"], w["head_dim"]) == ("custom", 2, 2, 16)
    assert w["tokens_per_frame"] == 4 and w["keys"] == (1 + 3 + 2) * 4
    assert w["order"] == "rotated" and w["timer"] == "host" and w["model_dtype"] == "float32"
    pools = w["pools"]
    assert list(pools) == RUNS
    assert [p["dtype"] for p in pools.values()] == ["float32", "float8_e4m3fn", "float8_e4m3fn"]
    assert [p["gemm_dtype"] for p in pools.values()] == ["float32", "float32", "float8_e4m3fn"]
    for p in pools.values():
        assert p["chunk_ms"]["n"] == 3 and p["chunk_ms"]["median"] > 0
        assert p["frames_per_second"] == pytest.approx(2e3 / p["chunk_ms"]["median"])
        assert p["pool_bytes"] > 0 and p["path"] in ("graphs", "eager")
    assert w["fp8_speedup"] > 0 and w["fp8_speedup_paired"] > 0 and w["fp8_pool_fraction"] < 1
    assert w["fp8_gemm_speedup"] > 0 and w["fp8_gemm_speedup_paired"] > 0
    for name in RUNS[1:]:
        d = pools[name]["latents_rel_l2"]
        assert d["n"] == 3 and all(math.isfinite(x) and x > 0 for x in d["per_chunk"])
        assert d["median"] <= d["p90"] <= d["max"] < 2e-2
    assert pools["fp8"]["saturated"] == 0


def test_wan_sequential_order_gives_the_same_latents(result):
    seq = measure_wan_pools(TINY16, chunks=2, rounds=2, order="sequential", device="cpu",
                            progress=lambda msg: None, **WAN_SIZES)
    assert seq["order"] == "sequential" and seq["pools"]["fp8-gemm"]["chunk_ms"]["n"] == 2
    for name in RUNS[1:]:
        rotated = result["wan"][0]["pools"][name]["latents_rel_l2"]["per_chunk"]
        assert seq["pools"][name]["latents_rel_l2"]["per_chunk"] == pytest.approx(rotated[:2])


def test_wan_shipped_tiny_config_cannot_run_fp8_gemms():
    with pytest.raises(ValueError, match="blocks.0.attn1.to_q/to_k/to_v: fp8 GEMMs need"):
        measure_wan_pools("tiny", chunks=1, rounds=1, device="cpu", progress=lambda msg: None,
                          **WAN_SIZES)


def test_the_tables_name_every_part_and_the_summary(result):
    text = format_fp8(result)
    for piece in ("fp8 forward, one layer at tiny", "denoise           32  fp8   float8_e4m3fn",
                  "fp8 speed-up (bf16 time / fp8 time; per round in brackets): denoise", "fp8 reference DiT: tiny",
                  "bf16     float32", "fp8-gemm latents vs bf16, relative L2 over 4 chunks",
                  "fp8 wan custom (2 layers", "fp8 dit forward: tiny", "fp8 GEMMs' speed-up",
                  "rounds rotated (host)", "fp8-gemm speed-up (bf16 time / fp8-gemm time)",
                  "fp8 latents vs bf16, relative L2 over 3 chunks", "0 values saturated",
                  "summary (speed-up = bf16 time / fp8 time)", "forward clean µs",
                  "reference fp8-gemm ms/chunk", "wan custom fp8 ms/chunk"):
        assert piece in text, piece
    rows = summary_rows(result)
    assert [r[0] for r in rows] == ["forward denoise µs", "forward clean µs",
                                    "dit fp8-gemm forward µs",
                                    "reference fp8 ms/chunk", "reference fp8-gemm ms/chunk",
                                    "wan custom fp8 ms/chunk", "wan custom fp8-gemm ms/chunk"]
    assert all(r[1] > 0 and r[2] > 0 and r[3] == pytest.approx(r[1] / r[2]) for r in rows)


def test_helpers():
    assert distribution([3.0, 1.0, 2.0]) == {"median": 2.0, "p90": 3.0, "max": 3.0, "n": 3}
    assert measured_layers(30) == [0, 15, 29] and measured_layers(1) == [0]
    assert speedups([2.0, 4.0, 6.0], [1.0, 4.0, 2.0]) == {"fp8_speedup": 2.0,
                                                          "fp8_speedup_paired": 2.0}
    assert run_speedups({"bf16": [2.0], "fp8": [1.0], "fp8-gemm": [0.5]}) == {
        "fp8_speedup": 2.0, "fp8_speedup_paired": 2.0, "fp8_gemm_speedup": 4.0,
        "fp8_gemm_speedup_paired": 4.0}


@pytest.mark.parametrize("kw, match", [
    ({"chunks": 0}, "chunks must be an integer >= 1, got 0"),
    ({"wan_chunks": True}, "wan_chunks must be an integer >= 1, got True"),
    ({"parts": ("forward", "pixels")}, "parts must be a non-empty subset"),
    ({"wan_configs": ("2b",)}, "wan_configs must name configs of"),
    ({"wan_order": "random"}, "wan_order must be one of"),
])
def test_bad_options_are_refused_before_anything_runs(kw, match):
    with pytest.raises(ValueError, match=match):
        measure_fp8("tiny", device="cpu", **kw)
    opts = {"parts": fp8.PARTS, "wan_configs": ("tiny",), "wan_order": "auto", **kw}
    with pytest.raises(ValueError, match=match):
        check_options(opts.pop("parts"), opts.pop("wan_configs"), opts.pop("wan_order"), **opts)


def test_the_module_command_line_refuses_bad_counts(capsys):
    assert fp8.main(["--parts", "wan", "--wan-chunks", "0"]) == 2
    assert "wan_chunks must be an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fp8.main(["--wan-configs", "1.3b,2b"])


def test_the_section_is_registered_and_kv_dtype_both_selects_it():
    from framekv.engine.wan import CONFIGS

    assert "fp8" in SECTIONS
    assert tools_bench.FP8_PARTS == fp8.PARTS and tools_bench.WAN_CONFIGS == tuple(CONFIGS)
    args = build_parser().parse_args(["bench", "--kv-dtype", "both", "--sections", "e2e"])
    assert args.kv_dtype == "both" and sections_of(args) == ["e2e", "fp8"]
    assert args.fp8_parts == list(fp8.PARTS) and args.wan_configs == ["1.3b"]
    assert args.wan_chunks == 20
    args = build_parser().parse_args(["bench", "--kv-dtype", "fp8", "--sections", "e2e"])
    assert sections_of(args) == ["e2e"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--wan-configs", "1.3b,2b"])


def test_framekv_bench_passes_its_options_to_the_section(result, monkeypatch, capsys):
    seen = {}

    def parts(preset, **kw):
        seen.update(kw, preset=preset)
        yield "wan", result["wan"][0]
    monkeypatch.setattr(fp8, "measure_parts", parts)
    args = build_parser().parse_args(
        ["bench", "--sections", "fp8", "--fp8-parts", "wan,forward", "--wan-configs", "1.3b,14b",
         "--wan-chunks", "7", "--chunk-iters", "6", "--iters", "9", "--chunks", "5",
         "--e2e-preset", "tiny"])
    out, saved = {}, []
    tools_bench._fp8(args, "PRESET", out, lambda: saved.append(1), lambda msg: None)
    progress = seen.pop("progress")
    assert callable(progress) and seen == {
        "preset": "tiny", "parts": ["wan", "forward"], "forward_preset": "PRESET",
        "window_frames": 21, "chunks": 5, "rounds": 6, "iters": 9,
        "wan_configs": ["1.3b", "14b"], "wan_chunks": 7}
    assert out["fp8"] == {"parts": ["wan", "forward"], "wan": [result["wan"][0]]} and saved
    text = capsys.readouterr().out
    assert "fp8 wan custom" in text and "wan custom fp8-gemm ms/chunk" in text


def test_error_budget_emulates_the_plans_roundings():
    """The budget's Q, K, V and O roundings with the product's scales are what the fp8
    plan computes (the stand-in for cuDNN rounds those, not P): its "Q,K,V,O" row is the
    measured error; each source alone rounds something, the storage more than any one."""
    from cudnn_fake import FakeCudnnBackend
    from framekv.bench.fp8_budget import SOURCES

    f = measure_forward("tiny", iters=1, device="cpu", backend=FakeCudnnBackend(),
                        progress=lambda msg: None)
    b, measured = f["error_budget"], f["pools"]["fp8"]["passes"]["denoise"]
    assert set(SOURCES) <= set(b)
    assert b["Q,K,V,O"]["max_abs"] == pytest.approx(measured["max_abs"], rel=0.02)
    assert b["Q,K,V,O"]["mean_abs"] == pytest.approx(measured["mean_abs"], rel=0.02)
    for name in ("Q", "K", "V", "P", "O"):
        assert 0 < b[name]["mean_abs"] < b["all"]["mean_abs"], name
    assert b["Q,K,V"]["mean_abs"] > max(b[n]["mean_abs"] for n in "QKV")
    assert "where the fp8 error enters" in format_forward(f)
