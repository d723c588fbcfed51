"""What framekv puts inside a diffusers `WanTransformer3DModel`: self-attention
processors over a K/V store, cross-attention over text K/V computed once per prompt, and
a rotary embedding at absolute frame positions.

The model's blocks call ``attn1(norm_hs, None, None, rotary_emb)``: no argument reaches
a processor but those. So a `WanContext` the rollout owns is the side channel: before
each model forward the rollout sets it (``begin(seq_len, block_size)``: the K/V store's
attention function for that forward) and the processors read it. Nothing here depends
on diffusers at import time; the math is the stock processors' (``WanAttnProcessor``):

    self-attention   q, k, v projections (fused or not) -> RMSNorm over all heads (q, k)
                     -> heads [1, S, H, D] -> rotary on interleaved pairs -> the store's
                     cached attention over exactly V(j) -> to_out
    cross-attention  q projection and norm per forward; k, v of the prompt projected and
                     normed once per prompt (`WanCrossAttention.set_text`) -> SDPA -> to_out
    rope             cos / sin of (frame0 + f, row, col) for every token: fp64 angles,
                     fp32 tables, each angle repeated for its pair, as the stock table
                     (`get_1d_rotary_pos_embed(..., repeat_interleave_real=True)`) but
                     from a device frame index (graph-replayable) and without a length cap

With ``ctx.glue == "fused"`` the self-attention hands q and k as projected to one
`framekv.ops.qk_norm_rope_stage_` (the norm over all heads, the rope from the same
positions, computed in the kernel from a `RopeGrid` the rope returns instead of tables),
which a store that stages it (`PagedKV`) runs as its K/V staging.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from framekv import ops

from ..kv import AttendFn


class WanContext:
    """The side channel between a rollout and the processors in its model.

    Attributes:
        kv: the rollout's `KVStore`.
        frame0: int64 [1] or [B] device tensor, the rope frame of the forward's first
            frame (of each batch row).
        rows: None, or int64 [B] device tensor: the pool sequence of each batch row,
            whose prompt the cross-attention reads (a fixed buffer graphs read).
        attend: the store's attention function of the forward under way (`begin`).
        output: False while the forward under way is kept only for its K/V (`begin`).
        glue: "fused" (QK norm and rope through framekv's kernel) or "torch".
    """

    def __init__(self, kv, frame0: torch.Tensor, glue: str = "torch"):
        self.kv, self.frame0, self.glue = kv, frame0, glue
        self.rows: torch.Tensor | None = None
        self.attend: AttendFn | None = None
        self.output = True

    def begin(self, seq_len: int, block_size: int, *, output: bool = True) -> None:
        """The next model forward writes ``seq_len`` tokens in blocks of ``block_size``;
        ``output=False``: only its K/V are kept (a clean pass), so with the fused glue
        the last block stops once its K/V are staged."""
        self.attend = self.kv.forward(seq_len, block_size)
        self.output = output


def qkv_projections(attn, hidden_states: torch.Tensor):
    """q, k, v [1, S, H*D] of a self-attention module, fused or not (the stock rule)."""
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
    GEMM writes the packed QKV the fused glue reads: no ``cat`` of three outputs (3.3 ms
    of a Wan 1.3B chunk on the H200) and, unlike diffusers' ``fuse_qkv_projections``, no
    second copy of the weights. The values and the modules' own use are unchanged; a
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


def packed_qkv(attn, hidden_states: torch.Tensor) -> torch.Tensor:
    """q, k and v of a self-attention module side by side, [B, S, 3*H*D]: one GEMM where
    the projections are fused or packed (`pack_projections`), else a ``cat``."""
    if getattr(attn, "fused_projections", False):
        return attn.to_qkv(hidden_states)
    parts = _packed_parts(attn)
    if parts is not None:
        return F.linear(hidden_states, *parts)
    return torch.cat(qkv_projections(attn, hidden_states), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair rotary of x [1, S, H, D] by cos / sin [1, S, 1, D] (each angle
    twice, as the stock table holds it); the stock processor's arithmetic."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class WanSelfAttention:
    """``attn1``'s processor: the stock math, attention through the context's store.

    Args:
        ctx: the `WanContext`.
        cached: the layer's `CachedAttention` (H = H_kv = the block's heads).
        last: whether this is the model's last self-attention: with the fused glue, in
            a forward kept for its K/V only (``ctx.output`` False), it stages its K/V,
            skips the attention where the store can, and returns None (the fused
            block then returns at once: nothing after it is read).
    """

    def __init__(self, ctx: WanContext, cached, *, last: bool = False):
        self.ctx, self.cached, self.last = ctx, cached, last

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, **kwargs):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("framekv's Wan self-attention takes no encoder states or mask: "
                             "causality comes from the rollout's blocks")
        if self.ctx.glue == "fused":
            return self._fused(attn, hidden_states, rotary_emb)
        q, k, v = qkv_projections(attn, hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))  # [1, S, H, D]
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        packed = torch.cat([q, k, v], dim=2)                                 # [1, S, 3H, D]
        out = self.ctx.attend(self.cached, packed)                           # [1, S, H, D]
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))

    def _fused(self, attn, hidden_states, rope):
        qkv = packed_qkv(attn, hidden_states).unflatten(2, (3 * attn.heads, -1))  # [B, S, 3H, D]
        prologue = functools.partial(
            ops.qk_norm_rope_stage_, q_weight=attn.norm_q.weight, k_weight=attn.norm_k.weight,
            num_heads=attn.heads, num_kv_heads=attn.heads, norm="all", eps=attn.norm_q.eps,
            rope=rope)
        kv, keep = self.ctx.kv, self.ctx.output or not self.last
        if not kv.stages_prologue:
            prologue(qkv)
            out = self.ctx.attend(self.cached, qkv)
        elif keep or not kv.stages_without_output:
            out = self.ctx.attend(self.cached, qkv, prologue)                # [B, S, H, D]
        else:
            return self.ctx.attend(self.cached, qkv, prologue, output=False)  # None
        if not keep:
            return None  # the K/V are staged; the output feeds nothing
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))


class WanCrossAttention:
    """``attn2``'s processor: the stock text attention, with the prompt's K/V projected
    once per prompt into fixed buffers (a captured chunk reads the new prompt's).

    The buffers hold one prompt per pool sequence ([N, L, H, D]); a forward of B rows
    reads the rows ``ctx.rows`` names (all N in order when it is None and B = N).
    """

    def __init__(self, ctx: WanContext | None = None, sequences: int = 1):
        self.ctx, self.sequences = ctx, sequences
        self.k = self.v = None  # [N, L, H, D], fixed once the first prompt is set

    @torch.no_grad()
    def set_text(self, attn, text: torch.Tensor, rows=None) -> None:
        """Project and norm ``text`` [R, L, dim] (the model's embedded prompts) into the
        buffers of sequences ``rows`` (host ints; default 0 .. R-1); L must stay what
        the first prompt had (the buffers do not move)."""
        if getattr(attn, "fused_projections", False):
            k, v = attn.to_kv(text).chunk(2, dim=-1)
        else:
            k, v = attn.to_k(text), attn.to_v(text)
        k = attn.norm_k(k).unflatten(2, (attn.heads, -1))                    # [R, L, H, D]
        v = v.unflatten(2, (attn.heads, -1))
        rows = list(range(k.shape[0])) if rows is None else list(rows)
        if self.k is None:
            self.k = k.new_zeros(self.sequences, *k.shape[1:])
            self.v = v.new_zeros(self.sequences, *v.shape[1:])
        elif self.k.shape[1:] != k.shape[1:]:
            raise ValueError(f"text must keep the prompt length of the first set_prompt "
                             f"({self.k.shape[1]} tokens), got {k.shape[1]}")
        self.k[rows] = k
        self.v[rows] = v

    def _text(self, B: int):
        """The K/V [B, L, H, D] of the forward's rows."""
        rows = None if self.ctx is None else self.ctx.rows
        if rows is None:
            return self.k[:B], self.v[:B]
        return self.k.index_select(0, rows[:B]), self.v.index_select(0, rows[:B])

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, **kwargs):
        if self.k is None:
            raise ValueError("no prompt: call set_prompt(text_embeds) before a step")
        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        k, v = self._text(q.shape[0])
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2))              # [B, H, S, D]
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


