"""framekv.graphs on CPU: keys, eager GraphCache semantics, errors, warm-up, replay checks."""
from __future__ import annotations

import io
import re

import msgspec
import pytest
import torch

from framekv.graphs import (CaptureRequest, GraphCache, GraphCaptureError, GraphKey,
                            TensorSpec, assert_replay_matches, check_replay, chunk_key,
                            compare_outputs, decode_report, encode_report, format_report,
                            owner_token)
from framekv.specs import Geometry

G = Geometry(6, 12, 8, (4, 8))
#: Warm-up items (geometry, tokens, block size), as a builder receives them.
ITEMS = [(G, 8, 4), (G, 8, 8), (G, 4, 4)]


def raises(exc, *fragments: str):
    """pytest.raises matching every fragment literally, in order."""
    return pytest.raises(exc, match=".*".join(re.escape(f) for f in fragments))


def forward_key(owner, geometry, tokens, block_size, inputs=None) -> GraphKey:
    """Key of one forward of ``tokens`` tokens in ``block_size`` blocks."""
    return GraphKey.build(owner=owner, geometry=geometry, tokens=tokens,
                          block_sizes=(block_size,), program="forward", inputs=inputs)


def key(**over) -> GraphKey:
    """A key from live tensors; ``over`` replaces any build argument or one input."""
    inputs = {"x": torch.zeros(8, 16), "t": torch.zeros(4)}
    inputs.update(over.pop("inputs", {}))
    args = dict(owner=7, geometry=G, tokens=8, block_sizes=(8, 8, 4),
                program="chunk:2x8+clean4+commit")
    args.update(over)
    return GraphKey.build(inputs=inputs, **args)


# ---------------------------------------------------------------------------- keys
def test_tensor_spec_of():
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    s = TensorSpec.of("x", t)
    assert s == TensorSpec("x", (3, 4), (4, 1), "bfloat16", "cpu")
    assert TensorSpec.of("x", t.t()).stride == (1, 4)
    assert s.matches(torch.ones(3, 4, dtype=torch.bfloat16)) and not s.matches(t.t())
    assert s.summary() == "x[3,4]bfloat16@cpu"
    assert TensorSpec.of("x", t.t()).summary() == "x[4,3]/s1,4bfloat16@cpu"
    assert TensorSpec("x", [3, 4], [4, 1], "float32", "cpu").shape == (3, 4)  # lists hash
    with raises(ValueError, "input 'x' must be a torch.Tensor"):
        TensorSpec.of("x", [1, 2])
    with raises(ValueError, "same length"):
        TensorSpec("x", (3,), (1, 1), "float32", "cpu")


def test_key_equal_when_nothing_changes():
    a, b = key(), key(inputs={"x": torch.randn(8, 16)})  # other values, other address
    assert a == b and hash(a) == hash(b)
    assert key(inputs={"t": torch.ones(4), "x": torch.ones(8, 16)}) == a  # mapping order


CHANGES = {
    "owner": dict(owner=8),
    "geometry": dict(geometry=Geometry(6, 13, 8, (4, 8))),
    "geometry None": dict(geometry=None),
    "tokens": dict(tokens=4, block_sizes=(4,)),
    "block sizes": dict(block_sizes=(8, 8, 8)),
    "block order": dict(block_sizes=(4, 8, 8)),
    "program": dict(program="chunk:2x8+clean4"),
    "input shape": dict(inputs={"x": torch.zeros(8, 17)}),
    "input stride": dict(inputs={"x": torch.zeros(16, 8).t()}),
    "input dtype": dict(inputs={"x": torch.zeros(8, 16, dtype=torch.float16)}),
    "input device": dict(inputs={"x": torch.zeros(8, 16, device="meta")}),
    "input name": dict(inputs={"y": torch.zeros(8, 16)}),
    "splits": dict(splits=(2, 2, 1)),
    "split of one forward": dict(splits=(1, 1, 2)),
    "batch": dict(batch=2),
}


