"""`framekv bench`: framekv measured side by side with what users run instead.

Sections (each a module with ``run(args) -> dict``):

    attention   one layer's attention at a spec's geometry: framekv's paged cuDNN
                path against dense torch SDPA variants, errors checked first
    chunk       the chunk cycle over every layer: forwards, clean pass, commit, as
                per-forward graphs and as one whole-chunk graph
    e2e         the reference model end to end: framekv against a dense rolling cache

Timing follows `framekv.bench.timing`: CUDA events around graph replays after
warm-up, the L2 flushed before each, medians and spreads.
"""
