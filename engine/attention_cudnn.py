"""The cuDNN backend: cudnn-frontend paged SDPA over the cache's per-block rows.

One forward is one cuDNN launch: the causal blocks are a batch of nb rows, each with
its own ``seq_len_q`` (= b) and ``seq_len_kv`` (device tensors the cache rewrites at
commit), its row of the page table, and the padding mask cutting it there::

    Q      [nb, H, b, D]            strided view of q[0, :T] (packed QKV: no copy)
    K, V   [pages, H_kv, tpp, D]    the pool layer, token-major pages viewed by strides
    table  [nb, 1, row_pages, 1]    rows of the block size (int32)
    O      [nb, H, b, D]            strided view of out[0, :T]

Every pointer the kernel reads is fixed (arena tensors), so a captured forward
replays correctly after any number of commits.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch

from .arena import DeviceArena
from .attention_backends import AttentionBackend

_WORKSPACE_RESERVE = 1 << 30  # address space for workspaces; only what is carved is mapped


class PagedGraphKey(msgspec.Struct, frozen=True):
    """Everything baked into one built cuDNN graph; a change in any field needs a new graph."""

    device: int              # plans and workspaces belong to one device
    dtype: str               # io data type of Q, K, V, O
    num_blocks: int          # batch of the graph: T // b rows
    block_size: int          # s_q of every row
    num_heads: int           # H (query heads)
    num_kv_heads: int        # H_kv: GQA ratio baked into the kernel choice
    head_dim: int            # D
    q_strides: tuple         # Q's token and head strides (packed QKV differs from plain q)
    o_strides: tuple         # output token and head strides
    num_pages: int           # K/V container extent
    tokens_per_page: int     # page size: the container's third dim
    row_pages: int           # table width; max_seq_len_kv = row_pages * tokens_per_page
    scale: float             # softmax scale is a graph constant (a stale scale would replay silently)


@dataclass
class _PagedGraph:
    graph: object
    tensors: dict        # name -> cudnn graph tensor
    workspace: torch.Tensor


class CudnnBackend(AttentionBackend):
    """cudnn-frontend paged SDPA (Hopper or newer, bf16/fp16)."""

    name = "cudnn"
    supports_kv_cache = True

    def __init__(self):
        self._graphs: dict[PagedGraphKey, _PagedGraph] = {}
        self._handle = None
        self._arenas: dict[int, DeviceArena] = {}

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

    def cached(self, q, cache, layer, block_size, scale, out):
        import cudnn

        nb, b = q.shape[0] // block_size, block_size
        bt = cache.block_tensors(b)
        key = PagedGraphKey(
            device=q.device.index, dtype=str(q.dtype), num_blocks=nb, block_size=b,
            num_heads=q.shape[1], num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim,
            q_strides=(q.stride(0), q.stride(1)), o_strides=(out.stride(0), out.stride(1)),
            num_pages=cache.num_pages, tokens_per_page=cache.tokens_per_page,
            row_pages=bt.rows.shape[1], scale=scale)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._build(key)
        k_pages, v_pages = cache.page_view(layer)  # [pages, H_kv, tpp, D]
        t = entry.tensors
        pack = {
            t["q"]: _blocks(q, nb, b), t["o"]: _blocks(out, nb, b),
            t["k"]: k_pages, t["v"]: v_pages,
            t["k_table"]: bt.rows[:nb].view(nb, 1, -1, 1), t["v_table"]: bt.rows[:nb].view(nb, 1, -1, 1),
            t["seq_len_q"]: bt.seq_len_q[:nb].view(nb, 1, 1, 1),
            t["seq_len_kv"]: bt.seq_len_kv[:nb].view(nb, 1, 1, 1),
        }
        handle = self._get_handle()
        cudnn.set_stream(handle, torch.cuda.current_stream(q.device).cuda_stream)
        entry.graph.execute(pack, entry.workspace, handle=handle)

    # ------------------------------------------------------------------ building
    def _get_handle(self):
        import cudnn

        if self._handle is None:
            self._handle = cudnn.create_handle()
        return self._handle

    def _build(self, key: PagedGraphKey) -> _PagedGraph:
        import cudnn

        dt = {"torch.bfloat16": cudnn.data_type.BFLOAT16, "torch.float16": cudnn.data_type.HALF}[key.dtype]
        nb, b, H, Hkv, D = key.num_blocks, key.block_size, key.num_heads, key.num_kv_heads, key.head_dim
        tpp, rp = key.tokens_per_page, key.row_pages
        g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=self._get_handle())
        qs, os_ = key.q_strides, key.o_strides
        t = {
            "q": g.tensor(name="q", dim=[nb, H, b, D], stride=[b * qs[0], qs[1], qs[0], 1], data_type=dt),
            "k": g.tensor(name="k", dim=[key.num_pages, Hkv, tpp, D],
                          stride=[tpp * Hkv * D, D, Hkv * D, 1], data_type=dt),
            "v": g.tensor(name="v", dim=[key.num_pages, Hkv, tpp, D],
                          stride=[tpp * Hkv * D, D, Hkv * D, 1], data_type=dt),
        }
        for name, dims, strides in (("k_table", [nb, 1, rp, 1], [rp, rp, 1, 1]),
                                    ("v_table", [nb, 1, rp, 1], [rp, rp, 1, 1]),
                                    ("seq_len_q", [nb, 1, 1, 1], [1, 1, 1, 1]),
                                    ("seq_len_kv", [nb, 1, 1, 1], [1, 1, 1, 1])):
            t[name] = g.tensor(name=name, dim=dims, stride=strides, data_type=cudnn.data_type.INT32)
        o, _ = g.sdpa(name="paged_sdpa", q=t["q"], k=t["k"], v=t["v"], generate_stats=False,
                      attn_scale=key.scale, use_padding_mask=True,
                      seq_len_q=t["seq_len_q"], seq_len_kv=t["seq_len_kv"],
                      paged_attention_k_table=t["k_table"], paged_attention_v_table=t["v_table"],
                      paged_attention_max_seq_len_kv=rp * tpp)
        o.set_output(True).set_dim([nb, H, b, D]).set_stride([b * os_[0], os_[1], os_[0], 1]).set_data_type(dt)
        t["o"] = o
        try:
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        except Exception as e:
            raise ValueError(f"cuDNN cannot build paged attention for {key}: {e}") from e
        return _PagedGraph(graph=g, tensors=t, workspace=self._workspace(key.device, g.get_workspace_size()))

    def _workspace(self, device: int, nbytes: int) -> torch.Tensor:
        arena = self._arenas.get(device)
        if arena is None:
            arena = self._arenas[device] = DeviceArena(_WORKSPACE_RESERVE, device=torch.device("cuda", device))
        return arena.empty(max(nbytes, 1), torch.uint8, name="cudnn_workspace")


def _blocks(x: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """[T, H, D] (any token/head strides) as [nb, H, b, D] without a copy."""
    s_tok, s_head = x.stride(0), x.stride(1)
    return x.as_strided((nb, x.shape[1], b, x.shape[2]), (b * s_tok, s_head, s_tok, 1))
