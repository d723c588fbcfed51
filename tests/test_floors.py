"""The floors of the package: which subpackage may import which, no import cycle between
files, and no file grown past what one reader takes in.

    specs, ops     the bottom: data and device primitives (ops may read specs)
    graphs         capture and replay over static buffers (specs, ops)
    engine         the cache, attention, model, rollout (graphs and below)
    bench          measurements (the engine and below)
    tools          the command line (everything)

Every ``import`` and ``from ... import`` of every module counts, function-level ones
included, relative ones resolved; a package face (``__init__``) is a module like any
other, so importing through it counts as importing it.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ALLOWED = {
    "specs": {"specs"},
    "ops": {"ops", "specs"},
    "graphs": {"graphs", "ops", "specs"},
    "engine": {"engine", "graphs", "ops", "specs"},
    "bench": {"bench", "engine", "graphs", "ops", "specs"},
    "tools": {"tools", "bench", "engine", "graphs", "ops", "specs"},
    "client": {"client", "tools", "bench", "engine", "graphs", "ops", "specs"},
}
#: Lines a file may hold before its module docstring must say why it is one file.
MAX_LINES = 400


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """``framekv.<package>.<...>`` -> file, for every module of every floor."""
    out = {}
    for pkg in ALLOWED:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out["framekv." + ".".join(parts)] = f
    return out


def _package_of(name: str, f: pathlib.Path) -> list[str]:
    parts = name.split(".")
    return parts if f.name == "__init__.py" else parts[:-1]


def imports(name: str, f: pathlib.Path, mods: dict) -> set[str]:
    """The framekv modules ``name`` imports (each resolved to a module of ``mods``)."""
    out = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = _package_of(name, f)[:len(_package_of(name, f)) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
            if any(f"{base}.{a.name}" in mods for a in node.names):
                targets = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
        else:
            continue
        for t in targets:
            while t.startswith("framekv.") and t not in mods:
                t = t.rsplit(".", 1)[0]
            if t in mods and t != name:
                out.add(t)
    return out


def violations(root: pathlib.Path) -> list[str]:
    """Every upward import and every cycle, one line each."""
    mods = modules(root)
    edges = {name: imports(name, f, mods) for name, f in mods.items()}
    bad = []
    for name, targets in edges.items():
        floor = name.split(".")[1]
        for t in sorted(targets):
            if t.split(".")[1] not in ALLOWED[floor]:
                bad.append(f"{mods[name].relative_to(root)} imports {t}: {floor} may import only "
                           f"{sorted(ALLOWED[floor])}")
    return bad + cycles(edges)


def cycles(edges: dict[str, set[str]]) -> list[str]:
    """Each import cycle once, as ``a -> b -> a`` (depth-first, white/grey/black)."""
    state, stack, found = {}, [], []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if state.get(v) == 1:
                found.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for u in sorted(edges):
        if u not in state:
            visit(u)
    return [f"cycle: {c}" for c in found]


def long_files(root: pathlib.Path) -> list[str]:
    """Files over MAX_LINES lines whose module docstring does not say why (a line
    starting ``One file:``)."""
    out = []
    for f in modules(root).values():
        n = len(f.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(f.read_text())) or ""
        if n > MAX_LINES and not any(ln.startswith("One file:") for ln in doc.splitlines()):
            out.append(f"{f.relative_to(root)}: {n} lines")
    return out


def test_no_import_runs_upward_and_no_file_cycle():
    assert violations(ROOT) == []


def test_files_stay_short_or_say_why():
    assert long_files(ROOT) == []


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for pkg in ALLOWED:
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").touch()
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.mark.parametrize("files, want", [
    ({"graphs/a.py": "def f():\n    from framekv.engine import b\n", "engine/b.py": ""},
     ["graphs/a.py imports framekv.engine.b: graphs may import only"]),
    ({"specs/a.py": "import framekv.ops.k\n", "ops/k.py": ""},
     ["specs/a.py imports framekv.ops.k: specs may import only"]),
    ({"engine/x/a.py": "from ..b import f\n", "engine/b.py": "from .x import a\n",
      "engine/x/__init__.py": ""},
     ["cycle: framekv.engine.b -> framekv.engine.x.a -> framekv.engine.b"]),
    ({"engine/x/__init__.py": "from .a import f\n", "engine/x/a.py": "from framekv.engine.x import g\n"},
     ["cycle: framekv.engine.x -> framekv.engine.x.a -> framekv.engine.x"]),
    ({"bench/a.py": "from framekv.engine import b\nfrom . import c\n", "engine/b.py": "",
      "bench/c.py": "import framekv.specs\n"}, []),
])
def test_the_check_finds_upward_imports_and_cycles(tmp_path, files, want):
    _write(tmp_path, files)
    got = violations(tmp_path)
    assert len(got) == len(want) and all(g.startswith(w) for g, w in zip(got, want)), got


def test_the_length_check_takes_a_stated_reason(tmp_path):
    body = "x = 1\n" * (MAX_LINES + 1)
    _write(tmp_path, {"ops/long.py": body,
                      "ops/said.py": '"""Kernels.\n\nOne file: one kernel and its reference."""\n'
                                     + body})
    assert long_files(tmp_path) == [f"ops/long.py: {MAX_LINES + 1} lines"]


def test_every_package_folder_is_installed():
    """pyproject lists packages one by one: a new sub-package missing there would be left
    out of a (non-editable) install. The root package `framekv` (its version) is the
    folder package-dir maps it to, and holds no floor."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {"framekv." + ".".join(f.parent.relative_to(ROOT).parts)
               for pkg in ALLOWED for f in (ROOT / pkg).rglob("__init__.py")}
    root = ROOT / setuptools["package-dir"]["framekv"]
    assert (root / "__init__.py").is_file() and not list(root.glob("*/__init__.py"))
    folders.add("framekv")
    assert folders - listed == set() and listed - folders == set()
