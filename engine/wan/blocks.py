"""A Wan transformer block's glue through framekv's ops.

diffusers' ``WanTransformerBlock.forward`` spends as much time in small torch kernels as
in its GEMMs at rollout sizes: fp32 LayerNorms, the modulation ``(1 + scale), + shift``,
the gated residuals, casts, the GELU. `fused_forward` is the same math, step by step
(each rounding where the stock block rounds), with the norm + modulation and the
residual before it one `adaln_` kernel, the last residual one `gated_residual_`, and
the MLP's bias + GELU-tanh a cuBLASLt epilogue on CUDA (`linear_gelu`)::

    x += 0                      h = adaLN(x; shift, scale)                  norm1
    a = attn1(h)                h = LN_affine(x += gate * a)                 norm2
    a = attn2(h, text)          h = adaLN(x += a; c_shift, c_scale)          norm3
    f = ffn(h)                  x += c_gate * f

The block's hidden states are updated in place. In a forward kept only for its K/V
(a clean pass) the last block's self-attention returns None once its K/V are staged
(`WanSelfAttention`) and the block returns at once. Installed per block by `WanRollout`
(``glue="fused"``) as the block's ``forward``; `uninstall` gives the stock one back.
"""
from __future__ import annotations

import types

import torch

from framekv import ops

from ..model.blocks import linear_gelu


def feed_forward(ffn, h: torch.Tensor) -> torch.Tensor:
    """diffusers' ``FeedForward`` on h, its GELU-tanh projection fused where it is one."""
    act, *rest = ffn.net
    if getattr(act, "approximate", None) != "tanh" or not hasattr(act, "proj"):
        return ffn(h)
    y = linear_gelu(act.proj, h)
    for m in rest:  # dropout (identity in eval), the output projection
        y = m(y)
    return y


def _modulation(block, temb: torch.Tensor) -> list[torch.Tensor]:
    """shift, scale, gate, c_shift, c_scale, c_gate: fp32 [B, 1, N] (or [B, S, N] for a
    per-token temb [B, S, 6, N]), as the stock block adds them."""
    if temb.ndim == 4:
        mods = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
        return [m.squeeze(2) for m in mods]
    return list((block.scale_shift_table + temb.float()).chunk(6, dim=1))


def fused_forward(block, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                  temb: torch.Tensor, rotary_emb) -> torch.Tensor:
    """``WanTransformerBlock.forward`` with the glue through framekv's ops (module doc)."""
    shift, scale, gate, c_shift, c_scale, c_gate = _modulation(block, temb)
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    h = ops.adaln_(x, shift=shift, scale=scale, eps=block.norm1.eps)      # [B, S, N]
    a = block.attn1(h, None, None, rotary_emb)
    if a is None:  # a forward kept for its K/V only: they are staged, the rest feeds nothing
        return x
    if isinstance(block.norm2, torch.nn.Identity):
        ops.gated_residual_(x, a, gate)
        h = x
    else:
        h = ops.adaln_(x, residual=a, gate=gate, weight=block.norm2.weight,
                       bias=block.norm2.bias, eps=block.norm2.eps)
    a = block.attn2(h, encoder_hidden_states, None, None)
    h = ops.adaln_(x, residual=a, shift=c_shift, scale=c_scale, eps=block.norm3.eps)
    ops.gated_residual_(x, feed_forward(block.ffn, h), c_gate)
    return x


def install(block) -> None:
    """Make ``block`` run `fused_forward`."""
    block.forward = types.MethodType(fused_forward, block)


def uninstall(block) -> None:
    """Give ``block`` its stock forward back (nothing when it has it)."""
    block.__dict__.pop("forward", None)
