"""Attention inside a diffusers `WanTransformer3DModel` rolled out by framekv: self-attention
over the runner's K/V store, cross-attention over the prompt's K/V projected once per
prompt. The math is the stock processor's (``WanAttnProcessor``); the modules and their
weights are the model's own, called directly (no processor is replaced)::

    self-attention   q, k, v projections (fused, packed or not) -> RMSNorm over all
                     heads (q, k) -> heads [B, S, H, D] -> rotary on interleaved pairs
                     -> the forward's cached attention over exactly V(j) -> to_out
    cross-attention  q projection and norm per forward; k, v of each sequence's prompt
                     projected and normed once per prompt (`PromptKV`) -> SDPA -> to_out

With the fused glue, q and k go as projected to one `framekv.ops.qk_norm_rope_stage_`
(the norm over all heads, the rope from a `RopeGrid`), which a store that stages K/V
with it (`PagedKV`) runs as its staging. Given a block's fp8 GEMMs
(`framekv.engine.wan.blocks.fp8_linears`: "qkv", "out", "cross_q", "cross_out"), the
q, k, v projection (one GEMM over the packed weight, either glue) and the output
projections and cross-attention's q run through them; the prompt's k and v stay in
the model's dtype (once per prompt).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from framekv import ops

from ..fp8_linear import Fp8Linear
from ..kv import ForwardContext
from ..model.blocks import apply_rope, linear


def qkv_projections(attn, hidden_states: torch.Tensor):
    """q, k, v [B, S, H*D] of a self-attention module, fused or not (the stock rule)."""
    if getattr(attn, "fused_projections", False):
        return attn.to_qkv(hidden_states).chunk(3, dim=-1)
    return attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)


_PACKED = "framekv_packed_qkv"  # the module attribute holding (weight, bias)


def _packed_parts(attn):
    """(weight [3*H*D, dim], bias [3*H*D] or None) of `pack_projections` while ``to_q``,
    ``to_k`` and ``to_v`` are still its row blocks (a later ``.to()`` or an assigning
    state-dict load moves them out: then None, and the projections run unpacked)."""
    parts = getattr(attn, _PACKED, None)
    if parts is None:
        return None
    weight, bias = parts
    n, dim = weight.shape[0] // 3, weight.shape[1]
    for i, m in enumerate((attn.to_q, attn.to_k, attn.to_v)):
        at = weight.data_ptr() + i * n * dim * weight.element_size()  # row block i
        if m.weight.shape != (n, dim) or m.weight.data_ptr() != at:
            return None
        if (m.bias is None) != (bias is None):
            return None
        if bias is not None and m.bias.data_ptr() != bias.data_ptr() + i * n * bias.element_size():
            return None
    return parts


@torch.no_grad()
def pack_projections(attn) -> None:
    """Store the q, k, v projections of a self-attention module as row blocks of one
    weight [3*H*D, dim] (and one bias), each projection's parameter a view of it, so one
    GEMM writes the packed QKV the fused glue reads: no ``cat`` of three outputs and,
    unlike diffusers' ``fuse_qkv_projections``, no second copy of the weights. The values and the modules' own use are unchanged; a
    module with fused projections, or already packed, is left as it is."""
    if getattr(attn, "fused_projections", False) or _packed_parts(attn) is not None:
        return
    mods = (attn.to_q, attn.to_k, attn.to_v)
    n = mods[0].weight.shape[0]
    if any(m.weight.shape != mods[0].weight.shape for m in mods):
        return  # not one head layout for q, k and v: nothing to pack
    weight = torch.cat([m.weight for m in mods])                            # [3n, dim]
    bias = None
    if all(m.bias is not None for m in mods):
        bias = torch.cat([m.bias for m in mods])                            # [3n]
    elif any(m.bias is not None for m in mods):
        return
    for i, m in enumerate(mods):
        m.weight.data = weight[i * n:(i + 1) * n]
        if bias is not None:
            m.bias.data = bias[i * n:(i + 1) * n]
    setattr(attn, _PACKED, (weight, bias))


def fp8_qkv(attn, name: str, fast_accum: bool = False) -> Fp8Linear:
    """The q, k, v projections of a self-attention module as one fp8 GEMM over their
    weights stacked by rows ([3*H*D, dim], as `pack_projections` stores them; the
    per-channel scales make it the three GEMMs' result side by side). ``name`` names
    the module in errors; ``fast_accum``: `Fp8Linear`'s."""
    if getattr(attn, "fused_projections", False):
        return Fp8Linear.of(attn.to_qkv, f"{name}.to_qkv", fast_accum)
    parts = _packed_parts(attn)
    if parts is None:
        mods = (attn.to_q, attn.to_k, attn.to_v)
        biased = all(m.bias is not None for m in mods)
        parts = (torch.cat([m.weight for m in mods]),
                 torch.cat([m.bias for m in mods]) if biased else None)
    return Fp8Linear(*parts, name=f"{name}.to_q/to_k/to_v", fast_accum=fast_accum)


def packed_qkv(attn, hidden_states: torch.Tensor) -> torch.Tensor:
    """q, k and v of a self-attention module side by side, [B, S, 3*H*D]: one GEMM where
    the projections are fused or packed (`pack_projections`), else a ``cat``."""
    if getattr(attn, "fused_projections", False):
        return attn.to_qkv(hidden_states)
    parts = _packed_parts(attn)
    if parts is not None:
        return F.linear(hidden_states, *parts)
    return torch.cat(qkv_projections(attn, hidden_states), dim=-1)


def self_attention(attn, hidden_states: torch.Tensor, rope, ctx: ForwardContext, cached, *,
                   fused: bool, last: bool, fp8: dict | None = None) -> torch.Tensor | None:
    """``attn1`` of a block over the forward's store: hidden_states [B, S, dim] (an
    `Fp8Rows` where the fused norm wrote the fp8 GEMM's input) -> [B, S, dim]; ``cached``
    the layer's `CachedAttention`; rope: cos/sin tables (torch glue) or a `RopeGrid`
    (fused); ``last``: the model's last layer (None back once its K/V are staged in a
    forward kept for them); ``fp8``: the block's fp8 GEMMs, or None."""
    fp8 = fp8 or {}
    if fused:
        qkv = (fp8["qkv"](hidden_states) if fp8 else packed_qkv(attn, hidden_states))
        qkv = qkv.unflatten(2, (3 * attn.heads, -1))                      # [B, S, 3H, D]
        prologue = functools.partial(
            ops.qk_norm_rope_stage_, q_weight=attn.norm_q.weight, k_weight=attn.norm_k.weight,
            num_heads=attn.heads, num_kv_heads=attn.heads, norm="all", eps=attn.norm_q.eps,
            rope=rope)
    else:
        q, k, v = (fp8["qkv"](hidden_states).chunk(3, dim=-1) if fp8
                   else qkv_projections(attn, hidden_states))
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))  # [B, S, H, D]
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        qkv, prologue = torch.cat([q, k, v], dim=2), None                  # [B, S, 3H, D]
    out = ctx.attention(cached, qkv, prologue, last=last)                  # [B, S, H, D]
    if out is None:
        return None
    return attn.to_out[1](linear(attn.to_out[0], out.flatten(2, 3).to(hidden_states.dtype),
                                 fp8.get("out")))


