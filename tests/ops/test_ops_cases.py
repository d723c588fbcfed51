"""Case builders shared by the op tests (simulator and GPU); this module holds no tests.

Every tensor is filled with random non-zero bit patterns (stamped data: a slot, row or
layer mix-up changes bits), viewed as the dtype under test; results are compared bit
for bit. A builder is deterministic in its seed, so a test builds a case twice: once
for the op under test, once for the torch reference.
"""
from __future__ import annotations

import torch

_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def random_bits(shape, dtype, gen: torch.Generator, device) -> torch.Tensor:
    """A contiguous tensor of random non-zero bit patterns, as ``dtype``."""
    it = _SAME_SIZE_INT[dtype.itemsize]
    info = torch.iinfo(it)
    t = torch.randint(info.min, info.max, tuple(shape), generator=gen, dtype=it)
    t[t == 0] = 1
    return t.view(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_SAME_SIZE_INT[t.dtype.itemsize])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    a, e = bits(actual), bits(expected)
    if not torch.equal(a, e):
        bad = (a != e).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} elements differ, first at "
                             f"{bad[:5].tolist()}")


def _sprinkle(ids: torch.Tensor, value: int, every: int, start: int) -> torch.Tensor:
    ids = ids.clone()
    ids[start::every] = value
    return ids


# --- scatter_kv_slots -------------------------------------------------------------

def scatter_case(device, dtype, *, T, H, D, slots, kv="contiguous", pool="contiguous",
                 dst2=False, src_rows=False, seed=0):
    """K/V sources, a pool layer and slot lists for ``scatter_kv_slots_``.

    kv: contiguous | fused (slices of a [T, 2H + H + H, D] QKV) | heads_major
        ([H, T, D] transposed) | misaligned (starts one element into a buffer).
    pool: contiguous | permuted ([H, slots, D] transposed) | padded (slot and head
        strides with padding, start one slot in) | kvpair (K and V halves of one
        [slots, 2, H, D] tensor).
    """
    g = torch.Generator().manual_seed(seed)
    rb = lambda *shape: random_bits(shape, dtype, g, device)  # noqa: E731
    if kv == "contiguous":
        k, v = rb(T, H, D), rb(T, H, D)
    elif kv == "fused":
        qkv = rb(T, 4 * H, D)  # [T, Hq + 2 H, D] with Hq = 2 H
        k, v = qkv[:, 2 * H:3 * H], qkv[:, 3 * H:]
    elif kv == "heads_major":
        k, v = rb(H, T, D).transpose(0, 1), rb(H, T, D).transpose(0, 1)
    elif kv == "misaligned":
        k = rb(T * H * D + 1)[1:].view(T, H, D)
        v = rb(T * H * D + 1)[1:].view(T, H, D)
    else:
        raise ValueError(kv)
    if pool == "contiguous":
        k_pool, v_pool = rb(slots, H, D), rb(slots, H, D)
    elif pool == "permuted":
        k_pool, v_pool = rb(H, slots, D).transpose(0, 1), rb(H, slots, D).transpose(0, 1)
    elif pool == "padded":
        k_pool = rb(slots + 1, H + 1, D + 1)[1:, 1:, :D]
        v_pool = rb(slots + 1, H + 1, D + 1)[1:, 1:, :D]
    elif pool == "kvpair":
        both = rb(slots, 2, H, D)
        k_pool, v_pool = both[:, 0], both[:, 1]
    else:
        raise ValueError(pool)
    E = T + 3 if src_rows else T
    need = 2 * E if dst2 else E
    assert slots >= need, "distinct destinations keep the kernel race-free"
    perm = torch.randperm(slots, generator=g)
    lists = {"dst": _sprinkle(perm[:E], -1, 3, 1).to(device)}
    if dst2:
        lists["dst2"] = _sprinkle(perm[E:2 * E], -1, 4, 2).to(device)
    if src_rows:
        rows = torch.randint(0, T, (E,), generator=g)
        rows[0], rows[1], rows[2] = -1, T, T + 7  # outside [0, T): skipped
        lists["src_rows"] = rows.to(device)
    return {"k_pool": k_pool, "v_pool": v_pool, "k": k, "v": v, **lists}


