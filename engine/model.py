"""The reference model: a Wan-style causal video DiT with deterministic random weights.

No checkpoint is loaded: every weight is drawn from the `ModelSpec`'s seed, on the CPU
and then moved, so two models of one spec are equal on any device. What matters for
the runtime is the shape of the work, which is the real one:

    latents [F, C, H, W] -> patches [S = F*h*w, C*ph*pw] -> Linear -> [1, S, hidden]
    per block: adaptive norm -> fused QKV [1, S, H + 2*H_kv, D] -> QK RMSNorm -> rope
               -> CachedAttention over the K/V cache -> gated residual -> GELU MLP
    final adaptive norm -> Linear -> patches -> unpatchify -> velocity [F, C, H, W]

Rotary positions are absolute over the rollout (they grow forever, storage does not):
video frame f sits at rope frame f + 1, row and col at its patch grid cell. Prompt
tokens sit at (0, 0, 0), i.e. they are not rotated: text has no place in the video.

The prompt is a fixed random token tensor [prompt_tokens, text_dim] projected to the
model width. `CausalVideoDiT.prefill` runs it through the blocks at t = 0 as one causal
block (every prompt token sees every other, which is exactly V(j) of a block [0, P))
and commits its K/V as the pinned prefix.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from framekv.specs import ModelSpec

from .model_blocks import AttendFn, DiTBlock, Rope3D, modulate, sinusoidal_embedding

#: recorder(layer, packed_qkv [1, S, H+2Hkv, D], out [1, S, H, D], seq_len, block_size)
Recorder = Callable[[int, torch.Tensor, torch.Tensor, int, int], None]


def model_dtype(spec: ModelSpec, device) -> torch.dtype:
    """The compute and K/V dtype: float32 on CPU (the reference path); on CUDA the
    spec's bf16/fp16, and bf16 for a float32 spec (the CUDA cache holds 16-bit K/V)."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return torch.bfloat16 if spec.dtype == "float32" else spec.torch_dtype


def default_backend(device) -> str:
    """The attention backend a device uses unless told otherwise."""
    return "cudnn" if torch.device(device).type == "cuda" else "reference"


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


def reference_attend(reference, seq_len: int, block_size: int) -> AttendFn:
    """Attention through an `ExactWindowReference` instead of the cache: the rows'
    K/V are recorded at the reference's committed count, then each block attends in
    fp32 over exactly its visible positions."""
    def attend(attn, qkv):
        H, Hkv = attn.num_heads, attn.num_kv_heads
        k, v = qkv[0, :seq_len, H:H + Hkv], qkv[0, :seq_len, H + Hkv:]   # [T, Hkv, D]
        reference.write(attn.layer_idx, reference.committed, k, v)
        out = reference.attention(attn.layer_idx, qkv[0, :, :H], seq_len, block_size,
                                  scale=attn.scale)                        # [S, H, D] fp32
        return out.to(qkv.device, qkv.dtype)[None]
    return attend


def _attend_for(kv_cache, reference, seq_len: int, b: int, attend: AttendFn | None = None
                ) -> AttendFn:
    """The attention of one forward: the caller's, the fp32 reference, the cache, or dense."""
    if attend is not None:
        if kv_cache is not None or reference is not None:
            raise ValueError("attend replaces kv_cache and reference: pass only one of them")
        return attend
    if reference is not None:
        return reference_attend(reference, seq_len, b)
    if kv_cache is not None:
        return lambda attn, qkv: attn(qkv, kv_cache=kv_cache, seq_len=seq_len,
                                      causal_block_size=b)
    return lambda attn, qkv: attn(qkv)


