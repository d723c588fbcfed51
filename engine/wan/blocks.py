"""A Wan transformer block's forward, both glues: the stock block's math step by step,
its attention through the forward's `ForwardContext` (`framekv.engine.wan.attention`).

``torch`` is ``WanTransformerBlock.forward`` as diffusers writes it (fp32 LayerNorms,
the modulation ``(1 + scale), + shift``, the gated residuals, each rounding where the
stock block rounds). ``fused`` is the same math with the norm + modulation and the
residual before it one `adaln_` kernel, the last residual one `gated_residual_`, and
the MLP's bias + GELU-tanh a cuBLASLt epilogue on CUDA (`linear_gelu`)::

    x += 0                      h = adaLN(x; shift, scale)                  norm1
    a = attn1(h)                h = LN_affine(x += gate * a)                 norm2
    a = attn2(h, text)          h = adaLN(x += a; c_shift, c_scale)          norm3
    f = ffn(h)                  x += c_gate * f

The fused block updates its hidden states in place. In a forward kept only for its K/V
(a clean pass) the last block's self-attention returns None once its K/V are staged and
the block returns None at once: nothing after it is read.

With a block's fp8 GEMMs (`fp8_linears`, either glue) its self-attention's q, k, v and
output projections, its cross-attention's q and output projections and its MLP's two
run in fp8 (`framekv.engine.fp8_linear`); the MLP's GELU-tanh is applied by the second
GEMM's input quantizer. Dropout is the identity (inference).
"""
from __future__ import annotations

import torch

from framekv import ops

from ..fp8_linear import Fp8Linear, adaln_for
from ..kv import ForwardContext
from ..model.blocks import linear_gelu
from .attention import PromptKV, fp8_qkv, self_attention


def _gelu_tanh_ffn(ffn) -> bool:
    """Whether diffusers' ``FeedForward`` is GELU-tanh(proj) then the output projection."""
    act = ffn.net[0]
    return getattr(act, "approximate", None) == "tanh" and hasattr(act, "proj")


def _out_projection(net) -> int:
    """The index of the output projection in a ``FeedForward``'s ``net`` (the one
    ``torch.nn.Linear`` after its activation; dropouts around it)."""
    found = [i for i, m in enumerate(net) if isinstance(m, torch.nn.Linear)]
    if len(found) != 1:
        raise ValueError(f"a FeedForward's net must hold one Linear after its activation, "
                         f"got {len(found)}")
    return found[0]


#: Each fp8 GEMM's accumulation (`framekv.engine.fp8_linear`, "Accumulation"): fast
#: where the sum runs over the model's width, promoted to fp32 for the MLP's output
#: projection (its sum over the MLP's width, the longest).
FP8_FAST_ACCUM = {"qkv": True, "out": True, "cross_q": True, "cross_out": True,
                  "ffn_in": True, "ffn_out": False}


def fp8_linears(block, name: str) -> dict[str, Fp8Linear]:
    """A Wan block's fp8 GEMMs by name (module doc), quantized now: "qkv" (attn1's q,
    k, v: `attention.fp8_qkv`), "out", "cross_q", "cross_out", "ffn_in", "ffn_out".
    ``name`` names the block in errors ("blocks.3"); ValueError for a layer that cannot
    be one, or an MLP that is not GELU-tanh then a projection."""
    if not _gelu_tanh_ffn(block.ffn):
        raise ValueError(f"{name}.ffn: fp8 GEMMs need a GELU-tanh MLP (diffusers' "
                         f"'gelu-approximate'), got {type(block.ffn.net[0]).__name__}")
    a1, a2, net = block.attn1, block.attn2, block.ffn.net
    out = _out_projection(net)
    fast = FP8_FAST_ACCUM
    return {"qkv": fp8_qkv(a1, f"{name}.attn1", fast["qkv"]),
            "out": Fp8Linear.of(a1.to_out[0], f"{name}.attn1.to_out.0", fast["out"]),
            "cross_q": Fp8Linear.of(a2.to_q, f"{name}.attn2.to_q", fast["cross_q"]),
            "cross_out": Fp8Linear.of(a2.to_out[0], f"{name}.attn2.to_out.0",
                                      fast["cross_out"]),
            "ffn_in": Fp8Linear.of(net[0].proj, f"{name}.ffn.net.0.proj", fast["ffn_in"]),
            "ffn_out": Fp8Linear.of(net[out], f"{name}.ffn.net.{out}", fast["ffn_out"])}


def feed_forward(ffn, h: torch.Tensor, fp8: dict | None = None) -> torch.Tensor:
    """diffusers' ``FeedForward`` on h, its GELU-tanh projection fused where it is one;
    with ``fp8`` (the block's fp8 GEMMs) both GEMMs in fp8, the GELU between them
    applied by the second's quantizer."""
    if fp8:
        return fp8["ffn_out"](fp8["ffn_in"](h), gelu=True)
    act, *rest = ffn.net
    if not _gelu_tanh_ffn(ffn):
        return ffn(h)
    y = linear_gelu(act.proj, h)
    for m in rest:  # dropout (identity in eval), the output projection
        y = m(y)
    return y


def block_forward(block, x: torch.Tensor, temb: torch.Tensor, rope, ctx: ForwardContext,
                  cached, prompt: PromptKV, *, fused: bool, last: bool,
                  fp8: dict | None = None) -> torch.Tensor | None:
    """One block over hidden states x [B, S, dim] with the time projection temb
    [B, 6, dim]; ``cached``: its `CachedAttention`, ``prompt``: its cross-attention
    K/V; None when ``last`` stops a forward kept for its K/V only (module doc);
    ``fp8``: its `fp8_linears`, or None (the model's dtype)."""
    shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table
                                                    + temb.float()).chunk(6, dim=1)
    f = fp8 or {}  # a norm before an fp8 layer writes its e4m3 input (`adaln_for`)
    if fused:
        x = x if x.stride(-1) == 1 else x.contiguous()
        h = adaln_for(f.get("qkv"), x, shift=shift, scale=scale, eps=block.norm1.eps)
    else:
        h = (block.norm1(x.float()) * (1 + scale) + shift).type_as(x)
    a = self_attention(block.attn1, h, rope, ctx, cached, fused=fused, last=last, fp8=fp8)
    if a is None:
        return None
    if not fused:
        x = (x.float() + a * gate).type_as(x)
        a = prompt(block.attn2, block.norm2(x.float()).type_as(x), ctx.rows, fp8)
        x = x + a
        h = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        f = feed_forward(block.ffn, h, fp8) if fp8 else block.ffn(h)
        return (x.float() + f.float() * c_gate).type_as(x)
    if isinstance(block.norm2, torch.nn.Identity):
        ops.gated_residual_(x, a, gate)
        h = x
    else:
        h = adaln_for(f.get("cross_q"), x, residual=a, gate=gate, weight=block.norm2.weight,
                      bias=block.norm2.bias, eps=block.norm2.eps)
    a = prompt(block.attn2, h, ctx.rows, fp8)
    h = adaln_for(f.get("ffn_in"), x, residual=a, shift=c_shift, scale=c_scale,
                  eps=block.norm3.eps)
    ops.gated_residual_(x, feed_forward(block.ffn, h, fp8), c_gate)
    return x
