"""The command line's conventions: ``--version`` and ``framekv.__version__``, a preset
given as PRESET or ``--preset`` to every command, help read from the registries, every
``python -m framekv.bench.NAME`` saying in one line that it needs a CUDA GPU, and the
LICENSE that pyproject names."""
from __future__ import annotations

import importlib.metadata as md
import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
import torch

import framekv
from framekv.bench import __doc__ as BENCH_DOC
from framekv.engine.attention import BACKENDS
from framekv.specs import list_presets
from framekv.tools.bench import SECTIONS
from framekv.tools.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH_DIR = pathlib.Path(framekv.bench.__path__[0])
#: Arguments each command needs besides its preset (generate's --out is checked writable).
PRESET_COMMANDS = {"demo": [], "verify": [], "warmup": [], "bench": [], "serve": [],
                   "generate": ["--prompt", "p", "--chunks", "1", "--out", "{tmp}/v.mp4"]}
#: The preset each command runs when given none (warmup: none, then an error).
DEFAULT_PRESET = {"demo": None, "verify": None, "warmup": None, "bench": "seed-bench",
                  "generate": None, "serve": None}
BACKEND_COMMANDS = ("demo", "verify", "warmup")
#: ``python -m framekv.bench.NAME`` modules, found in their sources.
RUNNABLE = sorted(f.stem for f in BENCH_DIR.glob("*.py")
                  if 'if __name__ == "__main__":' in f.read_text())
#: Runnable modules that run on a CPU: they skip the no-GPU check.
RUNS_ON_CPU: frozenset[str] = frozenset({"serve_load", "cluster", "swap_model"})


def help_text(command: str, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping: "wan-1.3b" stays whole
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


# ----------------------------------------------------------------------------- the version
def test_version_flag_prints_the_metadata_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"framekv {md.version('framekv')}\n"


def test_dunder_version_is_the_metadata_version():
    assert framekv.__version__ == md.version("framekv")
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", framekv.__version__)
    assert "__version__" in framekv.__all__


def test_version_without_metadata_falls_back_to_pyproject(monkeypatch):
    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "version", missing)
    framekv._version.cache_clear()
    try:
        beside = pathlib.Path(framekv.__file__).resolve().parent.parent / "pyproject.toml"
        want = (tomllib.loads(beside.read_text())["project"]["version"] if beside.is_file()
                else "0+unknown")
        assert framekv.__version__ == want
    finally:
        framekv._version.cache_clear()


