"""framekv.ops: the numba-cuda kernels, one op per file, each with a thin validating
wrapper, a bound launcher for the hot path and a torch reference implementation.

CUDA tensors run the kernels on torch's current stream (graph-capturable: no host sync,
no allocation); CPU tensors run the references, or the kernels under numba's CUDA
simulator when ``NUMBA_ENABLE_CUDASIM=1``. Each op is also a torch custom op
(``torch.ops.framekv.*``), so callers trace under torch.compile. Importing this package
imports numba but does not initialise CUDA.

Besides the ops: `fill_pattern_` / `fill_node_params` (a memset's bytes written by a
kernel, for graph kernel nodes), `compile_stats` (how many kernels this process compiled
or loaded from numba's disk cache, and the seconds it took) and `framekv.ops.driver`
(the cuda-python driver, runtime and NVRTC calls, checked in one place) and
`resolve_device` (a device argument checked once, with a clear error).
"""
from ._launch import CompileStats, compile_stats, use_kernel
from .advance_commit import advance_commit_, advance_commit_reference
from .causal_layout import causal_layout_, causal_layout_reference
from .device import resolve_device
from .copy_kv_slots import CopyKVSlots, bind_copy_kv_slots, copy_kv_slots_, copy_kv_slots_reference
from .fill_pattern import fill_node_params, fill_pattern_, fill_pattern_reference
from .merge_split_kv import (MergeSplitKV, bind_merge_split_kv, merge_split_kv_,
                             merge_split_kv_reference)
from .adaln import (AdaLN, GatedResidual, adaln_, adaln_reference, bind_adaln,
                    bind_gated_residual, gated_residual_, gated_residual_reference)
from .qk_norm_rope import (QKNormRopeStage, RopeGrid, bind_qk_norm_rope_stage,
                           qk_norm_rope_stage_, qk_norm_rope_stage_reference)
from .rotate_rows import RotateRows, bind_rotate_rows, rotate_rows_, rotate_rows_reference
from .scatter_kv_slots import (ScatterKVSlots, bind_scatter_kv_slots, scatter_kv_slots_,
                               scatter_kv_slots_reference)

__all__ = [
    "use_kernel", "CompileStats", "compile_stats", "resolve_device",
    "fill_pattern_", "fill_pattern_reference", "fill_node_params",
    "advance_commit_", "advance_commit_reference",
    "causal_layout_", "causal_layout_reference",
    "rotate_rows_", "rotate_rows_reference", "bind_rotate_rows", "RotateRows",
    "scatter_kv_slots_", "scatter_kv_slots_reference", "bind_scatter_kv_slots",
    "ScatterKVSlots",
    "copy_kv_slots_", "copy_kv_slots_reference", "bind_copy_kv_slots", "CopyKVSlots",
    "merge_split_kv_", "merge_split_kv_reference", "bind_merge_split_kv", "MergeSplitKV",
    "adaln_", "adaln_reference", "bind_adaln", "AdaLN",
    "gated_residual_", "gated_residual_reference", "bind_gated_residual", "GatedResidual",
    "qk_norm_rope_stage_", "qk_norm_rope_stage_reference", "bind_qk_norm_rope_stage",
    "QKNormRopeStage", "RopeGrid",
]
