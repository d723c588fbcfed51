"""Where a forward's K/V goes: the one seam between a model and the K/V it attends.

A model forward over a chunk asks its store for the forward's attention function, and
each layer calls it with its attention module and its packed QKV::

    attend = kv.forward(seq_len=T, block_size=b)    # once per model forward (plans once)
    out = attend(attn, qkv)                         # each layer: stage its K/V, attend V(j)
    kv.commit(T)                                    # the chunk becomes history
    kv.after_replay(T)                              # host half of a replayed chunk

The prompt goes in once, as a forward whose K/V the store keeps
(``prompt_forward(P)``), then ``commit_prompt()``. A store whose forwards span ranks
also cuts the tokens (``shard`` / ``gather``, its first row at ``token_offset``); the
others leave them whole.

A store with ``stages_prologue`` takes the QK norm and rope too: ``attend(attn, qkv,
prologue)`` with qkv as projected (q and k neither normed nor rotated) and ``prologue``
the fused `framekv.ops.qk_norm_rope_stage_` bound to the layer's weights and the
forward's rope; the store runs it as its staging (Q normed and rotated in place, K/V
written straight to the cache: no separate scatter). Other stores get qkv ready.

A store with ``stages_without_output`` also takes ``attend(attn, qkv, prologue,
output=False)``: the layer's K/V staged, its attention skipped, None returned. A clean
pass keeps only K/V, so its last layer's attention feeds nothing; the model asks for
that there (other stores attend and the model drops the output).

Stores: `PagedKV` (framekv's paged `CausalKVCache`), `ReferenceKV` (the fp32
`ExactWindowReference`, the oracle; not capturable), `UlyssesKV`
(`framekv.engine.attention.ulysses`: a paged cache per rank, heads exchanged), and
the dense rolling baseline of the benchmarks (`framekv.bench.dense`).
"""
from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable

import torch

from framekv.specs import Geometry

from .cache import CausalKVCache, ExactWindowReference
from .cache.sequences import check_id_values

#: attend(attention_module, packed_qkv [1, S, H + 2*H_kv, D]) -> [1, S, H, D]
AttendFn = Callable[[Any, torch.Tensor], torch.Tensor]


class KVStore(abc.ABC):
    """The K/V of one rollout, as a model's forwards see it.

    Attributes:
        geometry: the `Geometry` the store keeps (P, W, staged tokens, block sizes).
        graph_safe: whether a chunk over this store may be captured in a CUDA graph
            (its forwards and commit run no host-dependent work).
    """

    graph_safe: bool = True
    stages_prologue: bool = False
    stages_without_output: bool = False
    geometry: Geometry

    @abc.abstractmethod
    def forward(self, seq_len: int, block_size: int) -> AttendFn:
        """The attention of one model forward writing ``seq_len`` tokens at [C, C + T)
        in causal blocks of ``block_size``; rows >= seq_len are padding."""

    @abc.abstractmethod
    def prompt_forward(self, prompt_tokens: int) -> AttendFn:
        """The attention of the prompt forward (P tokens, one block over itself); the
        store keeps each layer's K/V for `commit_prompt`. Needs position 0."""

    @abc.abstractmethod
    def commit_prompt(self) -> None:
        """Make the prompt forward's K/V the pinned prefix [0, P)."""

    @abc.abstractmethod
    def commit(self, n: int) -> None:
        """Make the first ``n`` staged tokens history (inside a captured chunk, the
        device half runs on every replay; see `after_replay`)."""

    def after_replay(self, tokens: int) -> None:
        """Host bookkeeping after a replay of a captured chunk whose forwards staged
        ``tokens`` and committed them (the replay ran no Python)."""
        raise ValueError(f"{type(self).__name__} chunks cannot be replayed from graphs")

    @abc.abstractmethod
    def reset(self) -> None:
        """Back to position 0, no prompt (captured graphs stay valid)."""

    def close(self) -> None:
        """Free what the store holds; it is unusable after."""

    @property
    def replayable(self) -> bool:
        """Whether the next chunk may run as a replay of the chunk captured under
        `capture_scope` (a store whose launches depend on its fill level says no
        until its state matches the captured one)."""
        return self.graph_safe

    def capture_scope(self) -> contextlib.AbstractContextManager:
        """The state chunks are captured in (entered around the captures; the rollout
        resets the store afterwards)."""
        return contextlib.nullcontext()

    def key_layout(self, attn, tokens: int, block_sizes: tuple[int, ...],
                   batch: int | None = None) -> tuple[tuple[int, ...], tuple[bool, ...]]:
        """(split-KV sub-rows, GQA query packing) of each forward of a chunk over
        ``batch`` sequences (default the store's), for its graph key (both empty when the
        store's attention neither splits nor packs)."""
        return (), ()

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This process's share of a forward's token rows [1, S, ...] (all of them)."""
        return x

    def token_offset(self, length: int) -> int:
        """The forward index of this process's first row of a forward of ``length``
        tokens (0: it has them all)."""
        return 0

    def gather(self, x: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
        """Every process's rows back, cut to ``length`` (``x`` itself here)."""
        return x


