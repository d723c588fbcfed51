"""Many Wan streams on one pool, the re-cache of a stream's history under a new prompt,
and `StreamScheduler` over a `WanRollout` (the server's ``--model wan-diffusers``), on
the CPU in fp32."""
from __future__ import annotations

import functools

import pytest
import torch

from framekv.engine import WanRollout
from framekv.engine.history import History, pieces
from framekv.engine.step import chunk_noise
from framekv.engine.serving import StreamScheduler
from framekv.engine.wan import CONFIGS, build_model

TS = (1000, 500)
DIM = CONFIGS["tiny"]["text_dim"]
KW = dict(latent_size=(4, 4), frames_per_chunk=2, sink_frames=2, window_frames=4,
          timesteps=TS, use_graphs=False)


def text(seed: int, L: int = 5) -> torch.Tensor:
    return torch.randn(1, L, DIM, generator=torch.Generator().manual_seed(seed))


def noise(seed: int, i: int) -> torch.Tensor:
    return chunk_noise(seed, i, (4, 2, 4, 4))[None]                   # [1, C, F, H, W]


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", seed=3)


def alone(model, seed, n, prompt, *, change_at=None, new_prompt=None, **kw):
    """Chunks of one stream on a rollout of its own (prompt changes re-cached)."""
    r = WanRollout(model, **{**KW, **kw})
    r.set_prompt(prompt)
    out = []
    for i in range(n):
        if i == change_at:
            r.set_prompt(new_prompt, recache=True)
        out.append(r.step(noise(seed, i))[0])
    return out


def test_pieces_cut_at_the_sink_the_chunk_grid_and_gaps():
    assert pieces([0, 1, 2, 3, 4, 5], sink=1, per_chunk=2) == [[0], [1], [2, 3], [4, 5]]
    assert pieces([0, 1, 6, 7, 8], sink=2, per_chunk=3) == [[0, 1], [6, 7, 8]]
    assert pieces([0, 7, 8, 9, 10], sink=1, per_chunk=3) == [[0], [7, 8], [9, 10]]
    assert pieces([], sink=1, per_chunk=3) == []


def test_history_keeps_the_sink_and_the_last_window_frames():
    h = History(2, sink_frames=1, window_frames=3)
    for f0 in (0, 2, 4):
        h.add(1, f0, torch.full((1, 2, 1, 1), float(f0)) + torch.tensor([0.0, 1.0])[None, :, None, None])
    assert [f for f, _ in h.visible(1)] == [0, 3, 4, 5]
    assert [float(x) for _, x in h.visible(1)] == [0.0, 3.0, 4.0, 5.0]  # frame f holds f
    assert h.visible(0) == []
    h.clear(1)
    assert h.visible(1) == []


@pytest.mark.parametrize("glue", ["torch", "fused"])
def test_streams_in_one_batch_equal_each_stream_alone(model, glue):
    """Three streams at different frames and prompts, batched, equal each run alone
    (and, fused, the torch glue's streams: each row's rope from its own frame)."""
    r = WanRollout(model, sequences=3, prompt_tokens=5, glue=glue, **KW)
    prompts = [text(10 + i)[0] for i in range(3)]
    for i, p in enumerate(prompts):
        r.prefill_rows([i], p)
    seeds, starts = [7, 8, 9], [0, 1, 2]   # stream i joins at step i
    got = {i: [] for i in range(3)}
    for step in range(5):
        rows = [i for i in range(3) if step >= starts[i]]
        rows = rows + [i for i in range(3) if i not in rows]  # idle rows ride along
        idx = [max(step - starts[i], 0) for i in rows]
        nz = torch.cat([noise(seeds[i], k) for i, k in zip(rows, idx)])
        frame0 = torch.tensor([2 * k for k in idx])
        out = r.step_rows(rows, nz, frame0)
        for b, i in enumerate(rows):
            if step >= starts[i]:
                got[i].append(out[b])
            else:  # an idle row moved its sequence: start it over, as a scheduler does
                r.prefill_rows([i], prompts[i])
    for i in range(3):
        want = alone(model, seeds[i], len(got[i]), prompts[i][None])   # torch glue
        err = max(float((a - b).abs().max()) for a, b in zip(got[i], want))
        assert err <= 1e-5, (i, err)


@pytest.mark.parametrize("glue", ["torch", "fused"])
def test_recache_under_the_same_prompt_changes_nothing_before_the_window_slides(model, glue):
    """With the sink one chunk and nothing slid out yet, the re-cache's clean passes
    are the ones the stream ran: the next chunks are the same."""
    base = alone(model, 4, 4, text(1), glue=glue)
    again = alone(model, 4, 4, text(1), change_at=3, new_prompt=text(1), glue=glue)  # 6 frames
    assert max(float((a - b).abs().max()) for a, b in zip(base, again)) <= 1e-5


