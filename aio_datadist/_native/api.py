"""Typed wrappers over the C extension: the only module that touches ``ffi`` and ``lib``.

Every C return code goes through ``_check``, which turns it into the documented
``LLMException`` subclass. Every call into C releases the GIL (cffi does so for all calls),
and no C function calls back into Python, so a long copy never stalls other threads.

Addresses are plain ``int``s: the pool hands out offsets in an arena it never touches (so
the arena may be device memory); the copy and socket functions dereference them, so they
must name host memory that stays valid for the whole call.

The socket functions raise errors of their own that are NOT ``LLMException``s, so the
transport layer decides at its edge what a timeout or a lost peer means: ``NetTimeout``,
``PeerClosed``, or ``OSError`` for any other failed system call. The C side returns
``DD_ESYS`` and leaves ``errno`` as the failing call set it; cffi saves ``errno`` right after
every call, and ``ffi.errno`` reads that saved value in the calling thread.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from ..status import LLMStatusCode, ParamInvalidError, raise_for_status
from ._ffi import ffi, lib

# The C types of the calls below, parsed once (a type named by a string is looked up again on
# every call that names it).
_U64S = ffi.typeof("uint64_t[]")
_U64P = ffi.typeof("uint64_t *")
_I64P = ffi.typeof("int64_t *")
_INTP = ffi.typeof("int *")
_I32S = ffi.typeof("int32_t[]")
_PAIRP = ffi.typeof("dd_blocks_pair *")
_TASKPP = ffi.typeof("dd_copy_task **")

__all__ = (
    "BACKGROUND_MIN",
    "SPLIT_THRESHOLD",
    "UCX_CALLS",
    "BlockLayout",
    "CopySignal",
    "CopyTask",
    "NativePool",
    "NetTimeout",
    "PeerClosed",
    "PoolStats",
    "UCX_COUNTED",
    "UcxCalls",
    "UcxCount",
    "UcxLaneThread",
    "UcxPart",
    "UcxParts",
    "copy",
    "copy_batch",
    "copy_threads",
    "deadline_after",
    "fill",
    "host_alloc",
    "host_free",
    "host_page_size",
    "monotonic_ns",
    "set_copy_threads",
    "sock_recv",
    "sock_recv_into",
    "sock_recvv",
    "sock_send",
    "sock_send_bytes",
    "sock_sendv",
    "sock_tune",
    "sock_wait_readable",
    "ucx_find",
    "block_rows",
    "blocks_access_rows",
    "vm_copy_blocks",
    "vm_copy_batch",
)

_U64_LIMIT = 1 << 64

_STATUS: dict[int, LLMStatusCode] = {
    lib.DD_ENOMEM: LLMStatusCode.LLM_OUT_OF_MEMORY,
    lib.DD_EHANDLE: LLMStatusCode.LLM_PARAM_INVALID,
    lib.DD_EINVAL: LLMStatusCode.LLM_PARAM_INVALID,
    lib.DD_ECLOSED: LLMStatusCode.LLM_FAILED,
    lib.DD_ESYS: LLMStatusCode.LLM_FAILED,
    lib.DD_ETIMEDOUT: LLMStatusCode.LLM_TIMEOUT,
    lib.DD_ECLOSED_PEER: LLMStatusCode.LLM_LINK_FAILED,
}

_REASON: dict[int, str] = {
    lib.DD_ENOMEM: "out of memory",
    lib.DD_EHANDLE: "unknown, stale or already freed handle",
    lib.DD_EINVAL: "invalid argument",
    lib.DD_ECLOSED: "pool is closed",
    lib.DD_ESYS: "system call failed",
    lib.DD_ETIMEDOUT: "deadline passed",
    lib.DD_ECLOSED_PEER: "peer closed the connection",
}

SPLIT_THRESHOLD: int = int(lib.dd_copy_split_threshold())
#: Cross-process copies started with a signal move in the background from this many bytes
#: on; smaller ones are copied by the caller.
BACKGROUND_MIN: int = int(lib.dd_copy_background_min())
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
    if type(value) is int and 0 <= value < _U64_LIMIT:  # (the usual case, in one test)
        return value
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
    out = ffi.new(_U64P)
    _check(lib.dd_host_alloc(nbytes, out), f"host_alloc of {nbytes} bytes")
    return int(out[0])


def host_alloc_shared(nbytes: int) -> tuple[int, int]:
    """``host_alloc`` backed by a memory file sealed at its size, which a same-host peer may
    map (:func:`host_map_peer`).

    Returns ``(addr, fd)``: release with ``host_free(addr, nbytes)``, then ``os.close(fd)``.

    Raises:
        TypeError: ``nbytes`` is not an int.
        ParamInvalidError: ``nbytes <= 0``.
        OutOfMemoryError: the memory could not be had.
        OSError: no memory file could be made (a kernel or sandbox without ``memfd``).
    """
    if not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    what = f"host_alloc_shared of {nbytes} bytes"
    if not 0 < nbytes < _U64_LIMIT:
        _check(lib.DD_EINVAL, what)
    addr, fd = ffi.new(_U64P), ffi.new(_INTP)
    rc = lib.dd_host_alloc_shared(nbytes, addr, fd)
    if rc == lib.DD_ESYS:
        code = ffi.errno
        raise OSError(code, f"{what}: {os.strerror(code)}")
    _check(rc, what)
    return int(addr[0]), int(fd[0])


def host_map_peer(pid: int, fd_no: int, ino: int, nbytes: int) -> int:
    """Map here, read-write, the shared memory (:func:`host_alloc_shared`) that process
    ``pid`` holds open as descriptor ``fd_no``: only when it is the memory file of inode
    ``ino`` and exactly ``nbytes`` (rounded up to pages), sealed against shrinking. Returns
    its address here; unmap with ``host_free(addr, nbytes)``.

    Raises:
        TypeError, ValueError: an argument is not an int in range.
        PermissionError: the kernel refuses access to ``pid`` (as for ``vm_copy_batch``), or
            is too old to hand over a descriptor (before Linux 5.6).
        ProcessLookupError: ``pid`` does not exist.
        OSError: ``fd_no`` there is not that file, or the mapping failed.
    """
    _pid(pid)
    if isinstance(fd_no, bool) or not isinstance(fd_no, int) or not 0 <= fd_no <= _INT_MAX:
        raise ValueError(f"fd_no must be a descriptor number, got {fd_no!r}")
    _u64(ino, "ino")
    _u64(nbytes, "nbytes")
    out = ffi.new(_U64P)
    rc = lib.dd_host_map_peer(pid, fd_no, ino, nbytes, out)
    if rc == lib.DD_ESYS:
        code = ffi.errno
        _vm_check(rc, code, pid, False, "host_map_peer")
    _check(rc, f"host_map_peer of {nbytes} bytes of process {pid}")
    return int(out[0])


def host_populate(addr: int, nbytes: int) -> None:
    """Commit and map now every page of ``nbytes`` at ``addr`` (page-aligned memory from
    ``host_alloc`` or ``host_alloc_shared``), so that no later access faults on it. One
    native call with the GIL released; the contents do not change.

    Raises:
        TypeError: an argument is not an int.
        ParamInvalidError: ``addr`` 0 or not page-aligned, ``nbytes <= 0``.
        OutOfMemoryError: the memory cannot be had (the pages committed so far stay).
        OSError: the kernel refused for another reason.
    """
    _u64(addr, "addr")
    _u64(nbytes, "nbytes")
    what = f"host_populate of {nbytes} bytes at {addr:#x}"
    rc = lib.dd_host_populate(addr, nbytes)
    if rc == lib.DD_ESYS:
        code = ffi.errno
        raise OSError(code, f"{what}: {os.strerror(code)}")
    _check(rc, what)


def host_free(addr: int, nbytes: int) -> None:
    """Unmap memory from ``host_alloc``, ``host_alloc_shared`` or ``host_map_peer``;
    ``nbytes`` is the size that was asked for.

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


