"""The device side of `framekv.graphs.resident.ResidentGraph`.

Built here, through cuda-python in torch's primary context (every call checked by
`framekv.ops.driver.check`):

- the gate and done kernels, compiled once per process with NVRTC for the device's
  architecture (one thread each; the gate sets the graph's conditional handles with
  ``cudaGraphSetConditional``, which the driver links at module load, as it does for
  torch's own conditional kernels);
- the control block, 64 bytes of pinned host memory mapped into the device, read by
  the host as a numpy array;
- the parent graph, WHILE(loop){ gate -> IF(run){ child -> done } }, with the
  captured graph cloned in as the child graph node; instantiated, uploaded, and
  launched on a non-blocking stream of its own (a blocking one would make torch's
  legacy-default-stream work wait for the loop to end).
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from framekv.ops.driver import CudaDriverError, check, driver, make_current, primary_context

from .protocol import DONE, EXITED, EXITING, RING, RUNNING, SERVED, STATE, STOP, WORDS

__all__ = ["DEVICE_PRELUDE", "KERNELS", "DeviceLoop", "kernel_source"]

#: What the kernels need from CUDA, as the FK_* primitives they are written against (a
#: host build of the same kernels, in the tests, supplies host versions instead).
DEVICE_PRELUDE = r"""
typedef unsigned long long u64;
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __attribute__((cudart_builtin))
void cudaGraphSetConditional(cudaGraphConditionalHandle handle, unsigned int value);
#define FK_KERNEL extern "C" __global__
#define FK_INLINE __device__ __forceinline__
#define FK_FENCE() __threadfence()
#define FK_FENCE_SYSTEM() __threadfence_system()
#define FK_PAUSE() __nanosleep(200)
#define FK_SET(handle, value) cudaGraphSetConditional(handle, value)
#define FK_BEFORE_EXIT()  // where the host build's tests act, as a host store landing then
FK_INLINE u64 fk_now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
"""

KERNELS = r"""
FK_INLINE void fk_serve(volatile u64* cb, u64 served, u64 run) {
    cb[SERVED] = served + 1;
    FK_FENCE_SYSTEM();
    FK_SET(run, 1);
}

// One thread. Waits until the host rang (RING > SERVED: serve one run), STOP, or
// idle_ns passed; before leaving on idle it says so (STATE = EXITING) and looks at
// RING once more, so that a ring stored meanwhile is served, not left behind.
FK_KERNEL void framekv_resident_gate(volatile u64* cb, u64 loop, u64 run, u64 idle_ns) {
    const u64 served = cb[SERVED];
    const u64 t0 = fk_now_ns();
    for (;;) {
        if (cb[STOP]) break;
        if (cb[RING] > served) { fk_serve(cb, served, run); return; }
        if (fk_now_ns() - t0 > idle_ns) {
            FK_BEFORE_EXIT();
            cb[STATE] = EXITING;
            FK_FENCE_SYSTEM();
            if (cb[RING] > served && !cb[STOP]) {
                cb[STATE] = RUNNING;
                fk_serve(cb, served, run);
                return;
            }
            break;
        }
        FK_PAUSE();
    }
    FK_SET(run, 0);
    FK_SET(loop, 0);
    FK_FENCE();
    cb[STATE] = EXITED;
    FK_FENCE_SYSTEM();
}

