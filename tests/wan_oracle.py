"""The model's own math for a Wan rollout: a stock copy of the model run over the whole
sequence (every finished frame and the chunk) with a dense mask in its own processor
and per-token timesteps. Shared by the CPU and GPU suites.

Token p of a finished chunk sees, as in the clean pass that wrote its K/V, the sink,
the window behind its clean block and its clean block; a token of the chunk being
denoised sees the sink, the window behind the chunk and the chunk (docs/DESIGN.md,
"The cache": V(j) = [0, min(P, s)) U [max(P, s - W), s) U [s, s + b)).
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from framekv.engine.wan.attention import qkv_projections


def stock_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The stock processor's interleaved-pair rotary of x [B, S, H, D] by the stock
    table's cos / sin [1, S, 1, D] (each angle twice)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class MaskedSelfAttention:
    """A stock-math self-attention processor with a boolean mask [S, S] from ``holder``."""

    def __init__(self, holder: dict):
        self.holder = holder

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        q, k, v = qkv_projections(attn, hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = stock_rotary(q, *rotary_emb), stock_rotary(k, *rotary_emb)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), attn_mask=self.holder["mask"])
        out = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def visible_mask(C: int, M: int, *, P: int, W: int | None, clean: int) -> torch.Tensor:
    """bool [C + M, C + M]: which key each token of (history [0, C), chunk [C, C + M)) sees.
    ``W`` None: no window (everything before the block)."""
    S = C + M
    mask = torch.zeros(S, S, dtype=torch.bool)
    for p in range(S):
        if p < C:
            s = (p // M) * M + ((p % M) // clean) * clean   # its clean block's start
            b = clean
        else:
            s, b = C, M
        lo = 0 if W is None else max(P, s - W)
        mask[p, :min(P, s)] = True
        mask[p, lo:s] = True
        mask[p, s:s + b] = True
    return mask


class Oracle:
    """The stock copy and the finished chunks; ``chunk(noise)`` runs the sampler over it.

    Args:
        model: the model before a rollout patches it (deep-copied here).
        tokens_per_frame, frames_per_chunk, sink_frames, window_frames: the rollout's.
        timesteps: the model timesteps; clean_block: "chunk" or "frame".
        window: False to drop the window (a negative control).
    """

    def __init__(self, model, text, *, tokens_per_frame, frames_per_chunk, sink_frames,
                 window_frames, timesteps, clean_block="chunk", window=True):
        self.model = copy.deepcopy(model)
        self.holder = {"mask": None}
        for block in self.model.blocks:
            block.attn1.set_processor(MaskedSelfAttention(self.holder))
        self.text, self.tpf, self.F = text, tokens_per_frame, frames_per_chunk
        self.P, self.M = sink_frames * tokens_per_frame, frames_per_chunk * tokens_per_frame
        self.W = window_frames * tokens_per_frame if window else None
        self.clean = self.M if clean_block == "chunk" else tokens_per_frame
        self.ts = [float(t) for t in timesteps]
        self.sig = [t / 1000 for t in self.ts] + [0.0]
        self.history: list[torch.Tensor] = []   # clean latents [1, C, F, H, W] per chunk

    @torch.no_grad()
    def velocity(self, x: torch.Tensor, t: float) -> torch.Tensor:
        """The chunk's velocity at model timestep t, the history at timestep 0."""
        C, dev = len(self.history) * self.M, x.device
        dtype = self.model.patch_embedding.weight.dtype
        full = torch.cat([*self.history, x], dim=2).to(dtype)
        tstep = torch.tensor([[0.0] * C + [t] * self.M], device=dev)
        self.holder["mask"] = visible_mask(C, self.M, P=self.P, W=self.W,
                                           clean=self.clean).to(dev)
        v = self.model(full, tstep, self.text, return_dict=False)[0]
        return v[:, :, -self.F:].float()

    def chunk(self, noise: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Euler over one chunk: (clean latents, each step's velocity)."""
        x, vs = noise, []
        for i, t in enumerate(self.ts):
            vs.append(self.velocity(x, t))
            x = x + (self.sig[i + 1] - self.sig[i]) * vs[-1]
        self.history.append(x)
        return x, vs


def guidance_pair(build, text, negative, *, g: float, chunks: int, latent_size, frames: int,
                  sink: int, window: int, timesteps, use_graphs: bool, noise) -> float:
    """Largest |difference| between a guided `WanRollout` (both branches as two
    sequences of one pool) and the two branches run separately, each over its own
    one-sequence rollout and prompt, combined in lockstep: v = v_u + g (v_c - v_u).
    ``build()`` makes a fresh model (equal weights every call); ``noise(i)`` chunk i's."""
    from framekv.engine import WanRollout

    kw = dict(latent_size=latent_size, frames_per_chunk=frames, sink_frames=sink,
              window_frames=window, timesteps=timesteps)
    guided = WanRollout(build(), guidance_scale=g, use_graphs=use_graphs, **kw)
    cond, unc = (WanRollout(build(), use_graphs=False, **kw) for _ in range(2))
    guided.set_prompt(text, negative)
    cond.set_prompt(text)
    unc.set_prompt(negative)
    worst = 0.0
    for i in range(chunks):
        got = guided.step(noise(i))
        want = _lockstep(cond, unc, noise(i), g)
        worst = max(worst, float((got - want).abs().max()))
    return worst


@torch.no_grad()
def _lockstep(cond, unc, noise, g: float) -> torch.Tensor:
    """One chunk of two one-sequence rollouts, their velocities combined at every step
    (the runners' own forwards and clean pass)."""
    frame0 = torch.tensor([cond.frames_done], device=cond.device)
    T, sig = cond.shape.chunk_tokens, cond.sigmas
    x = noise.to(cond.device, torch.float32)
    for i in range(len(cond._t)):
        v_c, v_u = (r._forward(x, r._t[i], frame0, T) for r in (cond, unc))
        x = x + (sig[i + 1] - sig[i]) * (v_u + g * (v_c - v_u))
    for r in (cond, unc):
        r._clean_pass(x, frame0)
        r.sequence_frames[0] += r.frames_per_chunk
    return x
