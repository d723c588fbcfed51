"""`framekv bench` on CPU: arguments, the no-GPU error, ratios, tables and the chart."""
from __future__ import annotations

import json

import pytest
import torch

from framekv.bench import attention, chunk, e2e
from framekv.tools.cli import main


def timing(median):
    return {"median": median, "p10": median * 0.99, "p90": median * 1.02, "min": median * 0.98, "n": 50}


def attention_result():
    rows = {name: {"block_size": b, "max_error": 1.5e-4, "us": timing(us), "tflops": 400.0,
                   "fraction_of_ceiling": 0.5}
            for name, b, us in [("framekv-denoise", 1576, 1800.0), ("framekv-clean", 394, 2400.0),
                                ("sdpa-cudnn", 1576, 2150.0), ("concat-sdpa", 1576, 2300.0),
                                ("sdpa-flash", 1576, 3700.0), ("framekv-denoise-S1", 1576, 2170.0),
                                ("framekv-denoise-S4", 1576, 1790.0), ("framekv-clean-S1", 394, 2400.0),
                                ("framekv-clean-S2", 394, 2500.0)]}
    return {"heads": 32, "kv_heads": 8, "head_dim": 128, "tokens": 1576, "keys": 39912,
            "frame": 394, "matmul_tflops": 790.0, "notes": {}, "variants": rows,
            "ratios": attention.ratios(rows)}


def test_ratios_are_the_stated_comparisons():
    r = attention_result()["ratios"]
    assert r["denoise_over_sdpa_cudnn"] == pytest.approx(1800 / 2150)
    assert r["sdpa_flash_over_denoise"] == pytest.approx(3700 / 1800)
    assert r["denoise_s1_over_sdpa_cudnn"] == pytest.approx(2170 / 2150)
    assert r["best_denoise"] == "framekv-denoise-S4"
    assert r["best_denoise_over_s1"] == pytest.approx(1790 / 2170)
    assert r["best_clean"] == "framekv-clean-S1" and r["best_clean_over_s1"] == 1.0


def test_tables_name_every_variant():
    text = attention.format_attention(attention_result())
    for name in ("framekv-denoise-S4", "sdpa-flash", "concat-sdpa"):
        assert name in text
    assert "unsplit (S=1) denoise / sdpa-cudnn = 1.009" in text
    res = {"layers": 36, "tokens": 1576, "clean_block": 394, "denoising_steps": 4, "keys": 39912,
           "device_us": {"whole_chunk_graph": timing(3.4e5)}, "host_us": {"whole_chunk_replay": timing(40.0)},
           "sum_of_pieces_us": 3.39e5, "whole_chunk_over_pieces": 1.003,
           "whole_over_per_forward_paired": 1.0006}
    assert "whole chunk / sum of pieces = 1.0030" in chunk.format_chunk(res)
    run = {"preset": "wan-1.3b", "layers": 30, "window_frames": 21, "keys": 38000,
           "frames_per_chunk": 3, "chunks": 6,
           "variants": {"framekv-graphs": {"chunk_us": timing(4.8e5), "frames_per_second": 6.2,
                                           "path": "graphs"},
                        "dense-eager": {"chunk_us": timing(5.5e5), "frames_per_second": 5.4,
                                        "path": "eager"},
                        "dense-graphs": {"skipped": "no"}}}
    text = e2e.format_e2e(run)
    assert "framekv-graphs / dense-eager frames per second = 1.148" in text
    assert "dense-graphs    skipped: no" in text


@pytest.mark.parametrize("argv,message", [
    (["--sections", "attention,bogus"], "--sections: must be a comma-separated subset"),
    (["--windows", "21,x"], "--windows: must be comma-separated frame counts"),
    (["--iters", "2"], "--iters: must be >= 5"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_a_gpu_the_command_says_so(capsys):
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_chart_from_needs_png(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text("{}")
    assert main(["bench", "--chart-from", str(path)]) == 2
    assert "--chart-from needs --png" in capsys.readouterr().err


def test_chart_from_an_earlier_run(tmp_path):
    pytest.importorskip("matplotlib")
    results = {"environment": {"device": "NVIDIA H200", "torch": "2.11"},
               "sections": {"attention": attention_result()}}
    src, png = tmp_path / "r.json", tmp_path / "r.png"
    src.write_text(json.dumps(results))
    assert main(["bench", "--chart-from", str(src), "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chunk_result_sums_the_pieces_and_pairs_whole_and_per_forward_by_round():
    from types import SimpleNamespace

    dev = {k: [10.0, 10.0] for k in ("denoise_forward", "clean_pass", "commit")}
    dev["whole_chunk_graph"] = [50.0, 48.0, 60.0]
    dev["per_forward_graphs"] = [50.0, 40.0, 50.0]
    host = {"whole_chunk_replay": [12.0, 14.0, 13.0]}
    stack = SimpleNamespace(kv=SimpleNamespace(num_layers=36))
    g = SimpleNamespace(pin_tokens=4, window_tokens=16)
    res = chunk._chunk_result(dev, host, stack, g, 8, 4, 2)
    assert res["sum_of_pieces_us"] == 2 * 10.0 + 10.0 + 10.0
    assert res["whole_chunk_over_pieces"] == pytest.approx(50.0 / 40.0)
    # paired per round (1.0, 1.2, 1.2), not a ratio of medians (50 / 50)
    assert res["whole_over_per_forward_paired"] == pytest.approx(1.2)
    assert (res["layers"], res["keys"], res["host_us"]["whole_chunk_replay"]["median"]) == (
        36, 4 + 16 + 8, 13.0)
    text = chunk.format_chunk(res)
    assert "whole chunk / sum of pieces = 1.2500" in text and "resident" not in text
