"""framekv.graphs.resident: ways to run a captured graph other than torch's replay.

- `ResidentGraph` (`runner`, built by ``GraphCache.resident``): the graph looped on
  the device, each run submitted by one host store to a control block (`protocol`);
  the parent graph, its NVRTC gate kernels and the mapped block are built in `device`.
- `DirectLaunch` / `RngProbe` (`direct`, opt-in through ``GraphCache(...,
  direct_launch=True)``): a replay launched straight from torch's executable, skipping
  torch's generator prologue once replays showed the graph draws no random numbers.

Both take a `CapturedGraph`'s launcher slot (``entry.launcher``): a direct launch
replaces torch's replay; an open `ResidentGraph` makes replays raise until it closes.
"""
from .direct import DirectLaunch, RngProbe, default_generator_offset
from .runner import ResidentGraph

__all__ = ["DirectLaunch", "ResidentGraph", "RngProbe", "default_generator_offset"]
