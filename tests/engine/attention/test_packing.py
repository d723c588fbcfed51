"""GQA query packing on CPU: the layout maps, the wave model's layout choice, and the cuDNN
backend's real plans (packed and unpacked, with and without split-KV) over a stand-in
for cuDNN's paged SDPA (`cudnn_fake`), against the fp32 exact-window reference."""
from __future__ import annotations

import pytest
import torch

from attention_harness import onehot_visible_sets, rollout_vs_reference
from cudnn_fake import FakeCudnnBackend
from framekv.engine.attention.cudnn import CudnnBackend
from framekv.engine.attention.packing import pack_queries_, token_view, unpack_output_
from framekv.engine.attention.split_kv import choose_layout, launch_ctas, wave_time
from framekv.specs import Geometry as G


def stamped(T, H, D, extra_heads=0):
    """[T, H, D] whose every value says its token and head (token * 100 + head), as a
    window of a wider packed-QKV-like tensor (non-trivial strides)."""
    base = torch.zeros(T, H + extra_heads, D)
    x = base[:, :H]
    x += (torch.arange(T)[:, None, None] * 100 + torch.arange(H)[None, :, None]).float()
    return x


@pytest.mark.parametrize("nb,b,hkv,g", [(1, 5, 2, 3), (3, 4, 3, 2), (2, 7, 1, 4)])
def test_packed_order_is_kv_head_then_stacked_head_then_token(nb, b, hkv, g):
    q = stamped(nb * b, hkv * g, 8, extra_heads=2 * hkv)
    view = token_view(q, nb, b, g)                                  # [nb, H_kv, g, b, D]
    for j, k, r, t in [(0, 0, 0, 0), (nb - 1, hkv - 1, g - 1, b - 1), (nb // 2, hkv // 2, g // 2, 1)]:
        assert view[j, k, r, t, 0].item() == (j * b + t) * 100 + k * g + r
    dst = torch.zeros(nb, hkv, g, b, 8)
    pack_queries_(dst, q, g)
    assert torch.equal(dst, view)
    back = torch.zeros(nb * b, hkv * g + 5, 8)[:, 2:2 + hkv * g]    # strided output window
    unpack_output_(back, dst.reshape(nb, hkv, g * b, 8), g)
    assert torch.equal(back, q)


def test_launch_ctas_and_wave_time():
    # The seed clean pass: 4 blocks of 394 queries, 32 / 8 heads.
    assert launch_ctas(num_blocks=4, block_size=394, num_heads=32) == 4 * 32 * 4
    assert launch_ctas(num_blocks=4, block_size=394, num_heads=32, group=4) == 4 * 8 * 13
    assert wave_time(416, 5, 132) == pytest.approx(16 / 5)
    assert wave_time(512, 1, 132) == 4


@pytest.mark.parametrize("args,want", [
    (dict(num_blocks=1, block_size=1576), (True, 5)),        # seed denoise: a tie, fewer CTAs
    (dict(num_blocks=4, block_size=394), (True, 5)),         # seed clean pass: 3.2 vs 4.0 row times
    (dict(num_blocks=4, block_size=394, pack=False), (False, 1)),
    (dict(num_blocks=1, block_size=1576, pack=True), (True, 5)),
    (dict(num_blocks=4, block_size=394, split=1), (False, 1)),   # at S = 1 both take 4 waves
    (dict(num_blocks=1, block_size=1576, split=1), (False, 1)),  # unsplit packing must gain
    (dict(num_blocks=4, block_size=394, num_kv_heads=32, pack=True), (False, 1)),  # MHA
])
def test_choose_layout(args, want):
    base = dict(num_heads=32, num_kv_heads=8, row_keys=1247 * 32, sms=132)
    assert choose_layout(**{**base, **args}) == want


def test_backend_layout_for_pins_and_refusals():
    g = G(394, 36 * 394, 1576, (394, 1576))
    fake = FakeCudnnBackend()
    assert fake.layout_for(g, 32, 32, 1576, 394, num_kv_heads=8) == (True, 5)
    assert fake.layout_for(g, 32, 32, 1576, 394) == (False, 1)    # no K/V heads given: MHA
    assert FakeCudnnBackend(pack=False).layout_for(g, 32, 32, 1576, 394, num_kv_heads=8) == (False, 1)
    assert FakeCudnnBackend(split={394: 3}).layout_for(g, 32, 32, 1576, 394,
                                                       num_kv_heads=8) == (True, 3)
    with pytest.raises(ValueError, match="pack must be 'auto', True or False, got 'yes'"):
        CudnnBackend(pack="yes")


CASES = [  # geometry, page size, chunk, frame
    (G(5, 40, 12, (4, 12)), 4, 12, 4),       # window fills; three blocks per clean pass
    (G(3, 97, 16, (8, 16)), 8, 16, 8),       # nothing aligned
    (G(0, 24, 6, (3, 6)), 2, 6, 3),          # no pin
]


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("g,tpp,chunk,frame", CASES)
def test_cudnn_plans_equal_the_exact_window_reference(g, tpp, chunk, frame, split, pack):
    backend = FakeCudnnBackend(split=split, pack=pack)
    # bf16 as on the GPU (the merge takes bf16/fp16): a wrong layout is off by O(1).
    err = rollout_vs_reference(g, tpp, chunk=chunk, frame=frame, chunks=8, layers=2, H=6,
                               Hkv=2, D=16, dtype=torch.bfloat16, backend=backend,
                               packed=split == 2, seed=split)
    assert err["max_rel_error"] <= 8e-3, err
    plans = list(backend._plans.values())
    assert plans and all(p.packed == pack and p.splits == split for p in plans)
    groups = {key.query_group for key in backend._executables}
    assert groups == {3 if pack else 1}
    # Split over several blocks (the clean pass), the sub-rows read ragged query rows.
    ragged = {key.num_blocks // key.splits: key.q_offsets for key in backend._executables}
    assert ragged == {nb: split > 1 and nb > 1 for nb in ragged} and len(ragged) == 2


@pytest.mark.parametrize("split", [1, 4])
def test_packed_onehot_visible_sets_are_exact(split):
    """Each query head reads its own K/V head's one-hot values, exactly V(j)."""
    onehot_visible_sets(G(5, 13, 6, (2, 3, 6)), 4, block_sizes=(6, 3, 2), commits=18, H=4,
                        Hkv=2, dtype=torch.bfloat16, tol=2e-3,
                        backend=FakeCudnnBackend(split=split, pack=True))


def test_packed_plan_sees_new_commits_without_replanning():
    """One plan serves every forward: the packed rows follow the commits (prepare)."""
    backend = FakeCudnnBackend(split=1, pack=True)
    err = rollout_vs_reference(G(5, 40, 12, (4, 12)), 4, chunk=12, frame=4, chunks=12,
                               layers=1, H=4, Hkv=2, D=16, dtype=torch.bfloat16, backend=backend)
    assert err["max_rel_error"] <= 8e-3, err
    assert len(backend._plans) == 2 and backend.plans_built == 2  # denoise and clean shapes


@pytest.mark.parametrize("D,dtype,heads_off", [(128, torch.bfloat16, 0), (128, torch.bfloat16, 3),
                                               (6, torch.bfloat16, 0), (5, torch.float32, 1),
                                               (8, torch.float16, 2)])
def test_copy_rows_is_bit_exact_on_any_layout(D, dtype, heads_off):
    """Word copies where the layout allows them (D = 128 of packed QKV), the element copy
    where it does not (D = 5 or 6, odd head offsets): the same bits either way."""
    from framekv.engine.attention.packing import copy_rows_

    nb, b, hkv, g = 2, 3, 2, 2
    base = torch.randn(nb * b, hkv * g + 6, D).to(dtype)          # a packed-QKV-like tensor
    base.view(-1)[::7] = float("nan")                               # odd bits must survive too
    q = base[:, heads_off:heads_off + hkv * g]
    dst = torch.zeros(nb, hkv, g, b, D, dtype=dtype)
    pack_queries_(dst, q, g)
    assert torch.equal(dst.view(torch.uint8), token_view(q, nb, b, g).contiguous().view(torch.uint8))
    out = torch.zeros(nb * b, hkv * g + 4, D, dtype=dtype)[:, 1:1 + hkv * g]
    copy_rows_(out, q)
    assert torch.equal(out.contiguous().view(torch.uint8), q.contiguous().view(torch.uint8))


def test_copy_rows_between_dtypes_converts_values():
    """fp32 rows of 2 are one word each, fp64 ones two: moving words would broadcast the
    bits; a copy between dtypes must convert the values instead."""
    from framekv.engine.attention.packing import copy_rows_

    src = torch.randn(3, 4, 2)
    wide = torch.zeros(3, 4, 2, dtype=torch.float64)
    copy_rows_(wide, src)
    assert torch.equal(wide, src.double())
