"""The dense rolling-cache baseline: exact V(j), roll-by-clone, the same rollout as framekv."""
from __future__ import annotations

import gc
import random

import msgspec
import numpy as np
import pytest
import torch

from framekv.bench.dense import SDPA_BACKENDS, DenseRollingKV, DenseRollout, sdpa_backend_name
from framekv.engine import CausalVideoDiT, ForwardContext, KVStore, Rollout
from framekv.engine.kv import plain
from framekv.engine.cache.reference import ExactWindowReference, visible_positions
from framekv.engine.verify import ReferenceRollout
from framekv.specs import Geometry, load_preset

TINY = load_preset("tiny")
TOL = 1e-4  # fp32: summation order only


def _specs(model=None, **rollout):
    return (msgspec.structs.replace(TINY.model, **(model or {})),
            msgspec.structs.replace(TINY.rollout, **rollout))


def _errors(a, b):
    assert len(a) == len(b)
    return [float((x - y).abs().max()) for x, y in zip(a, b)]


# ---------------------------------------------------------------------- whole rollouts
def test_dense_rollout_equals_framekv_rollout_and_the_reference_chunk_by_chunk():
    spec = _specs(chunks=25, last_chunk_frames=1)           # the last chunk is one frame
    framekv = Rollout(spec)
    want = framekv.run()
    dense = DenseRollout(spec, model=framekv.model)
    got = dense.run()
    assert [x.shape[2] for x in got] == [2] * 24 + [1]
    assert max(_errors(got, want)) < TOL
    assert max(_errors(got, ReferenceRollout(spec, model=framekv.model).run())) < TOL
    assert max(float(x.abs().max()) for x in got) > 0.5      # non-trivial latents
    kv, g = dense.kv, dense.geometry
    # The window filled after two chunks (W = 48, 32 tokens a chunk), then rolled.
    assert kv.committed == g.pin_tokens + spec[1].total_tokens > g.pin_tokens + 10 * g.window_tokens
    assert kv.window_full and kv.history == g.window_tokens
    assert dense.paths == {"eager": 2, "graphs": 23} and dense.path == "graphs"
    assert len(dense.graphs) == 2                            # one per chunk length
    assert dense.backend == "sdpa-math" and kv.kernel == "math" and kv.gqa == "native"


@pytest.mark.parametrize("rollout", [
    {"prompt_tokens": 0},                     # no pinned prefix: V(j) is one range
    {"prompt_tokens": 45},                    # a prompt longer than one forward
    {"window_frames": 1},                     # W < a chunk: every commit rolls by T
    {"window_frames": 0},                     # prompt and own tokens only
    {"frames_per_chunk": 3, "window_frames": 4, "last_chunk_frames": 2},
], ids=["no-prompt", "long-prompt", "short-window", "no-window", "three-frame-chunks"])
def test_dense_rollout_equals_the_reference_across_geometries(rollout):
    spec = _specs(chunks=7, **rollout)
    ref = ReferenceRollout(spec)
    dense = DenseRollout(spec, model=ref.model)
    assert max(_errors(dense.run(), ref.run())) < TOL
    assert dense.kv.committed == spec[1].prompt_tokens + spec[1].total_tokens


class _Recorder:
    """Feeds each attention's K/V to an `ExactWindowReference`, keeps the max error."""

    def __init__(self, reference: ExactWindowReference):
        self.reference, self.worst, self.calls = reference, 0.0, 0

    def __call__(self, layer, qkv, out, seq_len, block_size):
        H = out.shape[2]
        Hkv = (qkv.shape[2] - H) // 2
        ref = self.reference
        ref.write(layer, ref.committed, qkv[0, :seq_len, H:H + Hkv], qkv[0, :seq_len, H + Hkv:])
        want = ref.attention(layer, qkv[0, :, :H], seq_len, block_size)  # fp32 [S, H, D]
        self.worst = max(self.worst, float((out[0].float() - want).abs().max()))
        self.calls += 1


def test_every_attention_equals_the_exact_window_reference():
    spec = _specs(chunks=6)
    dense = DenseRollout(spec, use_graphs=False)
    ref = ExactWindowReference(dense.geometry, spec[0].num_layers)
    recorder = _Recorder(ref)
    dense.attention_recorder = recorder
    dense.prefill()
    ref.commit(spec[1].prompt_tokens)
    for _ in range(spec[1].chunks):
        out = dense.step()
        ref.commit(out.shape[2] * spec[1].tokens_per_frame)
    layers, forwards = spec[0].num_layers, spec[1].denoising_steps + 1
    assert recorder.calls == layers * (1 + spec[1].chunks * forwards)
    assert recorder.worst < 1e-5