def test_recache_under_a_new_prompt_moves_the_stream(model):
    """The controls: a new prompt with and without re-cache both differ from the old
    prompt, and from each other (the history's K/V did change)."""
    old = alone(model, 4, 5, text(1))
    kept = alone(model, 4, 5, text(1), change_at=3, new_prompt=text(2))
    r = WanRollout(model, **KW)
    r.set_prompt(text(1))
    stale = [r.step(noise(4, i))[0] for i in range(3)]
    r.set_prompt(text(2))  # history K/V stay under the old prompt
    stale += [r.step(noise(4, i))[0] for i in range(3, 5)]
    assert float((kept[3] - old[3]).abs().max()) > 1e-3
    assert float((kept[3] - stale[3]).abs().max()) > 1e-4


def test_stream_arguments_are_checked(model):
    with pytest.raises(ValueError, match="sequences must be None or an integer >= 1"):
        WanRollout(model, sequences=0, **KW)
    from framekv.bench.dense import DenseRollingKV

    dense = DenseRollingKV(WanRollout(model, **KW).geometry, num_layers=2, num_kv_heads=2,
                           head_dim=12)
    with pytest.raises(ValueError, match="kv holds one sequence"):
        WanRollout(model, sequences=2, kv=dense, **KW)
    r = WanRollout(model, sequences=2, prompt_tokens=5, **KW)
    with pytest.raises(ValueError, match="keep the prompt length"):
        r.prefill_rows([0], text(1, L=6)[0])
    r.prefill_rows([0, 1])
    with pytest.raises(ValueError, match=r"noise must be a \[2, 4, 2, 4, 4\] tensor"):
        r.step_rows([0, 1], torch.zeros(2, 4, 3, 4, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="batch sizes"):
        r.step_rows([0], torch.zeros(1, 4, 2, 4, 4), torch.zeros(1))
    with pytest.raises(ValueError, match="no prompt"):
        WanRollout(model, sequences=2, prompt_tokens=5, **KW).step()


def test_scheduler_sessions_over_wan_equal_each_seed_alone_with_a_prompt_change(model):
    """The server's Wan mode: 3 sessions stepped together (one joins late, one changes
    its prompt mid-stream) equal each seed run alone, the change re-cached offline."""
    make = functools.partial(WanRollout, model, prompt_tokens=5, **KW)
    sched = StreamScheduler(max_sessions=3, device="cpu", runner_factory=make, queue_chunks=8)
    try:
        assert sched.chunk_shape == (4, 2, 4, 4) and sched.prompt_shape == (5, DIM)
        a = sched.open_session(seed=21, chunks=5)
        b = sched.open_session(seed=22, chunks=5, prompt=text(3)[0])
        sched.step()
        sched.step()
        c = sched.open_session(seed=23, chunks=3)
        sched.step()
        sched.set_prompt(b.id, text(4)[0])      # before b's chunk 3
        while sched.step():
            pass
        default = sched.runner.default_prompt()[None]
        cases = [(a, default, None, None), (b, text(3), 3, text(4)), (c, default, None, None)]
        for s, prompt, at, new in cases:
            chunks = list(s.delivery.queue)
            assert [k.index for k in chunks] == list(range(s.budget))
            want = alone(model, s.seed, s.budget, prompt, change_at=at, new_prompt=new)
            err = max(float((k.latents - w).abs().max()) for k, w in zip(chunks, want))
            assert err <= 1e-5, (s.seed, err)
        assert [k.prompt_version for k in b.delivery.queue] == [0, 0, 0, 1, 1]
    finally:
        sched.close()


def test_guided_sequences_equal_each_guided_sequence_alone(model):
    """guidance_scale with sequences=2: sequence s and its unconditional branch (pool
    sequence 2 + s) run as rows of one batch; each equals a guided one-sequence rollout
    of its own prompt, noise and frames (fp32)."""
    many = WanRollout(model, sequences=2, guidance_scale=3.0, prompt_tokens=5, **KW)
    alone_ = [WanRollout(model, guidance_scale=3.0, **KW) for _ in range(2)]
    many.prefill_rows([0], text(1)[0])
    many.prefill_rows([1], text(2)[0])
    many.prefill_rows([2, 3], torch.zeros(5, DIM))                    # the branches: empty
    for r, p in zip(alone_, (text(1), text(2))):
        r.set_prompt(p)
    for i in range(4):
        nz = torch.cat([noise(30 + s, i) for s in range(2)])
        got = many.step(nz)                                            # [2, C, F, H, W]
        for s, r in enumerate(alone_):
            want = r.step(noise(30 + s, i))
            assert float((got[s] - want[0]).abs().max()) <= 1e-5, (i, s)
    assert many.cache.num_sequences == 4 and many.sequence_frames == [8, 8]


def test_a_guided_recache_under_the_same_prompt_changes_nothing(model):
    """A re-cache recomputes both branches' history (each under its own prompt): under
    the same prompts, before the window slides, the next chunks are unchanged."""
    def run(change_at):
        r = WanRollout(model, guidance_scale=2.0, **KW)
        r.set_prompt(text(1), text(5))
        out = []
        for i in range(4):
            if i == change_at:
                r.set_prompt(text(1), text(5), recache=True)
            out.append(r.step(noise(4, i))[0])
        return out
    base, again = run(None), run(3)
    assert max(float((a - b).abs().max()) for a, b in zip(base, again)) <= 1e-5
