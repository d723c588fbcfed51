"""The cuDNN backend's own plans and launches on CPU, over a stand-in for cuDNN's paged SDPA.

`FakeCudnnBackend` is `CudnnBackend` with one thing replaced: cuDNN itself. Each graph
is defined by the real `cudnn_graph.build_graph` against `recording_cudnn`, a stand-in
for the ``cudnn`` module that records the tensors and the SDPA operation asked for
(`RecordingGraph`); `FakePagedGraph.execute` then checks that the variant pack binds
exactly the recorded uids with the recorded shapes and strides, and computes, in fp32
torch, what cuDNN's paged SDPA computes for a `PagedGraphKey` over those tensors:
query head h of a row reads K/V head h // (H' / H_kv) (cuDNN's GQA grouping), the
row's keys are its table's pages cut at ``seq_len_kv``, queries past ``seq_len_q`` come
back zero, and empty rows return NaN (cuDNN's output there is undefined; the merge must
skip them); with ``q_offsets`` row i's queries start at element ``q_offsets[i]`` of Q
(`ragged_rows`). An fp8 key (`sdpa_fp8`) reads e4m3 Q, K, V times their descales and
stores e4m3(O * scale_o) (P is kept in fp32: the fake does not model P's rounding), and
writes amax_s and amax_o. Everything else (the plan's layout choice, split, packing and
fp8 buffers, strides, scales, merge) is the real code.
"""
from __future__ import annotations

import contextlib
import sys
import types

import torch

from framekv.engine.attention.cudnn import CudnnBackend, _Executable
from framekv.engine.attention.cudnn_graph import FP8_RAGGED_CUDNN, UID, build_graph

FP8 = torch.float8_e4m3fn


def ragged_rows(q: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """The n rows cuDNN reads from Q [rows, H', s, D] given ragged ``offsets``: row i has
    Q's row layout and starts ``offsets[i]`` elements after Q's first (batch stride unused)."""
    offs = offsets.view(-1).tolist()
    return torch.stack([q.as_strided(q.shape[1:], q.stride()[1:], q.storage_offset() + offs[i])
                        for i in range(n)])


class HostArena:
    """What the plan's buffers need of an arena, on the host."""

    def empty(self, shape, dtype, name=""):
        return torch.full(shape, 7, dtype=dtype)  # garbage the code must overwrite


# --------------------------------------------------------------------------- recording cudnn

class RecordedTensor:
    """A graph tensor as defined: its attributes, set by the same chained setters."""

    def __init__(self, name="", dim=None, stride=None, data_type=None):
        self.name, self.dim, self.stride, self.data_type = name, dim, stride, data_type
        self.uid = self.ragged = None
        self.output = False

    def set_uid(self, uid):
        self.uid = uid
        return self

    def set_output(self, flag):
        self.output = flag
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, dt):
        self.data_type = dt
        return self

    def set_ragged_offset(self, t):
        self.ragged = t
        return self


class RecordingGraph:
    """What `cudnn.pygraph` is asked for: ``io_data_type``, ``tensors`` and ``ops``
    [(op name, keyword arguments)]; building and planning do nothing."""

    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None,
                 handle=None):
        self.io_data_type = io_data_type
        self.tensors: list[RecordedTensor] = []
        self.ops: list[tuple[str, dict]] = []

    def tensor(self, name="", dim=None, stride=None, data_type=None):
        t = RecordedTensor(name, list(dim), list(stride), data_type)
        self.tensors.append(t)
        return t

    def _out(self, name):
        t = RecordedTensor(name)
        self.tensors.append(t)
        return t

    def sdpa(self, **kw):
        self.ops.append(("sdpa", kw))
        return self._out("o"), self._out("stats") if kw.get("generate_stats") else None

    def sdpa_fp8(self, **kw):
        self.ops.append(("sdpa_fp8", kw))
        return (self._out("o"), self._out("stats") if kw.get("generate_stats") else None,
                self._out("amax_s"), self._out("amax_o"))

    def validate(self):
        pass

    build_operation_graph = check_support = build_plans = validate

    def create_execution_plans(self, modes):
        pass

    def get_workspace_size(self):
        return 0

    def bound(self) -> dict[int, RecordedTensor]:
        """The tensors a variant pack must bind (those with a uid), by uid."""
        return {t.uid: t for t in self.tensors if t.uid is not None}


def _enum(*names):
    return types.SimpleNamespace(**{n: n for n in names})


#: A stand-in for the ``cudnn`` module: what `cudnn_graph` defines graphs with.
recording_cudnn = types.SimpleNamespace(
    data_type=_enum("BFLOAT16", "HALF", "FP8_E4M3", "FLOAT", "INT32", "INT64"),
    heur_mode=_enum("A", "B", "FALLBACK"),
    pygraph=RecordingGraph)


@contextlib.contextmanager
def recording_cudnn_module():
    """``import cudnn`` gives `recording_cudnn` inside (the real module, if any, after)."""
    had = "cudnn" in sys.modules
    old = sys.modules.get("cudnn")
    sys.modules["cudnn"] = recording_cudnn
    try:
        yield recording_cudnn
    finally:
        if had:
            sys.modules["cudnn"] = old
        else:
            del sys.modules["cudnn"]


