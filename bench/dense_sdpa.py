"""Dense torch SDPA baselines of one layer's attention (rows of `framekv.bench.attention`).

Each builder takes the section's `Setup` (a full window's fp32 record, the chunk's
packed QKV on the GPU) and returns name -> (callable, block size) and notes:

    dense_variants   the denoising forward (the chunk one block): sdpa-cudnn over a
                     contiguous buffer of exactly the visible keys, concat-sdpa,
                     sdpa-flash
    clean_variants   the clean pass (one-frame blocks): sdpa-clean-blocks (one call per
                     block over its own buffer), sdpa-clean-masked (one masked call)

Every callable includes its K/V write (the chunk's tokens copied into the buffers'
tails) and returns [T, H, D].
"""
from __future__ import annotations

import numpy as np
import torch

from framekv import specs
from framekv.engine.cache.reference import visible_positions

#: What a masked-out key adds to its score. Finite, as in torch's own conversion of a
#: boolean mask for cuDNN (-inf there has given NaN); every row sees its own block, so
#: no row is masked whole and the softmax never sees only this value.
MASK_FILL = -65504.0


def block_positions(geometry: specs.Geometry, committed: int, tokens: int,
                    b: int) -> list[np.ndarray]:
    """V(j) of each block of ``b`` of a forward of ``tokens`` at ``committed`` positions."""
    return [visible_positions(geometry, committed, committed + j * b, b)
            for j in range(tokens // b)]


def block_mask(columns: np.ndarray, blocks: list[np.ndarray], b: int) -> torch.Tensor:
    """Boolean [len(blocks) * b, len(columns)] mask, True = attend: the rows of block j
    (j*b to j*b + b - 1) are True exactly at the columns holding V(j).

    ``columns``: the sorted positions a key buffer holds, one per column; ``blocks``: the
    visible positions of each block (`block_positions`). ValueError when a block sees a
    position the buffer does not hold.
    """
    mask = torch.zeros(len(blocks) * b, len(columns), dtype=torch.bool)
    for j, pos in enumerate(blocks):
        col = np.searchsorted(columns, pos)
        if not (col < len(columns)).all() or not np.array_equal(columns[col], pos):
            missing = np.setdiff1d(pos, columns)
            raise ValueError(f"block {j} sees positions the buffer does not hold: "
                             f"{missing[:8].tolist()}")
        mask[j * b:(j + 1) * b, torch.as_tensor(col)] = True
    return mask


def additive_mask(mask: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """The boolean [T, keys] ``mask`` as SDPA's additive [1, 1, T, keys] mask: 0 where it
    is True, `MASK_FILL` elsewhere.

    Given a boolean mask, torch builds this tensor inside every SDPA call (a pass over
    T x keys that would be timed with the attention); built once here, the timed call
    holds the write and the attention only. Rows start at multiples of 8 elements, the
    alignment under which the efficient backend takes the mask as it is (no padded copy).
    """
    t, n = mask.shape
    out = torch.full((1, 1, t, -(-n // 8) * 8), MASK_FILL, dtype=dtype, device=device)
    out[0, 0, :, :n].masked_fill_(mask.to(device), 0.0)
    return out[..., :n]


def tail_tokens(pos: np.ndarray, committed: int, end: int) -> int:
    """How many of the forward's own tokens a block's visible positions ``pos`` end with:
    n such that ``pos`` ends with [end - n, end) and holds nothing else at or past
    ``committed`` (the tokens a dense buffer of ``pos`` rewrites in its tail per forward).
    ValueError when the forward's tokens in ``pos`` are not that run."""
    n = int((pos >= committed).sum())
    if not np.array_equal(pos[len(pos) - n:], np.arange(end - n, end)):
        raise ValueError(f"the positions at or past {committed} are not the run ending at {end}")
    return n


def _sdpa(backend, q, k, v, scale: float, mask=None) -> torch.Tensor:
    """torch SDPA on one backend: q [1, H, n, D], k and v [1, H_kv or H, keys, D],
    ``mask`` None or additive [1, 1, n, keys]; [1, H, n, D]."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([backend]):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def _in_place(st, backend, k: torch.Tensor, v: torch.Tensor, mask=None):
    """The timed call over a contiguous buffer k, v ([1, H_kv or H, keys, D], the chunk's
    tokens last): the chunk's K/V copied into its tail, then SDPA of all T queries."""
    group = k.shape[1] // st.HKV  # 1, or H / H_kv when K/V were expanded
    tail = slice(k.shape[2] - st.T, k.shape[2])
    qd = st.q.transpose(0, 1)[None]                                   # [1, H, T, D]
    new_k, new_v = (x.transpose(0, 1)[None] for x in (st.k_new, st.v_new))  # [1, H_kv, T, D]

    def run():
        k[0, :, tail].copy_(new_k[0].repeat_interleave(group, 0))
        v[0, :, tail].copy_(new_v[0].repeat_interleave(group, 0))
        return _sdpa(backend, qd, k, v, st.scale, mask)[0].transpose(0, 1)  # [T, H, D]
    return run


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:80]


def dense_variants(st) -> tuple[dict, dict]:
    """name -> (callable, block size) of the dense baselines of the denoising forward
    (the chunk one block), and notes."""
    from torch.nn.attention import SDPBackend

    kd, vd = st.dense_kv()
    qd = st.q.transpose(0, 1)[None]                                   # [1, H, T, D]
    hist = st.keys - st.T
    hist_k, hist_v = kd[:, :, :hist].clone(), vd[:, :, :hist].clone()
    new_k, new_v = (x.transpose(0, 1)[None] for x in (st.k_new, st.v_new))  # [1, H_kv, T, D]

    def concat():
        out = _sdpa(SDPBackend.CUDNN_ATTENTION, qd, torch.cat([hist_k, new_k], 2),
                    torch.cat([hist_v, new_v], 2), st.scale)
        return out[0].transpose(0, 1)                                 # [T, H, D]

    out, notes = {"sdpa-cudnn": (_in_place(st, SDPBackend.CUDNN_ATTENTION, kd, vd), st.T),
                  "concat-sdpa": (concat, st.T)}, {}
    flash = _in_place(st, SDPBackend.FLASH_ATTENTION, kd.clone(), vd.clone())
    try:
        flash()
    except RuntimeError as e:
        notes["sdpa-flash"] = (f"GQA refused ({_first_line(e)}); K/V expanded to "
                               f"{st.H} heads outside the timing")
        group = st.H // st.HKV
        flash = _in_place(st, SDPBackend.FLASH_ATTENTION, kd.repeat_interleave(group, 1),
                          vd.repeat_interleave(group, 1))
    out["sdpa-flash"] = (flash, st.T)
    return out, notes


def clean_variants(st) -> tuple[dict, dict]:
    """name -> (callable, block size) of the clean pass dense (one-frame blocks,
    ``sdpa-clean-blocks`` and ``sdpa-clean-masked``), and notes."""
    blocks = block_positions(st.g, st.ref.committed, st.T, st.frame)
    masked, note = _clean_masked(st, blocks)
    return ({"sdpa-clean-blocks": (_clean_blocks(st, blocks), st.frame),
             "sdpa-clean-masked": (masked, st.frame)}, {"sdpa-clean-masked": note})


def _clean_blocks(st, blocks: list[np.ndarray], backend=None):
    """One SDPA call per block (``backend``, default cuDNN) over its own buffer of exactly
    V(j), after the chunk's tokens up to the block's end are written into its tail."""
    from torch.nn.attention import SDPBackend

    backend = SDPBackend.CUDNN_ATTENTION if backend is None else backend
    b, C = st.frame, st.ref.committed
    qd = st.q.transpose(0, 1)[None]                                   # [1, H, T, D]
    new_k, new_v = (x.transpose(0, 1)[None] for x in (st.k_new, st.v_new))  # [1, H_kv, T, D]
    bufs = []
    for j, pos in enumerate(blocks):
        end = (j + 1) * b                          # the block's end, as a chunk index
        n = tail_tokens(pos, C, C + end)
        k, v = st.dense_kv(pos)                                       # [1, H_kv, L_j, D]
        bufs.append((k, v, slice(k.shape[2] - n, k.shape[2]), slice(end - n, end)))
    out = torch.empty(st.T, st.H, st.D, dtype=st.qkv.dtype, device=st.qkv.device)

    def run():
        for j, (k, v, dst, src) in enumerate(bufs):
            k[0, :, dst].copy_(new_k[0, :, src])
            v[0, :, dst].copy_(new_v[0, :, src])
            o = _sdpa(backend, qd[:, :, j * b:(j + 1) * b], k, v, st.scale)
            out[j * b:(j + 1) * b].copy_(o[0].transpose(0, 1))        # [b, H, D]
        return out
    return run


def _clean_masked(st, blocks: list[np.ndarray]):
    """All T queries in one SDPA call over the sdpa-cudnn buffer, masked to each block's
    V(j): the callable on the first backend that takes the mask, and a note naming it."""
    from torch.nn.attention import SDPBackend

    mask = block_mask(st.visible_keys(), blocks, st.frame)          # [T, keys] bool
    bias = additive_mask(mask, st.qkv.dtype, st.qkv.device)          # [1, 1, T, keys]
    del mask
    kd, vd = st.dense_kv()
    group = st.H // st.HKV
    tries = [(SDPBackend.CUDNN_ATTENTION, 1, "cuDNN"),
             (SDPBackend.EFFICIENT_ATTENTION, 1, "efficient")]
    if group > 1:  # the efficient backend may take the mask but not GQA
        tries.append((SDPBackend.EFFICIENT_ATTENTION, group,
                      f"efficient with K/V expanded to {st.H} heads outside the timing"))
    tries.append((SDPBackend.MATH, 1, "math"))
    refused = []
    for backend, expand, label in tries:
        k, v = (kd, vd) if expand == 1 else (kd.repeat_interleave(expand, 1),
                                             vd.repeat_interleave(expand, 1))
        fn = _in_place(st, backend, k, v, bias)
        try:
            fn()
        except RuntimeError as e:
            refused.append(f"{label} refused ({_first_line(e)})")
            continue
        dtype = str(st.qkv.dtype).removeprefix("torch.")
        ran = f"ran on {label}, additive {dtype} mask built outside the timing"
        return fn, "; ".join([*refused, ran])
    raise RuntimeError("sdpa-clean-masked: every SDPA backend refused: " + "; ".join(refused))


