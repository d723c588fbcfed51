"""Wan models for a rollout: their shapes, the shipped configs, and random weights from
a config (`build_model`; local weights: `framekv.engine.wan.weights`). diffusers is
imported here, on first use: it is an optional extra (``pip install 'framekv[wan]'``).
"""
from __future__ import annotations

import dataclasses

import torch

from framekv.specs import Geometry, load_preset

#: diffusers' WanTransformer3DModel configs by name. "1.3b" is Wan 2.1 T2V 1.3B (and the
#: Self-Forcing / CausVid checkpoints built on it), "14b" Wan 2.1 T2V 14B (the same text
#: encoder and VAE; random weights of it need about 28 GiB in bf16); "tiny" runs on a
#: CPU in seconds.
CONFIGS = {
    "tiny": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                 in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                 num_layers=2, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024),
    "1.3b": dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128,
                 in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960,
                 num_layers=30, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024),
    "14b": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128,
                in_channels=16, out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824,
                num_layers=40, cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024),
}


#: The preset each shipped config rolls out at unless another is named: the one table
#: of sizes (latent, chunk, window, prompt length, steps) the demo and the server share.
PRESETS = {"tiny": "tiny", "1.3b": "wan-1.3b", "14b": "wan-14b"}


def preset_sizes(preset) -> dict:
    """`WanRollout` keyword arguments for a preset's sizes (a `framekv.specs.Preset`, or
    a preset name or path): ``latent_size`` (the model spec's latent H, W),
    ``frames_per_chunk``, ``window_frames``, ``prompt_tokens`` (the rollout spec's) and
    ``timesteps`` (``denoising_steps`` of them, evenly spaced down from 1000); the sink
    is one frame."""
    if not hasattr(preset, "rollout"):
        preset = load_preset(preset)
    m, r = preset.model, preset.rollout
    n = r.denoising_steps
    return {"latent_size": (m.latent_height, m.latent_width),
            "frames_per_chunk": r.frames_per_chunk, "sink_frames": 1,
            "window_frames": r.window_frames, "prompt_tokens": r.prompt_tokens,
            "timesteps": tuple(1000.0 * (n - i) / n for i in range(n))}


@dataclasses.dataclass(frozen=True)
class WanShape:
    """What a rollout needs to know of a model and its latents."""

    num_layers: int
    heads: int
    head_dim: int
    channels: int
    patch_size: tuple[int, int, int]
    latent_size: tuple[int, int]
    frames_per_chunk: int
    sink_frames: int
    window_frames: int
    tokens_per_page: int = 32

    @classmethod
    def of(cls, model, latent_size, frames_per_chunk, sink_frames, window_frames) -> "WanShape":
        """The shape of ``model`` rolled out at these sizes; ValueError naming a bad one."""
        cfg = model.config
        patch = tuple(cfg.patch_size)
        if (not isinstance(latent_size, (tuple, list)) or len(latent_size) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in latent_size)):
            raise ValueError(f"latent_size must be (H, W) positive integers, got {latent_size!r}")
        for name, v, low in (("frames_per_chunk", frames_per_chunk, 1),
                             ("sink_frames", sink_frames, 0), ("window_frames", window_frames, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        if patch[0] != 1 or latent_size[0] % patch[1] or latent_size[1] % patch[2]:
            raise ValueError(f"latent_size {tuple(latent_size)} must be a multiple of the "
                             f"model's patch {patch[1:]} (and its time patch 1), got patch {patch}")
        return cls(num_layers=len(model.blocks), heads=cfg.num_attention_heads,
                   head_dim=cfg.attention_head_dim, channels=cfg.in_channels, patch_size=patch,
                   latent_size=tuple(latent_size), frames_per_chunk=frames_per_chunk,
                   sink_frames=sink_frames, window_frames=window_frames)

    @property
    def tokens_per_frame(self) -> int:
        return (self.latent_size[0] // self.patch_size[1]) * (self.latent_size[1] // self.patch_size[2])

    @property
    def chunk_tokens(self) -> int:
        return self.frames_per_chunk * self.tokens_per_frame

    def geometry(self) -> Geometry:
        """P = sink frames, W = window frames behind the sink, M = one chunk; blocks of
        the chunk and of one frame."""
        tpf = self.tokens_per_frame
        return Geometry(pin_tokens=self.sink_frames * tpf, window_tokens=self.window_frames * tpf,
                        max_staged_tokens=self.chunk_tokens,
                        causal_block_sizes=tuple(sorted({self.chunk_tokens, tpf})))


def check_model(model) -> None:
    """ValueError unless ``model`` is a text-to-video ``WanTransformer3DModel``."""
    try:
        from diffusers import WanTransformer3DModel
    except ImportError as exc:
        raise ValueError("WanRollout needs diffusers: pip install 'framekv[wan]'") from exc
    if not isinstance(model, WanTransformer3DModel):
        raise ValueError(f"model must be a diffusers WanTransformer3DModel, got "
                         f"{type(model).__name__}")
    if getattr(model.config, "added_kv_proj_dim", None) is not None:
        raise ValueError("image-conditioned Wan models (added_kv_proj_dim) are not supported: "
                         "their cross-attention reads image K/V too")


def model_device_dtype(model, device=None) -> tuple[torch.device, torch.dtype]:
    """Where the model runs (its parameters' device unless ``device`` moves it) and its
    compute dtype (its patch embedding's: the fp32 modules diffusers keeps stay)."""
    from framekv.ops import resolve_device

    dev = resolve_device(device if device is not None else next(model.parameters()).device)
    if next(model.parameters()).device != dev:
        model.to(dev)
    return dev, model.patch_embedding.weight.dtype


def build_model(config="tiny", *, dtype=None, device=None, seed: int = 0):
    """A randomly initialised ``WanTransformer3DModel`` of a shipped config name or a
    config dict, built in ``dtype`` (default bf16 on CUDA, fp32 on CPU) on ``device``;
    the modules diffusers keeps in fp32 stay fp32."""
    from diffusers import WanTransformer3DModel

    cfg = CONFIGS.get(config) if isinstance(config, str) else dict(config)
    if cfg is None:
        raise ValueError(f"config must be one of {sorted(CONFIGS)} or a config dict, got {config!r}")
    from framekv.ops import resolve_device

    dev = resolve_device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = WanTransformer3DModel(**cfg)
    return _cast(model, dtype).eval().requires_grad_(False)


def _cast(model, dtype: torch.dtype):
    """``dtype`` for everything but the modules diffusers keeps in fp32, which are fp32
    (as loading with ``torch_dtype`` does): a whole-model cast would also cast the rope
    tables, ``scale_shift_table`` and norms."""
    keep = tuple(model._keep_in_fp32_modules or ())
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if any(k in name.split(".") for k in keep) else dtype)
    return model
