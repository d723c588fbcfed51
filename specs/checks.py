"""Argument checks, one module for every floor: each raises a ValueError that names the
argument (or the struct's field), says what it must be and what came.

    fields     ``Owner.field must ...``: the spec structs' checks, run in
               ``__post_init__`` (construction and msgspec decoding alike)
    tensors    ``name: expected ..., got ...``: the op wrappers' checks, on metadata only
               (shape, stride, dtype, device), so they run while torch.compile traces
    arguments  ``name must be ..., got ...``: the runners', schedulers' and commands'
               checks; each returns the value it accepts

torch is imported where a check reads a tensor, so importing the specs (the command
line's parser) needs no torch.
"""
from __future__ import annotations

import numbers
from typing import Any


def _torch():
    import torch

    return torch


# --- fields ---------------------------------------------------------------------------------

def _name(owner: str, field: str) -> str:
    return f"{owner}.{field}" if owner else field


#: Largest size or count a spec takes: device tensors index tokens, pages and rows with
#: 32-bit integers, and a seed shifted into the upper half of a 64-bit one must fit.
SIZE_MAX = 2**31 - 1


def check_int(owner: str, field: str, value: Any, *, minimum: int | None = None,
              maximum: int | None = SIZE_MAX) -> None:
    """Raise ValueError unless ``value`` is an int (not bool) in ``[minimum, maximum]``
    (``maximum`` defaults to `SIZE_MAX`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_name(owner, field)} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{_name(owner, field)} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{_name(owner, field)} must be <= {maximum}, got {value}")


def check_power_of_two(owner: str, field: str, value: Any, *, maximum: int | None = None) -> None:
    """Raise ValueError unless ``value`` is a power of two (1, 2, 4, ...) ``<= maximum``."""
    check_int(owner, field, value, minimum=1)
    if value & (value - 1):
        raise ValueError(f"{_name(owner, field)} must be a power of two, got {value}")
    check_int(owner, field, value, maximum=maximum)


def check_bool(owner: str, field: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a bool (1 and 0 are not accepted)."""
    if not isinstance(value, bool):
        raise ValueError(f"{_name(owner, field)} must be a boolean, got {value!r}")


def check_str(owner: str, field: str, value: Any, *, nonempty: bool = True) -> None:
    """Raise ValueError unless ``value`` is a string, non-blank when ``nonempty``."""
    if not isinstance(value, str):
        raise ValueError(f"{_name(owner, field)} must be a string, got {value!r}")
    if nonempty and not value.strip():
        raise ValueError(f"{_name(owner, field)} must not be empty, got {value!r}")



def check_instance(owner: str, field: str, value: Any, cls: type) -> None:
    """Raise ValueError unless ``value`` is a ``cls`` (nested structs built by hand)."""
    if not isinstance(value, cls):
        raise ValueError(
            f"{_name(owner, field)} must be a {cls.__name__}, got {type(value).__name__}")


def check_int_tuple(owner: str, field: str, value: Any, *, minimum: int | None = None,
                    nonempty: bool = True) -> tuple[int, ...]:
    """Check a sequence of ints and return it as a tuple.

    Entries are named by index, e.g. ``Geometry.causal_block_sizes[1] must be >= 1, got 0``.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise ValueError(
            f"{_name(owner, field)} must be a sequence of integers, got {value!r}")
    if nonempty and len(value) == 0:
        raise ValueError(f"{_name(owner, field)} must hold at least one entry, got {value!r}")
    for i, item in enumerate(value):
        check_int(owner, f"{field}[{i}]", item, minimum=minimum)
    return tuple(value)


def sorted_unique(values: tuple[int, ...]) -> tuple[int, ...]:
    """Sorted without repeats, so that equal sets compare and hash equal."""
    return tuple(sorted(set(values)))


# --- tensors --------------------------------------------------------------------------------

def check_tensor(name: str, value, *, ndims: tuple[int, ...], layout: str = ""):
    """Raise unless ``value`` is a tensor with one of ``ndims`` dimensions."""
    torch = _torch()
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dim() not in ndims:
        want = " or ".join(str(n) for n in ndims)
        shape = f" {layout}" if layout else ""
        raise ValueError(f"{name}: expected {want} dimensions{shape}, "
                         f"got {value.dim()} (shape {tuple(value.shape)})")
    return value


def check_same_device(name: str, value, ref_name: str, ref) -> None:
    """Raise unless ``value`` lives on ``ref``'s device."""
    if value.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} (the device of {ref_name}), "
                         f"got {value.device}")


