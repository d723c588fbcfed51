"""The command line's refusals, each one line (or the command's own usage) and a clear
exit status, before anything is built: no abbreviated option is taken and an unknown one
is the command's usage error; Ctrl-C ends `generate` and `serve` with one line and 130;
`serve` (one server and a cluster) refuses a port in use and a missing extra before a
model is built; the cluster's temporary state folder; `scripts/install.sh` does what it
says about torch.
"""
from __future__ import annotations

import argparse
import ast
import os
import pathlib
import signal
import socket
import subprocess
import sys

import pytest

from framekv.bench.serve_load import free_port, stop_server, wait_serving
from framekv.tools.cli import build_parser, main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def parsers(p: argparse.ArgumentParser):
    """``p`` and every command parser under it."""
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from parsers(sub)


# ------------------------------------------------------------------ abbreviations, usage
def test_no_parser_takes_an_abbreviation():
    found = list(parsers(build_parser()))
    assert len(found) >= 10 and all(not p.allow_abbrev for p in found)


def test_every_argument_parser_in_the_sources_refuses_abbreviations():
    """`python -m framekv.bench.NAME`, `framekv bench` and the examples build their own."""
    calls = []
    for folder in ("bench", "tools", "examples"):
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "ArgumentParser"):
                    kw = {k.arg: k.value for k in node.keywords}
                    ok = isinstance(kw.get("allow_abbrev"), ast.Constant) and \
                        kw["allow_abbrev"].value is False
                    calls.append((f.relative_to(ROOT), ok))
    assert len(calls) >= 20 and [c for c in calls if not c[1]] == []