def fill(addr: int, value: int, nbytes: int) -> None:
    """Set ``nbytes`` of host memory at ``addr`` to the byte ``value`` (memset, GIL released).

    ``nbytes == 0`` does nothing.

    Raises:
        TypeError: an argument is not an int.
        ParamInvalidError: a null address with ``nbytes > 0``, a range that wraps, a
            negative value, or ``value`` outside 0..255.
    """
    _u64(addr, "addr")
    _u64(nbytes, "nbytes")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"value must be an int, got {type(value).__name__}")
    if not 0 <= value <= 255:
        _check(lib.DD_EINVAL, f"fill with byte value {value}")
    _check(lib.dd_fill(addr, value, nbytes), f"fill of {nbytes} bytes at {addr:#x}")


def _ops_table(ops: object, threads: object) -> int:
    """Check a ``(dst, src, nbytes)`` table and a thread count; return the row count."""
    table = _u64_table("ops", ops, 3)
    _copy_threads(threads)
    return int(table.shape[0])


def _copy_threads(threads: object) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int):
        raise TypeError(f"threads must be an int, got {type(threads).__name__}")
    if not 0 <= threads <= MAX_COPY_THREADS:
        _check(lib.DD_EINVAL, f"copy threads={threads}")


def vm_copy_batch(
    pid: int,
    ops: npt.NDArray[np.uint64],
    *,
    write: bool,
    threads: int = 0,
    signal: CopySignal | None = None,
) -> CopyTask | None:
    """``copy_batch`` with another process: its memory is each row's src, or dst if ``write``.

    One kernel copy between the two address spaces (``process_vm_readv`` /
    ``process_vm_writev``, up to IOV_MAX merged ranges a call, GIL released); big batches
    are cut across ``threads`` threads as for ``copy_batch``. ``pid`` 0: the peer's memory
    is mapped here (:func:`host_map_peer`) and the rows are copied with memcpy, which cannot
    report an unmapped address: the caller has checked every row.

    With ``signal`` the copy runs in the background: the rows are checked and the running
    copy returned at once (a :class:`CopyTask`, whose end posts ``signal``), unless it is
    under :data:`BACKGROUND_MIN` bytes and was copied here (None). Without it, None once the
    bytes moved.

    Raises:
        TypeError, ValueError: as for ``copy_batch``, or ``pid`` not a process id.
        ParamInvalidError: as for ``copy_batch``; nothing moved then.
        PermissionError: the kernel refuses access to ``pid`` (ptrace scope, another user,
            a container boundary); nothing moved.
        ProcessLookupError: ``pid`` does not exist.
        OSError: ``EFAULT`` (an address is not mapped on one side) or another failure;
            part of the batch may have moved.
    """
    _pid(pid)
    n = _ops_table(ops, threads)
    if n == 0:
        return None
    err = ffi.new(_INTP)
    rows = ffi.from_buffer(_U64S, ops)
    what = f"vm_copy_batch of {n} rows"
    if signal is None:
        rc = lib.dd_vm_copy_batch(pid, int(write), rows, n, threads, err)
        _vm_check(rc, int(err[0]), pid, write, what)
        return None
    task = ffi.new(_TASKPP)
    rc = lib.dd_vm_copy_batch_start(pid, int(write), rows, n, threads, signal.handle, task, err)
    return _started(task[0], rc, int(err[0]), pid, write, what)


def _started(task: Any, rc: int, code: int, pid: int, write: bool, what: str) -> CopyTask | None:
    """The running copy of a background start, or None when it was copied in the caller."""
    if task != ffi.NULL:
        return CopyTask(task, pid, write, what)
    _vm_check(rc, code, pid, write, what)
    return None


class CopySignal:
    """An eventfd (non-blocking) that the copy workers add 1 to each time a background copy
    started with it ends: what an event loop watches for its copies."""

    __slots__ = ("_handle", "fd")

    def __init__(self) -> None:
        out = ffi.new("dd_copy_signal **")
        rc = lib.dd_copy_signal_open(out)
        if rc == lib.DD_ESYS:
            code = ffi.errno
            raise OSError(code, f"copy signal: {os.strerror(code)}")
        _check(rc, "copy signal")
        self._handle = out[0]
        #: The eventfd to watch (open until :meth:`close` and the end of every copy
        #: started with it).
        self.fd = int(lib.dd_copy_signal_fd(self._handle))

    @property
    def handle(self) -> Any:
        """The native signal, for a background start.

        :raises LLMException: ``LLM_FAILED`` after :meth:`close`.
        """
        if self._handle == ffi.NULL:
            _check(lib.DD_ECLOSED, "copy signal used after close")
        return self._handle

    def close(self) -> None:
        """Give the signal up; its fd closes once no copy started with it still runs.
        Idempotent."""
        handle, self._handle = self._handle, ffi.NULL
        if handle != ffi.NULL:
            lib.dd_copy_signal_close(handle)

    def __del__(self) -> None:
        self.close()


class CopyTask:
    """A cross-process copy running on the copy workers (``vm_copy_batch`` or
    ``vm_copy_blocks`` with a signal). :meth:`reap` it once its signal was posted."""

    __slots__ = ("_handle", "_pid", "_what", "_write")

    def __init__(self, handle: Any, pid: int, write: bool, what: str) -> None:
        self._handle = handle
        self._pid = pid
        self._write = write
        self._what = what

    def reap(self, *, wait: bool = False) -> bool:
        """True once the copy ended, and the task is gone; False while it runs (``wait``:
        sleep, GIL released, until it ended). True again after that.

        :raises PermissionError, ProcessLookupError, OSError: the copy failed, as
            ``vm_copy_batch`` says (part of it may have moved).
        """
        handle = self._handle
        if handle == ffi.NULL:
            return True
        err = ffi.new(_INTP)
        rc = lib.dd_copy_task_reap(handle, int(wait), err)
        if rc == lib.DD_EAGAIN:
            return False
        self._handle = ffi.NULL
        _vm_check(rc, int(err[0]), self._pid, self._write, self._what)
        return True

    def __del__(self) -> None:
        # Never reaped (its loop went away): wait for the copy, which still owns its memory.
        if self._handle != ffi.NULL:
            with contextlib.suppress(OSError):
                self.reap(wait=True)


def _pid(pid: object) -> None:
    if isinstance(pid, bool) or not isinstance(pid, int):
        raise TypeError(f"pid must be an int, got {type(pid).__name__}")
    if not 0 <= pid <= _INT_MAX:
        raise ValueError(f"pid must be a process id (or 0: this process), got {pid}")