@pytest.mark.parametrize("change", CHANGES, ids=list(CHANGES))
def test_every_baked_field_changes_the_key(change):
    changed = key(**CHANGES[change])
    assert changed != key()
    assert hash(changed) != hash(key())  # a dict lookup tells them apart


def test_key_fields_are_exactly_what_a_graph_bakes():
    assert GraphKey.__struct_fields__ == ("owner", "geometry", "tokens", "block_sizes",
                                          "program", "inputs", "splits", "batch", "packed")


def test_key_packing_flags_are_checked_and_distinguish_keys():
    base = dict(owner=1, geometry=G, tokens=8, block_sizes=(8, 4), program="chunk")
    assert GraphKey(**base, packed=(False, True)) != GraphKey(**base, packed=(False, False))
    assert "packed=n/y" in GraphKey(**base, packed=[False, True]).summary()
    with pytest.raises(ValueError, match=r"GraphKey.packed must give one flag per block size \(2\)"):
        GraphKey(**base, packed=(True,))
    with pytest.raises(ValueError, match=r"GraphKey.packed\[1\] must be a bool, got 1"):
        GraphKey(**base, packed=(False, 1))


def test_key_never_includes_the_commit_count():
    from framekv.engine import CausalKVCache

    cache = CausalKVCache(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                          tokens_per_page=4, pool_tokens=CausalKVCache.pool_tokens_for(G, 4),
                          device="cpu")
    cache.open(G)
    x = torch.zeros(1, 8, 2, 8)

    def current_key():  # everything the rollout knows now, commit count included
        return forward_key(owner_token(cache), cache.geometry, 8, 4, {"x": x})

    keys = []
    for _ in range(3):
        keys.append((cache.committed_tokens, current_key()))
        cache.write_staged(0, x[0], x[0], 4)
        cache.commit(8)
    assert [c for c, _ in keys] == [0, 8, 16]
    assert len({k for _, k in keys}) == 1


def test_key_json_round_trip_and_summary():
    k = key()
    assert msgspec.json.decode(msgspec.json.encode(k), type=GraphKey) == k
    assert k.summary().startswith("chunk:2x8+clean4+commit T=8 blocks=8/8/4 P=6 W=12 M=8 owner=7")
    assert "t[4]float32@cpu x[8,16]float32@cpu" in k.summary()


@pytest.mark.parametrize("over,message", [
    (dict(owner=True), "GraphKey.owner must be an integer"),
    (dict(owner=-1), "GraphKey.owner must be >= 0"),
    (dict(tokens=8, block_sizes=(3,), geometry=None),
     "block_sizes[0] must divide tokens (8), got 3"),
    (dict(block_sizes=(2,)), "block_sizes[0] must be one of the geometry's causal_block_sizes"),
    (dict(tokens=16, block_sizes=(8,)), "tokens must be <= the geometry's max_staged_tokens (8)"),
    (dict(program=" "), "GraphKey.program must be a non-empty string"),
    (dict(splits=(2,)), "GraphKey.splits must give one S per block size (3), got (2,)"),
    (dict(splits=(2, 0, 1)), "GraphKey.splits[1] must be >= 1"),
])
def test_key_validation(over, message):
    with raises(ValueError, message):
        key(**over)


def test_key_rejects_duplicate_input_names():
    spec = TensorSpec("x", (1,), (1,), "float32", "cpu")
    with raises(ValueError, "distinct names"):
        GraphKey(owner=1, geometry=None, tokens=0, block_sizes=(), program="p", inputs=(spec, spec))


def test_owner_token_is_per_object_and_never_reused():
    class Owner:
        pass

    a, b = Owner(), Owner()
    ta = owner_token(a)
    assert owner_token(a) == ta and owner_token(b) != ta
    del a
    seen = {ta, owner_token(b)}
    for _ in range(50):  # new objects often land at a freed object's address
        token = owner_token(Owner())
        assert token not in seen
        seen.add(token)


