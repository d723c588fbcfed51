"""framekv.bench.small_chunks on CPU: its specs, its command line and its table (the
measurement itself needs a GPU)."""
from __future__ import annotations

import pytest

from framekv.bench import small_chunks
from framekv.bench.timing import summary


def test_mid_preset_is_a_valid_mid_size_spec():
    p = small_chunks.mid_preset()
    assert (p.model.num_layers, p.model.hidden_size, p.model.num_heads, p.model.head_dim) == \
        (4, 512, 8, 64)
    assert p.rollout.tokens_per_frame == p.model.tokens_per_frame == 256
    assert (p.rollout.frames_per_chunk, p.rollout.window_frames) == (2, 6)
    assert small_chunks.skipped_chunks(p) == 3  # the window fills after three chunks
    assert small_chunks.skipped_chunks(small_chunks.preset_for("tiny")) == 2


def test_arguments_default_and_parse():
    a = small_chunks.parse_args([])
    assert (a.specs, a.rounds, a.chunks, a.json) == (["tiny", "mid"], 5, 10, None)
    a = small_chunks.parse_args(["--specs", "tiny", "--rounds", "2", "--chunks", "3",
                                 "--json", "out.json"])
    assert (a.specs, a.rounds, a.chunks, a.json) == (["tiny"], 2, 3, "out.json")


@pytest.mark.parametrize("argv,message", [
    (["--specs", "huge"], "--specs: expected names from ['tiny', 'mid'], got ['huge']"),
    (["--specs", ","], "--specs: expected names from ['tiny', 'mid'], got (none)"),
    (["--rounds", "0"], "--rounds: expected at least 1, got 0"),
    (["--chunks", "3"], "--chunks: expected more than 3 (the chunks before the window is "
                        "full are not timed), got 3"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        small_chunks.parse_args(argv)
    assert message in capsys.readouterr().err


def fake_results() -> dict:
    samples = {"replayed": {"wall_us": [200.0, 210.0, 220.0], "step_host_us": [8.0, 9.0, 10.0]},
               "resident": {"wall_us": [190.0, 200.0, 210.0],
                            "step_host_us": [180.0, 190.0, 200.0]}}
    spec = small_chunks.summarize("mid", small_chunks.mid_preset(), 3, samples)
    return {"specs": [spec]}


def test_summary_ratios_are_resident_over_replayed():
    s = fake_results()["specs"][0]
    assert s["replayed"]["wall_us"] == summary([200.0, 210.0, 220.0])
    assert s["ratio"]["wall_us"] == pytest.approx(200 / 210)
    assert s["ratio"]["step_host_us"] == pytest.approx(190 / 9)
    assert (s["chunk_tokens"], s["layers"], s["skipped_chunks"]) == (512, 4, 3)


def test_table_has_a_row_per_variant_and_the_ratios():
    lines = small_chunks.format_table(fake_results()).splitlines()
    assert lines[0].split()[:3] == ["spec", "tokens", "variant"]
    replayed, resident, ratio = lines[1:]
    assert replayed.split()[:5] == ["mid", "512", "replayed", "210.0", "200.0-220.0"]
    assert resident.split()[2:4] == ["resident", "200.0"]
    assert ratio.split() == ["mid", "res/rep", "0.952", "21.111"]
