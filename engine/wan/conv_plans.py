"""`ConvPlans`: the Wan VAE's convolutions as cuDNN graphs with the bias (and a
residual) in the convolution's epilogue, each shape's plan chosen by timing.

The fused decode program (`vae_fused.py`) runs its convolutions through this on CUDA
in bf16 / fp16. Against ``F.conv3d``: torch adds a channels-last conv's bias in a
kernel of its own (a whole read and write of the output), the residual block's sum is
another, and the plan is cuDNN's first heuristic guess. Here a graph is

    y = conv(x, w) + bias [+ residual]      # fp32 inside, rounded once to x's dtype

and every plan cuDNN's heuristics propose (modes A, B and the fallback) is built and
timed on the call's own tensors (one warm run, then `TIMED_RUNS` between CUDA events),
beside torch's own convolution with its adds; the fastest is kept (a plan with a
workspace of its own). A key cuDNN cannot build a graph for runs torch's way, with a
warning. Each process times a key once (the choice is shared by every `ConvPlans` of
the process); each instance builds its own graph, handle and workspaces, so two
decoders may run at once on two streams.

A key is first seen in a warm-up call, never inside CUDA graph capture (timing
synchronises): `ConvPlans` raises RuntimeError for a new key while the current stream
captures. Launches bind the handle to torch's current stream, so a captured graph
replays them.
"""
from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.nn.functional as F

__all__ = ["ConvKey", "ConvPlans", "supported"]

TIMED_RUNS = 3
_CHOSEN: dict = {}       # (ConvKey, allow_torch) -> the fastest plan's index, -1: torch
_UID = {"x": 1, "w": 2, "b": 3, "r": 4, "y": 5}


def supported(t: torch.Tensor) -> bool:
    """Whether convolutions of ``t`` run through `ConvPlans`: bf16 / fp16 on CUDA."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16)


def channels_last_strides(dims) -> list[int]:
    """Strides of [N, C, *S] with C innermost, then S in order, N outermost."""
    strides = [0] * len(dims)
    strides[1], step = 1, dims[1]
    for i in range(len(dims) - 1, 1, -1):
        strides[i], step = step, step * dims[i]
    strides[0] = step
    return strides


@dataclasses.dataclass(frozen=True)
class ConvKey:
    """What one cuDNN graph bakes in."""

    device: int              # graphs, plans and workspaces belong to one device
    dtype: str               # x, w, bias, residual and y in it; fp32 inside
    x: tuple                 # input dims [N, C, *S]
    x_strides: tuple         # its strides (C innermost: channels last)
    w: tuple                 # weight dims [K, C, *k], channels last
    pad: tuple               # zero padding of each of S, both sides
    residual: bool           # + residual [N, K, *S'] (y's layout) in the epilogue

    @property
    def out(self) -> list[int]:
        """y's dims [N, K, *S']: S'_i = S_i + 2 pad_i - k_i + 1 (stride and dilation 1)."""
        return [self.x[0], self.w[0], *(s + 2 * p - k + 1
                                        for s, p, k in zip(self.x[2:], self.pad, self.w[2:]))]


