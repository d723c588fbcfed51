"""A DiT block's glue: torch ops, the same function under torch.compile (inductor), and
framekv's fused ops.

The glue is everything of a block but its GEMMs and attention: the adaptive norms and
modulation, the QK RMSNorm and rope, the gated residuals, the GELU. Timed here on one
block of a preset at a chunk's token count (its projections' outputs given), with the
MLP's first GEMM included in every variant (framekv's GELU is that GEMM's epilogue):

    torch      the reference model's unfused glue (`CausalVideoDiT.glue = "torch"`)
    inductor   the same Python function through ``torch.compile`` (default mode):
               what a user would reach for instead
    framekv    `adaln_`, `qk_norm_rope_stage_` (in place), `adaln_` with the gated
               residual, cuBLASLt bias + GELU, `gated_residual_`

Each variant is captured as one CUDA graph and timed with CUDA events, the variants'
order rotated every round, the first GEMM alone timed in the same rounds; medians
reported, and each variant's glue (its time less the GEMM's) with the GB/s of the
glue's own bytes (`glue_bytes`: its tensors read and written once, what a perfect
fusion moves).
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from framekv import ops


def _inputs(m, S: int, device) -> dict:
    """Random activations of one block at S tokens (bf16, the model's shapes)."""
    g = torch.Generator(device=device).manual_seed(0)
    H, Hkv, D, hid = m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)
    return {"x": r(1, S, hid), "mods": [r(1, 1, hid, scale=0.1) for _ in range(6)],
            "qkv": r(1, S, H + 2 * Hkv, D), "proj": r(1, S, hid), "fc2": r(1, S, hid),
            "qn": _rms_norm(r(D, scale=0.1) + 1), "kn": _rms_norm(r(D, scale=0.1) + 1),
            "fc1": torch.nn.Linear(hid, m.ffn_size, device=device, dtype=torch.bfloat16)}


def _rms_norm(weight: torch.Tensor):
    """The model's per-head QK norm (`blocks.RMSNorm`) with this weight."""
    from framekv.engine.model.blocks import RMSNorm

    norm = RMSNorm(weight.shape[0]).to(weight.device).requires_grad_(False)
    norm.weight.copy_(weight)
    return norm


def torch_glue(x, mods, qkv, proj, fc2, cos, sin, qn, kn, fc1, H: int, Hkv: int):
    """The reference block's glue as torch ops (returns what the GEMMs would read);
    qn, kn: the QK norms (`blocks.RMSNorm`)."""
    from framekv.engine.model.blocks import apply_rope, modulate

    shift1, scale1, gate1, shift2, scale2, gate2 = mods
    h1 = modulate(x, shift1, scale1)
    q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
    packed = torch.cat([apply_rope(qn(q), cos, sin), apply_rope(kn(k), cos, sin), v], 2)
    x = x + gate1 * proj
    h2 = modulate(x, shift2, scale2)
    mlp = F.gelu(fc1(h2), approximate="tanh")
    return h1, packed, mlp, x + gate2 * fc2


def fused_glue(x, mods, qkv, proj, fc2, rope, qn, kn, fc1, H: int, Hkv: int):
    """The same through framekv's ops (x and qkv updated in place)."""
    from framekv.engine.model.blocks import linear_gelu

    shift1, scale1, gate1, shift2, scale2, gate2 = mods
    h1 = ops.adaln_(x, shift=shift1, scale=scale1)
    ops.qk_norm_rope_stage_(qkv, qn.weight, kn.weight, num_heads=H, num_kv_heads=Hkv,
                            norm="head", eps=qn.eps, rope=rope)
    h2 = ops.adaln_(x, residual=proj, gate=gate1, shift=shift2, scale=scale2)
    mlp = linear_gelu(fc1, h2)
    ops.gated_residual_(x, fc2, gate2)
    return h1, mlp


def glue_bytes(m, S: int) -> int:
    """Bytes a perfect fusion of the glue moves (bf16): x read 3x and written 2x, the
    norm outputs written, qkv's q and k read and written, proj and fc2 read, the MLP's
    hidden activations written once (the GELU in the GEMM epilogue)."""
    hid, qk = m.hidden_size, (m.num_heads + m.num_kv_heads) * m.head_dim
    return 2 * S * (5 * hid + 2 * hid + 2 * qk + 2 * hid + m.ffn_size)


def measure_glue(preset: str = "wan-1.3b", *, iters: int = 30, progress=print) -> dict:
    """Median µs per variant of one block's glue at the preset's chunk tokens."""
    from framekv.bench.timing import captured_graph, interleaved_device_times
    from framekv.engine.model.blocks import Rope3D
    from framekv.engine.rollout import resolve_specs

    from .timing import summary

    _, m, r = resolve_specs(preset)
    S = r.frames_per_chunk * r.tokens_per_frame
    dev = torch.device("cuda")
    a = _inputs(m, S, dev)
    H, Hkv = m.num_heads, m.num_kv_heads
    grid = (m.latent_height // m.patch_size[1], m.latent_width // m.patch_size[2])
    rope3d = Rope3D(m.head_dim, grid, dev)
    frame0 = torch.tensor([7], device=dev)
    cos, sin = Rope3D.cos_sin(rope3d.angles(frame0, r.frames_per_chunk))
    args = (a["x"], a["mods"], a["qkv"], a["proj"], a["fc2"])
    tail = (a["qn"], a["kn"], a["fc1"], H, Hkv)
    progress(f"glue {preset}: torch.compile (inductor) of the torch glue")
    compiled = torch.compile(torch_glue, dynamic=False)
    fused_x, fused_qkv = a["x"].clone(), a["qkv"].clone()
    calls = {
        "torch": lambda: torch_glue(*args, cos, sin, *tail),
        "inductor": lambda: compiled(*args, cos, sin, *tail),
        "framekv": lambda: fused_glue(fused_x, a["mods"], fused_qkv, a["proj"], a["fc2"],
                                      rope3d.grid(frame0), *tail),
    }
    h = a["x"].clone()
    calls["fc1 GEMM alone"] = lambda: a["fc1"](h)  # what every variant's glue includes
    graphs = {name: captured_graph(fn) for name, fn in calls.items()}
    progress(f"glue {preset}: timing ({iters} rounds, order rotated)")
    times = interleaved_device_times({n: g.replay for n, g in graphs.items()}, iters, rotate=True)
    nbytes = glue_bytes(m, S)
    out = {"preset": preset, "tokens": S, "bytes": nbytes, "variants": {}}
    gemm = statistics.median(times["fc1 GEMM alone"])
    for name, ts in times.items():
        glue = statistics.median(ts) - gemm
        out["variants"][name] = {"us": summary(ts), "glue_us": glue,
                                 "glue_gb_per_s": nbytes / glue / 1e3 if glue > 0 else None}
    return out


def format_glue(res: dict) -> str:
    v = res["variants"]
    gemm = v["fc1 GEMM alone"]["us"]["median"]
    lines = [f"glue of one {res['preset']} block at {res['tokens']} tokens (the MLP's first "
             f"GEMM, {gemm:.1f} µs alone, included in each):"]
    for name, r in v.items():
        if name == "fc1 GEMM alone":
            continue
        med = r["us"]["median"]
        lines.append(f"  {name:<10}{med:>9.1f} µs  glue {med - gemm:>7.1f} µs  "
                     f"{v['torch']['us']['median'] / med:.2f}x torch")
    return "\n".join(lines)
