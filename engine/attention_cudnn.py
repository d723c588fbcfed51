"""The cuDNN backend: cudnn-frontend paged SDPA over the cache's per-block rows.

One forward is one cuDNN launch: the causal blocks are a batch of nb rows, each with
its own ``seq_len_q`` (= b) and ``seq_len_kv`` (device tensors the cache rewrites at
commit), its row of the page table, and the padding mask cutting it there (with
split-KV, S sub-rows per row and a merge after: see `framekv.engine.split_kv`)::

    Q      [nb, H, b, D]            strided view of q[0, :T] (packed QKV: no copy)
    K, V   [pages, H_kv, tpp, D]    the pool layer, token-major pages viewed by strides
    table  [nb, 1, row_pages, 1]    rows of the block size (int32)
    O      [nb, H, b, D]            strided view of out[0, :T]

Every pointer the kernel reads is fixed (arena tensors), so a captured forward
replays correctly after any number of commits.

Built plans can be kept on disk (``plan_dir``): one file per `PagedGraphKey`, named by
a hash of the key, the cuDNN and frontend versions and the GPU, so a plan is only ever
loaded where it was built. A file that fails to load is rebuilt and replaced.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from dataclasses import dataclass

import msgspec
import torch

from framekv.graphs.keys import owner_token
from framekv.ops.merge_split_kv import merge_split_kv_

from .arena import DeviceArena
from .attention_backends import AttentionBackend
from .layout_plan import LayoutPlan
from .split_kv import SplitBuffers, blocks_view as _blocks, choose_split

# Address space for workspaces and split buffers; only what is carved is mapped.
_WORKSPACE_RESERVE = 8 << 30


class PagedGraphKey(msgspec.Struct, frozen=True):
    """Everything baked into one built cuDNN graph; a change in any field needs a new graph."""

    device: int              # plans and workspaces belong to one device
    dtype: str               # io data type of Q, K, V, O
    num_blocks: int          # batch of the graph: S * (T // b) rows
    block_size: int          # s_q of every row
    num_heads: int           # H (query heads)
    num_kv_heads: int        # H_kv: GQA ratio baked into the kernel choice
    head_dim: int            # D
    q_strides: tuple         # Q's batch, token, head strides (packed QKV, split broadcast: 0)
    o_strides: tuple         # output batch, token and head strides
    num_pages: int           # K/V container extent
    tokens_per_page: int     # page size: the container's third dim
    row_pages: int           # table width; max_seq_len_kv = row_pages * tokens_per_page
    scale: float             # softmax scale is a graph constant (a stale scale would replay silently)
    splits: int = 1          # S: > 1 adds the softmax stats output the merge needs


# Tensor uids: a plan loaded from disk has no tensor objects, so packs bind by uid.
_UID = {"q": 1, "k": 2, "v": 3, "o": 4, "k_table": 5, "v_table": 6, "seq_len_q": 7,
        "seq_len_kv": 8, "stats": 9}


@dataclass
class _PagedGraph:
    graph: object
    workspace: torch.Tensor


class CudnnBackend(AttentionBackend):
    """cudnn-frontend paged SDPA (Hopper or newer, bf16/fp16).

    Args:
        plan_dir: keep built execution plans in this folder and load them from it
            in later processes (created on first save); None builds every plan.
        split: split-KV sub-rows per causal block row: "auto" (the wave model,
            `split_kv.choose_split`), an int S for every forward, or a dict
            {block_size: S} (1 for sizes it does not name).

    Attributes:
        plans_built, plans_loaded: how many plans this backend built and loaded.
    """

    name = "cudnn"
    supports_kv_cache = True

    def __init__(self, plan_dir: str | os.PathLike | None = None, split="auto"):
        self._graphs: dict[PagedGraphKey, _PagedGraph] = {}
        self._handle = None
        self._arenas: dict[int, DeviceArena] = {}
        self._splits: dict[tuple, SplitBuffers] = {}
        self.plan_dir = os.fspath(plan_dir) if plan_dir is not None else None
        self.split = _check_split(split)
        self.plans_built = self.plans_loaded = 0

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

    def split_for(self, geometry, tokens_per_page: int, num_heads: int, tokens: int,
                  block_size: int, device=None) -> int:
        """S used for a forward of ``tokens`` queries in ``block_size`` blocks over a cache
        of ``geometry`` (graph keys hold it: a different S is a different graph)."""
        if isinstance(self.split, int):
            return self.split
        if isinstance(self.split, dict):
            return self.split.get(block_size, 1)
        row_pages = LayoutPlan.for_geometry(geometry, tokens_per_page).block(block_size).row_pages
        return choose_split(num_blocks=tokens // block_size, block_size=block_size,
                            num_heads=num_heads, row_keys=row_pages * tokens_per_page,
                            sms=_sm_count(device))

    def cached(self, q, cache, layer, block_size, scale, out):
        import cudnn

        nb, b = q.shape[0] // block_size, block_size
        bt = cache.block_tensors(b)
        S = self.split_for(cache.geometry, cache.tokens_per_page, q.shape[1], q.shape[0], b,
                           q.device)
        if S == 1:
            qv, ov, table = _blocks(q, nb, b), _blocks(out, nb, b), bt.rows[:nb]
            kv_lens, q_lens = bt.seq_len_kv[:nb], bt.seq_len_q[:nb]
        else:
            sp = self._split_buffers(q, cache, nb, b, S)
            qv = sp.prepare(bt.rows[:nb], bt.seq_len_kv[:nb], q,
                            rebuild=self._rows_changed(sp, cache, bt, q.device))
            ov, table, kv_lens, q_lens = sp.partial_view(), sp.table, sp.kv_lens, sp.q_lens
        n = S * nb
        key = PagedGraphKey(
            device=q.device.index, dtype=str(q.dtype), num_blocks=n, block_size=b,
            num_heads=q.shape[1], num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim,
            q_strides=(qv.stride(0), qv.stride(2), qv.stride(1)),
            o_strides=(ov.stride(0), ov.stride(2), ov.stride(1)),
            num_pages=cache.num_pages, tokens_per_page=cache.tokens_per_page,
            row_pages=table.shape[1], scale=scale, splits=S)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._build(key)
        k_pages, v_pages = cache.page_view(layer)  # [pages, H_kv, tpp, D]
        table = table.view(n, 1, -1, 1)
        pack = {_UID["q"]: qv, _UID["o"]: ov, _UID["k"]: k_pages, _UID["v"]: v_pages,
                _UID["k_table"]: table, _UID["v_table"]: table,
                _UID["seq_len_q"]: q_lens.view(n, 1, 1, 1),
                _UID["seq_len_kv"]: kv_lens.view(n, 1, 1, 1)}
        if S > 1:
            pack[_UID["stats"]] = sp.lse
        handle = self._get_handle()
        cudnn.set_stream(handle, torch.cuda.current_stream(q.device).cuda_stream)
        entry.graph.execute(pack, entry.workspace, handle=handle)
        if S > 1:
            merge_split_kv_(out, sp.partial, sp.lse, sp.kv_lens, block_size=b, seq_len=q.shape[0])

    def _rows_changed(self, bufs: SplitBuffers, cache, bt, device) -> bool:
        """Whether the sub-rows must be rebuilt before this forward.

        The rows change only at open and commit (``cache.layout_epoch``), so one
        rebuild serves every layer of a forward and every forward of a chunk. Each
        new CUDA graph capture rebuilds once more: a graph replays after commits it
        did not see, so it must hold its own rebuild.
        """
        stamp = (cache.layout_epoch, bt.rows.data_ptr(), _capture_id(device))
        if bufs.stamp == stamp:
            return False
        bufs.stamp = stamp
        return True

    def _split_buffers(self, q, cache, nb: int, b: int, S: int) -> SplitBuffers:
        row_pages = cache.block_tensors(b).rows.shape[1]
        # Per cache: the rebuild-once rule reads one cache's epoch.
        key = (owner_token(cache), q.device.index, q.dtype, nb, b, S, row_pages,
               cache.tokens_per_page, q.shape[1], q.shape[2])
        bufs = self._splits.get(key)
        if bufs is None:
            bufs = self._splits[key] = SplitBuffers.allocate(
                self._arena(q.device.index), splits=S, num_blocks=nb, block_size=b,
                row_pages=row_pages, tokens_per_page=cache.tokens_per_page,
                num_heads=q.shape[1], head_dim=q.shape[2], dtype=q.dtype)
        return bufs

    # ------------------------------------------------------------------ building
    def _get_handle(self):
        import cudnn

        if self._handle is None:
            self._handle = cudnn.create_handle()
        return self._handle

    def _build(self, key: PagedGraphKey) -> _PagedGraph:
        """Load ``key``'s plan from ``plan_dir`` when there, else build (and save) it."""
        path = self._plan_path(key) if self.plan_dir is not None else None
        graph = self._load(key, path) if path is not None and os.path.exists(path) else None
        if graph is None:
            graph = self._build_plan(key)
            self.plans_built += 1
            if path is not None:
                _write_atomic(path, bytes(graph.serialize(as_bytes=True)))
        else:
            self.plans_loaded += 1
        return _PagedGraph(graph=graph,
                           workspace=self._workspace(key.device, graph.get_workspace_size()))

    def _plan_path(self, key: PagedGraphKey) -> str:
        import cudnn

        ident = (msgspec.json.encode(key) + f"|cudnn {cudnn.backend_version()}|frontend "
                 f"{getattr(cudnn, '__version__', '?')}|{torch.cuda.get_device_name(key.device)}"
                 f"|cc {torch.cuda.get_device_capability(key.device)}".encode())
        return os.path.join(self.plan_dir, hashlib.sha256(ident).hexdigest()[:32] + ".plan")

    def _load(self, key: PagedGraphKey, path: str):
        import cudnn

        try:
            with open(path, "rb") as f:
                data = f.read()
            graph = cudnn.pygraph()
            graph.deserialize(self._get_handle(), data)
            return graph
        except Exception as e:  # a truncated or foreign file: rebuild and replace it
            warnings.warn(f"cuDNN plan {path} did not load ({e}); rebuilding it", stacklevel=3)
            return None

    def _build_plan(self, key: PagedGraphKey):
        import cudnn

        dt = {"torch.bfloat16": cudnn.data_type.BFLOAT16, "torch.float16": cudnn.data_type.HALF}[key.dtype]
        nb, b, H, Hkv, D = key.num_blocks, key.block_size, key.num_heads, key.num_kv_heads, key.head_dim
        tpp, rp = key.tokens_per_page, key.row_pages
        g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self._get_handle())
        qs, os_ = key.q_strides, key.o_strides  # (batch, token, head)
        page = [tpp * Hkv * D, D, Hkv * D, 1]  # token-major pages viewed as [pages, H_kv, tpp, D]
        t = {
            "q": g.tensor(name="q", dim=[nb, H, b, D], stride=[qs[0], qs[2], qs[1], 1], data_type=dt),
            "k": g.tensor(name="k", dim=[key.num_pages, Hkv, tpp, D], stride=page, data_type=dt),
            "v": g.tensor(name="v", dim=[key.num_pages, Hkv, tpp, D], stride=page, data_type=dt),
        }
        for name, dims, strides in (("k_table", [nb, 1, rp, 1], [rp, rp, 1, 1]),
                                    ("v_table", [nb, 1, rp, 1], [rp, rp, 1, 1]),
                                    ("seq_len_q", [nb, 1, 1, 1], [1, 1, 1, 1]),
                                    ("seq_len_kv", [nb, 1, 1, 1], [1, 1, 1, 1])):
            t[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=cudnn.data_type.INT32)
        o, stats = g.sdpa(name="paged_sdpa", q=t["q"], k=t["k"], v=t["v"],
                      generate_stats=key.splits > 1,
                      attn_scale=key.scale, use_padding_mask=True,
                      seq_len_q=t["seq_len_q"], seq_len_kv=t["seq_len_kv"],
                      paged_attention_k_table=t["k_table"], paged_attention_v_table=t["v_table"],
                      paged_attention_max_seq_len_kv=rp * tpp)
        o.set_output(True).set_dim([nb, H, b, D]).set_stride([os_[0], os_[2], os_[1], 1]).set_data_type(dt)
        t["o"] = o
        if key.splits > 1:  # log-sum-exp per (row, head, query), fp32 [nb, H, b, 1]
            stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
            t["stats"] = stats
        for name, tensor in t.items():
            tensor.set_uid(_UID[name])
        try:
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        except Exception as e:
            raise ValueError(f"cuDNN cannot build paged attention for {key}: {e}") from e
        return g

    def _arena(self, device: int) -> DeviceArena:
        arena = self._arenas.get(device)
        if arena is None:
            arena = self._arenas[device] = DeviceArena(_WORKSPACE_RESERVE, device=torch.device("cuda", device))
        return arena

    def _workspace(self, device: int, nbytes: int) -> torch.Tensor:
        return self._arena(device).empty(max(nbytes, 1), torch.uint8, name="cudnn_workspace")


def _capture_id(device) -> int | None:
    """Id of the CUDA graph capture under way on the current stream, else None."""
    if not torch.cuda.is_current_stream_capturing():
        return None
    from cuda.bindings import runtime as rt

    stream = rt.cudaStream_t(init_value=torch.cuda.current_stream(device).cuda_stream)
    out = rt.cudaStreamGetCaptureInfo(stream)
    if int(out[0]) != 0:
        raise RuntimeError(f"cudaStreamGetCaptureInfo failed: {out[0]}")
    return int(out[2])


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


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file: readers see all or nothing."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
