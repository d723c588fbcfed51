"""The numba kernels on a CUDA GPU: every op against its torch reference (strided and
aliased inputs included), capture in CUDA graphs replayed with changed device inputs,
and torch.compile over the custom ops."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import (bind_scatter_kv_slots, copy_kv_slots_, copy_kv_slots_reference,
                         rotate_rows_, rotate_rows_reference, scatter_kv_slots_,
                         scatter_kv_slots_reference)
from framekv.ops import _launch
from test_ops_cases import (COPY_PARAMS, ROTATE_SHIFTS, assert_bits_equal, copy_case,
                            random_bits, rotate_case, scatter_case, scatter_params)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def _check_pools(got, want):
    torch.cuda.synchronize()
    assert_bits_equal(got["k_pool"], want["k_pool"], "k_pool")
    assert_bits_equal(got["v_pool"], want["v_pool"], "v_pool")


def _side_stream_warmup(*fns):
    """Run each callable once on a side stream (compiles and loads the kernels) before
    a capture, as torch.cuda.graph expects."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


# --- scatter_kv_slots_ ----------------------------------------------------------------

@pytest.mark.parametrize("dtype,D,kv,pool,dst2,src_rows", scatter_params())
def test_scatter_matches_reference(dtype, D, kv, pool, dst2, src_rows, launch_mode):
    make = lambda: scatter_case(CUDA, dtype, T=37, H=3, D=D, slots=100, kv=kv,  # noqa: E731
                                pool=pool, dst2=dst2, src_rows=src_rows, seed=D)
    got, want = make(), make()
    scatter_kv_slots_(**got)
    scatter_kv_slots_reference(**want)
    _check_pools(got, want)


def test_scatter_seed_geometry_uses_16_byte_words():
    make = lambda: scatter_case(CUDA, torch.bfloat16, T=1576, H=8, D=128,  # noqa: E731
                                slots=4096, kv="fused", dst2=True, src_rows=True, seed=7)
    got, want = make(), make()
    words = _launch.pick_word_size(256, [got["k_pool"], got["v_pool"], got["k"], got["v"]])
    assert words == 16
    scatter_kv_slots_(**got)
    scatter_kv_slots_reference(**want)
    _check_pools(got, want)


def test_bound_scatter_across_calls_and_word_sizes(launch_mode):
    got, want = (scatter_case(CUDA, torch.bfloat16, T=40, H=4, D=64, slots=128, kv="fused",
                              dst2=True, src_rows=True, seed=3) for _ in range(2))
    bound = bind_scatter_kv_slots(got["k_pool"], got["v_pool"], got["dst"], got["dst2"],
                                  got["src_rows"])
    for kv in ("fused", "misaligned", "heads_major", "contiguous"):
        src = scatter_case(CUDA, torch.bfloat16, T=40, H=4, D=64, slots=128, kv=kv, seed=9)
        bound(src["k"], src["v"])
        scatter_kv_slots_reference(want["k_pool"], want["v_pool"], src["k"], src["v"],
                                   want["dst"], want["dst2"], want["src_rows"])
        _check_pools(got, want)


def test_scatter_pool_halves_of_one_tensor_and_fused_source():
    # k_pool/v_pool are halves of one allocation and k/v slices of one fused tensor.
    got, want = (scatter_case(CUDA, torch.float16, T=64, H=8, D=128, slots=256, kv="fused",
                              pool="kvpair", dst2=True, src_rows=False, seed=5)
                 for _ in range(2))
    scatter_kv_slots_(**got)
    scatter_kv_slots_reference(**want)
    _check_pools(got, want)


# --- copy_kv_slots_ -------------------------------------------------------------------

@pytest.mark.parametrize("dtype,D,pool", COPY_PARAMS)
def test_copy_matches_reference(dtype, D, pool, launch_mode):
    make = lambda: copy_case(CUDA, dtype, L=5, slots=60, H=3, D=D, pool=pool, seed=D)  # noqa: E731
    got, want = make(), make()
    copy_kv_slots_(**got)
    copy_kv_slots_reference(**want)
    _check_pools(got, want)


def test_copy_seed_geometry():
    make = lambda: copy_case(CUDA, torch.bfloat16, L=36, slots=300, H=8, D=128,  # noqa: E731
                             pool="layer_strided", seed=2)
    got, want = make(), make()
    copy_kv_slots_(**got)
    copy_kv_slots_reference(**want)
    _check_pools(got, want)


# --- rotate_rows_ ---------------------------------------------------------------------

ROTATE_SHAPES = [((1300,), "contiguous"), ((36, 1300), "contiguous"),
                 ((5, 301), "strided_rows"), ((7, 33), "transposed"), ((9, 64), "offset"),
                 ((3, 1), "contiguous")]


