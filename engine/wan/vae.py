"""Wan VAE: shipped configs, weights, and `StreamingVAEDecoder`, which decodes a video's
latents chunk by chunk as a rollout returns them.

A decoder holds S sequences, each with its own causal feature cache in one persistent
arena (``vae_graph.py``). ``decode(latents)`` continues the named sequences' videos:
the frames of a video decoded in chunks, concatenated along time, are the frames
diffusers' ``WanPipeline`` decodes from the whole video::

    z = latents / (1 / latents_std) + latents_mean    # in the vae's dtype, per channel
    frames = vae.decode(z).sample                      # [B, 3, F', 8H, 8W], in [-1, 1]

with F' = 1 + 4 (F - 1) for a chunk that starts a video and 4 F for a later chunk.
Frames come back in the vae's dtype (as the pipeline's), a fresh tensor. Latents are
cast to that dtype first (the pipeline does too); they must be on the decoder's device.
The decode is untiled (the pipeline's default); Wan 2.2 VAEs (``patch_size``,
``is_residual``) are refused.

On CUDA each chunk is one graph replay (`framekv.graphs.GraphCache`), keyed on batch
size, latent frames and stage: "first" (every row starts a video) or "steady" (every
row continues one). The rows of one call must share a stage. On CPU, or with
``use_graphs=False``, the same chunk program runs eagerly. diffusers is imported on
first use (``pip install 'framekv[wan]'``); nothing is ever fetched.
"""
from __future__ import annotations

import os

import torch


from framekv.specs.checks import check_count, check_flag
from .vae_fused import FusedDecoder, fused_chunk_program
from .vae_graph import CacheLayout, DecoderRows, chunk_program

__all__ = ["VAE_CONFIGS", "StreamingVAEDecoder", "VaeCoder", "build_vae", "check_vae",
           "load_vae"]

_WAN21_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
               0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
_WAN21_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
              3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]

#: diffusers' AutoencoderKLWan configs by name. "1.3b" is the Wan 2.1 VAE (the one of
#: Wan 2.1 T2V 1.3B); "tiny" pairs with the tiny transformer (4 latent channels) and
#: keeps the 8x spatial, 4x temporal upsampling, decoding on a CPU in milliseconds.
VAE_CONFIGS = {
    "tiny": dict(base_dim=8, z_dim=4, dim_mult=(1, 2, 2, 2), num_res_blocks=1, attn_scales=(),
                 temperal_downsample=(False, True, True), dropout=0.0,
                 latents_mean=(0.31, -0.47, 0.12, 0.85), latents_std=(1.7, 0.6, 2.3, 1.1)),
    "1.3b": dict(base_dim=96, z_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=2, attn_scales=(),
                 temperal_downsample=(False, True, True), dropout=0.0,
                 latents_mean=tuple(_WAN21_MEAN), latents_std=tuple(_WAN21_STD)),
}
#: Wan 2.1 T2V 14B decodes with the same VAE.
VAE_CONFIGS["14b"] = VAE_CONFIGS["1.3b"]


def _resolve(device) -> torch.device:
    from framekv.ops import resolve_device

    return resolve_device(device)


