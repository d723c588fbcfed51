"""End to end on a model preset: framekv (graphs, eager) against a dense rolling cache.

    python benchmarks/bench_e2e.py [--preset wan-1.3b] [--windows 21,60] [--chunks 8]
        [--variants framekv-graphs,framekv-eager,dense-eager,dense-graphs] [--json out.json]

Per-chunk latency and latent frames per second; see `framekv.bench.e2e`.
"""
import sys

from framekv.bench.e2e import main

if __name__ == "__main__":
    sys.exit(main())
