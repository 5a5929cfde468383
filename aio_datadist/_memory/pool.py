"""Memory pools: a native page allocator over one arena from the device runtime."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from aio_datadist._memory.arena import Arena
from aio_datadist._native.api import NativePool, PoolStats
from aio_datadist._runtime.base import DeviceRuntime
from aio_datadist.enums import Placement
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ("Allocation", "MemoryPool", "PoolStats")


@dataclass(frozen=True)
class Allocation:
    """One live pool allocation: ``nbytes`` (page-rounded) at ``addr``."""

    addr: int
    nbytes: int
    handle: int
    #: ``(addr, nbytes)`` runs to zero before use: empty unless the pool zeroes (``zero``).
    to_zero: tuple[tuple[int, int], ...] = ()
    #: ``(addr, nbytes)`` runs no allocation held before, to commit before use
    #: (``DeviceRuntime.populate``): empty unless the runtime's memory is committed on first
    #: touch (``DeviceRuntime.fresh_memory_is_lazy``).
    to_populate: tuple[tuple[int, int], ...] = ()

    @property
    def prepare_bytes(self) -> int:
        """Bytes to zero or commit before the allocation is used; 0 for none."""
        return sum(n for _, n in self.to_zero) + sum(n for _, n in self.to_populate)


def _runs(flags: npt.NDArray[np.bool_]) -> list[tuple[int, int]]:
    """``(start, stop)`` index pairs of the runs of True in ``flags``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.view(np.int8), [0]))))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


class MemoryPool:
    """A pool of ``memory_size`` bytes for one placement, allocated in pages of ``1 << page_shift``.

    Thread-safe. Exhaustion raises ``LLMException(LLM_OUT_OF_MEMORY)`` and leaves the pool usable.

    With ``zero``, each allocation names the runs that must be zeroed before anyone reads them
    (``Allocation.to_zero``): the whole allocation, or, where the runtime's fresh memory reads
    zero (``DeviceRuntime.fresh_memory_is_zero``), only the pages an earlier allocation held.
    Where the runtime's memory is committed on first touch
    (``DeviceRuntime.fresh_memory_is_lazy``), each allocation names the pages no allocation
    held before (``Allocation.to_populate``), to commit in one call before use, so that
    transfers never take a page fault (device memory is committed when allocated). Pages
    never handed out cost nothing.
    """

    def __init__(
        self,
        runtime: DeviceRuntime,
        placement: Placement,
        memory_size: int,
        page_shift: int,
        *,
        zero: bool = False,
    ) -> None:
        self.placement = placement
        arena: Arena | None
        if placement is Placement.DEVICE:
            addr = runtime.alloc_device(memory_size)
            arena = Arena(addr, memory_size, runtime.free_device)
        else:
            addr = runtime.alloc_host(memory_size)
            arena = Arena(addr, memory_size, runtime.free_host)
        #: The pool's memory; dropped at :meth:`close` (caches and their views keep it).
        self._arena: Arena | None = arena
        self._native = NativePool(addr, memory_size, page_shift)
        self._lock = threading.Lock()
        self._closed = False
        #: Allocations name the runs to zero before use (``aio.ZeroOnAlloc``).
        self.zero = zero
        #: Allocations name their fresh pages to commit before use.
        self.populate = runtime.fresh_memory_is_lazy
        # Zeroing names the pages handed out before where fresh memory reads zero, else
        # every page.
        self._zero_reused = zero and runtime.fresh_memory_is_zero
        self._zero_whole = zero and not runtime.fresh_memory_is_zero
        self._page_shift = page_shift
        # One flag per page: handed out at least once. None: nothing needs to tell.
        self._used: npt.NDArray[np.bool_] | None = (
            np.zeros(self._native.capacity >> page_shift, np.bool_)
            if self.populate or self._zero_reused
            else None
        )

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
        size = self.round_up(nbytes)
        whole = ((addr, size),) if self._zero_whole else ()
        if self._used is None:
            return Allocation(addr, size, handle, whole)
        first = (addr - self._native.base) >> self._page_shift
        stop = first + (size >> self._page_shift)
        with self._lock:
            used = self._used[first:stop]
            reused = _runs(used) if self._zero_reused else []
            fresh = _runs(~used) if self.populate else []
            used[:] = True
        shift = self._page_shift

        def spans(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
            return tuple((addr + (a << shift), (b - a) << shift) for a, b in runs)

        return Allocation(addr, size, handle, whole or spans(reused), spans(fresh))

    def release(self, allocation: Allocation, *, unused: bool = False) -> None:
        """Return ``allocation`` to the pool; a pool already closed ignores it.

        ``unused``: it goes back before anyone used it (an allocate call that failed, maybe
        while committing it), so its fresh pages count as never handed out: the next
        allocation over them commits them again.
        """
        with self._lock:
            if self._closed:
                return
            if unused and self._used is not None:
                base, shift = self._native.base, self._page_shift
                for addr, nbytes in allocation.to_populate:
                    first = (addr - base) >> shift
                    self._used[first : first + (nbytes >> shift)] = False
            self._native.free(allocation.handle)

    def stats(self) -> PoolStats:
        """Capacity, usage and fragmentation figures of the pool."""
        return self._native.stats()

    @property
    def arena(self) -> Arena:
        """The pool's memory, while the pool is open.

        Raises:
            LLMException: ``LLM_FAILED`` once the pool closed.
        """
        arena = self._arena
        if arena is None:
            raise LLMException("the memory pool is closed", status_code=LLMStatusCode.LLM_FAILED)
        return arena

    def close(self) -> None:
        """Forget every allocation and drop the pool's hold on its memory: the memory is
        freed now, or once the last cache object or view that refers to it is gone (never
        by the collector for the engine's own objects, which may outlive ``finalize`` in
        reference cycles)."""
        arena: Arena | None = None
        with self._lock:
            if not self._closed:
                self._closed = True
                self._native.close()
                arena, self._arena = self._arena, None
        del arena  # (outside the lock: its release may call into the runtime)

    def __repr__(self) -> str:
        return f"<MemoryPool {self.placement!s} {self.stats()}>"
