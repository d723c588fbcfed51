"""The sampler seam (`framekv.engine.samplers`): the registry, ``steps`` (``--steps``),
and a sampler registered here, in this file alone, running through `ChunkRunner`,
``framekv generate`` and a served session with nothing changed elsewhere; no module of
engine/, tools/ or bench/ but the samplers' own names a sampler.

The toy sampler runs a suffix of its schedule (``skip``), starts from its noise scaled
to its first sigma, takes a static input of its own (``jitter``, drawn per stream and
chunk) and re-noises between calls: every part of the protocol. Its chunks are checked
against the same arithmetic written out here over the runner's own forwards (fp32).
"""
from __future__ import annotations

import ast
import functools
import io
import json
import pathlib

import msgspec
import pytest
import torch

from framekv.engine.rollout import Rollout
from framekv.engine.samplers import (EulerSampler, ScheduleSampler, build_sampler,
                                     get_sampler, named_samplers, pick_steps,
                                     register_sampler, samplers, unregister_sampler)
from framekv.engine.serving import StreamScheduler
from framekv.engine.step import StepPlan, chunk_noise, chunk_renoise, noise_seed, sampler_inputs
from framekv.specs import load_preset

ROOT = pathlib.Path(__file__).resolve().parents[3]
TINY = load_preset("tiny")
#: The toy's jitter streams in `noise_seed`'s ``sequence``: apart from every other stream.
JITTER = 3 << 32


class ToySampler(ScheduleSampler):
    """Euler over the steps after the first ``skip``, from the chunk's noise scaled to
    the first of them, and between calls a churn: x += eta * sigma_{i+1} * jitter_i
    (the stream's own, or what its source brings)."""

    def __init__(self, timesteps, timestep_scale, *, eta: float = 0.5, skip: int = 0):
        if not 0 <= skip < len(timesteps):
            raise ValueError(f"skip must be in [0, {len(timesteps)}), got {skip!r}")
        super().__init__(list(timesteps)[skip:], timestep_scale)
        self.eta, self.options = eta, {"eta": eta, "skip": skip}

    def input_shapes(self, chunk_shape):
        return {"jitter": (len(self.timesteps) - 1, *chunk_shape)}

    def row_inputs(self, seed, index, chunk_shape, sequence=0, source=None):
        if source is not None:
            return {"jitter": source}
        gen = torch.Generator().manual_seed(noise_seed(seed, index, sequence + JITTER))
        return {"jitter": torch.randn(len(self.timesteps) - 1, *chunk_shape, generator=gen)}

    def start(self, noise, inputs):
        return self.sigmas[0] * noise

    def update(self, x, v, i):
        return x + (self.sigmas[i + 1] - self.sigmas[i]) * v

    def renoise(self, x, i, inputs):
        return x + self.eta * self.sigmas[i + 1] * inputs["jitter"][:, i]


@pytest.fixture
def toy():
    register_sampler("toy", ToySampler)
    yield "toy"
    unregister_sampler("toy")


def specs(**rollout):
    return TINY.model, msgspec.structs.replace(TINY.rollout, **rollout)


@torch.no_grad()
def by_hand(r, x, timesteps, step):
    """One chunk of the one-sequence euler `Rollout` ``r`` written out: from latents x
    [1, C, F, H, W], ``step(x, v, i)`` after each forward at ``timesteps`` (the runner's
    own forwards, the whole chunk one block), then its clean pass."""
    frame0 = torch.tensor([r.frames_done])
    T = x.shape[2] * r.tokens_per_frame
    for i, t in enumerate(timesteps):
        x = step(x, r._forward(x, torch.full((1,), t), frame0, T), i)
    r._clean_pass(x, frame0)
    r.sequence_frames[0] += x.shape[2]
    return x


