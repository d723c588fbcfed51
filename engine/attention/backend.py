"""Attention backends: the interface (plan once, run per layer), the fp32 reference and
plain torch SDPA.

A backend computes dense attention and, when it declares ``supports_kv_cache``,
attention over a `CausalKVCache`'s per-block rows: block j of a forward reads the pages
of ``rows[j]`` in order, cut at ``seq_len_kv[j]`` keys, exactly what a paged kernel
reads. Cached attention is split as FlashInfer splits it::

    plan = backend.plan(cache, tokens=T, block_size=b, num_heads=H, scale=s, batch=B)  # once
    plan.prepare()                      # once per forward (device work, graph-safe)
    plan.run(q, layer, out)             # every layer of that forward

`plan` is a host-side lookup (cached per cache, geometry, T, b, H, scale and the
number B of sequences) that decides everything a forward's launches bake in;
`prepare` selects the forward's sequences (`CausalKVCache.select`: the cache's
sequences in use, their per-block tensors gathered) and refreshes what the plan derives
from them (they change at every commit), so a forward captured in a graph holds its
own refresh;
`run` launches one layer over all B sequences' blocks.
The cuDNN backend lives in ``cudnn.py`` (cudnn-frontend is a GPU extra).
"""
from __future__ import annotations

import abc

import torch

from ..cache import quant

_QUERY_CHUNK = 256  # query rows per fp32 score tile: bounds the reference's memory


class AttentionPlan(abc.ABC):
    """One forward shape over one cache: what every layer of that forward launches.

    Attributes:
        cache: the `CausalKVCache` it reads (its open geometry when planned).
        tokens, block_size, num_heads, scale: the forward it was planned for.
        batch: B, the sequences of each forward (rows of its query batch).
        splits: split-KV sub-rows per causal block row (1: none); graph keys hold it.
        packed: whether GQA query heads are stacked per K/V head row; graph keys hold it.
        selected: the `Selection` of the last `prepare` (None before one).
    """

    splits: int = 1
    packed: bool = False

    def __init__(self, cache, *, tokens: int, block_size: int, num_heads: int, scale: float,
                 batch: int = 1):
        self.cache, self.tokens, self.block_size = cache, tokens, block_size
        self.num_heads, self.scale, self.batch = num_heads, scale, batch
        self.selected = None

    def matches(self, cache, tokens: int, block_size: int, num_heads: int, scale: float,
                batch: int = 1) -> bool:
        """Whether this plan is the one for such a forward."""
        return (cache is self.cache and tokens == self.tokens and block_size == self.block_size
                and num_heads == self.num_heads and scale == self.scale and batch == self.batch)

    def prepare(self, sequences=None) -> None:
        """Select this forward's sequences (the cache's sequences in use; ``sequences``,
        host ints: put these in use first) and refresh what the plan derives from their
        per-block tensors; once per forward, before its layers run (capturable)."""
        selected = self.cache.select(self.block_size, self.tokens, sequences=sequences)
        if selected.size != self.batch:
            raise ValueError(f"the plan is for a batch of {self.batch} sequences, the cache "
                             f"has {selected.size} in use ({selected.rows})")
        self.selected = selected
        self.refresh()

    def refresh(self) -> None:
        """What a backend derives from the selected per-block tensors (device work)."""

    def stage_outputs(self, layer: int) -> dict:
        """Extra outputs of the fused staging of ``layer`` for this plan (keyword
        arguments of `framekv.ops.qk_norm_rope_stage_`, e.g. a quantized Q for an fp8
        kernel); none by default."""
        return {}

    @abc.abstractmethod
    def run(self, q: torch.Tensor, layer: int, out: torch.Tensor) -> None:
        """Attend q [B * T, H, D] (block j of batch row r = rows [(r*nb + j)*b, ...+b))
        over the selected sequences' rows of ``layer``; write out [B * T, H, D]. The
        K/V of these tokens are already staged."""


_HALF = (torch.bfloat16, torch.float16)


