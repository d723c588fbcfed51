"""Split-KV rows of the attention section: the paged forward at each S, explicitly.

``framekv-denoise`` and ``framekv-clean`` run the backend's own choice (the wave
model, and whether to pack query heads); these rows pin both, so the choice can be
checked against every alternative:

    framekv-denoise-S<k>          the denoising forward (one block) with k sub-rows per
                                  row, query heads not packed
    framekv-clean-S<k>            the clean pass (one-frame blocks) with k sub-rows per
                                  row, query heads not packed
    framekv-denoise-S<k>-packed   the same forwards with the query heads that share a
    framekv-clean-S<k>-packed     K/V head stacked along the query axis (only with
                                  more query heads than K/V heads)

Each includes the K/V write and, for k > 1, the sub-row rebuild and the merge.
"""
from __future__ import annotations

from framekv.engine import CachedAttention
from framekv.engine.attention.cudnn import CudnnBackend


def variants_for(splits):
    """The ``extra`` argument of `framekv.bench.attention.measure_attention`: a function
    of the `Setup` returning name -> (callable, block size) for S = 1 and each of
    ``splits``, unpacked and, where there are more query than K/V heads, packed."""
    values = sorted({1, *splits})
    for s in values:
        if s < 1:
            raise ValueError(f"split counts must be >= 1, got {s}")

    def build(st) -> dict:
        # Packing stacks a K/V head's query heads: without GQA there is nothing to stack.
        packs = (False, True) if st.H > st.HKV else (False,)
        rows = {}
        for s in values:
            for pack in packs:
                backend = CudnnBackend(split=s, pack=pack)
                mod = CachedAttention(st.H, st.HKV, st.D, backend=backend, layer_idx=0)
                for name, b in (("denoise", st.T), ("clean", st.frame)):
                    rows[f"framekv-{name}-S{s}{'-packed' if pack else ''}"] = (
                        (lambda mod=mod, b=b: mod(st.qkv, kv_cache=st.cache, seq_len=st.T,
                                                  causal_block_size=b)[0]), b)
        return rows
    return build
