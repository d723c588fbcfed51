"""framekv.ops: the numba-cuda kernels, one op per file, each with a thin validating
wrapper and a torch reference implementation. `bind_scatter_kv_slots` also binds the
K/V scatter to a pool layer and its slot lists once, so the cache's per-layer call
checks and converts only that forward's K and V.

CUDA tensors run the kernels on torch's current stream (graph-capturable: no host sync,
no allocation); CPU tensors run the references, or the kernels under numba's CUDA
simulator when ``NUMBA_ENABLE_CUDASIM=1``. Each op is also a torch custom op
(``torch.ops.framekv.*``), so callers trace under torch.compile. Importing this package
imports numba but does not initialise CUDA.

Besides the ops: `fill_pattern_` / `fill_node_params` (a memset's bytes written by a
kernel, for graph kernel nodes), `compile_stats` (how many kernels this process compiled
or loaded from numba's disk cache, and the seconds it took) and `framekv.ops.driver`
(the cuda-python driver and runtime calls, checked in one place) and
`resolve_device` (a device argument checked once, with a clear error).
"""
from ._launch import CompileStats, compile_stats, use_kernel
from .advance_commit import advance_commit_, advance_commit_reference
from .causal_layout import causal_layout_, causal_layout_reference
from .device import resolve_device
from .copy_kv_slots import copy_kv_slots_, copy_kv_slots_reference
from .copy_rows import copy_rows_, copy_rows_reference, prepare_copy_rows
from .fill_pattern import fill_node_params, fill_pattern_, fill_pattern_reference
from .merge_split_kv import merge_split_kv_, merge_split_kv_reference
from .adaln import adaln_, adaln_reference, gated_residual_, gated_residual_reference
from .rms_silu import rms_norm_silu, rms_norm_silu_reference
from .quant_rows import quantize_rows, quantize_rows_reference
from .qk_norm_rope import RopeGrid, q_bound, qk_norm_rope_stage_, qk_norm_rope_stage_reference
from .rotate_rows import rotate_rows_, rotate_rows_reference
from .scatter_kv_slots import (ScatterKVSlots, bind_scatter_kv_slots, scatter_kv_slots_,
                               scatter_kv_slots_reference)

__all__ = [
    "use_kernel", "CompileStats", "compile_stats", "resolve_device",
    "fill_pattern_", "fill_pattern_reference", "fill_node_params",
    "advance_commit_", "advance_commit_reference",
    "causal_layout_", "causal_layout_reference",
    "rotate_rows_", "rotate_rows_reference",
    "scatter_kv_slots_", "scatter_kv_slots_reference", "bind_scatter_kv_slots",
    "ScatterKVSlots",
    "copy_kv_slots_", "copy_kv_slots_reference",
    "copy_rows_", "copy_rows_reference", "prepare_copy_rows",
    "merge_split_kv_", "merge_split_kv_reference",
    "adaln_", "adaln_reference",
    "gated_residual_", "gated_residual_reference",
    "rms_norm_silu", "rms_norm_silu_reference",
    "quantize_rows", "quantize_rows_reference",
    "qk_norm_rope_stage_", "qk_norm_rope_stage_reference", "RopeGrid", "q_bound",
]