def test_chunk_key_names_its_steps():
    k = chunk_key(1, G, 8, denoise_steps=2, clean_block=4)
    assert (k.program, k.block_sizes, k.tokens) == ("chunk:2x8+clean4+commit", (8, 8, 4), 8)
    assert chunk_key(1, G, 8, denoise_steps=3, denoise_block=4, commit=False).program == "chunk:3x4"
    assert chunk_key(1, G, 8, denoise_steps=1, commit=4).program == "chunk:8+commit:4"
    assert chunk_key(1, G, 8, denoise_steps=1, clean_block=8).program == "chunk:8+clean8+commit"
    assert chunk_key(1, G, 8, denoise_steps=0, clean_block=4).program == "chunk:clean4+commit"
    x = {"x": torch.zeros(2)}
    k = chunk_key(1, G, 8, denoise_steps=1, inputs=x, splits=(2,), packed=(True,), batch=2)
    assert ([s.name for s in k.inputs], k.splits, k.packed, k.batch) == (["x"], (2,), (True,), 2)
    with raises(ValueError, "denoise_steps must be an integer >= 0"):
        chunk_key(1, G, 8, denoise_steps=-1)


# ---------------------------------------------------------------------------- eager cache
class Counter:
    """A callable counting its calls: out = x * 2 + t.sum()."""

    def __init__(self, fail_on=()):
        self.calls, self.fail_on = 0, set(fail_on)

    def __call__(self, x, t):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(f"planted failure on call {self.calls}")
        return {"y": x * 2 + t.sum(), "s": x.sum()}


def inputs(v=1.0):
    return {"x": torch.full((8, 16), v), "t": torch.full((4,), v)}


def plain_key(**over):
    args = dict(owner=1, program="fn", inputs=inputs())
    return GraphKey.build(**{**args, **over})


def test_cpu_runs_eagerly_every_call_and_counts():
    cache, fn, hook = GraphCache("cpu"), Counter(), []
    k = plain_key()
    first = cache.run(k, fn, inputs(1.0), after_replay=lambda: hook.append(1))
    assert fn.calls == 2 + 1  # two warm-up calls, then the call itself
    assert torch.equal(first["y"], torch.full((8, 16), 6.0))
    for v in (2.0, 3.0):
        out = cache.run(k, fn, inputs(v), after_replay=lambda: hook.append(1))
        assert out is first  # the same static outputs, rewritten, as a graph would
        assert torch.equal(out["y"], torch.full((8, 16), 2 * v + 4 * v))
    assert fn.calls == 5
    # An eager call ran the callable's own Python: no host bookkeeping was skipped.
    assert hook == []
    s = cache.stats()
    assert (s.eager, s.graphs, s.captures, s.hits, s.capture_failures) == (True, 1, 1, 3, 0)
    assert s.per_key[0].hits == 3 and s.per_key[0].key == k.summary()
    assert (s.allocated_bytes, s.reserved_bytes) == (0, 0)
    msgspec.json.encode(s)


def test_warmup_count_and_warmup_fn():
    fn, other = Counter(), Counter()
    cache = GraphCache("cpu", warmup_iters=4)
    cache.capture(plain_key(), fn, inputs())
    assert fn.calls == 4
    cache.capture(plain_key(owner=2), fn, inputs(), warmup=0)
    assert fn.calls == 4
    cache.capture(plain_key(owner=3), fn, inputs(), warmup_fn=other)
    assert (fn.calls, other.calls) == (4, 4)


def test_static_inputs_filled_in_place():
    cache, fn = GraphCache("cpu"), Counter()
    k = plain_key()
    handle = cache.capture(k, fn, inputs(1.0))
    static = cache.get_static_inputs(k)
    assert static is handle.static_inputs
    with pytest.raises(TypeError):
        static["x"] = torch.zeros(8, 16)  # read-only: buffers are filled, never replaced
    static["x"].fill_(5.0)
    out = cache.replay(k)
    assert torch.equal(out["y"], torch.full((8, 16), 14.0))
    out = handle.replay({"x": static["x"], "t": torch.zeros(4)})  # a static buffer is not copied
    assert torch.equal(out["y"], torch.full((8, 16), 10.0))
    assert cache.get_static_outputs(k) is out