// After the child graph: its kernels have finished (graph order), count the run.
FK_KERNEL void framekv_resident_done(volatile u64* cb) {
    FK_FENCE();
    cb[DONE] = cb[SERVED];
    FK_FENCE_SYSTEM();
}
"""


def kernel_source(prelude: str = DEVICE_PRELUDE) -> str:
    """The gate and done kernels after ``prelude``, with the control-block word
    indices and states filled in."""
    defs = "".join(f"#define {n} {v}ULL\n" for n, v in (
        ("RING", RING), ("STOP", STOP), ("SERVED", SERVED), ("DONE", DONE), ("STATE", STATE),
        ("RUNNING", RUNNING), ("EXITING", EXITING), ("EXITED", EXITED)))
    return prelude + defs + KERNELS


_FUNCTIONS: dict[int, tuple] = {}  # device index -> (module, gate, done)


def _kernels(device_index: int) -> tuple:
    """(gate, done) CUfunctions for the device, compiled and loaded on first use."""
    got = _FUNCTIONS.get(device_index)
    if got is None:
        dr = driver()
        make_current(device_index)
        major, minor = torch.cuda.get_device_capability(device_index)
        module = check("cuModuleLoadData", dr.cuModuleLoadData(_compile(f"sm_{major}{minor}")))
        gate, done = (check("cuModuleGetFunction", dr.cuModuleGetFunction(module, name))
                      for name in (b"framekv_resident_gate", b"framekv_resident_done"))
        got = _FUNCTIONS[device_index] = (module, gate, done)
    return got[1], got[2]


def _compile(arch: str) -> bytes:
    """NVRTC: the gate source -> CUBIN for ``arch``.

    Raises:
        CudaDriverError: an NVRTC call failed; a failed compile carries NVRTC's log.
    """
    from cuda.bindings import nvrtc

    prog = check("nvrtcCreateProgram", nvrtc.nvrtcCreateProgram(
        kernel_source().encode(), b"framekv_resident.cu", 0, [], []))
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        try:
            check("nvrtcCompileProgram", nvrtc.nvrtcCompileProgram(prog, len(opts), opts))
        except CudaDriverError as exc:
            raise CudaDriverError(f"NVRTC could not compile the resident gate for {arch} "
                                  f"({exc}):\n{_log(nvrtc, prog)}") from exc
        cubin = b" " * check("nvrtcGetCUBINSize", nvrtc.nvrtcGetCUBINSize(prog))
        check("nvrtcGetCUBIN", nvrtc.nvrtcGetCUBIN(prog, cubin))
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _log(nvrtc, prog) -> str:
    """NVRTC's compile log of ``prog``."""
    log = b" " * check("nvrtcGetProgramLogSize", nvrtc.nvrtcGetProgramLogSize(prog))
    check("nvrtcGetProgramLog", nvrtc.nvrtcGetProgramLog(prog, log))
    return log.decode(errors="replace")


