"""Shared by the benchmark scripts (the implementations live in `framekv.bench.timing`)."""
from framekv.bench.timing import captured_graph  # noqa: F401
