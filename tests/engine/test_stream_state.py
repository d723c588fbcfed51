"""Streams that leave a runner and come back: `ChunkRunner.snapshot` / `restore` and the
`StreamState` file, on CPU. A restored stream's chunks equal the uninterrupted run's bit
for bit; refusals and faults change nothing."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import Rollout, WanRollout
from framekv.engine.cache import CorruptFile
from framekv.engine.cache import cache as cache_mod
from framekv.engine.stream_state import StreamState
from framekv.engine.wan import CONFIGS, build_model


@pytest.fixture(scope="module")
def ref():
    return Rollout("tiny", device="cpu", sequences=3, use_graphs=False)


def fresh(r, **kw):
    out = Rollout("tiny", device="cpu", model=r.model, use_graphs=False,
                  **{"sequences": 3, **kw})
    out.prefill()
    return out


@pytest.mark.parametrize("to_row", [1, 2])
def test_a_restored_stream_goes_on_bit_for_bit(ref, tmp_path, to_row):
    a = fresh(ref)
    for _ in range(3):
        a.step()
    state = a.snapshot(1)
    path = tmp_path / "s.stream"
    state.save(path)
    b = fresh(ref)
    b.step()                                     # rows of b under way elsewhere
    b.restore(to_row, StreamState.load(path))
    assert b.sequence_chunks[to_row] == 3 and b.noise_streams[to_row] == a.noise_streams[1]
    for _ in range(4):
        want, got = a.step()[1], b.step()[to_row]
        assert torch.equal(want, got)


def test_a_wan_stream_with_guidance_and_history_moves_and_recaches_alike(tmp_path):
    model = build_model("tiny", seed=5)
    kw = dict(latent_size=(4, 4), frames_per_chunk=2, sink_frames=2, window_frames=4,
              timesteps=(1000, 500), use_graphs=False, guidance_scale=2.5, prompt_tokens=5)
    gen = torch.Generator().manual_seed(0)
    p1, p2 = (torch.randn(1, 5, CONFIGS["tiny"]["text_dim"], generator=gen) for _ in range(2))
    a, b = WanRollout(model, sequences=2, **kw), WanRollout(model, sequences=2, **kw)
    a.set_prompt(p1)
    b.set_prompt(p2)
    for _ in range(3):
        a.step()
    path = tmp_path / "w.stream"
    a.snapshot(0).save(path)
    b.restore(1, StreamState.load(path))
    assert torch.equal(a.step()[0], b.step()[1])
    a.prefill_rows([0, 2], p2, rewrite=True)     # the stream and its unconditional branch
    b.prefill_rows([1, 3], p2, rewrite=True)
    for _ in range(2):
        assert torch.equal(a.step()[0], b.step()[1])


def test_a_state_of_another_runner_is_refused_and_changes_nothing(ref):
    a = fresh(ref)
    a.step()
    b = fresh(ref, sequences=2)
    b.step()
    before = b.snapshot(0)
    state = a.snapshot(0)
    state.model = {**state.model, "frames_per_chunk": 7, "sampler": "other"}
    with pytest.raises(ValueError, match="frames_per_chunk: the state has 7.*sampler"):
        b.restore(0, state)
    after = b.snapshot(0)
    assert torch.equal(before.sequences[0].k, after.sequences[0].k) and after.chunks == 1
    with pytest.raises(ValueError, match="StreamState"):
        b.restore(0, before.sequences[0])
    with pytest.raises(ValueError, match="row must name"):
        b.restore(2, before)


def test_a_row_without_a_prompt_or_a_store_without_a_pool_has_no_snapshot(ref):
    a = fresh(ref)
    a.kv.reset_sequences([1])
    a._reset_rows([1])
    with pytest.raises(ValueError, match="no prompt"):
        a.snapshot(1)
    dense = Rollout("tiny", device="cpu", model=ref.model, use_graphs=False, kv="reference")
    dense.prefill()
    with pytest.raises(ValueError, match="paged pool"):
        dense.snapshot(0)


@pytest.mark.parametrize("under_way", [True, False])
def test_a_fault_mid_restore_puts_the_row_back(ref, monkeypatch, under_way):
    a = fresh(ref)
    for _ in range(2):
        a.step()
    state = a.snapshot(2)
    b, twin = fresh(ref), fresh(ref)
    if under_way:
        b.step()
        twin.step()
    real, calls = cache_mod.scatter, []

    def failing(*args):
        if calls:
            return real(*args)
        calls.append(1)
        raise RuntimeError("injected copy fault")

    monkeypatch.setattr(cache_mod, "scatter", failing)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        b.restore(0, state)
    if under_way:       # the row goes on as if nothing had happened
        assert b.sequence_chunks == twin.sequence_chunks
        assert torch.equal(b.step(), twin.step())
    else:               # the row had no history: it starts over without a prompt
        assert b.sequence_chunks[0] == 0
        with pytest.raises(ValueError, match="no prompt"):
            b.step()


def test_a_corrupt_stream_file_is_refused(ref, tmp_path):
    a = fresh(ref)
    a.step()
    path = tmp_path / "s.stream"
    a.snapshot(0).save(path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-7])
    with pytest.raises(CorruptFile):
        StreamState.load(path)
    path.write_bytes(raw[:-7] + bytes(b ^ 1 for b in raw[-7:]))
    with pytest.raises(CorruptFile, match="CRC"):
        StreamState.load(path)
