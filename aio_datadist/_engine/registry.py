"""The cache registry: live caches, their key references and in-flight pins. Pure and sync.

A pool-allocated cache is referenced by its id and by each bound key. Its memory returns to
the pool only when the id reference was dropped (``deallocate_*``), no key remains, no copy
is using it (pins), and no linked peer may still reach it one-sided (holds: the UCX route's
peers, until they acknowledge that they stopped; ``_routes.ucx.board``). All state changes
happen under one lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from aio_datadist._memory.pool import Allocation, MemoryPool
from aio_datadist._native.api import BlockLayout
from aio_datadist.cache import Cache
from aio_datadist.enums import Placement
from aio_datadist.types import BlocksCacheKey, CacheLayout

__all__ = ("CacheEntry", "CacheRegistry", "KeyIdentity")

KeyIdentity = Hashable


@dataclass(eq=False)
class CacheEntry:
    """Everything the engine knows about one live cache."""

    cache_id: int
    cache: Cache
    #: The layout fixed when the cache was made (the ``Cache``'s own frozen copy).
    desc: CacheLayout
    addrs: tuple[int, ...]
    is_blocks: bool
    registered: bool
    remote_accessible: bool
    tensor_stride: int
    pool: MemoryPool | None = None
    allocation: Allocation | None = None
    keys: dict[KeyIdentity, int] = field(default_factory=dict)
    blocks_key: BlocksCacheKey | None = None
    released: bool = False
    pins: int = 0
    #: Peers that may still reach the memory one-sided (it stays until they let go).
    holds: int = 0
    #: Bytes of one tensor.
    tensor_bytes: int = field(init=False)
    #: Batch rows (or blocks) of each tensor.
    num_rows: int = field(init=False)
    #: Bytes of one batch row (or one block) of each tensor.
    row_bytes: int = field(init=False)
    #: Where the memory lives.
    placement: Placement = field(init=False)
    #: The tensors' rows (or blocks) for native code.
    layout: BlockLayout = field(init=False)

    def __post_init__(self) -> None:
        self.tensor_bytes = self.desc.tensor_bytes
        self.num_rows = self.desc.batch_size
        self.row_bytes = self.tensor_bytes // self.num_rows if self.num_rows else 0
        self.placement = self.desc.placement
        self.layout = BlockLayout(self.addrs, self.row_bytes, self.num_rows)


class CacheRegistry:
    """Live caches by id, keys by identity, and the rules that free pool memory."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._unpinned = threading.Condition(self.lock)
        self._waiting = 0  # threads in wait_unpinned
        self._next_id = 1
        self._entries: dict[int, CacheEntry] = {}
        self._keys: dict[KeyIdentity, CacheEntry] = {}
        self._blocks_keys: dict[int, CacheEntry] = {}
        self._listeners: list[Callable[[], None]] = []

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (registry lock held) now and after every change of which
        caches are reachable."""
        with self.lock:
            self._listeners.append(listener)
            listener()

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    # -- lookup ---------------------------------------------------------------------------
    def get(self, cache_id: int) -> CacheEntry | None:
        """The live entry for ``cache_id`` (None when unknown or released)."""
        entry = self._entries.get(cache_id)
        return None if entry is None or entry.released else entry

    def entry_for_key(self, identity: KeyIdentity) -> tuple[CacheEntry, int] | None:
        """The entry and batch row bound to a key identity."""
        entry = self._keys.get(identity)
        return None if entry is None else (entry, entry.keys[identity])

    def entry_for_blocks_key(self, model_id: int) -> CacheEntry | None:
        """The blocks cache registered under ``model_id``."""
        return self._blocks_keys.get(model_id)

    def key_bound(self, identity: KeyIdentity) -> bool:
        """True when a live cache holds ``identity``."""
        return identity in self._keys

    def blocks_key_bound(self, model_id: int) -> bool:
        """True when a live blocks cache is registered under ``model_id``."""
        return model_id in self._blocks_keys

    def entries(self) -> list[CacheEntry]:
        """Every entry still holding memory (released ones waiting for keys included)."""
        return list(self._entries.values())

    # -- changes --------------------------------------------------------------------------
    def next_id(self) -> int:
        """Reserve the next cache id (ids start at 1 after each init)."""
        cache_id = self._next_id
        self._next_id += 1
        return cache_id

    def add(
        self,
        entry: CacheEntry,
        keys: Iterable[tuple[KeyIdentity, int]] = (),
        blocks_key: BlocksCacheKey | None = None,
    ) -> None:
        """Insert ``entry`` and bind its keys; the caller checked that none is bound."""
        self._entries[entry.cache_id] = entry
        for identity, row in keys:
            entry.keys[identity] = row
            self._keys[identity] = entry
        if blocks_key is not None:
            entry.blocks_key = blocks_key
            self._blocks_keys[blocks_key.model_id] = entry
        self._changed()

    def drop_key(self, identity: KeyIdentity) -> bool:
        """Remove a key reference; frees the cache if it was the last one. False if unknown."""
        entry = self._keys.pop(identity, None)
        if entry is None:
            return False
        entry.keys.pop(identity, None)
        self._maybe_free(entry)
        return True

    def release(self, entry: CacheEntry) -> None:
        """Drop the id reference of a pool cache; memory goes back once keys and pins are gone."""
        if entry.released:
            return
        entry.released = True
        entry.cache._tensor_addrs = ()
        if entry.blocks_key is not None:
            self._blocks_keys.pop(entry.blocks_key.model_id, None)
        self._changed()
        self._maybe_free(entry)

    def remove(self, entry: CacheEntry) -> None:
        """Forget a registered cache and every key it holds (``unregister_cache``)."""
        for identity in list(entry.keys):
            self._keys.pop(identity, None)
        entry.keys.clear()
        self.release(entry)

    def pin(self, entries: Iterable[CacheEntry]) -> None:
        """Mark entries as in use by a copy, so their memory cannot be freed meanwhile."""
        for entry in entries:
            entry.pins += 1

    def unpin(self, entries: Iterable[CacheEntry]) -> None:
        """Undo :meth:`pin`; frees entries whose release was deferred by the copy."""
        with self.lock:
            for entry in entries:
                entry.pins -= 1
                self._maybe_free(entry)
            if self._waiting:
                self._unpinned.notify_all()

    def hold(self, entries: Iterable[CacheEntry]) -> None:
        """A peer may reach ``entries`` one-sided: their memory stays until it lets go (lock
        held)."""
        for entry in entries:
            entry.holds += 1

    def let_go(self, entries: Iterable[CacheEntry]) -> None:
        """Undo :meth:`hold`; frees entries whose release waited for the peer."""
        with self.lock:
            for entry in entries:
                entry.holds -= 1
                self._maybe_free(entry)
            if self._waiting:
                self._unpinned.notify_all()

    def wait_unpinned(self, entry: CacheEntry, timeout: float | None = None) -> bool:
        """Block until no copy uses ``entry`` and no peer may reach it; False if ``timeout``
        (seconds) ran out first."""
        return self._wait(lambda: entry.pins == 0 and entry.holds == 0, timeout)

    def wait_let_go(self, entry: CacheEntry, timeout: float | None = None) -> bool:
        """Block until no peer may reach ``entry``; False if ``timeout`` (seconds) ran out."""
        return self._wait(lambda: entry.holds == 0, timeout)

    def _wait(self, done: Callable[[], bool], timeout: float | None) -> bool:
        with self.lock:
            self._waiting += 1
            try:
                return self._unpinned.wait_for(done, timeout)
            finally:
                self._waiting -= 1

    def clear(self, free: Callable[[CacheEntry], None] | None = None) -> None:
        """Forget everything (finalize); ``free`` is called for each entry still holding memory."""
        with self.lock:
            for entry in self._entries.values():
                entry.cache._tensor_addrs = ()
                if free is not None:
                    free(entry)
            self._entries.clear()
            self._keys.clear()
            self._blocks_keys.clear()
            self._changed()

    def _maybe_free(self, entry: CacheEntry) -> None:
        if not entry.released or entry.keys or entry.pins or entry.holds:
            return
        if self._entries.pop(entry.cache_id, None) is None:
            return
        if entry.pool is not None and entry.allocation is not None:
            entry.pool.release(entry.allocation)
