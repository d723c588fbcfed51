"""The conventions every command follows, in one place.

A preset is given the same way to every command that runs one (demo, verify, warmup,
bench, generate, serve): as the command's one positional argument or as ``--preset``, so
``framekv warmup tiny`` and ``framekv warmup --preset tiny`` are the same command.
Giving both is allowed only when they name the same preset.

Help names what a registry holds, read from the registry, so that a new preset, backend
or bench section shows up in every help without an edit here: the shipped presets
(`framekv.specs.list_presets`), the attention backends
(`framekv.engine.attention.BACKENDS`) and the samplers
(`framekv.engine.samplers.samplers`, a sampler registered at run time included), the
model families and their configs (`framekv.engine.models.models`, likewise), each read
only when a help is printed or a value checked (importing the engine imports torch),
and the bench sections (`framekv.tools.bench.SECTIONS`). ``--steps N`` means
the same to every command that takes it (`STEPS_HELP`).

A command whose options are all checked before it builds anything (serve, generate)
reports a bad one in one line, ``framekv COMMAND: error: ...``, with exit status 2
(`one_line_errors`); every command reports an error it meets as it runs the same way
(`fail`).

Options are taken only as spelled: no parser takes an abbreviation (``--chunk`` is not
``--chunks``), and a command's unknown argument is its own usage error, not the top
level's (`CommandParser`).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

#: The namespace attribute that remembers which of PRESET / --preset set the preset.
_PRESET_SOURCE = "_preset_given_as"


def version_line() -> str:
    """What ``framekv --version`` prints: ``framekv X.Y.Z``."""
    import framekv

    return f"framekv {framekv.__version__}"


def preset_names() -> list[str]:
    """The shipped presets' names, sorted (`framekv.specs.list_presets`)."""
    from framekv.specs import list_presets

    return list_presets()


def preset_help(note: str | None = None) -> str:
    """Help for a preset argument: every shipped preset by name, and ``note`` (its
    default, say) in parentheses."""
    text = f"a preset: {', '.join(preset_names())}, or a .toml/.json preset file"
    return text + (f" ({note})" if note else "")


class PresetError(ValueError):
    """PRESET names neither a readable preset file nor a shipped preset."""


def load_preset_arg(name: str):
    """The `Preset` PRESET names (a file path or a shipped preset's name).

    Raises `PresetError` saying what PRESET was taken for and why it failed.
    """
    from framekv import specs

    if not _is_path(name):
        try:
            return specs.load_preset(name)
        except ValueError as exc:
            raise PresetError(f"PRESET must be a preset name or a .toml/.json preset file: "
                              f"{exc}") from exc
    try:
        return specs.load(name, specs.Preset)
    except FileNotFoundError as exc:
        raise PresetError(f"PRESET: preset file not found: {name}") from exc
    except ValueError as exc:
        raise PresetError(f"PRESET: not a preset file: {exc}") from exc
    except OSError as exc:                   # a folder, no permission
        raise PresetError(f"PRESET: cannot read the preset file {name}: "
                          f"{exc.strerror or exc}") from exc


def _is_path(name: str) -> bool:
    # Preset names may hold dots ("wan-1.3b"): only a spec suffix or a separator makes
    # PRESET a path (the rule `framekv.specs.load_preset` uses).
    return name.lower().endswith((".toml", ".json")) or "/" in name or os.sep in name