def _vm_check(rc: int, code: int, pid: int, write: bool, what: str) -> None:
    """Raise for a cross-process copy's return code (``code``: the errno it met)."""
    if rc == lib.DD_ESYS:
        where = f"{'write to' if write else 'read from'} process {pid}: {os.strerror(code)}"
        if code in (errno.EPERM, errno.EACCES, errno.ENOSYS):
            raise PermissionError(code, where)
        if code == errno.ESRCH:
            raise ProcessLookupError(code, where)
        raise OSError(code, where)
    if rc != 0:
        _check(rc, f"{what} (a row outside its memory, a null address or one that wraps)")


class BlockLayout:
    """Where the blocks of a blocks cache live: each tensor's base address, the bytes of one
    block, and the blocks per tensor (block ``b`` of tensor ``t`` starts at
    ``bases[t] + b * block_bytes``)."""

    __slots__ = ("_cbases", "bases", "block_bytes", "num_blocks")

    def __init__(self, bases: tuple[int, ...] | list[int], block_bytes: int, num_blocks: int):
        self.bases = np.array(bases, dtype=np.uint64)
        self.block_bytes = _u64(block_bytes, "block_bytes")
        self.num_blocks = _u64(num_blocks, "num_blocks")
        self._cbases = ffi.from_buffer(_U64S, self.bases)

    def _tensors(self, start: int, count: int) -> Any:
        """The C pointer to ``bases[start]``, once ``[start, start + count)`` was checked."""
        if not 0 <= start <= start + count <= len(self.bases):
            _check(
                lib.DD_EINVAL,
                f"tensors [{start}, {start + count}) of a layout of {len(self.bases)} tensors",
            )
        return self._cbases + start


def _block_list(name: str, blocks: object) -> Any:
    """A block list (ints, or a 1-D uint64 array) as a C array."""
    if isinstance(blocks, np.ndarray):
        if blocks.dtype != np.uint64 or blocks.ndim != 1 or not blocks.flags.c_contiguous:
            raise TypeError(f"{name} must be a contiguous 1-D uint64 array or a list of ints")
        return ffi.from_buffer(_U64S, blocks)
    try:
        return ffi.new(_U64S, blocks)
    except OverflowError:
        _check(lib.DD_EINVAL, f"{name} holds a value outside [0, 2**64)")
    except TypeError:
        raise TypeError(f"{name} must be a list of ints or a uint64 array") from None


def block_rows(
    layout: BlockLayout, start: int, count: int, blocks: object, seg: int
) -> npt.NDArray[np.uint64]:
    """The ``(addr, len)`` rows of ``blocks`` in tensors ``[start, start + count)`` of
    ``layout``: ``seg`` bytes at each block, per tensor then per block.

    Raises:
        TypeError: ``blocks`` is not a list of ints or a 1-D uint64 array.
        ParamInvalidError: a tensor outside the layout, a block not below ``num_blocks``,
            ``seg`` 0 or over ``block_bytes``, or an address that wraps.
    """
    cblocks = _block_list("blocks", blocks)
    n = len(cblocks)
    rows = np.empty((count * n, 2), dtype=np.uint64)
    rc = lib.dd_block_rows(
        ffi.from_buffer(_U64S, rows),
        layout._tensors(start, count),
        count,
        layout.block_bytes,
        layout.num_blocks,
        cblocks,
        n,
        _u64(seg, "seg"),
    )
    _check(rc, "block_rows (a block or segment outside the layout)")
    return rows


