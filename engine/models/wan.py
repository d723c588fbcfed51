"""The ``wan-diffusers`` model family: diffusers' Wan transformer, loaded by
`WanPipeline` (a shipped config with random weights, a diffusers folder, or an
original-layout generator checkpoint), rolled out by `WanRollout`.

It takes every model option: ``config`` (`WanFamily.configs`) or ``weights``,
``checkpoint``, ``sampler`` (with its options) and ``shift`` (a checkpoint samples as
Self-Forcing does unless they say otherwise), ``steps``, ``decoder`` (``wan``, ``tiny``
or ``tiny:PATH``, `framekv.engine.wan.decoders`), ``kv_dtype`` and ``gemm_dtype``; the
preset defaults to the config's (`PRESETS`). Its text encoder is the source's; its
decoders are the Wan VAE's and the tiny TAEHV one, and its encoders those that follow
them (`build_encoder`): frames come in through the latent space they go out of.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib

from ..samplers import VIDEO_SAMPLER, build_sampler, check_strength
from ..samplers.v2v import BASES
from ..wan.decoders import DECODERS, SPATIAL_SCALE, check_decoder
from ..wan.model import WanChunks
from ..wan.pipeline import WanPipeline, load_sizes, sampling
from .family import MODEL_OPTIONS, LoadedModel, ModelFamily, ModelOptions, spelled

__all__ = ["WanFamily", "WanParts"]


class WanFamily(ModelFamily):
    """diffusers' Wan transformer (module doc). ``configs`` are those a command offers
    (`framekv.engine.wan.CONFIGS` also has 14b, whose random weights take about 28 GiB)."""

    title = "diffusers' Wan transformer (needs the wan extra)"
    configs = ("tiny", "1.3b")
    default_config = "tiny"
    options = frozenset(MODEL_OPTIONS)
    decoders = encoders = DECODERS

    def check(self, options: ModelOptions, names=None) -> None:
        """A ValueError for a config it does not ship or a decoder choice that is none
        (`check_decoder`: a tiny checkpoint that is not there); the rest is
        `WanPipeline.load`'s, before it reads any weight."""
        super().check(options, names)
        check_decoder(options.decoder or "wan", options.weights,
                      name=spelled(names, "decoder"))

    def load(self, options: ModelOptions, *, device=None, text_encoder: bool | None = None,
             decode: bool = True) -> "WanParts":
        """`WanPipeline.load` of ``options``: the VAE with ``decode`` (True: the source
        must have one), the text encoder as ``text_encoder`` asks."""
        self.check(options)
        o = options
        pipe = WanPipeline.load(None if o.weights else (o.config or self.default_config),
                                weights=o.weights, checkpoint=o.checkpoint, preset=o.preset,
                                sampler=o.sampler, sampler_options=o.sampler_options,
                                shift=o.shift, steps=o.steps,
                                device=device, text_encoder=text_encoder, vae=decode,
                                decoder=o.decoder or "wan")
        return WanParts(self, options, pipe)

    def label(self, options: ModelOptions) -> str:
        """``NAME:CONFIG`` or ``NAME:FOLDER`` (the weights folder's name), then
        ``+FILE`` (the checkpoint's file name) if any."""
        o = options
        which = pathlib.Path(o.weights).name if o.weights else o.config or self.default_config
        return (f"{self.name}:{which}"
                + (f"+{pathlib.Path(o.checkpoint).name}" if o.checkpoint else ""))

    def decoder(self, kind: str, path=None, *, model: "WanParts", sequences=None,
                use_graphs: bool | None = None):
        """The Wan VAE's `StreamingVAEDecoder` (``wan``) or a `TinyStreamingDecoder`
        (``tiny``, ``path`` its checkpoint or None: random) of ``model``'s pipeline."""
        self._check_kind("decoder", kind, self.decoders)
        return model.pipeline.decoder(sequences, use_graphs=use_graphs, choice=(kind, path))

    def encoder(self, kind: str, path=None, *, model: "WanParts", sequences=None,
                use_graphs: bool | None = None):
        """The encoder that follows decoder ``kind``: the Wan VAE's `StreamingVAEEncoder`
        or the `TinyStreamingEncoder` of the same checkpoint (`build_encoder`)."""
        self._check_kind("encoder", kind, self.encoders)
        return model.pipeline.encoder(sequences, use_graphs=use_graphs, choice=(kind, path))

    def decoder_title(self, kind: str, path=None) -> str:
        """"Wan VAE decoder", or the tiny decoder and its weights."""
        return _coder_title("decoder", kind, path)

    def encoder_title(self, kind: str, path=None) -> str:
        """"Wan VAE encoder", or the tiny encoder and its weights."""
        return _coder_title("encoder", kind, path)

    def video_chunks(self, options: ModelOptions) -> tuple[int, tuple[int, int]]:
        """The preset's chunk frames and its latent size x `SPATIAL_SCALE` (`load_sizes`:
        only configs read)."""
        F, (H, W) = self._sizes(options)[:2]
        return F, (SPATIAL_SCALE * H, SPATIAL_SCALE * W)

    def video_options(self, options: ModelOptions, strength: float) -> ModelOptions:
        """The ``v2v`` sampler, its base the sampler ``options`` run (their own, else
        Euler, or Self-Forcing's with a checkpoint: `sampling`), over their steps."""
        check_strength(strength)
        if options.sampler == VIDEO_SAMPLER or options.sampler_options:
            given = options.sampler_options or options.sampler
            raise ValueError(f"sampler: a video input samples with {VIDEO_SAMPLER} over the "
                             f"sampler given (one of {list(BASES)}, with no options), got "
                             f"{given!r}")
        _, _, how = self._sizes(options)
        video = {"base": how["sampler"], "strength": float(strength)}
        # over the schedule load builds it on: a strength that runs no step is named here
        build_sampler(VIDEO_SAMPLER, how["timesteps"], WanChunks.timestep_scale, video)
        return dataclasses.replace(options, sampler=VIDEO_SAMPLER, sampler_options=video)

    def _sizes(self, options: ModelOptions):
        """(frames per chunk, latent size, `sampling`) of ``options``, nothing built."""
        self.check(options)
        o = options
        sizes = load_sizes(None if o.weights else (o.config or self.default_config),
                           weights=o.weights, checkpoint=o.checkpoint, preset=o.preset)
        how = sampling(sizes["timesteps"], checkpoint=o.checkpoint is not None,
                       sampler=o.sampler, shift=o.shift, steps=o.steps)
        return sizes["frames_per_chunk"], tuple(sizes["latent_size"]), how


