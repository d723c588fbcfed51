"""Persistent memory arenas: fixed addresses for everything a captured graph reads.

An arena reserves one address range up front and maps physical memory into it
as it grows, in whole chunks. Tensors are carved from it by a bump allocator and
never move, so a CUDA graph captured over them stays valid for the arena's life::

    reserved  |<------------------------------ reserve_bytes ------------------------------>|
    mapped    |<----- chunk ----->|<----- chunk ----->|                                      |
    used      |[pool......][table][rows]..|                                                  |
               ^ base (fixed)             ^ used_bytes (next carve, aligned)

`DeviceArena` uses the CUDA virtual memory API through cuda-python
(cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess) in the primary
context torch uses. `HostArena` offers the same interface over an anonymous
``mmap`` so the CPU engine and CI exercise the same code.

Closing an arena releases its memory; views carved from it must not be used
afterwards (the caller owns that ordering, as with any allocator).
"""
from __future__ import annotations

import abc
import math
import mmap

import torch

from framekv.ops import driver as _driver

#: Mapping chunk of device arenas: 2 MiB, the driver's minimum allocation granularity
#: on current GPUs (`DeviceArena` refuses a chunk that is not a multiple of the
#: device's). A fixed chunk makes `round_up` (and so the cache's `pool_bytes_for`)
#: exact without asking a device.
DEVICE_CHUNK_BYTES = 2 << 20
#: Host arenas account in pages of this size (the kernel maps 4 KiB pages on touch).
HOST_CHUNK_BYTES = 4096
#: Default alignment of carved tensors: 256 bytes suits 16-byte vector access,
#: TMA descriptors and cuDNN's pointer alignment rules.
DEFAULT_ALIGN = 256


class ArenaError(RuntimeError):
    """Base of arena failures."""


class ArenaExhaustedError(ArenaError, MemoryError):
    """A carve would pass the end of the reservation."""


class ArenaClosedError(ArenaError):
    """The arena was closed; it can carve nothing more."""


def round_up(nbytes: int, chunk: int) -> int:
    """``nbytes`` rounded up to a whole number of ``chunk``-byte pieces."""
    return -(-nbytes // chunk) * chunk


def carved_bytes(sizes: list[int], align: int = DEFAULT_ALIGN) -> int:
    """Bytes a bump allocator uses for tensors of ``sizes`` bytes, carved in order."""
    used = 0
    for n in sizes:
        used = round_up(used, align) + n
    return used


_DEFERRED: list = []  # arenas collected during a graph capture, closed at the next safe point


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized() and \
        torch.cuda.is_current_stream_capturing()


def release_deferred() -> None:
    """Close arenas whose last reference went away during a CUDA graph capture."""
    if _capturing():
        return
    while _DEFERRED:
        _DEFERRED.pop().close()


class _CAIView:
    """A raw byte range exposed through ``__cuda_array_interface__``.

    torch keeps this object alive with the tensor, and it holds the arena: an
    arena is never collected (and unmapped) while a tensor still aliases it.
    """

    def __init__(self, arena, ptr: int, nbytes: int):
        self._arena = arena
        # No 'stream' entry: consumers must not synchronise (that would break capture).
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
            "strides": None, "version": 2,
        }


