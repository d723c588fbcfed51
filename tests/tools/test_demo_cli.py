"""`framekv demo` and `framekv verify`, run in-process."""
from __future__ import annotations

import json

import pytest
import torch

import framekv.engine.rollout as rollout_module
from framekv.engine.attention import get_backend
from framekv.engine.attention.backend import ReferenceBackend, ReferencePlan
from framekv.tools.cli import main


def test_help_lists_demo_and_verify(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "verify" in out and "info" in out


def test_demo_runs_times_and_checks(capsys, tmp_path):
    path = tmp_path / "demo.json"
    assert main(["demo", "--json", str(path)]) == 0                  # the default: tiny
    captured = capsys.readouterr()
    out = captured.out
    for text in ("framekv demo: preset tiny, device cpu, backend reference", "latency ms",
                 "12 latent frames", "latent frames/s", "graphs: 1 graph(s), 6 hits",
                 "memory: cache arena", "graphs vs eager", "reference vs reference backend",
                 "on cpu the graph cache runs eagerly", "on cpu the backend already is the reference"):
        assert text in out, text
    assert "FAILED" not in out
    assert "demo [" in captured.err and "6/6" in captured.err       # progress on stderr
    report = json.loads(path.read_text())
    assert report["ok"] and report["chunks"] == 6 and report["frames"] == 12
    assert len(report["chunk_seconds"]) == 6 and report["latent_frames_per_second"] > 0
    assert report["graphs"]["hits"] == 6 and [c["ok"] for c in report["checks"]] == [True, True]


def test_demo_with_a_cache_dir_on_cpu_builds_nothing(capsys, tmp_path):
    from framekv import ops

    path = tmp_path / "demo.json"
    before = ops.compile_stats().compiled   # the count is the process's: other tests' too
    assert main(["demo", "--chunks", "2", "--no-progress", "--cache-dir", str(tmp_path / "c"),
                 "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["ok"] and report["builds"]["numba_compiled"] == before
    assert not (tmp_path / "c").exists()  # on CPU nothing is compiled, nothing is kept


def test_demo_short_run_without_progress(capsys):
    assert main(["demo", "--chunks", "1", "--no-progress", "--check-chunks", "1"]) == 0
    captured = capsys.readouterr()
    assert "2 latent frames" in captured.out and "checks on the first 1 chunk(s)" in captured.out
    assert "demo [" not in captured.err


@pytest.mark.parametrize("glue", ["torch", "fused"])
def test_verify_passes_and_prints_the_table(capsys, glue):
    assert main(["verify", "--chunks", "3", "--device", "cpu", "--glue", glue]) == 0
    out = capsys.readouterr().out
    for text in ("layer 0", "layer 1", "prefill", "denoise 0", "denoise 1", "clean",
                 "graph replay vs eager", "result: OK", f"{glue} glue"):
        assert text in out, text


class _PerturbedPlan(ReferencePlan):
    def run(self, q, layer, out):
        super().run(q, layer, out)
        out.add_(1e-3)


class _Perturbed(ReferenceBackend):
    def plan(self, cache, *, tokens, block_size, num_heads, scale):
        return _PerturbedPlan(cache, tokens=tokens, block_size=block_size, num_heads=num_heads,
                              scale=scale)


def test_verify_fails_beyond_tolerance(capsys, monkeypatch):
    def perturbed(backend, plan_dir=None, device=None):
        return _Perturbed() if backend == "reference" else get_backend(backend)
    monkeypatch.setattr(rollout_module, "get_backend", perturbed)
    assert main(["verify", "--chunks", "2", "--device", "cpu"]) == 1
    assert "result: FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["demo", "verify"])
def test_bad_preset_is_an_error(capsys, command):
    assert main([command, "--preset", "no-such-preset"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'no-such-preset'" in err and "tiny" in err


@pytest.mark.parametrize("command", ["demo", "verify"])
def test_bad_device_is_an_error(capsys, command):
    assert main([command, "--device", "tpu"]) == 2
    assert "device" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_on_a_cpu_machine_is_an_error(capsys):
    assert main(["demo", "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bad_chunks_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--chunks", "0"])
    assert exc.value.code == 2
