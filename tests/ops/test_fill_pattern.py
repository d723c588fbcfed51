"""fill_pattern_ and the ops' kernel plumbing on CPU: the reference, argument checks, the
flat arguments of a graph kernel node, and the compile counter (with stand-in
dispatchers: counting needs no GPU)."""
from __future__ import annotations

import ctypes
import re
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from framekv.ops import CompileStats, compile_stats, fill_pattern_, fill_pattern_reference
from framekv.ops import _compile, _launch, fill_pattern

# ---------------------------------------------------------------------------- the op
@pytest.mark.parametrize("dtype,value,want", [
    (torch.uint8, 0x5A, 0x5A),
    (torch.int8, 0x1FF, -1),                    # low 8 bits only
    (torch.int16, 0xBEEF, 0xBEEF - 0x10000),    # a memset's unsigned value, as int16 bits
    (torch.int16, -16657, -16657),              # the same bits, signed
    (torch.int32, 0x01020304, 0x01020304),
    (torch.int32, 0xFFFFFFFF, -1),
])
def test_reference_writes_the_low_bits_of_value(dtype, value, want):
    buf = torch.zeros(5, 9, dtype=dtype)
    region = buf[1:4, 2:7]                      # pitched: rows 9 elements apart
    fill_pattern_reference(region, value)
    expect = torch.zeros(5, 9, dtype=dtype)
    expect[1:4, 2:7] = want
    assert torch.equal(buf, expect)


def test_public_op_on_cpu_matches_the_reference_for_any_dtype_of_the_sizes():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.uint8):
        got, want = torch.zeros(3, 4, dtype=dtype), torch.zeros(3, 4, dtype=dtype)
        fill_pattern_(got[:, 1:], 0x3F80)
        fill_pattern_reference(want[:, 1:], 0x3F80)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), dtype
    fill_pattern_(torch.zeros(0, 4), 1)  # nothing to write


