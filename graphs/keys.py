"""Graph keys: everything a captured CUDA graph bakes in, and nothing else.

A captured graph replays fixed kernels with fixed arguments over fixed addresses. Two
calls may share a graph exactly when everything baked into it is equal; that is what a
`GraphKey` holds. What only changes device *contents* (the commit count C, the staging
offset, the ring head: all device-resident and advanced by the kernels themselves) is
never part of a key, so one graph serves every chunk of a rollout.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any, Mapping

import msgspec
import torch

from framekv.specs import Geometry


def _check_int(field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")


def _check_str(field: str, value: Any) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{field} must be a non-empty string, got {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling `framekv.specs` uses)."""
    return str(dtype).removeprefix("torch.")


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The layout of one graph input: what the captured kernels were built for.

    Attributes:
        name: the keyword the callable receives the tensor under.
        shape: sizes; kernels' launch grids and loop bounds depend on them.
        stride: element strides; kernels index the static buffer with them.
        dtype: element type, e.g. "bfloat16"; kernels are specialised per type.
        device: e.g. "cuda:0"; a graph runs on one device.

    The address is not part of the spec: inputs are copied into static buffers.
    """

    name: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    device: str

    def __post_init__(self) -> None:
        _check_str("TensorSpec.name", self.name)
        for field in ("shape", "stride"):
            value = getattr(self, field)
            for i, v in enumerate(value):
                _check_int(f"TensorSpec.{field}[{i}]", v, 0 if field == "shape" else -(1 << 62))
            msgspec.structs.force_setattr(self, field, tuple(value))  # lists hash as tuples
        if len(self.shape) != len(self.stride):
            raise ValueError(f"TensorSpec {self.name!r}: shape {self.shape} and stride "
                             f"{self.stride} must have the same length")
        _check_str("TensorSpec.dtype", self.dtype)
        _check_str("TensorSpec.device", self.device)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        """The spec of ``tensor`` passed as input ``name``."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"input {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        return cls(name, tuple(tensor.shape), tuple(tensor.stride()), dtype_name(tensor.dtype),
                   str(tensor.device))

    def matches(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` has exactly this layout."""
        return self == TensorSpec.of(self.name, tensor)

    def summary(self) -> str:
        """``x[1,16,8]bfloat16@cuda:0`` (strides only when not contiguous)."""
        dims = ",".join(map(str, self.shape))
        contiguous = self.stride == _contiguous_strides(self.shape)
        strides = "" if contiguous else "/s" + ",".join(map(str, self.stride))
        return f"{self.name}[{dims}]{strides}{self.dtype}@{self.device}"


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(size, 1)
    return tuple(reversed(out))


def input_specs(inputs: Mapping[str, torch.Tensor] | None) -> tuple[TensorSpec, ...]:
    """TensorSpecs of an input mapping, sorted by name (mapping order is not baked)."""
    if inputs is None:
        return ()
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs must be a mapping of name to tensor, got {type(inputs).__name__}")
    return tuple(sorted((TensorSpec.of(n, t) for n, t in inputs.items()), key=lambda s: s.name))


class GraphKey(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything baked into one captured graph; equal keys may share a graph.

    Attributes:
        owner: identity of the object (cache, model) whose fixed-address tensors the
            graph reads and writes: its kernels hold those addresses, so two owners
            never share a graph. An int token from the caller; `owner_token` gives one
            that is never reused, unlike ``id()``.
        geometry: the cache geometry the graph's kernels were launched for (row
            counts, private-copy list lengths and block descriptors depend on it), or
            None for a graph that does not touch the cache.
        tokens: T, real tokens per forward; launch grids and the scatter list length
            depend on it (0 where no forward runs).
        block_sizes: the causal block size of each forward in the graph, in order;
            each selects different per-block tensors and launch shapes.
        program: what the callable does, e.g. "forward", "commit:1576",
            "chunk:4x1576+clean394+commit"; two callables with equal layouts but
            different work must not share a graph.
        inputs: layouts of the static input buffers, sorted by name.
        splits: split-KV sub-rows S of each forward (``block_sizes`` order), or empty
            when the attention does not split; a different S launches a different
            cuDNN graph, a different grid and a merge.
        packed: whether each forward (``block_sizes`` order) stacks the query heads of
            a K/V head into one row (GQA packing), or empty when it never does; packed
            launches run another cuDNN graph over a packed copy of Q.
        batch: B, the sequences of a pool each forward runs (1: one). The cuDNN batch
            rows (B x blocks), the gathered per-block tensors and every launch grid
            over tokens scale with it; which sequences is a device input, not baked.

    Never the commit count or staging offset: those change device contents, not the
    graph. Keys are hashable, compare by value and encode to JSON.
    """

    owner: int
    geometry: Geometry | None
    tokens: int
    block_sizes: tuple[int, ...]
    program: str
    inputs: tuple[TensorSpec, ...] = ()
    splits: tuple[int, ...] = ()
    batch: int = 1
    packed: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        _check_int("GraphKey.owner", self.owner, 0)
        _check_int("GraphKey.batch", self.batch, 1)
        msgspec.structs.force_setattr(self, "splits", tuple(self.splits))
        if self.splits and len(self.splits) != len(self.block_sizes):
            raise ValueError(f"GraphKey.splits must give one S per block size "
                             f"({len(self.block_sizes)}), got {self.splits}")
        for i, sp in enumerate(self.splits):
            _check_int(f"GraphKey.splits[{i}]", sp, 1)
        msgspec.structs.force_setattr(self, "packed", tuple(self.packed))
        if self.packed and len(self.packed) != len(self.block_sizes):
            raise ValueError(f"GraphKey.packed must give one flag per block size "
                             f"({len(self.block_sizes)}), got {self.packed}")
        for i, p in enumerate(self.packed):
            if not isinstance(p, bool):
                raise ValueError(f"GraphKey.packed[{i}] must be a bool, got {p!r}")
        msgspec.structs.force_setattr(self, "block_sizes", tuple(self.block_sizes))
        msgspec.structs.force_setattr(self, "inputs", tuple(self.inputs))
        _check_int("GraphKey.tokens", self.tokens, 0)
        _check_str("GraphKey.program", self.program)
        for i, b in enumerate(self.block_sizes):
            _check_int(f"GraphKey.block_sizes[{i}]", b, 1)
            if self.tokens and self.tokens % b:
                raise ValueError(f"GraphKey.block_sizes[{i}] must divide tokens "
                                 f"({self.tokens}), got {b}")
        if self.geometry is not None:
            self._check_geometry()
        for i, spec in enumerate(self.inputs):
            if not isinstance(spec, TensorSpec):
                raise ValueError(f"GraphKey.inputs[{i}] must be a TensorSpec, got "
                                 f"{type(spec).__name__}")
        names = [s.name for s in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"GraphKey.inputs must have distinct names, got {names}")
        # Sorted so that the order of the caller's input mapping never splits a key.
        msgspec.structs.force_setattr(self, "inputs",
                                      tuple(sorted(self.inputs, key=lambda s: s.name)))

    def _check_geometry(self) -> None:
        g = self.geometry
        if not isinstance(g, Geometry):
            raise ValueError(f"GraphKey.geometry must be a Geometry or None, "
                             f"got {type(g).__name__}")
        if self.tokens > g.max_staged_tokens:
            raise ValueError(f"GraphKey.tokens must be <= the geometry's max_staged_tokens "
                             f"({g.max_staged_tokens}), got {self.tokens}")
        for i, b in enumerate(self.block_sizes):
            if b not in g.causal_block_sizes:
                raise ValueError(f"GraphKey.block_sizes[{i}] must be one of the geometry's "
                                 f"causal_block_sizes {g.causal_block_sizes}, got {b}")

    @classmethod
    def build(cls, *, owner: int, program: str, inputs: Mapping[str, torch.Tensor] | None = None,
              geometry: Geometry | None = None, tokens: int = 0,
              block_sizes: tuple[int, ...] = (), splits: tuple[int, ...] = (),
              batch: int = 1, packed: tuple[bool, ...] = ()) -> "GraphKey":
        """A key from live input tensors (their layouts are taken, not their addresses)."""
        return cls(owner=owner, geometry=geometry, tokens=tokens,
                   block_sizes=tuple(block_sizes), program=program, inputs=input_specs(inputs),
                   splits=tuple(splits), batch=batch, packed=tuple(packed))

    def summary(self) -> str:
        """One line for logs and reports."""
        g = self.geometry
        geom = (f" P={g.pin_tokens} W={g.window_tokens} M={g.max_staged_tokens}"
                if g is not None else "")
        blocks = "/".join(map(str, self.block_sizes)) or "-"
        if self.splits:
            blocks += " splits=" + "/".join(map(str, self.splits))
        if any(self.packed):
            blocks += " packed=" + "/".join("y" if p else "n" for p in self.packed)
        ins = " ".join(s.summary() for s in self.inputs)
        batch = f" B={self.batch}" if self.batch > 1 else ""
        return (f"{self.program} T={self.tokens}{batch} blocks={blocks}{geom} owner={self.owner}"
                + (f" in: {ins}" if ins else ""))


# --------------------------------------------------------------------- owner tokens
_owner_counter = itertools.count(1)
_owner_tokens: dict[int, tuple[weakref.ref, int]] = {}


def owner_token(obj: Any) -> int:
    """A positive int naming ``obj`` for as long as it lives, never reused after.

    ``id(obj)`` can be reused by a later object at the same address, which would let
    a new cache pick up graphs that read a freed cache's memory; this token cannot.
    ``obj`` must support weak references (plain classes and torch modules do).
    """
    entry = _owner_tokens.get(id(obj))
    if entry is not None and entry[0]() is obj:
        return entry[1]
    token = next(_owner_counter)
    oid = id(obj)
    ref = weakref.ref(obj, lambda _r, oid=oid: _forget(oid, _r))
    _owner_tokens[oid] = (ref, token)
    return token


def _forget(oid: int, ref: weakref.ref) -> None:
    entry = _owner_tokens.get(oid)
    if entry is not None and entry[0] is ref:
        del _owner_tokens[oid]
