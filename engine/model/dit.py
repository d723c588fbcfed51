"""The reference model: a Wan-style causal video DiT with deterministic random weights.

No checkpoint is loaded: every weight is drawn from the `ModelSpec`'s seed, on the CPU
and then moved, so two models of one spec are equal on any device. What matters for
the runtime is the shape of the work, which is the real one:

    latents [B, C, F, H, W] -> patches [B, S = F*h*w, C*ph*pw] -> Linear -> [B, S, hidden]
    per block: adaptive norm -> fused QKV [B, S, H + 2*H_kv, D] -> QK RMSNorm -> rope
               -> CachedAttention over the K/V cache -> gated residual -> GELU MLP
    final adaptive norm -> Linear -> patches -> unpatchify -> velocity [B, C, F, H, W]

B rows are B independent sequences of the K/V store (concurrent streams), each with
its own time and first frame.

Rotary positions are absolute over the rollout (they grow forever, storage does not):
video frame f sits at rope frame f + 1, row and col at its patch grid cell. Prompt
tokens sit at (0, 0, 0), i.e. they are not rotated: text has no place in the video.

The prompt is a fixed random token tensor [prompt_tokens, text_dim] projected to the
model width. `CausalVideoDiT.prefill` runs it through the blocks at t = 0 as one causal
block (every prompt token sees every other, which is exactly V(j) of a block [0, P))
and commits its K/V as the pinned prefix.

Every block's four GEMMs run in the model's dtype or, with the blocks' fp8 copies
(`CausalVideoDiT.fp8_linears`, passed to a forward as ``fp8``), as fp8 GEMMs
(`framekv.engine.fp8_linear`); the embeddings and the head stay in the model's dtype.

Where each layer's K/V goes is said by the forward's `framekv.engine.kv.ForwardContext`
(its store: the paged cache, the fp32 reference, a store spread over ranks, a dense
baseline; or none, dense attention over the forward's own tokens). `DiTChunks` is the
model as a `framekv.engine.runner.ChunkModel`.
"""
from __future__ import annotations

import math

import torch

from framekv import ops
from framekv.specs import ModelSpec

from ..attention import get_backend
from ..attention.registry import default_backend
from ..fp8_linear import Fp8Linear
from ..kv import ForwardContext, KVStore, Recorder
from .blocks import DiTBlock, Rope3D, modulate, sinusoidal_embedding


def model_dtype(spec: ModelSpec, device) -> torch.dtype:
    """The compute and K/V dtype: float32 on CPU (the reference path); on CUDA the
    spec's bf16/fp16, and bf16 for a float32 spec (the CUDA cache holds 16-bit K/V)."""
    if torch.device(device).type != "cuda":
        return torch.float32
    return torch.bfloat16 if spec.dtype == "float32" else spec.torch_dtype


