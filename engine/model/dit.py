"""The reference model: a Wan-style causal video DiT with deterministic random weights.

No checkpoint is loaded: every weight is drawn from the `ModelSpec`'s seed, on the CPU
and then moved, so two models of one spec are equal on any device. What matters for
the runtime is the shape of the work, which is the real one:

    latents [B, F, C, H, W] -> patches [B, S = F*h*w, C*ph*pw] -> Linear -> [B, S, hidden]
    per block: adaptive norm -> fused QKV [B, S, H + 2*H_kv, D] -> QK RMSNorm -> rope
               -> CachedAttention over the K/V cache -> gated residual -> GELU MLP
    final adaptive norm -> Linear -> patches -> unpatchify -> velocity [B, F, C, H, W]

B rows are B independent sequences of the K/V store (concurrent streams), each with
its own time and first frame; a [F, C, H, W] call is one sequence.

Rotary positions are absolute over the rollout (they grow forever, storage does not):
video frame f sits at rope frame f + 1, row and col at its patch grid cell. Prompt
tokens sit at (0, 0, 0), i.e. they are not rotated: text has no place in the video.

The prompt is a fixed random token tensor [prompt_tokens, text_dim] projected to the
model width. `CausalVideoDiT.prefill` runs it through the blocks at t = 0 as one causal
block (every prompt token sees every other, which is exactly V(j) of a block [0, P))
and commits its K/V as the pinned prefix.

Where each layer's K/V goes is the caller's `framekv.engine.kv.KVStore` (``kv=``): the
paged cache, the fp32 reference, a store spread over ranks, a dense baseline. Without
one, a forward attends densely over its own tokens.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from framekv.specs import ModelSpec

from ..attention import get_backend
from ..attention.registry import default_backend
from ..kv import AttendFn, KVStore
from .blocks import DiTBlock, Rope3D, modulate, sinusoidal_embedding

#: recorder(layer, packed_qkv [1, S, H+2Hkv, D], out [1, S, H, D], seq_len, block_size)
Recorder = Callable[[int, torch.Tensor, torch.Tensor, int, int], None]


def model_dtype(spec: ModelSpec, device) -> torch.dtype:
    """The compute and K/V dtype: float32 on CPU (the reference path); on CUDA the
    spec's bf16/fp16, and bf16 for a float32 spec (the CUDA cache holds 16-bit K/V)."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return torch.bfloat16 if spec.dtype == "float32" else spec.torch_dtype


