"""framekv.bench: every measurement of framekv, as `framekv bench` sections and as
modules run on their own.

`framekv bench` sections (`framekv.tools.bench.SECTIONS`, which ``framekv bench
--help`` lists): attention, chunk, e2e, wan, streams, breakdown, pixels, fp8.

Modules run as ``python -m framekv.bench.NAME [--json FILE]`` (each checks its results
against a reference before timing and writes JSON; ``--help`` says what it takes). Each
but serve_load, cluster and swap_model need a CUDA GPU: without one it says so in one line
and exits with status 2 (`framekv.bench.timing.require_cuda`, called once its arguments
are checked):

    clean_pass      a clean pass kept for its K/V only against the whole clean pass
    commit          the commit at the seed geometry: kernels, uploads, device and host time
    fp8             bf16 against fp8 K/V, and fp8 K/V with fp8 GEMMs, side by side, speed
                    beside accuracy: one paged attention forward, the reference DiT's
                    held-out forward against fp32, the reference DiT, diffusers' Wan
    fp8_gemm        a block's linear layers, bf16 GEMMs against fp8 GEMMs, each with the
                    pass making its input (the norm writing e4m3 itself, the quantizer),
                    Wan 1.3B and 14B shapes at a chunk's tokens
    cluster         a live stream's move between replicas of `framekv serve --replicas`
                    (bytes, export, transfer, import, the client's gap), sessions
                    placed per second (``--device cpu``: runs on a CPU)
    cudnn_plans     cuDNN's execution plans for the paged forwards, each timed
    glue_ops        the fused glue ops, one call each at a model's chunk shape, against
                    a copy_ of their bytes
    graphs          host cost of a graph replay against many small launches
    launch          host cost of launching big graphs: node kinds, launch methods
    merge           the fused split-KV merge against torch merges
    ops             the ops at the seed geometry against torch equivalents
    pixels          prompt to pixels: each decoder's streaming decode, text to frames
    serve_load      sessions streaming from `framekv serve` in its own process, /metrics
                    scraped meanwhile (runs on a CPU too: ``--device cpu``)
    snapshots       a stream's export and import against PCIe, sessions over fewer slots
    startup         process start to the first replayed chunk, cold and warm
    streams         concurrent streams: B sequences batched on one pool against B in turn
    swap_model      the scheduler's swap policy replayed on a CPU against given step and
                    swap times: its steps, batches, swaps, fairness, ratio to resident
    ulysses         Ulysses attention over several GPUs (under torchrun)
    v2v             video in, video out: the streaming encoders (the Wan VAE's fused
                    program against diffusers' modules, the tiny one) per chunk
    vae_decode      the Wan VAE's streaming decode, the fused program against diffusers'
                    modules: time, error against fp32, peak memory
    wait            what a launch after a host wait costs, and what changes it
    wan             diffusers' Wan transformer end to end against dense baselines

Timing follows `framekv.bench.timing`: CUDA events around graph replays after
warm-up, the L2 flushed before each, medians and spreads. Results: docs/benchmarks.md.
"""
