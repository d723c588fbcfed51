"""``merge_split_kv_``'s kernel on a CUDA GPU against the torch reference: odd geometries
in every launch mode, the seed geometry (one 1576-token block, and four 394-token
blocks), capture in CUDA graphs replayed with changed contents, torch.compile."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import _launch, merge_split_kv_, merge_split_kv_reference
from test_merge_split_kv import assert_merged_close, merge_case, split_attention_case
from test_ops_gpu import _side_stream_warmup

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _compare(dtype, **kw):
    args, base = merge_case(CUDA, dtype, **kw)
    want, want_base = merge_case(CUDA, dtype, **kw)
    assert _launch.use_kernel(args["out"])
    merge_split_kv_(**args)
    merge_split_kv_reference(**want)
    torch.cuda.synchronize()
    assert torch.isfinite(base.float()).all()
    assert_merged_close(base, want_base)
    return args


ODD_CASES = [  # (S, nb, b, H, D, seq_len, layout)
    (1, 1, 37, 3, 64, None, "contiguous"),
    (2, 1, 50, 3, 128, 41, "packed"),
    (2, 3, 17, 5, 64, 40, "heads_major"),
    (3, 2, 29, 3, 128, None, "packed"),
    (3, 4, 9, 3, 64, 30, "contiguous"),
    (4, 4, 13, 3, 128, 50, "packed"),
    (4, 2, 33, 7, 64, None, "heads_major"),
    (6, 3, 11, 3, 128, 25, "contiguous"),
]


@pytest.mark.parametrize("S,nb,b,H,D,seq_len,layout", ODD_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference(S, nb, b, H, D, seq_len, layout, dtype, launch_mode):
    _compare(dtype, S=S, nb=nb, b=b, H=H, D=D, seq_len=seq_len, layout=layout,
             seed=S * 10 + nb)


@pytest.mark.parametrize("S,nb,b,H", [(5, 1, 1576, 32), (5, 4, 394, 32), (3, 2, 29, 6)])
def test_blocked_partials_match_token_major(S, nb, b, H):
    """The kernel reads [S, nb, H, b, D] partials (packed GQA rows, cuDNN's layout)
    bit for bit like the same values stored [S, T, H, D]."""
    kw = dict(S=S, nb=nb, b=b, H=H, D=128, seq_len=nb * b - 3, seed=S + nb)
    args, base = merge_case(CUDA, torch.bfloat16, blocked=True, **kw)
    want, want_base = merge_case(CUDA, torch.bfloat16, **kw)
    merge_split_kv_(**args)
    merge_split_kv_(**want)
    torch.cuda.synchronize()
    assert torch.equal(base.view(torch.int16), want_base.view(torch.int16))


def test_kernel_is_exact_split_attention():
    partial, lse, kv_lens, want = split_attention_case(S=3, nb=4, b=16, H=3, D=128, seed=4,
                                                       empty_block=2, max_keys=200)
    out = torch.empty(64, 3, 128, dtype=torch.bfloat16, device=CUDA)
    merge_split_kv_(out, partial.to(CUDA, torch.bfloat16), lse.float().to(CUDA),
                    kv_lens.to(CUDA), block_size=16, seq_len=64)
    torch.testing.assert_close(out.double().cpu(), want, rtol=2e-2, atol=2e-2)


SEED = [(S, nb) for nb in (1, 4) for S in (2, 3, 4, 5, 6)]


@pytest.mark.parametrize("S,nb", SEED)
def test_seed_geometry(S, nb):
    T, H, D = 1576, 32, 128
    args = _compare(torch.bfloat16, S=S, nb=nb, b=T // nb, H=H, D=D, seq_len=T - 5,
                    layout="packed", empty_every=5, seed=S)
    assert _launch.pick_word_size(256, [args["out"], args["partial"]]) == 16
    assert args["out"][T - 5:].eq(0).all()


def test_misaligned_output_is_refused():
    args, _ = merge_case(CUDA, torch.bfloat16, S=2, nb=1, b=4, H=3, D=64)
    flat = torch.empty(4 * 3 * 64 + 4, dtype=torch.bfloat16, device=CUDA)
    args["out"] = flat[4:].view(4, 3, 64)
    with pytest.raises(ValueError, match="^out: "):
        merge_split_kv_(**args)


# --- CUDA graphs ----------------------------------------------------------------------

def _refill(args, g, trial):
    """New contents in place: partials, statistics, and a new pattern of empty sub-rows."""
    args["partial"].copy_(torch.randn(args["partial"].shape, generator=g))
    args["lse"].copy_(torch.randn(args["lse"].shape, generator=g) * 3)
    kv = torch.randint(1, 5000, args["kv_lens"].shape, generator=g, dtype=torch.int32)
    kv[trial % 3::3] = 0
    args["kv_lens"].copy_(kv)


@pytest.mark.parametrize("S,nb", [(2, 1), (4, 4)])
def test_graph_replays_new_contents(S, nb):
    T, H, D = 1576, 32, 128
    args, _ = merge_case(CUDA, torch.bfloat16, S=S, nb=nb, b=T // nb, H=H, D=D, seq_len=T - 3,
                         layout="packed", seed=7)
    _side_stream_warmup(lambda: merge_split_kv_(**args))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        merge_split_kv_(**args)
    g = torch.Generator().manual_seed(0)
    for trial in range(4):
        _refill(args, g, trial)
        args["out"].fill_(float("nan"))
        want = torch.empty_like(args["out"])
        merge_split_kv_reference(want, args["partial"], args["lse"], args["kv_lens"],
                                 block_size=T // nb, seq_len=T - 3)
        graph.replay()
        torch.cuda.synchronize()
        assert_merged_close(args["out"], want)


# --- torch.compile --------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_merge_traces_under_torch_compile_on_cuda(backend):
    torch._dynamo.reset()

    def step(out, partial, lse, kv_lens):
        merge_split_kv_(out, partial, lse, kv_lens, block_size=8, seq_len=20)
        return out.float().sum()

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got, _ = merge_case(CUDA, torch.bfloat16, S=3, nb=3, b=8, H=3, D=128, seed=2)
    want, _ = merge_case(CUDA, torch.bfloat16, S=3, nb=3, b=8, H=3, D=128, seed=2)
    keys = ("out", "partial", "lse", "kv_lens")
    a = compiled(*(got[k] for k in keys))
    b = step(*(want[k] for k in keys))
    torch.cuda.synchronize()
    assert torch.equal(got["out"], want["out"])
    torch.testing.assert_close(a, b)  # sums reduced in another order may differ