class AttentionBackend(abc.ABC):
    """What `CachedAttention` calls. Shapes: q [1, S, H, D], k/v [1, S, H_kv, D]."""

    name: str = "abstract"
    supports_kv_cache: bool = False

    def dtypes(self, device: torch.device) -> tuple[torch.dtype, ...]:
        """The q, k, v dtypes this backend attends in on ``device`` (`CachedAttention`
        refuses others by name): bf16 and fp16, and fp32 on a CPU."""
        return _HALF + ((torch.float32,) if device.type == "cpu" else ())

    @abc.abstractmethod
    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Full attention over the call's own tokens -> [1, S, H, D]."""

    def check_cache(self, cache) -> None:
        """Raise ValueError for a cache this backend cannot read (device, page size)."""
        raise ValueError(f"backend {self.name!r} does not support a kv_cache")

    def plan(self, cache, *, tokens: int, block_size: int, num_heads: int,
             scale: float, batch: int = 1) -> AttentionPlan:
        """The `AttentionPlan` of forwards of ``tokens`` queries per sequence in
        ``block_size`` blocks over ``batch`` sequences of ``cache``'s open geometry. A
        backend whose plans own device buffers or built kernels returns the same plan
        for the same forward."""
        raise ValueError(f"backend {self.name!r} does not support a kv_cache")


def attend_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v in fp32, GQA, chunked over queries.

    q [n, H, D]; k, v [L, H_kv, D]; key_mask bool [L] (False: not a key) -> [n, H, D] fp32.
    A masked key contributes nothing, whatever its K and V hold (a NaN or inf included):
    its score is -inf and its value row zero, so no 0 * NaN reaches the output.
    """
    n, H, D = q.shape
    group = H // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    vf = v.float()
    if key_mask is not None:
        vf = vf.masked_fill(~key_mask[:, None, None], 0.0)  # a new tensor: v stays as it is
    vf = vf.repeat_interleave(group, dim=1)
    out = torch.empty(n, H, D, dtype=torch.float32, device=q.device)
    for i in range(0, n, _QUERY_CHUNK):
        qf = q[i:i + _QUERY_CHUNK].float()
        s = torch.einsum("qhd,lhd->hql", qf, kf) * scale  # [H, q, L]
        if key_mask is not None:
            s.masked_fill_(~key_mask[None, None, :], float("-inf"))
        out[i:i + _QUERY_CHUNK] = torch.einsum("hql,lhd->qhd", torch.softmax(s, dim=-1), vf)
    return out


class ReferencePlan(AttentionPlan):
    """The reference backend's plan: nothing to prepare; each block's row gathered
    (an fp8 pool's dequantized) and attended in fp32."""

    def run(self, q, layer, out):
        cache, b = self.cache, self.block_size
        if self.selected is None and cache.num_sequences > 1:
            raise ValueError("prepare(sequences) the plan before run()")
        # One sequence: its own tensors, nothing to select.
        bt = (self.selected.blocks if self.selected is not None
              else cache.batch_blocks(1, b, self.tokens))
        tpp = cache.tokens_per_page
        offsets = torch.arange(tpp, device=q.device)
        for j in range(q.shape[0] // b):
            slots = (bt.rows[j].to(torch.int64)[:, None] * tpp + offsets).reshape(-1)  # [RP*tpp]
            mask = torch.arange(slots.numel(), device=q.device) < bt.seq_len_kv[j]
            k, v = cache.k_pool[layer][slots], cache.v_pool[layer][slots]  # [RP*tpp, H_kv, D]
            if cache.quantized:  # fp8: the values the pool stands for
                k, v = (quant.dequantize(x, cache.kv_scales[layer, c]) for c, x in enumerate((k, v)))
            rows = slice(j * b, (j + 1) * b)
            out[rows] = attend_fp32(q[rows], k, v, self.scale, mask).to(out.dtype)


class ReferenceBackend(AttentionBackend):
    """torch fp32 math, any device: the oracle the fast backends are measured against."""

    name = "reference"
    supports_kv_cache = True

    def dtypes(self, device):
        """bf16, fp16 and fp32 on any device: fp32 math (an fp32 model's oracle on CUDA
        too)."""
        return _HALF + (torch.float32,)

    def dense(self, q, k, v, scale):
        return attend_fp32(q[0], k[0], v[0], scale).to(q.dtype)[None]

    def check_cache(self, cache) -> None:
        return None  # any device, any page size

    def plan(self, cache, *, tokens, block_size, num_heads, scale, batch=1):
        return ReferencePlan(cache, tokens=tokens, block_size=block_size, num_heads=num_heads,
                             scale=scale, batch=batch)


class TorchSDPABackend(AttentionBackend):
    """torch.nn.functional.scaled_dot_product_attention, dense only (no cache)."""

    name = "sdpa"
    supports_kv_cache = False

    def dense(self, q, k, v, scale):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [1, H, S, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, scale=scale, enable_gqa=kt.shape[1] != qt.shape[1])
        return o.transpose(1, 2)