class WanParts(LoadedModel):
    """diffusers' Wan, loaded: a `WanPipeline` (transformer, text encoder, VAE or None,
    the sizes and sampling) as a scheduler's factories. Called ``(sequences=N,
    batch_sizes=...)`` it builds the pipeline's `WanRollout` (which encodes text);
    `decoder` is a scheduler's ``decoder_factory``."""

    def __init__(self, family: WanFamily, options: ModelOptions, pipeline: WanPipeline):
        super().__init__(family, options, device=pipeline.device,
                         text_encoder=pipeline.text_encoder,
                         decoder_choice=pipeline.decoder_choice, title=_title(pipeline, options))
        self.pipeline = pipeline

    model = property(lambda self: self.pipeline.transformer, doc="The transformer.")
    vae = property(lambda self: self.pipeline.vae, doc="The VAE, or None.")
    sizes = property(lambda self: self.pipeline.sizes, doc="`preset_sizes` of the preset.")
    kv_dtype = property(lambda self: self.options.kv_dtype, doc="Its rollouts' K/V pool.")
    gemm_dtype = property(lambda self: self.options.gemm_dtype, doc="Its blocks' GEMMs.")

    def rollout(self, **kwargs):
        """The pipeline's `WanRollout` (`WanPipeline.rollout`) with the options' pool and
        GEMMs; ``kwargs`` add to or replace them."""
        return self.pipeline.rollout(**{"kv_dtype": self.kv_dtype,
                                        "gemm_dtype": self.gemm_dtype, **kwargs})

    def decoder(self, rows: int | None = None, *, use_graphs: bool | None = None):
        """The pipeline's streaming decoder of its choice, ``rows`` rows (default 1); on
        CUDA with graphs (``use_graphs`` None: `use_graphs`), every batch of 1 to
        ``rows`` captured in both stages up front (a server captures before it serves)."""
        dec = super().decoder(rows, use_graphs=self.use_graphs if use_graphs is None
                              else use_graphs)
        return self._captured(dec, rows, tuple(self.sizes["latent_size"]))

    def encoder(self, rows: int | None = None, *, use_graphs: bool | None = None):
        """The streaming encoder that follows the decoder choice, ``rows`` rows (default
        1); captured up front as `decoder` is, for frames of the model's video size."""
        enc = super().encoder(rows, use_graphs=self.use_graphs if use_graphs is None
                              else use_graphs)
        h, w = self.sizes["latent_size"]
        return self._captured(enc, rows, (SPATIAL_SCALE * h, SPATIAL_SCALE * w))

    def _captured(self, coder, rows: int | None, size: tuple[int, int]):
        """``coder`` with every batch of 1 to ``rows`` captured (both stages, chunks of
        the preset's frames at ``size``) where it runs graphs."""
        if coder.use_graphs:
            for b in range(1, (rows or 1) + 1):
                coder.capture(b, self.sizes["frames_per_chunk"], size)
        return coder


def _coder_title(part: str, kind: str, path) -> str:
    if kind == "wan":
        return f"Wan VAE {part}"
    return f"tiny {part} ({'random weights' if path is None else path})"


def _title(pipe: WanPipeline, options: ModelOptions) -> str:
    """"Wan NAME (SOURCE)": the config, or the weights folder's name; random weights or
    the folder, and the checkpoint."""
    weights, checkpoint = options.weights, options.checkpoint
    name = pipe.config_name or os.path.basename(os.path.normpath(weights))
    source = f"weights {weights}" if weights is not None else "random weights"
    return f"Wan {name} ({source}" + (f", checkpoint {checkpoint})" if checkpoint else ")")
