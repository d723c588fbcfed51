"""``causal_layout_``: rebuild every per-block tensor of a geometry from the device state.

At commit the exact-window layout (DESIGN.md, "The cache") of every causal block of
every declared block size changes: which pages a block reads in full, which positions
of its (at most three) partly visible pages it gets private copies of, where its own
tokens go. This op recomputes all of it from (C = counters[0], ring_base = counters[1],
table) in one launch, so a commit reads only device memory and replays from a graph.

Flat format (one descriptor row per declared block size, sizes in increasing order)::

    desc  int64 [S, 12]: b, nb, row_pages, private_pages (Q), committed_len,
          current_len, private_base, rows_off, blocks_off, staged_off, staged_len,
          committed_off
    rows        int32 [sum nb*row_pages]  size s at rows_off, row-major [nb, row_pages]
    seq_len_kv  int32 [sum nb]            size s at blocks_off
    staged_src, staged_dst, staged_dst2   int64 [sum staged_len], size s at staged_off:
                entry i < M: forward row i -> shared slot, private slot (i < nb*b, else -1)
                M + j*current_len + k: current_private copy (row x - C, private slot, -1)
    committed_src, committed_dst          int64 [sum nb*committed_len], size s at
                committed_off + j*committed_len + k: committed_private copy (slot, slot)

Block j of size b starts at s = C + j*b and sees V'(j) = [0, v0) U [u1, s) before its
own tokens. Its row: the logical pages wholly inside V'(j) (table order), its Q private
pages (physical private_base + j*Q + q), then the last private page as padding. Its
partial positions, in increasing order, come from three segments: the tail
[fv0*tpp, v0) of the first interval, the head [u1, min(s, cu1*tpp)) and the tail
[fv1*tpp, s) of the second; the k-th goes to private slot k, committed ones (x < C)
first. Unused entries are -1.

Kernel: one CTA per (block size, block), grid-stride; the CTA finds its size by
scanning desc (S is tiny) and its threads split the row entries, own tokens and
partial positions. Every entry of every output is rewritten on each launch.

One file: one op, as every op of this package is (kernel, reference, validating
wrapper, custom op); the kernel and the reference are two independent codings of the
layout rule, kept side by side so that they are read together.
"""
from __future__ import annotations

import operator

import numpy as np
import torch
from numba import cuda

from . import _launch
from ._launch import Kernel, array_arg, blocks_for, int_arg, use_kernel
from framekv.specs.checks import check_same_device, check_tensor
from .advance_commit import check_counters, check_int, check_page_args

__all__ = ["causal_layout_", "causal_layout_reference", "DESC_COLUMNS"]

#: The descriptor's format, defined here once: column names in order. The engine's
#: ``LayoutPlan.descriptor`` fills rows by these names; ``_check_desc`` checks them.
DESC_COLUMNS = ("b", "nb", "row_pages", "private_pages", "committed_len", "current_len",
                "private_base", "rows_off", "blocks_off", "staged_off", "staged_len",
                "committed_off")
(_B, _NB, _RP, _Q, _CL, _RL, _PBASE, _ROFF, _BOFF, _SOFF, _SLEN, _COFF) = range(12)
_THREADS = 128

# --------------------------------------------------------------------------- kernel


@cuda.jit(device=True)
def _page(table, p, fixed, ring_base):
    # Physical page of logical page p: fixed pages map directly, the ring by offset.
    if p < fixed:
        return table[p]
    return table[fixed + p - ring_base]


@cuda.jit(device=True)
def _slot(table, x, tpp, fixed, ring_base):
    p = x // tpp
    return _page(table, p, fixed, ring_base) * tpp + (x - p * tpp)


@cuda.jit(device=True)
def _intervals(s, pin, window, tpp):
    # V'(j) = [0, v0) U [u1, s): full pages [0, fv0) and [cu1, fv1). When the window
    # reaches the fixed region the union is [0, s), so no page counts as two partials.
    a = min(pin, s)
    lo = max(pin, s - window)
    v0 = a
    u1 = min(lo, s)
    if lo <= a:
        v0 = s
        u1 = s
    cu1 = (u1 + tpp - 1) // tpp
    return v0 // tpp, v0, u1, cu1, max(cu1, s // tpp)


