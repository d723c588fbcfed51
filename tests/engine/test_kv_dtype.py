"""fp8 K/V through the runners and the commands: ``kv_dtype`` on `Rollout`, `WanRollout`
and `StreamScheduler`, ``--kv-dtype`` on demo, verify, serve and bench, verify's
saturation report, and the Wan 14B config's pool sizing (no 14B weights are built)."""
from __future__ import annotations

import json

import pytest
import torch

from framekv.engine import CausalKVCache, Rollout, WanRollout, verify_rollout
from framekv.engine.memory import rollout_bytes
from framekv.engine.rollout import resolve_kv_dtype
from framekv.engine.wan import CONFIGS, PRESETS, WanShape, build_model, preset_sizes
from framekv.specs import load_preset
from framekv.tools.cli import build_parser, main

FP8 = torch.float8_e4m3fn
#: Bound on the fp8 rollout's relative L2 distance per chunk from the fp32 one (tiny,
#: CPU, reference backend, scales 1.0). Measured: about 1e-3 at most over 6 chunks
#: (e4m3 keeps 3 mantissa bits, so a stored value is off by up to 2^-4 of itself; the
#: attention averages those errors over the keys and the sampler's steps damp them);
#: the bound leaves a factor of 10 for summation order and platform differences.
ROLLOUT_REL_L2 = 1e-2


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("value", ["fp16", "int8", "FP8", torch.float16, torch.int8, 8])
def test_a_bad_kv_dtype_names_the_argument_the_choices_and_the_value(value):
    with pytest.raises(ValueError) as exc:
        Rollout("tiny", "cpu", kv_dtype=value)
    msg = str(exc.value)
    assert msg.startswith("kv_dtype must be None, 'bf16'") and "'fp8'" in msg
    assert f"got {value!r}" in msg


