"""`WanChunks`: a diffusers `WanTransformer3DModel` as a `framekv.engine.runner.ChunkModel`.

framekv runs the model's own modules and weights in its own top-level forward, the
stock ``WanTransformer3DModel.forward`` step by step, so that every block gets the
forward's `ForwardContext` (its K/V store, rope frames, batch rows) as an argument::

    x [B, C, F, H, W] -> patch_embedding -> [B, S, dim]         (S = F * h * w, frame-major)
    t [1] -> timesteps_proj -> time_embedder -> temb [B, dim] -> time_proj -> [B, 6, dim]
    blocks (`blocks.block_forward`): self-attention over the store, cross-attention over
        the prompt's K/V (projected once per prompt), MLP
    norm_out modulated by temb -> proj_out -> unpatchify -> velocity [B, C, F, H, W]

The rope is framekv's `Rope3D` at absolute frames (frame f of batch row r at rope frame
``ctx.frame0[r] + f``, a device tensor: one captured graph serves every chunk), the
stock table's angles without its length cap. A prompt lives in cross-attention, so the
K/V of finished frames depend on it (``keeps_history``). With the fused glue each
self-attention's q, k and v projections are packed into one weight
(`attention.pack_projections`); the model is otherwise untouched. With ``fp8`` every
block's GEMMs run in fp8 (`blocks.fp8_linears`: fp8 copies of their weights, kept
here, beside the model's own).
"""
from __future__ import annotations

import torch

from framekv import ops

from ..attention import CachedAttention
from ..kv import ForwardContext, KVStore, Recorder
from ..model.blocks import Rope3D
from .attention import PromptKV, pack_projections
from .blocks import block_forward, fp8_linears
from .setup import WanShape


