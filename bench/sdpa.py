"""torch SDPA restricted to one backend, as the dense baselines run it.

`DenseSDPA` attends q [n, H, D] over k, v [L, H_kv, D] with exactly the backend asked
for (cuDNN, flash, memory-efficient or math), native GQA where the backend takes it and
repeated K/V heads where it refuses; on CPU math runs, in fp32.
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["DenseSDPA", "SDPA_BACKENDS", "sdpa_backend_name"]


#: SDPA backends the dense baseline can run (torch.nn.attention.SDPBackend names).
SDPA_BACKENDS: tuple[str, ...] = ("cudnn", "flash", "efficient", "math")


def sdpa_backend_name(backend: str | None, device) -> str:
    """The SDPA backend asked for, validated: default "cudnn" on CUDA, "math" on CPU.

    Raises ValueError naming ``backend`` for anything but one of `SDPA_BACKENDS`.
    """
    if backend is None:
        return "cudnn" if torch.device(device).type == "cuda" else "math"
    if not isinstance(backend, str) or backend not in SDPA_BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, SDPA_BACKENDS))}, "
                         f"got {backend!r}")
    return backend


def _sdpa_enum(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


class DenseSDPA:
    """torch SDPA restricted to one backend: q [n, H, D] over k, v [L, H_kv, D].

    GQA runs natively (``enable_gqa``) unless the backend refuses it; the first GQA
    call finds out (outside any graph capture: a capture is preceded by warm-up
    calls) and later calls repeat the K/V heads if needed. On CPU math runs, in fp32.
    """

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.kernel = name if device.type == "cuda" else "math"
        self._backend = _sdpa_enum(self.kernel)
        self._fp32 = device.type != "cuda"
        #: None until a GQA call ran, then "native" or "repeat"
        self.gqa: str | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        qt = q.transpose(0, 1)[None]                                       # [1, H, n, D]
        kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]          # [1, H_kv, L, D]
        if self._fp32:
            qt, kt, vt = qt.float(), kt.float(), vt.float()
        group = qt.shape[1] // kt.shape[1]
        out = None
        if group > 1 and self.gqa != "repeat":
            out = self._native_gqa(qt, kt, vt, scale)
        if out is None:
            if group > 1:
                kt = kt.repeat_interleave(group, dim=1)                    # [1, H, L, D]
                vt = vt.repeat_interleave(group, dim=1)
            out = self._run(qt, kt, vt, scale, gqa=False)
        return out[0].transpose(0, 1).to(q.dtype)                          # [n, H, D]

    def _native_gqa(self, qt, kt, vt, scale) -> torch.Tensor | None:
        if self.gqa == "native":
            return self._run(qt, kt, vt, scale, gqa=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the kernel-selection notes of a refusal
                out = self._run(qt, kt, vt, scale, gqa=True)
        except RuntimeError:
            self.gqa = "repeat"
            return None
        self.gqa = "native"
        return out

    def _run(self, qt, kt, vt, scale: float, *, gqa: bool) -> torch.Tensor:
        from torch.nn.attention import sdpa_kernel

        try:
            with sdpa_kernel([self._backend]):
                return torch.nn.functional.scaled_dot_product_attention(
                    qt, kt, vt, scale=scale, enable_gqa=gqa)               # [1, H, n, D]
        except RuntimeError as exc:
            raise RuntimeError(f"SDPA backend {self.kernel!r} cannot run q {list(qt.shape)} "
                               f"over k/v {list(kt.shape)} {qt.dtype} (enable_gqa={gqa}): "
                               f"{str(exc).splitlines()[0]}") from exc
