"""Device rows on host-only routes: pinned host buffers that stand in for device memory.

Transports and the one-sided path move host memory only (sockets, ``memcpy``,
``process_vm_readv``). Under an accelerator runtime, rows of ``Placement.DEVICE`` memory
therefore travel through a pinned host buffer of the runtime: rows read by a route are
copied out of the device before it starts (:meth:`Staging.outbound`); rows written by a
route are received into the buffer and copied to the device only once every byte arrived
(:meth:`Staging.inbound`), so a transfer that fails never leaves device memory half
written. Host rows in the same table stay where they are.

Byte-stream routes (sockets) use :meth:`Staging.stream` instead: the rows move in order
through a bounded ring of pinned chunks, so device copies overlap the socket and a transfer
of any size needs only a few chunks of pinned memory. A streamed write reaches the device
chunk by chunk: a transfer that fails may leave device rows partly written (as a failed
socket receive into host memory does), and reports the failure.
"""

from __future__ import annotations

import threading
from collections.abc import Generator

import numpy as np
import numpy.typing as npt

from aio_datadist._memory.rows import Rows
from aio_datadist._runtime.base import CopyKind, DeviceRuntime

__all__ = ("STAGING_KEEP_BYTES", "STREAM_CHUNK_BYTES", "Mask", "Staged", "Staging", "Streamed")

#: Pinned bytes kept for reuse after a staged transfer ends (allocating pinned memory costs
#: milliseconds per call on accelerator runtimes).
STAGING_KEEP_BYTES = 256 << 20
#: Bytes per chunk when a runtime without a native ring streams device rows.
STREAM_CHUNK_BYTES = 4 << 20
#: Buffers are allocated in multiples of this, so sizes repeat and buffers get reused.
_GRAIN = 1 << 20
#: The longest :meth:`Staging.close` waits for buffers still out (a transfer that ended
#: hands its buffer back moments after its caller learned so).
_CLOSE_WAIT_S = 5.0

#: One flag per row: True where the row lies in device memory.
Mask = npt.NDArray[np.bool_]