@pytest.mark.parametrize("shape,layout", ROTATE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rotate_matches_reference(shape, layout, dtype, launch_mode):
    for i, shift in enumerate(ROTATE_SHIFTS + [10 ** 30 + 7]):
        for as_tensor in (False, True):
            if as_tensor and abs(shift) >= 2 ** 63:
                continue
            got = rotate_case(CUDA, dtype, shape=shape, layout=layout, seed=i)
            want = got.clone()
            s = torch.tensor([shift], device=CUDA) if as_tensor else shift
            rotate_rows_(got, s)
            rotate_rows_reference(want, s)
            torch.cuda.synchronize()
            assert torch.equal(got, want), (shift, as_tensor)


def test_rotate_int32_shift_tensor_and_extremes():
    x = rotate_case(CUDA, torch.int64, shape=(4, 1000), seed=1)
    want = x.clone()
    for shift in (torch.tensor(-(2 ** 31), dtype=torch.int32, device=CUDA),
                  torch.tensor([-(2 ** 63)], device=CUDA), torch.tensor([2 ** 63 - 1], device=CUDA)):
        rotate_rows_(x, shift)
        rotate_rows_reference(want, shift)
    torch.cuda.synchronize()
    assert torch.equal(x, want)


def test_rotate_more_rows_than_a_grid_dimension_holds():
    x = rotate_case(CUDA, torch.int32, shape=(70_000, 3), seed=2)  # > 65535 rows
    want = x.clone()
    rotate_rows_(x, torch.tensor([1], device=CUDA))
    rotate_rows_reference(want, 1)
    torch.cuda.synchronize()
    assert torch.equal(x, want)


def test_rotate_a_view_leaves_the_rest_alone():
    base = rotate_case(CUDA, torch.int32, shape=(10, 50), seed=3)
    want = base.clone()
    rotate_rows_(base[2:6, 5:45], -17)
    rotate_rows_reference(want[2:6, 5:45], -17)
    rotate_rows_(base[7], torch.tensor([4], device=CUDA))
    rotate_rows_reference(want[7], 4)
    torch.cuda.synchronize()
    assert torch.equal(base, want)


# --- CUDA graphs ----------------------------------------------------------------------

def test_rotate_graph_replays_new_shift():
    x = rotate_case(CUDA, torch.int32, shape=(36, 1300), seed=4)
    shift = torch.zeros(1, dtype=torch.int64, device=CUDA)
    _side_stream_warmup(lambda: rotate_rows_(x, shift), lambda: rotate_rows_(x[0], shift))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotate_rows_(x, shift)
        rotate_rows_(x[0], shift)
    want = x.clone()
    for value in (3, -5, 1301, 0, -(2 ** 40)):
        shift.fill_(value)
        rotate_rows_reference(want, value)
        rotate_rows_reference(want[0], value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, want), value


def test_scatter_graph_replays_new_lists_and_data():
    c = scatter_case(CUDA, torch.bfloat16, T=64, H=8, D=128, slots=512, kv="fused",
                     dst2=True, src_rows=True, seed=6)
    E = c["dst"].shape[0]
    bound = bind_scatter_kv_slots(c["k_pool"], c["v_pool"], c["dst"], c["dst2"],
                                  c["src_rows"])
    _side_stream_warmup(lambda: scatter_kv_slots_(**c), lambda: bound(c["k"], c["v"]))
    public, lean = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(public):
        scatter_kv_slots_(**c)
    with torch.cuda.graph(lean):
        bound(c["k"], c["v"])
    g = torch.Generator().manual_seed(0)
    for trial, graph in enumerate((public, lean, public, lean)):
        perm = torch.randperm(512, generator=g)
        c["dst"].copy_(perm[:E])
        c["dst2"].copy_(torch.where(torch.arange(E) % 5 == 0, -1, perm[E:2 * E]))
        rows = torch.randint(-2, 66, (E,), generator=g)
        c["src_rows"].copy_(rows)
        c["k"].copy_(random_bits(c["k"].shape, torch.bfloat16, g, CUDA))
        c["v"].copy_(random_bits(c["v"].shape, torch.bfloat16, g, CUDA))
        want = {"k_pool": c["k_pool"].clone(), "v_pool": c["v_pool"].clone()}
        scatter_kv_slots_reference(want["k_pool"], want["v_pool"], c["k"], c["v"], c["dst"],
                                   c["dst2"], c["src_rows"])
        graph.replay()
        _check_pools(c, want)


def test_copy_graph_replays_new_lists():
    c = copy_case(CUDA, torch.bfloat16, L=36, slots=200, H=8, D=128, seed=8)
    _side_stream_warmup(lambda: copy_kv_slots_(**c))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy_kv_slots_(**c)
    E = c["src"].shape[0]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        perm = torch.randperm(200, generator=g)
        src, dst = perm[:E].clone(), perm[E:2 * E].clone()
        src[::7] = -1
        dst[3::9] = -1
        c["src"].copy_(src)
        c["dst"].copy_(dst)
        want = {"k_pool": c["k_pool"].clone(), "v_pool": c["v_pool"].clone()}
        copy_kv_slots_reference(want["k_pool"], want["v_pool"], c["src"], c["dst"])
        graph.replay()
        _check_pools(c, want)


# --- torch.compile --------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_ops_trace_under_torch_compile_on_cuda(backend):
    torch._dynamo.reset()

    def step(page_table, shift, k_pool, v_pool, qkv, dst, src, dst_copy):
        rotate_rows_(page_table, shift)
        scatter_kv_slots_(k_pool[0], v_pool[0], qkv[:, 32:40], qkv[:, 40:48], dst)
        copy_kv_slots_(k_pool, v_pool, src, dst_copy)
        return page_table.sum() + 1

    def inputs():
        g = torch.Generator(device=CUDA).manual_seed(0)
        return (torch.arange(2600, dtype=torch.int32, device=CUDA).reshape(2, 1300),
                torch.tensor([37], device=CUDA),
                torch.zeros(4, 64, 8, 128, dtype=torch.bfloat16, device=CUDA),
                torch.zeros(4, 64, 8, 128, dtype=torch.bfloat16, device=CUDA),
                torch.randn(16, 48, 128, dtype=torch.bfloat16, device=CUDA, generator=g),
                torch.arange(16, device=CUDA) * 2 - 1,
                torch.tensor([1, 3, -1, 5], device=CUDA), torch.tensor([40, 41, 42, -1], device=CUDA))

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got, want = inputs(), inputs()
    out = compiled(*got)
    ref = step(*want)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
