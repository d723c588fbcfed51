"""Ulysses sequence parallelism: one layer's attention across the ranks of a process group.

Each rank holds a shard of the sequence (``shard_sequence``: rows [r*S_l, (r+1)*S_l) of
the sequence padded to a multiple of the world size W). Attention needs every token, so
an all-to-all turns the rank's sequence shard of all heads into the whole sequence of
its share of the heads, a plain `CachedAttention` attends there, and a second
all-to-all brings the output back to sequence shards:

    q [1, S_l, H, D], k/v [1, S_l, H_kv, D]          (this rank's tokens, every head)
        -- all-to-all -->  q [1, W*S_l, H/W, D], k/v [1, W*S_l, H_kv/W, D]
        -- CachedAttention(H/W, H_kv/W) over this rank's CausalKVCache (H_kv/W heads)
        -- all-to-all -->  out [1, S_l, H, D]

Rank r computes query heads [r*H/W, (r+1)*H/W) and K/V heads [r*H_kv/W, (r+1)*H_kv/W):
contiguous blocks keep each query head with its K/V head under grouped-query attention.
The cache knows nothing of parallelism: it is an ordinary cache built for H_kv/W heads,
and rank r's pool holds exactly those heads of the single-process pool.

With a cache, ``seq_len`` is the number of real tokens of the whole (unsharded) forward
and passes through untouched: rows >= seq_len, the caller's padding and the sharder's,
are neither staged nor attended and come back zero.

Collectives are ``torch.distributed.all_to_all_single`` (NCCL on CUDA, gloo on CPU).
Cached calls and grouped-query models exchange q, k and v as three tensors (their
per-rank head counts differ, and the cache stages k and v from their own receive
buffers); plain multi-head attention without a cache exchanges one packed buffer. A
world of one runs no collective at all.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

if dist.is_available():
    # Imported now, before any process group exists, on purpose: this torch module binds
    # ``group.WORLD`` into default arguments when it is first imported, and torch imports
    # it lazily (custom ops' first call imports dynamo, which imports FSDP, which imports
    # it). Imported after init_process_group, it pins the default group forever: a
    # destroyed gloo group then keeps its worker threads until interpreter shutdown,
    # where one releasing its last collective's tensors aborts the process.
    import torch.distributed.nn.functional  # noqa: F401

from .module import CachedAttention

# ---------------------------------------------------------------------- sequence shards


def check_world_rank(world, rank=None) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world_size must be a positive integer, got {world!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)
                             or not 0 <= rank < world):
        raise ValueError(f"rank must be an integer in [0, {world}), got {rank!r}")


def shard_length(length: int, world: int) -> int:
    """Rows of each rank's shard of a sequence of ``length``: ceil(length / world)."""
    check_world_rank(world)
    return -(-length // world)


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = 1) -> torch.Tensor:
    """``x`` with zero rows appended along ``dim`` up to a multiple of ``multiple``
    (``x`` itself when it already is one)."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple must be a positive integer, got {multiple!r}")
    pad = -x.shape[dim] % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def shard_sequence(x: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s rows of ``x`` along ``dim``: the sequence is zero-padded to a
    multiple of ``world`` and cut into ``world`` equal shards (a view when no padding
    was needed). [1, S, ...] -> [1, ceil(S / world), ...]."""
    check_world_rank(world, rank)
    x = pad_to_multiple(x, world, dim)
    n = x.shape[dim] // world
    return x.narrow(dim, rank * n, n)


def gather_sequence(x: torch.Tensor, length: int, *, process_group=None,
                    world_size: int | None = None, dim: int = 1) -> torch.Tensor:
    """Every rank's shard along ``dim``, in rank order, cut to the first ``length`` rows
    (the inverse of `shard_sequence`). [1, S_l, ...] -> [1, length, ...]."""
    world = resolve_world_size(process_group, world_size)
    if world == 1:
        return x.narrow(dim, 0, length)
    _require_distributed(world)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=process_group)
    return torch.cat(parts, dim=dim).narrow(dim, 0, length)


