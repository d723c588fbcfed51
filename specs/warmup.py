"""Warm-up plans: every (geometry, token count, block size) to capture before serving."""
from __future__ import annotations

from typing import Iterator

import msgspec

from ._validate import check_instance, check_int_tuple, check_str, sorted_unique
from .geometry import Geometry
from .kv import KVSpec
from .rollout import RolloutSpec


class WarmupEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One geometry with every token count crossed with every block size.

    Attributes:
        geometry: the cache geometry the forwards run in.
        token_counts: real tokens per forward, each ``<= geometry.max_staged_tokens``.
        block_sizes: causal block sizes, each declared in the geometry and dividing
            every token count.

    Both tuples are normalised to sorted tuples without repeats.
    """

    geometry: Geometry
    token_counts: tuple[int, ...]
    block_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        check_instance("WarmupEntry", "geometry", self.geometry, Geometry)
        counts = check_int_tuple("WarmupEntry", "token_counts", self.token_counts, minimum=1)
        blocks = check_int_tuple("WarmupEntry", "block_sizes", self.block_sizes, minimum=1)
        limit = self.geometry.max_staged_tokens
        for i, t in enumerate(counts):
            if t > limit:
                raise ValueError(f"WarmupEntry.token_counts[{i}] must be <= the geometry's "
                                 f"max_staged_tokens ({limit}), got {t}")
        declared = self.geometry.causal_block_sizes
        for i, b in enumerate(blocks):
            if b not in declared:
                raise ValueError(f"WarmupEntry.block_sizes[{i}] must be one of the geometry's "
                                 f"causal_block_sizes {declared}, got {b}")
            for t in counts:
                if t % b:
                    raise ValueError(f"WarmupEntry.block_sizes[{i}] must divide every token "
                                     f"count, got {b} for token count {t}")
        msgspec.structs.force_setattr(self, "token_counts", sorted_unique(counts))
        msgspec.structs.force_setattr(self, "block_sizes", sorted_unique(blocks))

    def pairs(self) -> tuple[tuple[int, int], ...]:
        """Every (token_count, block_size) of this entry."""
        return tuple((t, b) for t in self.token_counts for b in self.block_sizes)


class WarmupPlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a server captures up front, for one cache.

    Attributes:
        kv: the cache the graphs are captured over.
        entries: geometries with their token counts and block sizes.
        cache_dir: where capture artefacts (e.g. cuDNN plans) may be kept, or None.
    """

    kv: KVSpec
    entries: tuple[WarmupEntry, ...]
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        check_instance("WarmupPlan", "kv", self.kv, KVSpec)
        if isinstance(self.entries, (str, bytes)) or not isinstance(self.entries, (tuple, list)):
            raise ValueError(f"WarmupPlan.entries must be a sequence of WarmupEntry, "
                             f"got {self.entries!r}")
        if not self.entries:
            raise ValueError(f"WarmupPlan.entries must hold at least one entry, got {self.entries!r}")
        for i, entry in enumerate(self.entries):
            check_instance("WarmupPlan", f"entries[{i}]", entry, WarmupEntry)
        if self.cache_dir is not None:
            check_str("WarmupPlan", "cache_dir", self.cache_dir)
        msgspec.structs.force_setattr(self, "entries", tuple(self.entries))

    def items(self) -> Iterator[tuple[Geometry, int, int]]:
        """Every (geometry, token_count, block_size) to capture, in plan order."""
        for entry in self.entries:
            for t, b in entry.pairs():
                yield entry.geometry, t, b

    @property
    def num_forwards(self) -> int:
        """How many (geometry, token count, block size) combinations the plan holds."""
        return sum(len(entry.pairs()) for entry in self.entries)

    @classmethod
    def from_rollout(cls, kv: KVSpec, rollout: RolloutSpec, *,
                     cache_dir: str | None = None) -> "WarmupPlan":
        """The plan a rollout needs.

        For each chunk length (the full chunk, and the shorter last chunk if the
        rollout has one): the denoising forward with the whole chunk as one block and
        the clean forward with one-frame blocks.
        """
        check_instance("WarmupPlan.from_rollout", "rollout", rollout, RolloutSpec)
        geometry = rollout.geometry()
        entries = tuple(
            WarmupEntry(geometry, (t,), (t, rollout.tokens_per_frame))
            for t in rollout.chunk_token_counts())
        return cls(kv=kv, entries=entries, cache_dir=cache_dir)
