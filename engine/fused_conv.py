"""A convolution with its epilogue, each geometry run by the fastest of torch's conv and
the cuDNN frontend's plans: ``conv_add(x, weight, bias, residual, pad, stride)`` =
conv(x) + bias + residual (the Wan VAE's fused programs run every conv through it).

Contract: x [N, C_in, *S] (2 or 3 spatial dimensions, any strides), weight [C_out,
C_in, *k], bias None or [C_out], residual None or [N, C_out, *S'] -> y [N, C_out, *S'],
x's dtype, channels-last strides on CUDA. Products accumulate in fp32; every way
below gives that sum within one bf16 rounding of each step it takes.

Why choose per geometry: for the same conv, cuDNN's plans differ widely in time, and
the one torch's heuristics take is often not the fastest (the VAE's 384-channel 3-D
convs and its full-size folded convs among them; docs/benchmarks.md has the numbers);
a plan that adds the residual in its epilogue writes a residual block's output in one
pass where a conv and an add take three, but for some geometries cuDNN has only slower
fused kernels. So on CUDA in bf16 / fp16 (with cudnn-frontend installed) the first
call of each `ConvKey` times, on its own tensors, every candidate ("torch": torch's conv
then its adds; ("fused", i): plan i of the graph that adds the bias and the residual
in its epilogue; ("plain", i): plan i of the conv alone, then torch's adds) and keeps
the fastest (`choice`); later calls run it, one launch bound to torch's current stream
(graph-capturable). A key first met inside a CUDA graph capture runs torch's way (no
timing there) and is chosen at its next call outside one. Elsewhere torch runs it.

Choices are measured, so two processes may choose differently where two ways are
close, and their bf16 outputs then differ in rounding. Processes that must agree bit
for bit (replicas a stream moves between) share a choice folder (`use_choice_dir`;
`framekv.engine.cache_dir` sets ``cache_dir/cudnn``): a choice found there is taken as
is, a new one written there for the next process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics

import torch
import torch.nn.functional as F

from .files import written_whole

__all__ = ["ConvKey", "choice", "conv_add", "conv_add_reference", "use_choice_dir"]

_UID = {"x": 1, "w": 2, "b": 3, "r": 4, "y": 5}
_PLANS = 8          # a graph's plans timed, cuDNN's heuristics' first
_REPEATS = 5        # timed launches a candidate (the median kept), after one untimed


@dataclasses.dataclass(frozen=True)
class ConvKey:
    """Everything a choice and a built graph bake in."""

    device: int                 # plans, workspaces and the handle belong to one device
    dtype: torch.dtype          # x, weight, residual and y (the io type)
    x: tuple                    # (shape, strides): cuDNN reads x through its strides
    w: tuple                    # (shape, strides)
    bias: torch.dtype | None    # the bias's dtype; None: no bias
    r: tuple | None             # the residual's (shape, strides); None: no residual
    pad: tuple
    stride: tuple

    def name(self) -> str:
        """The key without its device: a choice file's entry."""
        return (f"{self.dtype}|x{self.x}|w{self.w}|b{self.bias}|r{self.r}|p{self.pad}"
                f"|s{self.stride}")