def check_kv_dtype(name: str, value) -> None:
    """Raise unless ``value``'s dtype can be moved as raw words (1, 2, 4 or 8 bytes)."""
    torch = _torch()
    dt = value.dtype
    if dt == torch.bool or dt.is_complex or dt.itemsize not in (1, 2, 4, 8):
        raise ValueError(f"{name}: expected a real dtype of 1, 2, 4 or 8 bytes "
                         f"(e.g. torch.bfloat16), got {dt}")


def check_last_dim_contiguous(name: str, value) -> None:
    """Raise unless the last dimension (the head dimension) has stride 1."""
    if value.shape[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), "
                         f"got strides {tuple(value.stride())}")


def _span(t) -> tuple[int, int]:
    """[first, last + 1) bytes of a tensor's elements."""
    if t.numel() == 0:
        return 0, 0
    far = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (far + 1) * t.element_size()


def check_disjoint(name: str, value, others) -> None:
    """Raise if written tensor ``value``'s memory span meets that of one of ``others``
    ((name, tensor or None) pairs, read while it is written); spans, so interleaved but
    disjoint views of one buffer are refused too."""
    lo, hi = _span(value)
    for other_name, o in others:
        if o is None:
            continue
        olo, ohi = _span(o)
        if lo < ohi and olo < hi:
            raise ValueError(f"{name}: expected memory apart from {other_name} (it is "
                             f"written while {other_name} is read), got overlapping spans")


def rows_interleaved(a, b) -> bool:
    """Whether [B, M_a, N] and [B, M_b, N] tensors a and b (last dimension contiguous;
    same dtype, row stride s1, batch strides multiples of s1) hold rows at offsets that
    never meet, though their spans do (`check_disjoint` refuses those): their starts are
    N to s1 - N elements apart past a multiple of s1, as the time taps of one
    [B, T, H, W, 3, C] buffer are. A dimension of size 1 has no stride that matters."""
    N, size = a.shape[2], a.element_size()
    long = a if a.shape[1] > 1 else b
    s1 = long.stride(1)
    if a.dtype != b.dtype or long.shape[1] < 2 or (b.data_ptr() - a.data_ptr()) % size:
        return False
    for t in (a, b):
        if (t.shape[1] > 1 and t.stride(1) != s1) or (t.shape[0] > 1 and t.stride(0) % s1):
            return False
    d = (b.data_ptr() - a.data_ptr()) // size % s1
    return N <= d <= s1 - N


def check_no_overlap(name: str, value) -> None:
    """Raise if a written tensor repeats memory (a zero stride over a dimension > 1)."""
    for size, stride in zip(value.shape, value.stride()):
        if size > 1 and stride == 0:
            raise ValueError(f"{name}: expected no zero strides on dimensions of size > 1 "
                             f"(it is written), got shape {tuple(value.shape)} "
                             f"strides {tuple(value.stride())}")


def check_output(name: str, value, dtype, shape: tuple[int, ...], ref_name: str, ref,
                 layout: str = "") -> None:
    """Raise unless ``value`` is a contiguous ``dtype`` tensor of ``shape`` on ``ref``'s
    device (an output a kernel writes row-major, e.g. an fp8 GEMM's operand); a
    contiguous tensor repeats no memory."""
    check_tensor(name, value, ndims=(len(shape),), layout=layout or str(list(shape)))
    if value.dtype != dtype or tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name}: expected a {dtype} tensor of shape {list(shape)}, got "
                         f"{value.dtype} of shape {list(value.shape)}")
    check_same_device(name, value, ref_name, ref)
    if not value.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides "
                         f"{tuple(value.stride())}")


def check_index_list(name: str, value, ref_name: str, ref,
                     length: int | None = None, length_name: str = ""):
    """Raise unless ``value`` is a 1-D int64 tensor on ``ref``'s device, of ``length``."""
    torch = _torch()
    check_tensor(name, value, ndims=(1,), layout="[E]")
    if value.dtype != torch.int64:
        raise ValueError(f"{name}: expected dtype torch.int64, got {value.dtype}")
    check_same_device(name, value, ref_name, ref)
    if length is not None and value.shape[0] != length:
        raise ValueError(f"{name}: expected length {length} ({length_name}), "
                         f"got {value.shape[0]}")
    return value


def check_shift_tensor(name: str, value, ref_name: str, ref) -> None:
    """Raise unless ``value`` is a one-element int32/int64 tensor on ``ref``'s device."""
    torch = _torch()
    if value.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected dtype torch.int32 or torch.int64, got {value.dtype}")
    if value.numel() != 1:
        raise ValueError(f"{name}: expected one element, got {value.numel()} "
                         f"(shape {tuple(value.shape)})")
    check_same_device(name, value, ref_name, ref)


