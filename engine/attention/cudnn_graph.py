"""cuDNN paged-SDPA graphs: what one graph bakes in, how it is built, and plan files.

A cuDNN graph is built for one `PagedGraphKey` (built graphs are shared by every layer
and every plan with that key). The tensors it binds::

    Q      [n, H, b, D]            strided view of the queries (packed QKV: no copy)
    K, V   [pages, H_kv, tpp, D]   the pool layer, token-major pages viewed by strides
    table  [n, 1, row_pages, 1]    rows of the block size (int32)
    O      [n, H, b, D]            strided view of the output
    stats  [n, H, b, 1] fp32       log-sum-exp per query, only when split (S > 1)
    q_offsets [n + 1] int64        with ``q_offsets``: where each row's queries start

With GQA query packing (``query_group`` g > 1, `packing`) Q, O and stats are
[n, H / g, g * b, ...]: the g query heads of a K/V head stacked along the query axis.

An fp8 key (``dtype`` "torch.float8_e4m3fn") builds cuDNN's fp8 SDPA (``sdpa_fp8``):
Q, K, V and O are e4m3 (an fp8 output: Hopper has no other), and it binds six fp32
[1, 1, 1, 1] scalars and two fp32 [1, 1, 1, 1] outputs, all device tensors read or
written at each launch (so scales change without a rebuild)::

    descale_q, descale_k, descale_v   S = (q * dq) (k * dk)^T * scale
    scale_s, descale_s                P quantized as e4m3(P * scale_s), read * descale_s
    scale_o                           O stored as e4m3(O * scale_o)
    amax_s, amax_o                    max |P| and max |O| of the launch

cuDNN's fp8 SDPA takes ragged Q (``q_offsets``) from cuDNN `FP8_RAGGED_CUDNN` on;
an older cuDNN gets no fp8 key with ``q_offsets`` (`CudnnBackend.layout_for`).

A split over several blocks has rows n = s * nb + j that read block j's queries: no
single batch stride maps n onto j, so Q's rows are ragged (``q_offsets``: cuDNN reads
row n's queries at element ``q_offsets[n]`` of Q, its batch stride unused), and the S
sub-rows of a block share one copy of its queries: they read what S copies would hold,
and no copy is written.

Built plans can be kept on disk (`PlanFiles`): one file per key, named by a hash of the
key, the cuDNN and frontend versions and the GPU, so a plan is only ever loaded where it
was built. A file that fails to load is rebuilt and replaced; writes are atomic.
"""
from __future__ import annotations

import hashlib
import os
import warnings

import msgspec
import torch

from ..files import written_whole


class PagedGraphKey(msgspec.Struct, frozen=True):
    """Everything baked into one built cuDNN graph; a change in any field needs a new graph."""

    device: int              # plans and workspaces belong to one device
    dtype: str               # io data type of Q, K, V, O; float8_e4m3fn: the fp8 SDPA
    num_blocks: int          # batch of the graph: S * B * (T // b) rows (B sequences)
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
    query_group: int = 1     # g query heads stacked per row (GQA packing): H / g heads of g * b
    q_offsets: bool = False  # Q rows at per-row offsets (ragged): a split's rows share queries

    @property
    def fp8(self) -> bool:
        """Whether the graph is cuDNN's fp8 SDPA (e4m3 Q, K, V and O, scalar scales)."""
        return self.dtype == FP8_DTYPE


#: The `PagedGraphKey.dtype` of fp8 graphs.
FP8_DTYPE = str(torch.float8_e4m3fn)

#: Tensor uids: a plan loaded from disk has no tensor objects, so packs bind by uid.
UID = {"q": 1, "k": 2, "v": 3, "o": 4, "k_table": 5, "v_table": 6, "seq_len_q": 7,
       "seq_len_kv": 8, "stats": 9, "q_offsets": 10,
       # fp8 graphs only: fp32 [1, 1, 1, 1] scalars in, then the two amax outputs
       "descale_q": 11, "descale_k": 12, "descale_v": 13, "descale_s": 14, "scale_s": 15,
       "scale_o": 16, "amax_s": 17, "amax_o": 18}

#: The oldest cuDNN (``cudnn.backend_version()``) whose fp8 SDPA framekv runs with
#: ragged Q (a split forward of several blocks); older ones refuse such a graph.
FP8_RAGGED_CUDNN = 91900


#: The scalars an fp8 graph reads, in `sdpa_fp8`'s argument order.
FP8_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")