class PromptKV:
    """One cross-attention layer's prompt K/V, projected once per prompt into fixed
    buffers (a captured chunk reads the new prompt's): [N, L, H, D], one prompt per pool
    sequence. A forward of B rows reads the rows ``ctx.rows`` names (rows 0 .. B-1 when
    it is None).

    Args:
        sequences: N, the pool's sequences.
    """

    def __init__(self, sequences: int):
        self.sequences = sequences
        self.k = self.v = None  # [N, L, H, D], fixed once allocated

    def allocate(self, attn, length: int, like: torch.Tensor) -> None:
        """Zero buffers for prompts of ``length`` tokens (in ``like``'s dtype and device)."""
        shape = (self.sequences, length, attn.heads, attn.to_k.out_features // attn.heads)
        self.k, self.v = like.new_zeros(shape), like.new_zeros(shape)

    @torch.no_grad()
    def write(self, attn, text: torch.Tensor, rows) -> None:
        """Project and norm ``text`` [R, L, dim] (the model's embedded prompts; R = 1:
        one prompt for every row) into the buffers of sequences ``rows`` (host ints); L
        must be the buffers' (they do not move)."""
        if getattr(attn, "fused_projections", False):
            k, v = attn.to_kv(text).chunk(2, dim=-1)
        else:
            k, v = attn.to_k(text), attn.to_v(text)
        k = attn.norm_k(k).unflatten(2, (attn.heads, -1))                    # [R, L, H, D]
        v = v.unflatten(2, (attn.heads, -1))
        if self.k is None:
            self.allocate(attn, k.shape[1], k)
        elif self.k.shape[1:] != k.shape[1:]:
            raise ValueError(f"a prompt must keep the prompt length of the first one "
                             f"({self.k.shape[1]} tokens), got {k.shape[1]}")
        self.k[list(rows)] = k
        self.v[list(rows)] = v

    def kept(self, rows) -> tuple | None:
        """What `put_back` needs to undo writes to sequences ``rows`` (host ints): a copy
        of their K/V, or None before the buffers exist."""
        if self.k is None:
            return None
        return self.k[list(rows)].clone(), self.v[list(rows)].clone()

    def put_back(self, rows, kept: tuple | None) -> None:
        """Sequences ``rows`` as `kept` found them (no buffers again if there were none)."""
        if kept is None:
            self.k = self.v = None
        else:
            self.k[list(rows)], self.v[list(rows)] = kept

    def clear(self, rows) -> None:
        """Zero the K/V of sequences ``rows`` (host ints): no prompt left to read."""
        if self.k is not None:
            self.k[list(rows)] = 0
            self.v[list(rows)] = 0

    def __call__(self, attn, hidden_states: torch.Tensor, rows: torch.Tensor | None,
                 fp8: dict | None = None) -> torch.Tensor:
        """``attn2`` over hidden_states [B, S, dim] (or an `Fp8Rows` for an fp8 "cross_q")
        and the prompts of the forward's rows; ``fp8``: the block's fp8 GEMMs
        ("cross_q", "cross_out"), or None."""
        fp8 = fp8 or {}
        q = attn.norm_q(linear(attn.to_q, hidden_states, fp8.get("cross_q")))
        q = q.unflatten(2, (attn.heads, -1))
        B = q.shape[0]
        if rows is None:
            k, v = self.k[:B], self.v[:B]                                    # [B, L, H, D]
        else:
            k, v = self.k.index_select(0, rows[:B]), self.v.index_select(0, rows[:B])
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))              # [B, H, S, D]
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](linear(attn.to_out[0], out, fp8.get("cross_out")))