class CommandParser(argparse.ArgumentParser):
    """The parser of ``framekv`` and of each of its commands: no abbreviated long option
    is taken (``allow_abbrev`` is off), and a command's parser reports an argument it
    does not know as its own error (``framekv demo: error: unrecognized arguments: ...``
    after demo's usage), where argparse would print the top level's usage."""

    def __init__(self, *args, allow_abbrev: bool = False, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", _SubcommandParser)
        return super().add_subparsers(**kwargs)


class _SubcommandParser(CommandParser):
    """A command's parser (`CommandParser`): what is left over is its own usage error."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


def fail(command: str, exc: BaseException, status: int = 2) -> int:
    """Print ``exc`` as ``framekv COMMAND: error: MESSAGE`` on stderr (its white space
    runs as single spaces: one line), each of its notes on a line of its own after it;
    returns ``status``."""
    notes = "".join(f"\n  {note}" for note in getattr(exc, "__notes__", ()))
    print(f"framekv {command}: error: {' '.join(str(exc).split())}{notes}", file=sys.stderr)
    return status


def one_line_errors(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``p`` with its usage errors as one line on stderr, ``PROG: error: MESSAGE`` (the
    option, what it takes, what it got), exit status 2: no usage block, so a script or
    a log sees exactly the reason. ``PROG --help`` still prints the usage."""
    def error(message: str):
        p.exit(2, f"{p.prog}: error: {' '.join(message.split())}\n")
    p.error = error
    return p


class RegistryNames(Sequence):
    """A registry's names, read at each use (a membership test, iteration), so that a
    parser can offer them as ``choices`` without importing the registry when built,
    and a name registered after it was built is among them."""

    def __init__(self, load: Callable[[], Sequence[str]]):
        self._load = load

    @property
    def _names(self) -> tuple[str, ...]:
        return tuple(self._load())

    def __getitem__(self, index):
        return self._names[index]

    def __len__(self) -> int:
        return len(self._names)


def _backend_registry() -> Sequence[str]:
    from framekv.engine.attention.registry import BACKENDS

    return BACKENDS


#: The attention backends `framekv.engine.attention.get_backend` takes.
BACKEND_NAMES = RegistryNames(_backend_registry)


def _sampler_registry() -> Sequence[str]:
    from framekv.engine.samplers import named_samplers

    return named_samplers()


#: The samplers a command may name (``--sampler``; `framekv.engine.samplers.named_samplers`).
SAMPLER_NAMES = RegistryNames(_sampler_registry)


def _model_registry() -> Sequence[str]:
    from framekv.engine.models import models

    return models()


def _config_registry() -> Sequence[str]:
    from framekv.engine.models import model_configs

    return model_configs()


#: The model families `framekv.engine.models.get_model` takes (``--model``).
MODEL_NAMES = RegistryNames(_model_registry)
#: Every registered family's shipped configs (``--config``; which family takes which is
#: `framekv.engine.models.check_model`'s to say).
CONFIG_NAMES = RegistryNames(_config_registry)
#: ``--steps N``: which N of a preset's S denoising steps run
#: (`framekv.engine.samplers.pick_steps`).
STEPS_HELP = ("run N of the preset's S denoising steps, N in 1..S: those at indices "
              "floor(i*S/N) for i = 0..N-1, evenly spaced and always the first (default: "
              "all S)")


def add_backend_argument(p: argparse.ArgumentParser, default: str) -> None:
    """``--backend NAME``, one of the registered attention backends (checked at parse
    time; the help lists them). ``default`` says what None picks."""
    p.add_argument("--backend", choices=BACKEND_NAMES, metavar="NAME", default=None,
                   help=f"attention backend: %(choices)s (default: {default})")


class _PresetAction(argparse.Action):
    """Stores PRESET or ``--preset``; the two naming different presets is a usage error."""

    def __call__(self, parser, namespace, value, option_string=None):
        given_as = option_string or "PRESET"
        earlier = getattr(namespace, _PRESET_SOURCE, None)
        current = getattr(namespace, self.dest, None)
        if earlier is not None and current != value:
            parser.error(f"{given_as}: {earlier} already names {current!r}; expected the "
                         f"same preset or none, got {value!r}")
        setattr(namespace, _PRESET_SOURCE, given_as)
        setattr(namespace, self.dest, value)


def add_preset_arguments(p: argparse.ArgumentParser, default: str | None,
                         note: str | None = None) -> None:
    """PRESET (an optional positional) and ``--preset PRESET``, both into
    ``args.preset`` (``default`` when neither is given). The help lists the shipped
    presets and ``note`` (default: "default DEFAULT")."""
    note = note or (f"default {default}" if default else None)
    p.add_argument("preset", metavar="PRESET", nargs="?", default=argparse.SUPPRESS,
                   action=_PresetAction, help=preset_help(note))
    p.add_argument("--preset", dest="preset", metavar="PRESET", default=default,
                   action=_PresetAction, help="the same as PRESET, as an option")
