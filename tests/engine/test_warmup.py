"""`framekv warmup` and `framekv.engine.warm_up` on CPU: the table, the JSON, preset
files, clear errors, and a rollout left at position 0 whose captured graphs are exactly
the ones it replays."""
from __future__ import annotations

import importlib.resources
import json
import subprocess
import sys

import msgspec
import pytest
import torch

from framekv import specs
from framekv.engine import Rollout, warm_up
from framekv.graphs import decode_report
from framekv.tools import cli as tool

TINY_TOML = importlib.resources.files("framekv.specs") / "presets" / "tiny.toml"


def cli(argv):
    """Run ``framekv warmup ...`` in process."""
    return tool.main(["warmup", *argv])


def two_lengths() -> specs.Preset:
    """tiny with a shorter last chunk: two chunk lengths, two graphs."""
    tiny = specs.load_preset("tiny")
    return msgspec.structs.replace(tiny, name="two-lengths", rollout=msgspec.structs.replace(
        tiny.rollout, chunks=3, last_chunk_frames=1))


# ---------------------------------------------------------------------------- the command
def test_tiny_prints_the_table_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "w.json"
    assert cli(["tiny", "--json", str(out_json), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert tool.CPU_NOTE in out and "1 chunk graph(s)" in out and "backend reference" in out
    assert "program" in out and "reserved MiB" in out and "1 graphs on cpu" in out
    assert "chunk[euler]:2x32+clean16+commit" in out
    assert err == ""  # --no-progress
    report = decode_report(out_json.read_bytes())
    assert [(r.tokens, r.program, r.status) for r in report.records] == [
        (32, "chunk[euler]:2x32+clean16+commit", "captured")]
    assert report.records[0].block_sizes == (32, 32, 16)
    assert report.graphs == report.captured == 1 and report.device == "cpu"
    assert decode_report(json.dumps(msgspec.to_builtins(report))) == report


def test_progress_goes_to_stderr(capsys):
    assert cli(["tiny"]) == 0
    out, err = capsys.readouterr()
    assert "warm-up [" in err and "done" in err
    assert "warm-up [" not in out


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_preset_file(tmp_path, capsys, suffix):
    path = tmp_path / f"preset{suffix}"
    if suffix == ".json":
        path.write_bytes(specs.encode_json(two_lengths()))
    else:  # the shipped TOML with a short last chunk and a cache dir
        text = TINY_TOML.read_text().replace("chunks = 6", "chunks = 3\nlast_chunk_frames = 1")
        path.write_text(text + f'\n[warmup]\ncache_dir = "{tmp_path / "cache"}"\n')
    out_json = tmp_path / "w.json"
    assert cli([str(path), "--json", str(out_json), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "warm-up of" in out and "2 chunk graph(s)" in out
    if suffix == ".toml":
        assert "cache dir:" in out and "unused on cpu" in out
    report = decode_report(out_json.read_bytes())
    assert [r.tokens for r in report.records] == [32, 16]
    assert not (tmp_path / "cache").exists()  # nothing is compiled on CPU


def test_shipped_preset_file_path(capsys):
    assert cli([str(TINY_TOML), "--no-progress"]) == 0
    assert "warm-up of" in capsys.readouterr().out


def test_a_json_that_is_no_preset_is_refused_with_the_reason(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"entries": []}))
    assert cli([str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "not a preset file" in err and "plan.json" in err


@pytest.mark.parametrize("name, words", [
    ("missing.toml", ["preset file not found", "missing.toml"]),
    ("no/such/preset.json", ["preset file not found"]),
    ("nope", ["preset name", "unknown preset 'nope'", "available:", "tiny"]),
    ("preset.yaml", ["unknown preset 'preset.yaml'", ".toml/.json preset file"]),
])
def test_bad_preset_errors_are_clear(capsys, name, words):
    assert cli([name, "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("framekv warmup: error: ")
    for w in words:
        assert w in err


def test_invalid_preset_file_names_the_field(tmp_path, capsys):
    data = msgspec.to_builtins(specs.load_preset("tiny"))
    data["model"]["tokens_per_page"] = 48
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert cli([str(path)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "tokens_per_page" in err and "power of two" in err


@pytest.mark.parametrize("device, words", [("gpu", ["cpu or cuda"]),
                                           ("meta", ["cpu or cuda"])])
def test_bad_device(capsys, device, words):
    assert cli(["tiny", "--device", device, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words)


def test_failed_capture_names_the_graph(capsys, monkeypatch):
    from framekv.engine import CachedAttention

    def broken(self, *args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(CachedAttention, "forward", broken)
    assert cli(["tiny", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "kernel exploded" in err
    assert "warm-up request 0: chunk[euler]:2x32+clean16+commit T=32" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_without_a_gpu_says_so(capsys):
    assert cli(["tiny", "--device", "cuda", "--no-progress"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_module_entry_point_and_light_import():
    out = subprocess.run([sys.executable, "-m", "framekv.tools.cli", "warmup", "tiny",
                          "--no-progress"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert tool.CPU_NOTE in out.stdout and "1 graphs on cpu" in out.stdout
    code = ("import sys, framekv.tools.cli\n"
            "assert 'torch' not in sys.modules and 'cudnn' not in sys.modules\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------- the engine side
def test_warm_up_captures_what_the_rollout_replays_and_leaves_it_at_position_zero():
    result = warm_up(two_lengths(), device="cpu", progress=False)
    r = result.rollout
    assert r.cache.committed_tokens == 0 and r.cache.staged_tokens == 0 and not r.prefilled
    assert r.cache._open.seqs[0].counters.tolist() == [0, r.cache._open.seqs[0].host.ring_base, 0, 0]
    assert set(r.graphs.keys()) == {q.key for q in r.capture_requests()}
    assert result.report.captured == 2 and set(result.builds) >= {"numba_compiled",
                                                                  "numba_loaded"}
    out = r.run()
    assert r.paths == {"graphs": 3, "eager": 0} and r.graphs.stats().captures == 2
    eager = Rollout(two_lengths(), "cpu", use_graphs=False, model=r.model)
    assert max(float((a - b).abs().max()) for a, b in zip(out, eager.run())) == 0.0
    r.close()


def test_warm_up_takes_the_preset_cache_dir(tmp_path, monkeypatch):
    seen = []
    import framekv.engine.rollout as rollout_module

    monkeypatch.setattr(rollout_module, "use_cache_dir",
                        lambda d, device: seen.append(d) or None)
    preset = msgspec.structs.replace(two_lengths(), warmup=specs.WarmupOptions(
        cache_dir=str(tmp_path / "preset-dir")))
    warm_up(preset, device="cpu", progress=False).rollout.close()
    warm_up(preset, device="cpu", progress=False, cache_dir=str(tmp_path / "given")).rollout.close()
    assert seen == [str(tmp_path / "preset-dir"), str(tmp_path / "given")]


def test_numba_disk_cache_reaches_every_kernel(tmp_path):
    # Seven kernels exist at import; the glue and merge kernels are made per
    # configuration on first use, after the cache was enabled: those must be reached too.
    code = (
        "import os, sys\n"
        "from framekv.ops import _launch, adaln, merge_split_kv, qk_norm_rope\n"
        f"d = {str(tmp_path / 'numba')!r}\n"
        "assert _launch.enable_disk_cache(d)\n"
        "assert os.environ['NUMBA_CACHE_DIR'] == d and len(_launch._KERNELS) == 7\n"
        "qk_norm_rope._kernel((12, 12, 128, True, False, True, True, False, False, 30, 52,"
        " 22, 43, True))\n"
        "adaln._kernel(adaln._VEC, 1536, 192)\n"
        "merge_split_kv._kernel(3, 3, 12, 16, 1560, False)\n"
        "assert len(_launch._KERNELS) == 10\n"
        "for k in _launch._KERNELS:\n"
        "    c = k._dispatcher._cache\n"
        "    assert type(c).__name__ == 'CUDACache', c\n"
        "    assert c._cache_path.startswith(d), c._cache_path\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