def test_version_and_parser_import_no_torch():
    code = ("import sys\nfrom framekv.tools.cli import build_parser\n"
            "p = build_parser()\ntry:\n    p.parse_args(['--version'])\n"
            "except SystemExit as exc:\n    assert exc.code == 0\n"
            "p.parse_args(['warmup', '--preset', 'tiny'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"framekv {framekv.__version__}\n"


# ------------------------------------------------------------------ help from the registries
@pytest.mark.parametrize("preset", list_presets())
@pytest.mark.parametrize("command", sorted(PRESET_COMMANDS))
def test_every_preset_help_lists_every_shipped_preset(command, preset, capsys, monkeypatch):
    assert preset in help_text(command, capsys, monkeypatch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("command", BACKEND_COMMANDS)
def test_every_backend_help_lists_every_registered_backend(command, backend, capsys,
                                                           monkeypatch):
    line = next(ln for ln in help_text(command, capsys, monkeypatch).splitlines()
                if ln.lstrip().startswith("--backend"))
    assert backend in line


@pytest.mark.parametrize("section", SECTIONS)
def test_bench_help_and_package_doc_list_every_section(section, capsys, monkeypatch):
    assert section in help_text("bench", capsys, monkeypatch)
    assert re.search(rf"\b{section}\b", BENCH_DOC.split("Modules run as")[0])


def test_an_unregistered_backend_is_a_usage_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--backend", "nope"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--backend" in err and "'nope'" in err
    assert all(repr(name) in err for name in BACKENDS)


# ------------------------------------------------------------------ PRESET or --preset
def parse(command: str, argv: list[str], tmp_path):
    extra = [a.format(tmp=tmp_path) for a in PRESET_COMMANDS[command]]
    return build_parser().parse_args([command, *argv, *extra])


@pytest.mark.parametrize("argv", [["tiny"], ["--preset", "tiny"], ["--device", "cpu", "tiny"],
                                  ["tiny", "--device", "cpu"], ["tiny", "--preset", "tiny"]])
@pytest.mark.parametrize("command", sorted(PRESET_COMMANDS))
def test_a_preset_is_positional_or_an_option(command, argv, tmp_path):
    if command == "bench":  # bench has no --device
        argv = [a for a in argv if a not in ("--device", "cpu")]
    assert parse(command, argv, tmp_path).preset == "tiny"


@pytest.mark.parametrize("command", sorted(PRESET_COMMANDS))
def test_without_a_preset_the_default_holds(command, tmp_path):
    assert parse(command, [], tmp_path).preset == DEFAULT_PRESET[command]


@pytest.mark.parametrize("argv", [["tiny", "--preset", "wan-1.3b"],
                                  ["--preset", "wan-1.3b", "tiny"],
                                  ["--preset", "tiny", "--preset", "wan-1.3b"]])
@pytest.mark.parametrize("command", sorted(PRESET_COMMANDS))
def test_two_different_presets_are_a_usage_error(command, argv, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(command, argv, tmp_path)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "expected the same preset or none" in err
    assert "'tiny'" in err and "'wan-1.3b'" in err


def test_warmup_without_a_preset_says_it_needs_one(capsys):
    assert main(["warmup", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "PRESET (or --preset) is required" in err and "got none" in err
    assert all(name in err for name in list_presets())


def test_warmup_takes_the_preset_as_an_option_on_cpu(capsys):
    assert main(["warmup", "--preset", "tiny", "--device", "cpu", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith("warm-up of tiny:")


# -------------------------------------------------------- python -m framekv.bench.NAME
#: Runs each module as ``python -m`` does (runpy, as __main__) with argv[1], in one process
#: (one torch import for all), and writes {name: {code, stdout, stderr}} to argv[2].
_DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
argv, names, path = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
results = {}
for name in names:
    module, out, err, code = f"framekv.bench.{name}", io.StringIO(), io.StringIO(), 0
    sys.argv = [module, *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if isinstance(exc.code, str):
            err.write(exc.code + "\n")
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    results[name] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
with open(path, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory):
    """{"help": results of ``--help``, "bare": results without arguments (the modules
    that need a GPU: the others would run their measurement), "process": the one real
    ``python -m`` run}, the three run as parallel processes."""
    folder = tmp_path_factory.mktemp("bench_runs")
    procs = {kind: subprocess.Popen([sys.executable, "-c", _DRIVER, json.dumps(argv),
                                     json.dumps(names), str(folder / f"{kind}.json")],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for kind, argv, names in (("help", ["--help"], RUNNABLE),
                                       ("bare", [], sorted(set(RUNNABLE) - RUNS_ON_CPU)))}
    procs["process"] = subprocess.Popen([sys.executable, "-m", "framekv.bench.graphs"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
    outs = {kind: p.communicate(timeout=300) for kind, p in procs.items()}
    runs = {kind: json.loads((folder / f"{kind}.json").read_text()) for kind in ("help", "bare")}
    runs["process"] = {"code": procs["process"].returncode, "stdout": outs["process"][0],
                       "stderr": outs["process"][1]}
    return runs


def test_the_runnable_modules_are_found():
    assert len(RUNNABLE) >= 14 and {"commit", "ulysses", "wan"} <= set(RUNNABLE)


@pytest.mark.parametrize("name", RUNNABLE)
def test_bench_module_help_works_and_the_package_doc_names_it(name, bench_runs):
    run = bench_runs["help"][name]
    assert run["code"] == 0 and run["stdout"].startswith("usage:"), run["stderr"]
    assert re.search(rf"^\s+{name}\s", BENCH_DOC, re.MULTILINE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
@pytest.mark.parametrize("name", sorted(set(RUNNABLE) - RUNS_ON_CPU))
def test_bench_module_without_cuda_says_so_in_one_line(name, bench_runs):
    run = bench_runs["bare"][name]
    assert run["code"] == 2 and "Traceback" not in run["stderr"], run["stderr"]
    assert run["stderr"].splitlines() == [run["stderr"].strip()]
    assert run["stderr"].startswith(f"python -m framekv.bench.{name}: needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_a_real_python_dash_m_run_without_cuda_exits_2_in_one_line(bench_runs):
    run = bench_runs["process"]
    assert run["code"] == 2 and run["stdout"] == "", run["stderr"]
    assert run["stderr"].count("\n") == 1 and "needs a CUDA GPU" in run["stderr"]


# ----------------------------------------------------------------------------- the license
def test_license_is_apache_2_and_pyproject_names_it():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "Copyright 2026 framekv authors" in text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
