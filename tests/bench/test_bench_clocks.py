"""The clock sampler on the CPU: parsing nvidia-smi's CSV, the summary, the sampler's
process around a block (a stand-in tool), and what the breakdown makes of it."""
from __future__ import annotations

import os
import stat
import sys
import textwrap
import time

import pytest

from framekv.bench import breakdown, clocks


def test_parse_keeps_good_lines_and_drops_the_rest():
    text = ("1785, 1980, 692.44, 700.00, 0x0000000000000004\n"
            "1980, 1980, 122.9, 700.00, 0x0000000000000000\n"
            "[N/A], 1980, 100, 700, 0x0\n"          # a field the board does not report
            "1800, 1980, 650\n")                    # a line cut by the stop
    assert clocks.parse_samples(text) == [(1785.0, 1980.0, 692.44, 700.0, 4),
                                          (1980.0, 1980.0, 122.9, 700.0, 0)]


def test_summary_means_and_power_capped_share():
    samples = [(1600.0, 1980.0, 700.0, 700.0, 0x4), (1800.0, 1980.0, 650.0, 700.0, 0x4 | 0x20),
               (1900.0, 1980.0, 400.0, 700.0, 0x0), (1700.0, 1980.0, 690.0, 700.0, 0x1)]
    s = clocks.summarise_samples(samples)
    assert s == {"samples": 4, "sm_mhz_mean": 1750.0, "sm_mhz_max": 1980.0,
                 "power_w_mean": 610.0, "power_limit_w": 700.0, "power_capped_share": 0.5}
    assert clocks.summarise_samples([]) is None


def _stand_in(tmp_path, lines: list[str]) -> str:
    """An executable printing ``lines`` then waiting to be stopped, as nvidia-smi -lms
    does; it records its arguments next to itself."""
    tool = tmp_path / "smi"
    tool.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys, time
        open({str(tmp_path / 'argv')!r}, 'w').write(' '.join(sys.argv[1:]))
        for line in {lines!r}:
            print(line, flush=True)
        time.sleep(60)
        """))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return str(tool)


def test_sampler_runs_the_tool_beside_the_block_and_stops_it(tmp_path):
    tool = _stand_in(tmp_path, ["1800, 1980, 690, 700, 0x4", "1900, 1980, 500, 700, 0x0"])
    sampler = clocks.ClockSampler("GPU-abc", period_ms=50, command=tool)
    with sampler:
        for _ in range(200):  # until the stand-in has started (it is a Python)
            if os.path.exists(tmp_path / "argv"):
                break
            time.sleep(0.05)
        time.sleep(0.3)       # and printed
    assert sampler._proc.poll() is not None  # stopped at exit, not left running
    argv = (tmp_path / "argv").read_text()
    assert "-lms 50" in argv and "-i GPU-abc" in argv and "clocks_event_reasons" in argv
    s = sampler.summary()
    assert s["samples"] == 2 and s["sm_mhz_mean"] == 1850.0 and s["power_capped_share"] == 0.5


def test_sampler_without_the_tool_samples_nothing(tmp_path):
    with clocks.ClockSampler(0, command=str(tmp_path / "no-such-tool")) as sampler:
        pass
    assert sampler.summary() is None


def test_period_below_ten_ms_is_refused():
    with pytest.raises(ValueError, match="period_ms: expected at least 10, got 5"):
        clocks.ClockSampler(0, period_ms=5)


def test_breakdown_scales_the_roofline_by_the_sampled_clock():
    profile = {"us": {"attention": 300.0, "gemm": 80.0, "framekv": 15.0, "other": 5.0},
               "kernels": 10, "top_other": []}
    flops = {"gemm": 40e12, "attention": 160e12}
    c = clocks.summarise_samples([(1800.0, 1980.0, 690.0, 700.0, 4)] * 3)
    r = breakdown.summarise(profile, flops, 800.0, [400e3, 410e3, 420e3], c)
    assert r["fraction"] == pytest.approx(250e3 / 410e3)       # 200 TFLOP at 800 TFLOP/s
    assert r["fraction_at_clock"] == pytest.approx(250e3 / 410e3 * 1980 / 1800)
    line = breakdown.format_breakdown("m", r)
    assert "SMs at 1800 of 1980 MHz" in line and "power-capped 100%" in line
    plain = breakdown.summarise(profile, flops, 800.0, [410e3])
    assert plain["clocks"] is None and "fraction_at_clock" not in plain
    assert "SMs at" not in breakdown.format_breakdown("m", plain)