@cuda.jit(device=True)
def _nth_partial(k, a0, na, u1, nb_, c0):
    # k-th partial position: segments [a0, a0+na), [u1, u1+nb_), [c0, ...) in order.
    if k < na:
        return a0 + k
    if k < na + nb_:
        return u1 + k - na
    return c0 + k - na - nb_


@cuda.jit(device=True)
def _below(lo, n, c):
    # Positions of [lo, lo + n) below c.
    return max(0, min(lo + n, c) - lo)


@cuda.jit(device=True)
def _write_row(rows, table, desc, d, j, fv0, cu1, n_full, fixed, ring_base):
    rp, q = desc[d, _RP], desc[d, _Q]
    page0 = desc[d, _PBASE] + j * q
    base = desc[d, _ROFF] + j * rp
    for r in range(cuda.threadIdx.x, rp, cuda.blockDim.x):
        if r < n_full:
            p = r if r < fv0 else cu1 + r - fv0
            rows[base + r] = _page(table, p, fixed, ring_base)
        else:  # private pages, then the last one again as padding
            rows[base + r] = page0 + min(r - n_full, q - 1)


@cuda.jit(device=True)
def _write_own(staged_src, staged_dst, staged_dst2, table, desc, d, j, s, slot0,
               n_partial, max_staged, tpp, fixed, ring_base):
    b, off = desc[d, _B], desc[d, _SOFF]
    for t in range(cuda.threadIdx.x, b, cuda.blockDim.x):
        i = j * b + t
        staged_src[off + i] = i
        staged_dst[off + i] = _slot(table, s + t, tpp, fixed, ring_base)
        staged_dst2[off + i] = slot0 + n_partial + t
    if j == 0:  # rows [nb*b, M) belong to no block (T <= nb*b)
        for i in range(desc[d, _NB] * b + cuda.threadIdx.x, max_staged, cuda.blockDim.x):
            staged_src[off + i] = -1
            staged_dst[off + i] = -1
            staged_dst2[off + i] = -1


@cuda.jit(device=True)
def _write_copies(committed_src, committed_dst, staged_src, staged_dst, staged_dst2, table,
                  desc, d, j, c, slot0, a0, na, u1, nb_, c0, n_com, n_partial, max_staged,
                  tpp, fixed, ring_base):
    # Partial position k goes to private slot slot0 + k; committed ones (x < c) come
    # first in position order, so k < n_com are committed copies, the rest current.
    cl = desc[d, _CL]
    for k in range(cuda.threadIdx.x, cl, cuda.blockDim.x):
        e = desc[d, _COFF] + j * cl + k
        if k < n_com:
            x = _nth_partial(k, a0, na, u1, nb_, c0)
            committed_src[e] = _slot(table, x, tpp, fixed, ring_base)
            committed_dst[e] = slot0 + k
        else:
            committed_src[e] = -1
            committed_dst[e] = -1
    rl = desc[d, _RL]
    for m in range(cuda.threadIdx.x, rl, cuda.blockDim.x):
        e = desc[d, _SOFF] + max_staged + j * rl + m
        k = n_com + m
        staged_dst2[e] = -1
        if k < n_partial:  # source: the forward's row of position x
            staged_src[e] = _nth_partial(k, a0, na, u1, nb_, c0) - c
            staged_dst[e] = slot0 + k
        else:
            staged_src[e] = -1
            staged_dst[e] = -1