def _expand(v, n: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


def _out_shape(x, w, pad: tuple, stride: tuple) -> list:
    """[N, C_out, *S']: S'_i = (S_i + 2 pad_i - k_i) // stride_i + 1."""
    return [x[0], w[0]] + [(s + 2 * p - k) // st + 1
                           for s, p, k, st in zip(x[2:], pad, w[2:], stride)]


def _channels_last(shape: list) -> list:
    """Strides of a contiguous [N, *S, C] tensor viewed as [N, C, *S]."""
    strides, acc = [0] * len(shape), shape[1]
    strides[1] = 1
    for i in range(len(shape) - 1, 1, -1):
        strides[i] = acc
        acc *= shape[i]
    strides[0] = acc
    return strides


def conv_add_reference(x, weight, bias=None, residual=None, pad=0, stride=1) -> torch.Tensor:
    """torch's way: ``F.conv(x, weight, bias)`` then ``add_(residual)``."""
    n = x.dim() - 2
    y = (F.conv3d if n == 3 else F.conv2d)(x, weight, bias, padding=_expand(pad, n),
                                           stride=_expand(stride, n))
    return y if residual is None else y.add_(residual)


def conv_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, pad=0, stride=1) -> torch.Tensor:
    """conv(x) + bias [+ residual] (module doc), the fastest way for its geometry.

    Args:
        x: [N, C_in, *S], S of 2 or 3 dimensions.
        weight: [C_out, C_in, *k], x's dtype and device.
        bias: None or [C_out].
        residual: None or [N, C_out, *S'] in x's dtype (the output's shape).
        pad, stride: an int or one per spatial dimension.
    """
    n = x.dim() - 2
    pad, stride = _expand(pad, n), _expand(stride, n)
    if not _cudnn_ok(x):
        return conv_add_reference(x, weight, bias, residual, pad, stride)
    key = ConvKey(x.device.index or 0, x.dtype, (tuple(x.shape), x.stride()),
                  (tuple(weight.shape), weight.stride()), None if bias is None else bias.dtype,
                  None if residual is None else (tuple(residual.shape), residual.stride()),
                  pad, stride)
    run = _RUNS.get(key)
    if run is None:
        if torch.cuda.is_current_stream_capturing():
            return conv_add_reference(x, weight, bias, residual, pad, stride)
        run = _RUNS[key] = _chosen(key, (x, weight, bias, residual))
    return run(x, weight, bias, residual)


def choice(key: ConvKey):
    """What runs ``key`` in this process: "torch", ("fused", i) or ("plain", i); None
    before its first call outside a capture."""
    run = _RUNS.get(key)
    return None if run is None else run.choice


def use_choice_dir(folder: str | os.PathLike | None) -> None:
    """Read and write choices under ``folder`` from now on (module doc); None: keep them
    in this process only."""
    global _DIR
    _DIR = None if folder is None else os.fspath(folder)
    _FILE_CACHE.clear()


_RUNS: dict = {}
_HANDLES: dict = {}
_DIR: str | None = None
_FILE_CACHE: dict = {}


def _cudnn_ok(x: torch.Tensor) -> bool:
    from framekv.engine.attention.registry import cudnn_frontend_available
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and cudnn_frontend_available()


def _handle_on_stream(device: torch.device):
    import cudnn

    index = device.index or 0
    if index not in _HANDLES:
        _HANDLES[index] = cudnn.create_handle()
    cudnn.set_stream(_HANDLES[index], torch.cuda.current_stream(device).cuda_stream)
    return _HANDLES[index]


# ----------------------------------------------------------------------- runs


class _Run:
    """One way of running a key: ``run(x, weight, bias, residual) -> y``."""

    def __init__(self, key: ConvKey, choice, graph=None, workspace=None):
        self.key, self.choice, self.graph, self.workspace = key, choice, graph, workspace

    def __call__(self, x, weight, bias, residual):
        k = self.key
        if self.choice == "torch":
            return conv_add_reference(x, weight, bias, residual, k.pad, k.stride)
        kind, index = self.choice
        y = torch.empty_strided(_out_shape(k.x[0], k.w[0], k.pad, k.stride),
                                _channels_last(_out_shape(k.x[0], k.w[0], k.pad, k.stride)),
                                dtype=x.dtype, device=x.device)
        pack = {_UID["x"]: x, _UID["w"]: weight, _UID["y"]: y}
        fused = kind == "fused"
        if fused and bias is not None:
            pack[_UID["b"]] = bias.view(1, -1, *[1] * (x.dim() - 2))
        if fused and residual is not None:
            pack[_UID["r"]] = residual
        self.graph.execute_plan_at_index(pack, self.workspace, index,
                                         handle=_handle_on_stream(x.device))
        if not fused:
            if bias is not None:
                y.add_(bias.view(1, -1, *[1] * (x.dim() - 2)))
            if residual is not None:
                y.add_(residual)
        return y


