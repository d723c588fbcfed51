"""Replay-correctness harness: a rollout eagerly, through graph replay, and against the
fp32 exact-window reference, for users' test suites and ``framekv verify``.

::

    from framekv.engine import verify_rollout

    def test_my_preset():
        verify_rollout("my-preset.toml", chunks=8).assert_ok()

Three comparisons per rollout:

1. attention, per layer and per forward: the eager rollout runs with an attention
   recorder (`ChunkRunner.attention_recorder`); every attention's packed Q/K/V goes into an `ExactWindowReference` (the K/V
   at the positions the cache staged them) and the cache's output is compared with
   the reference's fp32 attention over exactly V(j);
2. graph replay: a second rollout with graphs on (replays on CUDA; eager calls on CPU,
   where this is the same computation) is compared chunk by chunk with the eager one;
3. the tolerance: each error is a max abs error; any above it fails the report.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .cache import ExactWindowReference
from .rollout import Rollout, resolve_specs, with_chunks

#: Default tolerances by compute dtype: fp32 math differs in summation order only;
#: bf16/fp16 outputs round at about 2^-8 of their magnitude.
DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}


class ReferenceRollout(Rollout):
    """The same rollout with every attention recomputed densely in fp32 over its visible
    positions by an `ExactWindowReference` (``kv="reference"``: no cache reads, no
    graphs). Its memory grows with the rollout: for tests and short checks.

    Attributes:
        reference: the store's `ExactWindowReference` (a new one after each reset).
    """

    def __init__(self, preset="tiny", device=None, *, model=None):
        super().__init__(preset, device, backend="reference", use_graphs=False, model=model,
                         kv="reference")

    @property
    def reference(self) -> ExactWindowReference:
        return self.kv.reference


@dataclass
class VerifyReport:
    """What `verify_rollout` measured.

    Attributes:
        preset, device, backend, dtype, chunks, glue: what ran.
        tolerance: the max abs error allowed.
        graphs_eager: True where the graph side ran eagerly (CPU).
        attention_errors: step label ("prefill", "denoise 0", ..., "clean") -> max abs
            error per layer over all chunks, attention output vs the fp32 reference.
        replay_errors: per chunk, max abs error of the graph side's latents vs eager.
    """

    preset: str
    device: str
    backend: str
    dtype: str
    chunks: int
    tolerance: float
    graphs_eager: bool
    glue: str = "fused"
    attention_errors: dict[str, list[float]] = field(default_factory=dict)
    replay_errors: list[float] = field(default_factory=list)

    @property
    def max_attention_error(self) -> float:
        return max((e for row in self.attention_errors.values() for e in row), default=0.0)

    @property
    def max_replay_error(self) -> float:
        return max(self.replay_errors, default=0.0)

    @property
    def ok(self) -> bool:
        """Every error finite and within the tolerance."""
        worst = max(self.max_attention_error, self.max_replay_error)
        return worst == worst and worst <= self.tolerance  # NaN fails

    def assert_ok(self) -> None:
        """AssertionError with the formatted report unless `ok`."""
        if not self.ok:
            raise AssertionError("rollout verification failed\n" + self.format())

    def format(self) -> str:
        """The report as a text table."""
        layers = len(next(iter(self.attention_errors.values()), []))
        head = f"{'step':<10}" + "".join(f"{'layer ' + str(i):>10}" for i in range(layers))
        lines = [f"framekv verify: preset {self.preset}, {self.chunks} chunks, device "
                 f"{self.device}, backend {self.backend}, {self.dtype}, {self.glue} glue, "
                 f"tolerance {self.tolerance:.1e}",
                 "attention vs fp32 exact-window reference (max abs error over chunks):",
                 "  " + head]
        for label, row in self.attention_errors.items():
            lines.append("  " + f"{label:<10}" + "".join(f"{e:>10.2e}" for e in row))
        note = (" (on cpu the graph cache runs each chunk eagerly: both sides are eager)"
                if self.graphs_eager else "")
        lines.append(f"graph replay vs eager, clean latents per chunk{note}:")
        for i in range(0, len(self.replay_errors), 8):
            part = self.replay_errors[i:i + 8]
            lines.append(f"  chunks {i:>3}-{i + len(part) - 1:<3}" + "".join(f"{e:>10.2e}" for e in part))
        worst = max(self.max_attention_error, self.max_replay_error)
        verdict = "OK" if self.ok else "FAILED"
        rel = "<=" if self.ok else ">"
        lines.append(f"result: {verdict} (max error {worst:.2e} {rel} tolerance {self.tolerance:.1e})")
        return "\n".join(lines)


class _AttentionRecorder:
    """Model recorder: feeds each attention's K/V to the reference, keeps max errors."""

    def __init__(self, reference: ExactWindowReference, num_layers: int, steps: int):
        self.reference, self.num_layers = reference, num_layers
        self.labels = [f"denoise {i}" for i in range(steps)] + ["clean"]
        self.errors: dict[str, list[float]] = {}
        self.label: str | None = "prefill"
        self.calls = 0

    def start_chunk(self) -> None:
        self.label, self.calls = None, 0

    def __call__(self, layer, qkv, out, seq_len, block_size) -> None:
        label = self.label or self.labels[self.calls // self.num_layers]
        self.calls += 1
        H = out.shape[2]                                                  # out [1, S, H, D]
        Hkv = (qkv.shape[2] - H) // 2
        ref = self.reference
        ref.write(layer, ref.committed, qkv[0, :seq_len, H:H + Hkv], qkv[0, :seq_len, H + Hkv:])
        want = ref.attention(layer, qkv[0, :, :H], seq_len, block_size)   # fp32 [S, H, D]
        err = float((out[0].float().cpu() - want).abs().max())
        row = self.errors.setdefault(label, [0.0] * self.num_layers)
        row[layer] = max(row[layer], err) if err == err else float("nan")


def verify_rollout(preset="tiny", *, chunks: int | None = None, device=None, backend=None,
                   tolerance: float | None = None, glue: str = "fused") -> VerifyReport:
    """Run a rollout eagerly, through graph replay, and against the fp32 reference.

    Args:
        preset: a `Preset`, a preset name or path, or a (ModelSpec, RolloutSpec) pair.
        chunks: chunks to run (default: the preset's count).
        device: "cpu", "cuda[:N]" or None (cuda if available).
        backend: attention backend of the rollouts (default: cudnn on CUDA, reference on CPU).
        tolerance: max abs error allowed (default by dtype, `DEFAULT_TOLERANCE`).
        glue: the model's glue, "fused" (default) or "torch" (`Rollout`'s ``glue``); with "fused"
            the eager side runs the QK prologue in place (its recorder reads the packed
            K) and the graph side stages it into the cache, so the replay errors also
            compare the two.
    Returns a `VerifyReport`; ``report.assert_ok()`` for tests.
    """
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(
            tolerance, (int, float)) or not math.isfinite(tolerance) or tolerance < 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    name, mspec, rspec = resolve_specs(preset)
    if chunks is not None:
        rspec = with_chunks(rspec, chunks)
    eager = Rollout((mspec, rspec), device, backend=backend, use_graphs=False, glue=glue)
    tol = DEFAULT_TOLERANCE[eager.dtype] if tolerance is None else float(tolerance)
    report = VerifyReport(name, str(eager.device), eager.backend, str(eager.dtype).removeprefix("torch."),
                          rspec.chunks, tol, graphs_eager=eager.device.type != "cuda", glue=glue)
    reference = ExactWindowReference(eager.geometry, mspec.num_layers)
    recorder = _AttentionRecorder(reference, mspec.num_layers, rspec.denoising_steps)
    eager.attention_recorder = recorder
    eager.prefill()
    if rspec.prompt_tokens:
        reference.commit(rspec.prompt_tokens)
    expected = []
    for _ in range(rspec.chunks):
        recorder.start_chunk()
        expected.append(eager.step())
        reference.commit(expected[-1].shape[2] * rspec.tokens_per_frame)
    report.attention_errors = {k: recorder.errors[k]
                               for k in ["prefill", *recorder.labels] if k in recorder.errors}
    eager.close()
    graphed = Rollout((mspec, rspec), device, backend=backend, use_graphs=True, model=eager.model,
                      glue=glue)
    graphed.prefill()
    for want in expected:
        got = graphed.step()
        report.replay_errors.append(float((got - want).abs().max()))
    graphed.close()
    return report