@cuda.jit
def _causal_layout_kernel(counters, table, desc, rows, seq_len_kv, staged_src, staged_dst,
                          staged_dst2, committed_src, committed_dst, pin, window,
                          max_staged, tpp, fixed):
    # counters [4] int64; table [F+R] int64; desc [S, 12] int64; rows, seq_len_kv int32;
    # staged_* [sum staged_len], committed_* [sum nb*committed_len] int64.
    c = counters[0]
    ring_base = counters[1]
    for cta in range(cuda.blockIdx.x, seq_len_kv.shape[0], cuda.gridDim.x):
        d = 0
        for r in range(1, desc.shape[0]):
            if desc[r, _BOFF] <= cta:
                d = r
        j = cta - desc[d, _BOFF]
        s = c + j * desc[d, _B]
        fv0, v0, u1, cu1, fv1 = _intervals(s, pin, window, tpp)
        n_full = fv0 + fv1 - cu1
        na = v0 - fv0 * tpp
        nb_ = max(0, min(s, cu1 * tpp) - u1)
        nc = max(0, s - fv1 * tpp)
        n_partial = na + nb_ + nc
        n_com = _below(fv0 * tpp, na, c) + _below(u1, nb_, c) + _below(fv1 * tpp, nc, c)
        slot0 = (desc[d, _PBASE] + j * desc[d, _Q]) * tpp
        _write_row(rows, table, desc, d, j, fv0, cu1, n_full, fixed, ring_base)
        if cuda.threadIdx.x == 0:
            seq_len_kv[cta] = n_full * tpp + n_partial + desc[d, _B]
        _write_own(staged_src, staged_dst, staged_dst2, table, desc, d, j, s, slot0,
                   n_partial, max_staged, tpp, fixed, ring_base)
        _write_copies(committed_src, committed_dst, staged_src, staged_dst, staged_dst2,
                      table, desc, d, j, c, slot0, fv0 * tpp, na, u1, nb_, fv1 * tpp,
                      n_com, n_partial, max_staged, tpp, fixed, ring_base)


_KERNEL = Kernel(_causal_layout_kernel)

# --------------------------------------------------------------------------- reference

_STAGED = ("staged_src", "staged_dst", "staged_dst2")
_COMMITTED = ("committed_src", "committed_dst")
_OUTPUTS = ("rows", "seq_len_kv") + _STAGED + _COMMITTED


