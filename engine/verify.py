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

With an fp8 K/V pool (``kv_dtype="fp8"``) the reference still holds the K/V the model
computed (unquantized, fp32), so the attention errors are the quantization's; the
report also carries both rollouts' saturation counts (`CausalKVCache.kv_stats`): a
value clamped to +-448 is never silent, it is printed and in the JSON (`to_dict`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from .cache import ExactWindowReference
from .rollout import Rollout, resolve_specs, with_chunks

#: Default tolerances by compute dtype: fp32 math differs in summation order only;
#: bf16/fp16 outputs round at about 2^-8 of their magnitude.
DEFAULT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 1e-2}
#: Default tolerance over an fp8 e4m3 pool, any compute dtype: a stored value is off by
#: up to 2^-4 of itself (3 mantissa bits), so an attention output (a softmax-weighted
#: mean of such values, its weights perturbed by K's rounding) by up to 2^-4 of the
#: largest |V|: 0.25 for values up to 4, as the shipped presets' random weights give.
#: Models with larger values need a larger ``tolerance``.
FP8_TOLERANCE = 2.5e-1


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
        kv_dtype: the dtype the K/V pool held (``dtype`` unless fp8).
        tolerance: the max abs error allowed.
        graphs_eager: True where the graph side ran eagerly (CPU).
        attention_errors: step label ("prefill", "denoise 0", ..., "clean") -> max abs
            error per layer over all chunks, attention output vs the fp32 reference.
        replay_errors: per chunk, max abs error of the graph side's latents vs eager.
        kv_stats: an fp8 pool's statistics (`CausalKVCache.kv_stats`: ``saturated``
            [L][K, V] counts, ``amax`` and ``scales`` [L][K, V][H_kv]) by side,
            "eager" and "graphs"; empty for another pool.
    """

    preset: str
    device: str
    backend: str
    dtype: str
    chunks: int
    tolerance: float
    graphs_eager: bool
    glue: str = "fused"
    kv_dtype: str = ""
    attention_errors: dict[str, list[float]] = field(default_factory=dict)
    replay_errors: list[float] = field(default_factory=list)
    kv_stats: dict[str, dict] = field(default_factory=dict)

    @property
    def saturated_values(self) -> int:
        """K/V values clamped to +-448 by an fp8 pool, both sides, every layer."""
        return sum(n for stats in self.kv_stats.values() for row in stats["saturated"]
                   for n in row)

    @property
    def saturated_q(self) -> int:
        """Q values clamped to +-448 where the backend quantizes Q (cuDNN), both sides."""
        return sum(sum(stats.get("q_saturated", ())) for stats in self.kv_stats.values())

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

    def to_dict(self) -> dict:
        """The report as JSON-able builtins, with ``ok``, the worst errors and
        ``saturated_values``."""
        out = dataclasses.asdict(self)
        out.update(ok=self.ok, max_attention_error=self.max_attention_error,
                   max_replay_error=self.max_replay_error,
                   saturated_values=self.saturated_values, saturated_q=self.saturated_q)
        return out

    def format(self) -> str:
        """The report as a text table."""
        layers = len(next(iter(self.attention_errors.values()), []))
        head = f"{'step':<10}" + "".join(f"{'layer ' + str(i):>10}" for i in range(layers))
        pool = (f", K/V pool {self.kv_dtype}" if self.kv_dtype and self.kv_dtype != self.dtype
                else "")
        lines = [f"framekv verify: preset {self.preset}, {self.chunks} chunks, device "
                 f"{self.device}, backend {self.backend}, {self.dtype}{pool}, {self.glue} "
                 f"glue, tolerance {self.tolerance:.1e}",
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
        lines += self._format_kv_stats()
        worst = max(self.max_attention_error, self.max_replay_error)
        verdict = "OK" if self.ok else "FAILED"
        rel = "<=" if self.ok else ">"
        lines.append(f"result: {verdict} (max error {worst:.2e} {rel} tolerance {self.tolerance:.1e})")
        return "\n".join(lines)

    def _format_kv_stats(self) -> list[str]:
        """The fp8 pool's saturation counts per layer (K/V) and scale range, each side."""
        if not self.kv_stats:
            return []
        lines = ["fp8 K/V saturation (values clamped to +-448), per layer K/V:"]
        for side, stats in self.kv_stats.items():
            counts = " ".join(f"{k}/{v}" for k, v in stats["saturated"])
            scales = [s for layer in stats["scales"] for kv in layer for s in kv]
            q = stats.get("q_saturated")
            q = f", Q {sum(q)}" if q is not None else ""
            lines.append(f"  {side:<7}{counts}   (scales {min(scales):.3g} to "
                         f"{max(scales):.3g}{q})")
        if self.saturated_values:
            lines.append(f"WARNING: {self.saturated_values} K/V values saturated: the scales "
                         "are too small for them (calibrate_kv_scales, or set_kv_scales)")
        if self.saturated_q:
            lines.append(f"WARNING: {self.saturated_q} Q values saturated: a declared |q| "
                         "bound is too small (CudnnBackend.set_q_bounds)")
        return lines


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
                   tolerance: float | None = None, glue: str = "fused", kv_dtype=None,
                   kv_scales=None) -> VerifyReport:
    """Run a rollout eagerly, through graph replay, and against the fp32 reference.

    Args:
        preset: a `Preset`, a preset name or path, or a (ModelSpec, RolloutSpec) pair.
        chunks: chunks to run (default: the preset's count).
        device: "cpu", "cuda[:N]" or None (cuda if available).
        backend: attention backend of the rollouts (default: cudnn on CUDA, reference on CPU).
        tolerance: max abs error allowed (default by dtype, `DEFAULT_TOLERANCE`; over an
            fp8 pool `FP8_TOLERANCE`).
        glue: the model's glue, "fused" (default) or "torch" (`Rollout`'s ``glue``); with "fused"
            the eager side runs the QK prologue in place (its recorder reads the packed
            K) and the graph side stages it into the cache, so the replay errors also
            compare the two.
        kv_dtype: the K/V pool of both rollouts (`Rollout`'s ``kv_dtype``: None or
            "bf16" the model's dtype, "fp8").
        kv_scales: an fp8 pool's scales for both rollouts (`CausalKVCache.set_kv_scales`:
            a number or fp32 values broadcastable to [L, 2, H_kv]); default 1.0.
    Returns a `VerifyReport`; ``report.assert_ok()`` for tests.
    """
    if tolerance is not None and (isinstance(tolerance, bool) or not isinstance(
            tolerance, (int, float)) or not math.isfinite(tolerance) or tolerance < 0):
        raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    name, mspec, rspec = resolve_specs(preset)
    if chunks is not None:
        rspec = with_chunks(rspec, chunks)
    eager = Rollout((mspec, rspec), device, backend=backend, use_graphs=False, glue=glue,
                    kv_dtype=kv_dtype)
    fp8 = eager.kv_dtype == torch.float8_e4m3fn
    if kv_scales is not None:
        if not fp8:
            eager.close()
            raise ValueError(f"kv_scales needs kv_dtype='fp8', got kv_dtype={kv_dtype!r}")
        eager.cache.set_kv_scales(kv_scales)
    tol = (FP8_TOLERANCE if fp8 else DEFAULT_TOLERANCE[eager.dtype]) if tolerance is None \
        else float(tolerance)
    report = VerifyReport(name, str(eager.device), eager.backend, _name(eager.dtype),
                          rspec.chunks, tol, graphs_eager=eager.device.type != "cuda", glue=glue,
                          kv_dtype=_name(eager.kv_dtype))
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
    if fp8:
        report.kv_stats["eager"] = _fp8_stats(eager)
    eager.close()
    graphed = Rollout((mspec, rspec), device, backend=backend, use_graphs=True, model=eager.model,
                      glue=glue, kv_dtype=kv_dtype)
    if kv_scales is not None:
        graphed.cache.set_kv_scales(kv_scales)
    if fp8:  # the captures' warm-up chunks write K/V too: count the rollout's alone
        graphed.capture(progress=False)
        graphed.cache.reset_kv_stats()
    graphed.prefill()
    for want in expected:
        got = graphed.step()
        report.replay_errors.append(float((got - want).abs().max()))
    if fp8:
        report.kv_stats["graphs"] = _fp8_stats(graphed)
    graphed.close()
    return report


def _fp8_stats(rollout: Rollout) -> dict:
    """The fp8 pool's `CausalKVCache.kv_stats`, plus ``q_saturated`` (Q values the
    staging clamped, per layer) where the backend quantizes Q (cuDNN)."""
    stats = rollout.cache.kv_stats()
    q_saturated = getattr(rollout.model.blocks[0].attn.backend, "q_saturated", None)
    if q_saturated is not None:
        stats["q_saturated"] = q_saturated(rollout.cache)
    return stats


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