class WanRope(torch.nn.Module):
    """The model's ``rope``, at absolute frames: frame f of a forward's batch row r sits
    at rope frame ``ctx.frame0[r] + f`` (a device tensor, so one captured graph serves
    every chunk; one entry serves every row).

    Args:
        ctx: the `WanContext`.
        head_dim, patch_size, theta: the stock rope's (its (t, h, w) split of head_dim).
    """

    def __init__(self, ctx: WanContext, head_dim: int, patch_size, theta: float = 10000.0):
        super().__init__()
        self.ctx, self.patch_size = ctx, tuple(patch_size)
        hw = 2 * (head_dim // 6)
        self.dims = (head_dim - 2 * hw, hw, hw)
        self.theta = theta
        self._inv: torch.Tensor | None = None  # the fused rope's [D/2] fp64 frequencies

    def _inv_freq(self, dim: int, device) -> torch.Tensor:
        return 1.0 / self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64,
                                                 device=device)[: dim // 2] / dim)

    def forward(self, hidden_states: torch.Tensor):
        B, _, frames, height, width = hidden_states.shape
        pt, ph, pw = self.patch_size
        f, h, w = frames // pt, height // ph, width // pw
        dev = hidden_states.device
        if self.ctx.glue == "fused":  # positions for the kernel, no tables
            frame0 = self.ctx.frame0
            frame0 = frame0 if frame0.shape[0] == B else frame0.expand(B).contiguous()
            if self._inv is None or self._inv.device != dev:
                self._inv = torch.cat([self._inv_freq(d, dev) for d in self.dims])  # [D/2] fp64
            return ops.RopeGrid(inv_freq=self._inv, axes=tuple(d // 2 for d in self.dims),
                                grid=(h, w), frame0=frame0, style="interleaved")
        frame0 = self.ctx.frame0.to(torch.float64)                           # [R]
        R = frame0.shape[0]
        frames = frame0[:, None] + torch.arange(f, device=dev, dtype=torch.float64)  # [R, f]
        rows = torch.outer(torch.arange(h, device=dev, dtype=torch.float64),
                           self._inv_freq(self.dims[1], dev))                # [h, Dh/2]
        cols = torch.outer(torch.arange(w, device=dev, dtype=torch.float64),
                           self._inv_freq(self.dims[2], dev))                # [w, Dw/2]
        fa = frames[..., None] * self._inv_freq(self.dims[0], dev)           # [R, f, Df/2]
        angles = torch.cat([fa[:, :, None, None].expand(R, f, h, w, -1),     # [R, f, h, w, D/2]
                            rows[None, None, :, None].expand(R, f, h, w, -1),
                            cols[None, None, None, :].expand(R, f, h, w, -1)], dim=-1)
        angles = angles.reshape(R, f * h * w, 1, -1).repeat_interleave(2, dim=-1)  # [R, S, 1, D]
        return angles.cos().float(), angles.sin().float()