def patchify(latents: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, F*h*w, C*ph*pw]: tokens frame-major, each in Conv3d order
    (C, pt, ph, pw)."""
    B, C, Fr, Hh, Ww = latents.shape
    _, ph, pw = patch
    x = latents.reshape(B, C, Fr, Hh // ph, ph, Ww // pw, pw)
    return x.permute(0, 2, 3, 5, 1, 4, 6).reshape(B, Fr * (Hh // ph) * (Ww // pw), C * ph * pw)


def unpatchify(tokens: torch.Tensor, frames: int, spec: ModelSpec) -> torch.Tensor:
    """[B, F*h*w, C*ph*pw] -> [B, C, F, H, W] (inverse of `patchify`)."""
    _, ph, pw = spec.patch_size
    h, w, C = spec.latent_height // ph, spec.latent_width // pw, spec.in_channels
    x = tokens.reshape(tokens.shape[0], frames, h, w, C, ph, pw).permute(0, 4, 1, 2, 5, 3, 6)
    return x.reshape(tokens.shape[0], C, frames, h * ph, w * pw)


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
        glue: "torch" (default: the blocks' glue as torch ops) or "fused" (through
            framekv's ops, the QK norm and rope staged by stores that can; the same
            math); a forward may name its own.
    """

    def __init__(self, spec: ModelSpec, *, prompt_tokens: int, device=None, dtype=None,
                 backend=None):
        super().__init__()
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be an integer >= 0, got {prompt_tokens!r}")
        device = torch.device(device if device is not None else "cpu")
        self.spec, self.prompt_tokens = spec, prompt_tokens
        self.dtype = dtype or model_dtype(spec, device)
        backend = get_backend(backend if backend is not None else
                              default_backend(device, spec.head_dim))
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

    def fp8_linears(self) -> list[dict[str, Fp8Linear]]:
        """Each block's GEMMs as fp8 GEMMs (`DiTBlock.fp8_linears`), quantized now: what
        ``fp8`` of `forward` and `prefill` takes. ValueError naming the first layer that
        cannot be one (`framekv.engine.fp8_linear.Fp8Linear`)."""
        return [blk.fp8_linears(f"blocks.{i}") for i, blk in enumerate(self.blocks)]

    def forward(self, latents: torch.Tensor, t: torch.Tensor, ctx: ForwardContext, *,
                glue: str | None = None,
                fp8: list[dict[str, Fp8Linear]] | None = None) -> torch.Tensor | None:
        """The velocity of a chunk's latents.

        Args:
            latents: [B, C, F, H, W] (B sequences of the store), any float dtype (cast
                to the model dtype).
            t: fp32 [1] or [B], the flow-matching time in [0, 1] (1 = noise).
            ctx: the forward's `ForwardContext`: its store (or None: dense attention
                over the call's own tokens), real tokens and block size, ``frame0``
                (int64 [1] or [B]: each sequence's first frame of the chunk, a device
                tensor so a captured graph replays for every chunk), and ``output``:
                False for a forward kept only for the K/V it stages (a clean pass: the
                last block stops once they are staged, the head does not run).
            glue: "torch" or "fused" for this forward (default ``self.glue``).
            fp8: the blocks' fp8 GEMMs (`fp8_linears`), or None (the model's dtype).
        Returns:
            velocity [B, C, F, H, W] in the model dtype; None without ``ctx.output``.
        """
        B, _, frames = latents.shape[:3]
        x = self.patch_embed(patchify(latents, self.spec.patch_size).to(self.dtype))
        S = x.shape[1]                                                     # x [B, S, hidden]
        fused = (glue or self.glue) == "fused"
        e, mod = self.time_conditioning(t)
        rope = self.rope.for_forward(ctx.frame0 + 1, frames, B, fused, ctx)  # video at f + 1
        x = self._blocks(ctx.shard(x), mod, rope, ctx, fused, fp8)         # [B, S(_l), hidden]
        if x is None:
            return None
        shift, scale = (self.head_modulation + e[:, None]).unbind(1)      # [B, hidden] each
        y = self.head(modulate(x, shift[:, None], scale[:, None]))        # [B, S(_l), patch_dim]
        return unpatchify(ctx.gather(y, S), frames, self.spec)            # [B, C, F, H, W]

    def prefill(self, kv: KVStore, prompt: torch.Tensor | None = None, *,
                rewrite: bool = False, glue: str | None = None,
                recorder: Recorder | None = None,
                fp8: list[dict[str, Fp8Linear]] | None = None) -> None:
        """Run the prompt at t = 0 as one causal block and commit its K/V (P tokens) as
        the pinned prefix of ``kv``'s sequences in use, which must be at position 0.
        ``prompt``: [P, text_dim] tokens instead of the model's own. ``rewrite``: write
        them over the pinned region of sequences under way instead (a prompt change;
        the store must support it: `PagedKV.rewrite_prompt`). Only the prompt's K/V
        are kept: its last block stops once they are staged. ``fp8``: as `forward`."""
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
        ctx = ForwardContext(kv, seq_len=P, output=False, recorder=recorder, attend=attend)
        x = self.text_embed(prompt.to(self.device, self.dtype))[None]      # [1, P, hidden]
        _, mod = self.time_conditioning(torch.zeros(1, device=self.device))
        self._blocks(ctx.shard(x), mod, None, ctx, (glue or self.glue) == "fused", fp8)
        kv.rewrite_prompt() if rewrite else kv.commit_prompt()

    def _blocks(self, x, mod, rope, ctx: ForwardContext, fused: bool,
                fp8: list | None) -> torch.Tensor | None:
        """The blocks over x; None when the forward keeps only its K/V (the last block
        stopped once they were staged)."""
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            x = blk(x, mod, rope, ctx, fused=fused, last=i == last,
                    fp8=None if fp8 is None else fp8[i])
            if x is None:
                return None
        return x