class ConvPlans:
    """Convolutions of one device (module doc); ``plans(x, weight, bias, pad,
    residual=None) -> y`` with x [N, C, *S] channels last (a view of [N, *S, C]),
    weight [K, C, *k] channels last, bias [K], residual None or [N, K, *S'] channels
    last; y a new [N, K, *S'] channels-last tensor."""

    def __init__(self, device: torch.device, *, allow_torch: bool = True):
        self.device = torch.device(device)
        self.allow_torch = allow_torch     # False: a cuDNN plan always (tests of the graphs)
        self._handle = None
        self._exe: dict = {}          # ConvKey -> (graph, plan index, workspace)

    def __call__(self, x, weight, bias, pad, residual=None) -> torch.Tensor:
        key = ConvKey(device=x.device.index, dtype=str(x.dtype), x=tuple(x.shape),
                      x_strides=tuple(x.stride()), w=tuple(weight.shape), pad=tuple(pad),
                      residual=residual is not None)
        y = torch.empty_strided(key.out, channels_last_strides(key.out), dtype=x.dtype,
                                device=x.device)
        pack = {_UID["x"]: x, _UID["w"]: weight, _UID["b"]: bias, _UID["y"]: y}
        if residual is not None:
            pack[_UID["r"]] = residual
        exe = self._exe[key] if key in self._exe else self._build(key, pack, pad)
        if exe is None:                                   # torch's convolution was faster
            return torch_conv(x, weight, bias, pad, residual)
        graph, index, ws = exe
        graph.execute_plan_at_index(pack, ws, index, handle=self._on_stream())
        return y

    def __len__(self) -> int:
        """Graphs built."""
        return len(self._exe)

    def _on_stream(self):
        import cudnn

        if self._handle is None:
            self._handle = cudnn.create_handle()
        cudnn.set_stream(self._handle, torch.cuda.current_stream(self.device).cuda_stream)
        return self._handle

    def _build(self, key: ConvKey, pack: dict, pad):
        """Choose (once per process) and build ``key``'s way: (graph, plan, workspace),
        or None for torch's convolution."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a convolution first seen inside CUDA graph capture: {key} "
                               "(warm it up before capturing)")
        index, graph = _CHOSEN.get((key, self.allow_torch)), None
        if index is None:
            try:
                graph = _define(key, self._on_stream())
                ms, index = _fastest(graph, pack, self._on_stream())
            except ValueError as e:
                warnings.warn(f"{e}; torch's convolution runs it", stacklevel=4)
                ms, index = math.inf, None
            args = [pack[_UID[n]] for n in ("x", "w", "b")] + [pad, pack.get(_UID["r"])]
            if index is None or (self.allow_torch and _time(lambda: torch_conv(*args)) <= ms):
                index = -1
            _CHOSEN[(key, self.allow_torch)] = index
        if index == -1:
            self._exe[key] = None
            return None
        if graph is None:
            graph = _define(key, self._on_stream())
            graph.build_plan_at_index(index)
        size = graph.get_workspace_size_plan_at_index(index)
        ws = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)
        self._exe[key] = (graph, index, ws)
        return self._exe[key]


def torch_conv(x, weight, bias, pad, residual=None) -> torch.Tensor:
    """torch's way: ``F.conv3d`` / ``F.conv2d`` with the bias, then the residual added."""
    y = (F.conv3d if x.dim() == 5 else F.conv2d)(x, weight, bias, padding=pad)
    return y if residual is None else y.add_(residual)


def _time(call) -> float:
    """ms per call: one warm call, then `TIMED_RUNS` between CUDA events."""
    call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_RUNS):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / TIMED_RUNS


def _define(key: ConvKey, handle):
    """The graph of ``key`` with its candidate plans listed (none built); ValueError
    naming the key when cuDNN (or this frontend) cannot express or support it."""
    import cudnn

    try:
        return _graph(cudnn, key, handle)
    except Exception as e:
        raise ValueError(f"cuDNN cannot build the convolution {key}: {e}") from e


def _graph(cudnn, key: ConvKey, handle):
    dt = {"torch.bfloat16": cudnn.data_type.BFLOAT16, "torch.float16": cudnn.data_type.HALF}[key.dtype]
    f32 = cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32,
                      handle=handle)
    nd, K, out = len(key.x) - 2, key.w[0], key.out
    x = g.tensor(name="x", dim=list(key.x), stride=list(key.x_strides), data_type=dt)
    w = g.tensor(name="w", dim=list(key.w), stride=channels_last_strides(key.w), data_type=dt)
    b = g.tensor(name="b", dim=[1, K] + [1] * nd, stride=[K, 1] + [K] * nd, data_type=dt)
    y = g.conv_fprop(image=x, weight=w, padding=list(key.pad), stride=[1] * nd,
                     dilation=[1] * nd, compute_data_type=f32, name="conv")
    y = g.bias(name="bias", input=y, bias=b)
    tensors = {"x": x, "w": w, "b": b}
    if key.residual:
        r = g.tensor(name="r", dim=out, stride=channels_last_strides(out), data_type=dt)
        y = g.add(name="residual", a=y, b=r, compute_data_type=f32)
        tensors["r"] = r
    y.set_output(True).set_dim(out).set_stride(channels_last_strides(out)).set_data_type(dt)
    tensors["y"] = y
    for name, t in tensors.items():
        t.set_uid(_UID[name])
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    g.check_support()
    return g


def _fastest(graph, pack: dict, handle) -> tuple[float, int | None]:
    """(ms, index) of the fastest plan that builds and runs (module doc); (inf, None)
    when none does."""
    best = (math.inf, None)
    for i in range(graph.get_execution_plan_count()):
        try:
            graph.build_plan_at_index(i)
            ws = torch.empty(max(graph.get_workspace_size_plan_at_index(i), 1),
                             dtype=torch.uint8, device=pack[_UID["x"]].device)
            ms = _time(lambda: graph.execute_plan_at_index(pack, ws, i, handle=handle))
        except Exception:            # a proposed plan that cannot build or run here
            continue
        best = min(best, (ms, i), key=lambda t: t[0])
    return best
