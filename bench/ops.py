"""Benchmark the ops at the seed geometry against torch equivalents.

    python -m framekv.bench.ops [--json out.json] [--launches 20] [--repeats 50]

Geometry: 1576 tokens, 8 K/V heads of 128, bf16; K and V are slices of a fused QKV
tensor [1576, 32 + 8 + 8, 128]; the scatter writes every token to two slots. The copy
runs over 36 layers with 96 slot pairs (8 of them sentinels); the rotate over one page
table row of 1300 entries and over [36, 1300].

Kernel time: CUDA events around the replay of a CUDA graph holding ``--launches``
launches (launch cost excluded), divided by that count; the median over ``--repeats``
replays after warm-up. GB/s counts bytes read plus bytes written by the operation
(logical bytes: the rotate's in-place reversals touch each element twice). The
reference bandwidth is ``dst.copy_(src)`` moving the scatter's byte count. The working
set of every K/V case fits in the H200's L2 cache (60 MB), as it does in a forward.

``copy_rows_`` moves a Wan VAE folded conv's cache entry, [1, 2, 480, 832, 96] bf16
(153 MB, far past the L2, as in the decoder): a load from row 1 of a 2-row arena into
channels 96..191 of a [1, 2, 480, 832, 288] buffer and the store back, beside
``torch.index_select(out=)`` and ``index_copy_`` on the same views and a contiguous
``copy_`` of the same bytes. Its host cost is taken on a tiny entry (the large one's
launches wait on the device).

Host cost: wall time of many eager launches, one synchronisation at the end, divided
by the count; for the public op (through the torch custom op) and, for the scatter (the
cache's per-layer write), its bound launcher.

Every op is first checked bit for bit against its torch reference.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from framekv.bench.report import dump_json, kernel_results
from framekv.bench.timing import captured_graph, require_cuda
from framekv.ops import (bind_scatter_kv_slots, copy_kv_slots_, copy_kv_slots_reference,
                         copy_rows_, copy_rows_reference, rotate_rows_, rotate_rows_reference,
                         scatter_kv_slots_, scatter_kv_slots_reference)

T, HQ, H, D = 1576, 32, 8, 128
LAYERS, PAIRS, SENTINELS = 36, 96, 8
ROW = 1300
VAE_ENTRY, VAE_WIDTH = (2, 480, 832, 96), 288   # a folded conv's entry, its buffer's channels


def graph_time_us(fn, launches: int, repeats: int) -> float:
    """Median kernel time of ``fn`` in µs, from replays of a graph of ``launches`` calls."""
    graph = captured_graph(fn, launches)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / launches)
    return statistics.median(times)


def host_us(fn, count: int = 2000) -> float:
    """Wall µs per eager call of ``fn`` (one sync at the end)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(count):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / count


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t


def check(name: str, got, want) -> None:
    for a, b in zip(got, want):
        if not torch.equal(bits(a), bits(b)):
            raise SystemExit(f"{name}: result differs from the torch reference")


# --- cases --------------------------------------------------------------------------

