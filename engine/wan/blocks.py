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
"""
from __future__ import annotations

import torch

from framekv import ops

from ..kv import ForwardContext
from ..model.blocks import linear_gelu
from .attention import PromptKV, self_attention


def feed_forward(ffn, h: torch.Tensor) -> torch.Tensor:
    """diffusers' ``FeedForward`` on h, its GELU-tanh projection fused where it is one."""
    act, *rest = ffn.net
    if getattr(act, "approximate", None) != "tanh" or not hasattr(act, "proj"):
        return ffn(h)
    y = linear_gelu(act.proj, h)
    for m in rest:  # dropout (identity in eval), the output projection
        y = m(y)
    return y


def block_forward(block, x: torch.Tensor, temb: torch.Tensor, rope, ctx: ForwardContext,
                  cached, prompt: PromptKV, *, fused: bool, last: bool) -> torch.Tensor | None:
    """One block over hidden states x [B, S, dim] with the time projection temb
    [B, 6, dim]; ``cached``: its `CachedAttention`, ``prompt``: its cross-attention
    K/V; None when ``last`` stops a forward kept for its K/V only (module doc)."""
    shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table
                                                    + temb.float()).chunk(6, dim=1)
    if fused:
        x = x if x.stride(-1) == 1 else x.contiguous()
        h = ops.adaln_(x, shift=shift, scale=scale, eps=block.norm1.eps)    # [B, S, dim]
    else:
        h = (block.norm1(x.float()) * (1 + scale) + shift).type_as(x)
    a = self_attention(block.attn1, h, rope, ctx, cached, fused=fused, last=last)
    if a is None:
        return None
    if not fused:
        x = (x.float() + a * gate).type_as(x)
        a = prompt(block.attn2, block.norm2(x.float()).type_as(x), ctx.rows)
        x = x + a
        h = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        return (x.float() + block.ffn(h).float() * c_gate).type_as(x)
    if isinstance(block.norm2, torch.nn.Identity):
        ops.gated_residual_(x, a, gate)
        h = x
    else:
        h = ops.adaln_(x, residual=a, gate=gate, weight=block.norm2.weight,
                       bias=block.norm2.bias, eps=block.norm2.eps)
    a = prompt(block.attn2, h, ctx.rows)
    h = ops.adaln_(x, residual=a, shift=c_shift, scale=c_scale, eps=block.norm3.eps)
    ops.gated_residual_(x, feed_forward(block.ffn, h), c_gate)
    return x
