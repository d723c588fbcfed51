"""The chunk cycle of the seed geometry's 36 layers and the warm-up of its plan.

    python benchmarks/bench_chunk.py [--preset seed-bench] [--iters 10] [--json out.json]

Whole-chunk replay host cost, the chunk's device time against the sum of its
forwards' and commit's, and the `framekv warmup` time cold and warm; see
`framekv.bench.chunk`.
"""
import sys

from framekv.bench.chunk import main

if __name__ == "__main__":
    sys.exit(main())
