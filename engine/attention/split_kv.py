"""Split-KV for the cuDNN backend: each causal block's row cut into S sub-rows.

cuDNN runs one CTA per (batch row, head, 128-query tile). At the seed geometry one
row is 32 heads x 13 tiles = 416 CTAs on 132 SMs: 3.15 waves, the last one 15% full.
Cutting every row's pages into S sub-rows, run as S x more batch rows of the same
launch, fills the waves; each sub-row returns its output normalised over its own keys
and the log-sum-exp of its scores, and `merge_split_kv_` combines them exactly.

Sub-rows (n = s * nb + j: split s of block j; K = ceil(row_pages / S) pages each)::

    row j      | p0 p1 p2 ... p(K-1) | pK ... p(2K-1) | ... | private pages, padding |
    sub-rows   |      n = j          |   n = nb + j   | ... |   n = (S-1) nb + j     |
    keys       min(L, K tpp)          min(L - K tpp, K tpp) ...  (clamped at 0)

Every page of a row before its last holds tpp keys (full pages, then the private
slots filled from slot 0, own tokens last), so any page boundary cuts the row's key
sequence exactly; the partly filled private page is the row's last page and lands in
the last non-empty sub-row. Sub-rows past a short row's end have 0 keys and are
skipped by the merge.

Every sub-row of block j reads block j's queries. With one block they are a stride-0
broadcast of q (or of its one packed copy); with several (the clean pass, B sequences)
no batch stride maps n onto j, so the rows are ragged: cuDNN reads sub-row n's queries
at element ``q_offsets[n]`` of q (unpacked: no copy at all) or of the one packed copy.
Either way a sub-row reads the queries that a copy of Q per split would hold, and no
such copies are written.

The sub-row tables and key counts are rebuilt from the cache's rows on the device once
per forward (`SplitBuffers.rebuild`: one gather, one clamp, both graph-safe; the plan's
``prepare``), so a captured forward stays right after any number of commits.

The wave model also decides GQA query packing (`packing`), which changes the CTA
count: `choose_layout` picks (packed, S) together. cuDNN's fp8 SDPA takes ragged Q from
cuDNN 9.19 (`cudnn_graph.FP8_RAGGED_CUDNN`); under an older one, over an fp8 pool only
one-block forwards split (`CudnnBackend.layout_for`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .packing import pack_queries_

#: Queries per CTA tile of cuDNN's Hopper SDPA forward.
QUERY_TILE = 128
#: Largest S considered by the wave model.
MAX_SPLIT = 6
#: A split must raise the wave fill by this fraction over the best smaller S: each
#: sub-row costs a CTA prologue and a partial output more, which a smaller gain in fill
#: does not repay. The value lies between the fill gains that paid and that did not at
#: the seed geometry (docs/benchmarks.md, "Attention at the seed geometry").
MIN_GAIN = 0.015
#: Fewest keys a sub-row should hold; below, a CTA's fixed cost dominates.
MIN_KEYS_PER_SPLIT = 2048


def wave_fill(ctas: int, sms: int) -> float:
    """Fraction of SM slots busy over the waves ``ctas`` CTAs take on ``sms`` SMs."""
    return ctas / (math.ceil(ctas / sms) * sms)


def launch_ctas(*, num_blocks: int, block_size: int, num_heads: int, group: int = 1) -> int:
    """CTAs of one unsplit launch: rows x heads x query tiles. A packed launch
    (``group`` query heads stacked per K/V head, `packing`) has num_heads / group heads
    of group * block_size queries each."""
    return num_blocks * (num_heads // group) * math.ceil(group * block_size / QUERY_TILE)


def wave_time(ctas: int, splits: int, sms: int) -> float:
    """Modelled time of ``ctas`` row CTAs cut S ways, in units of one whole-row CTA:
    the waves of S * ctas CTAs, each 1/S as long."""
    return math.ceil(ctas * splits / sms) / splits


def choose_split(*, num_blocks: int, block_size: int, num_heads: int, row_keys: int,
                 sms: int, max_split: int = MAX_SPLIT, group: int = 1) -> int:
    """S for one forward by the wave model: the smallest S whose wave fill no larger S
    beats by `MIN_GAIN`, with at least `MIN_KEYS_PER_SPLIT` keys per sub-row.

    ``row_keys`` is the most keys a row can hold (row_pages * tokens_per_page);
    ``group`` > 1 models the packed launch (`launch_ctas`). Sub-rows cost no query
    copy (one block: a broadcast; several: ragged rows, `SplitBuffers.query`).
    """
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_heads", num_heads), ("row_keys", row_keys), ("sms", sms),
                    ("max_split", max_split), ("group", group)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    ctas = launch_ctas(num_blocks=num_blocks, block_size=block_size, num_heads=num_heads,
                       group=group)
    best, best_fill = 1, wave_fill(ctas, sms)
    for s in range(2, max_split + 1):
        if row_keys // s < MIN_KEYS_PER_SPLIT:
            break
        fill = wave_fill(s * ctas, sms)
        if fill > best_fill * (1 + MIN_GAIN):
            best, best_fill = s, fill
    return best


def choose_layout(*, num_blocks: int, block_size: int, num_heads: int, num_kv_heads: int,
                  row_keys: int, sms: int, pack="auto", split="auto",
                  max_split: int = MAX_SPLIT) -> tuple[bool, int]:
    """(packed, S) of one forward by the wave model.

    Each layout allowed (``pack``: "auto" tries both, True / False only that one; an
    MHA model, num_heads == num_kv_heads, has nothing to pack) gets its S
    (`choose_split`, or ``split`` when it is an int) and its `wave_time`. Split, packing
    is chosen when it models no slower and launches fewer CTAs: the waves are not
    lockstep (rows differ in length), so fewer CTAs of equal work finish sooner even at
    an equal wave count. Unsplit it must be faster by `MIN_GAIN`: it copies Q in and
    the output back. At the seed geometry (32 / 8 heads, 132 SMs) the denoising forward
    (one block of 1576) packs at S = 5 (2000 CTAs against 2080, both 3.2 row times),
    and the clean pass (four blocks of 394) packs at S = 5 (3.2 row times; packed S = 4
    models 3.25, and 512 unpacked CTAs at S = 1 model 4.0). docs/benchmarks.md has the
    timings of these layouts.
    """
    group = num_heads // num_kv_heads
    options = (False, True) if pack == "auto" else (bool(pack),)
    best = None
    for packed in options if group > 1 else (False,):
        g = group if packed else 1
        S = split if isinstance(split, int) else choose_split(
            num_blocks=num_blocks, block_size=block_size, num_heads=num_heads,
            row_keys=row_keys, sms=sms, max_split=max_split, group=g)
        ctas = launch_ctas(num_blocks=num_blocks, block_size=block_size, num_heads=num_heads,
                           group=g)
        t = wave_time(ctas, S, sms)
        if best is None:
            best = (packed, S, t, ctas * S)
        elif t < best[2] / (1 + MIN_GAIN) or (S > 1 and t <= best[2] and ctas * S < best[3]):
            best = (packed, S, t, ctas * S)
    return best[0], best[1]


@dataclass
class SplitBuffers:
    """Fixed-address tensors of one split forward shape (shared by every layer).

    Attributes:
        splits, num_blocks, block_size, sub_pages: S, nb, b and K.
        index: int64 [S * nb * K], which entry of the flat rows [nb * row_pages] each
            sub-row table entry copies (past a row's end: its last entry).
        offsets: int32 [S, 1], s * K * tpp, the first key of split s.
        table: int32 [S * nb, K], the sub-row page tables.
        kv_lens: int32 [S * nb], keys per sub-row.
        q_lens: int32 [S * nb], b everywhere.
        partial: [S, T, H, D], each sub-row's normalised output (token-major).
        lse: float32 [S * nb, H, b, 1], each sub-row's log-sum-exp.
        q_packed: [T, H, D] storage of the packed queries [nb, H_kv, g * b, D] (packed
            only, else None).
        row_block: int64 [S * nb + 1], the block j = n % nb of each sub-row n (the last
            entry nb), when nb > 1 and unpacked (the offsets then follow q's token
            stride), else None.
        q_offsets: int64 [S * nb + 1], where sub-row n's queries start: its block times
            a block's elements in q (or in q_packed, fixed), when nb > 1, else None.
        group: g query heads stacked per row (`packing`), 1 unpacked. Packed, Q is
            copied in packed order, cuDNN writes `partial` as [S * nb, H_kv, g * b, D]
            and `merge_input` views it as [S, nb, H, b, D].
    """

    splits: int
    num_blocks: int
    block_size: int
    sub_pages: int
    tokens_per_page: int
    index: torch.Tensor
    offsets: torch.Tensor
    table: torch.Tensor
    kv_lens: torch.Tensor
    q_lens: torch.Tensor
    partial: torch.Tensor
    lse: torch.Tensor
    q_packed: torch.Tensor | None
    row_block: torch.Tensor | None
    q_offsets: torch.Tensor | None
    group: int = 1

    @classmethod
    def allocate(cls, arena, *, splits: int, num_blocks: int, block_size: int, row_pages: int,
                 tokens_per_page: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 group: int = 1):
        """Carve every buffer from ``arena`` (a `DeviceArena`: fixed addresses) and fill the
        constant ones (``group`` > 1: packed rows, see `packing`)."""
        S, nb, b, H, D = splits, num_blocks, block_size, num_heads, head_dim
        K, T = -(-row_pages // S), nb * b
        index = torch.tensor(sub_row_index(S, nb, row_pages), dtype=torch.int64)
        offsets = torch.arange(S, dtype=torch.int32).view(S, 1) * (K * tokens_per_page)
        bufs = cls(
            splits=S, num_blocks=nb, block_size=b, sub_pages=K, tokens_per_page=tokens_per_page,
            index=arena.empty(index.shape, torch.int64, name="split_index"),
            offsets=arena.empty((S, 1), torch.int32, name="split_offsets"),
            table=arena.empty((S * nb, K), torch.int32, name="split_table"),
            kv_lens=arena.empty((S * nb,), torch.int32, name="split_kv_lens"),
            q_lens=arena.empty((S * nb,), torch.int32, name="split_q_lens"),
            partial=arena.empty((S, T, H, D), dtype, name="split_partial"),
            lse=arena.empty((S * nb, H, b, 1), torch.float32, name="split_lse"),
            q_packed=arena.empty((T, H, D), dtype, name="split_q") if group > 1 else None,
            row_block=(arena.empty((S * nb + 1,), torch.int64, name="split_row_block")
                       if nb > 1 and group == 1 else None),
            q_offsets=arena.empty((S * nb + 1,), torch.int64, name="split_q_offsets") if nb > 1 else None,
            group=group)
        bufs.index.copy_(index)
        bufs.offsets.copy_(offsets)
        bufs.q_lens.fill_(group * b)
        if nb > 1:
            blocks = torch.tensor([n % nb for n in range(S * nb)] + [nb])  # block of each sub-row
            if group > 1:  # the packed copy's blocks are contiguous: fixed offsets
                bufs.q_offsets.copy_(blocks * (T * H * D // nb))
            else:
                bufs.row_block.copy_(blocks)
        return bufs

    def rebuild(self, rows: torch.Tensor, seq_len_kv: torch.Tensor) -> None:
        """Sub-row tables and key counts from the block size's ``rows`` [nb, row_pages]
        and ``seq_len_kv`` [nb] (device work only: capturable)."""
        S, nb = self.splits, self.num_blocks
        torch.index_select(rows.reshape(-1), 0, self.index, out=self.table.view(-1))
        limit = self.sub_pages * self.tokens_per_page
        torch.clamp(seq_len_kv.view(1, nb) - self.offsets, 0, limit, out=self.kv_lens.view(S, nb))

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """Q [T, H, D] as cuDNN reads it: one block, [S, H, b, D] (packed: [S, H_kv,
        g * b, D]), a stride-0 broadcast of q (of its packed copy); several, the nb
        blocks [nb, H, b, D] (packed: of the copy), sub-row n at `q_offsets` [n]."""
        S, nb, b, g = self.splits, self.num_blocks, self.block_size, self.group
        T, H, D = q.shape
        if g > 1:
            pack_queries_(self.q_packed.view(nb, H // g, g, b, D), q, g)
            return self.packed_query()
        if nb == 1:
            return q.as_strided((S, H, b, D), (0, q.stride(1), q.stride(0), 1))
        # q's token stride is the caller's: the offsets follow it in every forward
        torch.mul(self.row_block, b * q.stride(0), out=self.q_offsets)
        return blocks_view(q, nb, b)

    def packed_query(self) -> torch.Tensor:
        """`q_packed` as cuDNN reads it (`query` of a packed forward), whatever wrote it:
        [S, H_kv, g * b, D] broadcast for one block, else [nb, H_kv, g * b, D]."""
        S, nb, b, g = self.splits, self.num_blocks, self.block_size, self.group
        T, H, D = self.q_packed.shape
        q = self.q_packed.view(nb, H // g, g * b, D)
        return q.as_strided((S, H // g, g * b, D), (0, g * b * D, D, 1)) if nb == 1 else q

    def partial_view(self) -> torch.Tensor:
        """The partial outputs as cuDNN writes them: [S * nb, H, b, D] (packed:
        contiguous [S * nb, H_kv, g * b, D])."""
        S, T, H, D = self.partial.shape
        if self.group > 1:
            return self.partial.view(S * self.num_blocks, H // self.group,
                                     self.group * self.block_size, D)
        return blocks_view(self.partial.view(S * T, H, D), S * self.num_blocks, self.block_size)

    def merge_input(self) -> torch.Tensor:
        """The partial outputs as `merge_split_kv_` reads them: [S, T, H, D] token-major,
        or packed as [S, nb, H, b, D]."""
        if self.group == 1:
            return self.partial
        S, T, H, D = self.partial.shape
        return self.partial.view(S, self.num_blocks, H, self.block_size, D)


def sub_row_index(splits: int, num_blocks: int, row_pages: int) -> list[int]:
    """Flat-rows index of every sub-row table entry, n = s * nb + j major, then k.

    Entry k of sub-row (s, j) is row j's entry s * K + k; past the row's end it repeats
    the row's last entry (a valid page the padding mask never reads)."""
    K = -(-row_pages // splits)
    return [j * row_pages + min(s * K + k, row_pages - 1)
            for s in range(splits) for j in range(num_blocks) for k in range(K)]


def blocks_view(x: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """[nb * b, H, D] (any token/head strides) as [nb, H, b, D] without a copy."""
    s_tok, s_head = x.stride(0), x.stride(1)
    return x.as_strided((nb, x.shape[1], b, x.shape[2]), (b * s_tok, s_head, s_tok, 1))