def test_capture_copies_inputs_to_fresh_buffers_with_their_strides():
    x = torch.randn(16, 8).t()
    cache = GraphCache("cpu")
    k = GraphKey.build(owner=1, program="p", inputs={"x": x})
    handle = cache.capture(k, lambda x: x + 1, {"x": x})
    sx = handle.static_inputs["x"]
    assert sx.data_ptr() != x.data_ptr() and sx.stride() == x.stride() and torch.equal(sx, x)


def test_outputs_of_any_supported_structure():
    cache = GraphCache("cpu")
    x = {"x": torch.ones(2)}
    for i, fn in enumerate([lambda x: x + 1, lambda x: (x, x * 2), lambda x: [x], lambda x: None]):
        out = cache.run(GraphKey.build(owner=i, program="p", inputs=x), fn, x)
        assert out is None or isinstance(out, (torch.Tensor, tuple, list))


def test_lookup_errors():
    cache = GraphCache("cpu")
    k = plain_key()
    with raises(KeyError, "no graph captured for fn"):
        cache.replay(k)
    cache.capture(k, Counter(), inputs())
    with raises(ValueError, "already captured"):
        cache.capture(k, Counter(), inputs())
    cache.drop(k)
    assert k not in cache and len(cache) == 0
    with raises(ValueError, "key must be a GraphKey"):
        cache.capture("k", Counter(), inputs())


def test_capture_inputs_must_match_the_key():
    cache = GraphCache("cpu")
    with raises(ValueError, "input 'x' is x[8,17]float32@cpu", "the key says x[8,16]float32@cpu"):
        cache.capture(plain_key(), Counter(), {**inputs(), "x": torch.zeros(8, 17)})
    with raises(ValueError, "missing ['t']"):
        cache.capture(plain_key(), Counter(), {"x": torch.zeros(8, 16)})
    meta = {"x": torch.zeros(8, 16, device="meta"), "t": torch.zeros(4, device="meta")}
    with raises(ValueError, "input 't' is on meta, the cache on cpu"):
        cache.capture(plain_key(inputs=meta), Counter(), meta)
    assert len(cache) == 0


def test_replay_rejects_wrong_shape_dtype_and_names_always():
    cache = GraphCache("cpu")
    k = plain_key()
    cache.capture(k, Counter(), inputs())
    with raises(ValueError, "input 'x': got shape [1, 16]", "captured for [8, 16]"):
        cache.replay(k, {"x": torch.zeros(1, 16)})  # copy_ would broadcast it silently
    with raises(ValueError, "input 't'", "torch.float16"):
        cache.replay(k, {"t": torch.zeros(4, dtype=torch.float16)})
    with raises(ValueError, "unknown input 'z'"):
        cache.replay(k, {"z": torch.zeros(1)})
    # Without debug a different stride is copied correctly (the buffer keeps its own).
    out = cache.replay(k, {"x": torch.full((16, 8), 1.0).t(), "t": torch.zeros(4)})
    assert torch.equal(out["y"], torch.full((8, 16), 2.0))


def test_debug_mode_names_a_layout_mismatch_and_a_moved_buffer():
    cache = GraphCache("cpu", debug=True)
    k = plain_key()
    handle = cache.capture(k, Counter(), inputs())
    with raises(ValueError, "input 'x' has layout x[8,16]/s1,8float32@cpu",
                "captured for x[8,16]float32@cpu", "different key"):
        cache.replay(k, {"x": torch.zeros(16, 8).t()})
    cache.replay(k, inputs(2.0))
    handle.static_inputs["t"].set_(torch.zeros(4))  # swapped storage: the graph reads the old one
    with raises(RuntimeError, "input 't' of fn moved from"):
        cache.replay(k)


def test_debug_mode_catches_a_moved_static_output():
    cache = GraphCache("cpu", debug=True)
    k = plain_key()
    out = cache.run(k, Counter(), inputs())
    out["s"].set_(torch.zeros(()))
    with raises(RuntimeError, "static output 's' of fn moved"):
        cache.replay(k)