def define(key) -> RecordingGraph:
    """``key``'s graph as `cudnn_graph.build_graph` defines it, recorded."""
    with recording_cudnn_module():
        return build_graph(key, None)


# --------------------------------------------------------------------------- execution

def check_pack(graph: RecordingGraph, pack: dict) -> None:
    """The pack binds exactly the recorded uids, each with the recorded sizes and the
    strides of its dims longer than 1 (a ragged tensor's batch extent and stride are
    not its own)."""
    bound = graph.bound()
    assert set(pack) == set(bound), (sorted(pack), sorted(bound))
    for uid, t in bound.items():
        if t.dim is None:
            continue
        x = pack[uid]
        first = 1 if t.ragged is not None else 0
        assert list(x.shape)[first:] == t.dim[first:], (t.name, list(x.shape), t.dim)
        for size, got, want in list(zip(t.dim, x.stride(), t.stride))[first:]:
            assert size == 1 or got == want, (t.name, list(x.stride()), t.stride)


class FakePagedGraph:
    """fp32 paged SDPA of one key (see module doc) over its recorded definition."""

    def __init__(self, key, defined: RecordingGraph | None = None):
        self.key = key
        self.defined = defined
        self.launches = 0

    def execute(self, pack, workspace, handle=None):
        self.launches += 1
        if self.defined is not None:
            check_pack(self.defined, pack)
        fp8 = self.key.fp8
        q, o = pack[UID["q"]], pack[UID["o"]]                      # [n, H', s, D]
        kp, vp = pack[UID["k"]], pack[UID["v"]]                    # [pages, H_kv, tpp, D]
        table = pack[UID["k_table"]]                               # [n, 1, rp, 1]
        q_lens, kv_lens = pack[UID["seq_len_q"]].view(-1), pack[UID["seq_len_kv"]].view(-1)
        stats = pack.get(UID["stats"])                             # [n, H', s, 1]
        if self.key.q_offsets:  # rows at offsets: Q's own batch extent is not n
            q = ragged_rows(q, pack[UID["q_offsets"]], o.shape[0])
        n, Hq, s, D = q.shape
        hkv = kp.shape[1]
        if stats is not None:  # bound by address: cuDNN writes it as the key's [n, H', s, 1]
            stats = stats.view(n, Hq, s, 1)
        assert o.shape == q.shape and Hq % hkv == 0 and (stats is not None) == (self.key.splits > 1)
        assert (q.dtype == FP8) == fp8 and (o.dtype == FP8) == fp8 and (kp.dtype == FP8) == fp8
        dq = dk = dv = scale_o = 1.0
        if fp8:
            dq, dk, dv, scale_o = (float(pack[UID[u]]) for u in
                                   ("descale_q", "descale_k", "descale_v", "scale_o"))
            amax_o = 0.0
        for i in range(n):
            L, ql = int(kv_lens[i]), int(q_lens[i])
            if L == 0:
                o[i] = float("nan")
                continue
            pages = table[i].reshape(-1).long()
            k = kp[pages].permute(0, 2, 1, 3).reshape(-1, hkv, D)[:L].float() * dk  # [L, H_kv, D]
            v = vp[pages].permute(0, 2, 1, 3).reshape(-1, hkv, D)[:L].float() * dv
            k, v = (x.repeat_interleave(Hq // hkv, 1) for x in (k, v))             # [L, H', D]
            scores = torch.einsum("hqd,khd->hqk", q[i, :, :ql].float() * dq, k) * self.key.scale
            res = torch.einsum("hqk,khd->hqd", scores.softmax(-1), v)
            if fp8:
                amax_o = max(amax_o, float(res.abs().max()))
                res = (res * scale_o).clamp(-448, 448)
            o[i, :, :ql] = res.to(o.dtype)
            o[i, :, ql:] = 0
            if stats is not None:
                stats[i, :, :ql, 0] = torch.logsumexp(scores, -1)
        if fp8:
            pack[UID["amax_s"]].fill_(1.0)
            pack[UID["amax_o"]].fill_(amax_o)


class FakeCudnnBackend(CudnnBackend):
    """`CudnnBackend` on CPU caches of any dtype, launching `FakePagedGraph`s (defined
    by the real graph code, recorded) on a 132-SM device (an H200's count, so the wave
    model chooses as there)."""

    def check_cache(self, cache) -> None:
        return None

    #: the cuDNN version it answers as (`CudnnBackend.fp8_ragged_q`)
    cudnn_version = 91900

    def sm_count(self, device) -> int:
        return 132

    def fp8_ragged_q(self) -> bool:
        return self.cudnn_version >= FP8_RAGGED_CUDNN

    def handle_on_stream(self, device):
        return None

    def arena(self, device):
        return HostArena()

    def executable(self, key):
        exe = self._executables.get(key)
        if exe is None:
            defined = define(key) if key.dtype != str(torch.float32) else None
            exe = self._executables[key] = _Executable(FakePagedGraph(key, defined),
                                                       torch.empty(1), key)
            self.plans_built += 1
        return exe
