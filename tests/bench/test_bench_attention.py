"""The attention section's CPU-checkable parts: the clean-pass mask and buffers against
`visible_positions`, the dense clean-pass variants on CPU tensors (math backend), the
ratios, the table, and the split rows' names."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from framekv import specs
from framekv.bench import attention, dense_sdpa, split
from framekv.bench.attention import Setup
from framekv.bench.dense_sdpa import (MASK_FILL, additive_mask, block_mask, block_positions,
                                    tail_tokens)
from framekv.engine.cache.reference import ExactWindowReference, visible_positions

# P = 6 prompt tokens, W = 20, chunks of 32 in blocks of 8: the window start falls inside
# the pin (committed 10), just at it (26), or inside the chunk for the later blocks (40).
GEOMETRY = specs.Geometry(pin_tokens=6, window_tokens=20, max_staged_tokens=32,
                          causal_block_sizes=(8, 32))
CASES = [(GEOMETRY, 2, 8), (GEOMETRY, 10, 8), (GEOMETRY, 26, 8), (GEOMETRY, 40, 8),
         (GEOMETRY, 40, 32)]


def tiny_case():
    """The tiny preset's geometry with a full window, as `Setup` fills it."""
    g = specs.load_preset("tiny").rollout.geometry()
    return g, g.pin_tokens + g.window_tokens, specs.load_preset("tiny").rollout.tokens_per_frame


def rows_of(mask: torch.Tensor, columns: np.ndarray, j: int, b: int) -> list[set]:
    return [set(columns[mask[r].numpy()].tolist()) for r in range(j * b, (j + 1) * b)]


