"""framekv.graphs: capture callables as CUDA graphs by key, replay them, check replays.

Generic capture and replay over static buffers (DESIGN.md, "Graphs"). This package
knows the specs (a key holds a `framekv.specs.Geometry`) but not the cache: the engine
supplies the callables, the owner tokens and the host-mirror hooks.

- `GraphKey` / `TensorSpec`: everything baked into a graph; never the commit count.
  `forward_key`, `commit_key`, `chunk_key` build the standard ones; `owner_token`
  names an owner for its lifetime.
- `GraphCache`: warm-up, capture into one shared pool, replay (torch's
  ``CUDAGraph.replay``), stats; eager on CPU. Memset nodes become kernel nodes before
  instantiation (`framekv.graphs.rewrite`); `framekv.graphs.inspect` describes a graph.
- `ResidentGraph` (``GraphCache.resident``): a captured graph looped on the device,
  each run submitted by one host store instead of a launch (`framekv.graphs.resident`,
  which also holds the opt-in direct launch, ``GraphCache(direct_launch=True)``).
- `SequenceProgram` / `Step`: a per-chunk program (forwards and a commit) as one
  callable whose key is derived from its steps.
- `run_warmup` (``GraphCache.warmup``), `format_report`, `encode_report`: capture a
  whole `framekv.specs.WarmupPlan` up front.
- `check_replay` / `assert_replay_matches`: eager vs replayed, step by step.
"""
from .cache import GraphCache, GraphStats, KeyStats
from .captured import CapturedGraph, GraphCaptureError, named_outputs
from .keys import GraphKey, TensorSpec, dtype_name, input_specs, owner_token
from .programs import (SequenceProgram, Step, chunk_key, chunk_labels, commit_key, forward_key,
                       program_string)
from .replay_check import (ReplayMismatch, assert_replay_matches, check_replay,
                           compare_outputs)
from .resident import ResidentGraph
from .warmup import (CaptureRequest, WarmupRecord, WarmupReport, decode_report, encode_report,
                     format_report, run_warmup)

__all__ = [
    "CaptureRequest", "CapturedGraph", "GraphCache", "GraphCaptureError", "GraphKey",
    "GraphStats", "KeyStats", "ReplayMismatch", "ResidentGraph", "SequenceProgram", "Step",
    "TensorSpec", "WarmupRecord", "WarmupReport", "assert_replay_matches", "check_replay",
    "chunk_key", "chunk_labels", "commit_key", "compare_outputs", "decode_report",
    "dtype_name", "encode_report", "format_report", "forward_key", "input_specs",
    "named_outputs", "owner_token", "program_string", "run_warmup",
]
