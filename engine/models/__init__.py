"""framekv.engine.models: model families by name, the one place a ``--model`` value
becomes a model.

A family (`ModelFamily`) says what its models are before anything is built (shipped
configs, its default preset, the model options it takes, its decoders and encoders)
and loads one (`ModelFamily.load` -> `LoadedModel`): the runner over its chunk model
(`LoadedModel.rollout`, a scheduler's ``runner_factory``), its text encoder or None,
its streaming decoder and encoder by kind. ``framekv demo``, ``generate``, ``serve``
(a cluster's replicas too) and ``warmup`` build their model from it; no other module
branches on a family's name.

``reference`` (`ReferenceFamily`, the default): the reference DiT of a preset, weights
drawn from the preset's seed; it takes ``steps``, ``kv_dtype`` and ``gemm_dtype``, and
shows its latents as pictures. ``wan-diffusers`` (`WanFamily`): diffusers' Wan
transformer through `WanPipeline` (a shipped config with random weights, a diffusers
folder, an original-layout checkpoint), its text encoder, its VAE's or the tiny
decoder and the encoder that follows that choice; it takes every model option.

`register_model(name, family)` adds one: from then on ``--model NAME`` (choices read
from here when checked or printed), `get_model`, `check_model` and every command take
it. `check_model` is the one check of options against a family: an option the family
does not take is named with the families that take it, in one line.
"""
from __future__ import annotations

import re

from framekv.specs.checks import check_choice

from .family import (MODEL_OPTIONS, PREVIEW, LoadedModel, ModelFamily, ModelOptions,
                     spelled)
from .reference import ReferenceFamily, ReferenceModel
from .wan import WanFamily, WanParts

__all__ = ["DEFAULT_MODEL", "MODEL_OPTIONS", "PREVIEW", "TEXT_MODEL", "LoadedModel",
           "ModelFamily", "ModelOptions", "ReferenceFamily", "ReferenceModel", "WanFamily",
           "WanParts", "check_model", "get_model", "model_configs", "models",
           "register_model", "unregister_model"]

#: The family a command runs unless told otherwise.
DEFAULT_MODEL = "reference"
#: The family a text prompt runs on unless told otherwise (``framekv generate``).
TEXT_MODEL = "wan-diffusers"
_BUILT_IN = (DEFAULT_MODEL, TEXT_MODEL)
_REGISTRY: dict[str, ModelFamily] = {}
#: a name: lower case, digits, "-" or "_" after a letter (a --model value, the head of
#: a server's model label "NAME:...")
_NAME = re.compile(r"[a-z][a-z0-9_-]*")


def register_model(name: str, family: ModelFamily) -> None:
    """Make ``family`` (a `ModelFamily`) the model family ``name`` (and its ``name``):
    ``--model NAME`` and every command take it from then on. ValueError for a name that
    is not lower case letters, digits, "-" and "_" after a letter or is taken, or a
    ``family`` that is not a `ModelFamily` or is registered under another name."""
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ValueError(f"name must be lower case letters, digits, '-' or '_' after a "
                         f"letter (it is a --model value), got {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"model family {name!r} is registered already "
                         f"(unregister_model({name!r}) first)")
    if not isinstance(family, ModelFamily):
        raise ValueError(f"family must be a ModelFamily, got {type(family).__name__}")
    if family.name not in ("", name):
        raise ValueError(f"family is registered already as {family.name!r}, got {name!r}")
    family.name = name
    _REGISTRY[name] = family


def unregister_model(name: str) -> None:
    """Forget the model family ``name``; ValueError for one not registered or built in."""
    if name in _BUILT_IN:
        raise ValueError(f"name must not be a built-in model family {list(_BUILT_IN)}, "
                         f"got {name!r}")
    _REGISTRY.pop(check_choice("name", name, models())).name = ""


def models() -> tuple[str, ...]:
    """The registered families' names, in the order they were registered."""
    return tuple(_REGISTRY)


def get_model(name: str) -> ModelFamily:
    """The family registered as ``name``; ValueError naming the registered ones for any
    other."""
    return _REGISTRY[check_choice("model", name, models())]


def model_configs() -> tuple[str, ...]:
    """Every registered family's shipped configs, each once (``--config`` choices)."""
    return tuple(dict.fromkeys(c for family in _REGISTRY.values() for c in family.configs))


def check_model(name: str, options: ModelOptions, *, names=None) -> ModelFamily:
    """The family ``name`` once ``options`` suit it: every option given is one it takes
    (else a ValueError naming them, the families that take them all and what this one
    takes), then its own `ModelFamily.check`. ``names`` spells options and "model" in
    messages (a command's flags; default the keywords). Nothing is read or built."""
    family = get_model(name)
    foreign = [o for o in options.given() if o not in family.options]
    if foreign:
        model = spelled(names, "model")
        takers = [n for n in models() if set(foreign) <= _REGISTRY[n].options]
        where = f"{model} {' or '.join(takers)}" if takers else "a family that takes them"
        takes = ", ".join(spelled(names, o) for o in MODEL_OPTIONS if o in family.options)
        raise ValueError(f"{', '.join(spelled(names, o) for o in foreign)}: only with "
                         f"{where} (the {name} model family takes "
                         f"{takes or 'no model option'}), got {model} {name}")
    family.check(options, names)
    return family


register_model(DEFAULT_MODEL, ReferenceFamily())
register_model(TEXT_MODEL, WanFamily())