def patchify(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[F, C, H, W] -> [F*h*w, C*ph*pw]: Conv3d-equivalent order (C, pt, ph, pw)."""
    Fr, C, Hh, Ww = latents.shape
    _, ph, pw = patch
    x = latents.reshape(Fr, C, Hh // ph, ph, Ww // pw, pw)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(Fr * (Hh // ph) * (Ww // pw), C * ph * pw)


def unpatchify(tokens: torch.Tensor, frames: int, spec: ModelSpec) -> torch.Tensor:
    """[F*h*w, C*ph*pw] -> [F, C, H, W] (inverse of `patchify`)."""
    _, ph, pw = spec.patch_size
    h, w, C = spec.latent_height // ph, spec.latent_width // pw, spec.in_channels
    x = tokens.reshape(frames, h, w, C, ph, pw).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(frames, C, h * ph, w * pw)


class CausalVideoDiT(torch.nn.Module):
    """A Wan-style causal video DiT over the causal K/V cache.

    Args:
        spec: the model shapes and the weight seed.
        prompt_tokens: length of the prompt (the pinned prefix), >= 0.
        device: where the weights live (default CPU).
        dtype: compute dtype (default `model_dtype`: bf16/fp16 on CUDA, fp32 on CPU).
        backend: attention backend name or instance (default `default_backend`); one
            instance serves every layer (they share its plans and built kernels).

    Attributes:
        recorder: None, or a `Recorder` called after every attention with the packed
            QKV and the output (eager use only: a graph replay runs no Python).
        glue: "torch" (default: the blocks' glue as torch ops) or "fused" (through
            framekv's ops, the QK norm and rope staged by stores that can; the same math).
    """

    def __init__(self, spec: ModelSpec, *, prompt_tokens: int, device=None, dtype=None,
                 backend=None):
        super().__init__()
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an integer >= 0, got {prompt_tokens!r}")
        device = torch.device(device if device is not None else "cpu")
        self.spec, self.prompt_tokens = spec, prompt_tokens
        self.dtype = dtype or model_dtype(spec, device)
        backend = get_backend(backend if backend is not None else default_backend(device))
        # Built on the meta device and materialised once at the target dtype and device:
        # no default init, no full-size fp32 copy on the host for the large presets.
        with torch.device("meta"):
            self._build(spec, prompt_tokens, backend)
        self.to(dtype=self.dtype).to_empty(device=device)
        _init_weights(self, spec.seed)
        self.requires_grad_(False)
        _, ph, pw = spec.patch_size
        self.grid = (spec.latent_height // ph, spec.latent_width // pw)
        self.rope = Rope3D(spec.head_dim, self.grid, device)
        self.recorder: Recorder | None = None
        self.glue = "torch"

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def _build(self, spec: ModelSpec, prompt_tokens: int, backend) -> None:
        hid = spec.hidden_size
        self.patch_embed = torch.nn.Linear(spec.patch_dim, hid)
        self.text_embed = torch.nn.Sequential(torch.nn.Linear(spec.text_dim, hid),
                                              torch.nn.GELU(approximate="tanh"),
                                              torch.nn.Linear(hid, hid))
        self.time_embed = torch.nn.Sequential(torch.nn.Linear(spec.freq_dim, hid),
                                              torch.nn.SiLU(), torch.nn.Linear(hid, hid))
        self.time_proj = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(hid, 6 * hid))
        self.blocks = torch.nn.ModuleList(DiTBlock(spec, i, backend)
                                          for i in range(spec.num_layers))
        self.head_modulation = torch.nn.Parameter(torch.zeros(2, hid))
        self.head = torch.nn.Linear(hid, spec.patch_dim)
        self.register_buffer("prompt", torch.zeros(prompt_tokens, spec.text_dim))

    def time_conditioning(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """t fp32 [B] in [0, 1] -> (embedding [B, hidden], block modulation
        [B, 6, 1, hidden]: shift, scale, gate of attention and MLP, broadcast over tokens)."""
        e = self.time_embed(sinusoidal_embedding(t, self.spec.freq_dim).to(self.dtype))
        return e, self.time_proj(e).view(t.shape[0], 6, 1, -1)

    def forward(self, latents: torch.Tensor, t: torch.Tensor, frame0: torch.Tensor, *,
                kv: KVStore | None = None, seq_len: int | None = None,
                causal_block_size: int | None = None, output: bool = True) -> torch.Tensor | None:
        """The velocity of a chunk's latents.

        Args:
            latents: [F, C, H, W] or [B, F, C, H, W] (B sequences of the store), any
                float dtype (cast to the model dtype).
            t: fp32 [1] or [B], the flow-matching time in [0, 1] (1 = noise).
            frame0: int64 [1] or [B], absolute index of each sequence's first frame of
                the chunk (a device tensor, so a captured graph replays for every chunk).
            kv: the `KVStore` this forward stages into and attends over; None: dense
                attention over the call's own tokens.
            seq_len, causal_block_size: real tokens and block size of the forward
                (default: all tokens, one block).
            output: False (with ``kv``): the forward is kept only for the K/V it stages
                (a clean pass). The last block stops once its K/V are staged (its
                attention, projection and MLP feed nothing), the head does not run,
                and None is returned.
        Returns:
            velocity in the shape of ``latents``, in the model dtype; None with
            ``output=False``.
        """
        if not output and kv is None:
            raise ValueError("output=False needs kv: without a store the forward keeps nothing")
        lat = latents if latents.dim() == 5 else latents[None]             # [B, F, C, H, W]
        B, frames = lat.shape[:2]
        x = self.patch_embed(patchify(lat.flatten(0, 1), self.spec.patch_size).to(self.dtype))
        x = x.view(B, -1, x.shape[-1])                                     # [B, S, hidden]
        S = x.shape[1]
        seq_len = S if seq_len is None else seq_len
        b = seq_len if causal_block_size is None else causal_block_size
        e, mod = self.time_conditioning(t)
        rope = self._rope(frame0 + 1, frames, B, kv)                       # video at frame f + 1
        if kv is None:
            x = self._blocks(x, mod, rope, _self_attention, seq_len, b)
        else:                                                              # [B, S(_l), ...]
            x = kv.shard(x)
            x = self._blocks(x, mod, rope, kv.forward(seq_len, b), seq_len, b,
                             stages=kv.stages_prologue, skips=kv.stages_without_output,
                             output=output)
        if not output:
            return None
        shift, scale = (self.head_modulation + e[:, None]).unbind(1)      # [B, hidden] each
        y = self.head(modulate(x, shift[:, None], scale[:, None]))        # [B, S(_l), patch_dim]
        if kv is not None:
            y = kv.gather(y, S)
        v = unpatchify(y.flatten(0, 1), B * frames, self.spec)             # [B*F, C, H, W]
        return v.view(lat.shape) if latents.dim() == 5 else v

    def prefill(self, kv: KVStore, prompt: torch.Tensor | None = None, *,
                rewrite: bool = False) -> None:
        """Run the prompt at t = 0 as one causal block and commit its K/V (P tokens) as
        ``kv``'s pinned prefix; the store must be at position 0. ``prompt``: [P, text_dim]
        tokens instead of the model's own. ``rewrite``: write them over the pinned
        region of a rollout under way instead (a prompt change; the store must support
        it: `PagedKV.rewrite_prompt`)."""
        P = self.prompt_tokens
        if P == 0:
            return
        if not isinstance(kv, KVStore):
            raise ValueError(f"kv must be a framekv.engine.kv.KVStore, got {type(kv).__name__}")
        prompt = self.prompt if prompt is None else prompt
        if not isinstance(prompt, torch.Tensor) or tuple(prompt.shape) != tuple(self.prompt.shape):
            got = list(prompt.shape) if isinstance(prompt, torch.Tensor) else type(prompt).__name__
            raise ValueError(f"prompt must be a {list(self.prompt.shape)} tensor, got {got}")
        attend = kv.prompt_forward(P, rewrite=True) if rewrite else kv.prompt_forward(P)
        x = self.text_embed(prompt.to(self.device, self.dtype))[None]      # [1, P, hidden]
        x = kv.shard(x)                                                    # [1, P(_l), hidden]
        _, mod = self.time_conditioning(torch.zeros(1, device=self.device))
        self._blocks(x, mod, None, attend, P, P, output=False)  # only its K/V are kept
        kv.rewrite_prompt() if rewrite else kv.commit_prompt()

    def _rope(self, frame0: torch.Tensor, frames: int, B: int, kv: KVStore | None):
        """The blocks' rope: cos/sin tables (torch glue, sharded like the tokens) or the
        fused kernel's `RopeGrid` (positions from frame0 [B] and the token index)."""
        if self.glue == "fused":
            S = frames * self.grid[0] * self.grid[1]
            frame0 = frame0 if frame0.shape[0] == B else frame0.expand(B).contiguous()
            return self.rope.grid(frame0, 0 if kv is None else kv.token_offset(S))
        rope = Rope3D.cos_sin(self.rope.angles(frame0, frames))
        return rope if kv is None else tuple(kv.shard(c) for c in rope)

    def _blocks(self, x, mod, rope, attend: AttendFn, seq_len: int, b: int, *,
                stages: bool = False, skips: bool = False, output: bool = True) -> torch.Tensor:
        """The blocks over x; without ``output`` the last one only stages its K/V."""
        fused = self.glue == "fused"
        attend = self._attending(attend, seq_len, b, stages, skips)
        *body, last = self.blocks
        for blk in body:
            x = blk(x, mod, rope, attend, fused)
        if not output:
            last.stage_kv(x, mod, rope, attend, fused)
            return x
        return last(x, mod, rope, attend, fused)

    def _attending(self, attend: AttendFn, seq_len: int, b: int, stages: bool,
                   skips: bool = False) -> AttendFn:
        """The blocks' ``attend(attn, qkv, prologue=None, output=True)``: the QK
        prologue goes to a store that ``stages`` it, or runs in place first (and always
        with a recorder, which reads the packed K); ``output=False`` goes to a store that
        ``skips`` the attention then, else the output is computed and dropped (and
        always with a recorder, which checks it); the recorder is called after each
        attention."""
        recorder = self.recorder
        stages, skips = stages and recorder is None, skips and recorder is None

        def call(attn, qkv, prologue=None, output=True):
            if prologue is not None and not stages:
                with torch.no_grad():
                    prologue(qkv)
                prologue = None
            args = (attn, qkv) if prologue is None else (attn, qkv, prologue)
            out = attend(*args) if output or not skips else attend(*args, output=False)
            if recorder is not None:
                recorder(attn.layer_idx, qkv, out, seq_len, b)
            return out if output else None
        return call


def _self_attention(attn, qkv: torch.Tensor) -> torch.Tensor:
    """Dense attention over the forward's own tokens (no K/V store)."""
    return attn(qkv)


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights: drawn in registration order from one CPU generator.

    Linear weights ~ N(0, 1/fan_in); biases small; QK norm scales near 1; the
    modulation parameters and the time projection small (adaLN-zero would make them
    zero; small random keeps every gate and shift non-trivial); prompt tokens N(0, 1).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name == "prompt":
                p.copy_(r)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * r)
            elif "modulation" in name:
                p.copy_(0.1 * r)
            elif name.endswith(".bias"):
                p.copy_(0.02 * r)
            else:  # a Linear weight [out, in]
                gain = 0.1 if name.startswith("time_proj") else 1.0
                p.copy_(r * (gain / math.sqrt(p.shape[1])))
