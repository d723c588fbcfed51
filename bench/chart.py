"""The chart of a `framekv bench` run (matplotlib, drawn off-screen).

One panel per section present in the results: attention median µs per variant (the
dense cuDNN baseline dashed across), the chunk cycle (pieces, per-forward graphs,
whole-chunk graph), and end-to-end latent frames per second per window.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

_FRAMEKV, _OTHER = "#2a7ab9", "#9a9a9a"


def _color(name: str) -> str:
    return _FRAMEKV if name.startswith("framekv") else _OTHER


def _attention(ax, res: dict) -> None:
    names = list(res["variants"])
    med = [res["variants"][n]["us"]["median"] for n in names]
    ax.barh(names, med, color=[_color(n) for n in names])
    if "sdpa-cudnn" in res["variants"]:
        ax.axvline(res["variants"]["sdpa-cudnn"]["us"]["median"], ls="--", c="k", lw=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("µs per layer (median, L2 flushed)")
    ax.set_title(f"attention: {res['tokens']} queries over {res['keys']} keys")


def _chunk(ax, res: dict) -> None:
    d = res["device_us"]
    names = list(d)
    ax.barh(names, [d[n]["median"] / 1e3 for n in names], color=_FRAMEKV)
    ax.invert_yaxis()
    ax.set_xlabel("ms (median)")
    paired = res.get("whole_over_per_forward_paired", res["whole_chunk_over_pieces"])
    ax.set_title(f"chunk cycle, {res['layers']} layers; whole-chunk graph / per-forward "
                 f"graphs = {paired:.4f}")


def _e2e(ax, runs: list) -> None:
    width = 0.8 / max(len(runs), 1)
    variants = [v for v in runs[0]["variants"] if "frames_per_second" in runs[0]["variants"][v]]
    top = 0.0
    for i, run in enumerate(runs):
        fps = [run["variants"].get(v, {}).get("frames_per_second", 0.0) for v in variants]
        bars = ax.bar([x + i * width for x in range(len(variants))], fps, width,
                      label=f"window {run['window_frames']} frames")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        top = max([top, *fps])
    ax.set_ylim(0, top * 1.3 or 1.0)  # headroom: the legend sits above the tallest bars
    ax.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(variants))], variants,
                  rotation=15)
    ax.set_ylabel("latent frames / s")
    ax.set_title(f"end to end: {runs[0]['preset']}")
    ax.legend(loc="upper center", ncol=max(len(runs), 1))


def draw(results: dict, path: str) -> None:
    """Write the chart of ``results`` (the ``--json`` document) to ``path`` (PNG)."""
    sec = results.get("sections", {})
    panels = [(f, sec[k]) for k, f in (("attention", _attention), ("chunk", _chunk), ("e2e", _e2e))
              if sec.get(k)]
    if not panels:
        raise ValueError("results hold no section to draw")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.6 * len(panels)), squeeze=False)
    for ax, (fn, data) in zip(axes[:, 0], panels):
        fn(ax, data)
    env = results.get("environment", {})
    fig.suptitle(f"framekv bench — {env.get('device', '?')}, torch {env.get('torch', '?')}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
