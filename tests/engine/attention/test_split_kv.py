"""Split-KV on CPU: the wave model, the sub-row cut, and exactness of attention over
sub-rows merged by log-sum-exp against the reference over V(j)."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.attention.split_kv import SplitBuffers, choose_split, sub_row_index, wave_fill
from framekv.ops.merge_split_kv import merge_split_kv_reference
from framekv.specs import Geometry

from cudnn_fake import ragged_rows


class HostArena:
    """What `SplitBuffers.allocate` needs of an arena, on the host."""

    def empty(self, shape, dtype, name=""):
        return torch.empty(shape, dtype=dtype)


def test_wave_fill():
    assert wave_fill(416, 132) == pytest.approx(416 / 528)
    assert wave_fill(132, 132) == 1.0


@pytest.mark.parametrize("nb,b,H,keys,want", [
    (1, 1576, 32, 1247 * 32, 5),   # seed denoising forward: 416 CTAs, 3.15 waves
    (4, 394, 32, 1233 * 32, 1),    # seed clean pass: 512 CTAs already fill 3.9 waves
    (1, 4680, 12, 1041 * 32, 5),   # wan-1.3b denoising forward: 444 CTAs
    (1, 1576, 32, 3000, 1),        # too few keys for a second sub-row
    (1, 128, 1, 1 << 20, 6),       # one CTA: every split fills more
    (1, 1576, 32, 12 * 2048, 5),   # S = 6 would leave sub-rows under 2048 keys
])
def test_choose_split(nb, b, H, keys, want):
    assert choose_split(num_blocks=nb, block_size=b, num_heads=H, row_keys=keys, sms=132) == want


@pytest.mark.parametrize("nb,b,H,group,want", [
    (4, 394, 32, 4, 5),    # packed seed clean pass: S = 5 fills 0.985 against 0.970 at S = 4
    (2, 4680, 12, 1, 4),   # two Wan sequences: S = 4 fills 0.997 against 0.961 unsplit
    (4, 4680, 12, 1, 2),   # four: S = 2 already fills 0.997
])
def test_choose_split_of_several_blocks(nb, b, H, group, want):
    """Several blocks: the sub-rows share their block's queries (ragged rows, no copy
    per split), so the same fill rule as one block decides."""
    assert choose_split(num_blocks=nb, block_size=b, num_heads=H, row_keys=1041 * 32, sms=132,
                        group=group) == want


@pytest.mark.parametrize("field", ["num_blocks", "block_size", "num_heads", "row_keys", "sms"])
def test_choose_split_rejects_bad_arguments(field):
    args = dict(num_blocks=1, block_size=64, num_heads=4, row_keys=4096, sms=132)
    args[field] = 0
    with pytest.raises(ValueError, match=f"{field} must be an integer >= 1, got 0"):
        choose_split(**args)


def test_sub_row_index_cuts_rows_at_page_boundaries():
    # 2 rows of 5 entries in 2 sub-rows of 3: the last entry repeats past the end.
    assert sub_row_index(2, 2, 5) == [0, 1, 2, 5, 6, 7, 3, 4, 4, 8, 9, 9]


def cache_with_history(g, tpp, commits, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cache = CausalKVCache(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                          tokens_per_page=tpp, device="cpu",
                          pool_tokens=CausalKVCache.pool_tokens_for(g, tpp))
    cache.open(g)
    M = g.max_staged_tokens
    for _ in range(commits):
        kv = torch.randn(2, M, 2, 16, generator=gen)
        cache.write_staged(0, kv[0], kv[1], M)
        cache.commit(M)
    return cache, gen


def attend_sub_rows(cache, bufs, rows):
    """What cuDNN computes per sub-row over its queries ``rows`` [S*nb, H, b, D] (as
    the launch binds them): (partial [S, T, H, D], lse [S*nb, H, b, 1])."""
    S, nb, b = bufs.splits, bufs.num_blocks, bufs.block_size
    kp, vp = cache.page_view(0)                                # [pages, H_kv, tpp, D]
    H, D = rows.shape[1], rows.shape[3]
    partial = torch.full((S, nb * b, H, D), float("nan"))
    lse = torch.full((S * nb, H, b, 1), float("nan"))
    for n in range(S * nb):
        s, j = divmod(n, nb)
        L = int(bufs.kv_lens[n])
        if L == 0:
            continue  # cuDNN's output for an empty row is garbage: left NaN here
        pages = bufs.table[n].long()
        k = kp[pages].permute(0, 2, 1, 3).reshape(-1, 2, D)[:L]  # [L, H_kv, D]
        v = vp[pages].permute(0, 2, 1, 3).reshape(-1, 2, D)[:L]
        qj = rows[n].transpose(0, 1)                               # [b, H, D]
        scores = torch.einsum("qhd,khd->hqk", qj, k.repeat_interleave(H // 2, 1)) * D ** -0.5
        lse[n, :, :, 0] = torch.logsumexp(scores, -1)
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(H // 2, 1))
        partial[s, j * b:(j + 1) * b] = out
    return partial, lse


@pytest.mark.parametrize("S", [2, 3, 4])
@pytest.mark.parametrize("g,tpp,b,commits", [
    (Geometry(5, 40, 12, (4, 12)), 4, 4, 5),     # window full, three one-frame-like blocks
    (Geometry(5, 40, 12, (4, 12)), 4, 12, 5),    # one block
    (Geometry(3, 97, 16, (8, 16)), 8, 8, 2),     # window not yet full: short rows
    (Geometry(0, 64, 8, (8,)), 2, 8, 0),         # first forward: only own tokens
])
def test_sub_rows_merged_equal_attention_over_the_visible_set(g, tpp, b, commits, S):
    cache, gen = cache_with_history(g, tpp, commits)
    T = g.max_staged_tokens
    qkv = torch.randn(1, T, 4 + 4, 16, generator=gen)
    want = CachedAttention(4, 2, 16, backend="reference")(qkv, kv_cache=cache, seq_len=T,
                                                           causal_block_size=b)[0]
    bt = cache.block_tensors(b)
    bufs = SplitBuffers.allocate(HostArena(), splits=S, num_blocks=T // b, block_size=b,
                                 row_pages=bt.rows.shape[1], tokens_per_page=tpp, num_heads=4,
                                 head_dim=16, dtype=torch.float32)
    q = qkv[0, :, :4]
    bufs.rebuild(bt.rows[:T // b], bt.seq_len_kv[:T // b])
    qv = bufs.query(q)
    if T // b > 1:  # several blocks: ragged rows over q itself, no copy
        assert qv.data_ptr() == q.data_ptr() and qv.shape == (T // b, 4, b, 16)
        qv = ragged_rows(qv, bufs.q_offsets, S * (T // b))
    assert qv.shape == (S * (T // b), 4, b, 16)
    assert int(bufs.kv_lens.sum()) == int(bt.seq_len_kv[:T // b].sum())  # no key lost or doubled
    partial, lse = attend_sub_rows(cache, bufs, qv)
    out = torch.full((T, 4, 16), float("nan"))
    merge_split_kv_reference(out, partial, lse, bufs.kv_lens, block_size=b, seq_len=T)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_sub_rows_follow_the_rows_only_when_rebuilt():
    """What a plan's ``prepare`` is for: after a commit the rows move; rebuilt sub-rows
    follow them, sub-rows left alone still describe the old rows (the stale layout a
    forward without its prepare would read)."""
    g = Geometry(5, 40, 12, (4, 12))
    cache, gen = cache_with_history(g, 4, 5)
    bt = cache.block_tensors(12)
    bufs = SplitBuffers.allocate(HostArena(), splits=2, num_blocks=1, block_size=12,
                                 row_pages=bt.rows.shape[1], tokens_per_page=4, num_heads=4,
                                 head_dim=16, dtype=torch.float32)
    bufs.rebuild(bt.rows[:1], bt.seq_len_kv[:1])
    before = bufs.table.clone(), bufs.kv_lens.clone()
    kv = torch.randn(2, 12, 2, 16, generator=gen)
    cache.write_staged(0, kv[0], kv[1], 12)
    cache.commit(12)                                    # the window slides: rows change
    assert torch.equal(bufs.table, before[0])           # stale until rebuilt
    bufs.rebuild(bt.rows[:1], bt.seq_len_kv[:1])
    assert not torch.equal(bufs.table, before[0])
    want = torch.tensor(sub_row_index(2, 1, bt.rows.shape[1]))
    assert torch.equal(bufs.table.view(-1), bt.rows.reshape(-1)[want].to(bufs.table.dtype))
    assert int(bufs.kv_lens.sum()) == int(bt.seq_len_kv[0])


def test_a_forward_plans_once_and_every_layer_checks_its_plan():
    g = Geometry(5, 40, 12, (4, 12))
    cache, gen = cache_with_history(g, 4, 2)
    attn = CachedAttention(4, 2, 16, backend="reference")
    plan = attn.plan_for(cache, 12, 4)
    assert (plan.tokens, plan.block_size, plan.num_heads, plan.splits) == (12, 4, 4, 1)
    assert plan.matches(cache, 12, 4, 4, attn.scale)
    qkv = torch.randn(1, 12, 8, 16, generator=gen)
    want = attn(qkv, kv_cache=cache, seq_len=12, causal_block_size=4)
    assert torch.equal(attn(qkv, kv_cache=cache, seq_len=12, causal_block_size=4, plan=plan), want)
    for bad in (attn.plan_for(cache, 12, 12), "plan"):
        with pytest.raises(ValueError, match="plan must be the AttentionPlan of this forward"):
            attn(qkv, kv_cache=cache, seq_len=12, causal_block_size=4, plan=bad)
