"""The cuDNN backend's own plans and launches on CPU, over a stand-in for cuDNN's paged SDPA.

`FakeCudnnBackend` is `CudnnBackend` with one thing replaced: the built cuDNN graph.
`FakePagedGraph.execute` computes, in fp32 torch, what cuDNN's paged SDPA computes for
a `PagedGraphKey` over the tensors bound by uid: query head h of a row reads K/V head
h // (H' / H_kv) (cuDNN's GQA grouping), the row's keys are its table's pages cut at
``seq_len_kv``, queries past ``seq_len_q`` come back zero, and empty rows return NaN
(cuDNN's output there is undefined; the merge must skip them); with ``q_offsets`` row
i's queries start at element ``q_offsets[i]`` of Q (`ragged_rows`). Everything else (the
plan's layout choice, split and packing buffers, strides, merge) is the real code.
"""
from __future__ import annotations

import torch

from framekv.engine.attention.cudnn import CudnnBackend, _Executable
from framekv.engine.attention.cudnn_graph import UID


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


class FakePagedGraph:
    """fp32 paged SDPA of one key (see module doc)."""

    def __init__(self, key):
        self.key = key
        self.launches = 0

    def execute(self, pack, workspace, handle=None):
        self.launches += 1
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
        for i in range(n):
            L, ql = int(kv_lens[i]), int(q_lens[i])
            if L == 0:
                o[i] = float("nan")
                continue
            pages = table[i].reshape(-1).long()
            k = kp[pages].permute(0, 2, 1, 3).reshape(-1, hkv, D)[:L].float()  # [L, H_kv, D]
            v = vp[pages].permute(0, 2, 1, 3).reshape(-1, hkv, D)[:L].float()
            k, v = (x.repeat_interleave(Hq // hkv, 1) for x in (k, v))        # [L, H', D]
            scores = torch.einsum("hqd,khd->hqk", q[i, :, :ql].float(), k) * self.key.scale
            o[i, :, :ql] = torch.einsum("hqk,khd->hqd", scores.softmax(-1), v).to(o.dtype)
            o[i, :, ql:] = 0
            if stats is not None:
                stats[i, :, :ql, 0] = torch.logsumexp(scores, -1)


class FakeCudnnBackend(CudnnBackend):
    """`CudnnBackend` on CPU caches of any dtype, launching `FakePagedGraph`s on a
    132-SM device (an H200's count, so the wave model chooses as there)."""

    def check_cache(self, cache) -> None:
        return None

    def sm_count(self, device) -> int:
        return 132

    def handle_on_stream(self, device):
        return None

    def arena(self, device):
        return HostArena()

    def executable(self, key):
        exe = self._executables.get(key)
        if exe is None:
            exe = self._executables[key] = _Executable(FakePagedGraph(key), torch.empty(1), key)
            self.plans_built += 1
        return exe