def _visible_pages(P: int, W: int, tpp: int, s: int) -> tuple[list[int], list[int]]:
    """Logical full pages and partial positions of V'(j), both increasing.

    V'(j) = [0, min(P, s)) U [max(P, s - W), s), one interval [0, s) when the window
    reaches the fixed region. Each interval is cut into a head (before its first
    whole page), whole pages and a tail (after them); heads and tails are partial.
    """
    a, lo = min(P, s), max(P, s - W)
    intervals = ((0, s),) if lo <= a else ((0, a), (min(lo, s), s))
    full: list[int] = []
    partial: list[int] = []
    for u, v in intervals:
        cu = -(-u // tpp)              # first page starting at or after u
        fv = max(cu, v // tpp)         # end of the whole pages
        partial.extend(range(u, min(v, cu * tpp)))
        full.extend(range(cu, fv))
        partial.extend(range(fv * tpp, v))
    return full, partial


class _State:
    """(C, ring_base, table) and the geometry's integers: page and slot lookups."""

    def __init__(self, C, ring_base, table, P, W, M, tpp, F, R):
        self.C, self.ring_base, self.table = C, ring_base, table
        self.P, self.W, self.M, self.tpp, self.F, self.R = P, W, M, tpp, F, R

    def page(self, p: int) -> int:
        if p < self.F:
            return int(self.table[p])
        i = p - self.ring_base
        assert 0 <= i < self.R, (p, self.ring_base)
        return int(self.table[self.F + i])

    def slot(self, x: int) -> int:
        return self.page(x // self.tpp) * self.tpp + x % self.tpp

    def resident(self, x: int) -> bool:
        return 0 <= x < self.P or max(self.P, self.C - self.W) <= x < self.C + self.M


def _fill(out: dict, names, off: int, length: int, entries: list) -> None:
    """Write ``entries`` (tuples over ``names``) at [off, off + length), -1 padded."""
    assert len(entries) <= length, (names, len(entries), length)
    pad = [-1] * (length - len(entries))
    for c, name in enumerate(names):
        out[name][off:off + length] = [e[c] for e in entries] + pad


def _reference_block(st: _State, out: dict, d, j: int) -> None:
    """Block j of the size of descriptor row ``d``: what one kernel CTA writes."""
    b, nb, rp, q, cl, rl, pbase, roff, boff, soff, _, coff = (int(v) for v in d)
    C, tpp = st.C, st.tpp
    s = C + j * b
    full, partial = _visible_pages(st.P, st.W, tpp, s)
    assert len(full) <= (st.P + st.W) // tpp and len(partial) <= cl, (s, full, partial)
    assert all(st.resident(p * tpp) and st.resident(p * tpp + tpp - 1) for p in full), s
    assert all(st.resident(x) for x in partial), (s, partial)
    page0 = pbase + j * q
    row = [st.page(p) for p in full] + list(range(page0, page0 + q))
    out["rows"][roff + j * rp:roff + (j + 1) * rp] = row + [page0 + q - 1] * (rp - len(row))
    out["seq_len_kv"][boff + j] = len(full) * tpp + len(partial) + b
    slot0 = page0 * tpp  # private slots are contiguous across the block's pages
    com = [(st.slot(x), slot0 + k) for k, x in enumerate(partial) if x < C]
    cur = [(x - C, slot0 + k, -1) for k, x in enumerate(partial) if x >= C]
    _fill(out, _COMMITTED, coff + j * cl, cl, com)
    _fill(out, _STAGED, soff + st.M + j * rl, rl, cur)
    own = [(i, st.slot(C + i), slot0 + len(partial) + i - j * b)
           for i in range(j * b, (j + 1) * b)]
    _fill(out, _STAGED, soff + j * b, b, own)


def _reference_numpy(st: _State, desc: np.ndarray, out: dict) -> None:
    for d in desc:
        b, nb, soff = int(d[_B]), int(d[_NB]), int(d[_SOFF])
        for j in range(nb):
            _reference_block(st, out, d, j)
        for name in _STAGED:  # rows [nb*b, M) belong to no block
            out[name][soff + nb * b:soff + st.M] = -1


def causal_layout_reference(counters, table, desc, rows, seq_len_kv, staged_src,
                            staged_dst, staged_dst2, committed_src, committed_dst, *,
                            pin_tokens: int, window_tokens: int, max_staged_tokens: int,
                            tokens_per_page: int, fixed_pages: int, ring_pages: int) -> None:
    """Reference of :func:`causal_layout_` (same arguments, in place): a plain loop over
    blocks, enumerating each block's full pages and partial positions. Used on CPU,
    by tests and by the host model's looped builder; on CUDA it copies through the
    host (synchronises). Asserts that every position it reads is resident."""
    tensors = dict(zip(_OUTPUTS, (rows, seq_len_kv, staged_src, staged_dst, staged_dst2,
                                  committed_src, committed_dst)))
    host = {name: t.detach().cpu() for name, t in tensors.items()}  # CPU: the same tensor
    c = counters.detach().cpu()
    st = _State(int(c[0]), int(c[1]), table.detach().cpu().numpy(), pin_tokens,
                window_tokens, max_staged_tokens, tokens_per_page, fixed_pages, ring_pages)
    _reference_numpy(st, desc.detach().cpu().numpy(),
                     {name: t.numpy() for name, t in host.items()})
    for name, t in tensors.items():
        if t.device.type != "cpu":
            t.copy_(host[name])


# --------------------------------------------------------------------------- checks

def _check_flat(name: str, t, dtype: torch.dtype, counters: torch.Tensor) -> None:
    check_tensor(name, t, ndims=(1,), layout="[n]")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    check_same_device(name, t, "counters", counters)
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(t.stride())}")


def _check_tensors(counters, table, desc, outs: dict) -> None:
    check_counters(counters)
    _check_flat("table", table, torch.int64, counters)
    check_tensor("desc", desc, ndims=(2,), layout=f"[S, {len(DESC_COLUMNS)}]")
    if desc.shape[0] < 1 or desc.shape[1] != len(DESC_COLUMNS):
        raise ValueError(f"desc: expected shape [S >= 1, {len(DESC_COLUMNS)}], "
                         f"got {list(desc.shape)}")
    if desc.dtype != torch.int64:
        raise ValueError(f"desc: expected dtype torch.int64, got {desc.dtype}")
    check_same_device("desc", desc, "counters", counters)
    if not desc.is_contiguous():
        raise ValueError(f"desc: expected a contiguous tensor, got strides {tuple(desc.stride())}")
    for name, t in outs.items():
        _check_flat(name, t, torch.int32 if name in ("rows", "seq_len_kv") else torch.int64,
                    counters)
    for name, ref in (("staged_dst", "staged_src"), ("staged_dst2", "staged_src"),
                      ("committed_dst", "committed_src")):
        if outs[name].shape[0] != outs[ref].shape[0]:
            raise ValueError(f"{name}: expected length {outs[ref].shape[0]} (the length of "
                             f"{ref}), got {outs[name].shape[0]}")


def _check_scalars(table, P, W, M, tpp, F, R) -> None:
    check_int("pin_tokens", P)
    check_int("window_tokens", W)
    check_int("max_staged_tokens", M, 1)
    check_page_args(P, tpp, F)
    check_int("ring_pages", R, 1)
    if table.shape[0] != F + R:
        raise ValueError(f"table: expected length fixed_pages + ring_pages = {F + R}, "
                         f"got {table.shape[0]}")


def _needs(d, P, W, M, tpp) -> dict[int, int]:
    """Least value of each size column that keeps the kernel's writes inside its row,
    private pages and list slots for a block of size d[_B]: at most 3 * (tpp - 1)
    partial positions, (P + W) // tpp full pages, block j seeing j * b staged tokens."""
    b, nb = int(d[_B]), int(d[_NB])
    partial = 3 * (tpp - 1)
    q = -(-(partial + b) // tpp)
    return {_NB: 1, _Q: q, _RP: (P + W) // tpp + int(d[_Q]), _CL: partial,
            _RL: min(partial, (nb - 1) * b)}


def _check_desc(desc: np.ndarray, outs: dict, P, W, M, tpp, F, R) -> None:
    """Descriptor contents (host memory only) against what the kernel needs: sizes large
    enough for every write, offsets and lengths that tile the flat outputs, private
    pages after the table's and disjoint. The values themselves are the caller's (the
    engine's ``LayoutPlan`` defines them)."""
    sizes = desc[:, _B]
    if (sizes < 1).any() or (sizes > M).any() or (np.diff(sizes) <= 0).any():
        raise ValueError(f"desc: column b must hold increasing block sizes in "
                         f"[1, max_staged_tokens={M}], got {sizes.tolist()}")
    off = [0, 0, 0, 0]  # rows, blocks, staged, committed
    for i, d in enumerate(desc):
        if d[_NB] * d[_B] > M:
            raise ValueError(f"desc: row {i}: nb * b must be <= max_staged_tokens={M}, "
                             f"got {d[_NB]} * {d[_B]}")
        for col, least in _needs(d, P, W, M, tpp).items():
            if d[col] < least:
                raise ValueError(f"desc: row {i} column {DESC_COLUMNS[col]}: expected >= "
                                 f"{least} (what the kernel writes for b={d[_B]} at pin_tokens="
                                 f"{P}, window_tokens={W}, tokens_per_page={tpp}), got {d[col]}")
        exact = {_ROFF: off[0], _BOFF: off[1], _SOFF: off[2], _COFF: off[3],
                 _SLEN: M + d[_NB] * d[_RL]}
        for col, want in exact.items():
            if d[col] != want:
                raise ValueError(f"desc: row {i} column {DESC_COLUMNS[col]}: expected {want} "
                                 f"(rows tile the flat outputs in order; staged_len = "
                                 f"max_staged_tokens={M} + nb * current_len), got {d[col]}")
        off = [off[0] + d[_NB] * d[_RP], off[1] + d[_NB], off[2] + d[_SLEN],
               off[3] + d[_NB] * d[_CL]]
    _check_private_pages(desc, F + R)
    for name, total in zip(("rows", "seq_len_kv", "staged_src", "committed_src"), off):
        if outs[name].shape[0] != total:
            raise ValueError(f"{name}: expected length {total} (from desc), "
                             f"got {outs[name].shape[0]}")


def _check_private_pages(desc: np.ndarray, end: int) -> None:
    """Private pages follow the table's pages and never overlap each other."""
    for i in np.argsort(desc[:, _PBASE], kind="stable"):
        if desc[i, _PBASE] < end:
            raise ValueError(f"desc: row {i} private_base {desc[i, _PBASE]} overlaps the "
                             f"table's pages or another size's private pages (< {end})")
        end = desc[i, _PBASE] + desc[i, _NB] * desc[i, _Q]


# --------------------------------------------------------------------------- op

def _run(counters, table, desc, outs: list, scalars: list) -> None:
    if not use_kernel(counters):
        kw = dict(zip(("pin_tokens", "window_tokens", "max_staged_tokens", "tokens_per_page",
                       "fixed_pages", "ring_pages"), scalars))
        causal_layout_reference(counters, table, desc, *outs, **kw)
        return
    P, W, M, tpp, F, _ = scalars
    args = [array_arg(t) for t in (counters, table, desc, *outs)]
    args += [int_arg(v) for v in (P, W, M, tpp, F)]
    grid = blocks_for(outs[1].shape[0])  # one CTA per block of every size
    _KERNEL.launch(grid, min(_THREADS, _launch.MAX_THREADS), args, counters.device)


@torch.library.custom_op("framekv::causal_layout_", mutates_args=_OUTPUTS)
def _causal_layout_op(counters: torch.Tensor, table: torch.Tensor, desc: torch.Tensor,
                      rows: torch.Tensor, seq_len_kv: torch.Tensor, staged_src: torch.Tensor,
                      staged_dst: torch.Tensor, staged_dst2: torch.Tensor,
                      committed_src: torch.Tensor, committed_dst: torch.Tensor,
                      pin_tokens: int, window_tokens: int, max_staged_tokens: int,
                      tokens_per_page: int, fixed_pages: int, ring_pages: int) -> None:
    _run(counters, table, desc,
         [rows, seq_len_kv, staged_src, staged_dst, staged_dst2, committed_src, committed_dst],
         [pin_tokens, window_tokens, max_staged_tokens, tokens_per_page, fixed_pages,
          ring_pages])


@_causal_layout_op.register_fake
def _(counters, table, desc, rows, seq_len_kv, staged_src, staged_dst, staged_dst2,
      committed_src, committed_dst, pin_tokens, window_tokens, max_staged_tokens,
      tokens_per_page, fixed_pages, ring_pages) -> None:
    return None


def causal_layout_(counters, table, desc, rows, seq_len_kv, staged_src, staged_dst,
                   staged_dst2, committed_src, committed_dst, *, pin_tokens: int,
                   window_tokens: int, max_staged_tokens: int, tokens_per_page: int,
                   fixed_pages: int, ring_pages: int) -> None:
    """Rewrite every per-block tensor of a geometry in place from the device state.

    Args:
        counters: int64 [4]; reads C = counters[0] and ring_base = counters[1].
        table: int64 [F + R] page table: logical page p < F at table[p], ring logical
            page p at table[F + p - ring_base].
        desc: int64 [S, 12], one row per declared block size (module docstring).
        rows, seq_len_kv: int32 flat outputs; staged_src/staged_dst/staged_dst2 and
            committed_src/committed_dst: int64 flat outputs (module docstring).
            seq_len_q is constant (= b) and not part of the op.
        pin_tokens P, window_tokens W, max_staged_tokens M: the geometry.
        tokens_per_page: tpp, a power of two. fixed_pages: ceil(P / tpp).
        ring_pages: R, entries of the ring part of the table.

    Every tensor must be contiguous and on counters' device. desc's contents are
    checked against the geometry and the output lengths when desc is in host memory
    (and not while torch.compile traces). On CUDA reading them would synchronise, so
    there desc, counters and table are the caller's responsibility: the kernel trusts
    them (the ring must hold every page it looks up) and does not range-check the ids
    it reads or writes. Raises ValueError
    naming the bad argument. On CUDA one kernel on torch's current stream (no sync,
    capturable); on CPU the reference.
    """
    outs = dict(zip(_OUTPUTS, (rows, seq_len_kv, staged_src, staged_dst, staged_dst2,
                               committed_src, committed_dst)))
    _check_tensors(counters, table, desc, outs)
    scalars = [pin_tokens, window_tokens, max_staged_tokens, tokens_per_page, fixed_pages,
               ring_pages]
    _check_scalars(table, *scalars)
    scalars = [operator.index(v) for v in scalars]
    if desc.device.type == "cpu" and not torch.compiler.is_compiling():  # no data to read
        _check_desc(desc.numpy(), outs, *scalars)
    _causal_layout_op(counters, table, desc, *outs.values(), *scalars)