def _candidates(key: ConvKey, only=None) -> list[_Run]:
    """torch's way and every buildable plan of the fused and the plain graph (``only``:
    that one alone, where it builds)."""
    runs = [_Run(key, "torch")] if only in (None, "torch") else []
    kinds = ("fused", "plain") if key.bias is not None or key.r is not None else ("fused",)
    if only is not None:
        kinds = (only[0],) if only != "torch" and only[0] in kinds else ()
    handle = _handle_on_stream(torch.device("cuda", key.device))
    for kind in kinds:
        try:
            graph = _graph(key, kind == "fused", handle)
        except Exception:            # no plan of this kind for this geometry
            continue
        for i in range(min(graph.get_execution_plan_count(), _PLANS)):
            if only is not None and i != only[1]:
                continue
            try:
                graph.build_plan_at_index(i)
                size = graph.get_workspace_size_plan_at_index(i)
            except Exception:        # a proposed plan cuDNN then cannot build
                continue
            ws = torch.empty(max(size, 1), dtype=torch.uint8, device=f"cuda:{key.device}")
            runs.append(_Run(key, (kind, i), graph, ws))
    return runs


def _time(run: _Run, args) -> float:
    run(*args)
    times = []
    for _ in range(_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _chosen(key: ConvKey, args) -> _Run:
    """The run of ``key``: the choice file's, else the fastest candidate (saved)."""
    saved = _saved(key)
    if saved is not None:
        found = _candidates(key, only=saved)
        if found:
            return found[0]
    best = min(_candidates(key), key=lambda r: _time(r, args))
    _save(key, best.choice)
    return best


# ----------------------------------------------------------------------- graphs


def _graph(key: ConvKey, fused: bool, handle):
    """The conv graph of ``key`` (with ``fused``: the bias and residual adds in its
    epilogue), its plans listed (heuristics A, B, then the fallback), none built."""
    import cudnn

    types = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF,
             torch.float32: cudnn.data_type.FLOAT}
    dt, f32, n = types[key.dtype], cudnn.data_type.FLOAT, len(key.pad)
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
    t = {"x": g.tensor(name="x", dim=list(key.x[0]), stride=list(key.x[1]), data_type=dt),
         "w": g.tensor(name="w", dim=list(key.w[0]), stride=list(key.w[1]), data_type=dt)}
    y = g.conv_fprop(image=t["x"], weight=t["w"], padding=list(key.pad),
                     stride=list(key.stride), dilation=[1] * n, compute_data_type=f32)
    if fused and key.bias is not None:
        C = key.w[0][0]
        t["b"] = g.tensor(name="b", dim=[1, C] + [1] * n, stride=[C, 1] + [1] * n,
                          data_type=types[key.bias])
        y = g.add(a=y, b=t["b"], compute_data_type=f32)
    if fused and key.r is not None:
        t["r"] = g.tensor(name="r", dim=list(key.r[0]), stride=list(key.r[1]), data_type=dt)
        y = g.add(a=y, b=t["r"], compute_data_type=f32)
    shape = _out_shape(key.x[0], key.w[0], key.pad, key.stride)
    y.set_output(True).set_dim(shape).set_stride(_channels_last(shape)).set_data_type(dt)
    t["y"] = y
    for name, tensor in t.items():
        tensor.set_uid(_UID[name])
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    return g


# ----------------------------------------------------------------------- choice files


def _file(device: int) -> str | None:
    """This GPU's and cuDNN's choice file in the choice folder (None: no folder)."""
    if _DIR is None:
        return None
    import cudnn

    ident = (f"{torch.cuda.get_device_name(device)}|cudnn {cudnn.backend_version()}|"
             f"frontend {getattr(cudnn, '__version__', '?')}")
    return os.path.join(_DIR, "convs-" + hashlib.sha256(ident.encode()).hexdigest()[:16] + ".json")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):    # none yet, or unreadable: choose again
        return {}


def _saved(key: ConvKey):
    path = _file(key.device)
    if path is None:
        return None
    if path not in _FILE_CACHE:
        _FILE_CACHE[path] = _read(path)
    v = _FILE_CACHE[path].get(key.name())
    if v == "torch":
        return v
    ok = (isinstance(v, list) and len(v) == 2 and v[0] in ("fused", "plain")
          and type(v[1]) is int)
    return tuple(v) if ok else None  # anything else: choose again


def _save(key: ConvKey, value) -> None:
    path = _file(key.device)
    if path is None:
        return
    data = _read(path)               # another process's choices since: kept
    data[key.name()] = list(value) if isinstance(value, tuple) else value
    _FILE_CACHE[path] = data
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with written_whole(path) as tmp, open(tmp, "w") as f:
        json.dump(data, f, indent=0, sort_keys=True)
