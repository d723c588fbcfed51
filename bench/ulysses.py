"""Ulysses attention on several GPUs against one GPU: one layer's denoising forward.

    torchrun --nproc_per_node 2 -m framekv.bench.ulysses [--preset seed-bench]
        [--iters 50] [--graphs] [--no-flush] [--json out.json]

The forward is `framekv bench`'s ``framekv-denoise`` at the preset's geometry with a full
window (seed-bench: 32/8 heads of 128, 1576 queries as one causal block over 39,912
keys, bf16, cuDNN paged backend):

    single     `CachedAttention` with every head over a one-GPU cache (each rank times
               it on its own GPU, alone: nothing is exchanged)
    ulysses    `UlyssesAttention` over the W ranks: all-to-all of the rank's 1576 / W
               rows of q, k, v; H/W heads over a cache of H_kv/W heads; all-to-all back
    exchange   the two all-to-alls alone (what the parallelism adds)

Every rank fills its caches with the same random K/V (its cache holds its heads of the
one-GPU cache, copied), checks the sharded output against its rows of the one-GPU
output and of the fp32 exact-window reference, then times each variant with CUDA
events: a barrier before every iteration so the ranks start together, the L2 flushed
(unless ``--no-flush``), eager calls (``--graphs``: CUDA-graph replays, NCCL captured).
Reported: the median per rank; a parallel variant counts at its slowest rank. Rank 0
prints the JSON (and writes ``--json``).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from framekv import specs
from framekv.bench.attention import Setup
from framekv.bench.timing import Flusher, captured_graph, environment, require_cuda, summary
from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.attention.ulysses import UlyssesAttention, shard_sequence


def head_share(st: Setup, world: int, rank: int) -> CausalKVCache:
    """A cache of this rank's H_kv/W heads holding exactly those heads of ``st.cache``:
    the same commits (same slots), then the pool's head slice copied."""
    hkv = st.HKV // world
    cache = CausalKVCache(num_layers=1, num_kv_heads=hkv, head_dim=st.D, dtype=torch.bfloat16,
                          tokens_per_page=st.tpp, device="cuda",
                          pool_tokens=CausalKVCache.pool_tokens_for(st.g, st.tpp))
    cache.open(st.g)
    zeros = torch.zeros(st.T, hkv, st.D, dtype=torch.bfloat16, device="cuda")  # [T, H_kv/W, D]
    while cache.committed_tokens < st.cache.committed_tokens:
        cache.write_staged(0, zeros, zeros, st.T)
        cache.commit(st.T)
    heads = slice(rank * hkv, (rank + 1) * hkv)
    cache.k_pool.copy_(st.cache.k_pool[:, :, heads])                  # [1, slots, H_kv/W, D]
    cache.v_pool.copy_(st.cache.v_pool[:, :, heads])
    return cache


def timed(fn, iters: int, flush: Flusher, graphs: bool, warmup: int = 5) -> list[float]:
    """µs of each call between CUDA events, the ranks lined up by a barrier before each."""
    call = captured_graph(fn).replay if graphs else fn
    for _ in range(warmup):
        call()
    out = []
    for _ in range(iters):
        flush()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3)
    return out


def variants(st: Setup, world: int, rank: int):
    """name -> callable, and the error checks of the sharded output."""
    single = CachedAttention(st.H, st.HKV, st.D, backend="cudnn")
    ulysses = UlyssesAttention(st.H, st.HKV, st.D, backend="cudnn")
    local = head_share(st, world, rank)
    shard = shard_sequence(st.qkv, world, rank).contiguous()         # [1, T/W, H + 2 H_kv, D]
    T = st.T
    calls = {"single": lambda: single(st.qkv, kv_cache=st.cache, seq_len=T, causal_block_size=T),
             "ulysses": lambda: ulysses(shard, kv_cache=local, seq_len=T, causal_block_size=T),
             "exchange": lambda: ulysses.to_sequence(ulysses.to_heads(shard)[0])}
    one = shard_sequence(calls["single"]().float(), world, rank)      # [1, T/W, H, D]
    ref = shard_sequence(st.reference(T)[None], world, rank)
    got = calls["ulysses"]().float()
    errors = {"max_error_vs_single_gpu": (got - one).abs().max().item(),
              "max_error_vs_fp32_reference": (got - ref).abs().max().item(),
              "single_gpu_error_vs_fp32_reference": (one - ref).abs().max().item()}
    return calls, errors


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="seed-bench",
                    help="preset name or file (default seed-bench)")
    ap.add_argument("--iters", type=int, default=50, help="timed iterations per variant")
    ap.add_argument("--graphs", action="store_true",
                    help="time CUDA-graph replays, not eager calls")
    ap.add_argument("--no-flush", action="store_true", help="do not flush the L2 before each call")
    ap.add_argument("--json", help="rank 0 writes the results here")
    args = ap.parse_args(argv)
    require_cuda("framekv.bench.ulysses")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    world, rank = dist.get_world_size(), dist.get_rank()
    st = Setup(specs.load_preset(args.preset))                       # same data on every rank
    calls, errors = variants(st, world, rank)
    flush = Flusher(not args.no_flush)
    mine = {"rank": rank, **errors,
            **{name: summary(timed(fn, args.iters, flush, args.graphs))
               for name, fn in calls.items()}}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        result = report(st, args, ranks)
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


def report(st: Setup, args, ranks: list[dict]) -> dict:
    """Rank 0's summary: one GPU on rank 0, the parallel variants at their slowest rank."""
    slowest = {name: max(ranks, key=lambda r: r[name]["median"])[name]
               for name in ("ulysses", "exchange")}
    single = ranks[0]["single"]
    return {"preset": args.preset, "world_size": len(ranks), "heads": st.H, "kv_heads": st.HKV,
            "head_dim": st.D, "tokens": st.T, "keys": st.keys, "graphs": args.graphs,
            "flush_l2": not args.no_flush, "iters": args.iters, "environment": environment(),
            "single_gpu_us": single, "ulysses_us": slowest["ulysses"],
            "exchange_us": slowest["exchange"],
            "speedup": single["median"] / slowest["ulysses"]["median"],
            "exchange_fraction": slowest["exchange"]["median"] / slowest["ulysses"]["median"],
            "max_error_vs_single_gpu": max(r["max_error_vs_single_gpu"] for r in ranks),
            "max_error_vs_fp32_reference": max(r["max_error_vs_fp32_reference"] for r in ranks),
            "per_rank": ranks}


if __name__ == "__main__":
    main()