def test_graphs_and_eager_agree_and_reset_replays_the_same_rollout():
    spec = _specs(chunks=6, last_chunk_frames=1)
    a = DenseRollout(spec, use_graphs=True)
    b = DenseRollout(spec, use_graphs=False, model=a.model)
    first = a.run()
    assert max(_errors(first, b.run())) == 0.0
    assert b.paths == {"eager": 6, "graphs": 0} and len(b.graphs) == 0
    assert a.graphs.stats().hits == 4 and a.graphs.eager       # CPU: the eager stand-in
    a.reset()
    assert a.kv.committed == spec[1].prompt_tokens and a.frames_done == 0   # the prompt stays
    assert a.paths == {"eager": 0, "graphs": 0}
    assert max(_errors(first, a.run())) == 0.0
    # Past the planned chunks the rollout goes on with full chunks, through the graph.
    assert a.step().shape[2] == 2 and a.path == "graphs"


def test_dense_buffers_stay_constant_over_a_long_rollout():
    # One layer, one denoising step, 4 tokens per frame: the window rolls every chunk.
    spec = _specs(model={"num_layers": 1, "latent_height": 4, "latent_width": 4},
                  tokens_per_frame=4, chunks=300, denoising_steps=1)
    r = DenseRollout(spec)
    kv, g = r.kv, r.geometry
    expected = 2 * (g.pin_tokens + g.window_tokens + g.max_staged_tokens) \
        * spec[0].num_kv_heads * spec[0].head_dim * 4
    r.prefill()
    for _ in range(20):
        r.step()

    def snapshot():
        gc.collect()
        return ([b.data_ptr() for b in kv.k_buffers + kv.v_buffers],
                [tuple(b.shape) for b in kv.k_buffers + kv.v_buffers], kv.buffer_bytes,
                len(r.graphs))
    before, objects = snapshot(), len(gc.get_objects())
    for _ in range(280):
        r.step()
    assert snapshot() == before and kv.buffer_bytes == expected
    assert len(gc.get_objects()) - objects < 200               # nothing kept per chunk
    assert kv.committed == g.pin_tokens + 300 * spec[1].chunk_tokens


# ---------------------------------------------------------------------- DenseRollingKV alone
def _stamp(layer: int, positions, heads: int, dim: int) -> torch.Tensor:
    """K stamps [n, heads, dim]: layer * 10000 + position + head / 4 (V is the negative)."""
    pos = torch.as_tensor(list(positions), dtype=torch.float32)
    head = torch.arange(heads, dtype=torch.float32) / 4
    return (layer * 10000 + pos[:, None, None] + head[None, :, None]).expand(-1, -1, dim).clone()


def _positions(layer: int, k: torch.Tensor, v: torch.Tensor) -> list[int]:
    """Decode stamps back to positions, checking heads, dims and V on the way."""
    heads, dim = k.shape[1:]
    pos = (k[:, 0, 0] - layer * 10000).round().to(torch.int64).tolist()
    torch.testing.assert_close(k, _stamp(layer, pos, heads, dim), rtol=0, atol=0)
    torch.testing.assert_close(v, -k, rtol=0, atol=0)
    return pos


def _kv(geometry, layers=2, heads=2, dim=4):
    return DenseRollingKV(geometry, num_layers=layers, num_kv_heads=heads, head_dim=dim)


def _prefill_stamps(kv: DenseRollingKV) -> None:
    P, H, D = kv.pin_tokens, kv.num_kv_heads, kv.head_dim
    for layer in range(kv.num_layers):
        k = _stamp(layer, range(P), H, D)
        kv.k_buffers[layer][:P], kv.v_buffers[layer][:P] = k, -k
    kv.commit_prompt()


def _check_window(kv: DenseRollingKV) -> None:
    """[0, P) holds the prompt, [P, P + h) exactly the last h = min(C - P, W) commits."""
    P, C, W = kv.pin_tokens, kv.committed, kv.window_tokens
    h = min(C - P, W)
    assert kv.history == h and list(kv.window_positions()) == list(range(C - h, C))
    for layer in range(kv.num_layers):
        k, v = kv.k_buffers[layer], kv.v_buffers[layer]
        assert _positions(layer, k[:P + h], v[:P + h]) == list(range(P)) + list(range(C - h, C))


