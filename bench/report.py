"""What benchmark reports share: a kernel bench's result header (`kernel_results`) and
its JSON (`dump_json`); a Wan rollout's shape in words and the cells of a chunk-time
table (`wan_shape`, `CHUNK_HEAD`, `chunk_cells`); the command line of a Wan rollout
section run as ``python -m framekv.bench.NAME`` (`section_parser`, `print_report`)."""
from __future__ import annotations

import argparse
import json

import torch

from .timing import write_result

__all__ = ["CHUNK_HEAD", "chunk_cells", "dump_json", "kernel_results", "print_report",
           "section_parser", "wan_shape"]

#: the heads of `chunk_cells`' columns
CHUNK_HEAD = f"{'ms/chunk':>10}{'p10':>9}{'p90':>9}{'frames/s':>10}"


def kernel_results(**fields) -> dict:
    """A numba-cuda kernel bench's results: the GPU, torch's and numba-cuda's versions,
    then ``fields``."""
    import numba_cuda

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "numba_cuda": getattr(numba_cuda, "__version__", "?"), **fields}


def dump_json(path: str | None, data: dict) -> None:
    """``data`` as indented JSON to ``path``; nothing when ``path`` is None."""
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)


def wan_shape(res: dict) -> str:
    """A Wan rollout's shape in words, from its sizes in ``res`` (latent_size,
    tokens_per_frame, sink_frames, window_frames, keys, frames_per_chunk)."""
    return (f"latent {res['latent_size'][0]}x{res['latent_size'][1]} "
            f"({res['tokens_per_frame']} tokens/frame), sink {res['sink_frames']} + window "
            f"{res['window_frames']} frames ({res['keys']} keys per forward), "
            f"{res['frames_per_chunk']}-frame chunks")


def chunk_cells(ms: dict, frames_per_second: float, digits: int) -> str:
    """A chunk time's median, p10 and p90 (``ms``, milliseconds, ``digits`` decimals)
    and the frames per second, under `CHUNK_HEAD`."""
    return (f"{ms['median']:>10.{digits}f}{ms['p10']:>9.{digits}f}{ms['p90']:>9.{digits}f}"
            f"{frames_per_second:>10.2f}")


def section_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a Wan rollout section, ``python -m framekv.bench.NAME`` (its
    description ``doc``'s first paragraph): ``--window`` and ``--json`` (``json_path``)."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog=f"python -m framekv.bench.{name}",
                                description=doc.split("\n\n")[0])
    p.add_argument("--window", type=int, default=21, help="window frames (default 21)")
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE",
                   help="write the results here, with the environment (JSON)")
    return p


def print_report(table: str, json_path: str | None, **sections) -> int:
    """Print a section's ``table``, write its ``sections`` as JSON (`write_result`);
    a command's exit status, 0."""
    print(table)
    write_result(json_path, **sections)
    return 0
