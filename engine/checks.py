"""Argument checks the runners share: each returns the value it accepts, or raises a
ValueError naming the argument, what it must be and what it got."""
from __future__ import annotations

import numbers

import torch


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
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(want):
        got = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a {list(want)} tensor, got {got}")


def check_finite(name: str, x: torch.Tensor) -> None:
    """ValueError naming ``name`` unless every value of ``x`` is finite (no NaN, no inf):
    one reduction, read back once."""
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int(finite.numel() - finite.sum())
        raise ValueError(f"{name} must hold finite values only, got {bad} NaN or inf of "
                         f"{finite.numel()}")


def check_frames(name: str, value, count: int) -> list[int]:
    """``value`` as ``count`` host ints >= 0 (a list, tuple or range of integers, or an
    integer tensor or array of ``count`` entries, read once); else a ValueError naming
    ``name``: a float, even a whole one, is refused, never truncated."""
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


def check_prompt(name: str, x, shape) -> torch.Tensor | None:
    """``x`` as a [L, D] prompt of ``shape`` (given as that, or [1, L, D]) with finite
    floating-point values, or None as it is (a runner's default prompt); else a
    ValueError naming ``name``, the shape wanted and the one given."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] == 1:
        x = x[0]
    check_shape(name, x, tuple(shape))
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    check_finite(name, x)
    return x