@pytest.mark.parametrize("argv, unknown", [
    (["demo", "--chunk", "3"], "--chunk"),          # once taken for --chunks
    (["demo", "--steps", "3"], "--steps"),
    (["verify", "--tol", "1"], "--tol"),
    (["warmup", "tiny", "--dev", "cpu"], "--dev cpu"),
])
def test_an_unknown_option_is_the_commands_usage_error(argv, unknown, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.startswith(f"usage: framekv {argv[0]} "), err           # its usage, not the top's
    assert err.rstrip().endswith(f"framekv {argv[0]}: error: unrecognized arguments: {unknown}")


@pytest.mark.parametrize("argv, unknown", [
    (["serve", "--max-sess", "2"], "--max-sess"),
    (["generate", "--prompt", "a", "--out", "x.mp4", "--chunks", "1", "--loop"], "--loop"),
    (["cluster", "replicas", "--ur", "http://h"], "--ur http://h"),
])
def test_a_one_line_command_says_so_in_one_line(argv, unknown, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    name = " ".join(argv[:2] if argv[0] == "cluster" else argv[:1])
    assert exc.value.code == 2
    assert err == f"framekv {name}: error: unrecognized arguments: {unknown}\n"


# -------------------------------------------------------------------------- Ctrl-C
def _interrupted(proc, tail: str) -> str:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.splitlines()[-1] == tail, err
    return err


def test_ctrl_c_during_generate_is_one_line_and_leaves_no_file(tmp_path):
    pytest.importorskip("av")
    proc = subprocess.Popen([sys.executable, "-m", "framekv.tools.cli", "generate", "--prompt",
                             "a cat", "--chunks", "500", "--out", "long.mp4"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not proc.stderr.readline().startswith("generate ["):     # chunks being written
        assert proc.poll() is None, proc.stderr.read()
    _interrupted(proc, "framekv generate: interrupted")
    assert os.listdir(tmp_path) == []                               # no video, no .part


def test_ctrl_c_on_serve_drains_then_is_one_line(tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    port = free_port()
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "framekv.tools.cli", "serve", "tiny",
                                 "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serving(proc, lambda: httpx.get(f"{url}/health").status_code == 200,
                     log.name, 300)
        sid = httpx.post(f"{url}/v1/sessions", json={"seed": 1}).json()["id"]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        stop_server(proc, 30)
    err = (tmp_path / "serve.log").read_text()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert err.splitlines()[-1] == "framekv serve: interrupted", err
    assert "Application shutdown complete" in err and sid not in err


# ------------------------------------------------------------- serve: port, extra
@pytest.fixture
def nothing_built(monkeypatch, tmp_path):
    """Building a scheduler or starting Ray fails the test; temporary folders in tmp_path."""
    from framekv.tools.cluster import command as cluster
    from framekv.tools.serve import command as serve

    def built(*a, **k):
        raise AssertionError("built before the refusal")
    monkeypatch.setattr(serve, "build_scheduler", built)
    monkeypatch.setattr(cluster, "start_ray", built)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("cluster", [[], ["--replicas", "2", "--device", "cpu",
                                          "--checkpoint-every", "1"]])
def test_a_port_in_use_is_refused_before_anything_is_built(nothing_built, capsys, cluster):
    pytest.importorskip("fastapi")
    if cluster:
        pytest.importorskip("ray.serve")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["serve", "--port", str(port), *cluster]) == 2
    err = capsys.readouterr().err
    assert err == (f"framekv serve: error: --port {port}: cannot listen on 127.0.0.1:{port}, "
                   "in use by another process: stop it or give another --port\n")
    assert os.listdir(nothing_built) == []            # the cluster's state folder went too


@pytest.mark.parametrize("argv, missing, extra", [
    (["serve"], "fastapi", "serve"),
    (["serve", "--replicas", "2", "--device", "cpu"], "fastapi", "cluster"),
    (["serve", "--replicas", "2", "--device", "cpu"], "ray.serve", "cluster"),
])
def test_a_missing_extra_is_named_before_anything_is_built(nothing_built, capsys, monkeypatch,
                                                          argv, missing, extra):
    monkeypatch.setitem(sys.modules, missing, None)          # import fails as if not there
    assert main([*argv, "--port", "0"]) == 2
    err = capsys.readouterr().err
    package = {"fastapi": "fastapi", "ray.serve": "ray[serve]"}[missing]
    assert err == (f"framekv serve: error: the server needs the {extra} extra: pip install "
                   f"'framekv[{extra}]' (missing: {package})\n")


def test_a_local_cluster_keeps_its_sessions_in_a_temporary_folder_removed_at_exit(tmp_path,
                                                                                   monkeypatch):
    """``--checkpoint-every`` on a local cluster needs no ``--state-dir``."""
    import contextlib

    from framekv.tools.cluster.command import _cluster_args

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    args = build_parser().parse_args(["serve", "--replicas", "2", "--device", "cpu",
                                      "--checkpoint-every", "1"])
    with contextlib.ExitStack() as stack:
        args, options = _cluster_args(args, stack)
        state = pathlib.Path(args.state_dir)
        assert state.parent == tmp_path and state.name.startswith("framekv-sessions-")
        (state / "session.fkv").write_bytes(b"written at a replica's stop")
    assert os.listdir(tmp_path) == []
    joined = build_parser().parse_args(["serve", "--replicas", "2", "--ray-address", "auto",
                                        "--checkpoint-every", "1"])
    with pytest.raises(ValueError, match="--checkpoint-every needs --state-dir"):
        _cluster_args(joined, contextlib.ExitStack())   # another host reads no folder here


# ------------------------------------------------------------------ scripts/install.sh
_PYTHON = """#!/bin/bash
# python3 for install.sh: no torch; pip records what it installs, and finds torch's
# CPU build only where FOUND_CPU is 1
echo "$*" >> "$CALLS"
case "$*" in
  "-c import torch"*) exit 1 ;;
  *"torch==2.13.0+cpu"*) [ "$FOUND_CPU" = 1 ] ;;
  *) exit 0 ;;
esac
"""


@pytest.mark.parametrize("found_cpu", [True, False])
def test_install_says_which_torch_it_installs(tmp_path, found_cpu):
    stub = tmp_path / "python"
    stub.write_text(_PYTHON)
    stub.chmod(0o755)
    calls = tmp_path / "calls"
    out = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh")], capture_output=True,
                         text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": str(stub), "CALLS": str(calls),
                              "FOUND_CPU": "1" if found_cpu else "0"})
    assert out.returncode == 0, out.stderr
    torch = [c for c in calls.read_text().splitlines() if "pip install" in c and "torch==" in c]
    if found_cpu:
        assert torch == ["-m pip install -q torch==2.13.0+cpu"]
        assert out.stdout.startswith("framekv: no torch found, installing torch's CPU build "
                                     "torch==2.13.0+cpu\n")
        assert "CUDA" not in out.stdout
    else:
        assert torch == ["-m pip install -q torch==2.13.0+cpu", "-m pip install -q torch==2.13.0"]
        assert ("no CPU build of torch 2.13.0 at hand; installing torch==2.13.0 from the "
                "package index instead (on Linux x86-64, the CUDA build)") in out.stdout
    assert calls.read_text().splitlines()[-1] == "-m pip install -q -e ."


def test_the_address_check_refuses_a_port_in_use_and_an_unknown_host():
    from framekv.tools.serve.preflight import check_address

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(ValueError, match="in use"):
            check_address("127.0.0.1", held.getsockname()[1])
    check_address("127.0.0.1", 0)
    with pytest.raises(ValueError, match="--host 'no.such.host.invalid'"):
        check_address("no.such.host.invalid", 8000)


# ------------------------------------------------------- python -m framekv.bench.cluster
@pytest.fixture
def no_cluster(monkeypatch):
    """The bench's cluster start fails the test; the host has 16 GiB free."""
    from framekv.bench import cluster

    def started(*a, **k):
        raise AssertionError("a cluster started")
    monkeypatch.setattr(cluster, "cluster", started)
    monkeypatch.setattr("framekv.engine.memory.free_bytes", lambda device: 16 * 2**30)
    return cluster


def test_the_cluster_bench_as_written_measures_what_fits_the_cpu(no_cluster):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the defaults of a host without a GPU")
    p = argparse.Namespace(presets=None, device=None)
    device, presets = no_cluster.resolve(p)
    assert (device.type, presets) == ("cpu", ["tiny"])


def test_the_cluster_bench_refuses_a_preset_that_does_not_fit_before_starting(no_cluster,
                                                                              capsys):
    assert no_cluster.main(["--presets", "tiny,small-stream", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m framekv.bench.cluster: error: preset 'small-stream' (2 "
                          "replicas of 8 sessions) needs about ") and err.count("\n") == 1
    assert "and cpu has 16.00 GiB free" in err
