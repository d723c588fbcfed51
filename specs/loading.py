"""Reading and writing specs: JSON, TOML, shipped presets.

Decoding runs each struct's ``__post_init__``, so a file is held to the same rules as
a constructor call. Errors from files name the file and the field path, e.g.
``tiny.toml: ModelSpec.tokens_per_page must be a power of two, got 48 - at `$.model```.
"""
from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from .preset import Preset

T = TypeVar("T")

#: File suffixes ``load`` understands.
SUFFIXES: tuple[str, ...] = (".toml", ".json")

_PRESET_DIR = "presets"


def encode_json(spec: Any, *, indent: int = 2) -> bytes:
    """A spec (or any msgspec-encodable value) as JSON; ``indent=0`` for one line."""
    data = msgspec.json.encode(spec)
    return msgspec.json.format(data, indent=indent) if indent else data


def decode_json(data: bytes | str, type: type[T]) -> T:
    """Decode JSON into ``type``.

    Raises msgspec.ValidationError (a ValueError) naming the field path when the data
    breaks a rule, msgspec.DecodeError (also a ValueError) when it is not JSON.
    """
    return msgspec.json.decode(data, type=type)


def decode_toml(data: bytes | str, type: type[T]) -> T:
    """Decode TOML into ``type``; errors as for ``decode_json``."""
    return msgspec.toml.decode(data, type=type)


def _decode(data: bytes, suffix: str, type: type[T], source: str) -> T:
    decode = decode_toml if suffix == ".toml" else decode_json
    try:
        return decode(data, type)
    except (msgspec.MsgspecError, ValueError) as exc:
        # msgspec already names the field path; add the file so the user knows where.
        raise ValueError(f"{source}: {exc}") from exc


def load(path: str | os.PathLike, type: type[T]) -> T:
    """Read a ``.toml`` or ``.json`` file into the spec struct ``type``.

    Raises:
        FileNotFoundError: the file does not exist (the message names the path).
        ValueError: the suffix is not ``.toml``/``.json``, or the contents are not valid
            for ``type`` (the message names the file, the field path and the rule).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{path}: spec files must end in {' or '.join(SUFFIXES)}, "
                         f"got {path.suffix or 'no suffix'!r}")
    if not path.is_file():
        raise FileNotFoundError(f"spec file not found: {path}")
    return _decode(path.read_bytes(), suffix, type, str(path))


def _preset_files() -> dict[str, Any]:
    # importlib.resources rather than __file__, so presets load from any installation.
    folder = importlib.resources.files(__package__).joinpath(_PRESET_DIR)
    return {entry.name[: -len(".toml")]: entry for entry in folder.iterdir()
            if entry.name.endswith(".toml")}


def list_presets() -> list[str]:
    """Names of the presets shipped with framekv, sorted."""
    return sorted(_preset_files())


def _looks_like_path(name_or_path: str | os.PathLike) -> bool:
    if not isinstance(name_or_path, str):
        return True
    # Preset names may hold dots ("wan-1.3b"), so only a known suffix or a separator
    # marks a path.
    return (name_or_path.lower().endswith(SUFFIXES)
            or "/" in name_or_path or os.sep in name_or_path)


def load_preset(name_or_path: str | os.PathLike) -> Preset:
    """A shipped preset by name (see ``list_presets``), or a preset file by path.

    Raises:
        ValueError: an unknown name (the message lists the shipped presets), or an
            invalid file (the message names the file and the field).
        FileNotFoundError: a path that does not exist.
    """
    if _looks_like_path(name_or_path):
        return load(name_or_path, Preset)
    files = _preset_files()
    if name_or_path not in files:
        raise ValueError(f"unknown preset {name_or_path!r}; available: "
                         f"{', '.join(sorted(files))}")
    source = f"preset {name_or_path!r} ({_PRESET_DIR}/{name_or_path}.toml)"
    return _decode(files[name_or_path].read_bytes(), ".toml", Preset, source)
