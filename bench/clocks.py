"""The GPU's SM clock and power draw while a measurement runs, sampled by ``nvidia-smi``.

Why: `timing.matmul_ceiling` measures a short burst, which runs at the boost clock. A
whole chunk of GEMMs and attention runs long enough to reach the board's power limit,
and the driver then lowers the SM clock (clock event reason 0x4, the software power
cap): on the H200, 1,800 MHz on average against 1,980 (docs/benchmarks.md). A chunk's
fraction of a roofline taken at the burst clock mixes the code's efficiency with the
board's power budget; the sampled clock separates the two.

``with ClockSampler(device_index) as clocks: ...`` runs ``nvidia-smi --query-gpu ...
-lms PERIOD`` beside the block and stops it at exit; ``clocks.summary()`` then gives
the mean SM clock, the board's maximum, the mean draw, the limit and the share of
samples held by the power cap, or None where nothing was sampled (no ``nvidia-smi``,
a block shorter than one period). Sampling costs the GPU nothing: the tool reads the
driver's counters from another process.
"""
from __future__ import annotations

import statistics
import subprocess

_FIELDS = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active"
POWER_CAP = 0x4  # clock event reason: the software power cap


def parse_samples(text: str) -> list[tuple[float, float, float, float, int]]:
    """(sm MHz, max sm MHz, draw W, limit W, event reasons) of each line of ``nvidia-smi
    --format=csv,noheader,nounits`` output; lines that do not parse (a field the board
    reports as "[N/A]", a line cut by the stop) are left out."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            out.append((float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]),
                        int(parts[4], 16)))
        except ValueError:
            continue
    return out


def summarise_samples(samples) -> dict | None:
    """Mean SM clock and draw, the board's maximum clock and power limit, and the share
    of samples held by the power cap; None for no samples."""
    if not samples:
        return None
    return {"samples": len(samples),
            "sm_mhz_mean": statistics.fmean(s[0] for s in samples),
            "sm_mhz_max": max(s[1] for s in samples),
            "power_w_mean": statistics.fmean(s[2] for s in samples),
            "power_limit_w": max(s[3] for s in samples),
            "power_capped_share": sum(1 for s in samples if s[4] & POWER_CAP) / len(samples)}


class ClockSampler:
    """Samples one GPU's clock and power while its ``with`` block runs (module doc).

    Args:
        device: the device's ``nvidia-smi -i`` id (an index or ``GPU-<uuid>``; see
            `device_id`).
        period_ms: sampling period (>= 10).
        command: the tool to run (tests give a stand-in).
    """

    def __init__(self, device: str | int = 0, period_ms: int = 100,
                 command: str = "nvidia-smi"):
        if period_ms < 10:
            raise ValueError(f"period_ms: expected at least 10, got {period_ms}")
        self._argv = [command, f"--query-gpu={_FIELDS}", "--format=csv,noheader,nounits",
                      "-lms", str(int(period_ms)), "-i", str(device)]
        self._proc = None
        self._samples: list = []

    def __enter__(self) -> "ClockSampler":
        try:
            self._proc = subprocess.Popen(self._argv, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi: the measurement runs unsampled
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            text, _ = self._proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            text, _ = self._proc.communicate()
        self._samples = parse_samples(text or "")

    def summary(self) -> dict | None:
        """`summarise_samples` of what the last ``with`` block sampled."""
        return summarise_samples(self._samples)


def device_id(index: int) -> str:
    """``nvidia-smi -i`` id of torch's CUDA device ``index``: its UUID, which stays right
    under ``CUDA_VISIBLE_DEVICES`` (nvidia-smi numbers all the host's GPUs)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"GPU-{uuid}" if uuid else str(index)
