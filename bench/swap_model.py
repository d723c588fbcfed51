"""The swap policy of `StreamScheduler` replayed on a CPU against a cost model: which
streams each step runs, its scratch rows, its swaps, and what they would cost on a GPU
whose step and swap times are given.

    python -m framekv.bench.swap_model [--sessions 16] [--slots 8] [--quantum 16]
        [--steps 400] [--warmup-steps 64] [--step-ms 1:54,2:99,4:205,8:360]
        [--export-ms 35] [--import-ms 76] [--start-ms 0] [--pipelined] [--log]
        [--json FILE]

A real scheduler (the tiny preset on the CPU) plans every step; its runner's `execute`
runs no model (`model_runner`): it returns zero latents and, for each swap out, a
placeholder state that the scheduler only hands back to a later swap in. A step costs,
on a virtual clock, its batch's step time (``--step-ms``, per batch size: sizes between
two given ones interpolated, sizes above the largest scaled from it) plus its swaps:
``--export-ms`` per swap out, ``--import-ms`` per swap in and ``--start-ms`` per stream
started, in turn, or with ``--pipelined`` the exports one after another beside the
imports, each import after its slot's export (`CostModel`). Every session is open-ended and its
client takes and acknowledges each chunk as soon as it is queued. Deterministic: the
same arguments give the same steps.

Reported over the steps after ``--warmup-steps``: chunks per virtual second against
``--slots`` sessions resident (every step a full batch at its step time, no swap), the
chunks per session (min, max), the batch sizes seen, the scratch rows per step, the
steps that ran a scratch row while a ready session waited, the steps that swapped, the
swaps and their seconds; ``--log`` prints every step.
"""
from __future__ import annotations

import argparse
import collections
import sys
from dataclasses import asdict, dataclass, field

import torch

from .timing import write_result

#: batch size -> seconds of one step: small-stream batches on an H100
H100_SMALL_STREAM = {1: 0.054, 2: 0.099, 4: 0.205, 8: 0.360}


@dataclass
class StepRecord:
    """One `execute` of a plan: its rows (scratch rows included), the sessions of the
    batch, the sessions swapped out, restored and started, how many ready sessions
    the batch left out, and its cost (seconds; 0 until a `CostModel` prices it)."""

    rows: int
    streams: list[str]
    outs: list[str]
    ins: list[str]
    starts: list[str]
    left_waiting: int
    seconds: float = 0.0

    @property
    def scratch(self) -> int:
        """Rows that run no session (padding to a captured batch size)."""
        return self.rows - len(self.streams)


@dataclass
class CostModel:
    """Seconds of a step (``step_s``: batch size -> seconds) and of each swap; with
    ``pipelined`` a step's exports run one after another beside its imports, each
    import after its slot's export and the import before it (exports on one stream,
    imports on another); else every swap in turn."""

    step_s: dict[int, float] = field(default_factory=lambda: dict(H100_SMALL_STREAM))
    export_s: float = 0.035
    import_s: float = 0.076
    start_s: float = 0.0
    pipelined: bool = False

    def step_seconds(self, rows: int) -> float:
        """A batch of ``rows`` rows: given, interpolated, or scaled from the largest."""
        sizes = sorted(self.step_s)
        if rows in self.step_s or rows == 0:
            return self.step_s.get(rows, 0.0)
        if rows > sizes[-1]:
            return self.step_s[sizes[-1]] * rows / sizes[-1]
        lo = max([b for b in sizes if b < rows], default=0)
        hi = min(b for b in sizes if b > rows)
        t0 = self.step_s.get(lo, 0.0)
        return t0 + (self.step_s[hi] - t0) * (rows - lo) / (hi - lo)

    def seconds(self, r: StepRecord) -> float:
        """One step: its swaps (class doc), then its chunk."""
        return self.step_seconds(r.rows) + self.swap_seconds(r)

    def swap_seconds(self, r: StepRecord) -> float:
        """A step's swaps: in turn, or pipelined (class doc; starts first, each of the
        streams coming in taking the slot of the swap out of the same rank)."""
        coming = [self.start_s] * len(r.starts) + [self.import_s] * len(r.ins)
        if not self.pipelined:
            return self.export_s * len(r.outs) + sum(coming)
        t = 0.0
        for i, cost in enumerate(coming):
            t = max(t, self.export_s * (i + 1) if i < len(r.outs) else 0.0) + cost
        return max(t, self.export_s * len(r.outs))


