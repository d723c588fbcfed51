"""The cuDNN backend: cudnn-frontend paged SDPA over the cache's per-block rows.

One layer of a forward is one cuDNN launch: the causal blocks are a batch of nb rows,
each with its own ``seq_len_q`` (= b) and ``seq_len_kv`` (device tensors the cache
rewrites at commit), its row of the page table, and the padding mask cutting it there.
With split-KV each row is S sub-rows and a fused merge follows (`split_kv`).

Plan and run (see `backend`): `CudnnBackend.plan` chooses S and whether to pack GQA
query heads (`packing`) by the wave model (or as pinned) for one (cache, geometry,
token count, block size, heads, scale) and returns a `CudnnPlan` that owns the split
and packing buffers; its ``prepare`` rebuilds the sub-rows once per
forward, its ``run`` launches one layer. Built cuDNN graphs (`cudnn_graph`) and their
workspaces are shared by every plan of the backend, so one backend instance serves
every layer of a model. Every pointer a launch reads is fixed (arena tensors), so a
captured forward replays correctly after any number of commits.

fp8 pools (e4m3, Hopper or newer) run cuDNN's fp8 SDPA (scales and buffers: `cudnn_fp8`);
under a cuDNN older than `FP8_RAGGED_CUDNN`, unsplit where several blocks need ragged Q.
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
from .cudnn_fp8 import FP8, FP8_CAPABILITY, Fp8Buffers, QState
from .cudnn_graph import FP8_RAGGED_CUDNN, UID, PagedGraphKey, PlanFiles, build_graph
from .packing import PackBuffers
from .split_kv import SplitBuffers, blocks_view, choose_layout

# Address space for workspaces and split buffers; only what is carved is mapped.
_WORKSPACE_RESERVE = 8 << 30

@dataclass
class _Executable:
    graph: object
    workspace: torch.Tensor
    key: PagedGraphKey  # what the graph was built for


class CudnnPlan(AttentionPlan):
    """One forward shape over one cache: S, the split buffers, the launches.

    Attributes (besides `AttentionPlan`'s):
        splits: S chosen for this forward; ``split`` the `SplitBuffers` when S > 1.
        packed: GQA query packing chosen; ``group`` g query heads per row (1 when not
            packed); ``pack`` the `PackBuffers` when packed without a split.
        fp8: the `Fp8Buffers` over an fp8 cache, else None.
    """

    def __init__(self, backend: "CudnnBackend", cache, *, tokens: int, block_size: int,
                 num_heads: int, scale: float, splits: int, batch: int = 1,
                 packed: bool = False):
        super().__init__(cache, tokens=tokens, block_size=block_size, num_heads=num_heads,
                         scale=scale, batch=batch)
        self.backend, self.splits = backend, splits
        self.group = num_heads // cache.num_kv_heads if packed else 1
        self.packed = self.group > 1
        # Every sequence's blocks are rows of one cuDNN batch: B * nb rows.
        self.num_blocks = nb = batch * (tokens // block_size)
        bt = cache.batch_blocks(batch, block_size, tokens)  # fixed addresses, refreshed by select
        self._rows, self._kv_lens, self._q_lens = bt.rows, bt.seq_len_kv, bt.seq_len_q
        self.split = None if splits == 1 else SplitBuffers.allocate(
            backend.arena(cache.device.index), splits=splits, num_blocks=nb,
            block_size=block_size, row_pages=bt.rows.shape[1],
            tokens_per_page=cache.tokens_per_page, num_heads=num_heads,
            head_dim=cache.head_dim, dtype=cache.dtype, group=self.group)
        self.pack = None if splits > 1 or not self.packed else PackBuffers.allocate(
            backend.arena(cache.device.index), num_blocks=nb, block_size=block_size,
            num_heads=num_heads, num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim,
            dtype=cache.dtype)
        self.fp8 = Fp8Buffers.allocate(backend, self) if cache.dtype == FP8 else None
        self._staged: set[int] = set()  # layers whose Q the prologue quantizes this forward
        self._launches: dict[tuple, _Executable] = {}  # by (q strides, o strides)

    def refresh(self) -> None:
        """Rebuild the sub-row tables and key counts from the selected rows (S > 1);
        fp8: the staged layers' Q scales from their bounds."""
        if self.split is not None:
            self.split.rebuild(self._rows, self._kv_lens)
        if self.fp8 is not None:
            self._staged.clear()
            self.fp8.staged_scales(self.cache)

    def stage_outputs(self, layer: int) -> dict:
        """fp8, for a layer with a declared Q bound (`CudnnBackend.set_q_bounds`): the
        staging kernel's Q outputs, ``q_out`` (this plan's e4m3 Q, [B, T, H, D] for the
        forward's T real tokens per sequence), ``q_scale`` (fp32 [H]) and ``q_saturated``
        (int64 [1], a running count); `run` of that layer then reads ``q_out`` instead
        of q. Call it only for a staging that runs before this forward's `run` of
        ``layer`` (the module's prologue). Otherwise {}."""
        f = self.fp8
        if f is None or not f.q_state.known[layer]:
            return {}
        self._staged.add(layer)
        return {"q_out": f.q8.unflatten(0, (self.batch, self.tokens)),
                "q_scale": f.q_scale[layer], "q_saturated": f.q_state.saturated[layer:layer + 1]}

    def run(self, q, layer, out):
        b, sp, pk, f = self.block_size, self.split, self.pack, self.fp8
        if f is not None and layer in self._staged:  # the prologue wrote fp8 Q
            self._staged.discard(layer)
            exe, pack = self.launch(f.q8, layer, out)
        else:
            exe, pack = self.launch(q, layer, out)
        exe.graph.execute(pack, exe.workspace, handle=self.backend.handle_on_stream(q.device))
        if f is not None:  # dequantize where the partials are read: the merge
            scales = dict(scale=f.descale_o[layer:layer + 1], head_scale=self.cache.kv_scales[layer, 1])
            if sp is not None:
                merge_split_kv_(out, sp.merge_input(), sp.lse, sp.kv_lens, block_size=b,
                                seq_len=q.shape[0], **scales)
            else:  # one sub-row of weight 1: the dequantization alone
                merge_split_kv_(out, f.unsplit_output(self), f.zero_lse, self._kv_lens,
                                block_size=b, seq_len=q.shape[0], **scales)
        elif sp is not None:
            merge_split_kv_(out, sp.merge_input(), sp.lse, sp.kv_lens, block_size=b,
                            seq_len=q.shape[0])
        elif pk is not None:
            pk.unpack(out)

    def launch(self, q, layer, out) -> tuple[_Executable, dict]:
        """The cuDNN launch of `run` for q [T, H, D], ``layer`` and out [T, H, D]: its
        built graph with workspace and key, and its variant pack (uid -> tensor). Packs the
        queries (one copy, when packed; split over several blocks, the row offsets) as
        `run` does. fp8: a q that is not e4m3 is quantized into the plan's fp8 Q first
        (q that is the plan's fp8 Q, as staged, is read as it is), and the layer's output
        scale is set; cuDNN writes the plan's fp8 output, which `run` dequantizes."""
        nb, b, sp, pk, f = self.num_blocks, self.block_size, self.split, self.pack, self.fp8
        if f is not None:
            if q.dtype != FP8:
                f.quantize(q, layer, self.cache)
            f.output_scale(layer, self.cache)
            q = f.q8
        direct = f is not None and f.direct  # Q already in the packed order cuDNN reads
        if sp is not None:
            qv = sp.packed_query() if direct else sp.query(q)
            ov, table, kv_lens, q_lens = sp.partial_view(), sp.table, sp.kv_lens, sp.q_lens
        elif pk is not None:
            qv = pk.q if direct else pk.query(q)
            ov, table, kv_lens, q_lens = pk.out, self._rows, self._kv_lens, pk.q_lens
        else:
            o = out if f is None else f.o8
            qv, ov, table = blocks_view(q, nb, b), blocks_view(o, nb, b), self._rows
            kv_lens, q_lens = self._kv_lens, self._q_lens
        n = self.splits * nb
        k_pages, v_pages = self.cache.page_view(layer)  # [pages, H_kv, tpp, D]
        table = table.view(n, 1, -1, 1)
        pack = {UID["q"]: qv, UID["o"]: ov, UID["k"]: k_pages, UID["v"]: v_pages,
                UID["k_table"]: table, UID["v_table"]: table,
                UID["seq_len_q"]: q_lens.view(n, 1, 1, 1),
                UID["seq_len_kv"]: kv_lens.view(n, 1, 1, 1)}
        if sp is not None:
            pack[UID["stats"]] = sp.lse
            if sp.q_offsets is not None:  # several blocks: sub-rows share their block's queries
                pack[UID["q_offsets"]] = sp.q_offsets.view(n + 1, 1, 1, 1)
        if f is not None:
            pack.update(f.scalars(layer))
        return self._executable(qv, ov), pack

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
                scale=self.scale, splits=self.splits, query_group=self.group,
                q_offsets=self.split is not None and self.split.q_offsets is not None)
            exe = self._launches[strides] = self.backend.executable(key)
        return exe


