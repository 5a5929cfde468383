"""Device rows on host-only routes: pinned host buffers that stand in for device memory.

Transports and the one-sided path move host memory only (sockets, ``memcpy``,
``process_vm_readv``). Under an accelerator runtime, rows of ``Placement.DEVICE`` memory
therefore travel through a pinned host buffer of the runtime: rows read by a route are
copied out of the device before it starts (:meth:`Staging.outbound`); rows written by a
route are received into the buffer and copied to the device only once every byte arrived
(:meth:`Staging.inbound`), so a transfer that fails never leaves device memory half
written. Host rows in the same table stay where they are.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

from aio_datadist._memory.rows import Rows
from aio_datadist._runtime.base import CopyKind, DeviceRuntime

__all__ = ("STAGING_KEEP_BYTES", "Mask", "Staged", "Staging")

#: Pinned bytes kept for reuse after a staged transfer ends (allocating pinned memory costs
#: milliseconds per call on accelerator runtimes).
STAGING_KEEP_BYTES = 256 << 20
#: Buffers are allocated in multiples of this, so sizes repeat and buffers get reused.
_GRAIN = 1 << 20

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


class Staging:
    """The pinned host buffers of one runtime, reused across transfers."""

    def __init__(self, runtime: DeviceRuntime, *, keep_bytes: int = STAGING_KEEP_BYTES) -> None:
        self.runtime = runtime
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[int]] = {}
        self._kept = 0
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
            free = self._free.get(size)
            if free:
                self._kept -= size
                return free.pop(), size
        return self.runtime.alloc_host(size), size

    def give_back(self, addr: int, size: int) -> None:
        """Return a buffer from :meth:`take`: kept for reuse, or freed past the keep limit."""
        with self._lock:
            if not self._closed and self._kept + size <= self._keep_bytes:
                self._free.setdefault(size, []).append(addr)
                self._kept += size
                return
        self.runtime.free_host(addr, size)

    def close(self) -> None:
        """Free every kept buffer; buffers given back later are freed at once."""
        with self._lock:
            self._closed = True
            free, self._free, self._kept = self._free, {}, 0
        for size, addrs in free.items():
            for addr in addrs:
                self.runtime.free_host(addr, size)