def scatter_setup(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(T, HQ + 2 * H, D, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = qkv[:, HQ:HQ + H], qkv[:, HQ + H:]  # [T, H, D] slices, no copy
    slots = 48 * 1024
    k_pool = torch.zeros(slots, H, D, device=dev, dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    dst = torch.arange(1000, 1000 + T, device=dev)            # shared slots
    dst2 = torch.arange(40000, 40000 + T, device=dev)         # private slots
    return k_pool, v_pool, k, v, dst, dst2


def bench_scatter(dev, launches, repeats):
    k_pool, v_pool, k, v, dst, dst2 = scatter_setup(dev)
    scatter_kv_slots_(k_pool, v_pool, k, v, dst, dst2)
    wk, wv = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
    scatter_kv_slots_reference(wk, wv, k, v, dst, dst2)
    check("scatter_kv_slots_", (k_pool, v_pool), (wk, wv))
    bound = bind_scatter_kv_slots(k_pool, v_pool, dst, dst2)
    bound(k, v)
    check("bind_scatter_kv_slots", (k_pool, v_pool), (wk, wv))

    nbytes = 3 * 2 * T * H * D * 2  # read K and V once, write them twice
    src_buf = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    dst_buf = torch.empty_like(src_buf)

    def index_copy():
        for d in (dst, dst2):
            k_pool.index_copy_(0, d, k)
            v_pool.index_copy_(0, d, v)

    def index_put():
        for d in (dst, dst2):
            k_pool[d] = k
            v_pool[d] = v

    public = lambda: scatter_kv_slots_(k_pool, v_pool, k, v, dst, dst2)  # noqa: E731
    rows = {
        "kernel": graph_time_us(lambda: bound(k, v), launches, repeats),
        "torch index_copy_ x4": graph_time_us(index_copy, launches, repeats),
        "torch advanced indexing x4": graph_time_us(index_put, launches, repeats),
        "torch copy_ (same bytes)": graph_time_us(lambda: dst_buf.copy_(src_buf), launches,
                                                  repeats),
    }
    host = {"public op": host_us(public), "bound launcher": host_us(lambda: bound(k, v)),
            "torch index_copy_ x4": host_us(index_copy)}
    return rows, nbytes, host


def bench_copy(dev, launches, repeats):
    g = torch.Generator(device=dev).manual_seed(1)
    slots = 4096
    shape = (LAYERS, slots, H, D)
    k_pool = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
    v_pool = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(slots, device=dev, generator=g)
    src, dst = perm[:PAIRS].clone(), perm[PAIRS:2 * PAIRS].clone()
    src[::PAIRS // SENTINELS] = -1
    keep = src >= 0
    s_ok, d_ok = src[keep], dst[keep]  # the torch version gets pre-filtered lists
    wk, wv = k_pool.clone(), v_pool.clone()
    copy_kv_slots_(k_pool, v_pool, src, dst)
    copy_kv_slots_reference(wk, wv, src, dst)
    check("copy_kv_slots_", (k_pool, v_pool), (wk, wv))

    def kernel():
        copy_kv_slots_(k_pool, v_pool, src, dst)

    def torch_copy():
        k_pool[:, d_ok] = k_pool[:, s_ok]
        v_pool[:, d_ok] = v_pool[:, s_ok]

    nbytes = 2 * 2 * int(keep.sum()) * LAYERS * H * D * 2  # K and V, read + write
    rows = {"kernel": graph_time_us(kernel, launches, repeats),
            "torch advanced indexing (pre-filtered)": graph_time_us(torch_copy, launches,
                                                                    repeats)}
    return rows, nbytes, {"public op": host_us(kernel)}


def bench_rotate(dev, rows_n, launches, repeats):
    x = torch.arange(rows_n * ROW, device=dev, dtype=torch.int32).reshape(rows_n, ROW)
    shift = torch.tensor([37], device=dev)
    want = x.clone()
    rotate_rows_(x, shift)
    rotate_rows_reference(want, 37)
    check("rotate_rows_", (x,), (want,))
    table = {"kernel (device shift)": graph_time_us(lambda: rotate_rows_(x, shift), launches,
                                                    repeats),
             "torch roll + copy_": graph_time_us(lambda: x.copy_(torch.roll(x, -37, -1)),
                                                 launches, repeats)}
    nbytes = 2 * x.numel() * 4
    return table, nbytes, {"public op": host_us(lambda: rotate_rows_(x, shift))}


def vae_entry_setup(dev, entry=VAE_ENTRY):
    """A 2-row arena of ``entry`` [2, *entry], the folded conv's buffer [1, *entry[:-1],
    VAE_WIDTH], the view of its second tap and the row list [1]."""
    g = torch.Generator(device=dev).manual_seed(2)
    arena = torch.randn(2, *entry, device=dev, dtype=torch.bfloat16, generator=g)
    buf = torch.randn(1, *entry[:-1], VAE_WIDTH, device=dev, dtype=torch.bfloat16,
                      generator=g)
    C = entry[-1]
    return arena, buf, buf[..., C:2 * C], torch.tensor([1], device=dev)


def _rows_table(kernel, torch_fn, torch_name, nbytes, dev, launches, repeats):
    flat = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty_like(flat)
    return {"kernel": graph_time_us(kernel, launches, repeats),
            torch_name: graph_time_us(torch_fn, launches, repeats),
            "torch copy_ (same bytes, contiguous)": graph_time_us(
                lambda: flat_dst.copy_(flat), launches, repeats)}


def _rows_host(dev, load: bool) -> dict:
    arena, _, view, rows = vae_entry_setup(dev, (2, 4, 4, 96))
    if load:
        return {"public op (tiny entry)": host_us(lambda: copy_rows_(view, arena, src_rows=rows))}
    return {"public op (tiny entry)": host_us(lambda: copy_rows_(arena, view, dst_rows=rows))}


def bench_rows_load(dev, launches, repeats):
    arena, buf, view, rows = vae_entry_setup(dev)
    want = buf.clone()
    copy_rows_reference(want[..., VAE_ENTRY[-1]:2 * VAE_ENTRY[-1]], arena, src_rows=rows)
    copy_rows_(view, arena, src_rows=rows)
    check("copy_rows_ load", (buf,), (want,))
    del want
    nbytes = 2 * view.numel() * 2                 # read + write
    table = _rows_table(lambda: copy_rows_(view, arena, src_rows=rows),
                        lambda: torch.index_select(arena, 0, rows, out=view),
                        "torch index_select(out=)", nbytes, dev, launches, repeats)
    return table, nbytes, _rows_host(dev, load=True)


def bench_rows_store(dev, launches, repeats):
    arena, _, view, rows = vae_entry_setup(dev)
    want = arena.clone()
    want[1] = view[0]
    copy_rows_(arena, view, dst_rows=rows)
    check("copy_rows_ store", (arena,), (want,))
    del want
    nbytes = 2 * view.numel() * 2
    table = _rows_table(lambda: copy_rows_(arena, view, dst_rows=rows),
                        lambda: arena.index_copy_(0, rows, view),
                        "torch index_copy_", nbytes, dev, launches, repeats)
    return table, nbytes, _rows_host(dev, load=False)


# --- report -------------------------------------------------------------------------

def report(results: dict) -> None:
    print(f"{'op':<30}{'implementation':<42}{'µs':>9}{'GB/s':>9}")
    for op, r in results["ops"].items():
        for impl, us in r["kernel_us"].items():
            print(f"{op:<30}{impl:<42}{us:>9.2f}{r['bytes'] / us / 1e3:>9.0f}")
        for impl, us in r["host_us"].items():
            print(f"{op:<30}{'host/launch: ' + impl:<42}{us:>9.2f}")
    s = results["ops"]["scatter_kv_slots_"]
    print(f"scatter bandwidth / torch copy_ bandwidth: {s['fraction_of_copy']:.2f}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--launches", type=int, default=20, help="launches per graph")
    ap.add_argument("--repeats", type=int, default=50, help="graph replays timed")
    args = ap.parse_args(argv)
    require_cuda("framekv.bench.ops")
    dev = torch.device("cuda")
    ops = {}
    for name, fn in (("scatter_kv_slots_", lambda: bench_scatter(dev, args.launches, args.repeats)),
                     ("copy_kv_slots_", lambda: bench_copy(dev, args.launches, args.repeats)),
                     ("rotate_rows_ [1, 1300]", lambda: bench_rotate(dev, 1, args.launches,
                                                                     args.repeats)),
                     ("rotate_rows_ [36, 1300]", lambda: bench_rotate(dev, 36, args.launches,
                                                                      args.repeats)),
                     ("copy_rows_ load (VAE entry)", lambda: bench_rows_load(dev, args.launches,
                                                                             args.repeats)),
                     ("copy_rows_ store (VAE entry)", lambda: bench_rows_store(dev, args.launches,
                                                                               args.repeats))):
        table, nbytes, host = fn()
        ops[name] = {"kernel_us": table, "bytes": nbytes, "host_us": host,
                     "gb_per_s": {k: nbytes / us / 1e3 for k, us in table.items()}}
    s = ops["scatter_kv_slots_"]
    s["fraction_of_copy"] = s["kernel_us"]["torch copy_ (same bytes)"] / s["kernel_us"]["kernel"]
    results = kernel_results(geometry={"tokens": T, "kv_heads": H, "head_dim": D,
                                       "dtype": "bfloat16", "layers": LAYERS, "pairs": PAIRS,
                                       "row": ROW, "vae_entry": [1, *VAE_ENTRY],
                                       "vae_buffer_channels": VAE_WIDTH},
                             launches_per_graph=args.launches, repeats=args.repeats, ops=ops)
    report(results)
    dump_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
