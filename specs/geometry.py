"""The geometry of one rollout inside the causal K/V cache (DESIGN.md, "The cache")."""
from __future__ import annotations

import msgspec

from .checks import check_int, check_int_tuple, sorted_unique


class Geometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one rollout looks like to the cache; frozen because it keys graphs.

    A forward writes T tokens at positions [C, C+T), cut into blocks of size b.
    Block j starts at s = C + j*b and sees exactly::

        V(j) = [0, min(P, s))  U  [max(P, s - W), s)  U  [s, s + b)

    Attributes:
        pin_tokens: P, the first P committed positions, visible to every later
            token and never evicted.
        window_tokens: W, how many positions before its own start a block sees
            besides the fixed region.
        max_staged_tokens: the most tokens one forward writes.
        causal_block_sizes: every block size a forward may use, each
            ``<= max_staged_tokens``; normalised to a sorted tuple without repeats.
    """

    pin_tokens: int
    window_tokens: int
    max_staged_tokens: int
    causal_block_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        check_int("Geometry", "pin_tokens", self.pin_tokens, minimum=0)
        check_int("Geometry", "window_tokens", self.window_tokens, minimum=0)
        check_int("Geometry", "max_staged_tokens", self.max_staged_tokens, minimum=1)
        sizes = check_int_tuple("Geometry", "causal_block_sizes", self.causal_block_sizes,
                                minimum=1)
        for i, b in enumerate(sizes):
            if b > self.max_staged_tokens:
                raise ValueError(
                    f"Geometry.causal_block_sizes[{i}] must be <= max_staged_tokens "
                    f"({self.max_staged_tokens}), got {b}")
        # Frozen structs cannot assign normally; normalising keeps equal geometries equal.
        msgspec.structs.force_setattr(self, "causal_block_sizes", sorted_unique(sizes))

    @property
    def max_visible_tokens(self) -> int:
        """The most keys one block of the largest declared size can see."""
        return self.pin_tokens + self.window_tokens + max(self.causal_block_sizes)
