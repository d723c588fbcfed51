"""Building blocks of the reference causal video DiT: embeddings, 3-axis rotary
positions, norms and one transformer block.

Shapes follow the engine's convention: a forward holds B sequences of S tokens,
activations are [B, S, hidden], attention heads are [B, S, heads, D].

A block runs its glue (the norms, modulation, rope, gates and the GELU around its
GEMMs and attention) one of two ways, the same math: ``fused`` through framekv's ops
(`adaln_` for norm + modulation with the gated residual before it, `gated_residual_`,
`qk_norm_rope_stage_` for the QK norm and rope from device positions, staged into the
cache by the store when it can, and the MLP's bias + GELU as a cuBLASLt epilogue on
CUDA), or as torch ops (the unfused reference and what a baseline runs). Either glue
runs its four GEMMs in the model's dtype or, given the block's `fp8_linears`, as fp8
GEMMs (`framekv.engine.fp8_linear`; `linear`, `mlp`).
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from framekv import ops
from framekv.specs import ModelSpec

from ..attention import CachedAttention
from ..fp8_linear import Fp8Linear, adaln_for
from ..kv import ForwardContext

#: Wan feeds the sampler's t in [0, 1] to the sinusoid as t * 1000.
TIMESTEP_SCALE = 1000.0
ROPE_THETA = 10000.0


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """cos/sin features of timesteps: t [N] in [0, 1] -> fp32 [N, dim] (dim even)."""
    half = dim // 2
    exponent = torch.arange(half, device=t.device, dtype=torch.float64) / half
    freqs = torch.exp(-math.log(10000.0) * exponent)                        # [half]
    args = t.double()[:, None] * TIMESTEP_SCALE * freqs[None]              # [N, half]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).float()


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """How head_dim is cut over the (frame, row, col) axes; each part even (Wan's split)."""
    spatial = 2 * (head_dim // 6)
    return head_dim - 2 * spatial, spatial, spatial


class Rope3D:
    """Rotary embedding over absolute (frame, row, col) positions: the one rope of both
    models (the reference DiT's, and Wan's in place of its own table).

    Pairs of head dims (2i, 2i+1) rotate by ``position * inv_freq[i]``; the first
    ``rope_split(D)[0]`` dims follow the frame axis, the rest the row and col axes
    (Wan's split), ``inv_freq`` = theta^(-2i/d) per axis. Frame angles are computed in
    float64 from a device tensor, so positions can grow over a long rollout without
    losing precision and without a host-side value that a captured graph would bake in;
    the torch glue gets fp32 cos/sin tables (`cos_sin`, applied by `apply_rope`), the
    fused glue the positions themselves (`grid`, for `framekv.ops.qk_norm_rope_stage_`).

    Args:
        head_dim: D; grid: (h, w) patches of a frame; device: where the tables live;
        theta: the frequency base.
    """

    def __init__(self, head_dim: int, grid: tuple[int, int], device: torch.device,
                 theta: float = ROPE_THETA):
        self.dims = rope_split(head_dim)
        self.inv_freq = [1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64,
                                                      device=device) / d)
                         for d in self.dims]                               # [d / 2] each
        h, w = grid
        rows = torch.arange(h, device=device, dtype=torch.float64).repeat_interleave(w)
        cols = torch.arange(w, device=device, dtype=torch.float64).repeat(h)
        spatial = torch.cat([rows[:, None] * self.inv_freq[1][None],
                             cols[:, None] * self.inv_freq[2][None]], dim=-1)
        self._spatial = spatial                                            # [h*w, (Dr+Dc)/2]
        self._inv_all = torch.cat(self.inv_freq)                           # [D/2] fp64
        self.hw = (h, w)

    def angles(self, frame0: torch.Tensor, frames: int) -> torch.Tensor:
        """Angles of a chunk's tokens: frame0 int64 [B] (rope frame of each sequence's
        first frame) -> fp64 [B, frames * h * w, D / 2], frame-major token order."""
        f = frame0.double()[:, None] + torch.arange(frames, device=frame0.device,
                                                    dtype=torch.float64)   # [B, F]
        fa = f[..., None] * self.inv_freq[0]                               # [B, F, Df/2]
        tpf = self._spatial.shape[0]
        fa = fa.repeat_interleave(tpf, dim=1)                              # [B, S, Df/2]
        spatial = self._spatial.repeat(frames, 1).expand(fa.shape[0], -1, -1)
        return torch.cat([fa, spatial], dim=-1)                            # [B, S, D/2]

    def grid(self, frame0: torch.Tensor, token_offset: int = 0) -> ops.RopeGrid:
        """The same rotation for the fused kernel: positions from ``frame0`` int64 [B]
        (rope frame of each sequence's first frame) and the token index, angles in fp64
        on the device (`framekv.ops.RopeGrid`)."""
        return ops.RopeGrid(inv_freq=self._inv_all, axes=tuple(d // 2 for d in self.dims),
                            grid=self.hw, frame0=frame0, style="interleaved",
                            token_offset=token_offset)

    @staticmethod
    def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin [B, S, 1, D/2] ready to broadcast over heads."""
        return (torch.cos(angles).float()[:, :, None],
                torch.sin(angles).float()[:, :, None])

    def for_forward(self, frame0: torch.Tensor, frames: int, batch: int, fused: bool,
                    ctx: ForwardContext):
        """A forward's rope: the `RopeGrid` of the fused glue, or the torch glue's cos/sin
        tables; frame0 int64 [B] or [1] (every row), this process's share of the
        tokens (`ForwardContext.shard` / ``token_offset``)."""
        frame0 = frame0 if frame0.shape[0] == batch else frame0.expand(batch).contiguous()
        if fused:
            S = frames * self.hw[0] * self.hw[1]
            return self.grid(frame0, ctx.token_offset(S))
        return tuple(ctx.shard(c) for c in self.cos_sin(self.angles(frame0, frames)))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [B, S, heads, D] by the angles; fp32 math."""
    xf = x.float().unflatten(-1, (-1, 2))                                  # [B, S, h, D/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm over the last dim with a learned scale (per-head QK norm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm without affine parameters, in fp32 (adaptive norms add their own)."""
    return F.layer_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Adaptive norm: norm(x) * (1 + scale) + shift; shift/scale [B, 1, hidden] broadcast."""
    return layer_norm(x) * (1 + scale) + shift


def linear_gelu(fc: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """GELU-tanh(fc(x)): on CUDA one cuBLASLt GEMM with the bias and GELU-tanh in its
    epilogue (``torch._addmm_activation``); elsewhere the torch ops (the CPU kernel's
    GELU there is the erf form)."""
    if x.device.type != "cuda" or fc.bias is None:
        return F.gelu(fc(x), approximate="tanh")
    y = torch._addmm_activation(fc.bias, x.reshape(-1, x.shape[-1]), fc.weight.t(),
                                use_gelu=True)                             # [B*S, ffn]
    return y.view(*x.shape[:-1], -1)


def linear(fc: torch.nn.Linear, x: torch.Tensor, fp8: Fp8Linear | None = None) -> torch.Tensor:
    """fc(x) in the model's dtype, or through ``fp8``, its fp8 GEMM."""
    return fc(x) if fp8 is None else fp8(x)


def mlp(fc1, fc2, h: torch.Tensor, fp8: tuple[Fp8Linear, Fp8Linear] | None = None, *,
        epilogue: bool = True) -> torch.Tensor:
    """fc2(GELU-tanh(fc1(h))): the GELU in fc1's GEMM epilogue (``epilogue``,
    `linear_gelu`) or after it as a torch op; with ``fp8`` (fc1's and fc2's fp8 GEMMs)
    fc1 writes its pre-activation and fc2's input quantizer applies the GELU."""
    if fp8 is not None:
        return fp8[1](fp8[0](h), gelu=True)
    if epilogue:
        return fc2(linear_gelu(fc1, h))
    return fc2(F.gelu(fc1(h), approximate="tanh"))


class DiTBlock(torch.nn.Module):
    """One block: adaptive-norm self-attention (fused QKV, QK RMSNorm, 3-axis rope)
    and an adaptive-norm GELU-tanh MLP, each added through a gate.

    ``modulation`` [6, hidden] is added to the shared time projection [B, 6, 1, hidden]:
    shift, scale and gate of the attention, then of the MLP (Wan's layout).
    """

    #: The linears that run as fp8 GEMMs with ``gemm_dtype="fp8"`` (`fp8_linears`).
    FP8_LINEARS = ("qkv", "proj", "fc1", "fc2")
    #: Each one's accumulation (`framekv.engine.fp8_linear`, "Accumulation"): fast over
    #: the model's width, fc2's sum over the MLP's width promoted to fp32.
    FP8_FAST_ACCUM = {"qkv": True, "proj": True, "fc1": True, "fc2": False}

    def __init__(self, spec: ModelSpec, layer_idx: int, backend):
        super().__init__()
        H, Hkv, D, hid = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
        self.heads = (H, Hkv, D)
        self.layer_idx = layer_idx
        self.qkv = torch.nn.Linear(hid, (H + 2 * Hkv) * D)
        self.q_norm, self.k_norm = RMSNorm(D), RMSNorm(D)
        self.proj = torch.nn.Linear(H * D, hid)
        self.fc1 = torch.nn.Linear(hid, spec.ffn_size)
        self.fc2 = torch.nn.Linear(spec.ffn_size, hid)
        self.modulation = torch.nn.Parameter(torch.zeros(6, hid))
        self.attn = CachedAttention(H, Hkv, D, backend=backend, layer_idx=layer_idx)

    def fp8_linears(self, prefix: str) -> dict[str, Fp8Linear]:
        """The block's `FP8_LINEARS` as fp8 GEMMs, by name (their weights quantized
        now); ``prefix`` names the block in errors ("blocks.3")."""
        return {n: Fp8Linear.of(getattr(self, n), f"{prefix}.{n}", self.FP8_FAST_ACCUM[n])
                for n in self.FP8_LINEARS}

    def qkv_packed(self, h: torch.Tensor, rope: tuple | None,
                   fp8: dict | None = None) -> torch.Tensor:
        """[B, S, hidden] -> packed [B, S, H + 2*H_kv, D]: q, k normed and rotated."""
        H, Hkv, D = self.heads
        qkv = linear(self.qkv, h, (fp8 or {}).get("qkv")).unflatten(-1, (H + 2 * Hkv, D))
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return torch.cat([q, k, v], dim=2)

    def forward(self, x: torch.Tensor, time_mod: torch.Tensor, rope, ctx: ForwardContext, *,
                fused: bool = False, last: bool = False,
                fp8: dict[str, Fp8Linear] | None = None) -> torch.Tensor | None:
        """x [B, S, hidden]; time_mod [B, 6, 1, hidden]; rope (cos, sin), a `RopeGrid`
        (fused) or None. ``fused``: the glue through framekv's ops (module doc; x is
        then updated in place). ``last``: the model's last block, which in a forward
        kept for its K/V only stops once they are staged (None back). ``fp8``: the
        block's `fp8_linears` (its GEMMs in fp8), or None (the model's dtype)."""
        mods = self._mods(x, time_mod, fused)
        qkv, prologue = self._attention_input(x, mods, rope, fused, fp8)
        out = ctx.attention(self.attn, qkv, prologue, last=last)           # [B, S, H, D]
        if out is None:
            return None
        shift1, scale1, gate1, shift2, scale2, gate2 = mods
        f = fp8 or {}
        proj = linear(self.proj, out.flatten(2), f.get("proj"))           # [B, S, hidden]
        ffn = (f["fc1"], f["fc2"]) if f else None
        if fused:  # x += gate1 * proj; h for fc1 (e4m3 with its scales for an fp8 fc1)
            h = adaln_for(ffn[0] if ffn else None, x, residual=proj, gate=gate1, shift=shift2,
                          scale=scale2, eps=1e-6)
            ops.gated_residual_(x, mlp(self.fc1, self.fc2, h, ffn), gate2)
            return x
        x = x + gate1 * proj
        h = modulate(x, shift2, scale2)
        return x + gate2 * mlp(self.fc1, self.fc2, h, ffn, epilogue=False)

    def _mods(self, x, time_mod, fused: bool) -> list[torch.Tensor]:
        """shift, scale, gate of the attention, then of the MLP: [B, 1, hidden] each."""
        mods = (time_mod + self.modulation[:, None]).unbind(1)
        # A prompt forward of several sequences has one time row: broadcast it (views).
        return [m.expand(x.shape[0], -1, -1) for m in mods] if fused else list(mods)

    def _attention_input(self, x, mods, rope, fused: bool, fp8: dict | None):
        """(packed QKV [B, S, H + 2*H_kv, D], its QK prologue or None): torch glue
        returns q and k normed and rotated; fused glue returns them as projected with
        `qk_norm_rope_stage_` bound as the prologue."""
        H, Hkv, D = self.heads
        if not fused:
            return self.qkv_packed(modulate(x, mods[0], mods[1]), rope, fp8), None
        layer = (fp8 or {}).get("qkv")
        h = adaln_for(layer, x, shift=mods[0], scale=mods[1], eps=1e-6)   # [B, S, hidden]
        qkv = linear(self.qkv, h, layer).unflatten(-1, (H + 2 * Hkv, D))   # [B, S, H+2Hkv, D]
        prologue = functools.partial(
            ops.qk_norm_rope_stage_, q_weight=self.q_norm.weight, k_weight=self.k_norm.weight,
            num_heads=H, num_kv_heads=Hkv, norm="head", eps=self.q_norm.eps, rope=rope)
        return qkv, prologue
