"""`WanPipeline`: one Wan model's parts, loaded one way for every command that runs one
(``framekv serve --model wan-diffusers``, ``framekv generate``, ``framekv demo --model
wan-diffusers``).

`WanPipeline.load` takes one of three sources and returns the transformer, the text
encoder, the VAE, the rollout's sizes and its sampling:

- ``config`` (the default, "tiny", when no ``weights``): a shipped name (`CONFIGS`) or a
  transformer config dict. Every part is random, seed 0, so that one config is one
  model; the text encoder and VAE are those of the shipped config the transformer
  matches (`TEXT_CONFIGS`, `VAE_CONFIGS`).
- ``weights``: a local diffusers folder (``transformer/``, ``vae/``, ``text_encoder/`` +
  ``tokenizer/``) and its parts. ``config`` and ``weights`` exclude each other.
- ``checkpoint``: a generator checkpoint file in the original Wan layout (Self-Forcing,
  CausVid; `load_model`) replacing the transformer. Its shape is that of the folder's
  ``transformer/`` (Wan 2.1 1.3B's for a folder without one), else ``config``'s; the
  text encoder and VAE come from the folder or the config as without it.

Sizes are ``preset``'s (`preset_sizes`), else those of the preset of the shipped config
the transformer's config matches (`PRESETS`); a transformer of no shipped config needs
``preset``. Sampling is Euler at the preset's timesteps; with a checkpoint it is
Self-Forcing's: the ``self_forcing`` sampler over the steps warped by shift
`SELF_FORCING_SHIFT` (`sampling`); ``sampler`` (any registered one,
`framekv.engine.samplers`, with its ``sampler_options``) and ``shift`` override
either, and ``steps`` runs N of the preset's steps (`pick_steps`).

``text_encoder`` and ``vae`` say which parts load: True (a source without one is an
error), None (where the source has one) or False (never). ``decoder`` picks the
streaming decoder `decoder` builds (`framekv.engine.wan.decoders`): "wan", the VAE; or
"tiny" / "tiny:PATH", a `TinyStreamingDecoder`, and then no Wan VAE loads; `encoder`
builds the encoder that follows the choice. Every argument, and what the folder holds,
is checked before any weights are read or built (only configs are read): a ValueError
naming the argument, the value expected and the value given. A checkpoint's contents
are checked as it loads (`load_model`). Nothing is downloaded.
"""
from __future__ import annotations

import dataclasses
import math
import os

import torch

from ..samplers import (DEFAULT_SAMPLER, GENERATOR_SAMPLER, build_sampler, pick_steps,
                        samplers)
from .decoders import build_decoder, build_encoder, check_decoder, read_tiny
from .model import WanChunks
from .rollout import WanRollout
from .setup import CONFIGS, PRESETS, build_model, preset_sizes
from .text import TEXT_CONFIGS, TextEncoder, has_text_encoder
from .vae import VAE_CONFIGS, build_vae, load_vae
from .weights import _model_config, load_model

__all__ = ["CHECKPOINT_SUFFIXES", "SELF_FORCING_SHIFT", "WanPipeline", "load_sizes", "sampling",
           "shipped_config"]

#: Self-Forcing's schedule: its denoising steps warped by this flow-matching shift.
SELF_FORCING_SHIFT = 5.0
#: The files a generator checkpoint may be (`framekv.engine.wan.weights.read_checkpoint`).
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".safetensors")
#: A checkpoint's shape when its folder has no transformer: `load_model`'s default.
_CHECKPOINT_SHAPE = "1.3b"


