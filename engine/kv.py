"""Where a forward's K/V goes: the one seam between a model and the K/V it attends.

A store's protocol is four lines::

    attend = kv.forward(seq_len=T, block_size=b)    # once per model forward (plans once)
    out = attend(attn, qkv, prologue, output)       # each layer: stage its K/V, attend V(j)
    kv.commit(T)                                    # the chunk becomes history
    kv.after_replay(T)                              # host half of a replayed chunk

A model never calls a store itself: its runner hands every forward a `ForwardContext`
(the store's attention for that forward, the rope frames, the batch rows, whether the
output is wanted) and each layer calls ``ctx.attention(attn, qkv, prologue, last=...)``.

``prologue`` is the fused QK norm and rope (`framekv.ops.qk_norm_rope_stage_` bound to
the layer's weights and the forward's rope) of a qkv as projected; a store that stages
K/V with it (`PagedKV`) writes K/V straight into the cache on the way, any other runs it
in place first. ``output=False``: only the layer's K/V are kept (the last layer of a
clean pass, whose attention feeds nothing); a store that can skips the attention and
returns None. `plain` gives that full signature to a store's two-argument attend.

The prompt of a model whose prompt is the pinned prefix goes in once, as a forward whose
K/V the store keeps (``prompt_forward(P)``), then ``commit_prompt()``. A store whose
forwards span ranks also cuts the tokens (``shard`` / ``gather``, its first row at
``token_offset``); the others leave them whole.

Stores: `PagedKV` (framekv's paged `CausalKVCache`), `ReferenceKV` (the fp32
`ExactWindowReference`, the oracle; not capturable), `UlyssesKV`
(`framekv.engine.attention.ulysses_kv`: a paged cache per rank, heads exchanged), and
the dense rolling baseline of the benchmarks (`framekv.bench.dense`).

One file: the seam is one module: the store protocol, the engine's stores and the
context a forward reaches them through.
"""
from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable

import torch

from framekv.specs import Geometry

from .cache import CausalKVCache, ExactWindowReference

#: attend(attention_module, packed_qkv [B, S, H + 2*H_kv, D], prologue=None, output=True)
#: -> [B, S, H, D], or None with output=False
AttendFn = Callable[..., Any]
#: recorder(layer, packed_qkv [1, S, H + 2*H_kv, D], out [1, S, H, D], seq_len, block_size)
Recorder = Callable[[int, torch.Tensor, torch.Tensor, int, int], None]


class KVStore(abc.ABC):
    """The K/V of one rollout, as a model's forwards see it.

    Attributes:
        geometry: the `Geometry` the store keeps (P, W, staged tokens, block sizes).
        graph_safe: whether a chunk over this store may be captured in a CUDA graph
            (its forwards and commit run no host-dependent work).
    """

    graph_safe: bool = True
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
    def ids(self) -> torch.Tensor | None:
        """The pool sequence of each batch row as an int64 [B] device tensor, or None
        for a store of one sequence."""
        return None

    def use_sequences(self, rows) -> None:
        """Make batch row r of the next forwards sequence ``rows[r]``; a store of one
        sequence takes (0,) only."""
        if not isinstance(rows, (list, tuple, range)) or tuple(rows) != (0,):
            got = tuple(rows) if isinstance(rows, (list, tuple, range)) else repr(rows)
            raise ValueError(f"{type(self).__name__} holds one sequence: rows must be (0,), "
                             f"got {got}")

    def reset_sequences(self, rows) -> None:
        """Sequences ``rows`` back to position 0, no prompt (here: the one sequence)."""
        self.use_sequences(rows)
        self.reset()

    @property
    def replayable(self) -> bool:
        """Whether the next chunk may run as a replay of the chunk captured under
        `capture_scope` (a store whose launches depend on its fill level says no
        until its state matches the captured one)."""
        return self.graph_safe

    def capture_scope(self) -> contextlib.AbstractContextManager:
        """The state chunks are captured in (entered around the captures; the runner
        resets the store afterwards)."""
        return contextlib.nullcontext()

    def key_layout(self, attn, tokens: int, block_sizes: tuple[int, ...],
                   batch: int = 1) -> tuple[tuple[int, ...], tuple[bool, ...]]:
        """(split-KV sub-rows, GQA query packing) of each forward of a chunk over
        ``batch`` sequences, for its graph key (both empty when the store's attention
        neither splits nor packs)."""
        return (), ()

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This process's share of a forward's token rows [B, S, ...] (all of them)."""
        return x

    def token_offset(self, length: int) -> int:
        """The forward index of this process's first row of a forward of ``length``
        tokens (0: it has them all)."""
        return 0

    def gather(self, x: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
        """Every process's rows back, cut to ``length`` (``x`` itself here)."""
        return x