# ----------------------------------------------------------------------------- the registry
def test_the_registry_names_its_samplers_and_refuses_bad_entries():
    assert samplers()[:3] == ("euler", "self_forcing", "v2v")
    assert get_sampler("euler") is EulerSampler
    with pytest.raises(ValueError, match="sampler must be one of 'euler', 'self_forcing', "
                                         "'v2v', got 'ddim'"):
        get_sampler("ddim")
    for name, cls, words in [("euler", ToySampler, "registered already"),
                             ("Toy-2", ToySampler, "lower-case identifier"),
                             ("toy2", 3, "cls must be a callable")]:
        with pytest.raises(ValueError, match=words):
            register_sampler(name, cls)
    with pytest.raises(ValueError, match="must not be a built-in sampler"):
        unregister_sampler("euler")
    with pytest.raises(ValueError, match="name must be one of .* got 'nope'"):
        unregister_sampler("nope")
    assert samplers() == ("euler", "self_forcing", "v2v")


def test_build_sampler_names_a_bad_option_or_a_class_that_is_no_sampler():
    with pytest.raises(ValueError, match="do not fit the euler sampler"):
        build_sampler("euler", [1.0, 0.5], 1.0, {"eta": 1.0})
    with pytest.raises(ValueError, match="sampler_options must be a mapping"):
        build_sampler("euler", [1.0], 1.0, [("eta", 1.0)])
    with pytest.raises(ValueError, match="timesteps must be a decreasing sequence"):
        build_sampler("euler", [0.5, 1.0], 1.0)
    register_sampler("broken", lambda timesteps, scale: object())
    try:
        with pytest.raises(ValueError, match="lacks the Sampler protocol"):
            build_sampler("broken", [1.0], 1.0)
    finally:
        unregister_sampler("broken")


@pytest.mark.parametrize("count, steps, picked", [
    (4, None, [0, 1, 2, 3]), (4, 4, [0, 1, 2, 3]), (4, 2, [0, 2]), (4, 3, [0, 1, 2]),
    (4, 1, [0]), (6, 4, [0, 1, 3, 4]), (1, 1, [0])])
def test_pick_steps_takes_evenly_spaced_steps_from_the_first(count, steps, picked):
    ts = [1000.0 - 100.0 * i for i in range(count)]
    assert pick_steps(ts, steps) == tuple(ts[i] for i in picked)


@pytest.mark.parametrize("steps", [0, 5, True, 2.0, "2"])
def test_pick_steps_names_a_bad_count_and_the_range(steps):
    with pytest.raises(ValueError, match=r"steps must be an integer in \[1, 4\] \(how many of "
                                         rf"the preset's 4 denoising steps run\), got {steps!r}"):
        pick_steps([1000, 750, 500, 250], steps)


def test_a_plan_draws_each_streams_inputs_from_its_key_or_its_source(toy):
    sampler = build_sampler(toy, [1.0, 0.5, 0.25], 1.0)
    shape = (4, 2, 8, 8)
    given = torch.full((2, *shape), 3.0)
    plan = StepPlan(rows=[5, 1, 0], keys=[(11, 2), (12, 0)], sources=[None, given])
    plan.draw_noise(shape, sampler)
    jitter = plan.inputs["jitter"]                                   # [3, 2, 4, 2, 8, 8]
    assert list(plan.inputs) == ["jitter"] and jitter.shape == (3, 2, *shape)
    assert torch.equal(jitter[0], sampler.row_inputs(11, 2, shape)["jitter"])
    assert torch.equal(jitter[1], given) and not jitter[2].any()     # a scratch row: zeros
    assert not torch.equal(jitter[0], sampler.row_inputs(11, 3, shape)["jitter"])
    plan.draw_noise(shape)                                           # no sampler: no inputs
    assert plan.inputs == {} and torch.equal(plan.noise[0], chunk_noise(11, 2, shape))


