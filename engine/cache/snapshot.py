"""A sequence of the pool on the host: `SequenceSnapshot`, and the copies that make one.

What a sequence is, between chunks (nothing staged): its committed count C and the K/V
of the positions its next forward can see, in every layer::

    kept(C) = [0, min(P, C))  U  [max(P, C - W), C)            (``kept_positions``:
                                        V(j) of a block at s = C, less its own tokens)
    k, v       [L, n, H_kv, D]   position kept(C)[i] at row i (host memory)

Nothing else is needed: where those positions sit in a pool (pages, ring rotation,
private copies) is a function of C and the pool (`CausalKVCache.import_sequence` rebuilds
it), so a snapshot fits any sequence of any pool of the same geometry, K/V shape and
dtype (and for fp8, the same scales: its bytes mean nothing under others); the page
size may differ. Positions a later block can no longer see are not
kept.

`gather` copies a sequence out asynchronously: on a CUDA device, on a side stream that
first waits for the work queued so far, a layer group at a time through one device
buffer into pinned host memory; the snapshot's ``synchronize`` (and anything reading
its tensors) waits for it; `reserve_pinned` page-locks its host memory ahead of
time. `scatter` writes K/V rows into slots, a layer group at a time. File: `framekv.engine.cache.tensorfile` (versioned header, CRC).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from framekv.specs import Geometry

from .reference import visible_positions
from .tensorfile import CorruptFile, read_tensors, write_tensors

__all__ = ["FORMAT", "SequenceSnapshot", "describe_pool", "kept_count", "kept_positions"]

FORMAT, VERSION = "framekv.sequence", 1
_GROUP_BYTES = 256 << 20     # device staging per copy step


def kept_positions(geometry: Geometry, committed: int) -> list[int]:
    """The committed positions a sequence at C = ``committed`` still reads: what the
    next block sees (`reference.visible_positions` at s = C) but its own token."""
    return visible_positions(geometry, committed, committed, 1)[:-1].tolist()


def kept_count(geometry: Geometry, committed: int) -> int:
    """``len(kept_positions(geometry, committed))``, counted without listing them (a
    file's header may declare any size)."""
    P, W = geometry.pin_tokens, geometry.window_tokens
    return min(P, committed) + max(0, min(committed - P, W))


@dataclass(eq=False)
class SequenceSnapshot:
    """One sequence's state on the host (module doc).

    Attributes:
        geometry: the pool's geometry; num_layers, num_kv_heads, head_dim, dtype: the
            K/V shape and dtype of every token.
        committed: C, positions committed.
        k, v: [L, n, H_kv, D] host tensors of the positions `kept_positions` lists
            (read them once `synchronize` returned; the properties wait).
        kv_scales: an fp8 pool's scales as nested lists [L][2][H_kv], else None.
    """

    geometry: Geometry
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    committed: int
    _k: torch.Tensor = field(repr=False)
    _v: torch.Tensor = field(repr=False)
    _done: object = field(default=None, repr=False)   # a CUDA event until the copy ran
    kv_scales: list | None = field(default=None, repr=False)

    @property
    def k(self) -> torch.Tensor:
        self.synchronize()
        return self._k

    @property
    def v(self) -> torch.Tensor:
        self.synchronize()
        return self._v

    @property
    def positions(self) -> list[int]:
        """The positions held, in row order."""
        return kept_positions(self.geometry, self.committed)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held."""
        return 2 * self._k.numel() * self._k.element_size()

    def ready(self) -> bool:
        """Whether the copy from the device has finished (no wait)."""
        return self._done is None or self._done.query()

    def synchronize(self) -> None:
        """Wait until the copy from the device has finished."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None

    def describe(self) -> dict:
        """What a pool must match to take this snapshot (`describe_pool`)."""
        return describe_pool(self.geometry, self.num_layers, self.num_kv_heads,
                             self.head_dim, self.dtype, self.kv_scales)

    def check_fits(self, want: dict) -> None:
        """ValueError naming every field where this snapshot differs from ``want`` (a
        pool's `describe`: geometry, K/V shape, dtype)."""
        have = self.describe()
        diff = [f"{k}: the snapshot has {have[k]}, the pool {want[k]}"
                for k in have if have[k] != want.get(k)]
        if diff:
            raise ValueError("snapshot does not fit this pool: " + "; ".join(diff))

    # ------------------------------------------------------------------ files
    def tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The snapshot's tensors by name (for a file holding several)."""
        return {f"{prefix}k": self.k, f"{prefix}v": self.v}

    def header(self) -> dict:
        return {**self.describe(), "committed": self.committed}

    def save(self, path) -> int:
        """Write the snapshot to ``path`` (safetensors layout with a versioned JSON
        header and a CRC; atomic: a failure leaves any old file as it was); returns the
        file's bytes."""
        return write_tensors(path, self.tensors(), {"format": FORMAT, "version": VERSION,
                                                    **self.header()})

    @classmethod
    def load(cls, path, *, pin_memory: bool = False) -> "SequenceSnapshot":
        """The snapshot `save` wrote. `tensorfile.CorruptFile` (a ValueError) for a
        truncated or corrupt file, another format or version, a header that does not
        describe its tensors."""
        tensors, header = read_tensors(path, pin_memory=pin_memory)
        check_format(path, header, FORMAT, VERSION)
        try:
            return cls.from_parts(header, tensors)
        except ValueError as exc:
            raise CorruptFile(f"{path}: {exc}") from None

    @classmethod
    def from_parts(cls, header: dict, tensors: dict, prefix: str = "") -> "SequenceSnapshot":
        """The snapshot of a header (`header`) and its tensors named with ``prefix``;
        ValueError where they disagree."""
        try:
            g = Geometry(**{**header["geometry"], "causal_block_sizes":
                            tuple(header["geometry"]["causal_block_sizes"])})
            dtype = getattr(torch, header["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise TypeError(f"dtype {header['dtype']!r} is not a torch dtype")
            snap = cls(g, int(header["num_layers"]), int(header["num_kv_heads"]),
                       int(header["head_dim"]), dtype, int(header["committed"]),
                       tensors[f"{prefix}k"], tensors[f"{prefix}v"],
                       kv_scales=header.get("kv_scales"))
        except (KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise ValueError(f"snapshot header is incomplete or wrong: {str(exc)[:200]}") from None
        if snap.committed < 0:
            raise ValueError(f"snapshot committed must be >= 0, got {snap.committed}")
        want = (snap.num_layers, kept_count(g, snap.committed), snap.num_kv_heads, snap.head_dim)
        for name, t in (("k", snap._k), ("v", snap._v)):
            if tuple(t.shape) != want or t.dtype != dtype:
                raise ValueError(f"snapshot {name} is {t.dtype} {list(t.shape)}, its header "
                                 f"says {dtype} {list(want)}")
        return snap


def describe_pool(geometry: Geometry, num_layers: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, kv_scales: list | None = None) -> dict:
    """A pool's geometry, K/V shape and dtype (and an fp8 pool's scales), JSON-able:
    what a snapshot must match."""
    g = geometry
    out = {"geometry": {"pin_tokens": g.pin_tokens, "window_tokens": g.window_tokens,
                        "max_staged_tokens": g.max_staged_tokens,
                        "causal_block_sizes": list(g.causal_block_sizes)},
           "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
           "dtype": str(dtype).removeprefix("torch.")}
    if kv_scales is not None:
        out["kv_scales"] = kv_scales
    return out


def check_format(path, header: dict, fmt: str, version: int) -> None:
    """`CorruptFile` (a ValueError) unless a file's header names ``fmt`` at ``version``."""
    got = [str(header.get(k))[:40] for k in ("format", "version")]
    if header.get("format") != fmt or type(header.get("version")) is not int \
            or header.get("version") != version:
        raise CorruptFile(f"{path}: a {got[0]!r} file of version {got[1]}, not {fmt!r} "
                          f"version {version}")


def gather(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, side=None,
           ) -> tuple[torch.Tensor, torch.Tensor, object]:
    """K/V of ``slots`` (int64 [n] on the pool's device) in every layer as host tensors
    [L, n, H, D], and the CUDA event their copy completes (None on the CPU: done).
    ``side``: the CUDA stream the copy runs on (None: one from torch's pool)."""
    L, _, H, D = k_pool.shape
    n = slots.numel()
    if k_pool.device.type != "cuda":
        return k_pool.index_select(1, slots), v_pool.index_select(1, slots), None
    if k_pool.dtype == torch.float8_e4m3fn:   # moved as bytes: fp8 has no index kernels
        k, v, done = gather(k_pool.view(torch.uint8), v_pool.view(torch.uint8), slots, side)
        return k.view(k_pool.dtype), v.view(k_pool.dtype), done
    k = torch.empty((L, n, H, D), dtype=k_pool.dtype, pin_memory=True)
    v = torch.empty_like(k, pin_memory=True)
    group = _group(k_pool, n)
    side = side if side is not None else torch.cuda.Stream(k_pool.device)
    side.wait_stream(torch.cuda.current_stream(k_pool.device))
    with torch.cuda.stream(side):
        buf = torch.empty((group, n, H, D), dtype=k_pool.dtype, device=k_pool.device)
        for src, dst in ((k_pool, k), (v_pool, v)):
            for l0 in range(0, L, group):
                m = min(group, L - l0)
                torch.index_select(src[l0:l0 + m], 1, slots, out=buf[:m])
                dst[l0:l0 + m].copy_(buf[:m], non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    slots.record_stream(side)
    return k, v, done


def reserve_pinned(shape, dtype: torch.dtype, count: int) -> int:
    """Page-lock ``count`` K/V pairs of host memory of ``shape`` [L, n, H, D] now, so
    `gather`s of that size take them from torch's pinned-memory cache instead of
    page-locking memory as they copy (seconds for gigabytes, once per buffer). Returns
    the bytes reserved (0 where CUDA is unavailable)."""
    if count < 1 or not torch.cuda.is_available():
        return 0
    held = [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(2 * count)]
    nbytes = sum(t.numel() * t.element_size() for t in held)
    del held  # back to the cache, still pinned
    return nbytes


def scatter(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor) -> None:
    """Write host rows k, v [L, n, H, D] into ``slots`` of every layer (stream order)."""
    L, n = k.shape[:2]
    group = _group(k_pool, n)
    if k_pool.dtype == torch.float8_e4m3fn:   # moved as bytes: fp8 has no index_copy_
        k_pool, v_pool = k_pool.view(torch.uint8), v_pool.view(torch.uint8)
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    with torch.no_grad():
        for src, dst in ((k, k_pool), (v, v_pool)):
            for l0 in range(0, L, group):
                m = min(group, L - l0)
                rows = src[l0:l0 + m].to(dst.device, non_blocking=True)
                dst[l0:l0 + m].index_copy_(1, slots, rows)


def _group(pool: torch.Tensor, n: int) -> int:
    """Layers per copy step: as many as fit ``_GROUP_BYTES`` (at least one)."""
    per_layer = max(1, n * pool.shape[2] * pool.shape[3] * pool.element_size())
    return max(1, min(pool.shape[0], _GROUP_BYTES // per_layer))
