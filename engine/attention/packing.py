"""GQA query packing: the query heads that share a K/V head as one row of queries.

Inside one causal block every query sees the same keys (there is no mask within a
block), so the g = H / H_kv query heads that read K/V head k can be stacked along the
query axis: one row of g * b queries per K/V head instead of g rows of b. The result
is exact. cuDNN runs one CTA per (row, head, 128-query tile); a 394-query block fills
3 tiles and 10 rows of a fourth, so the clean pass of the seed geometry (32 / 8 heads,
four one-frame blocks) launches 4 x 32 x 4 = 512 CTAs unpacked and 4 x 8 x 13 = 416
packed, and each K/V tile is read once for all g heads of a CTA.

Layouts (block j of nb, token t of b, K/V head k, stacked head r of g; h = k * g + r)::

    tokens   q, out  [nb * b, H, D]          any token and head strides
    packed   buffer  [nb, H_kv, g, b, D]     contiguous; cuDNN reads [nb, H_kv, g * b, D]

No single stride maps the packed query axis (r, t) onto a token-major tensor, so the
queries are copied in once (a strided copy moved as 8-byte words, `copy_rows_`; split
rows share it, `split_kv`) and, without split-KV, the output is copied back. With
split-KV the merge reads the packed partial outputs directly (as
[S, nb, H, b, D]: head h = k * g + r sits b * D elements after head h - 1), and the
softmax statistics [S * nb, H_kv, g * b] are the unpacked [S * nb, H, b] already.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def token_view(x: torch.Tensor, nb: int, b: int, group: int) -> torch.Tensor:
    """[nb * b, H, D] (any strides) as its packed order [nb, H_kv, g, b, D], no copy."""
    H = x.shape[1]
    # Splitting a dimension is always a view, whatever the strides.
    return x.unflatten(0, (nb, b)).unflatten(2, (H // group, group)).permute(0, 2, 3, 1, 4)


def copy_rows_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` bit for bit, moved as 8-byte words where both layouts allow it
    (last dim contiguous and a multiple of a word, other strides and offsets whole
    words: D = 128 of packed QKV always is). torch's strided copy spends its time on
    index math per element; words are 4x fewer bf16 elements, each access 4x wider."""
    if dst.dtype == src.dtype:  # raw words move bits: only between equal dtypes
        try:
            dst.view(torch.int64).copy_(src.view(torch.int64))
            return
        except RuntimeError:  # a layout that is not whole words: the element-wise copy
            pass
    dst.copy_(src)


def pack_queries_(dst: torch.Tensor, q: torch.Tensor, group: int) -> None:
    """Copy q [nb * b, H, D] into ``dst`` [nb, H_kv, g, b, D] (packed order)."""
    nb, _, _, b, _ = dst.shape
    copy_rows_(dst, token_view(q, nb, b, group))


def unpack_output_(out: torch.Tensor, src: torch.Tensor, group: int) -> None:
    """Copy the packed output ``src`` [nb, H_kv, g * b, D] into out [nb * b, H, D]."""
    nb, hkv, gb, D = src.shape
    copy_rows_(token_view(out, nb, gb // group, group), src.view(nb, hkv, group, gb // group, D))


@dataclass
class PackBuffers:
    """Fixed-address tensors of one packed forward shape without split-KV.

    Attributes:
        group: g, query heads per K/V head.
        q: [nb, H_kv, g * b, D], the packed queries cuDNN reads.
        out: [nb, H_kv, g * b, D], the packed output cuDNN writes.
        q_lens: int32 [nb], g * b everywhere (every packed query is real).
    """

    group: int
    q: torch.Tensor
    out: torch.Tensor
    q_lens: torch.Tensor

    @classmethod
    def allocate(cls, arena, *, num_blocks: int, block_size: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> "PackBuffers":
        """Carve the buffers from ``arena`` (a `DeviceArena`: fixed addresses)."""
        g = num_heads // num_kv_heads
        shape = (num_blocks, num_kv_heads, g * block_size, head_dim)
        bufs = cls(group=g, q=arena.empty(shape, dtype, name="pack_q"),
                   out=arena.empty(shape, dtype, name="pack_out"),
                   q_lens=arena.empty((num_blocks,), torch.int32, name="pack_q_lens"))
        bufs.q_lens.fill_(g * block_size)
        return bufs

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """Pack q [nb * b, H, D] into `q` and return it."""
        nb, hkv, gb, D = self.q.shape
        pack_queries_(self.q.view(nb, hkv, self.group, gb // self.group, D), q, self.group)
        return self.q

    def unpack(self, out: torch.Tensor) -> None:
        """The packed output into out [nb * b, H, D]."""
        unpack_output_(out, self.out, self.group)