def test_failed_warmup_leaves_no_entry_and_a_later_call_retries():
    cache, fn = GraphCache("cpu"), Counter(fail_on={2})
    k = plain_key()
    with raises(GraphCaptureError, "warm-up call 2 of fn", "planted failure on call 2") as info:
        cache.run(k, fn, inputs())
    assert isinstance(info.value.__cause__, RuntimeError)
    assert k not in cache and cache.stats().capture_failures == 1
    out = cache.run(k, fn, inputs(1.0))  # calls 3, 4 warm up, 5 runs
    assert torch.equal(out["y"], torch.full((8, 16), 6.0)) and fn.calls == 5
    assert (cache.stats().captures, cache.stats().graphs) == (1, 1)


def test_failed_first_call_without_warmup_leaves_no_entry():
    cache, fn = GraphCache("cpu", warmup_iters=0), Counter(fail_on={1})
    k = plain_key()
    with raises(GraphCaptureError, "first call of fn", "planted failure on call 1"):
        cache.run(k, fn, inputs())
    assert k not in cache
    s = cache.stats()
    assert (s.captures, s.capture_failures, s.graphs) == (0, 1, 0)
    cache.run(k, fn, inputs())
    assert k in cache


def test_a_later_failure_keeps_the_entry():
    cache, fn = GraphCache("cpu", warmup_iters=0), Counter(fail_on={2})
    k = plain_key()
    cache.run(k, fn, inputs())
    with raises(RuntimeError, "planted failure on call 2"):
        cache.run(k, fn, inputs())
    assert k in cache


def test_eager_outputs_must_keep_their_layout():
    cache, n = GraphCache("cpu", warmup_iters=0), [0]

    def grows(x):
        n[0] += 1
        return x[: n[0]]

    k = GraphKey.build(owner=1, program="p", inputs={"x": torch.ones(4)})
    cache.run(k, grows, {"x": torch.ones(4)})
    with raises(ValueError, "output changed from [1]", "outputs are fixed"):
        cache.run(k, grows, {"x": torch.ones(4)})
    with raises(GraphCaptureError, "must return None, a tensor"):
        cache.run(plain_key(owner=5), lambda x, t: 3, inputs())


def test_bad_constructor_arguments():
    with raises(ValueError, "warmup_iters must be an integer >= 0"):
        GraphCache("cpu", warmup_iters=-1)
    with raises(ValueError, "device must be cpu or cuda"):
        GraphCache("meta")


class FakeGraph:
    """Stands in for a captured torch graph: counts replays through torch."""

    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


def test_a_replay_is_torchs_replay_then_the_host_hook():
    from framekv.graphs import CapturedGraph

    hooks = []
    entry = CapturedGraph(key(), lambda **kw: None, {"x": torch.zeros(8, 16), "t": torch.zeros(4)},
                          after_replay=lambda: hooks.append(1), debug=False)
    graph = FakeGraph()
    entry.set_captured(graph, torch.zeros(2), torch.device("cuda", 0))
    for _ in range(5):
        entry.replay()
    assert graph.replays == 5 and entry.hits == 5 and hooks == [1] * 5
    entry.replay(after_replay=lambda: hooks.append(2))
    assert graph.replays == 6 and hooks[-1] == 2 and len(hooks) == 6


def test_clear_keeps_hit_totals():
    cache = GraphCache("cpu")
    for owner in (1, 2):
        cache.run(plain_key(owner=owner), Counter(), inputs())
    cache.clear()
    s = cache.stats()
    assert (s.graphs, s.hits, s.captures) == (0, 2, 2)


