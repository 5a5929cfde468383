"""Memory pools: a native page allocator over one arena from the device runtime."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from aio_datadist._memory.arena import Arena
from aio_datadist._native.api import NativePool, PoolStats
from aio_datadist._runtime.base import DeviceRuntime
from aio_datadist.enums import Placement

__all__ = ("Allocation", "MemoryPool", "PoolStats")


@dataclass(frozen=True)
class Allocation:
    """One live pool allocation: ``nbytes`` (page-rounded) at ``addr``."""

    addr: int
    nbytes: int
    handle: int


class MemoryPool:
    """A pool of ``memory_size`` bytes for one placement, allocated in pages of ``1 << page_shift``.

    Thread-safe. Exhaustion raises ``LLMException(LLM_OUT_OF_MEMORY)`` and leaves the pool usable.
    """

    def __init__(
        self, runtime: DeviceRuntime, placement: Placement, memory_size: int, page_shift: int
    ) -> None:
        self.placement = placement
        if placement is Placement.DEVICE:
            addr = runtime.alloc_device(memory_size)
            self.arena = Arena(addr, memory_size, runtime.free_device)
        else:
            addr = runtime.alloc_host(memory_size)
            self.arena = Arena(addr, memory_size, runtime.free_host)
        self._native = NativePool(addr, memory_size, page_shift)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def page_size(self) -> int:
        """Allocation granularity in bytes."""
        return self._native.page_size

    def round_up(self, nbytes: int) -> int:
        """``nbytes`` rounded up to whole pages."""
        page = self._native.page_size
        return (nbytes + page - 1) // page * page

    def allocate(self, nbytes: int) -> Allocation:
        """Allocate ``nbytes`` (rounded up to pages).

        :raises LLMException: ``LLM_OUT_OF_MEMORY`` when no free run is large enough.
        """
        addr, handle = self._native.alloc(nbytes)
        return Allocation(addr, self.round_up(nbytes), handle)

    def release(self, allocation: Allocation) -> None:
        """Return ``allocation`` to the pool; a pool already closed ignores it."""
        with self._lock:
            if self._closed:
                return
            self._native.free(allocation.handle)

    def stats(self) -> PoolStats:
        """Capacity, usage and fragmentation figures of the pool."""
        return self._native.stats()

    def close(self) -> None:
        """Forget every allocation; the arena is freed once no view refers to it."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._native.close()

    def __repr__(self) -> str:
        return f"<MemoryPool {self.placement!s} {self.stats()}>"
