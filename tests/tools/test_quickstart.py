"""The README's quick start as a newcomer runs it: a ``git clone`` of this repository (its
committed tree) into a temporary folder, a new venv without the system's packages, then
the quick start's commands as README.md writes them, from the clone's root, and every
other install command the README gives (``bash scripts/install.sh cluster``).

The test suite the second command runs is collected, not run (``--collect-only``
after ``bash scripts/test.sh``): CI runs it whole (.ci/run), and collecting it imports
every test module, so every package a test needs must have come with the test extra.
What install.sh says of torch must be what it did (its CPU build where one is at hand).

Marked ``slow`` (torch, the test extra and Ray installed into a new venv: minutes);
.ci/run runs it once, as part of the plain suite (scripts/test.sh).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import readme_harness as rh

pytestmark = pytest.mark.slow


def quick_start() -> list[str]:
    """The quick start's commands, then the README's other installs, in README order."""
    blocks = rh.blocks()
    first = [c for b in blocks if b.section == "Quick start" for c in rh.commands(b)]
    rest = [c for b in blocks if b.section != "Quick start" and b.lang == "bash"
            and not b.needs for c in rh.commands(b) if rh.is_install(c)]
    return first + rest


def fresh_env(venv) -> dict:
    """A shell of the new venv: its bin first on PATH, nothing of this process's
    environment that would point Python elsewhere."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHON", "VIRTUAL_ENV", "FRAMEKV_TOKEN"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def test_the_quick_start_runs_in_a_fresh_venv_from_a_clean_clone(tmp_path):
    if shutil.which("git") is None or not (rh.ROOT / ".git").exists():
        pytest.skip("needs git and this repository's history to clone")
    commands = quick_start()
    assert commands[:2] == ["bash scripts/install.sh && framekv demo",
                            "bash scripts/install.sh test && bash scripts/test.sh"]
    clone, venv = tmp_path / "framekv", tmp_path / "venv"
    subprocess.run(["git", "clone", "-q", str(rh.ROOT), str(clone)], check=True, timeout=300)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env, outputs = fresh_env(venv), []
    for command in commands:
        if command.endswith("bash scripts/test.sh"):
            command += " --collect-only"             # CI runs the suite; here it imports
        out = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True,
                             text=True, timeout=1200)
        assert out.returncode == 0, f"{command}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
        outputs.append(out.stdout)
    demo, suite = outputs[0], outputs[1]
    assert "graphs vs eager: max abs error" in demo and " ok " in demo, demo
    assert "tests collected" in suite and "simulator suite exit 0" in suite, suite[-2000:]
    # run in the venv's folder: in tmp_path the clone's folder, framekv/, would be
    # imported as a namespace package before the installed one
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import framekv, torch; print(framekv.__file__); "
                            "print(torch.__version__)"],
                           capture_output=True, text=True, check=True, cwd=venv, env=env)
    package, torch_version = where.stdout.split()
    assert package.startswith(str(clone))                       # the clone, installed
    assert "no torch found, installing torch's CPU build torch==2.13.0+cpu" in demo, demo
    fell_back = "no CPU build of torch 2.13.0 at hand" in demo     # then it says so
    assert torch_version.endswith("+cpu") != fell_back, (torch_version, demo)