def check_pool_pair(k_pool, v_pool, *, ndims: int, layout: str) -> None:
    """Raise unless k_pool / v_pool are matching writable K/V pools of ``layout``."""
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        check_tensor(name, pool, ndims=(ndims,), layout=layout)
        check_kv_dtype(name, pool)
        check_last_dim_contiguous(name, pool)
        check_no_overlap(name, pool)
    if v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool: expected dtype {k_pool.dtype} (the dtype of k_pool), "
                         f"got {v_pool.dtype}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool: expected shape {tuple(k_pool.shape)} (the shape of "
                         f"k_pool), got {tuple(v_pool.shape)}")
    check_same_device("v_pool", v_pool, "k_pool", k_pool)


# --- arguments ------------------------------------------------------------------------------

def check_flag(name: str, value) -> bool:
    """``value`` if it is a bool, else a ValueError naming ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of ``allowed``, else a ValueError naming ``name``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def check_count(name: str, value) -> int | None:
    """None or an integer >= 1, else a ValueError naming ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
    return value


def check_guidance(g) -> float | None:
    """None or a finite number (the guidance scale)."""
    if g is None:
        return None
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not g == g:
        raise ValueError(f"guidance_scale must be None or a number, got {g!r}")
    return float(g)


def check_batch_sizes(batch_sizes, N: int) -> tuple[int, ...]:
    """Sorted distinct batch sizes, each in [1, N]; default (N,)."""
    if batch_sizes is None:
        return (N,)
    sizes = tuple(sorted(set(batch_sizes))) if isinstance(batch_sizes, (list, tuple)) else ()
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= N
                        for b in sizes):
        raise ValueError(f"batch_sizes must be integers in [1, {N}] (the sequences), "
                         f"got {batch_sizes!r}")
    return sizes


def check_timesteps(timesteps, scale: float) -> list[float]:
    """sigma_i = t_i / scale and a final 0; ValueError unless t decreases in (0, scale]."""
    ts = [float(t) for t in timesteps] if isinstance(timesteps, (tuple, list)) else None
    if not ts or any(not 0 < t <= scale for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
        raise ValueError(f"timesteps must be a decreasing sequence in (0, {scale:g}], "
                         f"got {timesteps!r}")
    return [t / scale for t in ts] + [0.0]


def check_shape(name: str, x, want: tuple[int, ...]) -> None:
    """ValueError unless ``x`` is a tensor of shape ``want``."""
    torch = _torch()
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(want):
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a {list(want)} tensor, got {got}")


def check_finite(name: str, x) -> None:
    """ValueError naming ``name`` unless every value of ``x`` is finite (no NaN, no inf):
    one reduction, read back once."""
    torch = _torch()
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int(finite.numel() - finite.sum())
        raise ValueError(f"{name} must hold finite values only, got {bad} NaN or inf of "
                         f"{finite.numel()}")


def check_frames(name: str, value, count: int) -> list[int]:
    """``value`` as ``count`` host ints >= 0 (a list, tuple or range of integers, or an
    integer tensor or array of ``count`` entries, read once); else a ValueError naming
    ``name``: a float, even a whole one, is refused, never truncated."""
    torch = _torch()
    values = None
    if isinstance(value, (list, tuple, range)):
        values = list(value)
    elif isinstance(value, torch.Tensor) or hasattr(value, "__array__"):
        t = torch.as_tensor(value)
        if t.dim() <= 1 and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            values = t.reshape(-1).tolist()
    if (values is None or len(values) != count
            or any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0
                   for v in values)):
        raise ValueError(f"{name} must be {count} integers >= 0 (host ints or an integer "
                         f"tensor), one per row, got {value!r}")
    return [int(v) for v in values]


def check_text(name: str, value) -> str:
    """``value`` as a text prompt: a string holding at least one character that is not
    white space (an empty or blank prompt would encode as no words at all). Else a
    ValueError naming ``name``."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{name} must hold at least one word (a character other than "
                         f"white space), got {value!r}")
    return value


def check_prompt(name: str, x, shape):
    """``x`` as a [L, D] prompt (given as that, or [1, L, D]) of ``shape`` (L, D), L None
    for any length, with finite floating-point values; or None as it is (a runner's
    default prompt). Else a ValueError naming ``name``, the shape wanted and the one
    given."""
    if x is None:
        return None
    torch = _torch()
    if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    L, D = shape
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != D:
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        n = "L" if L is None else L
        raise ValueError(f"{name} must be a [1, {n}, {D}] tensor (or [{n}, {D}]), got {got}")
    if L is not None and x.shape[0] != L:
        raise ValueError(f"{name} must keep the prompt length of the first set_prompt (or "
                         f"prompt_tokens): {L} tokens, got {x.shape[0]}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    check_finite(name, x)
    return x