def build_graph(key: PagedGraphKey, handle):
    """Build (validate, plan, compile) the cuDNN graph of ``key``; ValueError naming
    the key when cuDNN cannot."""
    import cudnn

    g = _planned(key, handle, [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    try:
        g.check_support()
        g.build_plans()
    except Exception as e:
        raise ValueError(f"cuDNN cannot build paged attention for {key}: {e}") from e
    return g


def candidate_plans(key: PagedGraphKey, handle):
    """The graph of ``key`` with every execution plan cuDNN's heuristics propose (modes
    A, B and the fallback; none built): ``get_execution_plan_count``,
    ``build_plan_at_index(i)``, ``execute_plan_at_index(pack, workspace, i, handle)``.
    For timing the plans against the one `build_graph` picks (`framekv.bench.cudnn_plans`)."""
    import cudnn

    return _planned(key, handle, [cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])


def _planned(key: PagedGraphKey, handle, modes):
    """The graph of ``key``, validated, with the plans of heuristic ``modes`` listed."""
    g = _define(key, handle)
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans(modes)
    except Exception as e:
        raise ValueError(f"cuDNN cannot build paged attention for {key}: {e}") from e
    return g


def _define(key: PagedGraphKey, handle):
    """The paged SDPA graph of ``key``, its tensors given their uids (not yet validated)."""
    import cudnn

    dt = {"torch.bfloat16": cudnn.data_type.BFLOAT16, "torch.float16": cudnn.data_type.HALF,
          FP8_DTYPE: cudnn.data_type.FP8_E4M3}[key.dtype]
    nb, Hkv, D, qg = key.num_blocks, key.num_kv_heads, key.head_dim, key.query_group
    b, H = key.block_size * qg, key.num_heads // qg  # packed: H / g heads of g * b queries
    tpp, rp = key.tokens_per_page, key.row_pages
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
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
    if key.q_offsets:  # element offsets, int64 (cuDNN >= 9.6); entry n: the end
        t["q_offsets"] = g.tensor(name="q_offsets", dim=[nb + 1, 1, 1, 1], stride=[1, 1, 1, 1],
                                  data_type=cudnn.data_type.INT64)
        t["q"].set_ragged_offset(t["q_offsets"])
    paged = dict(generate_stats=key.splits > 1, attn_scale=key.scale, use_padding_mask=True,
                 seq_len_q=t["seq_len_q"], seq_len_kv=t["seq_len_kv"],
                 paged_attention_k_table=t["k_table"], paged_attention_v_table=t["v_table"],
                 paged_attention_max_seq_len_kv=rp * tpp)
    if key.fp8:
        for name in FP8_SCALARS:
            t[name] = g.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                               data_type=cudnn.data_type.FLOAT)
        o, stats, amax_s, amax_o = g.sdpa_fp8(name="paged_sdpa_fp8", q=t["q"], k=t["k"],
                                              v=t["v"], **{n: t[n] for n in FP8_SCALARS},
                                              **paged)
        for name, amax in (("amax_s", amax_s), ("amax_o", amax_o)):
            amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(
                cudnn.data_type.FLOAT)
            t[name] = amax
    else:
        o, stats = g.sdpa(name="paged_sdpa", q=t["q"], k=t["k"], v=t["v"], **paged)
    o.set_output(True).set_dim([nb, H, b, D]).set_stride([os_[0], os_[2], os_[1], 1]).set_data_type(dt)
    t["o"] = o
    if key.splits > 1:  # log-sum-exp per (row, head, query), fp32 [nb, H, b, 1]
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        t["stats"] = stats
    for name, tensor in t.items():
        tensor.set_uid(UID[name])
    return g


class PlanFiles:
    """Built cuDNN plans kept in one folder across processes.

    Args:
        folder: where plan files live (created on the first save).
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = os.fspath(folder)

    def path(self, key: PagedGraphKey) -> str:
        """The file of ``key`` on this machine's cuDNN, frontend and GPU."""
        import cudnn

        ident = (msgspec.json.encode(key) + f"|cudnn {cudnn.backend_version()}|frontend "
                 f"{getattr(cudnn, '__version__', '?')}|{torch.cuda.get_device_name(key.device)}"
                 f"|cc {torch.cuda.get_device_capability(key.device)}".encode())
        return os.path.join(self.folder, hashlib.sha256(ident).hexdigest()[:32] + ".plan")

    def load(self, key: PagedGraphKey, handle):
        """The graph saved for ``key``, or None (no file, or one that did not load: a
        warning says so, and the caller rebuilds and saves over it)."""
        import cudnn

        path = self.path(key)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                data = f.read()
            graph = cudnn.pygraph()
            graph.deserialize(handle, data)
            return graph
        except Exception as e:  # a truncated or foreign file: rebuild and replace it
            warnings.warn(f"cuDNN plan {path} did not load ({e}); rebuilding it", stacklevel=3)
            return None

    def save(self, key: PagedGraphKey, graph) -> None:
        """Write ``graph`` as ``key``'s file, the folder made if missing (readers see
        all of it or nothing: `framekv.engine.files.written_whole`)."""
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with written_whole(path) as tmp, open(tmp, "wb") as f:
            f.write(bytes(graph.serialize(as_bytes=True)))
