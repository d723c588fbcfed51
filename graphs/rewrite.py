"""Memset nodes of a captured graph turned into kernel nodes.

CUDA launches a straight-line chain of one repeated kernel in nearly constant host time
(1000 kernels: ~10-16 µs on an H200), but memset nodes make the launch cost grow
quickly with the node count (a 36-layer forward with one memset per layer: ~139 µs
against ~41 µs with kernel nodes instead; a whole chunk with 180 of them: ~680 µs). cuDNN's attention issues a small memset (scheduler state in
its workspace) before every launch, and it ends up in every graph. This module
replaces each memset node by a kernel node writing the same bytes, with the same
dependencies, before the graph is instantiated::

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    ... capture ...
    replace_memsets(graph)      # count of nodes replaced
    graph.instantiate()

The fill kernel is a numba kernel over a 2-D view (height rows of ``width`` elements
of 1, 2 or 4 bytes, ``pitch`` bytes apart), launched as a graph kernel node with the
flattened array arguments numba kernels take.
"""
from __future__ import annotations

import ctypes

import numba
import torch
from numba import cuda

_BLOCK = 256
_MAX_GRID = 1024


@cuda.jit
def _fill_kernel(dst, value):
    # dst: [height, width] of 1/2/4-byte elements (any row pitch)
    width = dst.shape[1]
    n = dst.shape[0] * width
    for k in range(cuda.grid(1), n, cuda.gridsize(1)):
        dst[k // width, k % width] = value


_ELEMENT = {1: (numba.types.uint8, ctypes.c_uint8), 2: (numba.types.uint16, ctypes.c_uint16),
            4: (numba.types.uint32, ctypes.c_uint32)}
_FUNCTIONS: dict = {}


def _fill_function(element_size: int):
    """(CUfunction, value ctypes type) of the fill kernel for one element size."""
    fn = _FUNCTIONS.get(element_size)
    if fn is None:
        from cuda.bindings import driver as dr

        nbtype, ctype = _ELEMENT[element_size]
        array = numba.types.Array(nbtype, 2, "A")
        kernel = _fill_kernel.compile((array, nbtype))
        handle = kernel._codelibrary.get_cufunc().kernel.handle
        func = handle if isinstance(handle, dr.CUfunction) else _check(dr.cuKernelGetFunction(handle))
        fn = _FUNCTIONS[element_size] = (func, ctype)
    return fn


def _kernel_params(p, func, ctype):
    """CUDA_KERNEL_NODE_PARAMS of the fill for memset params ``p``."""
    from cuda.bindings import driver as dr

    e, width, height = int(p.elementSize), int(p.width), int(p.height)
    pitch = int(p.pitch) if height > 1 else width * e
    # numba's flattened array: meminfo, parent, nitems, itemsize, data, shape, strides
    values = (0, 0, width * height, e, int(p.dst), height, width, pitch, e, int(p.value))
    types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
             ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctype)
    k = dr.CUDA_KERNEL_NODE_PARAMS()
    k.func = func
    k.gridDimX = max(1, min(_MAX_GRID, -(-width * height // _BLOCK)))
    k.gridDimY = k.gridDimZ = 1
    k.blockDimX, k.blockDimY, k.blockDimZ = _BLOCK, 1, 1
    k.sharedMemBytes = 0
    k.kernelParams = (values, types)
    return k


def replace_memsets(graph: torch.cuda.CUDAGraph) -> int:
    """Replace every memset node of ``graph`` (captured with ``keep_graph=True``, not yet
    instantiated) by an equivalent kernel node; returns how many were replaced."""
    from cuda.bindings import driver as dr

    raw = dr.CUgraph(init_value=graph.raw_cuda_graph())
    count = _check(dr.cuGraphGetNodes(raw, 0), last=True)
    nodes = _check(dr.cuGraphGetNodes(raw, count))
    replaced = 0
    for node in nodes:
        if _check(dr.cuGraphNodeGetType(node)) != dr.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET:
            continue
        params = _check(dr.cuGraphMemsetNodeGetParams(node))
        func, ctype = _fill_function(int(params.elementSize))
        deps = _list(dr.cuGraphNodeGetDependencies, node)
        after = _list(dr.cuGraphNodeGetDependentNodes, node)
        # The fill joins the graph next to the memset before the memset goes: a failure
        # part way leaves both (the same bytes written twice), never neither.
        fill = _check(dr.cuGraphAddKernelNode(raw, deps, len(deps),
                                              _kernel_params(params, func, ctype)))
        if after:
            _add_edges(raw, [fill] * len(after), after)
        _check(dr.cuGraphDestroyNode(node))
        replaced += 1
    return replaced


def _list(fn, node) -> list:
    n = _check(fn(node, 0), last=True)
    return list(_check(fn(node, n))) if n else []


def _add_edges(raw, src, dst) -> None:
    from cuda.bindings import driver as dr

    try:
        _check(dr.cuGraphAddDependencies(raw, src, dst, None, len(src)))
    except TypeError:  # bindings without edge data
        _check(dr.cuGraphAddDependencies(raw, src, dst, len(src)))


def _check(out, last: bool = False):
    """The value of a cuda-python call (``last``: the trailing count), raising on error."""
    err = out[0] if isinstance(out, tuple) else out
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    if not isinstance(out, tuple) or len(out) == 1:
        return None
    return out[-1] if last else out[1]
