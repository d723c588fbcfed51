"""What the attention benchmark runs and how."""
from __future__ import annotations

import msgspec

from ._validate import check_bool, check_choice, check_int

#: Attention implementations the benchmark knows: framekv's paged exact-window
#: path, and the dense baselines it is measured against.
BENCH_VARIANTS: tuple[str, ...] = ("framekv-paged", "sdpa-cudnn", "sdpa-flash", "concat-sdpa")


class BenchSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Benchmark settings.

    Attributes:
        iterations: timed runs per variant (>= 1); the median is reported.
        warmup: untimed runs before timing (>= 0).
        flush_l2: whether to evict L2 between runs, so a run does not start warm.
        variants: which of ``BENCH_VARIANTS`` to run, in that order, without repeats.
        seed: seed of the random inputs.
    """

    iterations: int = 50
    warmup: int = 10
    flush_l2: bool = True
    variants: tuple[str, ...] = BENCH_VARIANTS
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("BenchSpec", "iterations", self.iterations, minimum=1)
        check_int("BenchSpec", "warmup", self.warmup, minimum=0)
        check_bool("BenchSpec", "flush_l2", self.flush_l2)
        self._check_variants()
        check_int("BenchSpec", "seed", self.seed, minimum=0)

    def _check_variants(self) -> None:
        variants = self.variants
        if isinstance(variants, (str, bytes)) or not isinstance(variants, (tuple, list)):
            raise ValueError(f"BenchSpec.variants must be a sequence of strings, got {variants!r}")
        if not variants:
            raise ValueError(f"BenchSpec.variants must hold at least one entry, got {variants!r}")
        for i, v in enumerate(variants):
            check_choice("BenchSpec", f"variants[{i}]", v, BENCH_VARIANTS)
            if v in variants[:i]:
                raise ValueError(f"BenchSpec.variants[{i}] must not repeat an earlier entry, "
                                 f"got {v!r}")
        msgspec.structs.force_setattr(self, "variants", tuple(variants))