class DiTChunks:
    """A `CausalVideoDiT` as a `framekv.engine.runner.ChunkModel`: its forward, its
    prompt as the pinned prefix (K/V committed into the sequences, rewritten in place
    on a change), its latent shape, with its own glue and GEMMs (one model may serve
    runners of both glues, with and without fp8 GEMMs).

    Args:
        model: the `CausalVideoDiT`; glue: "fused" or "torch".
        fp8: run the blocks' GEMMs in fp8 (`CausalVideoDiT.fp8_linears`, quantized here:
            ValueError naming a layer that cannot be one).

    Attributes:
        fp8: the blocks' fp8 GEMMs, or None.
    """

    keeps_history = False  # a prompt change rewrites the prefix; the window's K/V stay
    prompt_in_store = True  # the pinned prefix: a sequence's snapshot carries it
    timestep_scale = 1.0   # the sampler's sigma is the model's t

    def __init__(self, model: CausalVideoDiT, glue: str, fp8: bool = False):
        self.dit, self.glue = model, glue
        self.fp8 = model.fp8_linears() if fp8 else None
        s = model.spec
        self.device, self.dtype = model.device, model.dtype
        self.tokens_per_frame = (s.latent_height // s.patch_size[1]) * (s.latent_width // s.patch_size[2])
        self.latent_shape = (s.in_channels, s.latent_height, s.latent_width)
        self.prompt_shape, self.text_dim = tuple(model.prompt.shape), s.text_dim
        self.attention = model.blocks[0].attn

    def forward(self, x: torch.Tensor, t: torch.Tensor, ctx: ForwardContext):
        return self.dit(x, t, ctx, glue=self.glue, fp8=self.fp8)

    def q_bounds(self) -> list[float] | None:
        """Each block's |q| bound after its per-head QK norm (fused glue), else None."""
        if self.glue != "fused":
            return None
        D = self.dit.spec.head_dim
        return [ops.q_bound(b.q_norm.weight, "head", D) for b in self.dit.blocks]

    def write_prompt(self, kv: KVStore, rows, prompt: torch.Tensor, *, rewrite: bool = False,
                     recorder: Recorder | None = None) -> None:
        """The prompt [P, text_dim] as the pinned prefix of ``kv``'s sequences in use
        (``rows``, already in use), committed at position 0 or written over it. A
        rewrite is all or nothing: its forward writes nothing, and its writes put the
        old prompt's K/V back if one fails (`PagedKV.rewrite_prompt`)."""
        self.dit.prefill(kv, prompt, rewrite=rewrite, glue=self.glue, recorder=recorder,
                         fp8=self.fp8)

    def clear_prompt(self, rows) -> None:
        """Nothing to do: the prompt's K/V live in the store, whose reset of ``rows``
        zeroes them."""

    def default_prompt(self) -> torch.Tensor:
        """The model's own prompt tokens [P, text_dim] (deterministic random)."""
        return self.dit.prompt


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
