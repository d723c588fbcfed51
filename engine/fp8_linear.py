"""fp8 GEMMs: a transformer's linear layers as float8 e4m3 GEMMs (``torch._scaled_mm``)
with row-wise scales, the weights quantized once, the activations per token inside the
forward::

    qw, sw = quantize_rows(W)             W [N, K]: one scale per output channel, once
    qx, sx = quantize_rows(x)             x [M, K]: one scale per token, every call
    y[m, n] = (sum_k qx[m, k] qw[n, k]) * sx[m] * sw[n] + b[n]

accumulated in fp32 and rounded once to the model's dtype (`framekv.ops.quantize_rows`:
``s = max|row| / 448``, e4m3 rounding to nearest even). The input's scales are computed
on the device (a row's maximum, no host sync, no ``.item()``), so a forward with fp8
GEMMs captures in a CUDA graph like any other. Error: each operand is within 2^-4 of
itself (3 mantissa bits), so an output is within about ``2^-3 (|x| @ |W|^T)`` of the
fp32 product (subnormal steps and the output's rounding aside), and on data of mixed
sign much closer (the roundings average out).

Where the input is quantized: by the pass that makes it, where one can. A block's norm
(`framekv.ops.adaln_`) holds each token's row in registers and reduces over it already,
so for a layer after it (the self-attention's q, k, v, Wan's cross-attention q, the
MLP's first GEMM) it writes the e4m3 rows and their scales itself (`adaln_for`, an
`Fp8Rows`): bit for bit ``quantize_rows`` of the bf16 output, without that output or a
pass reading it again; no consumer needs the bf16 rows as well. The attention outputs
(cuDNN's, torch's SDPA) and the MLP's hidden rows go through ``quantize_rows``.

Why per row: tokens differ in scale (the modulation scales a whole sequence, some
tokens are far larger than the rest) and so do a weight's output channels. One scale
for a whole tensor sets it by the largest row and leaves a small row a few e4m3 steps
or none (values under 2^-9 of the scale round to 0); a scale per row keeps every row
in e4m3's normal range at 3 bits. The GEMM applies row-wise scales in its epilogue
(``scale_a`` [M, 1], ``scale_b`` [1, N]), so they cost nothing there.

Which layers (a model's `fp8_linears`): in every block the self-attention's q, k, v
projection (one GEMM, the packed weight) and output projection, the cross-attention's
q and output projections (Wan), and the MLP's two. Not: the cross-attention's k and v
(projected once per prompt, off the per-chunk path), the patch, time and text
embeddings and the final head: thin and few, at the model's input and output where no
later layer averages an error out. The MLP's GELU-tanh, which a bf16 GEMM applies in
its epilogue (`framekv.engine.model.blocks.linear_gelu`), has no fp8 equivalent: the
first GEMM writes its pre-activation (bias added) and the second's quantizer applies
GELU on the way in (``quantize_rows(gelu=True)``).

Accumulation (``fast_accum``, each model's table: `DiTBlock.FP8_FAST_ACCUM`,
`framekv.engine.wan.blocks.FP8_FAST_ACCUM`): Hopper's fp8 tensor cores sum in a
narrower accumulator than fp32; by default the GEMM promotes its partial sums to fp32
every few steps, ``use_fast_accum`` does not: faster, and off by more, the more so the
longer the sum (K). The choice per layer: fast where the sum runs over the model's
width (q, k, v, the output projections, the cross-attention's q, the MLP's first GEMM);
promoted for the MLP's output projection, whose sum runs over the MLP's width, the
longest. The evidence (docs/benchmarks.md): at the Wan shapes fast accumulation leaves
the GEMMs' error against fp32 at e4m3's own, and most of its gain is in the first
group; ``python -m framekv.bench.fp8_gemm`` reports its error alone ("fast vs
promoted", the same operands) beside e4m3's.

Constraints, checked when a layer is built: in and out features multiples of 16 (the
GEMM's operand alignment); on CUDA a bfloat16 layer (row-wise scaled fp8 GEMMs with a
bias write bf16). A layer that does not meet them is a ValueError naming it: no layer
falls back to its bf16 GEMM unseen. On a CPU the same GEMM runs (torch's CPU kernel,
which has no fast accumulation), its output in the layer's dtype. The fp8 copy is
taken when the layer is built: a weight changed later is not seen (build the rollout
again).
"""
from __future__ import annotations