def blocks_access_rows(
    addrs: Sequence[int],
    block_bytes: int,
    num_blocks: int,
    start: int,
    count: int,
    blocks: npt.NDArray[np.uint64],
    seg: int,
    last: int,
) -> npt.NDArray[np.uint64]:
    """The ``(addr, len)`` rows of a blocks access, per tensor then per block: ``seg`` bytes
    (``last`` at each tensor's last block) at each of ``blocks`` of tensors
    ``[start, start + count)`` of a blocks cache whose tensors start at ``addrs``, each of
    ``num_blocks`` blocks of ``block_bytes``. Checked by ``dd_blocks_check``, the one bounds
    check of a blocks access, which the native serving path and ``vm_copy_blocks`` apply too.

    Raises:
        ParamInvalidError: the first bound the access breaks, in this order: tensors outside
            the cache (or none), a segment over a block (or empty), a block not below
            ``num_blocks``, blocks that wrap around the address space.
    """
    ids = np.ascontiguousarray(blocks, dtype=np.uint64)
    rows = np.empty((max(0, min(count, len(addrs))) * len(ids), 2), dtype=np.uint64)
    bad = ffi.new(_U64P)
    try:
        rc = lib.dd_blocks_rows(
            ffi.from_buffer(_U64S, rows),
            len(rows),
            ffi.new(_U64S, addrs),
            len(addrs),
            block_bytes,
            num_blocks,
            start,
            count,
            ffi.from_buffer(_U64S, ids),
            len(ids),
            seg,
            last,
            bad,
        )
    except OverflowError:
        rc = lib.DD_EINVAL
    if rc == lib.DD_OK:
        return rows
    refusal = {
        lib.DD_BLOCKS_ETENSORS: f"tensors [{start}, {start + count}) are outside the cache's "
        f"{len(addrs)} tensors",
        lib.DD_BLOCKS_ESEG: f"block segments of {seg}/{last} bytes do not fit blocks of "
        f"{block_bytes} bytes",
        lib.DD_BLOCKS_EBLOCK: f"block index {bad[0]} is outside [0, {num_blocks})",
        lib.DD_BLOCKS_EADDR: f"blocks of tensors [{start}, {start + count}) wrap around the "
        "address space",
    }.get(rc, f"a field of the blocks access is outside [0, 2**64) (rc {rc})")
    raise ParamInvalidError(refusal, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _block_sides(
    dst: tuple[BlockLayout, int, Sequence[int]],
    src: tuple[BlockLayout, int, Sequence[int]],
    count: int,
) -> tuple[int, tuple[Any, ...]]:
    """The blocks per tensor, and the native arguments naming both sides of a blocks copy
    (each side's tensors, block bytes, blocks per tensor and block list).

    Raises:
        TypeError: a block list that is not ints.
        ParamInvalidError: the lists differ in length, or a tensor outside its layout.
    """
    d_layout, d_start, d_blocks = dst
    s_layout, s_start, s_blocks = src
    n = len(d_blocks)
    if len(s_blocks) != n:
        _check(lib.DD_EINVAL, f"{n} dst blocks but {len(s_blocks)} src blocks")
    # One C array for both lists: its first n values are dst's.
    blocks = _block_list("blocks", [*d_blocks, *s_blocks])
    return n, (
        d_layout._tensors(d_start, count),
        d_layout.block_bytes,
        d_layout.num_blocks,
        blocks,
        s_layout._tensors(s_start, count),
        s_layout.block_bytes,
        s_layout.num_blocks,
        blocks + n,
    )


def blocks_ops(
    dst: tuple[BlockLayout, int, Sequence[int]],
    src: tuple[BlockLayout, int, Sequence[int]],
    count: int,
    seg: int,
) -> npt.NDArray[np.uint64]:
    """The ``(dst, src, seg)`` ops of a blocks copy, as :func:`vm_copy_blocks` moves them:
    block ``src_blocks[k]`` of each of ``count`` tensors from ``src``'s first paired with
    block ``dst_blocks[k]`` of the matching ``dst`` tensor, per tensor then per block. Each
    side is ``(layout, first tensor, blocks)``.

    Raises:
        TypeError: a block list that is not ints.
        ParamInvalidError: the lists differ in length, a tensor or block outside its layout,
            ``seg`` 0 or over a block.
    """
    if type(seg) is not int or not 0 <= seg < _U64_LIMIT:
        _u64(seg, "seg")
    n, sides = _block_sides(dst, src, count)
    ops = np.empty((count * n, 3), dtype=np.uint64)
    rc = lib.dd_blocks_ops(ffi.from_buffer(_U64S, ops), *sides, count, n, seg)
    _check(rc, f"blocks_ops of {count} x {n} blocks (a block or segment outside its layout)")
    return ops


class PairedLayouts:
    """The tensors of two blocks layouts paired for :class:`BlockPairs`: ``count`` tensors
    of each side from its first one, ``seg`` bytes of each block. Each side is ``(layout,
    first tensor)``; ``local`` is :func:`blocks_ops`'s ``dst``, ``remote`` its ``src``.
    Checked once here, then paired with any block lists.

    Raises:
        ParamInvalidError: a tensor outside its layout, ``seg`` outside uint64.
    """

    __slots__ = ("_template", "count", "local", "remote", "seg")

    def __init__(
        self, local: tuple[BlockLayout, int], remote: tuple[BlockLayout, int], count: int, seg: int
    ) -> None:
        if type(seg) is not int or not 0 <= seg < _U64_LIMIT:
            _u64(seg, "seg")
        self.local, self.remote, self.count, self.seg = local, remote, count, seg
        (l_layout, l_start), (r_layout, r_start) = local, remote
        #: The ``dd_blocks_pair`` of both sides without blocks (each pairing copies it).
        self._template: Any = ffi.new(
            "dd_blocks_pair *",
            (
                l_layout._tensors(l_start, count),
                l_layout.block_bytes,
                l_layout.num_blocks,
                ffi.NULL,
                r_layout._tensors(r_start, count),
                r_layout.block_bytes,
                r_layout.num_blocks,
                ffi.NULL,
                count,
                0,
                seg,
            ),
        )


class BlockPairs:
    """Whole blocks of two paired layouts (:class:`PairedLayouts`), paired as
    :func:`blocks_ops` pairs them: block ``remote_blocks[k]`` of each remote tensor with
    block ``local_blocks[k]`` of the matching local one, for a native call that makes the ops
    itself (``dd_blocks_pair``, made here).

    Raises:
        TypeError: a block list that is not ints.
        ParamInvalidError: the lists differ in length.
    """

    __slots__ = ("_blocks", "_ops", "layouts", "local_blocks", "native", "remote_blocks")

    def __init__(
        self, layouts: PairedLayouts, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> None:
        n = len(local_blocks)
        if len(remote_blocks) != n:
            _check(lib.DD_EINVAL, f"{n} local blocks but {len(remote_blocks)} remote blocks")
        self.layouts, self.local_blocks, self.remote_blocks = layouts, local_blocks, remote_blocks
        # One C array for both lists: its first n values are the local ones.
        self._blocks = blocks = _block_list("blocks", [*local_blocks, *remote_blocks])
        #: The ``dd_blocks_pair`` naming both sides (kept alive with this object).
        native = ffi.new(_PAIRP, layouts._template[0])
        self.native: Any = native
        native.local_blocks = blocks
        native.remote_blocks = blocks + n
        native.nblocks = n
        self._ops = layouts.count * n

    def __len__(self) -> int:
        """How many ops the pairs make."""
        return self._ops

    def ops(self) -> npt.NDArray[np.uint64]:
        """The ``(local, remote, seg)`` ops, as :func:`blocks_ops` makes them."""
        layouts = self.layouts
        return blocks_ops(
            (*layouts.local, self.local_blocks),
            (*layouts.remote, self.remote_blocks),
            layouts.count,
            layouts.seg,
        )

    def refused(self) -> None:
        """Raise why :func:`blocks_ops` refuses the pairs (:class:`PairsRefused`)."""
        try:
            self.ops()
        except ParamInvalidError as exc:
            raise PairsRefused(str(exc), status_code=LLMStatusCode.LLM_PARAM_INVALID) from None
        raise PairsRefused("block pairs refused", status_code=LLMStatusCode.LLM_PARAM_INVALID)


class PairsRefused(ParamInvalidError):
    """:class:`BlockPairs` that :func:`blocks_ops` refuses (a block or segment outside its
    layout): nothing started."""


def vm_copy_blocks(
    pid: int,
    dst: tuple[BlockLayout, int, Sequence[int]],
    src: tuple[BlockLayout, int, Sequence[int]],
    count: int,
    seg: int,
    *,
    write: bool,
    threads: int = 0,
    signal: CopySignal | None = None,
) -> CopyTask | None:
    """``vm_copy_batch`` of blocks between two layouts, one of them in process ``pid``.

    ``dst`` and ``src`` are ``(layout, first tensor, blocks)`` with blocks as lists of ints:
    ``seg`` bytes of block ``src_blocks[k]`` of each of ``count`` tensors land in block
    ``dst_blocks[k]`` of the matching ``dst`` tensor. ``write``: ``dst`` is in ``pid``'s
    memory; else ``src`` is. ``signal``: as for ``vm_copy_batch``.

    Raises:
        TypeError, ValueError: as for ``vm_copy_batch``, or a block list that is not ints.
        ParamInvalidError: the lists differ in length, a tensor or block outside its layout,
            ``seg`` 0 or over a block; nothing moved then.
        PermissionError, ProcessLookupError, OSError: as for ``vm_copy_batch``.
    """
    if type(pid) is not int or not 0 <= pid <= _INT_MAX:  # exact ints in range: no call
        _pid(pid)
    if type(threads) is not int or threads:
        _copy_threads(threads)
    if type(seg) is not int or not 0 <= seg < _U64_LIMIT:
        _u64(seg, "seg")
    n, sides = _block_sides(dst, src, count)
    err = ffi.new(_INTP)
    args = (pid, int(write), *sides, count, n, seg, threads)
    if signal is None:
        rc = lib.dd_vm_copy_blocks(*args, err)
        if rc:
            _vm_check(rc, int(err[0]), pid, write, f"vm_copy_blocks of {count} x {n} blocks")
        return None
    task = ffi.new(_TASKPP)
    rc = lib.dd_vm_copy_blocks_start(*args, signal.handle, task, err)
    return _started(task[0], rc, int(err[0]), pid, write, f"vm_copy_blocks of {count} x {n} blocks")


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
    n = _ops_table(ops, threads)
    if n == 0:
        return
    rc = lib.dd_copy_batch(ffi.from_buffer(_U64S, ops), n, threads)
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


# --- UCX request batches -----------------------------------------------------------------

#: The UCP functions :class:`UcxCalls` needs, by their fields in ``dd_ucx_calls``.
UCX_CALLS = {
    "get_nbx": "ucp_get_nbx",
    "put_nbx": "ucp_put_nbx",
    "request_free": "ucp_request_free",
    "worker_progress": "ucp_worker_progress",
    "worker_signal": "ucp_worker_signal",
    "ep_flush_nbx": "ucp_ep_flush_nbx",
    "worker_arm": "ucp_worker_arm",
}


#: The address of the native UCP completion of a counted batch (``dd_ucx_counted``), for
#: the ``cb.send`` of its request parameters.
UCX_COUNTED = int(ffi.cast("uintptr_t", ffi.addressof(lib, "dd_ucx_counted")))

#: Counts whose requests were still completing when they were dropped: freed once they end.
_UNFINISHED_COUNTS: list[Any] = []


class UcxCount:
    """How many requests of one batch are still in flight, and the first failure among them
    (``dd_ucx_count``): each request's completion takes itself off, so a look is one load."""

    __slots__ = ("_count", "_status", "address")

    def __init__(self, calls: Any) -> None:
        if _UNFINISHED_COUNTS:
            _UNFINISHED_COUNTS[:] = [
                c for c in _UNFINISHED_COUNTS if lib.dd_ucx_count_free(c) != lib.DD_OK
            ]
        count = lib.dd_ucx_count_new(calls)
        if count == ffi.NULL:
            _check(lib.DD_ENOMEM, "ucx count")
        self._count = count
        self._status = ffi.new(_INTP)
        #: The count's address, the ``user_data`` of the batch's request parameters.
        self.address = int(ffi.cast("uintptr_t", count))

    def left(self) -> tuple[int, int]:
        """``(left, status)``: the requests still in flight and the ``ucs_status_t`` of the
        first that failed (0: none)."""
        left = int(lib.dd_ucx_count_left(self._count, self._status))
        return left, int(self._status[0])

    def reset(self) -> bool:
        """Make the count as new for another batch (no failure, no worker to signal): False
        (nothing changed) while one of its requests or their completion still runs."""
        return bool(lib.dd_ucx_count_reset(self._count) == lib.DD_OK)

    def notify(self, worker: int) -> None:
        """Have the completion that takes the count to 0 signal ``worker`` (a handle as an
        int; ``ucp_worker_signal``). Look at the count after: either that look sees 0 or the
        worker is signalled."""
        lib.dd_ucx_count_notify(self._count, worker)

    def __del__(self) -> None:
        count = getattr(self, "_count", None)
        if count is not None and lib.dd_ucx_count_free(count) == lib.DD_EAGAIN:
            # UCX still completes requests into it (a worker torn down under them): keep it
            _UNFINISHED_COUNTS.append(count)


class UcxLaneThread:
    """A native thread that progresses one UCX worker (``dd_ucx_lane``): it sleeps on the
    worker's event fd, and ``ucp_worker_signal`` wakes it."""

    __slots__ = ("_lane",)

    def __init__(self, lane: Any) -> None:
        if lane == ffi.NULL:
            code = ffi.errno
            raise OSError(code, f"ucx lane thread: {os.strerror(code)}")
        self._lane = lane

    def _handle(self) -> Any:
        """The native lane (raises once stopped)."""
        if self._lane is None:
            _check(lib.DD_EINVAL, "ucx lane: stopped")
        return self._lane

    def stop(self) -> None:
        """Stop the thread and wait for it (once; later calls do nothing)."""
        lane, self._lane = self._lane, None
        if lane is not None:
            lib.dd_ucx_lane_stop(lane)


class Words:
    """A uint64 array (1-D, or rows) with its C view, made once for native calls made again
    and again with it (a bundle's key rows and remote keys)."""

    __slots__ = ("array", "c", "rows")

    def __init__(self, array: npt.ArrayLike) -> None:
        #: A copy of ``array``, read-only.
        self.array: npt.NDArray[np.uint64] = np.array(array, dtype=np.uint64, order="C")
        self.array.flags.writeable = False
        #: The C view (``uint64_t[]``).
        self.c = ffi.from_buffer(_U64S, self.array)
        #: Its first dimension.
        self.rows = len(self.array)


def _words(values: Words | npt.ArrayLike) -> Words:
    """``values`` as :class:`Words` (made here unless they are)."""
    return values if isinstance(values, Words) else Words(values)


class UcxPart(NamedTuple):
    """Where one part of a :meth:`UcxCalls.transfer` goes (``dd_ucx_part``): handles as
    ints."""

    #: The endpoint (``ucp_ep_h``), on the worker that moves the part.
    ep: int
    #: The remote keys unpacked on ``ep``, one per key row of the transfer.
    rkeys: Words | npt.NDArray[np.uint64]
    #: The lane thread progressing ``ep``'s worker, woken once the part started (None: the
    #: caller's worker).
    lane: UcxLaneThread | None


class UcxParts:
    """The parts transfers through the same endpoints are cut into, as the native call takes
    them (``dd_ucx_part[]``): the remote keys' rows ``keys`` (``(address, end)``, sorted by
    address) and each part's endpoint, remote keys and lane, set once; each part's count is
    bound with :meth:`bind` and kept for the next transfer while none of its requests are in
    flight (:meth:`UcxCalls.transfer`). One transfer at a time may use it.

    Raises:
        ParamInvalidError: no parts or more than ``DD_UCX_MAX_PARTS``, keys that are not
            ``(k, 2)``, or a part whose remote keys do not match them.
    """

    __slots__ = ("_bad", "_c", "_counts", "_keep", "keys", "size")

    def __init__(self, keys: Words | npt.ArrayLike, parts: Sequence[UcxPart]) -> None:
        if not 0 < len(parts) <= lib.DD_UCX_MAX_PARTS:
            _check(lib.DD_EINVAL, f"ucx transfer: {len(parts)} parts")
        self.keys = _words(keys)
        if self.keys.array.ndim != 2 or self.keys.array.shape[1] != 2:
            _check(lib.DD_EINVAL, "ucx transfer: keys must be (k, 2)")
        #: How many parts.
        self.size = len(parts)
        self._c = ffi.new("dd_ucx_part[]", len(parts))
        self._keep: list[Any] = []  # (read by the native calls)
        for slot, part in zip(self._c, parts, strict=True):
            rkeys = _words(part.rkeys)
            if rkeys.rows != self.keys.rows:
                _check(lib.DD_EINVAL, "ucx transfer: a part's remote keys do not match the keys")
            self._keep.append(rkeys)
            slot.ep = part.ep
            slot.rkeys = rkeys.c
            slot.lane = ffi.NULL if part.lane is None else part.lane._handle()
            self._keep.append(part.lane)
        self._bad = ffi.new(_I64P)
        self._counts: list[UcxCount | None] = [None] * len(parts)

    def bind(self, part: int, param: int, count: UcxCount) -> None:
        """Have part ``part``'s requests use the request parameters ``param`` (an address,
        naming :data:`UCX_COUNTED` and ``count``'s address) and complete into ``count``."""
        slot = self._c[part]
        slot.param = param
        slot.count = count._count
        self._counts[part] = count


def ucx_find(
    keys: npt.NDArray[np.uint64], spans: npt.NDArray[np.uint64]
) -> npt.NDArray[np.intp] | None:
    """For each span row ``(address, length)`` of ``spans``, the index of the row of ``keys``
    (``(address, end)``, sorted by address) that holds it whole (``dd_ucx_find``: the nearest
    starting at or below it, or one of the 16 before); None when a span is held by none."""
    keys = np.ascontiguousarray(keys, np.uint64)
    spans = np.ascontiguousarray(spans, np.uint64)
    if keys.ndim != 2 or keys.shape[1] != 2 or spans.ndim != 2 or spans.shape[1] != 2:
        _check(lib.DD_EINVAL, "ucx find: keys and spans must be (n, 2)")
    found = np.empty(len(spans), np.int32)
    held = lib.dd_ucx_find(
        ffi.from_buffer(_U64S, keys),
        len(keys),
        ffi.from_buffer(_U64S, spans),
        2,
        len(spans),
        ffi.from_buffer(_I32S, found),
    )
    if held < 0:
        _check(int(held), "ucx find")
    return found.astype(np.intp) if held == len(spans) else None


class UcxCalls:
    """The addresses of the loaded libucp's functions that a batch calls (``dd_ucx_calls``):
    the native layer is not linked against UCX, so the caller hands them in."""

    __slots__ = ("_c",)

    def __init__(self, addresses: dict[str, int]) -> None:
        """``addresses``: the function address of every name of :data:`UCX_CALLS`'s values.

        Raises:
            ParamInvalidError: one is missing or 0.
        """
        c = ffi.new("dd_ucx_calls *")
        for field, name in UCX_CALLS.items():
            address = addresses.get(name, 0)
            if not address:
                _check(lib.DD_EINVAL, f"UcxCalls: no address for {name}")
            setattr(c, field, address)
        self._c = c

    def count(self) -> UcxCount:
        """A completion count for one batch started with :meth:`rma`."""
        return UcxCount(self._c)

    def transfer(
        self,
        ops: npt.NDArray[np.uint64] | BlockPairs,
        parts: UcxParts,
        *,
        write: bool,
        flush: bool = False,
        worker: int = 0,
        progress_ns: int = 0,
    ) -> tuple[int, Any]:
        """Start one get (put with ``write``) per row ``(local, remote, nbytes)`` of ``ops``
        (or per op of the :class:`BlockPairs`, made in the same call), each through the key
        row of ``parts.keys`` that holds its remote span, the bytes cut into one run of about
        equal size per part of ``parts`` (``dd_ucx_transfer``), each part's requests counted
        in the count bound to it (:meth:`UcxParts.bind`). With ``flush``, a flush of each
        part's endpoint follows its run into the same count. With ``progress_ns``, the call
        then progresses ``worker`` (the first part's, a handle as an int) until the first
        part's count reads 0, a round finds nothing to do, or that long passed.

        Returns ``(held, parts)``: ``held`` is the number of ops when the runs started, else
        the index of the first op no key row holds (nothing started); ``parts`` is the
        ``dd_ucx_part`` array of ``parts``, read until the next transfer through it: per
        part, ``started`` (whether it started), ``status`` (the ``ucs_status_t`` of what UCX
        refused in it; 0: nothing; the parts after a refusal did not start), and (with
        ``progress_ns``) ``done`` (whether all its requests completed in the call, their
        count then made as new) with ``failed`` (the ``ucs_status_t`` of the first that
        failed; 0: none).

        Raises:
            ParamInvalidError: bad arguments (a part with no count bound), an op that is
                empty, has no local address or wraps, or block pairs that
                :func:`blocks_ops` refuses (nothing started).
        """
        native = parts._c
        if ops.__class__ is BlockPairs:
            pair, n, c_ops = ops.native, 0, ffi.NULL
        else:
            ops = np.ascontiguousarray(ops, np.uint64)
            if ops.ndim != 2 or ops.shape[1] != 3:
                _check(lib.DD_EINVAL, "ucx transfer: ops must be (n, 3)")
            n, c_ops, pair = len(ops), ffi.from_buffer(_U64S, ops), ffi.NULL
        keys, bad = parts.keys, parts._bad
        held = lib.dd_ucx_transfer(
            self._c,
            1 if write else 0,
            1 if flush else 0,
            c_ops,
            n,
            pair,
            keys.c,
            keys.rows,
            native,
            parts.size,
            bad,
            worker,
            progress_ns,
        )
        if held < 0:
            if bad[0] == -2 and isinstance(ops, BlockPairs):
                ops.refused()  # raises why
            where = f": op {bad[0]} is empty, has no local address or wraps" if bad[0] >= 0 else ""
            _check(int(held), f"ucx transfer{where}")
        return held, native

    def lane(self, worker: int, efd: int) -> UcxLaneThread:
        """Start a native thread that progresses ``worker`` (a handle as an int; its event fd
        ``efd``) until :meth:`UcxLaneThread.stop`.

        Raises:
            OSError: no thread could be made.
        """
        return UcxLaneThread(lib.dd_ucx_lane_start(self._c, worker, efd))

    def spin(self, worker: int, count: UcxCount, spin_ns: int) -> bool:
        """Progress ``worker`` (a handle as an int) without sleeping until ``count`` reads 0
        (True) or ``spin_ns`` passed (False), without the GIL (``dd_ucx_spin``)."""
        rc = lib.dd_ucx_spin(self._c, worker, count._count, spin_ns)
        if rc < 0:
            _check(rc, "ucx spin")
        return bool(rc == 1)

    def drain(self, worker: int, budget_ns: int) -> bool | None:
        """Progress ``worker`` until nothing is left to do: whether anything was, or None when
        ``budget_ns`` (> 0) passed with work left."""
        rc = lib.dd_ucx_drain(self._c, worker, budget_ns)
        if rc < 0:
            _check(rc, "ucx drain")
        return None if rc == 2 else rc == 1

    def serve(
        self,
        worker: int,
        efd: int,
        wake_fd: int,
        deadline_ns: int,
        until_work: bool,
        idle: Any,
        turn: UcxTurn,
        spin_ns: int = 0,
    ) -> bool:
        """Progress ``worker`` (its event fd ``efd``) and sleep between, in one native call
        without the GIL, until ``deadline_ns`` (``time.monotonic_ns()``; 0: none) passed, a
        write to ``wake_fd`` came with :meth:`UcxTurn.look`, or, with ``until_work``, progress
        found work: True for that work (``dd_ucx_serve``). While ``turn`` counts waiters it
        does not progress and sleeps on ``wake_fd`` only. ``idle`` (an ``int *``, the
        caller's between calls) counts wake-ups in a row that found nothing to do (later
        sleeps wait a little first). After work it busy-polls for up to ``spin_ns`` before
        it sleeps again."""
        rc = int(
            lib.dd_ucx_serve(
                self._c, worker, efd, wake_fd, deadline_ns, until_work, idle, turn._c, spin_ns
            )
        )
        if rc < 0:
            _check(rc, "ucx serve")
        return rc == 1


class UcxTurn:
    """Who progresses a worker besides its serving thread (``dd_ucx_turn``), read by the
    serving thread's native wait (:meth:`UcxCalls.serve`) without the GIL."""

    __slots__ = ("_c",)

    #: :meth:`waiters`: the serving thread resumes by itself within its spin time.
    PARKED_TIMED: int = lib.DD_UCX_PARKED_TIMED
    #: :meth:`waiters`: the serving thread resumes when its wake fd is written.
    PARKED: int = lib.DD_UCX_PARKED

    def __init__(self) -> None:
        self._c = ffi.new("dd_ucx_turn *")

    def waiters(self, count: int) -> int:
        """Count ``count`` threads progressing the worker themselves now (the serving
        thread stands down while there is one); whether the serving thread is parked,
        asleep on its wake fd only: 0 (not parked), ``PARKED_TIMED`` (it looks at the
        waiters again by itself within its spin time) or ``PARKED`` (the last waiter to
        leave writes the wake fd to resume it)."""
        parked: int = lib.dd_ucx_turn_waiters(self._c, count)
        if parked < 0:
            _check(parked, f"ucx turn: {count} waiters")
        return parked

    def look(self) -> None:
        """Make the next write to the wake fd end the serving call (write it after)."""
        self._c.look = 1


# --- sockets ------------------------------------------------------------------------------

_I64_MAX = (1 << 63) - 1
_INT_MAX = (1 << 31) - 1


class _PartialTransfer(Exception):
    """A socket transfer that failed part way; ``transferred`` bytes had moved by then."""

    def __init__(self, message: str, transferred: int) -> None:
        """Carry ``message`` and the bytes moved before the failure."""
        super().__init__(message)
        self.transferred: int = transferred
        """Bytes sent or received before the failure."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.transferred))


class NetTimeout(_PartialTransfer, TimeoutError):
    """A socket transfer's deadline passed; ``transferred`` bytes had moved by then."""


class PeerClosed(_PartialTransfer, ConnectionError):
    """The peer closed the connection (EOF, reset or broken pipe) mid-transfer."""


def monotonic_ns() -> int:
    """``CLOCK_MONOTONIC`` now in ns, as the native layer reads it: the clock of deadlines."""
    return int(lib.dd_monotonic_ns())


def deadline_after(timeout_s: float | None) -> int:
    """The absolute deadline ``timeout_s`` seconds from now, for the ``sock_*`` functions.

    ``None`` (or ``+inf``) gives 0, meaning no deadline. A timeout <= 0 gives a deadline that
    has already passed: a transfer then completes only as far as it can without waiting.

    Raises:
        TypeError: ``timeout_s`` is not a number or None.
        ValueError: ``timeout_s`` is NaN.
    """
    if timeout_s is None:
        return 0
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float):
        raise TypeError(f"timeout_s must be a number or None, got {type(timeout_s).__name__}")
    if math.isnan(timeout_s):
        raise ValueError("timeout_s must not be NaN")
    if timeout_s == math.inf:
        return 0
    now = monotonic_ns()
    if timeout_s == -math.inf:
        return 1
    # Never 0 or below: those mean "no deadline" to the C side.
    return max(1, min(_I64_MAX, now + math.ceil(timeout_s * 1e9)))


def _fd(fd: object) -> int:
    if type(fd) is int and 0 <= fd <= _INT_MAX:  # (the usual case, in one test)
        return fd
    if isinstance(fd, bool) or not isinstance(fd, int):
        raise TypeError(f"fd must be an int, got {type(fd).__name__}")
    if not 0 <= fd <= _INT_MAX:
        _check(lib.DD_EINVAL, f"fd={fd} is not a file descriptor")
    return fd


def _deadline(deadline_ns: object) -> int:
    if type(deadline_ns) is int and -_I64_MAX - 1 <= deadline_ns <= _I64_MAX:  # (usual case)
        return deadline_ns
    if isinstance(deadline_ns, bool) or not isinstance(deadline_ns, int):
        raise TypeError(f"deadline_ns must be an int, got {type(deadline_ns).__name__}")
    if not -_I64_MAX - 1 <= deadline_ns <= _I64_MAX:
        _check(lib.DD_EINVAL, f"deadline_ns={deadline_ns} does not fit in int64")
    return deadline_ns


def _u64_table(name: str, table: object, columns: int) -> npt.NDArray[np.uint64]:
    """``table`` when it is a C-contiguous ``(n, columns)`` uint64 array; else raise."""
    if not isinstance(table, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(table).__name__}")
    if table.dtype != np.uint64:
        raise TypeError(f"{name} must have dtype uint64, got {table.dtype}")
    if table.ndim != 2 or table.shape[1] != columns:
        raise ValueError(f"{name} must have shape (n, {columns}), got {table.shape}")
    if not (table.flags.c_contiguous and table.flags.aligned):
        raise ValueError(f"{name} must be C-contiguous and aligned")
    return table


def _iov(iov: object) -> npt.NDArray[np.uint64]:
    return _u64_table("iov", iov, 2)


def _net_check(rc: int, done: int, what: str) -> None:
    """Raise for a socket call's return code; read ``ffi.errno`` before any other C call."""
    if rc == 0:
        return
    if rc == lib.DD_ESYS:
        err = ffi.errno
        raise OSError(err, f"{os.strerror(err)} ({what}, {done} bytes moved)")
    if rc == lib.DD_ETIMEDOUT:
        raise NetTimeout(f"{what}: deadline passed after {done} bytes", done)
    if rc == lib.DD_ECLOSED_PEER:
        raise PeerClosed(f"{what}: peer closed the connection after {done} bytes", done)
    _check(rc, f"{what} (a row with bytes has a null address or wraps around)")


def sock_sendv(fd: int, iov: npt.NDArray[np.uint64], deadline_ns: int = 0) -> None:
    """Send every byte of the rows ``(addr, len)`` of ``iov``, in order, in one native call.

    Uses ``sendmsg`` with up to IOV_MAX entries a call and never copies the payload.
    Blocking and non-blocking sockets behave alike (the socket's mode is left alone).
    ``deadline_ns`` is an absolute ``monotonic_ns()`` time (see ``deadline_after``); 0 means
    none. Zero-length rows are skipped; ``iov`` is read in place, never copied. A closed
    peer never raises SIGPIPE.

    Raises:
        TypeError: ``iov`` is not a numpy array of dtype uint64, or ``fd``/``deadline_ns``
            is not an int.
        ValueError: ``iov`` is not C-contiguous and aligned, or not of shape ``(n, 2)``.
        ParamInvalidError: ``fd`` is negative, or a row with bytes has a null address or
            wraps around; nothing is sent then.
        NetTimeout: the deadline passed; ``.transferred`` bytes were sent.
        PeerClosed: the peer reset or closed the connection; ``.transferred`` bytes were sent.
        OSError: another system error (its ``errno`` is the kernel's).
    """
    _fd(fd)
    _deadline(deadline_ns)
    _iov(iov)
    n = iov.shape[0]
    done = ffi.new(_U64P)
    rc = lib.dd_sock_sendv(fd, ffi.from_buffer(_U64S, iov), n, deadline_ns, done)
    _net_check(rc, int(done[0]), f"sock_sendv of {n} rows")


def sock_recvv(fd: int, iov: npt.NDArray[np.uint64], deadline_ns: int = 0) -> None:
    """Receive exactly the bytes the rows ``(addr, len)`` of ``iov`` describe, in order.

    The mirror of ``sock_sendv`` (``recvmsg``, scatter into the rows, no copy).

    Raises:
        TypeError, ValueError, ParamInvalidError: as for ``sock_sendv``.
        NetTimeout: the deadline passed; ``.transferred`` bytes were received.
        PeerClosed: EOF or reset before every byte came; ``.transferred`` bytes were received.
        OSError: another system error.
    """
    _fd(fd)
    _deadline(deadline_ns)
    _iov(iov)
    n = iov.shape[0]
    done = ffi.new(_U64P)
    rc = lib.dd_sock_recvv(fd, ffi.from_buffer(_U64S, iov), n, deadline_ns, done)
    _net_check(rc, int(done[0]), f"sock_recvv of {n} rows")


def sock_send(fd: int, addr: int, nbytes: int, deadline_ns: int = 0) -> None:
    """Send ``nbytes`` from address ``addr``: ``sock_sendv`` of one row.

    Raises:
        TypeError: an argument is not an int.
        ParamInvalidError: ``fd`` or a size is negative, or ``addr`` is null with
            ``nbytes > 0``.
        NetTimeout, PeerClosed, OSError: as for ``sock_sendv``.
    """
    _fd(fd)
    _u64(addr, "addr")
    _u64(nbytes, "nbytes")
    _deadline(deadline_ns)
    done = ffi.new(_U64P)
    rc = lib.dd_sock_send(fd, addr, nbytes, deadline_ns, done)
    _net_check(rc, int(done[0]), f"sock_send of {nbytes} bytes")


def sock_recv(fd: int, addr: int, nbytes: int, deadline_ns: int = 0) -> None:
    """Receive exactly ``nbytes`` into address ``addr``: ``sock_recvv`` of one row.

    Raises:
        TypeError, ParamInvalidError: as for ``sock_send``.
        NetTimeout, PeerClosed, OSError: as for ``sock_recvv``.
    """
    _fd(fd)
    _u64(addr, "addr")
    _u64(nbytes, "nbytes")
    _deadline(deadline_ns)
    done = ffi.new(_U64P)
    rc = lib.dd_sock_recv(fd, addr, nbytes, deadline_ns, done)
    _net_check(rc, int(done[0]), f"sock_recv of {nbytes} bytes")


def bytes_address(data: bytes | bytearray | memoryview) -> tuple[int, Any]:
    """Where ``data``'s bytes lie, and what keeps them there: hold the second item for as
    long as the address is used (a row of an iov, say); ``ffi.sizeof`` of it is their size.

    Raises:
        BufferError: ``data`` is not a contiguous buffer.
    """
    buf = ffi.from_buffer(data)  # keeps data's buffer exported until buf is dropped
    return int(ffi.cast("uintptr_t", buf)), buf


def sock_send_bytes(fd: int, data: bytes | bytearray | memoryview, deadline_ns: int = 0) -> None:
    """Send all of ``data`` (a small control frame, say) without copying it.

    Raises:
        TypeError: ``data`` does not support the buffer protocol or is not contiguous.
        NetTimeout, PeerClosed, OSError: as for ``sock_sendv``.
    """
    _fd(fd)
    _deadline(deadline_ns)
    try:
        addr, buf = bytes_address(data)
    except BufferError as exc:
        raise TypeError(f"data must be a contiguous buffer: {exc}") from exc
    nbytes = ffi.sizeof(buf)
    done = ffi.new(_U64P)
    rc = lib.dd_sock_send(fd, addr, nbytes, deadline_ns, done)
    _net_check(rc, int(done[0]), f"sock_send_bytes of {nbytes} bytes")


def sock_recv_into(fd: int, buf: bytearray | memoryview, deadline_ns: int = 0) -> None:
    """Fill the writable buffer ``buf`` exactly, receiving ``len`` of its bytes.

    Raises:
        TypeError: ``buf`` is read-only, not contiguous or not a buffer.
        NetTimeout, PeerClosed, OSError: as for ``sock_recvv``.
    """
    _fd(fd)
    _deadline(deadline_ns)
    try:
        cbuf = ffi.from_buffer(buf, require_writable=True)
    except BufferError as exc:
        raise TypeError(f"buf must be a writable contiguous buffer: {exc}") from exc
    nbytes = ffi.sizeof(cbuf)
    done = ffi.new(_U64P)
    rc = lib.dd_sock_recv(fd, int(ffi.cast("uintptr_t", cbuf)), nbytes, deadline_ns, done)
    _net_check(rc, int(done[0]), f"sock_recv_into of {nbytes} bytes")


def sock_wait_readable(fd: int, deadline_ns: int = 0, *, spin_ns: int = 0) -> bool:
    """Wait until ``fd`` is readable, or has an error or hangup for the next receive to
    report; False when ``deadline_ns`` passed first (GIL released).

    For the first ``spin_ns`` nanoseconds it polls without sleeping (busy polling), then
    sleeps in ``poll``. It always checks once, even with a deadline already past.

    Raises:
        TypeError: an argument is not an int.
        ParamInvalidError: ``fd`` or ``spin_ns`` is negative or too big.
        OSError: ``poll`` failed (``EBADF`` for a closed descriptor).
    """
    _fd(fd)
    _deadline(deadline_ns)
    if isinstance(spin_ns, bool) or not isinstance(spin_ns, int):
        raise TypeError(f"spin_ns must be an int, got {type(spin_ns).__name__}")
    if not 0 <= spin_ns <= _I64_MAX:
        _check(lib.DD_EINVAL, f"sock_wait_readable spin_ns={spin_ns}")
    rc = lib.dd_sock_wait_readable(fd, spin_ns, deadline_ns)
    if rc == lib.DD_ETIMEDOUT:
        return False
    if rc == lib.DD_ESYS:
        code = ffi.errno
        raise OSError(code, f"sock_wait_readable: {os.strerror(code)}")
    _check(rc, "sock_wait_readable")
    return True


def sock_tune(fd: int, *, nodelay: bool | None = True, sndbuf: int = 0, rcvbuf: int = 0) -> None:
    """Set TCP_NODELAY (``None`` leaves it; non-TCP sockets ignore it) and, when > 0, the
    kernel's send and receive buffer sizes (Linux doubles them and enforces a minimum).

    Raises:
        TypeError: an argument has the wrong type.
        ParamInvalidError: ``fd`` or a buffer size is negative or too big.
        OSError: the kernel refused an option.
    """
    _fd(fd)
    if nodelay is not None and not isinstance(nodelay, bool):
        raise TypeError(f"nodelay must be a bool or None, got {type(nodelay).__name__}")
    for name, value in (("sndbuf", sndbuf), ("rcvbuf", rcvbuf)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= value <= _INT_MAX:
            _check(lib.DD_EINVAL, f"sock_tune {name}={value}")
    flag = -1 if nodelay is None else int(nodelay)
    rc = lib.dd_sock_tune(fd, flag, sndbuf, rcvbuf)
    _net_check(rc, 0, f"sock_tune of fd {fd}")
