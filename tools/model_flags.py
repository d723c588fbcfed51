"""The model flags, declared once and checked once, for every command that runs a model
(demo, generate, serve and its cluster, warmup).

`model_parent` is the argparse parent that declares them: ``--model`` (a family of
`framekv.engine.models`, the choices read from its registry when checked or printed,
so a family registered in the process is a ``--model`` value), ``--config`` or
``--weights``, ``--checkpoint``, ``--sampler``, ``--shift``, ``--steps``,
``--decoder``, ``--kv-dtype`` and ``--fp8-gemm``; a command leaves out those it has no
use for. `checked_model` checks them against the family before anything is built
(`framekv.engine.models.check_model`): a flag the family does not take is named with
the families that take it, as a one-line error. `model_options` is what the flags ask
for, as `ModelOptions`; `loaded_model` the model its family loads from them, as a
server's factories.

Building a parser imports no engine: the defaults here are the parser's copies of the
engine's (`DEFAULT_MODEL`, `TEXT_MODEL`, `SELF_FORCING_SHIFT`).
"""
from __future__ import annotations

import argparse

from .args import (add_fp8_gemm_argument, add_kv_dtype_argument, gemm_dtype_of, kv_dtype_of,
                   positive_int, positive_number)
from .conventions import (CONFIG_NAMES, MODEL_NAMES, SAMPLER_NAMES, STEPS_HELP, CommandParser,
                          load_preset_arg)

__all__ = ["DEFAULT_MODEL", "FLAGS", "SELF_FORCING_SHIFT", "TEXT_MODEL", "checked_model",
           "loaded_model", "model_options", "model_parent", "wan_factory"]

#: The parser's copies of `framekv.engine.models.DEFAULT_MODEL` (what a command runs
#: unless told) and `TEXT_MODEL` (what ``framekv generate`` runs unless told).
DEFAULT_MODEL = "reference"
TEXT_MODEL = "wan-diffusers"
#: The parser's copy of `framekv.engine.wan.pipeline.SELF_FORCING_SHIFT`: Self-Forcing's
#: schedule, its denoising steps warped by this flow-matching shift.
SELF_FORCING_SHIFT = 5.0
#: How the command line spells each model option (and the family) in a message.
FLAGS = {"model": "--model", "preset": "PRESET", "config": "--config",
         "weights": "--weights", "checkpoint": "--checkpoint", "sampler": "--sampler",
         "shift": "--shift", "steps": "--steps", "decoder": "--decoder",
         "kv_dtype": "--kv-dtype", "gemm_dtype": "--fp8-gemm"}


def _add_checkpoint(p) -> None:
    p.add_argument("--checkpoint", metavar="FILE", default=None,
                   help="a generator checkpoint (.pt/.pth/.safetensors, the original Wan "
                        "layout: Self-Forcing, CausVid) replacing the transformer's weights; "
                        "its shape, VAE and text encoder from --weights, else random ones of "
                        "--config")


def _add_sampler(p) -> None:
    p.add_argument("--sampler", choices=SAMPLER_NAMES, metavar="NAME", default=None,
                   help="the sampler, one of %(choices)s (euler: Euler steps, the default; "
                        "self_forcing: x0, then fresh noise, the default with --checkpoint)")


def _add_shift(p) -> None:
    p.add_argument("--shift", type=positive_number, default=None,
                   help=f"timestep shift of the preset's steps (default {SELF_FORCING_SHIFT} "
                        "with --checkpoint, as Self-Forcing samples; else 1)")


def _add_steps(p) -> None:
    p.add_argument("--steps", type=positive_int, default=None, metavar="N", help=STEPS_HELP)


def _add_decoder(p) -> None:
    p.add_argument("--decoder", metavar="wan|tiny[:PATH]", default=None,
                   help="frames by the Wan VAE (default), or by the tiny TAEHV decoder of "
                        "PATH (taew2_1.pth/.safetensors; default the one in --weights, "
                        "random weights with --config)")


#: The flags a command may leave out (`model_parent`'s ``skip``), each declared once.
_OPTIONAL = {"checkpoint": _add_checkpoint, "sampler": _add_sampler, "shift": _add_shift,
             "steps": _add_steps, "decoder": _add_decoder, "kv_dtype": add_kv_dtype_argument,
             "gemm_dtype": add_fp8_gemm_argument}