def _check_blocks(kv: DenseRollingKV, T: int) -> None:
    """Every declared block size that cuts T: block j reads exactly V(j), in order."""
    g, C = kv.geometry, kv.committed
    for b in (b for b in g.causal_block_sizes if T % b == 0):
        for j in range(T // b):
            want = visible_positions(g, C, C + j * b, b).tolist()
            for layer in range(kv.num_layers):
                assert _positions(layer, *kv.block_kv(layer, j, b)) == want, (C, b, j)
            filling = kv.history < g.window_tokens
            if j == 0 or (filling and C + j * b - g.window_tokens <= g.pin_tokens):
                assert len(kv.block_slots(j, b)) == 1      # one slice of the buffer
            elif kv.window_full and g.pin_tokens:
                assert len(kv.block_slots(j, b)) == 2      # the prompt + a window tail
        if b == T and g.pin_tokens:
            assert kv.block_slots(0, b) == ((0, g.pin_tokens + kv.history + T),)


@pytest.mark.parametrize("geometry", [
    Geometry(pin_tokens=6, window_tokens=48, max_staged_tokens=32, causal_block_sizes=(16, 32)),
    Geometry(pin_tokens=5, window_tokens=11, max_staged_tokens=8, causal_block_sizes=(2, 4, 8)),
    Geometry(pin_tokens=0, window_tokens=7, max_staged_tokens=6, causal_block_sizes=(1, 3, 6)),
    Geometry(pin_tokens=3, window_tokens=0, max_staged_tokens=4, causal_block_sizes=(2, 4)),
    Geometry(pin_tokens=4, window_tokens=2, max_staged_tokens=9, causal_block_sizes=(3, 9)),
], ids=["tiny", "window-not-a-multiple", "no-prompt", "no-window", "window-below-a-forward"])
def test_window_holds_the_last_w_commits_and_blocks_see_exactly_v_j(geometry):
    rng = random.Random(0)
    kv = _kv(geometry)
    _prefill_stamps(kv)
    _check_window(kv)
    sizes = geometry.causal_block_sizes
    for _ in range(40):
        T = rng.choice(sizes)                   # a forward of one declared block length
        for _ in range(rng.randint(1, 2)):  # denoising steps rewrite the same positions
            for layer in range(kv.num_layers):
                k = _stamp(layer, range(kv.committed, kv.committed + T), 2, 4)
                kv.stage(layer, k, -k)
            _check_blocks(kv, T)
        kv.commit(rng.choice([T, T, rng.randint(0, T)]))  # mostly whole forwards
        _check_window(kv)
    assert kv.committed > geometry.pin_tokens + 2 * geometry.window_tokens


def test_attention_equals_the_reference_over_exactly_v_j():
    g = Geometry(pin_tokens=5, window_tokens=11, max_staged_tokens=8, causal_block_sizes=(2, 8))
    H, Hkv, D = 4, 2, 8
    kv = DenseRollingKV(g, num_layers=1, num_kv_heads=Hkv, head_dim=D)
    ref = ExactWindowReference(g, 1)
    gen = torch.Generator().manual_seed(0)
    prompt_k, prompt_v = (torch.randn(5, Hkv, D, generator=gen) for _ in range(2))
    kv.k_buffers[0][:5], kv.v_buffers[0][:5] = prompt_k, prompt_v
    kv.commit_prompt()
    ref.write(0, 0, prompt_k, prompt_v)
    ref.commit(5)
    for _ in range(6):
        for b in (8, 2):                         # a denoising forward, then the clean pass
            k, v, q = (torch.randn(8, heads, D, generator=gen) for heads in (Hkv, Hkv, H))
            kv.stage(0, k, v)
            ref.write(0, ref.committed, k, v)
            q = torch.cat([q, torch.randn(3, H, D, generator=gen)])     # 3 padding rows
            got = kv.attention(0, q, 8, b, scale=0.3)
            torch.testing.assert_close(got, ref.attention(0, q, 8, b, scale=0.3),
                                       rtol=1e-5, atol=1e-5)
            assert not got[8:].any()
        kv.commit(8)
        ref.commit(8)
    assert kv.window_full and kv.gqa == "native"


def test_roll_keeps_the_buffers_in_place():
    g = Geometry(pin_tokens=2, window_tokens=4, max_staged_tokens=3, causal_block_sizes=(3,))
    kv = _kv(g, layers=1)
    _prefill_stamps(kv)
    ptrs = [b.data_ptr() for b in kv.k_buffers + kv.v_buffers]
    assert kv.capacity == 9 and kv.buffer_bytes == 2 * 9 * 2 * 4 * 4
    for _ in range(5):
        k = _stamp(0, range(kv.committed, kv.committed + 3), 2, 4)
        kv.stage(0, k, -k)
        kv.commit(3)
    _check_window(kv)
    assert [b.data_ptr() for b in kv.k_buffers + kv.v_buffers] == ptrs
    kv.reset()
    assert kv.committed == kv.history == 0 and not kv.k_buffers[0].any()


# ---------------------------------------------------------------------- errors and hooks
def test_backend_names_are_checked():
    assert sdpa_backend_name(None, "cpu") == "math" and SDPA_BACKENDS == ("cudnn", "flash",
                                                                           "efficient", "math")
    with pytest.raises(ValueError, match="backend must be one of 'cudnn', 'flash', 'efficient', "
                                         "'math', got 'fast'"):
        DenseRollout("tiny", backend="fast")
    with pytest.raises(ValueError, match="backend must be one of"):
        DenseRollingKV(TINY.rollout.geometry(), num_layers=1, num_kv_heads=2, head_dim=4,
                       backend=3)
    # On CPU every backend name is accepted and math runs, in fp32.
    r = DenseRollout("tiny", backend="flash", use_graphs=False)
    assert r.kv.backend == "flash" and r.kv.kernel == "math" and r.backend == "sdpa-math"


def test_buffer_errors():
    g = Geometry(pin_tokens=2, window_tokens=4, max_staged_tokens=3, causal_block_sizes=(1, 3))
    kv = _kv(g, layers=1)
    k = torch.zeros(3, 2, 4)
    kv.commit_prompt()
    with pytest.raises(ValueError, match="C = 0 only"):
        kv.commit_prompt()
    with pytest.raises(ValueError, match="empty buffer"):
        kv.prompt_forward(kv.pin_tokens)
    with pytest.raises(ValueError, match="layer"):
        kv.stage(1, k, k)
    with pytest.raises(ValueError, match=r"k and v must both be \[T, 2, 4\]"):
        kv.stage(0, k, torch.zeros(3, 1, 4))
    with pytest.raises(ValueError, match="1 to 3 tokens"):
        kv.stage(0, torch.zeros(4, 2, 4), torch.zeros(4, 2, 4))
    kv.stage(0, k[:1], k[:1])
    with pytest.raises(ValueError, match="staged tokens"):
        kv.attention(0, torch.zeros(3, 4, 4), 3, 1)
    with pytest.raises(ValueError, match="n must be in"):
        kv.commit(2)
    with pytest.raises(ValueError, match="full window"):
        kv.after_replay(1)
    with pytest.raises(ValueError, match="geometry must be a Geometry"):
        DenseRollingKV(None, num_layers=1, num_kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match="dtype"):
        DenseRollingKV(g, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.int32)


def test_rollout_lifecycle_errors():
    r = DenseRollout("tiny")
    assert r.cache is None
    with pytest.raises(ValueError, match="prefill"):
        r.step()
    r.prefill()
    with pytest.raises(ValueError, match="already prefilled"):
        r.prefill()
    with pytest.raises(ValueError, match="another spec or prompt length"):
        DenseRollout(_specs(prompt_tokens=7), model=r.model)
    # Graphs are captured at a full window and replayed only at one.
    assert not r.kv.replayable and r.step().shape[2] == 2 and r.path == "eager"
    r.close()
    with pytest.raises(ValueError, match="closed"):
        r.kv.stage(0, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16))