# ---------------------------------------------------------------------------- warm-up
def test_warmup_captures_every_item_and_reports():
    cache, built = GraphCache("cpu"), []

    def builder(geometry, tokens, block_size):
        built.append((tokens, block_size))
        x = {"x": torch.zeros(tokens, 2)}
        # Forwards of every block size share one chunk graph here: later items are cached.
        k = chunk_key(9, geometry, tokens, denoise_steps=2, inputs=x)
        return k, (lambda x: x * 2), x, None

    out = io.StringIO()
    report = cache.warmup(ITEMS, builder, stream=out)
    assert built == [(8, 4), (8, 8), (4, 4)]
    assert [r.status for r in report.records] == ["captured", "cached", "captured"]
    assert (report.graphs, report.captured, report.device) == (2, 2, "cpu")
    assert report.records[0].key.startswith("chunk:2x8+commit T=8")
    text = out.getvalue()
    assert "warm-up [" in text and "3/3" in text and "done" in text
    table = format_report(report)
    assert table.splitlines()[0].split() == ["tokens", "program", "status", "seconds",
                                              "reserved", "MiB", "key"]
    assert [(r.tokens, r.block_sizes, r.program) for r in report.records] == [
        (8, (8, 8), "chunk:2x8+commit"), (8, (8, 8), "chunk:2x8+commit"),
        (4, (4, 4), "chunk:2x4+commit")]
    assert "cached" in table and "2 graphs on cpu" in table
    assert decode_report(encode_report(report)) == report
    assert b"\n" not in encode_report(report, indent=0)


def test_warmup_without_progress_and_with_capture_requests():
    cache, out = GraphCache("cpu"), io.StringIO()

    def builder(geometry, tokens, block_size):
        x = {"x": torch.zeros(tokens)}
        return CaptureRequest(forward_key(1, geometry, tokens, block_size, x), lambda x: x, x)

    report = cache.warmup(ITEMS, builder, progress=False, stream=out)
    assert out.getvalue() == "" and report.captured == 3


def _fails(x):
    raise RuntimeError("planted failure")


def test_warmup_failure_names_the_item_and_keeps_earlier_graphs():
    cache, out = GraphCache("cpu"), io.StringIO()

    def builder(geometry, tokens, block_size):
        x = {"x": torch.zeros(tokens)}
        fn = (lambda x: x) if block_size == 4 and tokens == 8 else _fails
        return forward_key(1, geometry, tokens, block_size, x), fn, x, None

    with pytest.raises(GraphCaptureError) as info:
        cache.warmup(ITEMS, builder, stream=out)
    assert "planted failure" in str(info.value)
    assert "warm-up request 1: forward T=8 blocks=8" in "\n".join(info.value.__notes__)
    assert len(cache) == 1 and "stopped" in out.getvalue()


# ---------------------------------------------------------------------------- replay checks
def test_compare_outputs():
    a = {"y": torch.arange(6.0).view(2, 3), "z": torch.zeros(2)}
    assert compare_outputs(a, {k: v.clone() for k, v in a.items()}) is None
    b = {"y": a["y"].clone(), "z": torch.tensor([0.0, 0.25])}
    assert compare_outputs(a, b) == ("z", 0.25, "1 of 2 elements differ, first at index [1]")
    assert compare_outputs(a, b, atol=0.3) is None
    assert compare_outputs(a, b, rtol=0.5) is not None  # relative to 0: still off
    name, err, detail = compare_outputs(a["y"], a["y"][:1])
    assert (name, err) == ("output", float("inf")) and "[2, 3]" in detail
    assert compare_outputs((a["y"],), (a["y"], a["y"]))[0] == "outputs"
    nan = torch.tensor([float("nan"), 1.0])
    assert compare_outputs(nan, nan.clone()) is None
    assert compare_outputs(nan, torch.tensor([0.0, 1.0]))[1] == float("inf")


class Recurrent:
    """State of a tiny recurrent step; ``bug_at`` plants a wrong value at one step."""

    def __init__(self, bug_at=None):
        self.h = torch.zeros(4)
        self.steps = 0
        self.bug_at = bug_at


def recurrent_step(state, x):
    state.h.copy_(torch.tanh(state.h * 0.5 + x))  # in place: a fixed address
    state.steps += 1
    out = state.h * 2
    if state.bug_at is not None and state.steps == state.bug_at + 1:
        out = out + 0.5
    return out


def states(bug_role=None, bug_at=3):
    """make_state for check_replay: eager, graph, scratch, in that order."""
    roles = iter(["eager", "graph", "scratch"])
    return lambda: Recurrent(bug_at if next(roles) == bug_role else None)


STEPS = [{"x": torch.full((4,), float(i) / 7)} for i in range(10)]