class CudnnBackend(AttentionBackend):
    """cudnn-frontend paged SDPA (Hopper or newer, bf16/fp16 caches; fp8 e4m3 caches
    through cuDNN's fp8 SDPA, see the module doc).

    Args:
        plan_dir: keep built execution plans in this folder and load them from it
            in later processes (created on first save); None builds every plan.
        split: split-KV sub-rows per causal block row: "auto" (the wave model,
            `split_kv.choose_split`), an int S for every forward, or a dict
            {block_size: S} (1 for sizes it does not name).
        pack: GQA query packing (`packing`): "auto" (the wave model,
            `split_kv.choose_layout`), True for every forward, False never. Models
            with as many K/V heads as query heads have nothing to pack.

    Attributes:
        plans_built, plans_loaded: how many cuDNN plans this backend built and loaded.

    fp8 caches under a cuDNN older than `FP8_RAGGED_CUDNN`: forwards of several blocks
    run unsplit whatever ``split`` says (module doc).
    """

    name = "cudnn"
    supports_kv_cache = True

    def __init__(self, plan_dir: str | os.PathLike | None = None, split="auto", pack="auto"):
        self.plan_files = PlanFiles(plan_dir) if plan_dir is not None else None
        self.split = _check_split(split)
        if pack not in ("auto", True, False):
            raise ValueError(f"pack must be 'auto', True or False, got {pack!r}")
        self.pack = pack
        self.plans_built = self.plans_loaded = 0
        self._plans: dict[tuple, CudnnPlan] = {}
        self._executables: dict[PagedGraphKey, _Executable] = {}
        self._handle = None
        self._arenas: dict[int, DeviceArena] = {}
        self._q_states: dict[int, QState] = {}  # fp8 caches by owner token

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
        if cache.dtype == FP8:
            cc = torch.cuda.get_device_capability(cache.device)
            if tuple(cc) < FP8_CAPABILITY:
                raise ValueError(
                    f"backend 'cudnn' reads a float8_e4m3fn kv_cache with cuDNN's fp8 SDPA, "
                    f"which needs compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} "
                    f"(Hopper) or newer; {cache.device} has {cc[0]}.{cc[1]}")
        elif cache.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"backend 'cudnn' needs a bfloat16, float16 or float8_e4m3fn "
                             f"kv_cache, got {cache.dtype}")

    def q_state(self, cache) -> QState:
        """The fp8 Q state (bounds, saturation counts) of ``cache`` (made on first use)."""
        token = owner_token(cache)
        st = self._q_states.get(token)
        if st is None:
            st = self._q_states[token] = QState(self.arena(cache.device.index), cache.num_layers)
        return st

    def set_q_bounds(self, cache, bounds) -> None:
        """Declare a bound on |q| per layer of an fp8 ``cache``'s forwards: a sequence of
        ``cache.num_layers`` positive finite numbers or Nones (a layer without one is
        quantized by the plan from its amax instead of by the staging), or None for
        none. A layer with a bound has its Q quantized by the fused prologue with
        qs = bound * max s_k / 448; |q| past the bound saturates and is counted
        (`q_saturated`). After an RMSNorm with weights w over n values, |q| <= sqrt(n) *
        max|w|. The values are read at each forward's prepare (captured graphs see new
        ones); whether a layer is staged is decided when a forward is captured."""
        if cache.dtype != FP8:
            raise ValueError(f"set_q_bounds needs a float8_e4m3fn kv_cache, got {cache.dtype}")
        L = cache.num_layers
        bounds = [None] * L if bounds is None else list(bounds)
        if len(bounds) != L:
            raise ValueError(f"bounds must hold one entry per layer ({L}), got {len(bounds)}")
        for i, x in enumerate(bounds):
            ok = x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)
                               and 0 < x < float("inf"))
            if not ok:
                raise ValueError(f"bounds[{i}] must be a positive finite number or None, got {x!r}")
        st = self.q_state(cache)
        values = torch.tensor([1.0 if x is None else float(x) for x in bounds], dtype=torch.float32)
        st.bound.copy_(values)
        st.known[:] = [x is not None for x in bounds]

    def q_saturated(self, cache) -> list[int]:
        """Q values the staging saturated, per layer of an fp8 ``cache`` (host ints:
        synchronises)."""
        return self.q_state(cache).saturated.tolist()

    def plan(self, cache, *, tokens, block_size, num_heads, scale, batch=1) -> CudnnPlan:
        self.check_cache(cache)
        key = (owner_token(cache), cache.geometry, tokens, block_size, num_heads, float(scale),
               batch)
        plan = self._plans.get(key)
        if plan is None:
            packed, S = self.layout_for(cache.geometry, cache.tokens_per_page, num_heads,
                                        tokens, block_size, cache.device, batch=batch,
                                        num_kv_heads=cache.num_kv_heads,
                                        fp8=cache.dtype == FP8 and not self.fp8_ragged_q())
            plan = self._plans[key] = CudnnPlan(self, cache, tokens=tokens, block_size=block_size,
                                                num_heads=num_heads, scale=float(scale), splits=S,
                                                batch=batch, packed=packed)
        return plan

    def layout_for(self, geometry, tokens_per_page: int, num_heads: int, tokens: int,
                   block_size: int, device=None, *, batch: int = 1,
                   num_kv_heads: int | None = None, fp8: bool = False) -> tuple[bool, int]:
        """(packed, S) of a forward of ``tokens`` queries per sequence in ``block_size``
        blocks over ``batch`` sequences of a cache of ``geometry`` with ``num_kv_heads``
        K/V heads (default ``num_heads``: nothing to pack): each pinned by ``pack`` and
        ``split``, else the wave model's choice. ``fp8``: an fp8 cache under a cuDNN
        without ragged fp8 Q, whose forwards of several blocks are unsplit (S = 1)."""
        split = self.split.get(block_size, 1) if isinstance(self.split, dict) else self.split
        if fp8 and batch * (tokens // block_size) > 1:  # sub-rows would need ragged Q
            split = 1
        hkv = num_heads if num_kv_heads is None else num_kv_heads
        if split != "auto" and (self.pack is False or hkv == num_heads):
            return False, split
        row_pages = LayoutPlan.for_geometry(geometry, tokens_per_page).block(block_size).row_pages
        return choose_layout(num_blocks=batch * (tokens // block_size), block_size=block_size,
                             num_heads=num_heads, num_kv_heads=hkv,
                             row_keys=row_pages * tokens_per_page, sms=self.sm_count(device),
                             pack=self.pack, split=split)

    def split_for(self, geometry, tokens_per_page: int, num_heads: int, tokens: int,
                  block_size: int, device=None, *, batch: int = 1,
                  num_kv_heads: int | None = None, fp8: bool = False) -> int:
        """S of such a forward (`layout_for`)."""
        return self.layout_for(geometry, tokens_per_page, num_heads, tokens, block_size,
                               device, batch=batch, num_kv_heads=num_kv_heads, fp8=fp8)[1]

    def fp8_ragged_q(self) -> bool:
        """Whether this cuDNN runs fp8 SDPA over ragged Q rows (`FP8_RAGGED_CUDNN`)."""
        import cudnn
        return cudnn.backend_version() >= FP8_RAGGED_CUDNN

    @staticmethod
    def sm_count(device) -> int:
        """Streaming multiprocessors of ``device`` (the wave model's slots)."""
        device = torch.device("cuda") if device is None else torch.device(device)
        return torch.cuda.get_device_properties(device).multi_processor_count

    # ------------------------------------------------------------------ building
    def handle_on_stream(self, device):
        """`handle`, bound to torch's current stream on ``device`` (every launch)."""
        import cudnn

        handle = self.handle()
        cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)
        return handle

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
        exe = self._executables[key] = _Executable(graph, workspace, key)
        return exe

    def arena(self, device: int) -> DeviceArena:
        """The device arena of this backend's workspaces and split buffers."""
        arena = self._arenas.get(device)
        if arena is None:
            arena = self._arenas[device] = DeviceArena(_WORKSPACE_RESERVE,
                                                       device=torch.device("cuda", device))
        return arena


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