class PagedKV(KVStore):
    """framekv's paged cache as a model's K/V store.

    Args:
        cache: a `CausalKVCache`; opened at ``geometry`` (closed first if open).
        geometry: the rollout's geometry.

    A forward plans its attention once (the first layer's backend ``plan``, prepared
    then) and runs every layer with that plan. Over a pool of N sequences, a forward of
    B batch rows runs sequences ``rows[:B]`` (`use_sequences`; default all N in order):
    the ids are the first B entries of a fixed device buffer, so a chunk captured for B
    rows serves any choice of B sequences (set them, then replay).
    """

    stages_prologue = True
    stages_without_output = True

    def __init__(self, cache: CausalKVCache, geometry: Geometry):
        self.cache, self.geometry = cache, geometry
        self._prompt: list[torch.Tensor] = []
        N = cache.num_sequences
        # Graph input: fixed address, contents rewritten by use_sequences.
        self._ids = torch.arange(N, device=cache.device) if N > 1 else None
        self._forward_batch = 1  # B of the forward under way: what its commit commits
        self.use_sequences(range(N))
        cache.close()
        cache.open(geometry)

    @property
    def batch(self) -> int:
        """B, the batch rows (sequences) of each forward."""
        return len(self.rows)

    def use_sequences(self, rows) -> None:
        """Make batch row r of the next forwards sequence ``rows[r]`` (host ints,
        distinct, in [0, N)). Copies them into the device buffer graphs read."""
        rows = list(rows)
        if not rows:
            raise ValueError("rows must name at least one sequence")
        self.rows = check_id_values(rows, self.cache.num_sequences)
        if self._ids is not None:
            self._ids[:len(rows)].copy_(torch.tensor(rows, dtype=torch.int64))

    def _ids_of(self, B: int):
        if B > self.cache.num_sequences:
            raise ValueError(f"the forward has {B} batch rows, the pool holds "
                             f"{self.cache.num_sequences} sequences")
        return None if self._ids is None else self._ids[:B]

    def forward(self, seq_len: int, block_size: int) -> AttendFn:
        cache, plans = self.cache, {}

        def attend(attn, qkv, prologue=None, output=True):
            B = qkv.shape[0]
            ids = self._ids_of(B)
            self._forward_batch = B
            plan = plans.get(id(attn.backend))
            if plan is None or not plan.matches(cache, seq_len, block_size, attn.num_heads,
                                                attn.scale, B):
                plan = plans[id(attn.backend)] = attn.plan_for(cache, seq_len, block_size, B)
                plan.prepare(ids)
            return attn(qkv, kv_cache=cache, seq_len=seq_len, causal_block_size=block_size,
                        plan=plan, prologue=prologue, output=output)
        return attend

    def prompt_forward(self, prompt_tokens: int, *, rewrite: bool = False) -> AttendFn:
        """The prompt forward; ``rewrite``: for `rewrite_prompt` over sequences that are
        under way (then they must hold the pinned region: C >= P)."""
        for i in self.rows:
            C = self.cache.sequence_committed_tokens(i)
            if not rewrite:
                check_prompt(self.geometry, prompt_tokens, C)
            elif prompt_tokens != self.geometry.pin_tokens or C < prompt_tokens:
                raise ValueError(f"a prompt rewrite needs a prefilled sequence of "
                                 f"pin_tokens={self.geometry.pin_tokens} prompt tokens; "
                                 f"sequence {i} holds C={C}, the prompt {prompt_tokens}")
        self._prompt = kvs = []

        def attend(attn, qkv):  # the prompt attends itself densely: P is rarely a block size
            kvs.append(qkv[0, :, attn.num_heads:])                        # [P, 2*H_kv, D]
            return attn(qkv)
        return attend

    def commit_prompt(self) -> None:
        """The prompt forward's K/V become the pinned prefix of every sequence in ``rows``."""
        kvs, self._prompt = self._prompt, []
        for i in self.rows:
            one = None if self._ids is None else torch.tensor([i], device=self.cache.device)
            stage_prompt(self.cache, kvs, self.cache.num_kv_heads, sequences=one)

    def rewrite_prompt(self) -> None:
        """The prompt forward's K/V written over positions [0, P) of every sequence in
        ``rows`` (their committed history stays): `CausalKVCache.write_range`, private
        copies included, so the next forward sees the new prompt."""
        kvs, self._prompt = self._prompt, []
        Hkv = self.cache.num_kv_heads
        for i in self.rows:
            for layer, kv in enumerate(kvs):                              # [P, 2*H_kv, D]
                self.cache.write_range(layer, 0, kv[:, :Hkv], kv[:, Hkv:], sequence=i)

    def commit(self, n: int) -> None:
        self.cache.commit(n, sequences=self._ids_of(self._forward_batch))

    def after_replay(self, tokens: int) -> None:
        self.cache.note_staged(tokens, sequences=self.rows)
        self.cache.commit_mirror(tokens, sequences=self.rows)

    def reset(self) -> None:
        self._prompt = []
        self.cache.close()
        self.cache.open(self.geometry)

    def reset_sequences(self, ids) -> None:
        """Sequences ``ids`` (host ints) back to position 0, no prompt; the others keep
        their state."""
        self.cache.reset_sequences(list(ids))

    def close(self) -> None:
        self.cache.shutdown()

    def key_layout(self, attn, tokens, block_sizes, batch: int | None = None):
        B = self.batch if batch is None else batch
        plans = [attn.plan_for(self.cache, tokens, b, B) for b in block_sizes]
        return tuple(p.splits for p in plans), tuple(p.packed for p in plans)


