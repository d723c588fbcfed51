"""The cuDNN backend: cudnn-frontend paged SDPA over the cache's per-block rows.

One layer of a forward is one cuDNN launch: the causal blocks are a batch of nb rows,
each with its own ``seq_len_q`` (= b) and ``seq_len_kv`` (device tensors the cache
rewrites at commit), its row of the page table, and the padding mask cutting it there.
With split-KV each row is S sub-rows and a fused merge follows (`split_kv`).

Plan and run (see `backend`): `CudnnBackend.plan` chooses S by the wave model (or as
pinned) for one (cache, geometry, token count, block size, heads, scale) and returns a
`CudnnPlan` that owns the split buffers; its ``prepare`` rebuilds the sub-rows once per
forward, its ``run`` launches one layer. Built cuDNN graphs (`cudnn_graph`) and their
workspaces are shared by every plan of the backend, so one backend instance serves
every layer of a model. Every pointer a launch reads is fixed (arena tensors), so a
captured forward replays correctly after any number of commits.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from framekv.graphs.keys import owner_token
from framekv.ops.merge_split_kv import merge_split_kv_

from ..arena import DeviceArena
from ..cache import LayoutPlan
from .backend import AttentionBackend, AttentionPlan
from .cudnn_graph import UID, PagedGraphKey, PlanFiles, build_graph
from .split_kv import SplitBuffers, blocks_view, choose_split

# Address space for workspaces and split buffers; only what is carved is mapped.
_WORKSPACE_RESERVE = 8 << 30


@dataclass
class _Executable:
    graph: object
    workspace: torch.Tensor


class CudnnPlan(AttentionPlan):
    """One forward shape over one cache: S, the split buffers, the launches.

    Attributes (besides `AttentionPlan`'s):
        splits: S chosen for this forward; ``split`` the `SplitBuffers` when S > 1.
    """

    def __init__(self, backend: "CudnnBackend", cache, *, tokens: int, block_size: int,
                 num_heads: int, scale: float, splits: int, batch: int = 1):
        super().__init__(cache, tokens=tokens, block_size=block_size, num_heads=num_heads,
                         scale=scale, batch=batch)
        self.backend, self.splits = backend, splits
        # Every sequence's blocks are rows of one cuDNN batch: B * nb rows.
        self.num_blocks = nb = batch * (tokens // block_size)
        bt = cache.batch_blocks(batch, block_size, tokens)  # fixed addresses, refreshed by select
        self._rows, self._kv_lens, self._q_lens = bt.rows, bt.seq_len_kv, bt.seq_len_q
        self.split = None if splits == 1 else SplitBuffers.allocate(
            backend.arena(cache.device.index), splits=splits, num_blocks=nb,
            block_size=block_size, row_pages=bt.rows.shape[1],
            tokens_per_page=cache.tokens_per_page, num_heads=num_heads,
            head_dim=cache.head_dim, dtype=cache.dtype)
        self._launches: dict[tuple, _Executable] = {}  # by (q strides, o strides)

    def refresh(self) -> None:
        """Rebuild the sub-row tables and key counts from the selected rows (S > 1)."""
        if self.split is not None:
            self.split.rebuild(self._rows, self._kv_lens)

    def run(self, q, layer, out):
        import cudnn

        nb, b, sp = self.num_blocks, self.block_size, self.split
        if sp is None:
            qv, ov, table = blocks_view(q, nb, b), blocks_view(out, nb, b), self._rows
            kv_lens, q_lens = self._kv_lens, self._q_lens
        else:
            qv, ov, table = sp.query(q), sp.partial_view(), sp.table
            kv_lens, q_lens = sp.kv_lens, sp.q_lens
        exe = self._executable(qv, ov)
        n = self.splits * nb
        k_pages, v_pages = self.cache.page_view(layer)  # [pages, H_kv, tpp, D]
        table = table.view(n, 1, -1, 1)
        pack = {UID["q"]: qv, UID["o"]: ov, UID["k"]: k_pages, UID["v"]: v_pages,
                UID["k_table"]: table, UID["v_table"]: table,
                UID["seq_len_q"]: q_lens.view(n, 1, 1, 1),
                UID["seq_len_kv"]: kv_lens.view(n, 1, 1, 1)}
        if sp is not None:
            pack[UID["stats"]] = sp.lse
        handle = self.backend.handle()
        cudnn.set_stream(handle, torch.cuda.current_stream(q.device).cuda_stream)
        exe.graph.execute(pack, exe.workspace, handle=handle)
        if sp is not None:
            merge_split_kv_(out, sp.partial, sp.lse, sp.kv_lens, block_size=b, seq_len=q.shape[0])

    def _executable(self, qv: torch.Tensor, ov: torch.Tensor) -> _Executable:
        strides = ((qv.stride(0), qv.stride(2), qv.stride(1)), (ov.stride(0), ov.stride(2), ov.stride(1)))
        exe = self._launches.get(strides)
        if exe is None:
            c = self.cache
            key = PagedGraphKey(
                device=c.device.index, dtype=str(c.dtype), num_blocks=self.splits * self.num_blocks,
                block_size=self.block_size, num_heads=self.num_heads,
                num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, q_strides=strides[0],
                o_strides=strides[1], num_pages=c.num_pages, tokens_per_page=c.tokens_per_page,
                row_pages=(self.split.table if self.split else self._rows).shape[1],
                scale=self.scale, splits=self.splits)
            exe = self._launches[strides] = self.backend.executable(key)
        return exe


class CudnnBackend(AttentionBackend):
    """cudnn-frontend paged SDPA (Hopper or newer, bf16/fp16).

    Args:
        plan_dir: keep built execution plans in this folder and load them from it
            in later processes (created on first save); None builds every plan.
        split: split-KV sub-rows per causal block row: "auto" (the wave model,
            `split_kv.choose_split`), an int S for every forward, or a dict
            {block_size: S} (1 for sizes it does not name).

    Attributes:
        plans_built, plans_loaded: how many cuDNN plans this backend built and loaded.
    """

    name = "cudnn"
    supports_kv_cache = True

    def __init__(self, plan_dir: str | os.PathLike | None = None, split="auto"):
        self.plan_files = PlanFiles(plan_dir) if plan_dir is not None else None
        self.split = _check_split(split)
        self.plans_built = self.plans_loaded = 0
        self._plans: dict[tuple, CudnnPlan] = {}
        self._executables: dict[PagedGraphKey, _Executable] = {}
        self._handle = None
        self._arenas: dict[int, DeviceArena] = {}

    @property
    def plan_dir(self) -> str | None:
        """The plan-file folder, or None."""
        return self.plan_files.folder if self.plan_files is not None else None

    # ------------------------------------------------------------------ dense
    def dense(self, q, k, v, scale):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [1, H, S, D]
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, scale=scale, enable_gqa=kt.shape[1] != qt.shape[1])
        return o.transpose(1, 2)

    # ------------------------------------------------------------------ cached
    def check_cache(self, cache) -> None:
        if cache.device.type != "cuda":
            raise ValueError(f"backend 'cudnn' needs a CUDA kv_cache, got one on {cache.device}")
        if cache.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"backend 'cudnn' needs a bfloat16/float16 kv_cache, got {cache.dtype}")

    def plan(self, cache, *, tokens, block_size, num_heads, scale, batch=1) -> CudnnPlan:
        self.check_cache(cache)
        key = (owner_token(cache), cache.geometry, tokens, block_size, num_heads, float(scale),
               batch)
        plan = self._plans.get(key)
        if plan is None:
            S = self.split_for(cache.geometry, cache.tokens_per_page, num_heads, tokens,
                               block_size, cache.device, batch=batch)
            plan = self._plans[key] = CudnnPlan(self, cache, tokens=tokens, block_size=block_size,
                                                num_heads=num_heads, scale=float(scale), splits=S,
                                                batch=batch)
        return plan

    def split_for(self, geometry, tokens_per_page: int, num_heads: int, tokens: int,
                  block_size: int, device=None, *, batch: int = 1) -> int:
        """S of a forward of ``tokens`` queries per sequence in ``block_size`` blocks
        over ``batch`` sequences of a cache of ``geometry``: pinned by ``split``, else
        the wave model's choice."""
        if isinstance(self.split, int):
            return self.split
        if isinstance(self.split, dict):
            return self.split.get(block_size, 1)
        row_pages = LayoutPlan.for_geometry(geometry, tokens_per_page).block(block_size).row_pages
        return choose_split(num_blocks=batch * (tokens // block_size), block_size=block_size,
                            num_heads=num_heads, row_keys=row_pages * tokens_per_page,
                            sms=_sm_count(device))

    # ------------------------------------------------------------------ building
    def handle(self):
        """The cuDNN handle every launch of this backend uses (created on first use)."""
        import cudnn

        if self._handle is None:
            self._handle = cudnn.create_handle()
        return self._handle

    def executable(self, key: PagedGraphKey) -> _Executable:
        """The built graph of ``key`` and its workspace: loaded from the plan files when
        there, else built (and saved); shared by every plan with that key."""
        exe = self._executables.get(key)
        if exe is not None:
            return exe
        graph = self.plan_files.load(key, self.handle()) if self.plan_files else None
        if graph is None:
            graph = build_graph(key, self.handle())
            self.plans_built += 1
            if self.plan_files is not None:
                self.plan_files.save(key, graph)
        else:
            self.plans_loaded += 1
        workspace = self.arena(key.device).empty(max(graph.get_workspace_size(), 1), torch.uint8,
                                                 name="cudnn_workspace")
        exe = self._executables[key] = _Executable(graph, workspace)
        return exe

    def arena(self, device: int) -> DeviceArena:
        """The device arena of this backend's workspaces and split buffers."""
        arena = self._arenas.get(device)
        if arena is None:
            arena = self._arenas[device] = DeviceArena(_WORKSPACE_RESERVE,
                                                       device=torch.device("cuda", device))
        return arena


def _sm_count(device) -> int:
    device = torch.device("cuda") if device is None else torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_split(split):
    """``split`` as the backend keeps it; ValueError naming what is wrong."""
    if split == "auto":
        return split
    if isinstance(split, int) and not isinstance(split, bool):
        if split < 1:
            raise ValueError(f"split must be 'auto', an int >= 1 or a dict, got {split}")
        return split
    if isinstance(split, dict):
        for b, s in split.items():
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise ValueError(f"split[{b}] must be an int >= 1, got {s!r}")
        return dict(split)
    raise ValueError(f"split must be 'auto', an int >= 1 or a dict {{block_size: S}}, got {split!r}")
