"""framekv: a CUDA-graph runtime for autoregressive video diffusion.

The root of the installed package (``package/`` in the repository, mapped to
``framekv`` by pyproject.toml's ``package-dir``); its floors are the subpackages
``framekv.specs``, ``ops``, ``graphs``, ``engine``, ``bench`` and ``tools``
(docs/DESIGN.md, "Map"). Importing it imports none of them, nor anything else until
``__version__`` is read.

``framekv.__version__`` is the installed distribution's version (its metadata, as
``pip show framekv`` says), or, where the metadata is missing (the folders put on
``sys.path`` by hand), the ``version`` of the pyproject.toml beside this folder, or
``"0+unknown"``.
"""
from __future__ import annotations

import functools

__all__ = ["__version__"]


def __getattr__(name: str):
    if name == "__version__":
        return _version()
    raise AttributeError(f"module 'framekv' has no attribute {name!r}")


@functools.cache
def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("framekv")
    except metadata.PackageNotFoundError:
        return _source_version()


def _source_version() -> str:
    import pathlib
    import tomllib

    path = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        project = tomllib.loads(path.read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "0+unknown"
    return str(project.get("version", "0+unknown")) if project.get("name") == "framekv" \
        else "0+unknown"
