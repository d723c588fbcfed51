"""Launch plumbing shared by the ops: simulator detection, word sizes, kernel arguments
built straight from torch tensors, per-stream handles and a lean kernel launcher.

Where a kernel runs:

- a CUDA tensor runs the numba kernel on torch's current stream;
- a CPU tensor runs the torch reference, except under numba's CUDA simulator
  (``NUMBA_ENABLE_CUDASIM=1`` set before numba is imported), where the kernel runs on
  numpy views that share the tensors' memory, so in-place semantics hold.

Nothing here synchronises or copies to the host: kernel arguments are read off the
tensors (pointer, shape, strides) and a launch is one ``cuLaunchKernel``, so every
launch path is legal inside CUDA graph capture (warm up first: a kernel's first launch
compiles and loads it). The fallback through numba's dispatcher (``USE_DISPATCHER``)
imports the tensors with ``cuda.from_cuda_array_interface(..., sync=False)``.
A graph kernel node takes the same flat arguments (`Kernel.node_params`), also over
memory no tensor owns (`pointer_arg`). Launches and nodes get their compiled function
through one path (`framekv.ops._compile.obtain`): numba's on-disk cache once
`enable_disk_cache` turned it on, and counted (`compile_stats`). Importing this module
does not initialise CUDA.
"""
from __future__ import annotations

import ctypes
import math

import numba
import numpy as np
import torch
from numba import cuda

# The disk cache and the compile count live in _compile; their names are part of this
# module's face (warm-up and tests reach them here).
from ._compile import (_KERNELS, CompileStats, compile_stats,  # noqa: F401
                       enable_disk_cache, obtain, register)
from .driver import check, driver

__all__ = ["SIMULATOR", "MAX_THREADS", "MAX_BLOCKS", "use_kernel", "pick_word_size",
           "array_arg", "pointer_arg", "int_arg", "kernel_arguments", "threads_for", "threads_holding",
           "HARD_MAX_THREADS",
           "blocks_for", "Kernel", "enable_disk_cache", "CompileStats", "compile_stats"]

#: True when numba runs CUDA kernels in its simulator (decided when numba is imported).
SIMULATOR: bool = bool(numba.config.ENABLE_CUDASIM)

if not SIMULATOR:
    # numba-cuda launches through cuda.core itself, so this import is already paid.
    from cuda.core import LaunchConfig as _LaunchConfig
    from cuda.core import launch as _core_launch

# The simulator runs one Python thread per CUDA thread: small blocks keep it fast, and
# small caps make every grid- and block-stride loop take more than one turn in tests
# (the kernels are correct for any block and grid size).
THREAD_STEP: int = 4 if SIMULATOR else 32  # block sizes are multiples of this (a warp)
MAX_THREADS: int = 8 if SIMULATOR else 256
MAX_BLOCKS: int = 3 if SIMULATOR else 32768
HARD_MAX_THREADS = 1024  # threads a CUDA block may have

#: Force launches through numba's dispatcher (slower host path) instead of the lean one.
USE_DISPATCHER: bool = False

_WORD_NUMPY = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64, 16: np.complex128}
_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def use_kernel(t: torch.Tensor) -> bool:
    """True when ops on ``t`` run the numba kernel, False when they run the reference."""
    if t.device.type == "cuda":
        return not SIMULATOR
    return SIMULATOR and t.device.type == "cpu"


def pick_word_size(row_bytes: int, tensors, start: int = 16) -> int:
    """Largest word (16, 8, 4, 2 or 1 bytes, at most ``start``) that divides ``row_bytes``
    (the contiguous last dimension, in bytes), every tensor's address and every byte
    stride of its other dimensions, so a kernel can move whole aligned words."""
    for w in (16, 8, 4, 2, 1):
        if w > start or row_bytes % w:
            continue
        if all(_aligned(t, w) for t in tensors):
            return w
    return 1


def _aligned(t: torch.Tensor, w: int) -> bool:
    if t.data_ptr() % w:
        return False
    e = t.element_size()
    shape, stride = t.shape, t.stride()
    # Size-1 dimensions are never stepped over, so their strides do not matter.
    return all(shape[i] == 1 or (stride[i] * e) % w == 0 for i in range(t.dim() - 1))