class DeviceLoop:
    """The parent graph of one `ResidentGraph` and what it needs (see the module doc).

    Args:
        entry: a captured `CapturedGraph` whose torch graph kept its cudaGraph_t
            (``GraphCache`` captures with ``keep_graph=True``).
        idle_timeout_s: the gate's idle limit.
    Raises:
        ValueError: the entry has no kept graph.
        CudaDriverError: the driver refused a step (e.g. a node type a conditional
            body cannot hold); whatever was built is freed.
    """

    def __init__(self, entry, *, idle_timeout_s: float):
        try:
            child = entry.graph.raw_cuda_graph()
        except (AttributeError, RuntimeError) as exc:
            raise ValueError(f"{entry.key.summary()}: a resident run needs the captured "
                             f"cudaGraph_t (torch CUDAGraph(keep_graph=True)): {exc}") from exc
        self._dr = dr = driver()
        self.device_index = entry.device.index
        self._entry = entry  # holds the torch graph whose topology the child node cloned
        self._host = self._graph = self._exec = self._stream = None
        try:
            self._build(dr.CUgraph(init_value=int(child)), int(idle_timeout_s * 1e9))
        except BaseException:
            self.release()
            raise

    def _build(self, child, idle_ns: int) -> None:
        dr = self._dr
        make_current(self.device_index)
        _, ctx = primary_context(self.device_index)
        gate, done = _kernels(self.device_index)
        self._host, self.control, cb_dev = _control_block()
        self._graph = g = check("cuGraphCreate", dr.cuGraphCreate(0))
        flags = dr.CU_GRAPH_COND_ASSIGN_DEFAULT  # every launch starts from the defaults
        loop = check("cuGraphConditionalHandleCreate",
                     dr.cuGraphConditionalHandleCreate(g, ctx, 1, flags))
        run = check("cuGraphConditionalHandleCreate",
                    dr.cuGraphConditionalHandleCreate(g, ctx, 0, flags))
        body = _conditional(g, loop, ctx, dr.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE)
        args = ((cb_dev, int(loop), int(run), idle_ns),
                (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64))
        gate_node = check("cuGraphAddKernelNode",
                          dr.cuGraphAddKernelNode(body, None, 0, _one_thread(gate, args)))
        then = _conditional(body, run, ctx, dr.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF,
                            after=[gate_node])
        chunk = check("cuGraphAddChildGraphNode", dr.cuGraphAddChildGraphNode(then, None, 0, child))
        check("cuGraphAddKernelNode", dr.cuGraphAddKernelNode(
            then, [chunk], 1, _one_thread(done, ((cb_dev,), (ctypes.c_void_p,)))))
        self._exec = check("cuGraphInstantiate", dr.cuGraphInstantiate(g, 0))
        self._stream = check("cuStreamCreate", dr.cuStreamCreate(
            dr.CUstream_flags.CU_STREAM_NON_BLOCKING))
        check("cuGraphUpload", dr.cuGraphUpload(self._exec, self._stream))
        check("cuStreamSynchronize", dr.cuStreamSynchronize(self._stream))

    # The calling thread may never have touched CUDA (a server thread that only
    # submits, or the collector): each call makes the context current first. Launches
    # are rare (the first, and one after each idle exit), so this costs nothing.
    def launch(self) -> None:
        """Queue one run of the parent loop on the loop's stream."""
        make_current(self.device_index)
        check("cuGraphLaunch", self._dr.cuGraphLaunch(self._exec, self._stream))

    def synchronize(self) -> None:
        """Wait until every launched loop has ended."""
        make_current(self.device_index)
        check("cuStreamSynchronize", self._dr.cuStreamSynchronize(self._stream))

    def release(self) -> None:
        """Free the executable, graph, stream and control block (idempotent). Call
        only once no loop runs (`ResidentGraph.close` stops it first)."""
        dr = self._dr
        if self._host is not None:
            make_current(self.device_index)
        for attr, free in (("_exec", dr.cuGraphExecDestroy), ("_graph", dr.cuGraphDestroy),
                           ("_stream", dr.cuStreamDestroy), ("_host", dr.cuMemFreeHost)):
            handle = getattr(self, attr)
            if handle is not None:
                setattr(self, attr, None)
                free(handle)
        self.control = None


def _control_block():
    """(host pointer, uint64 numpy view, device pointer) of a zeroed mapped block."""
    dr = driver()
    nbytes = WORDS * 8
    flags = dr.CU_MEMHOSTALLOC_DEVICEMAP | dr.CU_MEMHOSTALLOC_PORTABLE
    host = check("cuMemHostAlloc", dr.cuMemHostAlloc(nbytes, flags))
    view = np.ctypeslib.as_array((ctypes.c_uint64 * WORDS).from_address(int(host)))
    view[:] = 0
    dev = check("cuMemHostGetDevicePointer", dr.cuMemHostGetDevicePointer(host, 0))
    return host, view, int(dev)


def _one_thread(func, args):
    dr = driver()
    k = dr.CUDA_KERNEL_NODE_PARAMS()
    k.func = func
    k.gridDimX = k.gridDimY = k.gridDimZ = 1
    k.blockDimX = k.blockDimY = k.blockDimZ = 1
    k.sharedMemBytes = 0
    k.kernelParams = args
    return k


def _conditional(graph, handle, ctx, kind, after=()):
    """Add a conditional node of ``kind`` on ``handle``; returns its body graph."""
    dr = driver()
    p = dr.CUgraphNodeParams()
    p.type = dr.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    p.conditional.handle = handle
    p.conditional.type = kind
    p.conditional.size = 1
    p.conditional.ctx = ctx
    deps = list(after)
    try:  # bindings with edge data (CUDA 12.3+ signature)
        check("cuGraphAddNode", dr.cuGraphAddNode(graph, deps, None, len(deps), p))
    except TypeError:
        check("cuGraphAddNode", dr.cuGraphAddNode(graph, deps, len(deps), p))
    return p.conditional.phGraph_out[0]