@dataclasses.dataclass
class WanPipeline:
    """A Wan model's parts (module doc), made by `load`.

    Attributes:
        transformer: the diffusers ``WanTransformer3DModel``.
        text_encoder: a `TextEncoder` whose ``max_tokens`` is the preset's
            ``prompt_tokens``, or None.
        vae: the diffusers ``AutoencoderKLWan``, or None.
        sizes: `preset_sizes` of the preset (its ``timesteps`` unshifted).
        sampler, timesteps: the rollout's sampling (`sampling`): the sampler's name and
            the model timesteps of its steps.
        sampler_options: the sampler's options (default none).
        config_name: the shipped config the transformer matches, or None.
        decoder_choice: ``(kind, path)`` of the streaming decoder (module doc; path None:
            the VAE, or random tiny weights).
        decoder_net: the tiny decoder's net `load` read from ``path`` before building
            anything (None: none read; `decoder` reads ``path`` then).
        dtype: the dtype the parts were asked in (None: each part's default).
    """

    transformer: torch.nn.Module
    text_encoder: TextEncoder | None
    vae: torch.nn.Module | None
    sizes: dict
    sampler: str = DEFAULT_SAMPLER
    timesteps: tuple[float, ...] = ()
    sampler_options: dict = dataclasses.field(default_factory=dict)
    config_name: str | None = None
    decoder_choice: tuple[str, str | None] = ("wan", None)
    dtype: torch.dtype | None = None
    decoder_net: torch.nn.Module | None = None

    @classmethod
    def load(cls, config=None, *, weights=None, checkpoint=None, preset=None,
             sampler: str | None = None, shift: float | None = None,
             text_encoder: bool | None = True, vae: bool | None = True, device=None,
             dtype=None, key: str | None = None, decoder: str = "wan",
             steps: int | None = None, sampler_options=None) -> "WanPipeline":
        """The parts of ``config``, ``weights`` and ``checkpoint`` (module doc) at the
        sizes of ``preset`` on ``device``, in ``dtype`` (default bf16 on CUDA, fp32 on
        the CPU; the modules diffusers keeps in fp32 stay fp32). ``key``: the
        checkpoint's entry holding the state dict (`load_model`). ValueError naming a
        bad argument, before any weights are read or built."""
        from framekv.ops import resolve_device

        config = _check_sources(config, weights, checkpoint)
        kind, tiny = check_decoder(decoder, weights)
        net = None if tiny is None else read_tiny(tiny)     # read before any model is built
        vae = vae if kind == "wan" else False
        _check_sampling(sampler, shift)
        _check_folder(weights, checkpoint, text_encoder=text_encoder, vae=vae)
        shape = _shape(config, weights, checkpoint)
        name = shipped_config(_model_config(shape))
        if weights is None:
            _check_random_parts(name, text_encoder=text_encoder, vae=vae)
        sizes = _sizes(preset, name)
        how = sampling(sizes["timesteps"], checkpoint=checkpoint is not None, sampler=sampler,
                       shift=shift, steps=steps)
        # the sampler built once over its schedule: a bad option is named before any part
        build_sampler(how["sampler"], how["timesteps"], WanChunks.timestep_scale,
                      sampler_options)
        dev = resolve_device(device)
        if checkpoint is not None:
            model = load_model(checkpoint, config=shape, key=key, dtype=dtype, device=dev)
        elif weights is not None:
            model = load_model(weights, dtype=dtype, device=dev)
        else:
            model = build_model(config, dtype=dtype, device=dev)
        text = _text_encoder(text_encoder, weights, name, sizes["prompt_tokens"], dev, dtype)
        decoder_vae = _vae(vae, weights, name, dev, dtype)
        return cls(model, text, decoder_vae, sizes, config_name=name,
                   decoder_choice=(kind, tiny), dtype=dtype, decoder_net=net,
                   sampler_options=dict(sampler_options or {}), **how)

    @property
    def device(self) -> torch.device:
        """Where the transformer is."""
        return next(self.transformer.parameters()).device

    def rollout_kwargs(self) -> dict:
        """`WanRollout` keywords: the sizes, the sampler and its timesteps (and its
        options, where it has any)."""
        options = {"sampler_options": dict(self.sampler_options)} if self.sampler_options else {}
        return {**self.sizes, "sampler": self.sampler, "timesteps": self.timesteps, **options}

    def rollout(self, **kwargs) -> WanRollout:
        """A `WanRollout` of the transformer with the text encoder at `rollout_kwargs`;
        ``kwargs`` (``sequences``, ``use_graphs``, ``guidance_scale``, ...) add to or
        replace them."""
        return WanRollout(self.transformer, **{"text_encoder": self.text_encoder,
                                               **self.rollout_kwargs(), **kwargs})

    def decoder(self, sequences: int | None = None, *, use_graphs: bool | None = None,
                choice: tuple[str, str | None] | None = None):
        """The streaming decoder of `decoder_choice` (or of ``choice``, a checked
        ``(kind, path)``) on the transformer's device, ``sequences`` rows (default one):
        a `StreamingVAEDecoder` of the VAE or a `TinyStreamingDecoder`; ``use_graphs``
        None: graphs on CUDA. ValueError for the Wan VAE's decoder without a VAE."""
        return self._coder(build_decoder, "decoder", choice, sequences, use_graphs)

    def encoder(self, sequences: int | None = None, *, use_graphs: bool | None = None,
                choice: tuple[str, str | None] | None = None):
        """The streaming encoder that follows `decoder_choice` (or ``choice``), frames in
        through the latent space the decoder's frames come out of (`build_encoder`): a
        `StreamingVAEEncoder` of the VAE or the `TinyStreamingEncoder` of the same tiny
        checkpoint; arguments as `decoder`'s."""
        return self._coder(build_encoder, "encoder", choice, sequences, use_graphs)

    def _coder(self, build, part: str, choice, sequences, use_graphs):
        kind, path = choice or self.decoder_choice
        if kind == "wan" and self.vae is None:
            raise ValueError(f"{part}() needs the VAE: load the pipeline with vae=True (or "
                             "None, from weights that hold one), got a pipeline without one")
        # the tiny decoder's net `load` read: its decoder half, of its own choice only
        same = part == "decoder" and (kind, path) == tuple(self.decoder_choice)
        return build(kind, path, vae=self.vae, sequences=sequences, use_graphs=use_graphs,
                     device=self.device, dtype=self.dtype,
                     latent_channels=self.transformer.config.out_channels,
                     net=self.decoder_net if same else None)