import torch

from framekv.ops import adaln_, quantize_rows, quantize_rows_reference

__all__ = ["FP8", "GEMM_DTYPES", "ALIGN", "Fp8Linear", "Fp8Rows", "adaln_for",
           "fp8_linear_reference", "resolve_gemm_dtype"]

FP8 = torch.float8_e4m3fn
#: The names ``gemm_dtype`` takes: "bf16" the model's own dtype (its GEMMs as they are),
#: "fp8" float8 e4m3 with row-wise scales.
GEMM_DTYPES = ("bf16", "fp8")
#: In and out features of an fp8 GEMM must be multiples of this.
ALIGN = 16


def resolve_gemm_dtype(gemm_dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the transformer's block GEMMs run in for ``gemm_dtype``.

    None or "bf16": ``model_dtype`` (the model's GEMMs: bf16 on CUDA, fp32 on a CPU);
    "fp8" or `torch.float8_e4m3fn`: fp8 GEMMs (module doc); a torch dtype equal to
    ``model_dtype``: that. Anything else is a ValueError naming ``gemm_dtype``, the values
    allowed and the value given."""
    if gemm_dtype is None or (isinstance(gemm_dtype, str) and gemm_dtype == "bf16"):
        return model_dtype
    if (isinstance(gemm_dtype, str) and gemm_dtype == "fp8") or gemm_dtype is FP8:
        return FP8
    if isinstance(gemm_dtype, torch.dtype) and gemm_dtype == model_dtype:
        return gemm_dtype
    model = str(model_dtype).removeprefix("torch.")
    raise ValueError(f"gemm_dtype must be None, 'bf16' (the model's dtype, {model}), 'fp8', "
                     f"torch.float8_e4m3fn or torch.{model}, got {gemm_dtype!r}")


class Fp8Rows:
    """An activation already quantized per row for an fp8 GEMM (`adaln_for` makes one
    where the norm before a layer writes it).

    Attributes:
        q: float8_e4m3fn [..., K], contiguous; scale: fp32, one per row of q (M =
        q.numel() // K values, contiguous: its view [M, 1] is the GEMM's row-wise
        scale); dtype: the dtype of the activation it stands for (the model's).
    """

    __slots__ = ("q", "scale", "dtype")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.q, self.scale, self.dtype = q, scale, dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def adaln_for(layer: "Fp8Linear | None", x: torch.Tensor, **kw) -> "torch.Tensor | Fp8Rows":
    """``framekv.ops.adaln_(x, **kw)`` as the input of ``layer``: the norm in x's dtype
    for a layer of the model's dtype (None), or for an fp8 layer the same norm written
    as e4m3 with a scale per token by the norm's own kernel (`Fp8Rows`: no separate
    quantization pass, no bf16 copy; bit for bit what `quantize_rows` makes of it)."""
    if layer is None:
        return adaln_(x, **kw)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)                  # [B, S, K]
    s = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)  # [B, S, 1]
    adaln_(x, out=q, out_scale=s, **kw)
    return Fp8Rows(q, s, x.dtype)


class Fp8Linear:
    """One linear layer's fp8 GEMM: ``y = x W^T + b`` (module doc).

    Args:
        weight: [N, K] (out, in features), both multiples of `ALIGN`; bf16 on CUDA.
        bias: None or [N].
        name: the layer's name in the model, for errors ("blocks.3.ffn.net.2").
        fast_accum: accumulate in the tensor cores' own precision over the whole sum
            (``use_fast_accum=True``: faster on Hopper) instead of promoting partial
            sums to fp32 every few steps; a model decides per layer (module doc).

    Attributes:
        weight: float8_e4m3fn [N, K], row-major (the GEMM reads ``weight.t()``, column
            major, as its second operand); scale: fp32 [1, N]; bias: [N] in the output
            dtype or None; out_dtype: the layer's dtype; name; in_features,
            out_features; fast_accum.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 name: str = "linear", fast_accum: bool = False):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            got = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"{name}: the weight must be a [out, in] tensor, got {got}")
        N, K = weight.shape
        if N % ALIGN or K % ALIGN:
            raise ValueError(f"{name}: fp8 GEMMs need in and out features that are multiples "
                             f"of {ALIGN}, got a [{N}, {K}] (out, in) weight: run this model "
                             "with gemm_dtype None or 'bf16'")
        if weight.device.type == "cuda" and weight.dtype != torch.bfloat16:
            raise ValueError(f"{name}: fp8 GEMMs on CUDA write bf16 (row-wise scales): the "
                             f"layer must be bfloat16, got {weight.dtype}")
        if bias is not None and tuple(bias.shape) != (N,):
            raise ValueError(f"{name}: the bias must be [{N}], got {list(bias.shape)}")
        if not isinstance(fast_accum, bool):
            raise ValueError(f"{name}: fast_accum must be True or False, got {fast_accum!r}")
        self.name, self.in_features, self.out_features = name, K, N
        self.out_dtype, self.fast_accum = weight.dtype, fast_accum
        with torch.no_grad():
            self.weight, scale = quantize_rows(weight.detach())           # [N, K], [N, 1]
            self.scale = scale.view(1, N)
            self.bias = None if bias is None else bias.detach().to(weight.dtype)

    @classmethod
    def of(cls, module: torch.nn.Linear, name: str, fast_accum: bool = False) -> "Fp8Linear":
        """The fp8 GEMM of a ``torch.nn.Linear`` (its weight and bias, copied now)."""
        return cls(module.weight, module.bias, name=name, fast_accum=fast_accum)

    @property
    def nbytes(self) -> int:
        """Device bytes of the fp8 weight, its scales and bias."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.bias)
                   if t is not None)

    def __call__(self, x: "torch.Tensor | Fp8Rows", *, gelu: bool = False) -> torch.Tensor:
        """x [..., K] -> [..., N] in the layer's dtype; ``gelu``: x is a pre-activation,
        the layer reads GELU-tanh(x) (module doc). An `Fp8Rows` x is already quantized
        (``gelu`` must be False). ValueError for another K."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: expected inputs of {self.in_features} features, "
                             f"got shape {list(x.shape)}")
        if isinstance(x, Fp8Rows):
            if gelu:
                raise ValueError(f"{self.name}: an input quantized already cannot take GELU")
            q, s = x.q.view(-1, self.in_features), x.scale.view(-1, 1)   # [M, K], [M, 1]
        else:
            rows = x.reshape(-1, self.in_features)                        # [M, K]
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            q, s = quantize_rows(rows, gelu=gelu)                         # e4m3 [M, K], [M, 1]
        y = torch._scaled_mm(q, self.weight.t(), s, self.scale, bias=self.bias,
                             out_dtype=self.out_dtype, use_fast_accum=self.fast_accum)
        return y.view(*x.shape[:-1], self.out_features)                   # [..., N]


def fp8_linear_reference(layer: Fp8Linear, x, *, gelu: bool = False) -> torch.Tensor:
    """What ``layer(x, gelu=gelu)`` computes, in fp32 and not rounded: the quantized
    operands (`quantize_rows_reference`, or an `Fp8Rows` x as it is) dequantized,
    multiplied in fp32, plus the bias. x [..., K] -> fp32 [..., N]."""
    if isinstance(x, Fp8Rows):
        q, s = x.q.reshape(-1, layer.in_features), x.scale.reshape(-1, 1)
    else:
        q, s = quantize_rows_reference(x.reshape(-1, layer.in_features), gelu=gelu)
    w = layer.weight.float() * layer.scale.view(-1, 1)                     # [N, K]
    y = (q.float() * s) @ w.t()                                           # [M, N]
    if layer.bias is not None:
        y = y + layer.bias.float()
    return y.view(*x.shape[:-1], layer.out_features)