def test_kv_dtype_names_resolve_against_the_model_dtype():
    assert resolve_kv_dtype(None, torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype("bf16", torch.float32) is torch.float32   # the model's own
    assert resolve_kv_dtype("fp8", torch.float32) is FP8
    assert resolve_kv_dtype(FP8, torch.bfloat16) is FP8
    assert resolve_kv_dtype(torch.bfloat16, torch.bfloat16) is torch.bfloat16


def test_the_reference_store_takes_no_fp8():
    with pytest.raises(ValueError, match="kv_dtype='fp8' needs the paged cache"):
        Rollout("tiny", "cpu", kv="reference", kv_dtype="fp8")


# ----------------------------------------------------------------------------- rollouts
def test_an_fp8_rollout_stays_close_to_the_fp32_one():
    full = Rollout("tiny", "cpu")
    fp8 = Rollout("tiny", "cpu", model=full.model, kv_dtype="fp8")
    assert fp8.kv.cache.dtype == FP8 and fp8.kv_dtype == FP8 and full.kv_dtype == torch.float32
    want, got = full.run(), fp8.run()
    errs = [rel_l2(g, w) for g, w in zip(got, want)]
    assert len(errs) == 6 and max(errs) < ROLLOUT_REL_L2, errs
    assert max(errs) > 0                                          # the pool really is fp8
    stats = fp8.cache.kv_stats()
    assert stats["saturated"] == [[0, 0], [0, 0]]
    full.close()
    fp8.close()


def test_an_fp8_pool_is_sized_in_fp8_bytes():
    p = load_preset("wan-1.3b")
    need = {d: rollout_bytes(p.model, p.rollout, torch.bfloat16, kv_dtype=d)
            for d in (None, torch.bfloat16, FP8)}
    assert need[None] == need[torch.bfloat16]                      # default: the model's
    assert 0.49 < need[FP8]["kv_cache"] / need[None]["kv_cache"] < 0.51
    assert need[FP8]["weights"] == need[None]["weights"]


def test_a_wan_rollout_runs_over_an_fp8_pool():
    kw = preset_sizes(PRESETS["tiny"])
    model = build_model("tiny", device="cpu")
    text = torch.randn(1, kw["prompt_tokens"], CONFIGS["tiny"]["text_dim"],
                       generator=torch.Generator().manual_seed(9))
    runs = {}
    for name in (None, "fp8"):
        r = WanRollout(model, kv_dtype=name, **kw)
        r.set_prompt(text)
        runs[name] = [r.step(torch.randn(1, 4, kw["frames_per_chunk"], *kw["latent_size"],
                                         generator=torch.Generator().manual_seed(i)))
                      for i in range(3)]
        assert r.kv.cache.dtype == (FP8 if name else torch.float32)
        r.close()
    errs = [rel_l2(g, w) for g, w in zip(runs["fp8"], runs[None])]
    assert 0 < max(errs) < ROLLOUT_REL_L2, errs


# ----------------------------------------------------------------------------- verify
def test_verify_reports_an_fp8_pool_and_its_saturation_counts():
    report = verify_rollout("tiny", chunks=2, device="cpu", kv_dtype="fp8")
    assert report.kv_dtype == "float8_e4m3fn" and report.ok
    assert set(report.kv_stats) == {"eager", "graphs"} and report.saturated_values == 0
    text = report.format()
    assert "K/V pool float8_e4m3fn" in text and "fp8 K/V saturation" in text
    assert "WARNING" not in text


def test_verify_makes_saturation_visible_in_its_text_and_json(tmp_path):
    # Scale 1e-3: every |x| > 0.448 maps beyond 448 and is clamped.
    report = verify_rollout("tiny", chunks=2, device="cpu", kv_dtype="fp8", kv_scales=1e-3)
    assert report.saturated_values > 0
    assert "WARNING" in report.format() and f"{report.saturated_values} K/V values saturated" \
        in report.format()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["saturated_values"] == report.saturated_values
    assert any(n for row in data["kv_stats"]["eager"]["saturated"] for n in row)
    assert data["kv_stats"]["eager"]["scales"][0][0][0] == pytest.approx(1e-3)


def test_verify_kv_scales_need_an_fp8_pool():
    with pytest.raises(ValueError, match="kv_scales needs kv_dtype='fp8'"):
        verify_rollout("tiny", chunks=1, device="cpu", kv_scales=0.5)


# ----------------------------------------------------------------------------- commands
@pytest.mark.parametrize("command", ["demo", "verify", "serve", "bench"])
def test_kv_dtype_flag_parses_with_bf16_the_default(command):
    p = build_parser()
    assert p.parse_args([command]).kv_dtype == "bf16"
    assert p.parse_args([command, "--kv-dtype", "fp8"]).kv_dtype == "fp8"


@pytest.mark.parametrize("command", ["demo", "verify", "serve"])
def test_a_bad_kv_dtype_flag_is_a_usage_error(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--kv-dtype", "fp16"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--kv-dtype" in err and "'fp16'" in err


def test_bench_takes_both():
    assert build_parser().parse_args(["bench", "--kv-dtype", "both"]).kv_dtype == "both"


def test_demo_flag_reaches_the_cache(tmp_path, monkeypatch, capsys):
    import framekv.tools.demo as demo

    built = []

    class Recording(Rollout):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.kv.cache.dtype if self.cache is not None else None)

    monkeypatch.setattr(demo, "Rollout", Recording)
    out = tmp_path / "demo.json"
    assert main(["demo", "tiny", "--kv-dtype", "fp8", "--chunks", "2", "--check-chunks", "1",
                 "--device", "cpu", "--no-progress", "--json", str(out)]) == 0
    assert built and all(d == FP8 for d in built)      # the main rollout and the checks'
    report = json.loads(out.read_text())
    assert report["kv_dtype"] == "float8_e4m3fn" and "kv_stats" in report
    assert "K/V pool float8_e4m3fn" in capsys.readouterr().out


def test_verify_flag_reaches_the_cache_and_its_json(tmp_path, capsys):
    out = tmp_path / "verify.json"
    assert main(["verify", "tiny", "--kv-dtype", "fp8", "--chunks", "2", "--device", "cpu",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["kv_dtype"] == "float8_e4m3fn" and data["saturated_values"] == 0
    assert "fp8 K/V saturation" in capsys.readouterr().out


def test_serve_flag_reaches_the_scheduler_and_the_wan_runner():
    from framekv.engine.serving import StreamScheduler
    from framekv.tools.serve import kv_dtype_of, wan_factory

    args = build_parser().parse_args(["serve", "--kv-dtype", "fp8", "--device", "cpu"])
    assert kv_dtype_of(args) == "fp8"
    sched = StreamScheduler("tiny", max_sessions=1, device="cpu", kv_dtype=kv_dtype_of(args))
    assert sched.runner.kv.cache.dtype == FP8
    sched.runner.close()
    args = build_parser().parse_args(["serve", "--model", "wan-diffusers", "--config", "tiny",
                                      "--output", "latents", "--kv-dtype", "fp8",
                                      "--device", "cpu"])
    runner = wan_factory(args, decode=False)(sequences=1, batch_sizes=(1,))
    assert runner.kv.cache.dtype == FP8
    runner.close()


def test_the_scheduler_refuses_kv_dtype_beside_a_runner_factory():
    from framekv.engine.serving import StreamScheduler

    with pytest.raises(ValueError, match="kv_dtype is the preset's Rollout's"):
        StreamScheduler("tiny", device="cpu", kv_dtype="fp8", runner_factory=lambda **kw: None)


# ----------------------------------------------------------------------------- Wan 14B
def test_the_14b_config_is_wan_2_1_t2v_14b():
    c = CONFIGS["14b"]
    assert (c["num_layers"], c["num_attention_heads"], c["attention_head_dim"], c["ffn_dim"],
            c["text_dim"], c["freq_dim"], c["in_channels"], c["out_channels"],
            tuple(c["patch_size"])) == (40, 40, 128, 13824, 4096, 256, 16, 16, (1, 2, 2))
    assert set(c) == set(CONFIGS["1.3b"])
    assert PRESETS["14b"] == "wan-14b"
    m = load_preset("wan-14b").model
    assert (m.num_layers, m.num_heads, m.head_dim, m.ffn_size, m.hidden_size) == (
        40, 40, 128, 13824, 5120)
    assert preset_sizes(PRESETS["14b"]) == preset_sizes(PRESETS["1.3b"])


def test_the_14b_fp8_pool_at_480x832_and_a_21_frame_window_is_half_the_bf16_one():
    shape = WanShape(num_layers=40, heads=40, head_dim=128, channels=16, patch_size=(1, 2, 2),
                     latent_size=(60, 104), frames_per_chunk=3, sink_frames=1,
                     window_frames=21)
    g = shape.geometry()
    assert shape.tokens_per_frame == 1560 and g.window_tokens == 21 * 1560
    kw = dict(num_layers=40, num_kv_heads=40, head_dim=128, tokens_per_page=32)
    bf16 = CausalKVCache.pool_bytes_for(g, dtype=torch.bfloat16, **kw)
    fp8 = CausalKVCache.pool_bytes_for(g, dtype=FP8, **kw)
    values = 40 * 2 * CausalKVCache.pool_tokens_for(g, 32) * 40 * 128
    assert values * 2 <= bf16 < values * 2 * 1.01          # the pool dominates
    assert 0.49 < fp8 / bf16 < 0.51
    assert 18 < fp8 / 2**30 < 19 and 37 < bf16 / 2**30 < 38   # K/V of about 25 frames
