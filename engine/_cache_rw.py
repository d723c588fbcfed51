"""Writes and commit of `CausalKVCache`: the places where the cache crosses to kernels.

Hot path (every forward, every chunk): ``write_staged`` is one scatter launch;
``commit`` on CUDA is four launches reading only device memory. Edit path
(``write_range`` / ``zero_values``): host-built slot lists, uploaded per call.
"""
from __future__ import annotations

import numpy as np
import torch

from framekv import ops


class CacheWrites:
    """Mixin of `CausalKVCache`: staged writes, edits, commit."""

    # ------------------------------------------------------------------ forwards
    def write_staged(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                     causal_block_size: int) -> None:
        """Write this forward's T tokens of one layer at positions [C, C + T).

        Each token goes to its shared slot (read by later blocks and commits) and to
        its block's private slots; earlier blocks' tokens on a partly visible page
        are copied into later blocks' private slots (current_private). One launch.

        Args:
            layer: layer index.
            k, v: [T, H_kv, D] with any token/head strides (head dim contiguous), T a
                multiple of ``causal_block_size`` and <= max_staged_tokens.
            causal_block_size: a block size declared by the open geometry.
        """
        state = self._require_open()
        self._check_layer(layer)
        bt = self.block_tensors(causal_block_size)
        T = self._check_kv(k, v)
        M = state.plan.geometry.max_staged_tokens
        if T > M or T % causal_block_size:
            raise ValueError(
                f"k must hold a positive multiple of causal_block_size={causal_block_size} "
                f"tokens, at most max_staged_tokens={M}, got {T}")
        key = ("scatter", layer, causal_block_size)
        launch = state.launchers.get(key)
        if launch is None:
            launch = ops.bind_scatter_kv_slots(self.k_pool[layer], self.v_pool[layer],
                                               bt.staged_dst, bt.staged_dst2, bt.staged_src)
            state.launchers[key] = launch
        launch(k, v)
        state.host.note_staged(T)

    def note_staged(self, tokens: int) -> None:
        """Advance the host mirror's staged count as a forward of ``tokens`` would.

        For replays of a captured forward: the graph writes the K/V on the device,
        the host mirror learns of it here (it never reads the device back).
        """
        self._require_open().host.note_staged(tokens)

    # ------------------------------------------------------------------ commit
    def commit(self, n: int) -> None:
        """Make the first ``n`` staged tokens history: C += n, the window slides.

        ``commit_mirror(n)`` (validation, host mirror) then ``commit_device(n)``.
        """
        self.commit_mirror(n)
        self.commit_device(n)

    def commit_mirror(self, n: int) -> None:
        """Advance the host mirror only: what a replay of a captured commit needs."""
        state = self._require_open()
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= state.host.staged:
            raise ValueError(f"n must be an integer in [0, staged={state.host.staged}], got {n!r}")
        state.host.commit(n)
        self.layout_epoch += 1

    def commit_device(self, n: int) -> None:
        """The device side of commit(n), safe to capture: no host-computed argument
        but the constant n, no upload, no synchronisation. On CPU it applies the
        host mirror (unless numba's simulator runs the kernels), so it must follow
        ``commit_mirror(n)``."""
        state = self._require_open()
        self.layout_epoch += 1
        if ops.use_kernel(self._pool):  # CUDA, or numba's simulator on CPU
            self._commit_kernels(state, n)
        else:
            self._upload_layout(state)
        ops.copy_kv_slots_(self.k_pool, self.v_pool, state.flat["committed_src"],
                           state.flat["committed_dst"])

    def _commit_kernels(self, state, n: int) -> None:
        """advance counters -> rotate the ring -> rebuild every per-block tensor."""
        plan, g, t = state.plan, state.plan.geometry, state.flat
        ops.advance_commit_(t["counters"], n, pin_tokens=g.pin_tokens,
                            window_tokens=g.window_tokens,
                            tokens_per_page=plan.tokens_per_page, fixed_pages=plan.fixed_pages)
        ops.rotate_rows_(t["table"][plan.fixed_pages:], t["counters"][2:3])
        ops.causal_layout_(t["counters"], t["table"], t["desc"], t["rows"], t["seq_len_kv"],
                           t["staged_src"], t["staged_dst"], t["staged_dst2"],
                           t["committed_src"], t["committed_dst"],
                           pin_tokens=g.pin_tokens, window_tokens=g.window_tokens,
                           max_staged_tokens=g.max_staged_tokens,
                           tokens_per_page=plan.tokens_per_page,
                           fixed_pages=plan.fixed_pages, ring_pages=plan.ring_pages)

    # ------------------------------------------------------------------ edits
    def write_range(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite K/V of resident positions [start, start + T) of one layer.

        Committed positions' private copies are updated too, so the edit takes effect
        on the next forward. Staged positions are rewritten by every forward; an
        edit reaches the shared slot that the next commit reads.
        """
        state = self._require_open()
        self._check_layer(layer)
        T = self._check_kv(k, v)
        src_rows, dst = self._edit_targets(state, start, T)
        dev = self.device
        ops.scatter_kv_slots_(self.k_pool[layer], self.v_pool[layer], k, v,
                              torch.from_numpy(dst).to(dev), None,
                              torch.from_numpy(src_rows).to(dev))

    def zero_values(self, layer: int, start: int, n: int) -> None:
        """Zero V (not K) of resident positions [start, start + n) of one layer,
        private copies included."""
        state = self._require_open()
        self._check_layer(layer)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        _, dst = self._edit_targets(state, start, n)
        self.v_pool[layer].index_fill_(0, torch.from_numpy(dst).to(self.device), 0)

    def _edit_targets(self, state, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source row, slot) pairs of an edit: shared slots plus committed private copies."""
        h = state.host
        if isinstance(start, bool) or not isinstance(start, int):
            raise ValueError(f"start must be an integer, got {start!r}")
        rows = np.arange(count, dtype=np.int64)
        # slot_of raises ValueError naming the resident ranges for any other position.
        slots = np.array([h.slot_of(start + int(r)) for r in rows], np.int64)
        csrc, cdst = h.committed_copies()
        copies = {}
        for s_, d_ in zip(csrc.tolist(), cdst.tolist()):
            if s_ >= 0:
                copies.setdefault(s_, []).append(d_)
        extra_rows, extra_dst = [], []
        for r, slot in zip(rows.tolist(), slots.tolist()):
            if start + r < h.committed:
                for d_ in copies.get(slot, ()):
                    extra_rows.append(r)
                    extra_dst.append(d_)
        return (np.concatenate([rows, np.array(extra_rows, np.int64)]),
                np.concatenate([slots, np.array(extra_dst, np.int64)]))

    # ------------------------------------------------------------------ checks
    def _check_kv(self, k, v) -> int:
        want = (self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != want or t.shape[0] < 1:
                raise ValueError(f"{name} must have shape [T >= 1, {want[0]}, {want[1]}], "
                                 f"got {list(t.shape)}")
            if t.dtype != self.dtype:
                raise ValueError(f"{name} must have dtype {self.dtype}, got {t.dtype}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
        return int(k.shape[0])
