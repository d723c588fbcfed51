"""Validation helpers shared by the spec structs.

Every message names the field, the rule and the value, e.g.
``ModelSpec.tokens_per_page must be a power of two, got 48``. The structs call these
from ``__post_init__``, which runs both on construction and on msgspec decoding, so
a file and a constructor call are held to the same rules.
"""
from __future__ import annotations

from typing import Any


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


def check_choice(owner: str, field: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``; the message lists them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(
            f"{_name(owner, field)} must be one of {', '.join(choices)}, got {value!r}")


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