class CausalVideoDiT(torch.nn.Module):
    """A Wan-style causal video DiT over the causal K/V cache.

    Args:
        spec: the model shapes and the weight seed.
        prompt_tokens: length of the prompt (the pinned prefix), >= 0.
        device: where the weights live (default CPU).
        dtype: compute dtype (default `model_dtype`: bf16/fp16 on CUDA, fp32 on CPU).
        backend: attention backend name or instance (default `default_backend`).

    Attributes:
        recorder: None, or a `Recorder` called after every attention with the packed
            QKV and the output (eager use only: a graph replay runs no Python).
    """

    def __init__(self, spec: ModelSpec, *, prompt_tokens: int, device=None, dtype=None,
                 backend=None):
        super().__init__()
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an integer >= 0, got {prompt_tokens!r}")
        device = torch.device(device if device is not None else "cpu")
        self.spec, self.prompt_tokens = spec, prompt_tokens
        self.dtype = dtype or model_dtype(spec, device)
        backend = backend if backend is not None else default_backend(device)
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
        """t fp32 [1] in [0, 1] -> (embedding [1, hidden], block modulation [6, hidden])."""
        e = self.time_embed(sinusoidal_embedding(t, self.spec.freq_dim).to(self.dtype))
        return e, self.time_proj(e).view(6, -1)

    def forward(self, latents: torch.Tensor, t: torch.Tensor, frame0: torch.Tensor, *,
                kv_cache=None, seq_len: int | None = None,
                causal_block_size: int | None = None, reference=None,
                attend: AttendFn | None = None, sequence_parallel=None) -> torch.Tensor:
        """The velocity of a chunk's latents.

        Args:
            latents: [F, C, H, W], any float dtype (cast to the model dtype).
            t: fp32 [1], the flow-matching time in [0, 1] (1 = noise).
            frame0: int64 [1], absolute index of the chunk's first frame (a device
                tensor, so a captured graph replays for every chunk).
            kv_cache: the `CausalKVCache` to stage into and attend over.
            seq_len, causal_block_size: as for `CachedAttention` (default: all tokens,
                one block).
            reference: an `ExactWindowReference` used instead of ``kv_cache`` (the
                dense fp32 path tests compare against).
            attend: an `AttendFn` used instead of ``kv_cache`` and ``reference``: it
                stages and attends each layer's packed QKV itself (e.g. the dense
                rolling-cache baseline); ``seq_len`` and ``causal_block_size`` then only
                label the forward for the recorder.
            sequence_parallel: None, or an object with ``shard(x)`` (this rank's rows
                of [1, S, ...], zero-padded) and ``gather(x, length)`` (all ranks' rows,
                cut to ``length``), e.g. `UlyssesParallel`: the blocks then run on this
                rank's share of the tokens and ``attend`` must exchange them.
        Returns:
            velocity [F, C, H, W] in the model dtype.
        """
        frames = latents.shape[0]
        x = self.patch_embed(patchify(latents, self.spec.patch_size).to(self.dtype))[None]
        S = x.shape[1]                                                     # [1, S, hidden]
        seq_len = S if seq_len is None else seq_len
        b = seq_len if causal_block_size is None else causal_block_size
        e, mod = self.time_conditioning(t)
        rope = Rope3D.cos_sin(self.rope.angles(frame0 + 1, frames))        # video at frame f + 1
        attend = _attend_for(kv_cache, reference, seq_len, b, attend)
        if sequence_parallel is not None:                                  # [1, S_l, ...]
            x, rope = sequence_parallel.shard(x), tuple(sequence_parallel.shard(c) for c in rope)
        x = self._blocks(x, mod, rope, attend, seq_len, b)
        shift, scale = (self.head_modulation + e).unbind(0)
        y = self.head(modulate(x, shift, scale))                           # [1, S(_l), patch_dim]
        if sequence_parallel is not None:
            y = sequence_parallel.gather(y, S)
        return unpatchify(y[0], frames, self.spec)

    def prefill(self, *, kv_cache=None, reference=None, attend: AttendFn | None = None,
                sequence_parallel=None) -> None:
        """Run the prompt at t = 0 as one causal block and commit its K/V (P tokens).

        With ``kv_cache``: attention is dense over the prompt (the cache cannot run a
        block of P tokens unless P is a declared block size), then each layer's K/V is
        staged through `stage_prompt` and committed. With ``reference``: the fp32
        reference path, committed there. A cache must be open at C = 0. With
        ``attend``: an `AttendFn` that keeps each layer's prompt K/V and attends the
        prompt as one block of P tokens; nothing is committed here, the caller commits.
        ``sequence_parallel`` (with ``attend``) as for `forward`: the blocks run on this
        rank's rows of the prompt.
        """
        P = self.prompt_tokens
        if P == 0:
            return
        if sum(x is not None for x in (kv_cache, reference, attend)) != 1:
            raise ValueError("prefill needs exactly one of kv_cache, reference and attend")
        if kv_cache is not None and kv_cache.committed_tokens:
            raise ValueError(f"prefill needs a freshly opened cache, C = {kv_cache.committed_tokens}")
        kvs: list[torch.Tensor] = []  # per layer [P, 2*H_kv, D]
        if reference is not None:
            attend = reference_attend(reference, P, P)
        elif kv_cache is not None:
            def attend(attn, qkv):
                kvs.append(qkv[0, :, attn.num_heads:])
                return attn(qkv)
        x = self.text_embed(self.prompt.to(self.dtype))[None]              # [1, P, hidden]
        if sequence_parallel is not None:
            x = sequence_parallel.shard(x)                                 # [1, P_l, hidden]
        _, mod = self.time_conditioning(torch.zeros(1, device=self.device))
        self._blocks(x, mod, None, attend, P, P)
        if reference is not None:
            reference.commit(P)
        elif kv_cache is not None:
            stage_prompt(kv_cache, kvs, self.spec.num_kv_heads)

    def _blocks(self, x, mod, rope, attend: AttendFn, seq_len: int, b: int) -> torch.Tensor:
        attend = self._recording(attend, seq_len, b)
        for blk in self.blocks:
            x = blk(x, mod, rope, attend)
        return x

    def _recording(self, attend: AttendFn, seq_len: int, b: int) -> AttendFn:
        recorder = self.recorder
        if recorder is None:
            return attend

        def recorded(attn, qkv):
            out = attend(attn, qkv)
            recorder(attn.layer_idx, qkv, out, seq_len, b)
            return out
        return recorded


def stage_prompt(cache, kvs: list[torch.Tensor], num_kv_heads: int) -> None:
    """Write the prompt's per-layer K/V ([P, 2*H_kv, D] each) at [0, P) and commit it.

    A staged write needs a multiple of a declared block size, and the prompt length
    rarely is one. So the prompt goes in pieces of at most max_staged_tokens, each
    padded with zero rows to a multiple of the smallest declared block size, and only
    the real rows are committed: the padding rows sit at staged positions, which the
    next forward overwrites before anything can see them.
    """
    g = cache.geometry
    b = min(g.causal_block_sizes)
    piece = g.max_staged_tokens // b * b
    P = kvs[0].shape[0]
    for start in range(0, P, piece):
        n = min(piece, P - start)
        padded = -(-n // b) * b
        for layer, kv in enumerate(kvs):
            buf = kv.new_zeros(padded, *kv.shape[1:])                      # [padded, 2Hkv, D]
            buf[:n] = kv[start:start + n]
            cache.write_staged(layer, buf[:, :num_kv_heads], buf[:, num_kv_heads:], b)
        cache.commit(n)


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