class _Parked:
    """What a modelled swap out leaves: its bytes, nothing else."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def synchronize(self) -> None:
        pass


def record_steps(sched, *, model: bool = False) -> list[StepRecord]:
    """Record every plan ``sched`` runs from now on (its runner's `execute` wrapped):
    the list fills as it steps. ``model``: run no model, as `model_runner` says."""
    runner, log = sched.runner, []
    real = runner.execute

    def execute(plan):
        left = sum(1 for s in list(sched.sessions.values())
                   if sched._is_ready(s) and s.id not in plan.streams)
        log.append(StepRecord(len(plan.rows), list(plan.streams),
                              [sw.stream for sw in plan.swap_outs],
                              [sw.stream for sw in plan.swap_ins if sw.state is not None],
                              [sw.stream for sw in plan.swap_ins if sw.state is None], left))
        return _modelled(runner, plan) if model else real(plan)

    runner.execute = execute
    return log


def _modelled(runner, plan):
    """A `StepResult` of zero latents and placeholder states: no model runs."""
    from framekv.engine.step import StepResult

    res = StepResult()
    for sw in plan.swap_outs:
        res.parked[sw.stream] = _Parked(1)
    if plan.rows:
        res.latents = torch.zeros(len(plan.rows), *runner.chunk_shape)   # [B, C, F, H, W]
    return res


def drain(sched) -> None:
    """Every session's queued chunks taken and acknowledged, as a client keeping up."""
    for sid in list(sched.sessions):
        while (chunk := sched.next_chunk(sid, 0)) is not None:
            sched.ack(sid, chunk.index)


def model_scheduler(sessions: int, slots: int, quantum: int, **kw):
    """A tiny-preset CPU `StreamScheduler` of ``sessions`` over ``slots`` whose runner
    runs no model, and the list its steps are recorded in (`record_steps`)."""
    from framekv.engine.serving import StreamScheduler

    sched = StreamScheduler("tiny", max_sessions=sessions, slots=slots, device="cpu",
                            use_graphs=False, swap_quantum=quantum, **kw)
    return sched, record_steps(sched, model=True)


def summarize(log: list[StepRecord], names: dict[str, int], slots: int,
              cost: CostModel) -> dict:
    """What the module doc reports, over the records ``log`` (priced by ``cost``)."""
    chunks = collections.Counter({i: 0 for i in names.values()})
    for r in log:
        chunks.update(names[sid] for sid in r.streams)
    seconds = sum(cost.seconds(r) for r in log)
    made = sum(len(r.streams) for r in log)
    resident = slots / cost.step_seconds(slots)
    swapping = [r for r in log if r.outs or r.ins or r.starts]
    return {"steps": len(log), "seconds": seconds, "chunks": made,
            "chunks_per_second": made / seconds if seconds else 0.0,
            "resident_chunks_per_second": resident,
            "vs_resident": made / seconds / resident if seconds else 0.0,
            "chunks_per_session_min": min(chunks.values()),
            "chunks_per_session_max": max(chunks.values()),
            "batch_sizes": dict(sorted(collections.Counter(r.rows for r in log).items())),
            "scratch_rows_per_step": sum(r.scratch for r in log) / max(len(log), 1),
            "scratch_while_waiting": sum(1 for r in log if r.scratch and r.left_waiting),
            "swap_steps": len(swapping), "swap_outs": sum(len(r.outs) for r in log),
            "swap_ins": sum(len(r.ins) for r in log),
            "swap_seconds": sum(cost.swap_seconds(r) for r in log)}


def simulate(sessions: int = 16, slots: int = 8, quantum: int = 16, steps: int = 400,
             warmup_steps: int = 64, cost: CostModel | None = None,
             queue_chunks: int = 4) -> tuple[dict, list[StepRecord], dict[str, int]]:
    """``sessions`` open-ended sessions over ``slots`` slots for ``steps`` steps (module
    doc): (summary after ``warmup_steps``, every step's record, session id -> number)."""
    cost = cost or CostModel()
    sched, log = model_scheduler(sessions, slots, quantum, queue_chunks=queue_chunks)
    try:
        names = {sched.open_session(seed=i).id: i for i in range(sessions)}
        for _ in range(steps):
            sched.step()
            drain(sched)
    finally:
        sched.close()
    for r in log:
        r.seconds = cost.seconds(r)
    return summarize(log[warmup_steps:], names, slots, cost), log, names


def _step_ms(text: str) -> dict[int, float]:
    try:
        pairs = [p.split(":") for p in text.split(",") if p]
        out = {int(b): float(ms) / 1e3 for b, ms in pairs}
    except ValueError:
        out = {}
    if not out or any(b < 1 or s <= 0 for b, s in out.items()):
        raise argparse.ArgumentTypeError(
            f"want BATCH:MS pairs with BATCH >= 1 and MS > 0, e.g. 1:54,8:360, got {text!r}")
    return out


def format_model(res: dict, args) -> str:
    return (f"{args.sessions} sessions over {args.slots} slots, quantum {args.quantum}: "
            f"{res['vs_resident']:.3f} of resident ({res['chunks_per_second']:.2f} against "
            f"{res['resident_chunks_per_second']:.2f} chunks/s), chunks per session "
            f"{res['chunks_per_session_min']}-{res['chunks_per_session_max']} over "
            f"{res['steps']} steps; batch sizes {res['batch_sizes']}, scratch rows per step "
            f"{res['scratch_rows_per_step']:.2f} ({res['scratch_while_waiting']} steps while "
            f"a session waited); {res['swap_steps']} steps swapped {res['swap_outs']} out, "
            f"{res['swap_ins']} in, {res['swap_seconds']:.2f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.swap_model",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--quantum", type=int, default=16, help="the scheduler's swap_quantum")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup-steps", type=int, default=64)
    p.add_argument("--step-ms", type=_step_ms, default=H100_SMALL_STREAM,
                   help="BATCH:MS pairs, a step's time per batch size")
    p.add_argument("--export-ms", type=float, default=35.0)
    p.add_argument("--import-ms", type=float, default=76.0)
    p.add_argument("--start-ms", type=float, default=0.0)
    p.add_argument("--pipelined", action="store_true",
                   help="a step's exports beside its imports (CostModel), not in turn")
    p.add_argument("--log", action="store_true", help="print every step")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    for name in ("sessions", "slots", "quantum", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.warmup_steps < args.steps:
        p.error(f"--warmup-steps must be in [0, --steps={args.steps}), got {args.warmup_steps}")
    if args.slots > args.sessions:
        p.error(f"--slots must be <= --sessions={args.sessions}, got {args.slots}")
    if min(args.export_ms, args.import_ms, args.start_ms) < 0:
        p.error("--export-ms, --import-ms and --start-ms must be >= 0")
    cost = CostModel(args.step_ms, args.export_ms / 1e3, args.import_ms / 1e3,
                     args.start_ms / 1e3, args.pipelined)
    res, log, names = simulate(args.sessions, args.slots, args.quantum, args.steps,
                               args.warmup_steps, cost)
    if args.log:
        for i, r in enumerate(log):
            print(f"step {i:4d}: rows {r.rows} scratch {r.scratch} waiting {r.left_waiting} "
                  f"out {[names[s] for s in r.outs]} in {[names[s] for s in r.ins]} "
                  f"start {[names[s] for s in r.starts]} {r.seconds * 1e3:.0f} ms")
    print(format_model(res, args))
    write_result(args.json, swap_model={**res, "args": {k: v for k, v in vars(args).items()
                                                           if k not in ("json", "log")},
                                        "log": [asdict(r) for r in log]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
