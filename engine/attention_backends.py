"""Attention backends: the interface, the fp32 reference, and plain torch SDPA.

A backend computes dense attention and, when it declares ``supports_kv_cache``,
attention over a `CausalKVCache`'s per-block rows: block j of a forward reads the
pages of ``rows[j]`` in order, cut at ``seq_len_kv[j]`` keys, exactly what a paged
kernel reads. The cuDNN backend lives in ``attention_cudnn.py`` (imported lazily:
cudnn-frontend is a GPU extra).
"""
from __future__ import annotations

import abc

import torch

_QUERY_CHUNK = 256  # query rows per fp32 score tile: bounds the reference's memory


class AttentionBackend(abc.ABC):
    """What `CachedAttention` calls. Shapes: q [1, S, H, D], k/v [1, S, H_kv, D]."""

    name: str = "abstract"
    supports_kv_cache: bool = False

    @abc.abstractmethod
    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Full attention over the call's own tokens -> [1, S, H, D]."""

    def check_cache(self, cache) -> None:
        """Raise ValueError for a cache this backend cannot read (device, page size)."""
        raise ValueError(f"backend {self.name!r} does not support a kv_cache")

    def cached(self, q: torch.Tensor, cache, layer: int, block_size: int, scale: float,
               out: torch.Tensor) -> None:
        """Attend q [T, H, D] (block j = rows [j*b, (j+1)*b)) over the cache's rows of
        ``layer``; write out [T, H, D]. The K/V of these T tokens are already staged."""
        raise ValueError(f"backend {self.name!r} does not support a kv_cache")


def attend_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v in fp32, GQA, chunked over queries.

    q [n, H, D]; k, v [L, H_kv, D]; key_mask bool [L] (False: not a key) -> [n, H, D] fp32.
    """
    n, H, D = q.shape
    group = H // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    vf = v.float().repeat_interleave(group, dim=1)
    out = torch.empty(n, H, D, dtype=torch.float32, device=q.device)
    for i in range(0, n, _QUERY_CHUNK):
        qf = q[i:i + _QUERY_CHUNK].float()
        s = torch.einsum("qhd,lhd->hql", qf, kf) * scale  # [H, q, L]
        if key_mask is not None:
            s.masked_fill_(~key_mask[None, None, :], float("-inf"))
        out[i:i + _QUERY_CHUNK] = torch.einsum("hql,lhd->qhd", torch.softmax(s, dim=-1), vf)
    return out


class ReferenceBackend(AttentionBackend):
    """torch fp32 math, any device: the oracle the fast backends are measured against."""

    name = "reference"
    supports_kv_cache = True

    def dense(self, q, k, v, scale):
        return attend_fp32(q[0], k[0], v[0], scale).to(q.dtype)[None]

    def check_cache(self, cache) -> None:
        return None  # any device, any page size

    def cached(self, q, cache, layer, block_size, scale, out):
        bt = cache.block_tensors(block_size)
        tpp, nb = cache.tokens_per_page, q.shape[0] // block_size
        offsets = torch.arange(tpp, device=q.device)
        for j in range(nb):
            slots = (bt.rows[j].to(torch.int64)[:, None] * tpp + offsets).reshape(-1)  # [RP*tpp]
            mask = torch.arange(slots.numel(), device=q.device) < bt.seq_len_kv[j]
            k, v = cache.k_pool[layer][slots], cache.v_pool[layer][slots]  # [RP*tpp, H_kv, D]
            rows = slice(j * block_size, (j + 1) * block_size)
            out[rows] = attend_fp32(q[rows], k, v, scale, mask).to(out.dtype)


class TorchSDPABackend(AttentionBackend):
    """torch.nn.functional.scaled_dot_product_attention, dense only (no cache)."""

    name = "sdpa"
    supports_kv_cache = False

    def dense(self, q, k, v, scale):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [1, H, S, D]
        o = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, scale=scale, enable_gqa=kt.shape[1] != qt.shape[1])
        return o.transpose(1, 2)


def get_backend(backend) -> AttentionBackend:
    """A backend instance from a name ("reference", "cudnn", "sdpa") or an instance."""
    if isinstance(backend, AttentionBackend):
        return backend
    if backend == "reference":
        return ReferenceBackend()
    if backend == "sdpa":
        return TorchSDPABackend()
    if backend == "cudnn":
        from .attention_cudnn import CudnnBackend

        return CudnnBackend()
    raise ValueError(f"backend must be 'reference', 'cudnn', 'sdpa' or an AttentionBackend, got {backend!r}")
