"""The fp32 exact-window reference: V(j) itself, and attention over exactly V(j)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from framekv.engine.cache.reference import ExactWindowReference, visible_positions
from framekv.specs import Geometry


def brute_visible(P, W, s, b):
    """V(j) straight from the definition, one position at a time."""
    return [x for x in range(s + b)
            if (x < P and x < s) or (P <= x and s - W <= x < s) or s <= x < s + b]


@pytest.mark.parametrize("P", [0, 1, 5, 8])
@pytest.mark.parametrize("W", [0, 1, 3, 9])
def test_visible_positions_matches_definition(P, W):
    g = Geometry(P, W, 4, (1, 2, 4))
    for s in range(0, 30):
        for b in (1, 2, 4):
            got = visible_positions(g, s, s, b)
            assert got.dtype == np.int64
            assert got.tolist() == brute_visible(P, W, s, b), (s, b)
            assert got.tolist() == visible_positions(g, 0, s, b).tolist()


def test_visible_positions_errors():
    g = Geometry(2, 3, 4, (1,))
    with pytest.raises(ValueError, match="below the committed"):
        visible_positions(g, 5, 4, 1)
    with pytest.raises(ValueError, match="block size"):
        visible_positions(g, 0, 0, 0)


def brute_attention(ref, layer, q, seq_len, b, scale):
    """Per query row and head, a float64 softmax over V(j) written out by hand."""
    S, H, D = q.shape
    out = torch.zeros(S, H, D, dtype=torch.float64)
    for r in range(seq_len):
        s = ref.committed + (r // b) * b
        pos = brute_visible(ref.geometry.pin_tokens, ref.geometry.window_tokens, s, b)
        k, v = ref.kv(layer, np.array(pos))
        group = H // k.shape[1]
        for h in range(H):
            kh, vh = k[:, h // group].double(), v[:, h // group].double()
            logits = [float(q[r, h].double() @ kh[i]) * scale for i in range(len(pos))]
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            out[r, h] = sum(w / total * vh[i] for i, w in enumerate(weights))
    return out


def rollout(ref, forwards, tokens, h_kv, d, gen, dtype=torch.float32):
    """Write and commit ``forwards`` forwards of ``tokens`` random tokens on each layer."""
    for _ in range(forwards):
        for layer in range(ref.num_layers):
            k = torch.randn(tokens, h_kv, d, generator=gen).to(dtype)
            ref.write(layer, ref.committed, k, torch.randn(tokens, h_kv, d, generator=gen))
        ref.commit(tokens)


@pytest.mark.parametrize("P,W,b,H,h_kv,forwards", [
    (3, 5, 2, 4, 2, 3), (0, 0, 3, 2, 2, 2), (7, 2, 1, 6, 3, 4), (2, 11, 4, 4, 1, 5),
    (10, 4, 2, 2, 1, 2),
])
def test_attention_matches_brute_force(P, W, b, H, h_kv, forwards):
    M, D = 8, 8
    gen = torch.Generator().manual_seed(P * 100 + W * 10 + b)
    ref = ExactWindowReference(Geometry(P, W, M, (b,)), num_layers=2)
    rollout(ref, forwards, 4, h_kv, D, gen, dtype=torch.bfloat16)
    seq_len = b * (M // b) if b > 1 else 5
    for layer in range(2):
        ref.write(layer, ref.committed, torch.randn(seq_len, h_kv, D, generator=gen),
                  torch.randn(seq_len, h_kv, D, generator=gen))
    q = torch.randn(M, H, D, generator=gen)
    for layer, scale in ((0, None), (1, 0.3)):
        got = ref.attention(layer, q, seq_len, b, scale=scale)
        want = brute_attention(ref, layer, q, seq_len, b,
                               1 / math.sqrt(D) if scale is None else scale)
        assert got.dtype == torch.float32 and got.shape == q.shape
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        assert (got[seq_len:] == 0).all()


def test_attention_one_hot_recovers_visible_set():
    """q = 0 makes attention uniform; one-hot V per position then reads V(j) back."""
    P, W, M, b, H, h_kv = 5, 6, 6, 3, 4, 2
    geometry = Geometry(P, W, M, (1, b))
    ref = ExactWindowReference(geometry, num_layers=1)
    D = 64                                                  # > every position used
    gen = torch.Generator().manual_seed(0)
    for _ in range(7):
        C, T = ref.committed, M
        v = torch.zeros(T, h_kv, D)
        v[torch.arange(T), :, C + torch.arange(T)] = 1.0    # V of position x: e_x
        ref.write(0, C, torch.randn(T, h_kv, D, generator=gen), v)
        out = ref.attention(0, torch.zeros(M + 2, H, D), T, b)
        for j in range(T // b):
            want = torch.zeros(D)
            pos = visible_positions(geometry, C, C + j * b, b)
            want[pos] = 1.0 / len(pos)
            for r in range(j * b, (j + 1) * b):
                for h in range(H):
                    torch.testing.assert_close(out[r, h], want, atol=1e-7, rtol=0)
        assert (out[T:] == 0).all()
        ref.commit(int(T if C % 2 else T - 1))               # sometimes leave one staged


def test_write_overwrites_and_records_fp32():
    ref = ExactWindowReference(Geometry(0, 4, 4, (1,)), num_layers=1)
    k = torch.full((3, 1, 2), 1.5, dtype=torch.bfloat16)
    ref.write(0, 0, k, k)
    ref.write(0, 1, torch.full((1, 1, 2), 7.0), torch.full((1, 1, 2), -7.0))
    kk, vv = ref.kv(0, np.array([0, 1, 2]))
    assert kk.dtype == torch.float32
    assert kk[:, 0, 0].tolist() == [1.5, 7.0, 1.5] and vv[:, 0, 0].tolist() == [1.5, -7.0, 1.5]
    ref.write(0, 200, k, k)                                  # far positions grow the record
    assert ref.kv(0, np.array([202]))[0].shape == (1, 1, 2)


def test_errors():
    ref = ExactWindowReference(Geometry(2, 2, 4, (2,)), num_layers=2)
    x = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="layer"):
        ref.write(2, 0, x, x)
    with pytest.raises(ValueError, match="k and v"):
        ref.write(0, 0, x, x[:3])
    with pytest.raises(ValueError, match="start"):
        ref.write(0, -1, x, x)
    ref.write(0, 0, x, x)
    with pytest.raises(ValueError, match="heads and head_dim"):
        ref.write(0, 4, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8))
    with pytest.raises(ValueError, match="lacks K/V"):
        ref.commit(5)
    with pytest.raises(ValueError, match=">= 0"):
        ref.commit(-1)
    with pytest.raises(ValueError, match="no K/V recorded"):
        ref.attention(1, torch.zeros(4, 2, 8), 4, 2)
    q = torch.zeros(4, 4, 8)
    for seq_len, b in ((3, 2), (6, 2), (-2, 2)):
        with pytest.raises(ValueError, match="multiple"):
            ref.attention(0, q, seq_len, b)
    with pytest.raises(ValueError, match="do not fit"):
        ref.attention(0, torch.zeros(4, 3, 8), 4, 2)
    with pytest.raises(ValueError, match="S, H, D"):
        ref.attention(0, torch.zeros(4, 8), 4, 2)
    ref.commit(4)
    with pytest.raises(ValueError, match="no K/V for some"):
        ref.attention(0, q, 2, 2)                            # staged tokens never written
    with pytest.raises(ValueError, match="num_layers"):
        ExactWindowReference(Geometry(0, 0, 1, (1,)), num_layers=0)