def load_sizes(config=None, *, weights=None, checkpoint=None, preset=None) -> dict:
    """`preset_sizes` of the rollout `WanPipeline.load` of these sources would run at,
    before anything is built or read but configs: ``preset``'s, else the preset of the
    shipped config the transformer matches. ValueError as `load` names a bad source (a
    folder without ``transformer/``, a preset a config of no shipped shape needs)."""
    config = _check_sources(config, weights, checkpoint)
    _check_folder(weights, checkpoint, text_encoder=False, vae=False)
    return _sizes(preset, shipped_config(_model_config(_shape(config, weights, checkpoint))))


def sampling(timesteps, *, checkpoint: bool = False, sampler: str | None = None,
             shift: float | None = None, steps: int | None = None) -> dict:
    """``{"sampler", "timesteps"}`` of a rollout at the model timesteps ``timesteps``:
    Euler over them as they are, or for a generator ``checkpoint`` as Self-Forcing
    samples (the ``self_forcing`` sampler, shift `SELF_FORCING_SHIFT`); ``sampler`` and
    ``shift`` override. Shift k warps each t = 1000 s to 1000 k s / (1 + (k - 1) s), as
    Self-Forcing warps its steps; shift 1 keeps them as they are. ``steps``: N of them
    run (`pick_steps`; None: all)."""
    _check_sampling(sampler, shift)
    k = float(shift if shift is not None else (SELF_FORCING_SHIFT if checkpoint else 1.0))
    ts = tuple(float(t) for t in timesteps)
    if k != 1.0:
        ts = tuple(1000.0 * k * (t / 1000.0) / (1.0 + (k - 1.0) * (t / 1000.0)) for t in ts)
    return {"sampler": sampler or (GENERATOR_SAMPLER if checkpoint else DEFAULT_SAMPLER),
            "timesteps": pick_steps(ts, steps)}


def shipped_config(values) -> str | None:
    """The shipped config (`CONFIGS`) whose every value the transformer config
    ``values`` (a mapping) shares, or None."""
    def same(a, b) -> bool:
        return list(a) == list(b) if isinstance(b, (tuple, list)) and a is not None else a == b

    return next((name for name, want in CONFIGS.items()
                 if all(same(values.get(k), v) for k, v in want.items())), None)


def _check_sources(config, weights, checkpoint):
    """``config`` as loaded (default "tiny" without ``weights``); ValueError for a bad
    or missing source."""
    if weights is not None:
        if config is not None:
            raise ValueError(f"config and weights both give the transformer: pass one, got "
                             f"config={config!r} and weights={os.fspath(weights)!r}")
        if not os.path.isdir(weights):
            raise ValueError(f"weights must be a local diffusers folder, got "
                             f"{os.fspath(weights)!r} (not a folder; nothing is downloaded)")
    elif config is None:
        config = "tiny"
    elif not (isinstance(config, dict) or (isinstance(config, str) and config in CONFIGS)):
        raise ValueError(f"config must be one of {sorted(CONFIGS)} or a transformer config "
                         f"dict, got {config!r}")
    if checkpoint is not None:
        path = os.fspath(checkpoint)
        if not os.path.isfile(path) or not path.lower().endswith(CHECKPOINT_SUFFIXES):
            why = "no such file" if not os.path.isfile(path) else "not one of those"
            raise ValueError(f"checkpoint must be a generator checkpoint file "
                             f"({', '.join(CHECKPOINT_SUFFIXES)}), got {path!r} ({why})")
    return config


