"""`framekv.bench.v2v` on the CPU at the tiny config (eager, fp32): every encoder run
against its eager twin (equal) and the Wan VAE's programs against the fp32 modules (the
modules equal themselves, the fused program within fp32 rounding), the table; the
end-to-end part as a smoke run of the command (its JSON's fields, both modes over the
Wan VAE's coders: the tiny coders' full-width nets are slow on a CPU), the camera's arrivals and its pacing; a bad argument is refused before
anything is built. The GPU numbers are the bench's to take on a GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from framekv.bench import v2v  # noqa: E402


def test_every_encoder_against_eager_and_the_fp32_modules_at_the_tiny_config():
    res = v2v.measure_encoders(config="tiny", device="cpu", frame_size=(16, 24),
                               latent_frames=2, check_chunks=2, progress=lambda m: None,
                               encoders=v2v.ENCODERS + ("wan-fold0",))
    assert res["gpu"] == "cpu" and set(res["encoders"]) == {*v2v.ENCODERS, "wan-fold0"}
    assert res["frames_per_chunk"] == 8 and res["dtype"] == "float32"
    enc = res["encoders"]
    assert all(r["max_abs_diff_eager_graphed"] == 0.0 for r in enc.values())
    assert enc["wan-modules"]["max_abs_err"] == 0.0                   # the reference itself
    assert 0 < enc["wan"]["max_abs_err"] < 1e-5
    assert 0 < enc["wan-fold0"]["max_abs_err"] < 1e-5                  # no conv folded
    assert "max_abs_err" not in enc["tiny"]                           # another network
    table = v2v.format_encoders(res)
    assert "streaming encoders on cpu: 16x24 frames, 8-frame chunks (2 latent frames)" in table
    assert all(name in table for name in v2v.ENCODERS)
    tiny_row = next(line.split() for line in table.splitlines() if line.strip().startswith("tiny"))
    assert tiny_row[1:6] == ["-"] * 5          # not timed on a CPU, no fp32 reference: no number


@pytest.mark.parametrize("argv, words", [
    (["--parts", "pixels"], ["--parts must be a comma-separated list of encoders, e2e",
                             "'pixels'"]),
    (["--decoders", "wan-modules"], ["--decoders must be", "wan, tiny", "'wan-modules'"]),
    (["--strength", "0"], ["--strength must be a number in (0, 1]", "got 0.0"]),
    (["--strength", "1.5"], ["--strength must be a number in (0, 1]", "got 1.5"]),
    (["--chunks", "1"], ["--chunks must be at least 2, got 1"]),
    (["--input-fps", "0"], ["--input-fps must be a number > 0, got 0.0"]),
    (["--preset", "seed-bench"], ["--preset: invalid choice: 'seed-bench'"]),
    (["--encoders", "wan,big"], ["--encoders must be", "wan, wan-modules, tiny", "'wan,big'"]),
    (["--encoders", "wan-fold"], ["--encoders must be", "'wan-fold'"]),
    (["--iters", "0"], ["--iters must be at least 1, got 0"]),
])
def test_bad_arguments_are_refused_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        v2v.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and all(w in err for w in words), err
    assert "needs a CUDA GPU" not in err                              # checked before CUDA


def test_the_end_to_end_part_as_a_cpu_smoke_run(tmp_path, capsys):
    import json

    path = tmp_path / "v2v.json"
    assert v2v.main(["--device", "cpu", "--preset", "tiny", "--parts", "e2e", "--chunks", "2",
                     "--window", "1", "--repeats", "1", "--input-fps", "1000",
                     "--decoders", "wan", "--json", str(path)]) == 0
    res = json.loads(path.read_text())["v2v"]["e2e"]
    assert res["gpu"] == "cpu" and res["preset"] == "tiny" and res["video_size"] == [64, 64]
    assert res["steady_from_chunk"] == 2 and res["chunks"] == 4 and res["strength"] == 0.75
    assert set(res["decoders"]) == {"wan"} and res["input_fps"] == 1000
    for kind, modes in res["decoders"].items():
        assert set(modes) == {"text", "text-matched", "video"}
        assert modes["text"]["steps"] == 2 and modes["video"]["steps"] == 1     # 0.75 of (1000, 500)
        assert modes["text-matched"]["steps"] == 1 and "encode_ms" not in modes["text-matched"]
        assert "encode_ms" in modes["video"] and "encode_ms" not in modes["text"]
        for m in modes.values():
            assert m["video_frames"] == 5 + 8 * 3 and m["first_frame_s"] > 0
            assert m["steady_fps"] > 0 and m["overall_fps"] > 0 and len(m["steady_fps_rounds"]) == 1
            lat = m["latency_s"]
            assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
            assert m["dit_ms"]["n"] == m["decode_ms"]["n"] == 2                # the steady chunks
    table = capsys.readouterr().out
    rows = [ln.split()[:2] for ln in table.splitlines()]
    assert "video to video on cpu: 64x64" in table and rows.count(["wan", "video"]) == 1
    ratio = res["video_vs_text_matched"]["wan"]
    assert ratio == modes["video"]["steady_fps"] / modes["text-matched"]["steady_fps"]
    assert f"video / text-matched steady fps, wan: {ratio:.3f}" in table


def test_a_camera_gives_each_chunk_once_its_last_frame_arrived():
    from framekv.bench.v2v_e2e import camera_arrivals

    # 3 latent frames a chunk: frames 0..8, then 12 a chunk; frame j at j / 16 s
    assert camera_arrivals(3, 3, 16.0) == [8 / 16, 20 / 16, 32 / 16]


class _Lane:
    """A `DecodeLane` that holds one chunk beside the next, logging submits and takes."""

    overlap = 1

    def __init__(self, log):
        self.log, self.held = log, []

    def __len__(self):
        return len(self.held)

    def submit(self, x):
        self.log.append(("submit", x))
        self.held.append(x)

    def take(self):
        self.log.append(("take", self.held[0]))
        return self.held.pop(0)


def test_paced_chunks_start_after_their_arrival_and_are_not_held_back():
    import time

    from framekv.bench.pixels import roll_lane

    log, started = [], []

    def step(i):
        started.append(time.perf_counter() - t0)
        return i
    t0 = time.perf_counter()
    done, frames = roll_lane(step, _Lane(log), 3, t0, arrivals=[0.0, 0.05, 0.1])
    assert frames == [0, 1, 2] and len(done) == 3
    assert all(s >= a for s, a in zip(started, [0.0, 0.05, 0.1]))         # never before
    # the next chunk's frames were still to come: each chunk taken before the next starts
    assert log == [("submit", 0), ("take", 0), ("submit", 1), ("take", 1), ("submit", 2),
                   ("take", 2)]
    log.clear()
    roll_lane(lambda i: i, _Lane(log), 3, time.perf_counter())              # free: overlapped
    assert log == [("submit", 0), ("submit", 1), ("take", 0), ("submit", 2), ("take", 1),
                   ("take", 2)]