def model_parent(default: str = DEFAULT_MODEL, *, skip=()) -> argparse.ArgumentParser:
    """The argparse parent of the model flags (module doc), ``--model`` defaulting to
    ``default``; ``skip``: flags a command has no use for, by option name (checkpoint,
    sampler, shift, steps, decoder, kv_dtype, gemm_dtype; ``--model``, ``--config`` and
    ``--weights`` are always there). A new parent each call: a command's defaults stay
    its own (argparse shares a parent's actions with every child)."""
    unknown = set(skip) - set(_OPTIONAL)
    if unknown:
        raise ValueError(f"skip must name flags of {sorted(_OPTIONAL)}, got {sorted(unknown)}")
    p = CommandParser(add_help=False)
    p.add_argument("--model", choices=MODEL_NAMES, metavar="NAME", default=default,
                   help=f"the model family, one of %(choices)s (default {default}): the "
                        "reference DiT of PRESET, diffusers' Wan transformer (needs the wan "
                        "extra), or one registered in the process (framekv.engine.models)")
    # default None, not the family's: argparse sees a value equal to the default as
    # absent, so "--config tiny --weights DIR" would pass the exclusive group
    source = p.add_mutually_exclusive_group()
    source.add_argument("--config", choices=CONFIG_NAMES, metavar="CONFIG", default=None,
                        help="a shipped config of the model family, random weights: "
                             "%(choices)s (default the family's: tiny)")
    source.add_argument("--weights", metavar="DIR", default=None,
                        help="a local folder of the family's weights (a diffusers folder: "
                             "transformer, VAE, text encoder and tokenizer)")
    for name, add in _OPTIONAL.items():
        if name not in skip:
            add(p)
    return p


def model_options(args: argparse.Namespace):
    """The `ModelOptions` the flags in ``args`` ask for (a flag a command does not take,
    or left at its default, is None)."""
    from framekv.engine.models import ModelOptions

    return ModelOptions(
        preset=getattr(args, "preset", None), config=getattr(args, "config", None),
        weights=getattr(args, "weights", None), checkpoint=getattr(args, "checkpoint", None),
        sampler=getattr(args, "sampler", None), shift=getattr(args, "shift", None),
        steps=getattr(args, "steps", None), decoder=getattr(args, "decoder", None),
        kv_dtype=kv_dtype_of(args), gemm_dtype=gemm_dtype_of(args))


def checked_model(args: argparse.Namespace):
    """``(family, options, preset)`` of ``args``' model flags, checked before anything is
    built: a family with a default preset has PRESET loaded here (``preset``, its
    `Preset`; None for a family whose preset follows its weights, which checks it as it
    loads), then `check_model`. ValueError naming the flag (`PresetError` for PRESET)."""
    from framekv.engine.models import check_model, get_model

    options = model_options(args)
    default = get_model(args.model).default_preset
    preset = None if default is None else load_preset_arg(options.preset or default)
    return check_model(args.model, options, names=FLAGS), options, preset


def loaded_model(args: argparse.Namespace, *, use_graphs: bool = True, decode: bool = True,
                 device=None, model: str | None = None):
    """The `LoadedModel` the family ``model`` (default ``args.model``) loads from the
    flags in ``args`` (`ModelFamily.load`, after `check_model`), as a server's
    factories: called ``(sequences=N, batch_sizes=...)`` it builds a runner with
    ``args.cache_dir`` and ``use_graphs``; its ``decoder`` is a scheduler's
    ``decoder_factory`` (``decode``: what it needs is loaded), its ``encoder`` an
    ``encoder_factory``; ``args.video_strength`` (where set) samples video to video at
    that strength (`ModelFamily.video_options`). ``device``: default ``args.device``. ValueError for a bad option, before anything is built."""
    from framekv.engine.models import check_model

    options = model_options(args)
    family = check_model(model or args.model, options, names=FLAGS)
    if getattr(args, "video_strength", None) is not None:    # video in: the v2v sampler
        options = family.video_options(options, args.video_strength)
    loaded = family.load(options, decode=decode,
                         device=getattr(args, "device", None) if device is None else device)
    loaded.cache_dir, loaded.use_graphs = getattr(args, "cache_dir", None), use_graphs
    return loaded


def wan_factory(args: argparse.Namespace, *, use_graphs: bool = True, decode: bool = True):
    """`loaded_model` of diffusers' Wan (`TEXT_MODEL`), whatever ``args.model`` says: its
    `WanParts` (the pipeline, the transformer, the VAE or None)."""
    return loaded_model(args, use_graphs=use_graphs, decode=decode, model=TEXT_MODEL)