class _DenseStore(KVStore):
    """A store that keeps nothing: every forward attends densely over its own tokens;
    it records what the model asks of the seam."""

    def __init__(self, geometry):
        self.geometry, self.seen = geometry, []

    def forward(self, seq_len, block_size):
        def attend(attn, qkv):
            self.seen.append(("forward", attn.layer_idx, qkv.shape[1], seq_len, block_size))
            return attn(qkv)
        return plain(attend)

    def prompt_forward(self, prompt_tokens):
        def attend(attn, qkv):
            self.seen.append(("prompt", attn.layer_idx, qkv.shape[1]))
            return attn(qkv)
        return plain(attend)

    def commit_prompt(self):
        self.seen.append(("commit_prompt",))

    def commit(self, n):
        self.seen.append(("commit", n))

    def reset(self):
        self.seen.clear()


def test_model_forward_goes_through_the_store():
    m = CausalVideoDiT(TINY.model, prompt_tokens=TINY.rollout.prompt_tokens)
    x = torch.randn(1, 4, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    t, f0 = torch.ones(1), torch.zeros(1, dtype=torch.int64)
    store, L = _DenseStore(TINY.rollout.geometry()), TINY.model.num_layers
    # A store that attends densely gives the plain forward; every layer asks it once.
    dense = m(x, t, ForwardContext(None, seq_len=None, frame0=f0))
    ctx = ForwardContext(store, seq_len=32, block_size=16, frame0=f0)
    assert torch.equal(m(x, t, ctx), dense)
    assert store.seen == [("forward", i, 32, 32, 16) for i in range(L)]
    store.reset()
    # The prompt: every layer sees the P prompt tokens once, then one commit.
    m.prefill(store)
    P = TINY.rollout.prompt_tokens
    assert store.seen == [("prompt", i, P) for i in range(L)] + [("commit_prompt",)]
    with pytest.raises(ValueError, match="kv must be a framekv.engine.kv.KVStore"):
        m.prefill(ExactWindowReference(TINY.rollout.geometry(), L))
    assert np.isfinite(dense.numpy()).all()
