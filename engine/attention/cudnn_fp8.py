"""fp8 attention on cuDNN: the scales and fixed buffers `cudnn.CudnnPlan` runs cuDNN's
fp8 SDPA with over a ``torch.float8_e4m3fn`` pool.

fp8 pools (``torch.float8_e4m3fn``, Hopper or newer) run cuDNN's fp8 SDPA: Q, K, V
and O in e4m3, one fp32 descale per tensor (`cudnn_graph`). The pool's scales are per
layer, K/V and K/V head (``cache.kv_scales`` [L, 2, H_kv]; stored K = k / s_k, V =
v / s_v), which a per-tensor descale cannot express, so they are folded out of the
kernel (g = H / H_kv query heads per K/V head, h // g the K/V head of query head h)::

    Q       q8[h] = e4m3(q[h] * (1 / q_scale[h])),  q_scale[h] = qs / s_k[h // g]
    scores  (q8 * qs) . K8 = q[h] . k / s_k * s_k = q . k     descale_q = qs, descale_k = 1
    P       e4m3(P * 256), read * 1/256 (P in [0, 1]: 256 is exact and never saturates)
    O       o8 = e4m3(O * scale_o), O over V8 = v / s_v       descale_v = 1
    out[h]  = o8[h] * (1 / scale_o) * s_v[h // g]     (bf16/fp16, at the merge)

``qs`` (one per layer) maps the largest |q[h] * s_k[h // g]| to 448. Quantized by the
plan (`CudnnPlan.run` on a q nobody staged) it is that maximum, from the amax of q on
the device (no saturation). Staged by the fused QK prologue (`stage_outputs`) it must
be known before Q exists, so it comes from a bound on |q| per layer that the caller
declares (`CudnnBackend.set_q_bounds`; after an RMSNorm with weights w over n values,
|q| <= sqrt(n) * max|w|, rope included: a rotation keeps each pair's norm); a value
past it saturates and is counted (`CudnnBackend.q_saturated`). Layers without a bound
are not staged. ``scale_o`` maps a bound on |O| to 448: O is a convex combination of
the stored V8 of the layer, so |O| <= max over heads of min(448, amax_v / s_v) (the
pool's running ``kv_amax``, this forward's tokens included) times `O_MARGIN` for
rounding. Scaling O by its bound rather than by 1 keeps small outputs (small V, or
many keys averaged) in e4m3's normal range instead of its coarse subnormals. A
``reset_kv_stats`` while the pool holds K/V lowers the bound below what is stored,
and the output may then saturate until the statistics cover the pool again. Both
scales are computed on the device, per layer, when it runs: no host sync.

The output is dequantized where the bf16 path already reads it: split forwards in the
merge (`merge_split_kv_` with ``scale`` and ``head_scale``), unsplit ones by the same
kernel over one sub-row (weight 1: the dequantization alone, packed rows unpacked on
the way). cuDNN's fp8 SDPA takes no ragged Q, so fp8 forwards of several blocks run
unsplit (their sub-rows would share queries through ``q_offsets``); one-block forwards
split as bf16 ones do (sub-rows broadcast Q with a 0 batch stride).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cudnn_graph import UID

FP8 = torch.float8_e4m3fn
#: e4m3's largest finite value.
FP8_MAX = 448.0
#: P's scale in the fp8 SDPA: P in [0, 1], a power of two below 448 (exact, unsaturated).
P_SCALE = 256.0
#: The output bound over the stored V's bound: rounding V to e4m3 and P to e4m3 each
#: raise a magnitude by at most 2^-4 (1.0625^2 < 1.25).
O_MARGIN = 1.25
#: Smallest bound taken for Q or O: keeps every scale finite when all values are zero.
_TINY = 2.0 ** -100
#: Oldest compute capability with cuDNN's fp8 SDPA (Hopper).
FP8_CAPABILITY = (9, 0)


class QState:
    """The Q side of fp8 attention over one cache, shared by every plan of a backend
    over it.

    Attributes:
        bound: fp32 [L] device, each layer's declared bound on |q| (read at every
            forward's `CudnnPlan.prepare`, so a new value reaches captured graphs).
        known: host bools [L], the layers with a bound (staged by the prologue).
        saturated: int64 [L] device, running counts of Q values the staging saturated.
    """

    def __init__(self, arena, num_layers: int):
        self.bound = arena.empty((num_layers,), torch.float32, name="fp8_q_bound").fill_(1.0)
        self.known = [False] * num_layers
        self.saturated = arena.empty((num_layers,), torch.int64, name="fp8_q_saturated").zero_()


@dataclass
class Fp8Buffers:
    """Fixed-address tensors of one fp8 forward shape (shared by every layer; see the
    module doc for the scales).

    Attributes:
        q8: e4m3 [B * T, H, D], where Q lands (staged or quantized by the plan):
            token-major, or a view of the packed buffer cuDNN reads (``direct``).
        direct: whether ``q8`` is that packed buffer (one packed block: no pack copy).
        o8: e4m3 [B * T, H, D], the output of an unsplit unpacked launch (else None;
            split and packed launches write their own fp8 buffers).
        q_scale: fp32 [L, H], Q's divisors per layer and query head.
        descale_q: fp32 [L]; scale_o, descale_o: fp32 [L] (one per layer).
        consts: fp32 [3]: 1 (descale_k, descale_v), `P_SCALE`, 1 / `P_SCALE`.
        amax: fp32 [L, 2], max |P| and max |O| of each layer's last launch.
        zero_lse: fp32 [nb, H, b] zeros, the statistics of an unsplit launch's one
            sub-row (weight 1) at the dequantizing merge.
        q_state: the cache's `QState`.
        group: query heads per K/V head.
    """

    q8: torch.Tensor
    direct: bool
    o8: torch.Tensor | None
    q_scale: torch.Tensor
    descale_q: torch.Tensor
    scale_o: torch.Tensor
    descale_o: torch.Tensor
    consts: torch.Tensor
    amax: torch.Tensor
    zero_lse: torch.Tensor
    q_state: QState
    group: int

    @classmethod
    def allocate(cls, backend: "CudnnBackend", plan) -> "Fp8Buffers":
        """Carve every buffer of ``plan``'s shape from ``backend``'s arena."""
        c = plan.cache
        arena = backend.arena(c.device.index)
        L, H, D, nb, b = c.num_layers, plan.num_heads, c.head_dim, plan.num_blocks, plan.block_size
        T = plan.batch * plan.tokens
        packed = plan.split.q_packed if plan.split is not None else (
            plan.pack.q if plan.pack is not None else None)
        direct = packed is not None and nb == 1
        # One packed block is [H, b, D] head-major: token t, head h at (h * b + t) * D.
        q8 = (packed.view(H, b, D).transpose(0, 1) if direct
              else arena.empty((T, H, D), FP8, name="fp8_q"))
        unsplit_plain = plan.split is None and plan.pack is None
        f32 = torch.float32
        consts = arena.empty((3,), f32, name="fp8_consts")
        consts.copy_(torch.tensor([1.0, P_SCALE, 1.0 / P_SCALE], dtype=f32))
        return cls(
            q8=q8, direct=direct,
            o8=arena.empty((T, H, D), FP8, name="fp8_out") if unsplit_plain else None,
            q_scale=arena.empty((L, H), f32, name="fp8_q_scale").fill_(1.0),
            descale_q=arena.empty((L,), f32, name="fp8_descale_q").fill_(1.0),
            scale_o=arena.empty((L,), f32, name="fp8_scale_o").fill_(1.0),
            descale_o=arena.empty((L,), f32, name="fp8_descale_o").fill_(1.0),
            consts=consts, amax=arena.empty((L, 2), f32, name="fp8_amax").zero_(),
            zero_lse=arena.empty((nb, H, b), f32, name="fp8_zero_lse").zero_(),
            q_state=backend.q_state(c), group=H // c.num_kv_heads)

    def scalars(self, layer: int) -> dict:
        """The fp8 graph's scalar tensors of ``layer`` by uid ([1, 1, 1, 1] views)."""
        one = lambda t: t.view(1, 1, 1, 1)  # noqa: E731
        c = self.consts
        return {UID["descale_q"]: one(self.descale_q[layer:layer + 1]),
                UID["descale_k"]: one(c[0:1]), UID["descale_v"]: one(c[0:1]),
                UID["scale_s"]: one(c[1:2]), UID["descale_s"]: one(c[2:3]),
                UID["scale_o"]: one(self.scale_o[layer:layer + 1]),
                UID["amax_s"]: one(self.amax[layer, 0:1]), UID["amax_o"]: one(self.amax[layer, 1:2])}

    def _k_scales(self, cache, layer) -> torch.Tensor:
        """s_k of each query head's K/V head, [H_kv, g] (``layer`` None: [L, H_kv, g])."""
        sk = cache.kv_scales[:, 0] if layer is None else cache.kv_scales[layer, 0]
        return sk.unsqueeze(-1).expand(*sk.shape, self.group)

    def staged_scales(self, cache) -> None:
        """``descale_q`` and ``q_scale`` of every layer from its declared bound:
        qs = bound * max s_k / 448, q_scale[h] = qs / s_k[h // g] (device work, once per
        forward; nothing when no layer has a bound)."""
        st = self.q_state
        if not any(st.known):
            return
        L = self.descale_q.shape[0]
        torch.mul(cache.kv_scales[:, 0].amax(-1), st.bound, out=self.descale_q)
        self.descale_q.mul_(1.0 / FP8_MAX).clamp_(min=_TINY)
        torch.div(self.descale_q.view(L, 1, 1), self._k_scales(cache, None),
                  out=self.q_scale.view(L, -1, self.group))

    def quantize(self, q: torch.Tensor, layer: int, cache) -> None:
        """q [B * T, H, D] into ``q8`` with ``layer``'s scales from its amax (device
        work): qs = max_h amax(q[h]) * s_k[h // g] / 448, no value saturates (an inf
        does, and a NaN stays NaN; neither sets the scale)."""
        T, H, D = q.shape
        amax = torch.linalg.vector_norm(q, ord=float("inf"), dim=(0, 2), dtype=torch.float32)
        amax = torch.nan_to_num(amax, nan=0.0, posinf=0.0).view(-1, self.group)  # [H_kv, g]
        qs = self.descale_q[layer]
        torch.amax(amax * self._k_scales(cache, layer), dim=(0, 1), out=qs)
        qs.mul_(1.0 / FP8_MAX).clamp_(min=_TINY)
        q_scale = self.q_scale[layer]
        torch.div(qs, self._k_scales(cache, layer), out=q_scale.view(-1, self.group))
        # the staging formula: e4m3(clamp(q * (1 / q_scale[h]), -448, 448)), fp32
        y = q * torch.reciprocal(q_scale).view(1, H, 1)  # fp32: q_scale is
        self.q8.copy_(y.clamp_(-FP8_MAX, FP8_MAX))

    def output_scale(self, layer: int, cache) -> None:
        """``scale_o`` and ``descale_o`` of ``layer``: |O| <= max_h min(448, amax_v[h] /
        s_v[h]) * `O_MARGIN` maps to 448 (device work)."""
        bound = self.descale_o[layer]
        torch.amax(cache.kv_amax[layer, 1] / cache.kv_scales[layer, 1], dim=0, out=bound)
        bound.clamp_(max=FP8_MAX).mul_(O_MARGIN / FP8_MAX).clamp_(min=_TINY)  # = descale_o
        torch.reciprocal(bound, out=self.scale_o[layer])

    def unsplit_output(self, plan) -> torch.Tensor:
        """An unsplit launch's fp8 output as the merge reads one sub-row: [1, T, H, D]
        token-major, or packed [1, nb, H, b, D]."""
        if plan.pack is not None:
            nb, hkv, gb, D = plan.pack.out.shape
            return plan.pack.out.view(1, nb, hkv * self.group, gb // self.group, D)
        return self.o8.unsqueeze(0)
