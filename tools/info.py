"""`framekv info`: versions, the device, and which backends can run here.

Collecting this must not fail on a machine without a GPU or without the GPU
extra: every probe reports what it found or why it is unusable.
"""
from __future__ import annotations

import importlib.metadata as md
import platform


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _first_version(*dists: str) -> str:
    for d in dists:
        v = _version(d)
        if v != "not installed":
            return v
    return "not installed"


def _device_info() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"type": "cpu", "cuda_available": False}
    idx = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(idx)
    return {"type": "cuda", "cuda_available": True, "index": idx, "name": p.name,
            "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1)}


def _cudnn_probe(device: dict) -> dict:
    """Whether the cuDNN paged-attention backend can run: Hopper+, frontend importable."""
    import torch

    out = {"torch_cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None}
    try:
        import cudnn  # the GPU extra; imported only here, never by `import framekv`
        out["frontend_backend_version"] = cudnn.backend_version()
    except Exception as e:  # not installed, or its libraries cannot load
        out.update(usable=False, reason=f"cudnn-frontend unavailable: {type(e).__name__}: {e}")
        return out
    if not device.get("cuda_available"):
        out.update(usable=False, reason="no CUDA device")
    elif float(device["capability"]) < 9.0:
        out.update(usable=False, reason=f"needs compute capability >= 9.0, device has {device['capability']}")
    else:
        try:  # a handle proves the cuDNN library loads and binds to the device
            handle = cudnn.create_handle()
            cudnn.destroy_handle(handle)
            out.update(usable=True, reason="")
        except Exception as e:
            out.update(usable=False, reason=f"cuDNN handle: {type(e).__name__}: {e}")
    return out


def _numba_probe() -> dict:
    try:
        from numba import cuda

        if cuda.is_available():
            return {"usable": True, "reason": ""}
        return {"usable": False, "reason": "no CUDA device: CPU runs the torch references, "
                "and NUMBA_ENABLE_CUDASIM=1 runs the kernels in numba's simulator"}
    except Exception as e:  # numba-cuda missing or broken (e.g. an unsupported numpy)
        return {"usable": False, "reason": f"{type(e).__name__}: {e}"}


def collect() -> dict:
    """Everything `framekv info` prints, as a JSON-friendly dict."""
    import torch

    import framekv
    from framekv.ops import driver

    device = _device_info()
    cudnn = _cudnn_probe(device)
    numba = _numba_probe()
    return {
        "framekv": framekv.__version__,
        "python": platform.python_version(),
        "versions": {
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "numpy": _version("numpy"), "numba": _version("numba"),
            "numba-cuda": _version("numba-cuda"),
            "cuda-python": _first_version("cuda-python", "cuda-bindings"),
            "cudnn-frontend": _version("nvidia-cudnn-frontend"),
            "msgspec": _version("msgspec"),
            "cudnn (torch)": cudnn.get("torch_cudnn"),
            "cudnn (frontend)": cudnn.get("frontend_backend_version"),
            "cuda driver": driver.version_string() if device["cuda_available"] else "unavailable",
        },
        "device": device,
        "backends": {
            "reference": {"usable": True, "reason": "torch fp32 math, any device"},
            "cudnn": {"usable": cudnn["usable"], "reason": cudnn["reason"]},
            "numba-kernels": numba,
        },
    }


def format_info(info: dict) -> str:
    """A human-readable rendering of `collect()`."""
    lines = [f"framekv {info['framekv']}  (python {info['python']})", "versions:"]
    lines += [f"  {k:<18} {v}" for k, v in info["versions"].items()]
    d = info["device"]
    if d["type"] == "cuda":
        lines.append(f"device: cuda:{d['index']} {d['name']} (sm {d['capability']}, "
                     f"{d['multiprocessors']} SMs, {d['memory_gib']} GiB)")
    else:
        lines.append("device: cpu (no CUDA device)")
    lines.append("backends:")
    for name, b in info["backends"].items():
        state = "usable" if b["usable"] else "unusable"
        lines.append(f"  {name:<14} {state}" + (f"  ({b['reason']})" if b["reason"] else ""))
    return "\n".join(lines)
