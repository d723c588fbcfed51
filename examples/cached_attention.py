"""A rollout of one attention layer over the causal K/V cache, chunk by chunk.

    python examples/cached_attention.py [--device cuda]

Each chunk runs two denoising forwards (the whole chunk one causal block), a clean
pass with one-frame blocks, and commits the chunk; the output of every forward is
checked against the fp32 exact-window reference.
"""
import argparse

import torch

from framekv.engine import CachedAttention, CausalKVCache, ExactWindowReference
from framekv.specs import load_preset


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    preset = load_preset("tiny")
    geometry, m = preset.geometry(), preset.model
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    cache = CausalKVCache(num_layers=1, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                          dtype=dtype, tokens_per_page=m.tokens_per_page, device=args.device,
                          pool_tokens=CausalKVCache.pool_tokens_for(geometry, m.tokens_per_page))
    cache.open(geometry)
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    attn = CachedAttention(H, Hkv, D, backend="cudnn" if cuda else "reference", layer_idx=0)
    ref = ExactWindowReference(geometry, 1)
    chunk, frame = preset.rollout.chunk_tokens, preset.rollout.tokens_per_frame
    for c in range(preset.rollout.chunks):
        for block in (chunk, chunk, frame):  # two denoising steps, then the clean pass
            qkv = torch.randn(1, chunk, H + 2 * Hkv, D).to(args.device, dtype)
            out = attn(qkv, kv_cache=cache, seq_len=chunk, causal_block_size=block)
            ref.write(0, ref.committed, qkv[0, :, H:H + Hkv], qkv[0, :, H + Hkv:])
            want = ref.attention(0, qkv[0, :, :H], chunk, block)
            err = (out[0].float().cpu() - want).abs().max().item()
        cache.commit(chunk)
        ref.commit(chunk)
        print(f"chunk {c}: committed {cache.committed_tokens} tokens, "
              f"clean-pass max error vs exact window {err:.1e}")


if __name__ == "__main__":
    main()