class _ArenaBase(abc.ABC):
    """Bookkeeping shared by device and host arenas: bump carving and accounting."""

    chunk_bytes: int

    def __init__(self, reserve_bytes: int, chunk_bytes: int):
        if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes <= 0:
            raise ValueError(f"reserve_bytes must be a positive integer, got {reserve_bytes!r}")
        self.chunk_bytes = chunk_bytes
        self.reserved_bytes = round_up(reserve_bytes, chunk_bytes)
        self.mapped_bytes = 0
        self.used_bytes = 0
        self.allocations: list[tuple[str, int, int]] = []  # (name, offset, nbytes)
        self._closed = False

    # -- public -----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def free_bytes(self) -> int:
        """Bytes still carvable (before alignment of the next carve)."""
        return self.reserved_bytes - self.used_bytes

    def empty(self, shape, dtype: torch.dtype, *, align: int = DEFAULT_ALIGN,
              name: str = "") -> torch.Tensor:
        """Carve an uninitialised contiguous tensor at a fixed address.

        Args:
            shape: the tensor's shape (ints >= 0).
            dtype: any torch dtype.
            align: byte alignment of the start, a power of two >= the element size.
            name: a label kept in ``allocations`` for reports.
        Raises:
            ArenaClosedError: the arena is closed.
            ArenaExhaustedError: the carve passes the reservation (nothing changes).
            ValueError: a bad shape, dtype or alignment.
        """
        self._check_open()
        shape = _check_shape(shape)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if isinstance(align, bool) or not isinstance(align, int) or align < itemsize or align & (align - 1):
            raise ValueError(
                f"align must be a power of two >= the element size ({itemsize}), got {align!r}")
        nbytes = math.prod(shape) * itemsize
        offset = round_up(self.used_bytes, align)
        end = offset + nbytes
        if end > self.reserved_bytes:
            raise ArenaExhaustedError(
                f"arena carve of {nbytes} bytes ({name or 'unnamed'}) needs {end} bytes, "
                f"reservation holds {self.reserved_bytes} ({self.reserved_bytes - offset} free)")
        if end > self.mapped_bytes:
            self._grow(round_up(end, self.chunk_bytes))  # raises without changing state
        self.used_bytes = end
        self.allocations.append((name, offset, nbytes))
        raw = self._bytes_view(offset, max(nbytes, 1))[:nbytes]
        return raw.view(dtype).view(shape)

    def mark(self) -> int:
        """A point to `release_to` later: the current end of the carved bytes."""
        return self.used_bytes

    def release_to(self, mark: int) -> None:
        """Forget every carve made after ``mark`` and unmap the chunks only they used.

        For all-or-nothing setup: carve several tensors, and on failure return the
        arena to where it was. Views carved after the mark must not be used again.
        """
        if not 0 <= mark <= self.used_bytes:
            raise ValueError(f"mark must be in [0, used_bytes={self.used_bytes}], got {mark!r}")
        self.used_bytes = mark
        while self.allocations and self.allocations[-1][1] >= mark:
            self.allocations.pop()
        self._shrink(round_up(mark, self.chunk_bytes))

    def zeros(self, shape, dtype: torch.dtype, **kw) -> torch.Tensor:
        """Like `empty`, filled with zeros."""
        return self.empty(shape, dtype, **kw).zero_()

    def stats(self) -> dict:
        """Reserved, mapped and used bytes and the number of carves."""
        return {"reserved_bytes": self.reserved_bytes, "mapped_bytes": self.mapped_bytes,
                "used_bytes": self.used_bytes, "allocations": len(self.allocations),
                "closed": self._closed}

    def close(self) -> None:
        """Release all memory. Idempotent. Views carved earlier become invalid."""
        if not self._closed:
            self._release()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if _capturing():
                # Unmapping (and the synchronisation before it) would invalidate a CUDA
                # graph capture in progress; keep the arena until a safe point.
                _DEFERRED.append(self)
                return
            self.close()
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass

    def __repr__(self) -> str:
        s = self.stats()
        return (f"{type(self).__name__}(reserved={s['reserved_bytes']}, mapped={s['mapped_bytes']}, "
                f"used={s['used_bytes']}, closed={s['closed']})")

    # -- subclass hooks -------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise ArenaClosedError(f"{type(self).__name__} is closed")

    @abc.abstractmethod
    def _grow(self, new_mapped: int) -> None:
        """Subclass hook."""

    def _shrink(self, keep_mapped: int) -> None:
        """Unmap what lies past ``keep_mapped`` where the backing allows it."""
        self.mapped_bytes = min(self.mapped_bytes, max(keep_mapped, 0))

    @abc.abstractmethod
    def _bytes_view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Subclass hook."""

    @abc.abstractmethod
    def _release(self) -> None:
        """Subclass hook."""


def _check_shape(shape) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        shape = tuple(shape)
    except TypeError:
        raise ValueError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"shape must hold integers >= 0, got {shape!r}")
    return shape


class HostArena(_ArenaBase):
    """An arena in host memory: one anonymous mapping, pages committed on first touch.

    Same interface and accounting as `DeviceArena`, so the CPU engine runs the
    same code. Memory is returned when the arena is closed and the last view
    carved from it is gone.
    """

    device = torch.device("cpu")

    def __init__(self, reserve_bytes: int):
        super().__init__(reserve_bytes, HOST_CHUNK_BYTES)
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        self._map = mmap.mmap(-1, self.reserved_bytes, flags=flags)
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)

    def _grow(self, new_mapped: int) -> None:
        self.mapped_bytes = new_mapped  # the kernel maps the pages when they are touched

    def _bytes_view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self._base[offset:offset + nbytes]

    def _release(self) -> None:
        # Views hold the mmap object (torch.frombuffer keeps it): unmapping here would
        # leave them dangling, so the mapping goes when the last reference does.
        self._base = None
        self._map = None
        self.mapped_bytes = 0


class DeviceArena(_ArenaBase):
    """An arena in device memory over the CUDA virtual memory API.

    The address range is reserved once; physical memory is created and mapped in
    ``chunk_bytes`` pieces as carving needs it, so every address stays put.

    Args:
        reserve_bytes: size of the address range (rounded up to the chunk).
        device: a CUDA device (default: torch's current device).
        chunk_bytes: mapping granularity, a multiple of the driver's minimum
            granularity (default 2 MiB).
    """

    def __init__(self, reserve_bytes: int, *, device=None, chunk_bytes: int = DEVICE_CHUNK_BYTES):
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        drv = _driver.driver()
        self._cudev = _driver.make_current(self.device.index)
        self._prop = drv.CUmemAllocationProp()
        self._prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = self.device.index
        gran = _driver.check("cuMemGetAllocationGranularity", drv.cuMemGetAllocationGranularity(
            self._prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
        if chunk_bytes <= 0 or chunk_bytes % int(gran):
            raise ValueError(f"chunk_bytes must be a positive multiple of the driver granularity "
                             f"({int(gran)}), got {chunk_bytes}")
        self.driver_granularity = int(gran)
        release_deferred()  # creating an arena is itself illegal during capture: a safe point
        super().__init__(reserve_bytes, chunk_bytes)
        self._handles: list[tuple[int, int, object]] = []  # (offset, size, handle)
        self._base_ptr = int(_driver.check("cuMemAddressReserve", drv.cuMemAddressReserve(
            self.reserved_bytes, self.chunk_bytes, 0, 0)))
        self._bytes = None  # lazily built uint8 view over the mapped range

    @property
    def base_ptr(self) -> int:
        """Device address of the reservation's first byte."""
        return self._base_ptr

    def _grow(self, new_mapped: int) -> None:
        drv = _driver.driver()
        _driver.make_current(self.device.index)
        offset, size = self.mapped_bytes, new_mapped - self.mapped_bytes
        handle = _driver.check("cuMemCreate", drv.cuMemCreate(size, self._prop, 0))
        ptr = drv.CUdeviceptr(self._base_ptr + offset)
        try:
            _driver.check("cuMemMap", drv.cuMemMap(ptr, size, 0, handle, 0))
            try:
                access = drv.CUmemAccessDesc()
                access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = self.device.index
                access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                _driver.check("cuMemSetAccess", drv.cuMemSetAccess(ptr, size, [access], 1))
            except Exception:
                drv.cuMemUnmap(ptr, size)
                raise
        except Exception:
            drv.cuMemRelease(handle)
            raise
        self._handles.append((offset, size, handle))
        self.mapped_bytes = new_mapped

    def _shrink(self, keep_mapped: int) -> None:
        drv = _driver.driver()
        while self._handles and self._handles[-1][0] >= keep_mapped:
            offset, size, handle = self._handles.pop()
            if torch.cuda.is_initialized():
                torch.cuda.synchronize(self.device)
            _driver.check("cuMemUnmap", drv.cuMemUnmap(drv.CUdeviceptr(self._base_ptr + offset), size))
            _driver.check("cuMemRelease", drv.cuMemRelease(handle))
            self.mapped_bytes = offset

    def _bytes_view(self, offset: int, nbytes: int) -> torch.Tensor:
        view = _CAIView(self, self._base_ptr + offset, nbytes)
        return torch.as_tensor(view, device=self.device)

    def _release(self) -> None:
        if _capturing():
            raise ArenaError("a DeviceArena cannot be closed during CUDA graph capture")
        drv = _driver.driver()
        _driver.make_current(self.device.index)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)  # no kernel may still read what we unmap
        for offset, size, handle in reversed(self._handles):
            _driver.check("cuMemUnmap", drv.cuMemUnmap(drv.CUdeviceptr(self._base_ptr + offset), size))
            _driver.check("cuMemRelease", drv.cuMemRelease(handle))
        self._handles.clear()
        _driver.check("cuMemAddressFree", drv.cuMemAddressFree(
            drv.CUdeviceptr(self._base_ptr), self.reserved_bytes))
        self.mapped_bytes = 0


def make_arena(device, reserve_bytes: int, **kw) -> _ArenaBase:
    """A `DeviceArena` for a CUDA device, a `HostArena` for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return DeviceArena(reserve_bytes, device=device, **kw)
    if device.type == "cpu":
        return HostArena(reserve_bytes)
    raise ValueError(f"device must be 'cpu' or a CUDA device, got {device}")


def numba_view(tensor: torch.Tensor):
    """A numba device array aliasing a CUDA tensor, without synchronising.

    bf16 has no numba type: such tensors are viewed as int16 (same bytes).
    """
    from numba import cuda

    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return cuda.from_cuda_array_interface(tensor.__cuda_array_interface__, owner=tensor, sync=False)