class WanChunks:
    """The model of a `WanRollout` (module doc).

    Args:
        model: the ``WanTransformer3DModel`` (text-to-video).
        shape: the rollout's `WanShape`; glue: "fused" or "torch".
        backend: the attention backend every layer's `CachedAttention` shares.
        sequences: N, the pool's sequences (one prompt each).
        prompt_tokens: L of every prompt, or None (the first prompt's).
        device, dtype: where the model runs and its compute dtype.
        fp8: run the blocks' GEMMs in fp8 (their weights quantized here: ValueError
            naming a layer that cannot be one).

    Attributes:
        fp8: each block's fp8 GEMMs (`blocks.fp8_linears`), or None.
    """

    keeps_history = True
    prompt_in_store = False  # cross-attention K/V in the model, recomputed at a restore
    timestep_scale = 1000.0

    def __init__(self, model, shape: WanShape, *, glue: str, backend, sequences: int,
                 prompt_tokens: int | None, device, dtype, fp8: bool = False):
        self.model, self.glue, self.device, self.dtype = model, glue, device, dtype
        self.tokens_per_frame = shape.tokens_per_frame
        self.latent_shape = (shape.channels, *shape.latent_size)
        self.text_dim = model.config.text_dim
        if glue == "fused":
            for block in model.blocks:
                pack_projections(block.attn1)
        self.fp8 = ([fp8_linears(b, f"blocks.{i}") for i, b in enumerate(model.blocks)]
                    if fp8 else None)
        self.layers = [CachedAttention(shape.heads, shape.heads, shape.head_dim, backend=backend,
                                       layer_idx=i) for i in range(shape.num_layers)]
        self.attention = self.layers[0]
        self.prompts = [PromptKV(sequences) for _ in model.blocks]
        if prompt_tokens is not None:
            like = torch.empty(0, device=device, dtype=dtype)
            for block, p in zip(model.blocks, self.prompts):
                p.allocate(block.attn2, prompt_tokens, like)
        _, ph, pw = shape.patch_size
        grid = (shape.latent_size[0] // ph, shape.latent_size[1] // pw)
        self.rope = Rope3D(shape.head_dim, grid, device,
                           theta=getattr(model.rope, "theta", 10000.0))

    @property
    def prompt_shape(self) -> tuple[int, int] | None:
        """(L, text_dim) of a prompt, once L is known."""
        k = self.prompts[0].k
        return None if k is None else (k.shape[1], self.text_dim)

    def default_prompt(self) -> torch.Tensor:
        """[L, text_dim] standard normal embeddings from a fixed seed (stand-ins for a
        text encoder's output)."""
        if self.prompt_shape is None:
            raise ValueError("a default prompt needs prompt_tokens (its length L)")
        return torch.randn(self.prompt_shape, generator=torch.Generator().manual_seed(0))

    def q_bounds(self) -> list[float] | None:
        """Each block's |q| bound after its QK norm over all heads (fused glue), else None."""
        if self.glue != "fused":
            return None
        return [ops.q_bound(b.attn1.norm_q.weight, "all", self.layers[0].head_dim)
                for b in self.model.blocks]

    @torch.no_grad()
    def write_prompt(self, kv: KVStore, rows, prompt: torch.Tensor, *, rewrite: bool = False,
                     recorder: Recorder | None = None) -> None:
        """The prompt [L, text_dim] (a text encoder's output) of pool sequences ``rows``:
        embedded and projected to every block's cross-attention K/V, once. All or
        nothing: if a block's write fails, every block's K/V of ``rows`` are put back."""
        # Embedded and projected once, written to every row: a row's prompt K/V are the
        # same bits however many rows share the write (a restored stream writes alone).
        text = prompt.to(self.device, self.dtype)[None]
        emb = self.model.condition_embedder.text_embedder(text)              # [1, L, dim]
        kept = [p.kept(rows) for p in self.prompts]
        try:
            for block, p in zip(self.model.blocks, self.prompts):
                p.write(block.attn2, emb, rows)
        except BaseException:
            for p, old in zip(self.prompts, kept):
                p.put_back(rows, old)
            raise

    def clear_prompt(self, rows) -> None:
        """Zero every block's cross-attention K/V of pool sequences ``rows``: nothing of
        their prompt is left for a later forward to read."""
        for p in self.prompts:
            p.clear(rows)

    def forward(self, x: torch.Tensor, t: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor | None:
        """The velocity of latents x [B, C, F, H, W] (model dtype) at model timestep t
        (fp32 [1]): [B, C, F, H, W]; None without ``ctx.output`` (module doc)."""
        if self.prompts[0].k is None:
            raise ValueError("no prompt: call set_prompt(text_embeds) before a step")
        m, fused = self.model, self.glue == "fused"
        B, _, frames, H, W = x.shape
        pt, ph, pw = m.config.patch_size
        rope = self.rope.for_forward(ctx.frame0, frames, B, fused, ctx)
        h = m.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()     # [B, S, dim]
        temb, proj = self._time(t.expand(B))                                  # [B, dim], [B, 6, dim]
        last = len(m.blocks) - 1
        for i, (block, cached, prompt) in enumerate(zip(m.blocks, self.layers, self.prompts)):
            h = block_forward(block, h, proj, rope, ctx, cached, prompt, fused=fused,
                              last=i == last, fp8=None if self.fp8 is None else self.fp8[i])
            if h is None:
                return None
        shift, scale = (m.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
        h = (m.norm_out(h.float()) * (1 + scale) + shift).type_as(h)
        h = m.proj_out(h).reshape(B, frames // pt, H // ph, W // pw, pt, ph, pw, -1)
        return h.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def _time(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(temb [B, dim], time projection [B, 6, dim]) of timesteps t [B], as the stock
        condition embedder computes them (its text half runs once per prompt)."""
        ce = self.model.condition_embedder
        tp = ce.timesteps_proj(t)
        tp = tp.to(next(iter(ce.time_embedder.parameters())).dtype)
        temb = ce.time_embedder(tp).to(self.dtype)
        return temb, ce.time_proj(ce.act_fn(temb)).unflatten(1, (6, -1))
