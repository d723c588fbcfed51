"""One geometry's device state inside the cache's arena, and its host mirror.

Carved once per geometry, at the first ``open``, and reused at the same addresses by
every later ``open`` of it (so graphs captured over it replay after a reopen)::

    counters      int64 [4]        committed, ring_base, ring shift, pad (32-byte line)
    table         int64 [F + R]    fixed pages, then the ring
    desc          int64 [S, 12]    `LayoutPlan.descriptor()`: what `causal_layout_` reads
    rows          int32 [sum nb * row_pages]      flat over the declared block sizes,
    seq_len_kv    int32 [sum nb]                  in `LayoutPlan.blocks` order;
    seq_len_q     int32 [sum nb]                  `BlockTensors` are views of one
    staged_src/dst/dst2     int64 [sum staged_len]     size's part
    committed_src/dst       int64 [sum nb * committed_len]

All per-block tensors of all block sizes are flat, so one ``causal_layout_`` launch
rewrites them all. The device advances counters, table and layout itself at commit;
the host uploads only at open (`upload_layout`, and on CPU after every commit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from framekv.ops.causal_layout import DESC_COLUMNS

from .host import FLAT_FIELDS
from .mirror import HostLayout
from .plan import LayoutPlan

#: committed, ring_base, ring shift, pad (keeps 32-byte alignment)
NUM_COUNTERS = 4


def state_specs(plan: LayoutPlan) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every tensor a geometry carves, in carve order; sizing and carving share it."""
    rows, blocks, staged, committed = plan.flat_sizes()
    return [("counters", (NUM_COUNTERS,), torch.int64),
            ("table", (plan.table_len,), torch.int64),
            ("desc", tuple(plan.descriptor().shape), torch.int64),
            ("rows", (rows,), torch.int32),
            ("seq_len_kv", (blocks,), torch.int32),
            ("seq_len_q", (blocks,), torch.int32),
            ("staged_src", (staged,), torch.int64),
            ("staged_dst", (staged,), torch.int64),
            ("staged_dst2", (staged,), torch.int64),
            ("committed_src", (committed,), torch.int64),
            ("committed_dst", (committed,), torch.int64)]


def nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@dataclass
class BlockTensors:
    """Device tensors of one block size (fixed addresses; rewritten in place at commit).

    rows: int32 [nb, row_pages] page ids; seq_len_kv / seq_len_q: int32 [nb];
    staged_src / staged_dst / staged_dst2: int64 [M + nb * current_len], the scatter
    list of a forward (see `framekv.engine.cache.host.BlockLayout`).
    """

    block_size: int
    rows: torch.Tensor
    seq_len_kv: torch.Tensor
    seq_len_q: torch.Tensor
    staged_src: torch.Tensor
    staged_dst: torch.Tensor
    staged_dst2: torch.Tensor


class GeometryState:
    """A geometry's tensors in the arena and its host mirror; survives ``close()``.

    Attributes:
        plan: the geometry's `LayoutPlan`.
        host: the `HostLayout` mirror (never read back from the device).
        flat: name -> tensor, every tensor of `state_specs`.
        blocks: block size -> its `BlockTensors` (views into ``flat``).
        launchers: bound kernels of this geometry, built on first use.
    """

    def __init__(self, plan: LayoutPlan, flat: dict[str, torch.Tensor], num_layers: int = 1):
        self.plan, self.flat = plan, flat
        self.host = HostLayout(plan, num_layers)
        self.blocks = _block_views(plan, flat)
        self.launchers: dict = {}
        flat["desc"].copy_(torch.from_numpy(plan.descriptor()))

    @classmethod
    def carve(cls, arena, plan: LayoutPlan, num_layers: int = 1) -> "GeometryState":
        """Carve every tensor from ``arena``: all of them, or none (the arena is rolled
        back when anything fails)."""
        mark = arena.mark()
        try:
            flat = {name: arena.empty(shape, dtype, name=name)
                    for name, shape, dtype in state_specs(plan)}
            return cls(plan, flat, num_layers)
        except BaseException:
            arena.release_to(mark)
            raise

    @property
    def counters(self) -> torch.Tensor:
        """int64 [4]: committed, ring_base, ring shift, pad (advanced on the device)."""
        return self.flat["counters"]

    @property
    def table(self) -> torch.Tensor:
        """int64 [F + R]: fixed pages, then the ring."""
        return self.flat["table"]

    def reset(self) -> None:
        """Position 0: host mirror, counters and layout from the host model (an upload
        at open is fine; commits never upload)."""
        self.host.reset()
        self.upload()

    def upload(self) -> None:
        """Counters, table and per-block tensors from the host mirror: the device state
        of the mirror's position (open, and recovery after a failed commit)."""
        h = self.host
        self.counters.copy_(torch.tensor([h.committed, h.ring_base, 0, 0], dtype=torch.int64))
        self.upload_layout()

    def upload_layout(self) -> None:
        """Host model -> the geometry's table and per-block tensors."""
        self.table.copy_(torch.from_numpy(np.ascontiguousarray(self.host.table)))
        flat = self.host.flat_layout()
        for name in FLAT_FIELDS:
            self.flat[name].copy_(torch.from_numpy(np.ascontiguousarray(getattr(flat, name))))


def _block_views(plan: LayoutPlan, t: dict[str, torch.Tensor]) -> dict[int, BlockTensors]:
    """Per-block-size views into the flat tensors (same bytes, fixed addresses)."""
    out = {}
    cols = {name: i for i, name in enumerate(DESC_COLUMNS)}
    for bp, d in zip(plan.blocks, plan.descriptor().tolist()):
        nb, rp = d[cols["nb"]], d[cols["row_pages"]]
        rows_off, blocks_off, staged_off = (d[cols[c]] for c in
                                            ("rows_off", "blocks_off", "staged_off"))
        sl = slice(staged_off, staged_off + bp.staged_len)
        out[bp.block_size] = BlockTensors(
            bp.block_size, t["rows"][rows_off:rows_off + nb * rp].view(nb, rp),
            t["seq_len_kv"][blocks_off:blocks_off + nb], t["seq_len_q"][blocks_off:blocks_off + nb],
            t["staged_src"][sl], t["staged_dst"][sl], t["staged_dst2"][sl])
    return out