def stage_prompt(cache: CausalKVCache, kvs: list[torch.Tensor], num_kv_heads: int, *,
                 sequences: torch.Tensor | None = None) -> None:
    """Write the prompt's per-layer K/V ([P, 2*H_kv, D] each) at [0, P) and commit it.

    A staged write needs a multiple of a declared block size, and the prompt length
    rarely is one. So the prompt goes in pieces of at most max_staged_tokens, each
    padded with zero rows to a multiple of the smallest declared block size, and only
    the real rows are committed (into sequence 0, or the one ``sequences`` names): the padding rows sit at staged positions, which the
    next forward overwrites before anything can see them.
    """
    g = cache.geometry
    b = min(g.causal_block_sizes)
    piece = g.max_staged_tokens // b * b
    P = kvs[0].shape[0] if kvs else 0
    for start in range(0, P, piece):
        n = min(piece, P - start)
        padded = -(-n // b) * b
        for layer, kv in enumerate(kvs):
            buf = kv.new_zeros(padded, *kv.shape[1:])                      # [padded, 2Hkv, D]
            buf[:n] = kv[start:start + n]
            cache.write_staged(layer, buf[:, :num_kv_heads], buf[:, num_kv_heads:], b,
                               sequences=sequences)
        cache.commit(n, sequences=sequences)


class ReferenceKV(KVStore):
    """The fp32 exact-window reference as a K/V store: every K/V recorded densely, each
    block attended over exactly V(j) in fp32 (on the CPU; memory grows with the
    rollout). The oracle tests and `verify_rollout` compare against; not capturable.

    Args:
        geometry: the rollout's geometry; num_layers: layers recorded.
    """

    graph_safe = False

    def __init__(self, geometry: Geometry, num_layers: int):
        self.geometry, self.num_layers = geometry, num_layers
        self.reference = ExactWindowReference(geometry, num_layers)

    def forward(self, seq_len: int, block_size: int) -> AttendFn:
        ref = self.reference

        def attend(attn, qkv):
            H, Hkv = attn.num_heads, attn.num_kv_heads
            k, v = qkv[0, :seq_len, H:H + Hkv], qkv[0, :seq_len, H + Hkv:]   # [T, Hkv, D]
            ref.write(attn.layer_idx, ref.committed, k, v)
            out = ref.attention(attn.layer_idx, qkv[0, :, :H], seq_len, block_size,
                                scale=attn.scale)                            # [S, H, D] fp32
            return out.to(qkv.device, qkv.dtype)[None]
        return attend

    def prompt_forward(self, prompt_tokens: int) -> AttendFn:
        check_prompt(self.geometry, prompt_tokens, self.reference.committed)
        return self.forward(prompt_tokens, prompt_tokens)

    def commit_prompt(self) -> None:
        self.reference.commit(self.geometry.pin_tokens)

    def commit(self, n: int) -> None:
        self.reference.commit(n)

    def reset(self) -> None:
        self.reference = ExactWindowReference(self.geometry, self.num_layers)


def check_prompt(geometry: Geometry, prompt_tokens: int, committed: int) -> None:
    """ValueError unless a prompt of ``prompt_tokens`` can go in now: P = pin_tokens, C = 0."""
    if prompt_tokens != geometry.pin_tokens:
        raise ValueError(f"the prompt must hold pin_tokens={geometry.pin_tokens} tokens, "
                         f"got {prompt_tokens}")
    if committed:
        raise ValueError(f"the prompt goes in at position 0, C = {committed}; reset() first")
