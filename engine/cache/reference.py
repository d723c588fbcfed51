"""The fp32 exact-window attention reference: dense records, no pages.

``visible_positions`` is the one definition of the keys a causal block sees
(DESIGN.md, "The cache: semantics")::

    V(j) = [0, min(P, s))  U  [max(P, s - W), s)  U  [s, s + b)

``ExactWindowReference`` keeps every K/V ever written, per layer and position, in fp32,
and computes each block's softmax attention over exactly V(j). It is the oracle the
cache and its attention backends are measured against; memory grows with the rollout,
which is fine for tests and small demos.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from framekv.specs import Geometry

__all__ = ["ExactWindowReference", "visible_positions"]


def visible_positions(geometry: Geometry, committed: int, s: int, b: int) -> np.ndarray:
    """V(j) of the causal block [s, s + b) as a sorted int64 array without repeats.

    ``committed`` only validates the call: a block never starts before the committed
    count (its keys before ``s`` are history or earlier blocks of the same forward).
    """
    if b < 1:
        raise ValueError(f"causal block size must be >= 1, got {b}")
    if s < committed:
        raise ValueError(f"block start s={s} is below the committed count {committed}")
    P, W = geometry.pin_tokens, geometry.window_tokens
    # [0, min(P, s)) ends at or before P <= max(P, s - W): the parts never overlap.
    return np.concatenate([np.arange(0, min(P, s)), np.arange(max(P, s - W), s),
                           np.arange(s, s + b)]).astype(np.int64)


class ExactWindowReference:
    """Dense fp32 record of K/V per layer and position, attended over exactly V(j).

    Args:
        geometry: the rollout's geometry (P, W and the declared block sizes).
        num_layers: layers recorded.
    """

    def __init__(self, geometry: Geometry, num_layers: int):
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.geometry = geometry
        self.num_layers = num_layers
        self.committed = 0
        self._k: list[torch.Tensor | None] = [None] * num_layers   # [cap, H_kv, D]
        self._v: list[torch.Tensor | None] = [None] * num_layers
        self._written: list[torch.Tensor | None] = [None] * num_layers  # bool [cap]

    def _layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        return layer

    def _grow(self, layer: int, end: int, h_kv: int, d: int) -> None:
        k = self._k[layer]
        if k is not None and k.shape[1:] != (h_kv, d):
            raise ValueError(f"k/v heads and head_dim must stay {tuple(k.shape[1:])}, "
                             f"got {(h_kv, d)}")
        cap = 0 if k is None else k.shape[0]
        if end <= cap:
            return
        new_cap = max(end, 2 * cap, 64)  # doubling keeps long rollouts linear
        for store in (self._k, self._v):
            grown = torch.zeros(new_cap, h_kv, d, dtype=torch.float32)
            if store[layer] is not None:
                grown[:cap] = store[layer]
            store[layer] = grown
        written = torch.zeros(new_cap, dtype=torch.bool)
        if self._written[layer] is not None:
            written[:cap] = self._written[layer]
        self._written[layer] = written

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record k, v ([T, H_kv, D], any float dtype) at positions [start, start + T)."""
        layer = self._layer(layer)
        if k.dim() != 3 or k.shape != v.shape:
            raise ValueError(f"k and v must both be [T, H_kv, D], got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        t, h_kv, d = k.shape
        self._grow(layer, start + t, h_kv, d)
        self._k[layer][start:start + t] = k.detach().to("cpu", torch.float32)
        self._v[layer][start:start + t] = v.detach().to("cpu", torch.float32)
        self._written[layer][start:start + t] = True

    def commit(self, n: int) -> None:
        """Make [C, C + n) history; each recorded layer must hold those positions."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        for layer, written in enumerate(self._written):
            end = self.committed + n
            if written is not None and (written.shape[0] < end or
                                        not bool(written[self.committed:end].all())):
                raise ValueError(f"commit({n}) at C={self.committed}: layer {layer} "
                                 f"lacks K/V for some of [{self.committed}, {end})")
        self.committed += n

    def kv(self, layer: int, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 K and V ([n, H_kv, D]) of ``positions``; ValueError if one is missing."""
        layer = self._layer(layer)
        idx = torch.as_tensor(np.asarray(positions, dtype=np.int64))
        written = self._written[layer]
        if written is None:
            raise ValueError(f"layer {layer} has no K/V recorded")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= written.shape[0]
                            or not bool(written[idx].all())):
            raise ValueError(f"layer {layer} has no K/V for some of the positions "
                             f"{np.asarray(positions).tolist()}")
        return self._k[layer][idx], self._v[layer][idx]

    def attention(self, layer: int, q: torch.Tensor, seq_len: int, causal_block_size: int,
                  scale: float | None = None, device=None) -> torch.Tensor:
        """fp32 attention of a forward's queries over exactly V(j) for each block j.

        Args:
            q: [S, H, D]; row r is position C + r. Rows >= seq_len come back zero.
            seq_len: real tokens, a multiple of ``causal_block_size``, at most S.
            causal_block_size: b; block j holds rows [j*b, (j+1)*b).
            scale: softmax scale, 1/sqrt(D) when None.
            device: where it is computed (the recorded K/V moved there a block at a
                time): the CPU by default, a GPU for large geometries.
        Returns:
            fp32 [S, H, D] on ``device``. Query head h reads kv head h // (H // H_kv) (GQA).
        """
        b = causal_block_size
        if q.dim() != 3:
            raise ValueError(f"q must be [S, H, D], got {tuple(q.shape)}")
        S, H, D = q.shape
        if b < 1 or not 0 <= seq_len <= S or seq_len % b:
            raise ValueError(f"seq_len must be a multiple of causal_block_size={b} in "
                             f"[0, {S}], got {seq_len}")
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        device = torch.device("cpu" if device is None else device)
        out = torch.zeros(S, H, D, dtype=torch.float32, device=device)
        qf = q.detach().to(device, torch.float32)
        for j in range(seq_len // b):
            pos = visible_positions(self.geometry, self.committed, self.committed + j * b, b)
            k, v = (x.to(device) for x in self.kv(layer, pos))          # [n, H_kv, D]
            if k.shape[2] != D or H % k.shape[1]:
                raise ValueError(f"q heads {H} / head_dim {D} do not fit k/v "
                                 f"{tuple(k.shape[1:])}")
            group = H // k.shape[1]
            k = k.repeat_interleave(group, dim=1)                      # [n, H, D]
            v = v.repeat_interleave(group, dim=1)
            rows = qf[j * b:(j + 1) * b]                               # [b, H, D]
            scores = torch.einsum("qhd,khd->hqk", rows, k) * scale     # [H, b, n]
            out[j * b:(j + 1) * b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out