def test_importing_the_section_needs_no_cudnn():
    code = ("import sys, framekv.bench.attention; "
            "assert 'cudnn' not in sys.modules, 'cudnn imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("g, committed, b", [*CASES, tiny_case()])
def test_mask_rows_see_exactly_their_blocks_visible_positions(g, committed, b):
    T = g.max_staged_tokens
    columns = visible_positions(g, committed, committed, T)
    mask = block_mask(columns, block_positions(g, committed, T, b), b)
    assert mask.shape == (T, len(columns)) and mask.dtype == torch.bool
    P, W = g.pin_tokens, g.window_tokens
    for j in range(T // b):
        s = committed + j * b
        # V(j) spelled out, independently of visible_positions
        want = ({p for p in range(min(P, s))} | set(range(max(P, s - W), s)) | set(range(s, s + b)))
        assert want == set(visible_positions(g, committed, s, b).tolist())
        assert all(row == want for row in rows_of(mask, columns, j, b))


@pytest.mark.parametrize("g, committed, b", [c for c in CASES if c[2] < c[0].max_staged_tokens])
def test_a_wrong_block_offset_is_told_apart(g, committed, b):
    T = g.max_staged_tokens
    columns = visible_positions(g, committed, committed, T)
    mask = block_mask(columns, block_positions(g, committed, T, b), b)
    for j in range(1, T // b):
        for shift in (1, -1, -b):
            wrong = set(visible_positions(g, committed, committed + j * b + shift, b).tolist())
            assert rows_of(mask, columns, j, b)[0] != wrong
    # blocks placed one block late reach past the buffer: refused, not silently cut
    late = block_positions(g, committed + b, T, b)
    with pytest.raises(ValueError, match="block 3 sees positions the buffer does not hold"):
        block_mask(columns, late, b)
    shifted = [pos + 1 for pos in block_positions(g, committed, T, b)]
    if g.pin_tokens:  # the pin's first position moves off the buffer's first column
        with pytest.raises(ValueError):
            block_mask(columns, shifted, b)


@pytest.mark.parametrize("g, committed, b", CASES)
def test_tail_tokens_are_the_chunk_tokens_ending_each_buffer(g, committed, b):
    for j, pos in enumerate(block_positions(g, committed, g.max_staged_tokens, b)):
        end = committed + (j + 1) * b
        n = tail_tokens(pos, committed, end)
        assert n >= b and (pos[:len(pos) - n] < committed).all()
        assert pos[len(pos) - n:].tolist() == list(range(end - n, end))
    with pytest.raises(ValueError, match="not the run ending at"):
        tail_tokens(np.array([0, 1, 40, 42, 43]), 40, 44)


def test_additive_mask_is_zero_where_attended_and_rows_are_aligned():
    mask = torch.rand(5, 13) > 0.5
    out = additive_mask(mask, torch.bfloat16, "cpu")
    assert out.shape == (1, 1, 5, 13) and out.dtype == torch.bfloat16
    assert out.stride(2) % 8 == 0 and out.stride(3) == 1
    assert torch.equal(out[0, 0] == 0, mask)
    assert (out[0, 0][~mask].float() <= MASK_FILL + 64).all()  # -65504 rounds to -65536 in bf16


def cpu_setup(g: specs.Geometry, committed: int, frame: int, H=4, HKV=2, D=16, seed=0) -> Setup:
    """A `Setup` on CPU tensors (fp32): the record filled to ``committed``, a chunk staged."""
    st = Setup.__new__(Setup)
    st.H, st.HKV, st.D, st.g = H, HKV, D, g
    st.T, st.frame = g.max_staged_tokens, frame
    gen = torch.Generator().manual_seed(seed)
    st.ref = ExactWindowReference(g, 1)
    kv = torch.randn(2, committed, HKV, D, generator=gen)
    st.ref.write(0, 0, kv[0], kv[1])
    st.ref.commit(committed)
    st.qkv = torch.randn(1, st.T, H + 2 * HKV, D, generator=gen)
    st.q, st.k_new, st.v_new = st.qkv[0, :, :H], st.qkv[0, :, H:H + HKV], st.qkv[0, :, H + HKV:]
    st.ref.write(0, committed, st.k_new, st.v_new)
    st.scale = D ** -0.5
    return st


@pytest.mark.parametrize("g, committed, b", [c for c in CASES if c[1] >= 10])
def test_dense_clean_pass_variants_match_the_clean_pass_reference(g, committed, b):
    from torch.nn.attention import SDPBackend

    st = cpu_setup(g, committed, b)
    blocks = block_positions(g, committed, st.T, b)
    per_block = dense_sdpa._clean_blocks(st, blocks, backend=SDPBackend.MATH)
    masked, note = dense_sdpa._clean_masked(st, blocks)
    # no cuDNN or efficient kernels on CPU: the fallbacks are named, math ran
    assert note.startswith("cuDNN refused (") and "ran on math, additive float32 mask" in note
    for fn in (per_block, masked):
        torch.testing.assert_close(fn(), st.reference(b), atol=2e-5, rtol=1e-5)
    # the call writes the chunk's K/V each time: new values in the (static) input show up
    st.qkv[0, :, st.H:].normal_()
    st.ref.write(0, committed, st.k_new, st.v_new)
    for fn in (per_block, masked):
        torch.testing.assert_close(fn(), st.reference(b), atol=2e-5, rtol=1e-5)


def timing(median):
    return {"median": median, "p10": median * 0.99, "p90": median * 1.02, "min": median * 0.98,
            "n": 50}


# name, block size, median µs; FLOPs of the denoising forward and of the clean pass
TIMES = [("framekv-denoise", 1576, 1800.0), ("framekv-clean", 394, 2400.0),
         ("sdpa-cudnn", 1576, 2150.0), ("concat-sdpa", 1576, 2300.0), ("sdpa-flash", 1576, 3700.0),
         ("sdpa-clean-blocks", 394, 3000.0), ("sdpa-clean-masked", 394, 4800.0),
         ("framekv-denoise-S1", 1576, 2170.0), ("framekv-denoise-S4", 1576, 1790.0),
         ("framekv-denoise-S1-packed", 1576, 2000.0), ("framekv-denoise-S4-packed", 1576, 1700.0),
         ("framekv-clean-S1", 394, 2400.0), ("framekv-clean-S2", 394, 2500.0),
         ("framekv-clean-S1-packed", 394, 2450.0), ("framekv-clean-S2-packed", 394, 2600.0),
         ("framekv-denoise-call", 1576, 1740.0), ("framekv-clean-call", 394, 2300.0)]
FLOPS = {1576: 1.03e12, 394: 0.79e12}


def synthetic_rows(names=None):
    rows = {}
    for name, b, us in TIMES:
        if names is None or name in names:
            tflops = FLOPS[b] / us / 1e6
            err = None if name.endswith("-call") else 1.5e-4  # call rows are not checked
            rows[name] = {"block_size": b, "max_error": err, "us": timing(us), "tflops": tflops,
                          "fraction_of_ceiling": tflops / 790.0}
    for name, splits, packed in (("framekv-denoise", 4, True), ("framekv-clean", 1, False)):
        if name in rows:
            rows[name].update(splits=splits, packed=packed)
    return rows


def test_ratios_of_the_clean_pass_and_the_packed_rows():
    rows = synthetic_rows()
    r = attention.ratios(rows)
    # time per FLOP of the clean pass over that of the denoising forward
    assert r["clean_over_denoise_per_flop"] == pytest.approx((2400 / 0.79e12) / (1800 / 1.03e12))
    assert r["clean_over_sdpa_clean_blocks"] == pytest.approx(2400 / 3000)
    assert r["clean_over_sdpa_clean_masked"] == pytest.approx(2400 / 4800)
    assert r["denoise_fraction_of_ceiling"] == rows["framekv-denoise"]["fraction_of_ceiling"]
    # the best pinned row may be packed; the S=1 it is put against stays the unpacked one
    assert r["best_denoise"] == "framekv-denoise-S4-packed"
    assert r["best_denoise_over_s1"] == pytest.approx(1700 / 2170)
    assert r["best_denoise_packed"] == "framekv-denoise-S4-packed"
    assert r["best_denoise_packed_over_s1"] == pytest.approx(1700 / 2170)
    assert r["best_denoise_over_sdpa_cudnn"] == pytest.approx(1700 / 2150)
    assert r["best_clean"] == "framekv-clean-S1" and r["best_clean_over_s1"] == 1.0
    assert r["best_clean_packed"] == "framekv-clean-S1-packed"
    assert r["best_clean_packed_over_s1"] == pytest.approx(2450 / 2400)
    assert r["denoise_s1_over_sdpa_cudnn"] == pytest.approx(2170 / 2150)
    # what the layer adds around its cuDNN call, and the calls alone against each other
    assert r["denoise_layer_over_call"] == pytest.approx(1800 / 1740)
    assert r["clean_layer_over_call"] == pytest.approx(2400 / 2300)
    assert r["denoise_call_fraction_of_ceiling"] == pytest.approx(1.03e12 / 1740e-6 / 1e12 / 790)
    assert r["clean_call_over_denoise_call_per_flop"] == pytest.approx(
        (2300 / 0.79e12) / (1740 / 1.03e12))


def test_ratios_leave_out_what_a_result_lacks():
    r = attention.ratios(synthetic_rows({"framekv-denoise", "sdpa-cudnn", "concat-sdpa",
                                         "sdpa-flash", "framekv-denoise-S1",
                                         "framekv-denoise-S2"}))
    assert "best_denoise" in r and "best_denoise_packed" not in r and "best_clean" not in r
    assert not any(k.startswith("clean_over") for k in r)


def test_table_shows_layouts_and_the_new_ratios():
    rows = synthetic_rows()
    res = {"heads": 32, "kv_heads": 8, "head_dim": 128, "tokens": 1576, "keys": 39912,
           "frame": 394, "matmul_tflops": 790.0, "variants": rows, "ratios": attention.ratios(rows),
           "notes": {"sdpa-clean-masked": "ran on cuDNN, additive bfloat16 mask built outside "
                                          "the timing"}}
    text = attention.format_attention(res)
    lines = text.splitlines()
    assert "S/pack" in lines[1]
    assert "4/p" in next(ln for ln in lines if ln.strip().startswith("framekv-denoise "))
    assert "1/-" in next(ln for ln in lines if ln.strip().startswith("framekv-clean "))
    assert "framekv-clean-S2-packed" in text and "sdpa-clean-blocks" in text
    assert "note: sdpa-clean-masked: ran on cuDNN" in text
    assert "framekv clean / sdpa-clean-blocks = 0.800; framekv clean / sdpa-clean-masked = 0.500" in text
    per_flop = (2400 / 0.79e12) / (1800 / 1.03e12)
    assert f"framekv clean / framekv denoise, time per FLOP = {per_flop:.3f}" in text
    assert f"framekv denoise at {rows['framekv-denoise']['fraction_of_ceiling']:.2f} of the" in text
    assert "best packed denoise: framekv-denoise-S4-packed, 0.783 of the unpacked S=1 time" in text
    call = next(ln for ln in lines if ln.strip().startswith("framekv-denoise-call "))
    assert call.rstrip().endswith("-")                       # no error: not checked
    assert "denoise layer / its cuDNN call = 1.034; clean layer / its cuDNN call = 1.043" in text


def test_split_rows_pin_the_packing(monkeypatch):
    made = []

    class Backend:
        def __init__(self, **kw):
            made.append(kw)

    monkeypatch.setattr(split, "CudnnBackend", Backend)
    monkeypatch.setattr(split, "CachedAttention", lambda *a, backend, layer_idx: backend)
    st = SimpleNamespace(H=32, HKV=8, D=128, T=1576, frame=394, qkv=None, cache=None)
    rows = split.variants_for([4])(st)
    assert {n: b for n, (_, b) in rows.items()} == {
        f"framekv-{name}-S{s}{p}": b for s in (1, 4) for p in ("", "-packed")
        for name, b in (("denoise", 1576), ("clean", 394))}
    assert made == [{"split": s, "pack": p} for s in (1, 4) for p in (False, True)]
    made.clear()
    mha = split.variants_for([2])(SimpleNamespace(**{**vars(st), "HKV": 32}))
    assert sorted(mha) == ["framekv-clean-S1", "framekv-clean-S2", "framekv-denoise-S1",
                           "framekv-denoise-S2"]
    assert all(kw["pack"] is False for kw in made)
    with pytest.raises(ValueError, match="split counts must be >= 1"):
        split.variants_for([0])