# (dtype, D): the row bytes D * itemsize pick the word size the kernel moves.
WORD_SHAPES = [
    (torch.bfloat16, 8),   # 16 bytes -> 16-byte words
    (torch.bfloat16, 4),   # 8 -> 8
    (torch.bfloat16, 2),   # 4 -> 4
    (torch.bfloat16, 3),   # 6 -> 2
    (torch.float16, 6),    # 12 -> 4
    (torch.float32, 4),    # 16 -> 16
    (torch.float32, 3),    # 12 -> 4
    (torch.float32, 1),    # 4 -> 4
    (torch.int8, 5),       # 5 -> 1
    (torch.float64, 2),    # 16 -> 16
]

# (kv, pool, dst2, src_rows)
LAYOUTS = [
    ("contiguous", "contiguous", False, False),
    ("fused", "contiguous", True, False),
    ("fused", "permuted", True, True),
    ("heads_major", "padded", False, True),
    ("misaligned", "kvpair", True, True),
    ("contiguous", "kvpair", False, True),
]


def scatter_params():
    """(dtype, D, kv, pool, dst2, src_rows): every word shape once, every layout on
    bf16 at 16-byte words and on one odd word size."""
    out = [(dt, D, "fused", "contiguous", True, True) for dt, D in WORD_SHAPES]
    for dt, D in ((torch.bfloat16, 8), (torch.bfloat16, 3)):
        out += [(dt, D, *layout) for layout in LAYOUTS]
    return out


# --- copy_kv_slots ----------------------------------------------------------------

def copy_case(device, dtype, *, L, slots, H, D, pool="contiguous", seed=0):
    """A pool and slot lists for ``copy_kv_slots_``: distinct sources and destinations
    (race-free), a few src == dst entries and sentinels in either list.

    pool: contiguous | layer_strided ([slots, L, H, D] transposed) | padded (padding on
        slot, head and D; start one slot in) | kvpair (K and V halves of one tensor).
    """
    g = torch.Generator().manual_seed(seed)
    rb = lambda *shape: random_bits(shape, dtype, g, device)  # noqa: E731
    if pool == "contiguous":
        k_pool, v_pool = rb(L, slots, H, D), rb(L, slots, H, D)
    elif pool == "layer_strided":
        k_pool = rb(slots, L, H, D).transpose(0, 1)
        v_pool = rb(slots, L, H, D).transpose(0, 1)
    elif pool == "padded":
        k_pool = rb(L, slots + 1, H + 1, D + 2)[:, 1:, 1:, :D]
        v_pool = rb(L, slots + 1, H + 1, D + 2)[:, 1:, 1:, :D]
    elif pool == "kvpair":
        both = rb(L, slots, 2, H, D)
        k_pool, v_pool = both[:, :, 0], both[:, :, 1]
    else:
        raise ValueError(pool)
    n = slots // 3
    perm = torch.randperm(slots, generator=g)
    src, dst = perm[:n].clone(), perm[n:2 * n].clone()
    same = perm[2 * n:2 * n + 2]
    src = torch.cat([src, same, torch.tensor([-1, 5, -1])])
    dst = torch.cat([dst, same, torch.tensor([3, -1, -1])])
    src[1] = -1
    return {"k_pool": k_pool, "v_pool": v_pool, "src": src.to(device), "dst": dst.to(device)}


COPY_PARAMS = [  # (dtype, D, pool)
    (torch.bfloat16, 8, "contiguous"),
    (torch.bfloat16, 8, "layer_strided"),
    (torch.bfloat16, 3, "padded"),
    (torch.float16, 4, "kvpair"),
    (torch.float32, 2, "layer_strided"),
    (torch.float32, 3, "contiguous"),
    (torch.int8, 7, "contiguous"),
]


# --- rotate_rows ------------------------------------------------------------------

def rotate_case(device, dtype, *, shape, layout="contiguous", seed=0) -> torch.Tensor:
    """Rows to rotate. layout: contiguous | strided_rows (every other column of a wider
    buffer, so elements are 2 apart) | transposed (elements a full row apart) | offset
    (a window inside a larger buffer)."""
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    full = lambda *s: torch.randint(info.min, info.max, s, generator=g,  # noqa: E731
                                    dtype=dtype).to(device)
    if layout == "contiguous":
        return full(*shape)
    if layout == "strided_rows":
        return full(*shape[:-1], 2 * shape[-1])[..., ::2]
    if layout == "transposed":
        assert len(shape) == 2
        return full(shape[1], shape[0]).t()
    if layout == "offset":
        assert len(shape) == 2
        return full(shape[0] + 3, shape[1] + 5)[2:2 + shape[0], 1:1 + shape[1]]
    raise ValueError(layout)


ROTATE_SHIFTS = [0, 1, -1, 5, -6, 13, 2 ** 62 + 3, -(2 ** 62) - 5]
