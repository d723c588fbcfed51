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

The sub-row tables and key counts are rebuilt from the cache's rows on the device once
per forward (`SplitBuffers.rebuild`: one gather, one clamp, both graph-safe; the plan's
``prepare``), so a captured forward stays right after any number of commits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Queries per CTA tile of cuDNN's Hopper SDPA forward.
QUERY_TILE = 128
#: Largest S considered by the wave model.
MAX_SPLIT = 6
#: A split must raise the wave fill by this fraction over the best smaller S: each
#: sub-row costs a CTA prologue and a partial output more. On the H200 at the seed
#: geometry (variants timed in turn, two runs) S = 5 (fill 0.985) beat S = 4 (0.969)
#: by 1.2-1.4%, and S = 6 (0.995) lost 0.6-1.2% to S = 5: a 1.6% fill gain paid, a
#: 1.1% one did not.
MIN_GAIN = 0.015
#: Fewest keys a sub-row should hold; below, a CTA's fixed cost dominates.
MIN_KEYS_PER_SPLIT = 2048


def wave_fill(ctas: int, sms: int) -> float:
    """Fraction of SM slots busy over the waves ``ctas`` CTAs take on ``sms`` SMs."""
    return ctas / (math.ceil(ctas / sms) * sms)


def choose_split(*, num_blocks: int, block_size: int, num_heads: int, row_keys: int,
                 sms: int, max_split: int = MAX_SPLIT) -> int:
    """S for one forward by the wave model: the smallest S whose wave fill no larger S
    beats by `MIN_GAIN`, with at least `MIN_KEYS_PER_SPLIT` keys per sub-row.

    ``row_keys`` is the most keys a row can hold (row_pages * tokens_per_page).
    """
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_heads", num_heads), ("row_keys", row_keys), ("sms", sms),
                    ("max_split", max_split)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    ctas = num_blocks * num_heads * math.ceil(block_size / QUERY_TILE)
    best, best_fill = 1, wave_fill(ctas, sms)
    for s in range(2, max_split + 1):
        if row_keys // s < MIN_KEYS_PER_SPLIT:
            break
        fill = wave_fill(s * ctas, sms)
        if fill > best_fill * (1 + MIN_GAIN):
            best, best_fill = s, fill
    return best


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
        q_copies: [S, T, H, D] when nb > 1 (Q cannot be broadcast with one batch
            stride across n = s * nb + j), else None.
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
    q_copies: torch.Tensor | None

    @classmethod
    def allocate(cls, arena, *, splits: int, num_blocks: int, block_size: int, row_pages: int,
                 tokens_per_page: int, num_heads: int, head_dim: int, dtype: torch.dtype):
        """Carve every buffer from ``arena`` (a `DeviceArena`: fixed addresses) and fill the
        constant ones."""
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
            q_copies=arena.empty((S, T, H, D), dtype, name="split_q") if nb > 1 else None)
        bufs.index.copy_(index)
        bufs.offsets.copy_(offsets)
        bufs.q_lens.fill_(b)
        return bufs

    def rebuild(self, rows: torch.Tensor, seq_len_kv: torch.Tensor) -> None:
        """Sub-row tables and key counts from the block size's ``rows`` [nb, row_pages]
        and ``seq_len_kv`` [nb] (device work only: capturable)."""
        S, nb = self.splits, self.num_blocks
        torch.index_select(rows.reshape(-1), 0, self.index, out=self.table.view(-1))
        limit = self.sub_pages * self.tokens_per_page
        torch.clamp(seq_len_kv.view(1, nb) - self.offsets, 0, limit, out=self.kv_lens.view(S, nb))

    def query(self, q: torch.Tensor) -> torch.Tensor:
        """Q [T, H, D] as cuDNN reads it, [S * nb, H, b, D]: a stride-0 broadcast for
        nb = 1, else the copies (one per split)."""
        S, nb, b = self.splits, self.num_blocks, self.block_size
        T, H, D = q.shape
        if nb == 1:
            return q.as_strided((S, H, b, D), (0, q.stride(1), q.stride(0), 1))
        self.q_copies.copy_(q.expand(S, T, H, D))
        return blocks_view(self.q_copies.view(S * T, H, D), S * nb, b)

    def partial_view(self) -> torch.Tensor:
        """The partial outputs as cuDNN writes them: [S * nb, H, b, D]."""
        S, T, H, D = self.partial.shape
        return blocks_view(self.partial.view(S * T, H, D), S * self.num_blocks, self.block_size)


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