def plain(attend: Callable[[Any, torch.Tensor], torch.Tensor]) -> AttendFn:
    """The full `AttendFn` of a store whose ``attend(attn, qkv)`` neither stages the QK
    prologue nor skips an attention: the prologue runs in place first, and a forward
    kept for its K/V only attends and drops the output."""
    def full(attn, qkv, prologue=None, output=True):
        if prologue is not None:
            with torch.no_grad():
                prologue(qkv)
        out = attend(attn, qkv)
        return out if output else None
    return full


def _dense(attn, qkv: torch.Tensor) -> torch.Tensor:
    """Dense attention over the forward's own tokens (no K/V store)."""
    return attn(qkv)


class ForwardContext:
    """One model forward: what its layers need to reach the K/V store, explicitly.

    Args:
        kv: the `KVStore` the forward stages into and attends over, or None (dense
            attention over the forward's own tokens, nothing kept).
        seq_len, block_size: real tokens of the forward and its causal block size
            (default: all tokens, one block).
        frame0: int64 [B] (or [1] for every row) device tensor, the rope frame of each
            batch row's first frame (a graph input: one captured chunk serves every
            position).
        rows: None, or int64 [B] device tensor: the pool sequence of each batch row
            (a fixed buffer a graph reads), for models that keep state per sequence
            (a prompt's cross-attention K/V).
        output: False when only the forward's K/V are kept (a clean pass, a prompt):
            the last layer stops once its K/V are staged and the model returns None.
        recorder: None, or a `Recorder` after every attention (eager use only: with it
            the QK prologue runs in place, so the recorded K is normed and rotated,
            and every attention runs).
        attend: the forward's `AttendFn` (default ``kv.forward(seq_len, block_size)``;
            a prompt forward passes ``kv.prompt_forward(P)``).
    """

    def __init__(self, kv: KVStore | None, *, seq_len: int | None, block_size: int | None = None,
                 frame0: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                 output: bool = True, recorder: Recorder | None = None,
                 attend: AttendFn | None = None):
        if not output and kv is None:
            raise ValueError("output=False needs a K/V store: without one the forward keeps "
                             "nothing")
        self.kv, self.seq_len, self.frame0, self.rows = kv, seq_len, frame0, rows
        self.block_size = seq_len if block_size is None else block_size
        self.output, self.recorder = output, recorder
        if attend is None:
            attend = plain(_dense) if kv is None else kv.forward(seq_len, self.block_size)
        self.attend = attend

    def attention(self, attn, qkv: torch.Tensor, prologue=None, *, last: bool = False):
        """One layer's attention: stage its K/V (``prologue`` as the staging where the
        store takes it) and attend V(j); ``last``: the model's last layer, which in a
        forward without ``output`` stops once its K/V are staged (None back)."""
        stop = last and not self.output
        if self.recorder is None:
            return self.attend(attn, qkv, prologue, not stop)
        if prologue is not None:
            with torch.no_grad():
                prologue(qkv)
        out = self.attend(attn, qkv)
        self.recorder(attn.layer_idx, qkv, out, self.seq_len, self.block_size)
        return None if stop else out

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This process's share of the forward's token rows (`KVStore.shard`)."""
        return x if self.kv is None else self.kv.shard(x, dim)

    def gather(self, x: torch.Tensor, length: int, dim: int = 1) -> torch.Tensor:
        """Every process's rows back, cut to ``length`` (`KVStore.gather`)."""
        return x if self.kv is None else self.kv.gather(x, length, dim)

    def token_offset(self, length: int) -> int:
        """The forward index of this process's first row (`KVStore.token_offset`)."""
        return 0 if self.kv is None else self.kv.token_offset(length)