def _check_sampling(sampler, shift) -> None:
    """ValueError for a sampler or a shift that is not one."""
    if sampler is not None and sampler not in samplers():
        raise ValueError(f"sampler must be one of {list(samplers())}, got {sampler!r}")
    if shift is not None and (isinstance(shift, bool) or not isinstance(shift, (int, float))
                              or not 0 < shift < math.inf):
        raise ValueError(f"shift must be a number > 0, got {shift!r}")


def _shape(config, weights, checkpoint):
    """What gives the transformer's config: the folder, a checkpoint's default shape,
    or ``config``."""
    if weights is None:
        return config
    if checkpoint is not None and not os.path.isdir(os.path.join(weights, "transformer")):
        return _CHECKPOINT_SHAPE
    return weights


def _check_folder(weights, checkpoint, *, text_encoder, vae) -> None:
    """ValueError for a part flag that is not one, or for what the folder ``weights``
    lacks of the parts it must hold (all of them named at once)."""
    for arg, value in (("text_encoder", text_encoder), ("vae", vae)):
        if not any(value is v for v in (True, None, False)):  # 1 == True: by identity
            raise ValueError(f"{arg} must be True, None or False, got {value!r}")
    if weights is None:
        return
    need = [("transformer/", os.path.join(weights, "transformer"))] * (checkpoint is None)
    need += [("vae/", os.path.join(weights, "vae"))] * (vae is True)
    need += [("text_encoder/ + tokenizer/", None)] * (text_encoder is True)
    missing = [part for part, path in need
               if not (os.path.isdir(path) if path else has_text_encoder(weights))]
    if missing:
        raise ValueError(f"weights {os.fspath(weights)!r} must be a local diffusers Wan "
                         f"folder holding {', '.join(p for p, _ in need)}; it lacks "
                         f"{', '.join(missing)}")


def _check_random_parts(name, *, text_encoder, vae) -> None:
    """ValueError for a random part asked for (True) of a config that matches no
    shipped one: only those have a text encoder and a VAE to draw."""
    for arg, value, table in (("text_encoder", text_encoder, TEXT_CONFIGS),
                              ("vae", vae, VAE_CONFIGS)):
        if value is True and name not in table:
            raise ValueError(f"{arg}=True needs a shipped config to draw a random one of: "
                             f"the transformer's config must match one of {sorted(table)}, "
                             f"got one that matches none (pass {arg}=None or False)")


def _sizes(preset, name) -> dict:
    """``preset``'s sizes, else those of the shipped config ``name``'s preset."""
    if preset is None:
        if name not in PRESETS:
            raise ValueError(f"preset must be given: the transformer's config matches no "
                             f"shipped config {sorted(PRESETS)}, so no default sizes apply; "
                             f"got preset=None")
        preset = PRESETS[name]
    return preset_sizes(preset)


def _text_encoder(want, weights, name, max_tokens, device, dtype) -> TextEncoder | None:
    """The folder's text encoder, or the shipped config's random one, as ``want`` asks."""
    if want is False:
        return None
    if weights is not None:
        return (TextEncoder.from_pretrained(weights, max_tokens=max_tokens, dtype=dtype,
                                            device=device)
                if has_text_encoder(weights) else None)
    return (TextEncoder.from_config(name, max_tokens=max_tokens, dtype=dtype, device=device)
            if name in TEXT_CONFIGS else None)


def _vae(want, weights, name, device, dtype):
    """The folder's VAE, or the shipped config's random one, as ``want`` asks."""
    if want is False:
        return None
    if weights is not None:
        return (load_vae(weights, dtype=dtype, device=device)
                if os.path.isdir(os.path.join(weights, "vae")) else None)
    return build_vae(name, dtype=dtype, device=device) if name in VAE_CONFIGS else None
