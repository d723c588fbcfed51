"""fp8 K/V: the pool's one quantization formula, and its statistics.

A pool of dtype ``torch.float8_e4m3fn`` holds each K or V value of layer l, K/V kind c
and K/V head h as one byte::

    stored  = e4m3(clamp(x * (1 / s), -448, 448))      s = kv_scales[l, c, h]  (fp32)
    read    = float(stored) * s

``x`` is the fp32 value (a bf16 or fp16 input widened exactly; the fused staging
quantizes K from its fp32 norm and rope, before any rounding to the model's dtype),
``1 / s`` the fp32 reciprocal of the scale, e4m3 rounding to nearest even. 448 is
e4m3's largest finite value: a larger |x * (1 / s)| (inf included) saturates, and is
counted; a NaN stays a NaN (e4m3fn has one) and is not counted.

Why per layer, K/V and head: K and V of different heads differ in range by an order of
magnitude in trained models, and a per-head scale costs nothing at read time (cuDNN
folds K's into Q and V's into the output's dequantization). Finer scales (per token)
would not fit a paged kernel's per-tensor descale.

Statistics, written on the device by every quantizing write, never read back on the
hot path: ``kv_amax[l, c, h]`` the running max of |x| (NaN ignored: the same value the
fused kernel's atomic max keeps, in any order) and ``kv_saturated[l, c]`` the running
count of saturated values. `CausalKVCache.kv_stats` reads them.

This module is the torch formula: the cache's own scatter path and edits use it, and
the fused staging (`framekv.ops.qk_norm_rope_stage_`) computes the same bits.
"""
from __future__ import annotations

import torch

__all__ = ["FP8", "FP8_MAX", "is_fp8", "quantize", "dequantize", "scales_from_amax"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(dtype) -> bool:
    """Whether ``dtype`` is the fp8 pool format."""
    return dtype == FP8


def quantize(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
             saturated: torch.Tensor) -> torch.Tensor:
    """``x`` [E, H, D] (any float dtype) as fp8 with per-head ``scale`` fp32 [H];
    updates ``amax`` fp32 [H] (running max of |x|) and ``saturated`` (an int64 counter,
    0-d or [1]) in place. Device ops only: no host sync, capturable."""
    xf = x.float()                                                     # [E, H, D]
    y = xf * torch.reciprocal(scale)[None, :, None]
    if xf.numel():
        mag = xf.abs()
        mag = torch.where(torch.isnan(mag), 0.0, mag)                  # NaN ignored, inf kept
        torch.maximum(amax, mag.amax(dim=(0, 2)), out=amax)
        saturated.add_((y.abs() > FP8_MAX).sum())
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of fp8 rows ``q`` [..., H, D] under per-head ``scale`` fp32 [H]."""
    return q.float() * scale[:, None]


def scales_from_amax(amax: torch.Tensor, current: torch.Tensor, margin: float) -> torch.Tensor:
    """Scales that map ``amax * margin`` to 448; where no finite positive amax was seen
    (a head never written, or only inf), the ``current`` scale stays."""
    ok = torch.isfinite(amax) & (amax > 0)
    return torch.where(ok, amax * (margin / FP8_MAX), current)