class PagedKV(KVStore):
    """framekv's paged cache as a model's K/V store.

    Args:
        cache: a `CausalKVCache`; opened at ``geometry`` (closed first if open).
        geometry: the rollout's geometry.

    A forward plans its attention once (the first layer's backend ``plan``, prepared
    then) and runs every layer with that plan. Over a pool of N sequences a forward's
    batch rows are the cache's sequences in use (`use_sequences`; default all N in
    order): a fixed device buffer, so a chunk captured for B rows serves any choice of
    B sequences (set them, then replay). It stages the QK prologue into the cache and
    skips the attention of a layer whose output is not wanted.
    """

    def __init__(self, cache: CausalKVCache, geometry: Geometry):
        self.cache, self.geometry = cache, geometry
        self._prompt: list[torch.Tensor] = []
        cache.close()
        cache.open(geometry)

    @property
    def rows(self) -> tuple[int, ...]:
        """The sequences in use: batch row r of a forward is rows[r]."""
        return self.cache.sequences

    @property
    def ids(self) -> torch.Tensor:
        """The same as an int64 [B] device tensor (a fixed buffer graphs read)."""
        return self.cache.sequence_ids

    @property
    def batch(self) -> int:
        """B, the batch rows (sequences) of each forward."""
        return len(self.rows)

    def use_sequences(self, rows) -> None:
        """Make batch row r of the next forwards sequence ``rows[r]`` (host ints,
        distinct, in [0, N))."""
        self.cache.use_sequences(rows)

    def forward(self, seq_len: int, block_size: int) -> AttendFn:
        cache, plans = self.cache, {}

        def attend(attn, qkv, prologue=None, output=True):
            B = qkv.shape[0]
            plan = plans.get(id(attn.backend))
            if plan is None or not plan.matches(cache, seq_len, block_size, attn.num_heads,
                                                attn.scale, B):
                plan = plans[id(attn.backend)] = attn.plan_for(cache, seq_len, block_size, B)
                plan.prepare()
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
        return plain(attend)

    def commit_prompt(self) -> None:
        """The prompt forward's K/V become the pinned prefix of every sequence in use."""
        kvs, self._prompt = self._prompt, []
        stage_prompt(self.cache, kvs)

    def rewrite_prompt(self) -> None:
        """The prompt forward's K/V written over positions [0, P) of every sequence in
        use (their committed history stays): `CausalKVCache.write_range`, private
        copies included, so the next forward sees the new prompt. All or nothing: if a
        write fails, every sequence's old prompt K/V are put back in every layer."""
        kvs, self._prompt = self._prompt, []
        if not kvs:
            return
        Hkv, P = self.cache.num_kv_heads, self.geometry.pin_tokens
        with self.cache.keeping(0, P, sequences=self.rows):
            for i in self.rows:
                for layer, kv in enumerate(kvs):                          # [P, 2*H_kv, D]
                    self.cache.write_range(layer, 0, kv[:, :Hkv], kv[:, Hkv:], sequence=i)

    def commit(self, n: int) -> None:
        self.cache.commit(n)

    def after_replay(self, tokens: int) -> None:
        self.cache.note_staged(tokens)
        self.cache.commit_host(tokens)

    def reset(self) -> None:
        self._prompt = []
        self.cache.close()
        self.cache.open(self.geometry)

    def reset_sequences(self, rows) -> None:
        """Sequences ``rows`` (host ints) back to position 0, no prompt, their pages zeroed
        (`CausalKVCache.reset_sequences`); the others keep their state."""
        self.cache.reset_sequences(rows)

    def close(self) -> None:
        self.cache.shutdown()

    def key_layout(self, attn, tokens, block_sizes, batch: int = 1):
        plans = [attn.plan_for(self.cache, tokens, b, batch) for b in block_sizes]
        return tuple(p.splits for p in plans), tuple(p.packed for p in plans)


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
        return plain(attend)

    def prompt_forward(self, prompt_tokens: int) -> AttendFn:
        check_prompt(self.geometry, prompt_tokens, self.reference.committed)
        return self.forward(prompt_tokens, prompt_tokens)

    def commit_prompt(self) -> None:
        self.reference.commit(self.geometry.pin_tokens)

    def commit(self, n: int) -> None:
        self.reference.commit(n)

    def reset(self) -> None:
        self.reference = ExactWindowReference(self.geometry, self.num_layers)


def stage_prompt(cache: CausalKVCache, kvs: list[torch.Tensor]) -> None:
    """Write a prompt's per-layer K/V ([P, 2*H_kv, D] each) at [0, P) of every sequence in
    use of ``cache`` and commit it.

    A staged write needs a multiple of a declared block size, and the prompt length
    rarely is one: the prompt goes in pieces of at most max_staged_tokens, each padded
    with zero rows to a multiple of the smallest declared block size, and only the real
    rows are committed (the padding sits at staged positions, which the next forward
    overwrites before anything can see them).
    """
    g, B, Hkv = cache.geometry, len(cache.sequences), cache.num_kv_heads
    b = min(g.causal_block_sizes)
    piece = g.max_staged_tokens // b * b
    P = kvs[0].shape[0] if kvs else 0
    for start in range(0, P, piece):
        n = min(piece, P - start)
        for layer, kv in enumerate(kvs):
            buf = kv.new_zeros(B, -(-n // b) * b, *kv.shape[1:])           # [B, padded, 2Hkv, D]
            buf[:, :n] = kv[start:start + n]
            cache.write_staged(layer, buf[..., :Hkv, :], buf[..., Hkv:, :], b)
        cache.commit(n)


def check_prompt(geometry: Geometry, prompt_tokens: int, committed: int) -> None:
    """ValueError unless a prompt of ``prompt_tokens`` can go in now: P = pin_tokens, C = 0."""
    if prompt_tokens != geometry.pin_tokens:
        raise ValueError(f"the prompt must hold pin_tokens={geometry.pin_tokens} tokens, "
                         f"got {prompt_tokens}")
    if committed:
        raise ValueError(f"the prompt goes in at position 0, C = {committed}; reset() first")