def threads_for(work: int) -> int:
    """Threads per block for ``work`` independent items: whole warps, at most MAX_THREADS."""
    return max(THREAD_STEP, min(MAX_THREADS, -(-work // THREAD_STEP) * THREAD_STEP))


def threads_holding(lanes: int) -> int:
    """Threads per block when all ``lanes`` must run at once (a kernel that keeps a row
    in registers): whole warps (THREAD_STEP), not capped by MAX_THREADS; ValueError past
    the hardware's 1024 (the ops check their shapes first, naming the argument)."""
    n = max(THREAD_STEP, -(-lanes // THREAD_STEP) * THREAD_STEP)
    if n > HARD_MAX_THREADS:
        raise ValueError(f"lanes: expected at most {HARD_MAX_THREADS} threads, got {lanes}")
    return n


def blocks_for(work: int) -> int:
    """Blocks for ``work`` grid-stride items: at least 1, at most MAX_BLOCKS."""
    return max(1, min(MAX_BLOCKS, work))


# --- kernel arguments -------------------------------------------------------------

class _CudaArg:
    """A kernel argument in numba's ABI: its numba type and the flat launch values.

    An array is passed as (meminfo, parent, nitems, itemsize, data, *shape, *strides),
    exactly what numba's own launcher passes for a device array; ``tensor`` (None for
    a `pointer_arg`) keeps the memory alive and serves the dispatcher fallback. A
    scalar (``word`` 0) is one ctypes value."""

    __slots__ = ("nbtype", "values", "tensor", "word", "shape", "strides")

    def __init__(self, nbtype, values, tensor=None, word=0, shape=(), strides=()):
        self.nbtype, self.values, self.tensor = nbtype, values, tensor
        self.word, self.shape, self.strides = word, shape, strides

    def for_dispatcher(self):
        """The same argument as numba's dispatcher takes it (no copy, no sync)."""
        if not self.word:
            return self.values[0].value
        desc = {"shape": self.shape, "strides": self.strides, "version": 3,
                "typestr": np.dtype(_WORD_NUMPY[self.word]).str,
                "data": (self.values[4], False)}
        return cuda.from_cuda_array_interface(desc, owner=self.tensor, sync=False)

    def ctypes_pairs(self) -> tuple[list, list]:
        """(values, ctypes types) of the flat argument, as a kernel node takes them."""
        if not self.word:
            return [self.values[0].value], [type(self.values[0])]
        ndim = len(self.shape)
        return list(self.values), list(_ARRAY_HEAD_CTYPES) + [ctypes.c_int64] * (2 * ndim)


# meminfo, parent, nitems, itemsize, data: what precedes an array's shape and strides
_ARRAY_HEAD_CTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_void_p)


_ARRAY_TYPES: dict = {}


def _array_type(word: int, ndim: int):
    key = (word, ndim)
    nbtype = _ARRAY_TYPES.get(key)
    if nbtype is None:
        nbtype = numba.from_dtype(np.dtype(_WORD_NUMPY[word]))
        nbtype = _ARRAY_TYPES[key] = numba.types.Array(nbtype, ndim, "A")
    return nbtype


def array_arg(t: torch.Tensor, word: int | None = None):
    """``t`` as a kernel array of ``word``-byte elements (default: its own element size).

    ``word`` must come from :func:`pick_word_size` (or equal the element size); when it
    differs from the element size the last dimension must be contiguous. Returns a
    lean CUDA argument, or under the simulator a numba array over ``t``'s memory."""
    e = t.element_size()
    word = e if word is None else word
    if SIMULATOR:
        return _sim_array(t, e, word)
    shape = list(t.shape)
    strides = [s * e for s in t.stride()]
    if word != e:
        shape[-1] = shape[-1] * e // word
        strides[-1] = word
    shape, strides = tuple(shape), tuple(strides)
    values = [0, 0, math.prod(shape), word, t.data_ptr(), *shape, *strides]
    return _CudaArg(_array_type(word, len(shape)), values, t, word, shape, strides)


def _sim_array(t: torch.Tensor, e: int, word: int):
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    # numpy has no bfloat16: view as a same-size integer first; numpy strides are in
    # bytes, so a wider word view keeps every other stride as it is.
    a = t.detach().view(_SAME_SIZE_INT[e]).numpy()
    if word != e:
        a = a.view(_WORD_NUMPY[word])
    return FakeCUDAArray(a)


def pointer_arg(ptr: int, shape, strides, word: int):
    """A kernel array over device memory at ``ptr`` that no tensor owns (a graph
    node's target): ``shape`` elements of ``word`` bytes (1, 2, 4, 8 or 16), ``strides``
    in bytes. The caller keeps the memory alive. CUDA only (the simulator needs a
    tensor: use `array_arg`)."""
    if word not in _WORD_NUMPY:
        raise ValueError(f"word: expected one of {sorted(_WORD_NUMPY)} bytes, got {word!r}")
    shape, strides = tuple(int(n) for n in shape), tuple(int(n) for n in strides)
    if len(shape) != len(strides) or not shape:
        raise ValueError(f"shape, strides: expected the same number (at least 1) of "
                         f"dimensions, got shape {shape} and strides {strides}")
    values = [0, 0, math.prod(shape), word, int(ptr), *shape, *strides]
    return _CudaArg(_array_type(word, len(shape)), values, None, word, shape, strides)


_INT64 = numba.types.int64


def int_arg(value: int):
    """A 64-bit integer kernel argument."""
    if SIMULATOR:
        return int(value)
    return _CudaArg(_INT64, [ctypes.c_int64(value)])


def kernel_arguments(args) -> tuple[tuple, tuple]:
    """The flat (values, ctypes types) of kernel arguments (from `array_arg`,
    `pointer_arg`, `int_arg`): a graph kernel node's ``kernelParams``."""
    values, types = [], []
    for a in args:
        v, t = a.ctypes_pairs()
        values += v
        types += t
    return tuple(values), tuple(types)


# --- streams and launches ---------------------------------------------------------

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_STREAMS: dict = {}


def current_stream(device_index: int):
    """torch's current stream on ``device_index`` as (numba stream, cuda.core stream),
    cached per stream pointer."""
    if _raw_stream is not None:
        ptr = _raw_stream(device_index)
    else:
        ptr = torch.cuda.current_stream(device_index).cuda_stream
    handles = _STREAMS.get(ptr)
    if handles is None:
        from numba.cuda.cudadrv import driver

        # 0 is the legacy default stream for both torch and numba.
        nb_stream = cuda.external_stream(ptr) if ptr else 0
        handles = _STREAMS[ptr] = (nb_stream, driver._to_core_stream(nb_stream))
    return handles


class Kernel:
    """A numba kernel launched with pre-converted arguments.

    On CUDA the compiled function is looked up once per argument-type tuple and device,
    and each launch goes straight to ``cuda.core.launch`` with the flat argument values
    (numba's dispatcher would re-type every argument on every launch). `cufunction` and
    `node_params` hand the same function to a graph kernel node."""

    def __init__(self, dispatcher):
        self._dispatcher = dispatcher
        self._compiled: dict = {}
        self._configs: dict = {}
        register(self)

    def launch(self, grid: int, block: int, args, device: torch.device) -> None:
        """Launch on torch's current stream of ``device`` (kernel args from array_arg/int_arg)."""
        if SIMULATOR:
            self._dispatcher[grid, block](*args)
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index != torch.cuda.current_device():
            with torch.cuda.device(index):
                self._launch_cuda(grid, block, args, index)
        else:
            self._launch_cuda(grid, block, args, index)

    def _launch_cuda(self, grid, block, args, index):
        nb_stream, core_stream = current_stream(index)
        if USE_DISPATCHER:
            self._dispatcher[grid, block, nb_stream](*[a.for_dispatcher() for a in args])
            return
        fn = self._function(tuple(a.nbtype for a in args), index)
        config = self._configs.get((grid, block))
        if config is None:
            config = self._configs[(grid, block)] = _LaunchConfig(grid=grid, block=block,
                                                                  shmem_size=0)
        values = []
        for a in args:
            values += a.values
        _core_launch(core_stream, config, fn, *values)

    def _function(self, types: tuple, index: int):
        """The compiled function for ``types`` on device ``index`` (current already)."""
        fn = self._compiled.get((types, index))
        if fn is None:
            fn = self._compiled[(types, index)] = obtain(self._dispatcher, types)
        return fn

    def cufunction(self, arg_types, device_index: int):
        """The driver ``CUfunction`` of this kernel for numba ``arg_types`` on a device,
        from the same compiled (or disk-cached) function launches use."""
        types = tuple(arg_types)
        if device_index != torch.cuda.current_device():
            with torch.cuda.device(device_index):
                return self.cufunction(types, device_index)
        handle = self._function(types, device_index).handle
        dr = driver()
        if isinstance(handle, dr.CUfunction):
            return handle
        # A library kernel (CUkernel): its function in the current context.
        return check("cuKernelGetFunction", dr.cuKernelGetFunction(handle))

    def node_params(self, grid: int, block: int, args, device_index: int):
        """``CUDA_KERNEL_NODE_PARAMS`` launching this kernel over ``args`` (from
        `array_arg`, `pointer_arg`, `int_arg`) on ``grid`` x ``block`` threads, no
        shared memory: a graph kernel node of device ``device_index``."""
        k = driver().CUDA_KERNEL_NODE_PARAMS()
        k.func = self.cufunction([a.nbtype for a in args], device_index)
        k.gridDimX, k.gridDimY, k.gridDimZ = grid, 1, 1
        k.blockDimX, k.blockDimY, k.blockDimZ = block, 1, 1
        k.sharedMemBytes = 0
        k.kernelParams = kernel_arguments(args)
        return k
