"""This engine's UCX table, and the release protocol that keeps its UCX peers off freed memory.

The board registers the memory peers may reach (each pool's arena once, at ``init``; each
tensor of a registered cache when the cache is published) and keeps the table of published
caches (``_routes.ucx.table``) current from the registry: every change of the published set
makes a new table with a higher sequence number, pushed to every UCX peer (a
:class:`Subscriber`, one per link).

Release protocol. A peer reads and writes a published cache one-sided, so the board must not
let a cache's memory go while a peer may still touch it:

* each subscriber *holds* (``CacheRegistry.hold``) every cache of the tables it was sent;
* a cache that leaves the table (``deallocate_*``, ``unregister_cache``) is withdrawn in the
  next table, sequence ``N``; every subscriber that held it keeps holding it until it
  acknowledges a table ``>= N``. A peer acknowledges ``N`` once it applied that table and no
  transfer it started under an older table is still in flight (``_routes.ucx.remote``); a
  transfer whose caches changed under it fails with ``LLM_KV_CACHE_NOT_EXIST``;
* once no subscriber holds it, the cache's own registrations are unmapped and the holds go:
  pool memory returns to its pool only then, and ``deallocate_*`` and ``unregister_cache``
  (which wait for the holds, ``CacheRegistry.wait_let_go``) return only then;
* a subscriber that does not acknowledge within :data:`ACK_TIMEOUT_S` is overdue
  (:meth:`UcxBoard.overdue`): the engine breaks its link (logged) and the release goes on.
  So does a subscriber whose link closed.

Everything here runs under the registry's lock, which the listener already holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.regions import BoardEntry
from aio_datadist._engine.registry import CacheEntry
from aio_datadist._routes.ucx.table import UcxKey, encode_table
from aio_datadist._routes.ucx.worker import Registration, UcxContext
from aio_datadist._transport import WireError
from aio_datadist.enums import Placement
from aio_datadist.status import LLMException

__all__ = ("ACK_TIMEOUT_S", "Subscriber", "UcxBoard")

#: Seconds a UCX peer has to acknowledge a table that withdrew caches it held.
ACK_TIMEOUT_S = 10.0


@dataclass(eq=False)
class Subscriber:
    """One UCX peer of the board (one link): the caches it holds, and the releases waiting
    for its acknowledgement."""

    #: Who it is, for logs.
    name: str
    #: Called (registry lock held) once a newer table is there for it: queue its push.
    notify: Callable[[], None]
    #: Caches of the tables it was sent, by cache id (each held once for it).
    held: dict[int, CacheEntry] = field(default_factory=dict)
    #: ``(sequence, since_ns, caches)``: caches withdrawn in that table, still held for it
    #: until it acknowledges the sequence.
    releasing: list[tuple[int, int, list[CacheEntry]]] = field(default_factory=list)
    #: The highest sequence it acknowledged.
    acked: int = 0

    def holds(self, entry: CacheEntry) -> bool:
        """True while the peer may still reach ``entry``."""
        return self.held.get(entry.cache_id) is entry or any(
            entry in entries for _, _, entries in self.releasing
        )


class UcxBoard:
    """The caches this engine offers over UCX, their registrations, and who holds them."""

    def __init__(
        self,
        context: UcxContext,
        caches: CacheService,
        address: bytes,
        host: bytes,
        log: structlog.stdlib.BoundLogger,
        *,
        cuda: bool,
    ) -> None:
        self._context = context
        self._caches = caches
        self._address = address
        self._host = host
        self._log = log
        #: Device caches are registered as CUDA memory (else they are not published). Turned
        #: off when UCX refuses the device pool as CUDA memory: whatever UCX can reach, this
        #: runtime's device memory is not memory it knows, so device rows are staged.
        self.cuda = cuda
        self._registry = caches.registry
        self._seq = 0
        self._table = b""
        self._closed = False
        self._published: dict[int, tuple[CacheEntry, BoardEntry]] = {}
        self._pools: list[tuple[Registration, UcxKey]] = []
        self._own: dict[int, list[tuple[Registration, UcxKey]]] = {}
        self._unreachable: set[int] = set()  # caches that could not be registered (logged)
        self._withdrawn: dict[int, CacheEntry] = {}  # registrations wait for the last holder
        self._subs: list[Subscriber] = []
        for pool in caches.pools.values():
            memory = self._memory(pool.placement)
            if memory is None:
                continue
            try:
                reg = Registration(context, pool.arena.addr, pool.arena.nbytes, memory=memory)
            except LLMException as exc:
                log.warning("ucx.pool_unregistered", placement=str(pool.placement), reason=str(exc))
                if memory == "cuda":
                    self.cuda = False
                continue
            self._pools.append((reg, UcxKey(reg.addr, reg.nbytes, memory, reg.rkey)))
        self._registry.add_listener(self._changed)

    def _memory(self, placement: Placement) -> str | None:
        """The UCX memory type of memory at ``placement``; None when UCX cannot reach it."""
        if placement is Placement.DEVICE and self._caches.staging.needed:
            return "cuda" if self.cuda else None
        return "host"

    # -- the table --------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        """The current table's sequence number."""
        return self._seq

    def table(self) -> tuple[int, bytes]:
        """The current table: its sequence and its bytes."""
        with self._registry.lock:
            return self._seq, self._table

    def published(self) -> list[int]:
        """The ids of the caches the current table publishes."""
        with self._registry.lock:
            return list(self._published)

    def _reachable(self, entry: CacheEntry) -> list[UcxKey] | None:
        """The keys of ``entry``'s own registrations (empty for pool memory, which the pool's
        registration holds); None when UCX cannot reach it."""
        if entry.cache_id in self._unreachable:
            return None
        memory = self._memory(entry.placement)
        if memory is None or not entry.addrs:
            return None
        if not entry.registered:
            pool = entry.pool
            held = pool is not None and any(reg.addr == pool.arena.addr for reg, _ in self._pools)
            return [] if held else None
        own = self._own.get(entry.cache_id)
        if own is None:
            own = []
            try:
                for addr in entry.addrs:
                    reg = Registration(self._context, addr, entry.tensor_bytes, memory=memory)
                    own.append((reg, UcxKey(reg.addr, reg.nbytes, memory, reg.rkey)))
            except LLMException as exc:
                for reg, _ in own:
                    reg.close()
                self._unreachable.add(entry.cache_id)
                self._log.warning(
                    "ucx.cache_unregistered", cache_id=entry.cache_id, reason=str(exc)
                )
                return None
            self._own[entry.cache_id] = own
        return [key for _, key in own]

    def _changed(self) -> None:
        """The registry changed (its lock held): publish a new table when the published set
        changed, withdrawing the caches that left it."""
        if self._closed:
            return
        published: dict[int, tuple[CacheEntry, BoardEntry]] = {}
        keys = [key for _, key in self._pools]
        for e in self._registry.entries():
            if e.released or not e.remote_accessible:
                continue
            own = self._reachable(e)
            if own is None:
                continue
            keys += own
            model_id = e.blocks_key.model_id if e.blocks_key is not None else -1
            board = BoardEntry(
                e.cache_id, model_id, e.row_bytes, e.num_rows, e.tensor_bytes, e.addrs
            )
            published[e.cache_id] = (e, board)
        if self._table and published == self._published:
            return
        added = [e for cid, (e, _) in published.items() if cid not in self._published]
        removed = [e for cid, (e, _) in self._published.items() if cid not in published]
        self._seq += 1
        try:
            self._table = encode_table(
                self._seq, self._address, self._host, keys, (b for _, b in published.values())
            )
        except WireError as exc:  # too many caches for one table: peers use the link
            self._log.warning("ucx.table_too_large", reason=str(exc), fallback="link")
            published = {}
            added = []
            removed = [e for e, _ in self._published.values()]
            self._table = encode_table(self._seq, self._address, self._host, keys[:0], ())
        self._published = published
        now = time.monotonic_ns()
        for e in removed:
            self._withdrawn[e.cache_id] = e
        for sub in self._subs:
            gone = [e for e in removed if sub.held.pop(e.cache_id, None) is e]
            if gone:
                sub.releasing.append((self._seq, now, gone))
            for e in added:
                sub.held[e.cache_id] = e
            self._registry.hold(added)
            sub.notify()
        self._reap()

    # -- subscribers --------------------------------------------------------------------------
    def subscribe(self, sub: Subscriber) -> None:
        """Add a peer: it holds every published cache from now on, and is sent the table."""
        with self._registry.lock:
            if self._closed:
                return
            entries = [e for e, _ in self._published.values()]
            for e in entries:
                sub.held[e.cache_id] = e
            self._registry.hold(entries)
            self._subs.append(sub)
            sub.notify()

    def acked(self, sub: Subscriber, seq: int) -> None:
        """``sub`` acknowledged table ``seq``: what it held until then goes."""
        with self._registry.lock:
            if seq <= sub.acked or sub not in self._subs:
                return
            sub.acked = seq
            done = [entries for s, _, entries in sub.releasing if s <= seq]
            sub.releasing = [item for item in sub.releasing if item[0] > seq]
            self._release([e for entries in done for e in entries])

    def unsubscribe(self, sub: Subscriber) -> None:
        """Drop a peer (its link went, or it was overdue): what it held goes."""
        with self._registry.lock:
            if sub not in self._subs:
                return
            self._subs.remove(sub)
            entries = list(sub.held.values())
            entries += [e for _, _, gone in sub.releasing for e in gone]
            sub.held.clear()
            sub.releasing.clear()
            self._release(entries)

    def overdue(self, now_ns: int, timeout_s: float = ACK_TIMEOUT_S) -> list[Subscriber]:
        """The subscribers whose oldest release waited longer than ``timeout_s``."""
        limit = now_ns - int(timeout_s * 1e9)
        with self._registry.lock:
            return [s for s in self._subs if s.releasing and s.releasing[0][1] <= limit]

    def next_deadline(self, timeout_s: float = ACK_TIMEOUT_S) -> int | None:
        """When the first subscriber becomes overdue (``time.monotonic_ns()``); None when no
        release waits."""
        with self._registry.lock:
            starts = [s.releasing[0][1] for s in self._subs if s.releasing]
        return min(starts) + int(timeout_s * 1e9) if starts else None

    def _release(self, entries: list[CacheEntry]) -> None:
        """(Lock held.) One subscriber let go of ``entries``: unmap the registrations of
        withdrawn ones nobody holds any more, then drop its holds."""
        self._reap()
        if entries:
            self._registry.let_go(entries)

    def _reap(self) -> None:
        """(Lock held.) Unmap the registrations of withdrawn caches nobody holds."""
        for cid, entry in list(self._withdrawn.items()):
            if any(sub.holds(entry) for sub in self._subs):
                continue
            del self._withdrawn[cid]
            self._unreachable.discard(cid)
            for reg, _ in self._own.pop(cid, []):
                self._unmap(reg)

    def _unmap(self, reg: Registration) -> None:
        try:
            reg.close()
        except LLMException as exc:
            self._log.warning("ucx.unmap_failed", addr=reg.addr, reason=str(exc))

    def close(self) -> None:
        """Drop every subscriber and unmap every registration (finalize, before the pools go)."""
        with self._registry.lock:
            if self._closed:
                return
            for sub in list(self._subs):
                self.unsubscribe(sub)
            self._closed = True
            self._published.clear()
            self._withdrawn.clear()
            own, self._own = self._own, {}
            pools, self._pools = self._pools, []
        for regs in own.values():
            for reg, _ in regs:
                self._unmap(reg)
        for reg, _ in pools:
            self._unmap(reg)
