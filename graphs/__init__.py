"""framekv.graphs: capture callables as CUDA graphs by key, replay them, check replays.

Generic capture and replay over static buffers (DESIGN.md, "Graphs"). This package
knows the specs (a key holds a `framekv.specs.Geometry`) but not the cache: the engine
supplies the callables, the owner tokens and the host-mirror hooks.

- `GraphKey` / `TensorSpec`: everything baked into a graph; never the commit count.
  `chunk_key` builds the key of a whole chunk (forwards and commit as one graph);
  `owner_token` names an owner for its lifetime.
- `GraphCache`: warm-up, capture into one shared pool, replay (torch's
  ``CUDAGraph.replay``), stats; eager on CPU. Memset nodes become kernel nodes before
  instantiation (`framekv.graphs.rewrite`); `framekv.graphs.inspect` describes a graph.
- `run_warmup` (``GraphCache.warmup``), `format_report`, `encode_report`: capture
  every `CaptureRequest` (a rollout's graphs) up front, with a progress bar and a report.
- `check_replay` / `assert_replay_matches`: eager vs replayed, step by step.
"""
from .cache import GraphCache, GraphStats, KeyStats
from .captured import CapturedGraph, GraphCaptureError, named_outputs
from .keys import GraphKey, TensorSpec, dtype_name, input_specs, owner_token
from .programs import chunk_key
from .replay_check import (ReplayMismatch, assert_replay_matches, check_replay,
                           compare_outputs)
from .warmup import (CaptureRequest, WarmupRecord, WarmupReport, decode_report, encode_report,
                     format_report, run_warmup)

__all__ = [
    "CaptureRequest", "CapturedGraph", "GraphCache", "GraphCaptureError", "GraphKey",
    "GraphStats", "KeyStats", "ReplayMismatch", "TensorSpec", "WarmupRecord", "WarmupReport",
    "assert_replay_matches", "check_replay", "chunk_key", "compare_outputs", "decode_report",
    "dtype_name", "encode_report", "format_report", "input_specs", "named_outputs",
    "owner_token", "run_warmup",
]
