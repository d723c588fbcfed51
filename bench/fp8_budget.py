"""Where fp8 attention's error enters: each rounding of cuDNN's fp8 SDPA applied alone,
in fp32, to the forward part's denoising block (`fp8_forward.PoolPair`), against fp32
exact-window attention over the unquantized K/V::

    Q    e4m3(q[h] / q_scale[h]) * q_scale[h], the scales of Q's declared bound
    K    e4m3(k / s_k) * s_k, V alike: the pool's per-head scales (what it stores)
    P    e4m3(P * 256) / 256, P = exp(s - max): the probabilities cuDNN multiplies V by
    O    e4m3(O * scale_o) / scale_o, scale_o from the pool's V bound (`cudnn_fp8`)

then Q, K and V together (the storage alone), with O, and all of them. Each row: max and mean
|d|, and |want| where the max is. The kernel's own error is the gap between "all" and
the measured forward (`fp8_forward`). The scales are the ones the product sets: the
pool calibrated as `PoolPair` calibrates it, Q's from its bound (`framekv.ops.q_bound`)
as `Fp8Buffers.staged_scales` computes them, O's as `Fp8Buffers.output_scale` does.
"""
from __future__ import annotations

import torch

from framekv.engine.attention.cudnn_fp8 import FP8_MAX, O_MARGIN, P_SCALE
from framekv.engine.cache.reference import visible_positions
from framekv.ops import q_bound

FP8 = torch.float8_e4m3fn
#: The roundings of the table, each a set of `_attend` switches.
SOURCES = {"Q": {"q"}, "K": {"k"}, "V": {"v"}, "P": {"p"}, "O": {"o"},
           "Q,K,V": {"q", "k", "v"}, "Q,K,V,O": {"q", "k", "v", "o"},
           "all": {"q", "k", "v", "p", "o"}}


def _round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` [..., h, D] through e4m3 under per-head ``scale`` [h], back to fp32."""
    s = scale[:, None]
    return (x * torch.reciprocal(s)).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


def _attend(q, k, v, scale: float, rounded: set, o_scale: torch.Tensor) -> torch.Tensor:
    """fp32 attention of q [n, H, D] over k, v [L, H_kv, D] with P and O rounded as
    ``rounded`` says (Q, K, V are rounded by the caller); O of head h is stored as
    e4m3(O * o_scale[h])."""
    n, H, D = q.shape
    g = H // k.shape[1]
    kf, vf = (x.repeat_interleave(g, dim=1).transpose(0, 1) for x in (k, v))  # [H, L, D]
    out = torch.empty(n, H, D, device=q.device)
    for h0 in range(0, H, 4):  # [4, n, L] scores at a time
        s = q[:, h0:h0 + 4].transpose(0, 1) @ kf[h0:h0 + 4].transpose(1, 2) * scale
        p = torch.exp(s - s.amax(-1, keepdim=True))
        total = p.sum(-1, keepdim=True)  # cuDNN sums P in fp32 before rounding it
        if "p" in rounded:
            p = (p * P_SCALE).to(FP8).float() / P_SCALE
        out[:, h0:h0 + 4] = ((p @ vf[h0:h0 + 4]) / total).transpose(0, 1)
    if "o" in rounded:
        out = _round(out, torch.reciprocal(o_scale))
    return out


def error_budget(pp) -> dict:
    """{source: {"max_abs", "mean_abs", "at_abs"}} of `SOURCES` for ``pp``'s denoising
    block (its fp8 pool's scales; see the module doc)."""
    cache = pp.caches["fp8"]
    T, H = pp.T, pp.H
    pos = visible_positions(pp.g, pp.ref.committed, pp.ref.committed, T)
    k, v = (x.to(pp.device) for x in pp.ref.kv(0, pos))                  # [L, H_kv, D]
    q = pp.q                                                             # [T, H, D] fp32
    sk, sv = cache.kv_scales[0, 0].float(), cache.kv_scales[0, 1].float()  # [H_kv]
    g = H // pp.HKV
    sk_q = sk.repeat_interleave(g)                                       # [H]
    qs = q_bound(pp.q_weight, "all", pp.D) * sk.max() / FP8_MAX           # staged_scales
    q_scale = qs / sk_q
    bound = (cache.kv_amax[0, 1] / sv).max().clamp(max=FP8_MAX)          # output_scale
    # cuDNN stores O over V8 = v / s_v times scale_o: in real units, o * scale_o / s_v
    o_scale = FP8_MAX / (bound * O_MARGIN) / sv.repeat_interleave(g)      # [H]
    scale = pp.D ** -0.5
    want = _attend(q, k, v, scale, set(), o_scale)
    out = {}
    for name, rounded in SOURCES.items():
        got = _attend(_round(q, q_scale) if "q" in rounded else q,
                      _round(k, sk) if "k" in rounded else k,
                      _round(v, sv) if "v" in rounded else v, scale, rounded, o_scale)
        d = (got - want).abs()
        i = int(d.argmax())
        out[name] = {"max_abs": float(d.max()), "mean_abs": float(d.mean()),
                     "at_abs": float(want.flatten()[i].abs())}
    out["max_abs_out"] = float(want.abs().max())
    return out


def format_budget(budget: dict, measured: dict | None = None) -> str:
    """The budget's table; ``measured``: the fp8 denoising forward's max / mean |d|."""
    lines = ["  where the fp8 error enters (denoise block, each rounding alone in fp32; "
             f"max |want| {budget['max_abs_out']:.3g})",
             f"    {'rounded':<10}{'max|d|':>10}{'mean|d|':>10}{'|want| at max':>15}"]
    for name in SOURCES:
        r = budget[name]
        lines.append(f"    {name:<10}{r['max_abs']:>10.2e}{r['mean_abs']:>10.2e}{r['at_abs']:>15.3f}")
    if measured is not None:
        lines.append(f"    {'measured':<10}{measured['max_abs']:>10.2e}{measured['mean_abs']:>10.2e}"
                     f"{'-':>15}")
    return "\n".join(lines)
