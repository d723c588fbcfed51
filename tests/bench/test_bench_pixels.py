"""`framekv.bench.pixels` on the CPU at the tiny config: every decoder decoded eager and
"graphed" (eager on a CPU: equal), the whole path in both modes through `DecodeLane`
(equal frames), the report's fields and table, the steady window; a bad --decoders or
--chunks is refused. The GPU
numbers are the bench's to take on a GPU (docs/benchmarks.md)."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from framekv.bench import pixels  # noqa: E402


def test_the_bench_runs_every_decoder_and_mode_at_the_tiny_config():
    res = pixels.measure_pixels(config="tiny", device="cpu", latent_size=(8, 8),
                                frames_per_chunk=2, window_frames=2, chunks=2, decode_iters=1,
                                progress=lambda m: None)
    assert res["gpu"] == "cpu" and set(res["decoders"]) == {"wan", "wan-modules", "tiny"}
    assert res["kv_dtype"] == "float32"                                  # the rollout's pool
    for kind, r in res["decoders"].items():
        d, e = r["decode"], r["e2e"]
        assert d["max_abs_diff_eager_graphed"] == 0.0, kind
        assert set(d["chunk_us"]) == {"eager", "graphed"}
        assert e["frames_equal"] is True and set(e["modes"]) == set(pixels.MODES)
        assert e["modes"]["overlapped"]["overlap"] is False              # no stream on a CPU
        for m in e["modes"].values():
            assert m["video_frames"] == 5 + 8 * (e["chunks"] - 1) and m["first_frame_s"] > 0
            assert m["steady_fps"] > 0 and m["overall_fps"] > 0
        assert e["dit_ms"]["median"] > 0 and e["decode_ms"]["median"] > 0
        assert e["dit_pipelined_ms"] > 0 and "decode_hidden" in e
        assert e["dit_bound_fps"] == pytest.approx(8 / e["dit_pipelined_ms"] * 1e3)
    table = pixels.format_pixels(res)
    assert "prompt to pixels on cpu: 64x64 video" in table and "tiny decoder" in table


def test_fp8_modes_start_from_the_same_pool_statistics(monkeypatch):
    """An fp8 pool scales attention's output by its running amax, which a rollout's reset
    keeps: the modes' frames are compared from zeroed statistics each time."""
    import torch

    from framekv.engine.cache import CausalKVCache

    resets, real = [], CausalKVCache.reset_kv_stats

    def spy(cache):
        resets.append(bool(cache.quantized) and float(cache.kv_amax.max()) > 0)
        real(cache)
    monkeypatch.setattr(CausalKVCache, "reset_kv_stats", spy)
    res = pixels.measure_pixels(decoders=("tiny",), config="tiny", device="cpu",
                                latent_size=(8, 8), frames_per_chunk=2, window_frames=2,
                                chunks=2, decode_iters=1, kv_dtype=torch.float8_e4m3fn,
                                progress=lambda m: None)
    assert res["kv_dtype"] == "float8_e4m3fn" and res["decoders"]["tiny"]["e2e"]["frames_equal"]
    assert len(resets) == 2 and all(resets)      # each time over statistics already gathered


def test_bad_decoders_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        pixels.main(["--decoders", "wan,taehv"])
    assert exc.value.code == 2 and "--decoders must be" in capsys.readouterr().err


def test_the_steady_rate_leaves_out_the_drained_last_chunk():
    # an overlapped loop: each chunk out 0.5 s after the last, the last one (the drain,
    # nothing made beside it) 0.1 s after its predecessor; the window full from chunk 2
    done = [0.4, 0.9, 1.4, 1.9, 2.4, 2.5]
    assert pixels._steady_s(done, fill=2) == pytest.approx(1.5)          # chunks 2, 3, 4


def test_fewer_than_two_steady_chunks_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        pixels.main(["--chunks", "1"])
    assert exc.value.code == 2 and "--chunks must be at least 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="chunks must be at least 2 .*got 1"):
        pixels.measure_e2e(None, None, None, chunks=1)
