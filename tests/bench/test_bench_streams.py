"""The streams bench's judgement on the CPU: ratios to B = 1 and to in-turn rollouts,
each B's fraction of its roofline, and the bound on what batching can give."""
from __future__ import annotations

import pytest

from framekv import specs
from framekv.bench.breakdown import attention_flops, chunk_flops, reference_chunk_flops
from framekv.bench.streams import format_streams, judge


def _record(batched_ms: float, in_turn_ms: float, B: int, frames: int = 3) -> dict:
    fps = lambda ms: B * frames / (ms / 1e3)  # noqa: E731
    return {"batched": {"round_us": {"median": batched_ms * 1e3}, "frames_per_second": fps(batched_ms)},
            "in-turn": {"round_us": {"median": in_turn_ms * 1e3}, "frames_per_second": fps(in_turn_ms)}}


def test_judge_ratios_roofline_and_bound():
    per_b = {"1": _record(80.0, 80.0, 1), "2": _record(150.0, 160.0, 2), "8": _record(600.0, 640.0, 8)}
    flops = {"gemm": 12e12, "attention": 8e12}  # 20 TFLOP a chunk: 40 ms at 500 TFLOP/s
    res = judge(per_b, flops, 500.0)
    assert res["roofline_us_per_chunk"] == pytest.approx(40_000.0)
    b1, b2, b8 = (per_b[k]["batched"] for k in ("1", "2", "8"))
    assert b1["roofline_fraction"] == pytest.approx(0.5)
    assert b8["roofline_fraction"] == pytest.approx(8 * 40 / 600)
    assert res["max_gain_vs_b1"] == pytest.approx(2.0)
    assert b2["frames_per_second_vs_b1"] == pytest.approx(2 * 80 / 150)
    assert b8["latency_vs_b1"] == pytest.approx(600 / 80)
    assert b2["speedup_vs_in_turn"] == pytest.approx(160 / 150)
    # the bound holds for every B of this run: none is faster than the ceiling allows
    assert all(b["batched"]["frames_per_second_vs_b1"] <= res["max_gain_vs_b1"] for b in per_b.values())
    text = format_streams({"preset": "p", "layers": 2, "tokens_per_frame": 4, "window_frames": 6,
                           "frames_per_chunk": 3, "chunks": 2, **res})
    assert "no B can exceed 2.00x" in text and "0.53" in text  # B = 8 at 0.53 of its roofline


def test_without_b1_there_is_no_bound():
    res = judge({"2": _record(150.0, 160.0, 2)}, {"gemm": 1e12, "attention": 1e12}, 500.0)
    assert "max_gain_vs_b1" not in res and "frames_per_second_vs_b1" not in res["batches"]["2"]["batched"]


def test_reference_chunk_flops_counts_the_small_stream_chunk():
    pair = specs.load_preset("small-stream")
    m, r = pair.model, pair.rollout
    got = reference_chunk_flops((m, r))
    T, tpf = r.frames_per_chunk * r.tokens_per_frame, r.tokens_per_frame
    per_layer = (m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                 + m.num_heads * m.head_dim * m.hidden_size + 2 * m.hidden_size * m.ffn_size)
    want = chunk_flops(layers=m.num_layers, heads=m.num_heads, head_dim=m.head_dim,
                       pin=r.prompt_tokens, window=r.window_frames * tpf, tokens=T,
                       blocks=[T] * r.denoising_steps + [tpf],
                       linear_per_token=m.num_layers * per_layer + 2 * m.patch_dim * m.hidden_size)
    assert reference_chunk_flops((m, r), trimmed=False) == want
    # The K/V-only clean pass skips its last layer's attention and what follows its QKV.
    one = attention_flops(heads=m.num_heads, head_dim=m.head_dim, pin=r.prompt_tokens,
                          window=r.window_frames * tpf, tokens=T, block=tpf)
    tail = per_layer - m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    assert got["attention"] == want["attention"] - one
    assert got["gemm"] == want["gemm"] - 2 * T * (tail + m.patch_dim * m.hidden_size)
    assert got["gemm"] > 0 and got["attention"] > 0
