"""``framekv serve --model wan-diffusers``: the Wan parts as the scheduler's factories
(`WanParts`, built by `wan_factory` from the command's options)."""
from __future__ import annotations

import dataclasses
import typing

from ..args import gemm_dtype_of, kv_dtype_of

if typing.TYPE_CHECKING:
    from framekv.engine.wan.pipeline import WanPipeline


@dataclasses.dataclass
class WanParts:
    """``--model wan-diffusers``: a loaded `WanPipeline` (transformer, text encoder, VAE
    or None: latents only, the rollout's sizes and sampling) as the scheduler's
    factories. Called ``(sequences=N, batch_sizes=...)`` it builds the scheduler's
    runner (the pipeline's `WanRollout`, which encodes text); `decoder` is the
    scheduler's ``decoder_factory``. ``backend``: the rollout's attention backend
    (default: the device's, `default_backend`); ``kv_dtype``: its K/V pool
    (`WanRollout`'s: None the model's dtype, or "fp8"); ``gemm_dtype``: its blocks'
    GEMMs (None, or "fp8")."""

    pipeline: "WanPipeline"
    cache_dir: str | None = None
    use_graphs: bool = True
    backend: str | None = None
    kv_dtype: str | None = None
    gemm_dtype: str | None = None

    model = property(lambda self: self.pipeline.transformer, doc="The transformer.")
    text_encoder = property(lambda self: self.pipeline.text_encoder, doc="Its TextEncoder.")
    vae = property(lambda self: self.pipeline.vae, doc="The VAE, or None.")
    sizes = property(lambda self: self.pipeline.sizes, doc="`preset_sizes` of the preset.")

    def __call__(self, *, sequences: int, batch_sizes):
        return self.pipeline.rollout(cache_dir=self.cache_dir, use_graphs=self.use_graphs,
                                     sequences=sequences, batch_sizes=batch_sizes,
                                     backend=self.backend, kv_dtype=self.kv_dtype,
                                     gemm_dtype=self.gemm_dtype)

    def decoder(self, slots: int):
        """The pipeline's streaming decoder (the Wan VAE's or the tiny one, `--decoder`),
        one row per pool slot; on CUDA with graphs,
        every batch of 1 to ``slots`` rows captured in both stages up front."""
        dec = self.pipeline.decoder(slots, use_graphs=self.use_graphs)
        if dec.use_graphs:
            for b in range(1, slots + 1):
                dec.capture(b, self.sizes["frames_per_chunk"], self.sizes["latent_size"])
        return dec


def wan_factory(args, *, use_graphs: bool = True, decode: bool = True) -> WanParts:
    """The `WanParts` of ``--model wan-diffusers`` (`WanPipeline.load`): ``--config``'s
    transformer, text encoder (its built-in tokenizer) and, with ``decode``, VAE, all
    random; or those of the diffusers folder ``--weights`` (its text encoder where it
    has one); the transformer's weights those of ``--checkpoint`` if given, sampled by
    ``--sampler`` at ``--shift`` (default Self-Forcing's with a checkpoint), ``--steps``
    of the preset's steps; at the sizes of ``--preset`` (default: the preset of the
    shipped config the transformer matches), prompts of the preset's ``prompt_tokens``,
    the pool of ``--kv-dtype``, the GEMMs of ``--fp8-gemm``, frames by ``--decoder``.
    ValueError for a bad option, before anything is built."""
    from framekv.engine.wan.pipeline import WanPipeline

    weights = getattr(args, "weights", None)
    pipe = WanPipeline.load(None if weights else args.config, weights=weights,
                            checkpoint=getattr(args, "checkpoint", None),
                            preset=getattr(args, "preset", None),
                            sampler=getattr(args, "sampler", None),
                            shift=getattr(args, "shift", None), device=args.device,
                            steps=getattr(args, "steps", None),
                            text_encoder=None, vae=decode,
                            decoder=getattr(args, "decoder", None) or "wan")
    return WanParts(pipe, args.cache_dir, use_graphs, kv_dtype=kv_dtype_of(args),
                    gemm_dtype=gemm_dtype_of(args))
