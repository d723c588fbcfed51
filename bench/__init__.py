"""framekv.bench: every measurement of framekv, as `framekv bench` sections and as
modules run on their own.

`framekv bench` sections (each a module with ``run(args) -> dict``):

    attention   one layer's attention at a spec's geometry: framekv's paged cuDNN
                path against dense torch SDPA variants, errors checked first
    chunk       the chunk cycle over every layer: forwards, clean pass, commit, as
                per-forward graphs and as one whole-chunk graph
    e2e         the reference model end to end: framekv against a dense rolling cache
    wan         diffusers' Wan transformer through `WanRollout` against dense baselines
    streams     concurrent streams: B sequences batched on one pool against B in turn

Modules run as ``python -m framekv.bench.NAME [--json FILE]`` (each checks its results
against a reference before timing and writes JSON):

    commit          the commit at the seed geometry: kernels, uploads, device and host time
    glue_ops        the fused glue ops, one call each at a model's chunk shape, against
                    a copy_ of their bytes
    graphs          host cost of a graph replay against many small launches
    launch          host cost of launching big graphs: node kinds, launch methods
    merge           the fused split-KV merge against torch merges
    ops             the ops at the seed geometry against torch equivalents
    ulysses         Ulysses attention over several GPUs (under torchrun)
    wait            what a launch after a host wait costs, and what changes it

Timing follows `framekv.bench.timing`: CUDA events around graph replays after
warm-up, the L2 flushed before each, medians and spreads. Results: docs/benchmarks.md.
"""