@pytest.mark.parametrize("dst,value,message", [
    (torch.zeros(4), 1, "dst: expected 2 dimensions [height, width], got 1"),
    (torch.zeros(2, 2, dtype=torch.float64), 1, "dst: expected elements of (1, 2, 4) bytes, "
                                                "got torch.float64 (8 bytes)"),
    (torch.zeros(1, 4).expand(3, 4), 1, "dst: expected no zero strides"),
    (torch.zeros(2, 2), 1.5, "value: expected an int, got float"),
    (torch.zeros(2, 2), True, "value: expected an int, got bool"),
    ([[0]], 1, "dst: expected a torch.Tensor, got list"),
])
def test_bad_arguments_are_named(dst, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fill_pattern_(dst, value)


# ---------------------------------------------------------------------------- node params
def test_pointer_args_flatten_as_numba_arrays_for_a_kernel_node():
    arr = _launch.pointer_arg(0x7000, (3, 5), (64, 2), 2)
    values, types = _launch.kernel_arguments([arr, _launch.int_arg(-7)])
    # meminfo, parent, nitems, itemsize, data, shape, strides, then the int64
    assert values == (0, 0, 15, 2, 0x7000, 3, 5, 64, 2, -7)
    assert types == ((ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                      ctypes.c_void_p) + (ctypes.c_int64,) * 5)
    assert str(arr.nbtype) == "array(int16, 2d, A)"
    with pytest.raises(ValueError, match="word: expected one of"):
        _launch.pointer_arg(0x7000, (3,), (1,), 3)
    with pytest.raises(ValueError, match=r"shape, strides: .* got shape \(3, 5\) and "
                                         r"strides \(64,\)"):
        _launch.pointer_arg(0x7000, (3, 5), (64,), 2)


def test_fill_node_params_cover_the_memset_region(monkeypatch):
    pytest.importorskip("cuda.bindings")
    from cuda.bindings import driver as dr

    asked = []

    def cufunction(self, arg_types, device_index):
        asked.append(([str(t) for t in arg_types], device_index))
        return dr.CUfunction(init_value=0x1234)

    monkeypatch.setattr(_launch.Kernel, "cufunction", cufunction)
    p = fill_pattern.fill_node_params(0x9000, 7, 24, 64, 2, 0xBEEF, device_index=3)
    assert int(p.func) == 0x1234
    assert (p.gridDimX, p.blockDimX, p.sharedMemBytes) == (1, fill_pattern.NODE_BLOCK, 0)
    assert asked == [(["array(int16, 2d, A)", "int64"], 3)]
    big = fill_pattern.fill_node_params(0x9000, 1, 1 << 24, 12345, 4, 0, device_index=0)
    assert big.gridDimX == fill_pattern.NODE_MAX_BLOCKS  # a grid-stride loop covers the rest
    with pytest.raises(ValueError, match="element_size: expected one of .*, got 8"):
        fill_pattern.fill_node_params(0x9000, 1, 1, 8, 8, 0, device_index=0)
    with pytest.raises(ValueError, match="height, width: expected at least 1 each, got 0 x 4"):
        fill_pattern.fill_node_params(0x9000, 0, 4, 8, 2, 0, device_index=0)


# ---------------------------------------------------------------------------- compile counter
class FakeDispatcher:
    """numba-cuda's dispatcher as the counter sees it: ``compile`` returns what it holds
    in memory, else loads signatures ``on_disk`` (a cache hit) or compiles (a miss)."""

    def __init__(self, on_disk=(), counters: str = "private"):
        self.on_disk, self.memory = set(on_disk), {}
        hits, misses = Counter(), Counter()
        if counters == "private":
            self._cache_hits, self._cache_misses = hits, misses
        elif counters == "stats":
            self.stats = SimpleNamespace(cache_path="", cache_hits=hits, cache_misses=misses)
        self._hits, self._misses = hits, misses

    def compile(self, types):
        if types not in self.memory:
            (self._hits if types in self.on_disk else self._misses)[types] += 1
            function = SimpleNamespace(handle=object())
            library = SimpleNamespace(get_cufunc=lambda: SimpleNamespace(kernel=function))
            self.memory[types] = SimpleNamespace(_codelibrary=library)
        return self.memory[types]

    def enable_caching(self):
        pass


def _delta(before: CompileStats) -> tuple[int, int]:
    now = compile_stats()
    assert now.seconds >= before.seconds
    return now.compiled - before.compiled, now.loaded - before.loaded


@pytest.mark.parametrize("counters", ["private", "stats"])
def test_compile_stats_count_compiles_and_disk_loads(monkeypatch, counters):
    monkeypatch.setattr(_compile, "_KERNELS", [])  # keep the stand-ins out of the registry
    before = compile_stats()
    k = _launch.Kernel(FakeDispatcher(on_disk={("a",)}, counters=counters))
    first = k._function(("a",), 0)
    assert _delta(before) == (0, 1)               # loaded from the disk cache
    k._function(("b",), 0)
    assert _delta(before) == (1, 1)               # compiled
    assert k._function(("a",), 0) is first        # the Kernel keeps it: no second look
    k._function(("a",), 1)                        # another device: numba holds it already
    assert _delta(before) == (1, 1)
    assert isinstance(compile_stats(), CompileStats)


def test_a_dispatcher_without_counters_counts_as_compiled(monkeypatch):
    monkeypatch.setattr(_compile, "_KERNELS", [])
    before = compile_stats()
    _launch.Kernel(FakeDispatcher(on_disk={("a",)}, counters="none"))._function(("a",), 0)
    assert _delta(before) == (1, 0)


def test_compile_stats_are_frozen_and_public():
    import dataclasses

    import framekv.ops as ops

    s = ops.compile_stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.compiled = 5
    assert "compile_stats" in ops.__all__ and "CompileStats" in ops.__all__
