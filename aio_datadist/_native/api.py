"""Typed wrappers over the C extension: the only module that touches ``ffi`` and ``lib``.

Every C return code goes through ``_check``, which turns it into the documented
``LLMException`` subclass. Every call into C releases the GIL (cffi does so for all calls),
and no C function calls back into Python, so a long copy never stalls other threads.

Addresses are plain ``int``s: the pool hands out offsets in an arena it never touches (so
the arena may be device memory); the copy functions dereference them, so they must name
host memory that stays valid for the whole call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ..status import LLMStatusCode, raise_for_status
from ._ffi import ffi, lib

__all__ = (
    "SPLIT_THRESHOLD",
    "NativePool",
    "PoolStats",
    "copy",
    "copy_batch",
    "copy_threads",
    "host_alloc",
    "host_free",
    "host_page_size",
    "set_copy_threads",
)

_U64_LIMIT = 1 << 64

_STATUS: dict[int, LLMStatusCode] = {
    lib.DD_ENOMEM: LLMStatusCode.LLM_OUT_OF_MEMORY,
    lib.DD_EHANDLE: LLMStatusCode.LLM_PARAM_INVALID,
    lib.DD_EINVAL: LLMStatusCode.LLM_PARAM_INVALID,
    lib.DD_ECLOSED: LLMStatusCode.LLM_FAILED,
    lib.DD_ESYS: LLMStatusCode.LLM_FAILED,
}

_REASON: dict[int, str] = {
    lib.DD_ENOMEM: "out of memory",
    lib.DD_EHANDLE: "unknown, stale or already freed handle",
    lib.DD_EINVAL: "invalid argument",
    lib.DD_ECLOSED: "pool is closed",
    lib.DD_ESYS: "system call failed",
}

SPLIT_THRESHOLD: int = int(lib.dd_copy_split_threshold())
"""Bytes: ``copy_batch`` runs batches smaller than this on the calling thread only."""

MAX_COPY_THREADS: int = int(lib.DD_COPY_MAX_THREADS)
"""Most threads, the caller included, that one ``copy_batch`` call may use."""


def _check(rc: int, what: str) -> None:
    """Raise the ``LLMException`` subclass for C return code ``rc``; do nothing for 0."""
    if rc == 0:
        return
    status = _STATUS.get(rc, LLMStatusCode.LLM_FAILED)
    raise_for_status(status, f"{what}: {_REASON.get(rc, f'native error {rc}')}")


def _u64(value: object, name: str) -> int:
    """``value`` as an int in [0, 2**64); ``TypeError`` for non-ints, else ParamInvalidError."""
    if not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < _U64_LIMIT:
        _check(lib.DD_EINVAL, f"{name}={value} is outside [0, 2**64)")
    return value


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a ``NativePool``; every size is in bytes."""

    capacity: int
    """Bytes managed (whole pages)."""
    used: int
    """Bytes allocated, each allocation rounded up to whole pages."""
    free: int
    """``capacity - used``."""
    largest_free: int
    """The biggest contiguous run one ``alloc`` could get now."""
    allocations: int
    """Live allocations."""
    page_size: int
    """Allocation granule and alignment (relative to the arena base)."""