def test_check_replay_passes_when_equal():
    assert check_replay(states(), recurrent_step, STEPS, device="cpu") is None


def test_check_replay_finds_a_planted_mismatch_at_its_step():
    found = check_replay(states("graph", bug_at=5), recurrent_step, STEPS, device="cpu")
    assert (found.step, found.output) == (5, "output")
    assert found.max_abs_error == pytest.approx(0.5)
    with raises(AssertionError, "replay differs from eager at step 5, output: max abs error 0.5"):
        assert_replay_matches(states("graph", bug_at=5), recurrent_step, STEPS, device="cpu")


def test_check_replay_warms_up_on_a_scratch_state():
    # A bug only in the scratch state must not reach the compared sides.
    assert check_replay(states("scratch", bug_at=0), recurrent_step, STEPS, device="cpu") is None


# ---------------------------------------------------------------------------- over a real cache
class ChunkRollout:
    """A whole chunk over a `CausalKVCache`: denoising forwards, a clean pass, a commit.

    Two layers of reference-backend `CachedAttention`; the chunk's packed QKV input
    ``x`` [1, T, H + 2 H_kv, D] is refined by each forward. One step = one chunk.
    """

    H, HKV, D, L, TPP = 4, 2, 16, 2, 4
    T, CLEAN, DENOISE = 8, 4, 2

    def __init__(self, device, dtype):
        from framekv.engine import CachedAttention, CausalKVCache

        self.cache = CausalKVCache(num_layers=self.L, num_kv_heads=self.HKV, head_dim=self.D,
                                   dtype=dtype, tokens_per_page=self.TPP, device=device,
                                   pool_tokens=CausalKVCache.pool_tokens_for(G, self.TPP))
        self.attn = [CachedAttention(self.H, self.HKV, self.D, backend="reference", layer_idx=i)
                     for i in range(self.L)]
        self.reset()

    def reset(self) -> None:
        self.cache.close()
        self.cache.open(G)
        self.cache.k_pool.zero_()  # never-written slots must compare equal too
        self.cache.v_pool.zero_()

    def forward(self, x, block):
        for attn in self.attn:
            o = attn(x, kv_cache=self.cache, seq_len=self.T, causal_block_size=block)
            x = x + torch.cat([o, o[:, :, : 2 * self.HKV]], dim=2) * 0.5
        return x

    def __call__(self, x):
        for _ in range(self.DENOISE):
            x = self.forward(x, self.T)
        self.forward(x, self.CLEAN)  # its K/V become history
        self.cache.commit(self.T)
        return x

    def after_replay(self) -> None:
        """The host mirror's part of what the graph did."""
        self.cache.note_staged(self.T)
        self.cache.commit_host(self.T)

    def key(self, inputs) -> GraphKey:
        return chunk_key(owner_token(self.cache), G, self.T, denoise_steps=self.DENOISE,
                         clean_block=self.CLEAN, inputs=inputs)

    @classmethod
    def steps(cls, n, device, dtype):
        gen = torch.Generator().manual_seed(0)
        shape = (1, cls.T, cls.H + 2 * cls.HKV, cls.D)
        return [{"x": torch.randn(shape, generator=gen).to(device, dtype)} for _ in range(n)]


def check_chunk_rollout(device, dtype, chunks=7):
    """check_replay over whole chunks; returns (mismatch, the graph side's state)."""
    made = []

    def make_state():
        made.append(ChunkRollout(device, dtype))
        return made[-1]

    found = check_replay(make_state, lambda s, x: s(x), ChunkRollout.steps(chunks, device, dtype),
                         device=device, key_fn=lambda s, i, inp: s.key(inp),
                         after_replay=lambda s, k: s.after_replay(), reset=ChunkRollout.reset)
    return found, made


def test_whole_chunks_over_a_real_cache_cpu():
    found, (eager, graphed, _) = check_chunk_rollout("cpu", torch.float32)
    assert found is None
    assert eager.cache.committed_tokens == graphed.cache.committed_tokens == 7 * 8
    assert torch.equal(eager.cache.k_pool, graphed.cache.k_pool)