# ----------------------------------------------------------------------------- the runner
def test_a_toy_sampler_runs_through_the_chunk_runner(toy):
    spec = specs(denoising_steps=4)
    r = Rollout(spec, "cpu", sampler=toy, sampler_options={"eta": 0.5, "skip": 1})
    r.prefill()
    got = [r.step() for _ in range(2)]                 # [1, C, F, H, W] each
    assert r.sigmas == [0.75, 0.5, 0.25, 0.0] and r.paths["graphs"] == 2
    key = r.graphs.keys()[0]
    assert key.program == "chunk[toy(eta=0.5,skip=1)]:3x32+clean16+commit"
    assert {s.name: s.shape for s in key.inputs}["jitter"] == (1, 2, *r.chunk_shape)
    ref = Rollout(spec, "cpu", use_graphs=False, model=r.model)
    ref.prefill()
    seed, shape, sig = r.seed, r.chunk_shape, r.sigmas
    for i, out in enumerate(got):
        jitter = r.sampling.row_inputs(seed, i, shape)["jitter"][None]
        assert jitter.abs().max() > 0.5                 # each chunk's own, not zeros

        def churn(x, v, k):
            x = x + (sig[k + 1] - sig[k]) * v
            return x + 0.5 * sig[k + 1] * jitter[:, k] if k + 1 < 3 else x
        want = by_hand(ref, 0.75 * chunk_noise(seed, i, shape)[None], [0.75, 0.5, 0.25], churn)
        assert float((out - want).abs().max()) <= 1e-6, i


def test_the_toy_without_churn_is_euler_bit_for_bit(toy):
    euler = Rollout("tiny", "cpu", use_graphs=False)
    plain = Rollout("tiny", "cpu", use_graphs=False, model=euler.model, sampler=toy,
                    sampler_options={"eta": 0.0})
    for r in (euler, plain):
        r.prefill()
    for _ in range(2):
        assert torch.equal(euler.step(), plain.step())


def test_self_forcing_is_x0_then_the_streams_fresh_noise():
    spec = specs(denoising_steps=3)
    r = Rollout(spec, "cpu", sampler="self_forcing")
    ref = Rollout(spec, "cpu", use_graphs=False, model=r.model)
    for x in (r, ref):
        x.prefill()
    sig = r.sigmas
    for i in range(2):
        e = chunk_renoise(r.seed, i, 3, r.chunk_shape)[None]       # [1, 2, C, F, H, W]

        def x0_renoise(x, v, k):
            x = x - sig[k] * v
            return (1 - sig[k + 1]) * x + sig[k + 1] * e[:, k] if k + 1 < 3 else x
        want = by_hand(ref, chunk_noise(r.seed, i, r.chunk_shape)[None], sig[:3], x0_renoise)
        assert float((r.step() - want).abs().max()) <= 1e-6, i


def test_inputs_are_checked_before_anything_runs(toy):
    r = Rollout("tiny", "cpu", use_graphs=False, sampler=toy)
    r.prefill()
    noise = chunk_noise(0, 0, r.chunk_shape)[None]
    jitter = torch.zeros(1, 1, *r.chunk_shape)
    for inputs, words in [({}, r"static inputs \['jitter'\] .* got \[\]"),
                          ({"jitter": jitter, "renoise": jitter}, r"got \['jitter', 'renoise'\]"),
                          ({"jitter": jitter[:, :0]}, r"inputs\['jitter'\] must be a \[1, 1, 4"),
                          ({"jitter": jitter.long()}, "must be a floating-point tensor"),
                          ({"jitter": jitter * float("nan")}, "must hold finite values only")]:
        with pytest.raises(ValueError, match=words):
            r.step(noise, inputs)
    assert r.chunk_index == 0 and r.paths == {"eager": 0, "graphs": 0}


def test_sampler_options_and_steps_are_part_of_a_streams_state(toy):
    a = Rollout("tiny", "cpu", use_graphs=False, sampler=toy, sampler_options={"eta": 0.5})
    a.prefill()
    a.step()
    state = a.snapshot(0)
    assert state.model["sampler"] == {"name": "toy", "options": {"eta": 0.5, "skip": 0}}
    for kw, words in [({"sampler": toy, "sampler_options": {"eta": 0.25}},
                       "sampler.options.eta: the state has 0.5, the runner 0.25"),
                      ({}, "sampler: the state has {'name': 'toy'"),
                      ({"sampler": toy, "steps": 1}, "sigmas: the state has")]:
        b = Rollout("tiny", "cpu", use_graphs=False, model=a.model, **kw)
        with pytest.raises(ValueError, match=words):
            b.restore(0, state)
    same = Rollout("tiny", "cpu", use_graphs=False, model=a.model, sampler=toy,
                   sampler_options={"eta": 0.5})
    same.restore(0, state)
    assert torch.equal(same.step(), a.step())