def build_vae(config="tiny", *, dtype=None, device=None, seed: int = 0):
    """A randomly initialised ``AutoencoderKLWan`` of a shipped config name or a config
    dict, in ``dtype`` (default bf16 on CUDA, fp32 on CPU) on ``device``, in eval mode
    without gradients."""
    from diffusers import AutoencoderKLWan

    cfg = VAE_CONFIGS.get(config) if isinstance(config, str) else dict(config)
    if cfg is None:
        raise ValueError(f"config must be one of {sorted(VAE_CONFIGS)} or a config dict, "
                         f"got {config!r}")
    dev = _resolve(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
    torch.manual_seed(seed)
    with torch.device(dev):
        vae = AutoencoderKLWan(**cfg)
    # torch's own `to`: diffusers' warns of fp32 modules even for a VAE that keeps none.
    return torch.nn.Module.to(vae, dtype).eval().requires_grad_(False)


def load_vae(path, *, dtype=None, device=None):
    """An ``AutoencoderKLWan`` from a local diffusers folder (its ``vae`` subfolder when
    there is one), never fetched; in ``dtype`` (default bf16 on CUDA, fp32 on CPU)."""
    from diffusers import AutoencoderKLWan

    dev = _resolve(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path must be a local diffusers folder (nothing is downloaded), "
                         f"got {path!r}")
    sub = "vae" if os.path.isdir(os.path.join(path, "vae")) else None
    vae = AutoencoderKLWan.from_pretrained(path, subfolder=sub, local_files_only=True,
                                           torch_dtype=dtype)
    return vae.to(dev).eval().requires_grad_(False)


def check_vae(vae, owner: str = "StreamingVAEDecoder") -> None:
    """ValueError unless ``vae`` is a Wan 2.1 ``AutoencoderKLWan`` (``owner``: who needs it)."""
    try:
        from diffusers import AutoencoderKLWan
    except ImportError as exc:
        raise ValueError(f"{owner} needs diffusers: pip install 'framekv[wan]'") from exc
    if not isinstance(vae, AutoencoderKLWan):
        raise ValueError(f"vae must be a diffusers AutoencoderKLWan, got {type(vae).__name__}")
    if vae.config.patch_size is not None or vae.config.is_residual:
        raise ValueError("vae must be a Wan 2.1 VAE: patch_size and is_residual (Wan 2.2) "
                         f"are not supported, got patch_size={vae.config.patch_size}, "
                         f"is_residual={vae.config.is_residual}")


class VaeCoder:
    """What the Wan VAE's streaming coders (`StreamingVAEDecoder`, `StreamingVAEEncoder`)
    do alike: the constructor (``vae``, ``sequences``, ``use_graphs``, ``device``,
    ``fused``: their docstrings say what each means), checked, setting ``fused``
    (default: a bf16 or fp32 vae, the dtypes the norm kernel reads), ``sequences``,
    ``device`` (the vae moved there), ``vae``, ``dtype``, ``latent_channels``,
    ``use_graphs``, WanPipeline's ``_mean`` and ``_inv_std`` [1, z, 1, 1, 1] in the
    vae's dtype, and the fused program's weights (``FUSED(vae)``); the graph keys'
    program name (``NAME``, "-fused" after it for the fused program) and the arena's
    layout (channels last for the fused program)."""

    NAME, FUSED = "", None

    def __init__(self, vae, *, sequences=None, use_graphs=None, device=None, fused=None):
        check_vae(vae, type(self).__name__)
        readable = vae.dtype in (torch.bfloat16, torch.float32)
        self.fused = readable if fused is None else check_flag("fused", fused)
        if self.fused and not readable:
            raise ValueError(f"fused=True needs a bfloat16 or float32 vae, got {vae.dtype} "
                             "(pass fused=False to run diffusers' modules)")
        self.sequences = check_count("sequences", sequences)
        self.device = _resolve(device if device is not None else next(vae.parameters()).device)
        if next(vae.parameters()).device != self.device:
            vae.to(self.device)
        self.vae, self.dtype, self.latent_channels = vae, vae.dtype, vae.config.z_dim
        self.use_graphs = self._graphs_on(use_graphs, self.device)
        cfg, shape = vae.config, (1, vae.config.z_dim, 1, 1, 1)
        # WanPipeline's tensors, built as it builds them (1 / std in fp32, then cast).
        self._mean = torch.tensor(cfg.latents_mean).view(shape).to(self.device, self.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std)
        self._inv_std = inv_std.view(shape).to(self.device, self.dtype)
        self._program_weights = type(self).FUSED(vae) if self.fused else None
        self._start_rows()

    @property
    def PROGRAM(self) -> str:
        return f"{self.NAME}-fused" if self.fused else self.NAME

    @property
    def CACHE_CHANNELS_LAST(self) -> bool:
        return self.fused            # the fused program's cache layout


class StreamingVAEDecoder(VaeCoder, DecoderRows):
    """Decode Wan latents chunk by chunk, each sequence's causal cache kept between calls.

    Args:
        vae: a diffusers ``AutoencoderKLWan`` (Wan 2.1), used as it is.
        sequences: S, the sequences the decoder holds (default: the batch of the first
            `decode` or `capture`).
        use_graphs: replay each chunk as a CUDA graph (default True on CUDA; always
            eager on CPU).
        device: default the vae's (the vae is moved there otherwise).
        fused: run the channels-last program with fused norms (`vae_fused`; default
            True for a bf16 or fp32 vae, the dtypes its norm kernel reads); False runs
            diffusers' modules frame by frame. The two give the same frames up to bf16
            rounding and share the state's form (`snapshot`). The fused program keeps
            channels-last copies of the conv weights made here: load weights into the
            vae before building its decoder.

    Attributes:
        vae, device, dtype (the vae's: frames come back in it), sequences (None until
        known), use_graphs, fused, latent_channels (the vae's z_dim).
    """

    NAME, FUSED = "vae-decode", FusedDecoder

    @staticmethod
    def video_frames(latent_frames: int, first: bool) -> int:
        """Frames a chunk of ``latent_frames`` decodes to: 1 + 4 (F - 1) for a video's
        first chunk (the VAE's causal start), 4 F for a later one."""
        return 1 + 4 * (latent_frames - 1) if first else 4 * latent_frames

    # ------------------------------------------------------------------ internals
    MISMATCH = "another vae or latent size, or a decoder that has not decoded yet"

    def _layout(self, latent_size: tuple[int, int]) -> CacheLayout:
        return CacheLayout.probe(self.vae, latent_size, self.device)

    def _chunk(self, first: bool, write: bool):
        if self.fused:
            return fused_chunk_program(self._program_weights, self._cache, first=first,
                                       mean=self._mean, inv_std=self._inv_std, write=write)
        return chunk_program(self.vae, self._cache, first=first, mean=self._mean,
                             inv_std=self._inv_std, write=write)