def _rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to a power of two of at least one grain."""
    return max(_GRAIN, 1 << (max(nbytes, 1) - 1).bit_length())


class Staged:
    """Host rows standing in for device rows during one transfer, and how to end it.

    ``iov`` has the same order and byte count as the rows it replaces. Call :meth:`finish`
    exactly once when the route no longer touches ``iov``; later calls do nothing.
    """

    __slots__ = ("_buffer", "_ops", "_staging", "iov")

    def __init__(
        self, staging: Staging, buffer: tuple[int, int], iov: Rows, ops: npt.NDArray[np.uint64]
    ) -> None:
        self._staging: Staging | None = staging
        self._buffer = buffer
        self._ops = ops
        self.iov = iov

    def finish(self, ok: bool) -> None:
        """Copy received bytes to the device (inbound, when ``ok``), then free the buffer.

        :raises LLMException: the device copy failed (the buffer is freed all the same).
        """
        staging, self._staging = self._staging, None
        if staging is None:
            return
        try:
            if ok and len(self._ops):
                staging.runtime.copy_batch(self._ops, CopyKind.HOST_TO_DEVICE)
        finally:
            staging.give_back(*self._buffer)


class Streamed:
    """Rows a byte stream moves in order, device rows through pinned chunks.

    :meth:`segments` hands out host rows one piece at a time: host rows as they are,
    device rows as pinned chunks. Reading (``outbound``), each piece already holds its bytes;
    writing, each piece is to be filled, and reaches the device when the next piece is taken
    or when the iteration ends. Close the iterator early (``close()``) to stop: a piece not
    yet taken to the device is dropped. One iteration per transfer.
    """

    __slots__ = ("_mask", "_outbound", "_staging", "iov", "nbytes")

    def __init__(self, staging: Staging, iov: Rows, mask: Mask | None, outbound: bool) -> None:
        self._staging = staging
        self._mask = mask
        self._outbound = outbound
        self.iov = iov
        self.nbytes = int(iov[:, 1].sum()) if len(iov) else 0

    def segments(self) -> Generator[Rows, None, None]:
        """The pieces, in payload order (a generator: close it when stopping early)."""
        iov, mask = self.iov, self._mask
        if mask is None:
            yield from self._staging.chunks(iov, self._outbound)
            return
        # Runs of rows on one side of the mask, in order.
        edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
        for run in np.split(np.arange(len(iov)), edges):
            if not len(run):
                continue
            rows = iov[run[0] : run[-1] + 1]
            if mask[run[0]]:
                yield from self._staging.chunks(rows, self._outbound)
            else:
                yield rows


def _window_ops(
    iov: Rows, ends: npt.NDArray[np.uint64], start: int, n: int, buffer: int, outbound: bool
) -> npt.NDArray[np.uint64]:
    """Copy ops between bytes ``[start, start + n)`` of the rows ``iov`` (``ends``: their
    cumulative sizes) and a buffer at ``buffer``: ``(dst, src, nbytes)`` rows."""
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(ends, start + n, side="left"))
    rows = iov[first : last + 1]
    row_ends = ends[first : last + 1].astype(np.int64)
    row_starts = row_ends - rows[:, 1].astype(np.int64)
    lo = np.maximum(row_starts, start)
    hi = np.minimum(row_ends, start + n)
    device = rows[:, 0].astype(np.uint64) + (lo - row_starts).astype(np.uint64)
    host = np.uint64(buffer) + (lo - start).astype(np.uint64)
    ops = np.empty((len(rows), 3), dtype=np.uint64)
    dst, src = (host, device) if outbound else (device, host)
    ops[:, 0], ops[:, 1], ops[:, 2] = dst, src, (hi - lo).astype(np.uint64)
    return ops[ops[:, 2] > 0]


class Staging:
    """The pinned host buffers of one runtime, reused across transfers."""

    def __init__(
        self,
        runtime: DeviceRuntime,
        *,
        keep_bytes: int = STAGING_KEEP_BYTES,
        chunk_bytes: int | None = None,
    ) -> None:
        self.runtime = runtime
        #: Bytes per piece when streaming without a native ring (:data:`STREAM_CHUNK_BYTES`).
        self.chunk_bytes = STREAM_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        self._free: dict[int, list[int]] = {}
        self._kept = 0
        self._out = 0  # buffers taken and not given back yet
        self._closed = False

    @property
    def needed(self) -> bool:
        """True when device memory is not host memory, so device rows must be staged."""
        return not self.runtime.device_memory_is_host

    def outbound(self, iov: Rows, on_device: Mask | None = None) -> Staged:
        """Host rows holding the bytes of ``iov`` now, for a route that reads them.

        ``on_device`` marks the rows in device memory (default: all of them).
        """
        staged, ops = self._stage(iov, on_device, outbound=True)
        if len(ops):
            try:
                self.runtime.copy_batch(ops, CopyKind.DEVICE_TO_HOST)
            except BaseException:
                staged.finish(False)
                raise
        return staged

    def inbound(self, iov: Rows, on_device: Mask | None = None) -> Staged:
        """Host rows for a route to write; :meth:`Staged.finish` (ok) moves them to ``iov``."""
        staged, _ = self._stage(iov, on_device, outbound=False)
        return staged

    def stream(self, iov: Rows, on_device: Mask | None = None, *, outbound: bool) -> Streamed:
        """``iov`` for a byte stream that reads it (``outbound``) or writes it, in order.

        ``on_device`` marks the rows in device memory (default: all of them).
        """
        return Streamed(self, iov, on_device, outbound)

    def chunks(self, iov: Rows, outbound: bool) -> Generator[Rows, None, None]:
        """The device rows ``iov`` as pinned one-row pieces, in order (see :class:`Streamed`)."""
        kind = CopyKind.DEVICE_TO_HOST if outbound else CopyKind.HOST_TO_DEVICE
        ring = self.runtime.stage_ring(iov, kind)
        if ring is not None:
            with ring:
                for addr, n in ring:
                    yield np.array([[addr, n]], dtype=np.uint64)
            return
        ends = np.cumsum(iov[:, 1], dtype=np.uint64)
        total = int(ends[-1]) if len(ends) else 0
        if total == 0:
            return
        buffer = self.take(min(total, self.chunk_bytes))
        try:
            step = min(buffer[1], self.chunk_bytes)
            for start in range(0, total, step):
                n = min(step, total - start)
                ops = _window_ops(iov, ends, start, n, buffer[0], outbound)
                if outbound:
                    self.runtime.copy_batch(ops, kind)
                piece = np.array([[buffer[0], n]], dtype=np.uint64)
                yield piece
                if not outbound:  # taken again: the piece was filled
                    self.runtime.copy_batch(ops, kind)
        finally:
            self.give_back(*buffer)

    def _stage(
        self, iov: Rows, on_device: Mask | None, *, outbound: bool
    ) -> tuple[Staged, npt.NDArray[np.uint64]]:
        lens = iov[:, 1]
        moved = lens if on_device is None else np.where(on_device, lens, 0)
        total = int(moved.sum())
        buffer = self.take(total)
        base = np.uint64(buffer[0])
        starts = base + np.concatenate([np.zeros(1, np.uint64), np.cumsum(moved)[:-1]])
        if on_device is None:
            host = np.array([[buffer[0], total]], dtype=np.uint64)
            device_rows, buffer_starts = iov, starts
        else:
            host = iov.copy()
            host[on_device, 0] = starts[on_device]
            device_rows, buffer_starts = iov[on_device], starts[on_device]
        ops = np.empty((len(device_rows), 3), dtype=np.uint64)  # (dst, src, nbytes)
        device_col, buffer_col = (1, 0) if outbound else (0, 1)
        ops[:, device_col] = device_rows[:, 0]
        ops[:, buffer_col] = buffer_starts
        ops[:, 2] = device_rows[:, 1]
        ops = ops[ops[:, 2] > 0]
        return Staged(self, buffer, host, np.empty((0, 3), np.uint64) if outbound else ops), ops

    def take(self, nbytes: int) -> tuple[int, int]:
        """A pinned buffer of at least ``nbytes``: ``(addr, size)``; give it back when done."""
        size = _rounded(nbytes)
        with self._lock:
            self._out += 1
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop(), size
        try:
            return self.runtime.alloc_host(size), size
        except BaseException:
            self._given_back()
            raise

    def give_back(self, addr: int, size: int) -> None:
        """Return a buffer from :meth:`take`: kept for reuse, or freed past the keep limit."""
        with self._lock:
            if not self._closed and self._kept + size <= self._keep_bytes:
                self._free.setdefault(size, []).append(addr)
                self._kept += size
                self._out -= 1
                self._returned.notify_all()
                return
        try:
            self.runtime.free_host(addr, size)
        finally:
            self._given_back()

    def _given_back(self) -> None:
        with self._lock:
            self._out -= 1
            self._returned.notify_all()

    def close(self) -> None:
        """Free every kept buffer, once the buffers still out came back (a transfer that
        ended gives its buffer back moments after its caller learned so; the engine's links
        are closed first, so none is still moving): at most :data:`_CLOSE_WAIT_S`. A buffer
        given back later is freed at once. The runtime can then release the device at its
        close, not whenever the last buffer comes back."""
        with self._lock:
            self._closed = True
            self._returned.wait_for(lambda: self._out <= 0, _CLOSE_WAIT_S)
            free, self._free, self._kept = self._free, {}, 0
        for size, addrs in free.items():
            for addr in addrs:
                self.runtime.free_host(addr, size)