class NativePool:
    """Thread-safe page allocator over an arena ``[base, base + size)``.

    It hands out offsets and never touches the memory, so the arena may be device memory.
    Best-fit over segregated free lists with immediate coalescing of freed neighbours.
    Handles carry a generation, so stale and double frees are reported, never obeyed.
    """

    __slots__ = ("_base", "_capacity", "_page_size", "_ptr")

    def __init__(self, base: int, size: int, page_shift: int) -> None:
        """Manage ``size`` bytes from ``base``, rounded down to pages of ``1 << page_shift``.

        Raises:
            TypeError: an argument is not an int.
            ParamInvalidError: ``page_shift`` outside [10, 31), ``size`` under one page, or
                the arena does not fit in 64 bits.
            OutOfMemoryError: the bookkeeping could not be allocated.
        """
        _u64(base, "base")
        _u64(size, "size")
        if not isinstance(page_shift, int):
            raise TypeError(f"page_shift must be an int, got {type(page_shift).__name__}")
        if not lib.DD_PAGE_SHIFT_MIN <= page_shift <= lib.DD_PAGE_SHIFT_MAX:
            _check(
                lib.DD_EINVAL,
                f"page_shift={page_shift} is outside "
                f"[{lib.DD_PAGE_SHIFT_MIN}, {lib.DD_PAGE_SHIFT_MAX + 1})",
            )
        out = ffi.new("dd_pool **")
        _check(
            lib.dd_pool_create(base, size, page_shift, out),
            f"cannot create a pool of {size} bytes at {base:#x} with {1 << page_shift}-byte "
            "pages (needs one whole page at least, and must fit in 64-bit addresses)",
        )
        self._ptr: Any = ffi.gc(out[0], lib.dd_pool_destroy)
        self._base = base
        self._page_size = 1 << page_shift
        self._capacity = size & ~(self._page_size - 1)

    @property
    def page_size(self) -> int:
        """Bytes per page."""
        return self._page_size

    @property
    def capacity(self) -> int:
        """Bytes managed: ``size`` rounded down to whole pages."""
        return self._capacity

    @property
    def base(self) -> int:
        """Start address of the arena."""
        return self._base

    def alloc(self, nbytes: int) -> tuple[int, int]:
        """Allocate ``nbytes`` rounded up to whole pages; return ``(address, handle)``.

        The address is ``base`` plus a multiple of ``page_size``.

        Raises:
            TypeError: ``nbytes`` is not an int.
            ParamInvalidError: ``nbytes <= 0``.
            OutOfMemoryError: no free run is big enough; the pool stays usable.
            LLMFailedError: the pool is closed.
        """
        if not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
        if not 0 < nbytes < _U64_LIMIT:
            _check(lib.DD_EINVAL, f"cannot allocate {nbytes} bytes")
        out = ffi.new("uint64_t[2]")
        rc = lib.dd_pool_alloc(self._ptr, nbytes, out, out + 1)
        if rc != 0:
            _check(rc, self._alloc_failure(rc, nbytes))
        return out[0], out[1]

    def _alloc_failure(self, rc: int, nbytes: int) -> str:
        if rc != lib.DD_ENOMEM:
            return f"pool alloc of {nbytes} bytes"
        try:
            st = self.stats()
        except Exception:  # the pool was closed meanwhile; the OOM is still the news
            return f"pool alloc of {nbytes} bytes"
        pages = -(-nbytes // self._page_size)
        return (
            f"pool alloc of {nbytes} bytes ({pages * self._page_size} page-rounded) failed: "
            f"used {st.used} of capacity {st.capacity} bytes, largest_free {st.largest_free}"
        )

    def free(self, handle: int) -> None:
        """Return the allocation named by ``handle``.

        Raises:
            TypeError: ``handle`` is not an int.
            ParamInvalidError: the handle is unknown or already freed (the pool is unchanged).
            LLMFailedError: the pool is closed.
        """
        if not isinstance(handle, int):
            raise TypeError(f"handle must be an int, got {type(handle).__name__}")
        if not 0 <= handle < _U64_LIMIT:
            _check(lib.DD_EHANDLE, f"pool free of handle {handle}")
        rc = lib.dd_pool_free(self._ptr, handle)
        if rc != 0:
            _check(rc, f"pool free of handle {handle:#x}")

    def stats(self) -> PoolStats:
        """Return a consistent snapshot of the pool's counters.

        Raises:
            LLMFailedError: the pool is closed.
        """
        out = ffi.new("dd_pool_stats *")
        _check(lib.dd_pool_get_stats(self._ptr, out), "pool stats")
        return PoolStats(
            capacity=out.capacity,
            used=out.used,
            free=out.free,
            largest_free=out.largest_free,
            allocations=out.allocations,
            page_size=out.page_size,
        )

    def close(self) -> None:
        """Free the bookkeeping (not the arena). Idempotent; later calls raise LLMFailedError."""
        _check(lib.dd_pool_close(self._ptr), "pool close")


def host_alloc(nbytes: int) -> int:
    """Map ``nbytes`` (rounded up to host pages) of zero-filled, lazily committed host memory.

    Returns the page-aligned address; release it with ``host_free(addr, nbytes)``.

    Raises:
        TypeError: ``nbytes`` is not an int.
        ParamInvalidError: ``nbytes <= 0``.
        OutOfMemoryError: the mapping failed.
    """
    if not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if not 0 < nbytes < _U64_LIMIT:
        _check(lib.DD_EINVAL, f"host_alloc of {nbytes} bytes")
    out = ffi.new("uint64_t *")
    _check(lib.dd_host_alloc(nbytes, out), f"host_alloc of {nbytes} bytes")
    return int(out[0])


def host_free(addr: int, nbytes: int) -> None:
    """Unmap memory from ``host_alloc``; ``nbytes`` is the size that was asked for.

    Raises:
        ParamInvalidError: ``addr`` is not page aligned or ``nbytes <= 0``.
        LLMFailedError: the kernel refused to unmap.
    """
    _u64(addr, "addr")
    _u64(nbytes, "nbytes")
    _check(lib.dd_host_free(addr, nbytes), f"host_free of {nbytes} bytes at {addr:#x}")


def host_page_size() -> int:
    """The host's page size in bytes."""
    return int(lib.dd_host_page_size())


def copy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to ``dst`` in one memcpy (GIL released).

    The ranges must not overlap (no memmove semantics). ``nbytes == 0`` does nothing.

    Raises:
        TypeError: an argument is not an int.
        ParamInvalidError: a null address with ``nbytes > 0``, or a negative value.
    """
    _u64(dst, "dst")
    _u64(src, "src")
    _u64(nbytes, "nbytes")
    _check(lib.dd_copy(dst, src, nbytes), f"copy of {nbytes} bytes")


def copy_batch(ops: npt.NDArray[np.uint64], threads: int = 0) -> None:
    """Run a batch of copies in ONE native call; ``ops`` rows are ``(dst, src, nbytes)``.

    Rows that continue each other on both sides are merged; zero-length rows are skipped.
    Batches of at least ``SPLIT_THRESHOLD`` bytes are cut by bytes across ``threads``
    threads (the caller's included); ``threads=0`` uses ``copy_threads()``. Destinations
    must not overlap each other or any source. ``ops`` is read in place, never copied.

    Raises:
        TypeError: ``ops`` is not a numpy array of dtype uint64 (native byte order).
        ValueError: ``ops`` is not C-contiguous and aligned, or not of shape ``(n, 3)``.
        ParamInvalidError: ``threads`` outside [0, MAX_COPY_THREADS], or a row with
            ``nbytes > 0`` has a null address or wraps around; nothing is copied then.
    """
    if not isinstance(ops, np.ndarray):
        raise TypeError(f"ops must be a numpy.ndarray, got {type(ops).__name__}")
    if ops.dtype != np.uint64:
        raise TypeError(f"ops must have dtype uint64, got {ops.dtype}")
    if ops.ndim != 2 or ops.shape[1] != 3:
        raise ValueError(f"ops must have shape (n, 3), got {ops.shape}")
    if not (ops.flags.c_contiguous and ops.flags.aligned):
        raise ValueError("ops must be C-contiguous and aligned")
    if not isinstance(threads, int):
        raise TypeError(f"threads must be an int, got {type(threads).__name__}")
    if not 0 <= threads <= MAX_COPY_THREADS:
        _check(lib.DD_EINVAL, f"copy_batch threads={threads}")
    n = ops.shape[0]
    if n == 0:
        return
    rc = lib.dd_copy_batch(ffi.from_buffer("uint64_t[]", ops), n, threads)
    if rc != 0:
        _check(rc, f"copy_batch of {n} rows (a row has a null address or wraps around)")


def set_copy_threads(n: int) -> None:
    """Set the default thread count of ``copy_batch``; 1 disables splitting.

    Raises:
        TypeError: ``n`` is not an int.
        ParamInvalidError: ``n`` outside [1, MAX_COPY_THREADS].
    """
    if not isinstance(n, int):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if not 1 <= n <= MAX_COPY_THREADS:
        _check(lib.DD_EINVAL, f"set_copy_threads({n}): expected 1..{MAX_COPY_THREADS}")
    _check(lib.dd_copy_set_threads(n), f"set_copy_threads({n})")


def copy_threads() -> int:
    """The default thread count of ``copy_batch``: ``min(os.cpu_count(), 8)`` unless set."""
    return int(lib.dd_copy_get_threads())
