"""Address ranges a runtime knows (its allocations, pinned or mapped memory), looked up in bulk."""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

__all__ = ("AddressRanges",)

U64s = npt.NDArray[np.uint64]


class AddressRanges:
    """A thread-safe set of disjoint ``[start, start + nbytes)`` ranges.

    Changes (allocations) are rare and rebuild sorted arrays; lookups (every copy) read a
    snapshot of them without locking and answer for a whole column of addresses at once.
    """

    __slots__ = ("_lock", "_map", "_snapshot")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._map: dict[int, int] = {}
        empty = np.empty(0, dtype=np.uint64)
        self._snapshot: tuple[U64s, U64s] = (empty, empty)

    def _rebuild(self) -> None:
        starts = np.array(sorted(self._map), dtype=np.uint64)
        ends = np.array([self._map[int(s)] for s in starts], dtype=np.uint64)
        self._snapshot = (starts, ends)

    def add(self, start: int, nbytes: int) -> None:
        """Remember ``[start, start + nbytes)``."""
        with self._lock:
            self._map[start] = start + nbytes
            self._rebuild()

    def remove(self, start: int) -> int | None:
        """Forget the range starting at ``start``; returns its size, None if unknown."""
        with self._lock:
            end = self._map.pop(start, None)
            if end is None:
                return None
            self._rebuild()
            return end - start

    def find(self, addr: int) -> tuple[int, int] | None:
        """``(start, nbytes)`` of the range holding ``addr``, or None."""
        starts, ends = self._snapshot
        i = int(np.searchsorted(starts, np.uint64(addr), side="right")) - 1
        if i < 0 or addr >= int(ends[i]):
            return None
        return int(starts[i]), int(ends[i]) - int(starts[i])

    def covers(self, addrs: U64s, lengths: U64s) -> npt.NDArray[np.bool_]:
        """Per row: does one range hold all of ``[addrs[i], addrs[i] + lengths[i])``?"""
        starts, ends = self._snapshot
        if len(starts) == 0:
            return np.zeros(len(addrs), dtype=bool)
        idx = np.searchsorted(starts, addrs, side="right").astype(np.int64) - 1
        inside = idx >= 0
        idx[~inside] = 0
        with np.errstate(over="ignore"):
            last = addrs + lengths
        ok: npt.NDArray[np.bool_] = inside & (last >= addrs) & (last <= ends[idx])
        return ok

    def __len__(self) -> int:
        return len(self._map)

    def items(self) -> list[tuple[int, int]]:
        """Every range as ``(start, nbytes)``."""
        with self._lock:
            return [(start, end - start) for start, end in self._map.items()]