# ----------------------------------------------------------------------------- steps
def test_steps_runs_n_of_the_presets_steps():
    two = Rollout(specs(denoising_steps=2), "cpu", use_graphs=False)
    picked = Rollout(specs(denoising_steps=4), "cpu", use_graphs=False, model=two.model, steps=2)
    assert picked.sigmas == two.sigmas == [1.0, 0.5, 0.0]
    for r in (two, picked):
        r.prefill()
    assert all(torch.equal(two.step(), picked.step()) for _ in range(2))
    with pytest.raises(ValueError, match=r"steps must be an integer in \[1, 2\] .* got 3"):
        StreamScheduler("tiny", device="cpu", use_graphs=False, steps=3)
    with pytest.raises(ValueError, match="steps is the preset's Rollout's: with a "
                                         "runner_factory, set it in the factory, got steps=1"):
        StreamScheduler(runner_factory=two, steps=1)
    sched = StreamScheduler("tiny", max_sessions=1, device="cpu", use_graphs=False, steps=1)
    try:
        assert sched.runner.sigmas == [1.0, 0.0]
    finally:
        sched.close()


def test_the_wan_sampling_picks_the_steps_after_the_shift():
    from framekv.engine.wan.pipeline import sampling

    ts = (1000.0, 750.0, 500.0, 250.0)
    assert sampling(ts, steps=2) == {"sampler": "euler", "timesteps": (1000.0, 500.0)}
    sf = sampling(ts, checkpoint=True, steps=3)
    assert sf["timesteps"] == sampling(ts, checkpoint=True)["timesteps"][:3]
    with pytest.raises(ValueError, match=r"steps must be an integer in \[1, 4\]"):
        sampling(ts, steps=5)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_steps_below_one_is_refused_at_parse_time(command, capsys):
    from framekv.tools.cli import main

    extra = ["--prompt", "p", "--chunks", "1", "--out", "v.mp4"] if command == "generate" else []
    with pytest.raises(SystemExit) as exc:
        main([command, *extra, "--steps", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--steps: must be an integer >= 1, got 0" in err


def test_serve_hands_steps_to_the_reference_rollout(monkeypatch):
    from framekv.tools.cli import build_parser
    from framekv.tools.serve.command import build_scheduler, checked_options

    seen = {}
    monkeypatch.setattr("framekv.engine.serving.StreamScheduler",
                        lambda *a, **k: seen.update(k))
    args = build_parser().parse_args(["serve", "--device", "cpu", "--steps", "1"])
    build_scheduler(args, checked_options(args))
    assert seen["steps"] == 1


# ----------------------------------------------------------------------------- the commands
def test_a_sampler_a_source_picks_is_not_offered_by_name(capsys):
    """v2v starts from each stream's video: --video-in / --video-strength pick it, so
    neither generate nor serve takes it by --sampler (one line, exit 2)."""
    from framekv.tools.cli import main

    assert "v2v" in samplers() and "v2v" not in named_samplers()
    assert set(named_samplers()) == {n for n in samplers()
                                     if not getattr(get_sampler(n), "from_source", False)}
    for argv in (["generate", "--prompt", "p", "--chunks", "1", "--out", "v.mp4"],
                 ["serve", "--device", "cpu"]):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--sampler", "v2v"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1 and "invalid choice: 'v2v'" in err[0]


def test_the_command_line_takes_a_registered_sampler(toy, capsys, monkeypatch):
    from framekv.tools.cli import build_parser, main

    argv = ["generate", "--prompt", "p", "--chunks", "1", "--out", "v.mp4", "--sampler", toy]
    assert build_parser().parse_args(argv).sampler == toy
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_line = next(ln for ln in capsys.readouterr().out.splitlines()
                     if ln.lstrip().startswith("--sampler"))
    assert "one of euler, self_forcing, toy (" in help_line
    unregister_sampler(toy)
    try:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and "invalid choice: 'toy'" in capsys.readouterr().err
    finally:
        register_sampler(toy, ToySampler)


def test_generate_runs_a_toy_sampler(toy, tmp_path):
    pytest.importorskip("av")
    pytest.importorskip("diffusers")
    from framekv.engine.serving import to_uint8
    from framekv.engine.wan.pipeline import WanPipeline
    from framekv.tools.generate import generate

    frames, header = [], io.StringIO()
    generate("a cat", chunks=1, out=tmp_path / "t.mp4", device="cpu", stream=header,
             sampler=toy, sampler_options={"eta": 0.25},
             on_frames=lambda i, f: frames.append(f.numpy()))
    assert "toy at t = 1000.0, 500.0" in header.getvalue()
    # the same parts by hand: the pipeline's rollout and decoder, the seed's own inputs
    pipe = WanPipeline.load("tiny", device="cpu", sampler=toy, sampler_options={"eta": 0.25})
    r = pipe.rollout(use_graphs=False)
    r.set_prompt("a cat")
    latents = r.step(chunk_noise(0, 0, r.chunk_shape)[None],
                     sampler_inputs(r.sampling, [(0, 0)], r.chunk_shape))
    want = to_uint8(pipe.decoder().decode(latents))[0].numpy()
    assert abs(frames[0].astype(int) - want).max() <= 1
    # the toy ran: the same parts' Euler chunk is another one
    euler = pipe.rollout(use_graphs=False, sampler="euler", sampler_options=None)
    euler.set_prompt("a cat")
    assert float((euler.step(chunk_noise(0, 0, r.chunk_shape)[None]) - latents).abs().max()) > 0.1


def read_latents(port: int, sid: str) -> list[torch.Tensor]:
    """A session's chunks of latents from its socket, each acknowledged, to its end."""
    from serve_harness import ack
    from websockets.sync.client import connect

    from framekv.specs import wire

    out = []
    with connect(f"ws://127.0.0.1:{port}/v1/sessions/{sid}/stream", open_timeout=10,
                 max_size=None) as ws:
        while True:
            msg = ws.recv(timeout=30)
            if isinstance(msg, str):
                if json.loads(msg)["type"] == "end":
                    return out
                continue
            header, payload = wire.decode(msg)
            out.append(torch.frombuffer(bytearray(payload), dtype=torch.float32)
                       .view(header["shape"]))
            ack(ws, msg)


def test_a_served_session_runs_a_toy_sampler(toy):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("websockets")
    from serve_harness import create, serving

    sched = StreamScheduler(max_sessions=2, runner_factory=functools.partial(
        Rollout, "tiny", "cpu", use_graphs=False, sampler=toy))
    model = sched.runner.model
    with serving(sched) as (_, port):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            ids = {create(http, seed=seed, chunks=3): seed for seed in (7, 8)}
        got = {seed: read_latents(port, sid) for sid, seed in ids.items()}
    alone = Rollout("tiny", "cpu", use_graphs=False, sampler=toy, model=model)
    alone.prefill()
    shape = alone.chunk_shape
    for seed, chunks in got.items():
        alone.reset()                                    # position 0, the prompt kept
        assert len(chunks) == 3
        for i, lat in enumerate(chunks):
            want = alone.step(chunk_noise(seed, i, shape)[None],
                              sampler_inputs(alone.sampling, [(seed, i)], shape))[0]
            assert float((lat - want).abs().max()) <= 1e-5, (seed, i)


# ----------------------------------------------------------------------------- no branches
def sampler_names_in(root: pathlib.Path, names, folders=("engine", "tools", "bench")) -> list:
    """Every string constant equal to a sampler's name (a comparison, a default, a key:
    a branch on the name) in ``folders``' modules but the samplers package's."""
    hits, own = [], root / "engine" / "samplers"
    for folder in folders:
        for f in sorted((root / folder).rglob("*.py")):
            if own in f.parents:
                continue
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.Constant) and node.value in names:
                    hits.append(f"{f.relative_to(root)}:{node.lineno}: {node.value!r}")
    return hits


def test_no_module_but_the_samplers_names_a_sampler(tmp_path):
    names = set(samplers())
    assert sampler_names_in(ROOT, names) == []
    # the rule finds a branch on a name, and leaves docs and help texts alone
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "x.py").write_text(
        '"""The euler sampler."""\nhelp = "euler, or self_forcing"\n'
        'def f(r):\n    return r.sampler == "self_forcing"\n')
    assert sampler_names_in(tmp_path, names, ("engine",)) == ["engine/x.py:4: 'self_forcing'"]