def resolve_world_size(process_group=None, world_size: int | None = None) -> int:
    """The group's size: ``world_size`` if given (checked against an initialised group),
    else the group's, else 1 when torch.distributed is not initialised."""
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        return dist.get_world_size(process_group) if initialised else 1
    check_world_rank(world_size)
    if initialised and dist.get_world_size(process_group) != world_size:
        raise ValueError(f"world_size must equal the process group's size "
                         f"{dist.get_world_size(process_group)}, got {world_size}")
    return world_size


def _require_distributed(world: int) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"a world of {world} ranks needs torch.distributed initialised "
                         "(init_process_group: nccl on CUDA, gloo on CPU)")


# ---------------------------------------------------------------------- exchanges


def _heads_to_ranks(t: torch.Tensor, world: int) -> torch.Tensor:
    """[1, S_l, h, D] (any token/head strides) -> contiguous send buffer [W, S_l, h/W, D]:
    block r holds the heads rank r computes."""
    _, S, h, D = t.shape
    return t[0].reshape(S, world, h // world, D).transpose(0, 1).contiguous()


def _packed_to_ranks(qkv: torch.Tensor, world: int) -> torch.Tensor:
    """Packed MHA [1, S_l, 3H, D] -> send buffer [W, S_l, 3, H/W, D]."""
    _, S, h3, D = qkv.shape
    return qkv[0].reshape(S, 3, world, h3 // (3 * world), D).permute(2, 0, 1, 3, 4).contiguous()


def _all_to_all(send: torch.Tensor, group, async_op: bool):
    """Equal-split all-to-all along dim 0; (receive buffer, work or None)."""
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=async_op)
    return recv, work


class PendingAttention:
    """An attention whose input exchange is in flight (``async_op=True``).

    ``wait()`` completes the exchange, attends, brings the output back to sequence
    shards and returns it [1, S_l, H, D]; it may be called once.
    """

    def __init__(self, finish: Callable[[], torch.Tensor], works: list):
        self._finish, self._works = finish, works

    def is_completed(self) -> bool:
        """Whether the input exchange has completed (``wait`` will not block on it)."""
        return all(w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor:
        if self._finish is None:
            raise ValueError("wait() was already called on this PendingAttention")
        for w in self._works:
            w.wait()
        finish, self._finish, self._works = self._finish, None, []
        return finish()


# ---------------------------------------------------------------------- the module


class UlyssesAttention(torch.nn.Module):
    """One layer's attention over a sequence sharded across a process group.

    Args:
        num_heads, num_kv_heads, head_dim: the layer's H, H_kv, D (all ranks together);
            H and H_kv must be multiples of the world size.
        backend, layer_idx, scale: as for `CachedAttention`.
        process_group: the ranks sharing the sequence (None: the default group).
        world_size: the group's size; default the group's, or 1 when torch.distributed
            is not initialised (then no collective runs).

    Attributes:
        attn: the local `CachedAttention` (H/W query heads, H_kv/W K/V heads); the
            rank's `CausalKVCache` must be built for ``attn.num_kv_heads`` heads.
    Raises:
        ValueError: a head count that is not a multiple of the world size (naming it,
            the world size and the count), or anything `CachedAttention` refuses.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 backend="reference", layer_idx: int = 0, scale: float | None = None,
                 process_group=None, world_size: int | None = None):
        super().__init__()
        world = resolve_world_size(process_group, world_size)
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            if value % world:
                raise ValueError(f"{name} must be a multiple of the world size: expected a "
                                 f"multiple of {world}, got {value}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.process_group, self.world_size = process_group, world
        self.attn = CachedAttention(num_heads // world, num_kv_heads // world, head_dim,
                                    backend=backend, layer_idx=layer_idx, scale=scale)

    @classmethod
    def wrap(cls, attn: CachedAttention, *, process_group=None,
             world_size: int | None = None) -> "UlyssesAttention":
        """The Ulysses form of a single-process module: same heads, backend instance,
        layer and scale."""
        return cls(attn.num_heads, attn.num_kv_heads, attn.head_dim, backend=attn.backend,
                   layer_idx=attn.layer_idx, scale=attn.scale, process_group=process_group,
                   world_size=world_size)

    @property
    def layer_idx(self) -> int:
        return self.attn.layer_idx

    @property
    def scale(self) -> float:
        return self.attn.scale

    @property
    def supports_kv_cache(self) -> bool:
        """Whether the local backend can attend over a `CausalKVCache`."""
        return self.attn.supports_kv_cache

    def forward(self, q, k=None, v=None, *, kv_cache=None, seq_len=None,
                causal_block_size=None, async_op: bool = False, plan=None):
        """This rank's output shard [1, S_l, H, D].

        Args:
            q: this rank's shard [1, S_l, H, D], or packed [1, S_l, H + 2*H_kv, D] with
                k = v = None (every rank passes the same S_l).
            k, v: [1, S_l, H_kv, D] (any strides, head dim contiguous).
            kv_cache: this rank's `CausalKVCache` (H_kv/W heads), or None.
            seq_len: real tokens of the whole forward before sharding; required with a
                cache; without one, optional (rows >= seq_len are then not keys).
            causal_block_size: as for `CachedAttention` (needs a cache).
            async_op: start the input exchange and return a `PendingAttention` whose
                ``wait()`` gives the output. Refuses a cache: staging into it must
                happen in call order, before any later forward or commit.
            plan: the forward's prepared plan of the local module (see
                `CachedAttention`); default: planned here.
        Raises:
            ValueError: a cache with ``async_op``, a cache of another head count, bad
                shapes, or what the local `CachedAttention` refuses.
        """
        if async_op and kv_cache is not None:
            raise ValueError("async_op=True does not take a kv_cache: a cached call stages "
                             "K/V in call order; run it synchronously")
        self._check_call(kv_cache, seq_len, causal_block_size)
        parts, works, cut = self._start(q, k, v, async_op, cached=kv_cache is not None)

        def finish():
            q2, k2, v2 = cut(parts)
            out = self.attend_heads(q2, k2, v2, kv_cache=kv_cache, seq_len=seq_len,
                                    causal_block_size=causal_block_size, plan=plan)
            return self.to_sequence(out)
        return PendingAttention(finish, works) if async_op else finish()

    # ------------------------------------------------------------------ steps
    def to_heads(self, q, k=None, v=None):
        """Sequence shards of every head -> the whole (padded) sequence of this rank's
        heads: (q [1, W*S_l, H/W, D], k, v [1, W*S_l, H_kv/W, D]), exchanged as for a
        call without a cache."""
        parts, _, cut = self._start(q, k, v, False, cached=False)
        return cut(parts)

    def attend_heads(self, q, k, v, *, kv_cache=None, seq_len=None, causal_block_size=None,
                     plan=None):
        """The local attention over the whole sequence of this rank's heads ->
        [1, W*S_l, H/W, D]. Without a cache, ``seq_len`` (if given) limits the keys and
        queries to the first seq_len rows; the others come back zero."""
        if kv_cache is not None:
            return self.attn(q, k, v, kv_cache=kv_cache, seq_len=seq_len,
                             causal_block_size=causal_block_size, plan=plan)
        if causal_block_size is not None:
            raise ValueError("causal_block_size needs a kv_cache")
        if seq_len is None or seq_len == q.shape[1]:
            return self.attn(q, k, v)
        S = q.shape[1]
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= S:
            raise ValueError(f"seq_len must be an integer in [1, {S}], got {seq_len!r}")
        out = q.new_zeros(q.shape)                                         # [1, W*S_l, H/W, D]
        out[:, :seq_len] = self.attn(q[:, :seq_len], k[:, :seq_len], v[:, :seq_len])
        return out

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """[1, W*S_l, H/W, D] of this rank's heads -> this rank's shard [1, S_l, H, D]."""
        W = self.world_size
        if W == 1:
            return out
        _require_distributed(W)
        _, S, h, D = out.shape
        send = out[0].reshape(W, S // W, h, D).contiguous()               # [W, S_l, H/W, D]
        recv, _ = _all_to_all(send, self.process_group, False)            # [W, S_l, H/W, D]
        return recv.permute(1, 0, 2, 3).reshape(1, S // W, W * h, D)

    # ------------------------------------------------------------------ internals
    def _check_call(self, kv_cache, seq_len, b) -> None:
        """What can be refused before any collective runs (all ranks refuse alike)."""
        if kv_cache is None:
            if b is not None:
                raise ValueError("causal_block_size needs a kv_cache")
            return
        if kv_cache.num_kv_heads != self.attn.num_kv_heads:
            raise ValueError(f"kv_cache holds {kv_cache.num_kv_heads} K/V heads; this rank's "
                             f"share is num_kv_heads / world_size = {self.num_kv_heads} / "
                             f"{self.world_size} = {self.attn.num_kv_heads}")
        if seq_len is None:
            raise ValueError("seq_len (the real query tokens of the whole forward) is "
                             "required with a kv_cache")

    def _start(self, q, k, v, async_op: bool, *, cached: bool):
        """Validate the shard and start the input exchange: (receive buffers, works,
        cut) where ``cut(buffers)`` gives (q, k, v) of this rank's heads."""
        q, k, v, packed = self._split(q, k, v)
        W = self.world_size
        if W == 1:
            return (q, k, v), [], lambda parts: parts
        _require_distributed(W)
        S = q.shape[1] * W
        if packed is not None and not cached and self.num_heads == self.num_kv_heads:
            recv, work = _all_to_all(_packed_to_ranks(packed, W), self.process_group, async_op)
            h = self.num_heads // W

            def cut_packed(bufs):
                x = bufs[0].view(1, S, 3 * h, self.head_dim)             # [1, S, 3H/W, D]
                return x[:, :, :h], x[:, :, h:2 * h], x[:, :, 2 * h:]
            return (recv,), [w for w in (work,) if w is not None], cut_packed
        sent = [_all_to_all(_heads_to_ranks(t, W), self.process_group, async_op) for t in (q, k, v)]
        works = [w for _, w in sent if w is not None]

        def cut(bufs):  # [W, S_l, h/W, D] each -> [1, S, h/W, D]
            return tuple(b.view(1, S, *b.shape[2:]) for b in bufs)
        return tuple(r for r, _ in sent), works, cut

    def _split(self, q, k, v):
        """(q, k, v, packed-or-None) views of this rank's shard, shapes checked."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != 1:
            got = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be a [1, S_local, H, D] tensor, got {got}")
        if (k is None) != (v is None):
            raise ValueError("k and v must both be given, or both be None for a packed q")
        packed = None
        if k is None:
            if tuple(q.shape[2:]) != (H + 2 * Hkv, D):
                raise ValueError(f"packed q must have shape [1, S_local, {H + 2 * Hkv}, {D}], "
                                 f"got {list(q.shape)}")
            packed, (q, k, v) = q, (q[:, :, :H], q[:, :, H:H + Hkv], q[:, :, H + Hkv:])
        for name, t, heads in (("q", q, H), ("k", k, Hkv), ("v", v, Hkv)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (1, q.shape[1], heads, D):
                got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must have shape [1, {q.shape[1]}, {heads}, {D}], got {got}")
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), "
                                 f"got {t.dtype}, {t.device}")
        return q, k, v, packed


# ---------------------------------------------------------------------- a whole model
