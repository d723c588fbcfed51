"""A whole model's K/V under Ulysses sequence parallelism: the `KVStore` of a rank.

Each rank keeps an ordinary `CausalKVCache` of its share of the K/V heads
(H_kv / W), runs every layer's attention through a `UlyssesAttention`
(``ulysses.py``), and holds this rank's share of each forward's tokens
(``shard`` / ``gather``). The prompt is attended densely, sharded like any forward;
this rank's heads of its K/V become the pinned prefix.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..cache import CausalKVCache
from ..kv import AttendFn, KVStore, PagedKV, check_prompt, plain, stage_prompt
from .ulysses import (UlyssesAttention, check_world_rank, gather_sequence, resolve_world_size,
                      shard_length, shard_sequence)


class UlyssesKV(KVStore):
    """A `CausalVideoDiT`'s K/V under Ulysses sequence parallelism: this rank's
    `CausalKVCache` (H_kv / W heads), one `UlyssesAttention` per block, and the token
    shards of every forward.

    Args:
        model: the `CausalVideoDiT` (replicated on every rank, same weights).
        cache: this rank's cache, built for ``model.spec.num_kv_heads // W`` heads;
            opened at ``geometry``.
        geometry: the rollout's geometry.
        process_group: the ranks (None: the default group).
        world_size, rank: default the group's (1 and 0 without torch.distributed).
    """

    def __init__(self, model, cache: CausalKVCache, geometry, process_group=None, *,
                 world_size: int | None = None, rank: int | None = None):
        self.process_group = process_group
        self.world_size = resolve_world_size(process_group, world_size)
        initialised = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank(process_group) if initialised else 0)
        check_world_rank(self.world_size, self.rank)
        self.layers = [UlyssesAttention.wrap(blk.attn, process_group=process_group,
                                             world_size=self.world_size) for blk in model.blocks]
        self.num_heads = model.spec.num_heads // self.world_size
        self.num_kv_heads = model.spec.num_kv_heads // self.world_size
        if cache.num_kv_heads != self.num_kv_heads:
            raise ValueError(f"cache must hold this rank's num_kv_heads / world_size = "
                             f"{self.num_kv_heads} K/V heads, got {cache.num_kv_heads}")
        self.paged = PagedKV(cache, geometry)
        self.cache, self.geometry = cache, geometry
        self._prompt: list[torch.Tensor] = []

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's rows of [1, S, ...] -> [1, S_l, ...] (zero-padded)."""
        return shard_sequence(x, self.world_size, self.rank, dim)

    def token_offset(self, length: int) -> int:
        """This rank's first row of a forward of ``length`` tokens."""
        return self.rank * shard_length(length, self.world_size)

    def gather(self, x: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
        """Every rank's rows, cut to ``length``: [1, S_l, ...] -> [1, length, ...]."""
        return gather_sequence(x, length, process_group=self.process_group,
                               world_size=self.world_size, dim=dim)

    def forward(self, seq_len: int, block_size: int) -> AttendFn:
        layers, cache, plans = self.layers, self.cache, []

        def attend(attn, qkv):
            u = layers[attn.layer_idx]
            if not plans:  # every layer's local module shares the model's backend
                plans.append(u.attn.plan_for(cache, seq_len, block_size))
                plans[0].prepare()
            return u(qkv, kv_cache=cache, seq_len=seq_len, causal_block_size=block_size,
                     plan=plans[0])
        return plain(attend)

    def prompt_forward(self, prompt_tokens: int) -> AttendFn:
        """The prompt, sharded: dense attention over its P tokens; this rank's K/V
        heads of it are kept for `commit_prompt`."""
        check_prompt(self.geometry, prompt_tokens, self.cache.committed_tokens)
        self._prompt = kvs = []

        def attend(attn, qkv):
            u = self.layers[attn.layer_idx]
            q, k, v = u.to_heads(qkv)                                      # [1, W*S_l, h, D]
            kvs.append(torch.cat([k[0, :prompt_tokens], v[0, :prompt_tokens]], dim=1))
            return u.to_sequence(u.attend_heads(q, k, v, seq_len=prompt_tokens))
        return plain(attend)

    def commit_prompt(self) -> None:
        kvs, self._prompt = self._prompt, []
        stage_prompt(self.cache, kvs)

    def commit(self, n: int) -> None:
        self.paged.commit(n)

    def after_replay(self, tokens: int) -> None:
        self.paged.after_replay(tokens)

    def reset(self) -> None:
        self._prompt = []
        self.paged.reset()

    def close(self) -> None:
        self.paged.close()

    def key_layout(self, attn, tokens, block_sizes, batch=1):
        return self.paged.key_layout(self.layers[0].attn, tokens, block_sizes, batch)
