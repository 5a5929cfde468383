"""Typed wrappers over ``serve.c``: small pulls and pushes of blocks answered from a link's
reader thread.

A :class:`ServeTable` lists the blocks caches an engine lets peers read and write in host
memory. Each link's reader thread holds a :class:`ServeWorker` of it, whose
:meth:`ServeWorker.serve` answers, in one native call with the GIL released, every
well-formed PULL or PUSH of a listed cache waiting on the link's socket, up to the first
frame it leaves to the transport's general reader (anything else, anything refused,
anything not yet whole).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._ffi import ffi, lib
from .api import PeerClosed, _check, _fd, _u64

__all__ = ("ROWS_MAX", "PartialAnswer", "ServeResult", "ServeStats", "ServeTable", "ServeWorker")

#: Most payload rows one natively served request may have (one ``sendmsg`` or ``recvmsg``).
ROWS_MAX = 1023


@dataclass(frozen=True, slots=True)
class ServeStats:
    """A snapshot of a :class:`ServeTable`."""

    caches: int  #: caches listed
    pinned: int  #: transfers in flight over listed or dropped caches
    served: int  #: requests answered whole, ever
    partial: int  #: answers the kernel took in part, ever


@dataclass(frozen=True, slots=True)
class PartialAnswer:
    """An answer the kernel took in part; a pull's cache stays pinned until :meth:`release`."""

    request_id: int
    kind: int  #: the answer's frame kind (``FrameKind.PULL_DATA`` or ``PUSH_ACK``)
    nbytes: int  #: payload bytes of the answer
    sent: int  #: bytes of the frame (its 40-byte header first) already sent
    rows: npt.NDArray[np.uint64]  #: the payload rows ``(addr, len)``
    _table: ServeTable
    _pin: Any

    def release(self, ok: bool = True) -> None:
        """Unpin the cache once the rest of the frame went (or the link failed)."""
        del ok
        self._table._unpin(self._pin)


@dataclass(frozen=True, slots=True)
class ServeResult:
    """What one :meth:`ServeWorker.serve` call did."""

    served: int  #: requests answered whole
    pending: bool  #: a frame waits that the general reader must handle
    partial: PartialAnswer | None = None  #: an answer to finish sending, if any


class ServeTable:
    """The blocks caches served natively; thread-safe."""

    __slots__ = ("__weakref__", "_ptr")

    def __init__(self) -> None:
        """Make an empty table.

        Raises:
            OutOfMemoryError: the table could not be allocated.
        """
        out = ffi.new("dd_serve_table **")
        _check(lib.dd_serve_table_new(out), "cannot make a serve table")
        self._ptr: Any = ffi.gc(out[0], lib.dd_serve_table_free)

    def set(
        self, caches: Iterable[tuple[int, Sequence[int], int, int]], deadline_ns: int = 0
    ) -> bool:
        """List exactly ``caches``: ``(ident, tensor_addrs, block_bytes, num_blocks)`` each.

        Returns once no answer in flight uses a cache no longer listed, so its memory may
        go; False when ``deadline_ns`` (absolute, 0: none) passed first.

        Raises:
            TypeError: a field is not an int.
            ParamInvalidError: a cache has no tensors, no blocks, an empty block, a null
                address, or blocks that wrap around the address space.
        """
        rows: list[int] = []
        addrs: list[int] = []
        for ident, tensor_addrs, block_bytes, num_blocks in caches:
            rows += (_u64(ident, "ident"), len(tensor_addrs), _u64(block_bytes, "block_bytes"))
            rows.append(_u64(num_blocks, "num_blocks"))
            addrs += (_u64(a, "address") for a in tensor_addrs)
        row_buf = ffi.new("uint64_t[]", rows or 1)
        addr_buf = ffi.new("uint64_t[]", addrs or 1)
        rc = lib.dd_serve_table_set(
            self._ptr, row_buf, len(rows) // 4, addr_buf, len(addrs), int(deadline_ns)
        )
        if rc == lib.DD_ETIMEDOUT:
            return False
        _check(rc, "serve table")
        return True

    def stats(self) -> ServeStats:
        """Counts of the table (see :class:`ServeStats`)."""
        out = ffi.new("dd_serve_stats *")
        _check(lib.dd_serve_table_stats(self._ptr, out), "serve table stats")
        return ServeStats(int(out.caches), int(out.pinned), int(out.served), int(out.partial))

    def worker(self) -> ServeWorker:
        """A worker for one reader thread (it owns scratch space; one thread at a time)."""
        return ServeWorker(self)

    def _unpin(self, pin: Any) -> None:
        lib.dd_serve_unpin(self._ptr, pin)


class ServeWorker:
    """One reader thread's handle on a :class:`ServeTable`."""

    __slots__ = ("_out", "_rows", "_table")

    def __init__(self, table: ServeTable) -> None:
        self._table = table
        self._rows = ffi.new("uint64_t[]", 2 * ROWS_MAX)
        self._out = ffi.new("dd_serve_out *")

    def serve(self, fd: int, max_bytes: int, spin_ns: int = 0) -> ServeResult:
        """Answer the pulls and pushes waiting on socket ``fd`` that the table can serve
        (never waits).

        Requests of more than ``max_bytes`` payload bytes, or more than :data:`ROWS_MAX`
        rows, are left to the general reader; so is a push whose payload has not all
        arrived (for a push of up to 256 KiB, after ``spin_ns`` of busy polling).

        Raises:
            PeerClosed: the peer went away after a request was taken.
            OSError: the socket failed after a request was taken.
        """
        _fd(fd)
        out = self._out
        if isinstance(spin_ns, bool) or not isinstance(spin_ns, int):
            raise TypeError(f"spin_ns must be an int, got {type(spin_ns).__name__}")
        if not 0 <= spin_ns < 1 << 63:
            _check(lib.DD_EINVAL, f"spin_ns={spin_ns} is outside [0, 2**63)")
        rc = lib.dd_serve_requests(
            self._table._ptr, fd, _u64(max_bytes, "max_bytes"), spin_ns, self._rows, ROWS_MAX, out
        )
        if rc == 0:
            return ServeResult(int(out.served), bool(out.pending))
        if rc == lib.DD_SERVE_PARTIAL:
            n = int(out.nrows)
            rows = np.frombuffer(ffi.buffer(self._rows, 16 * n), dtype=np.uint64).reshape(n, 2)
            partial = PartialAnswer(
                int(out.request_id),
                int(out.kind),
                int(out.nbytes),
                int(out.sent),
                rows.copy(),
                self._table,
                out.pin,
            )
            return ServeResult(int(out.served), False, partial)
        what = f"answering request {int(out.request_id)} after {int(out.sent)} bytes"
        if rc == lib.DD_ECLOSED_PEER:
            raise PeerClosed(f"{what}: the peer closed the connection", int(out.sent))
        if rc == lib.DD_ESYS:
            code = ffi.errno
            raise OSError(code, f"{what}: {os.strerror(code)}")
        _check(rc, "serve requests")
        raise AssertionError("unreachable")  # pragma: no cover
