"""The serving side of transfers: a peer's request resolved into this engine's memory rows.

Every request is checked before memory is touched: the named cache must exist here, every
tensor, row, block, offset and size must lie inside it, raw addresses must lie inside memory
this engine allocated or registered, and the rows must add up to the size the requester
expects. A violation refuses that request (``LLM_PARAM_INVALID`` or
``LLM_KV_CACHE_NOT_EXIST``) and leaves the link usable. Memory being served is pinned, so a
cache released meanwhile keeps its memory until the transfer ends. Device memory under an
accelerator runtime is served through pinned host buffers (:mod:`aio_datadist._memory.staging`):
read out before a pull's bytes leave, and written to the device before a push is answered.
A request from a member of a rank-table domain that names its own rows
(:mod:`aio_datadist._routes.hccl.domain`) is moved through the domain's communicator instead,
before it is answered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from aio_datadist._engine.access import NO_ROWS, Access, Target, access_rows, decode_access
from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.registry import CacheEntry, KeyIdentity
from aio_datadist._log import get_logger
from aio_datadist._memory.staging import Mask, Staged, Streamed
from aio_datadist._native.serve import ServeTable
from aio_datadist._routes.hccl.domain import CommRoutes, deliver
from aio_datadist._transport import WireError, after_s
from aio_datadist._transport.base import Hello, Iov, RequestKind, Served
from aio_datadist.status import (
    FeatureNotEnabledError,
    KvCacheNotExistError,
    LLMStatusCode,
    ParamInvalidError,
)

__all__ = ("ControlPlane", "ControlServer", "Server")


class ControlServer(Protocol):
    """Serves the requests of a route provider's control plane (``_routes.provider``)."""

    def serve(self, hello: Hello, kind: RequestKind, access: Access, nbytes: int) -> Served:
        """Resolve one request of the provider's own from ``hello``'s link."""
        ...


#: Who serves each control target: its provider, or (where it is off) the setting that
#: would enable it.
ControlPlane = dict[Target, "ControlServer | str"]
#: How long a change of the served caches waits for native answers still reading a cache
#: that left (each is bounded by the link's stall timeout).
_UNPIN_WAIT_S = 60.0


def _invalid(message: str) -> ParamInvalidError:
    return ParamInvalidError(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _not_exist(message: str) -> KvCacheNotExistError:
    return KvCacheNotExistError(message, status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


def _nothing(ok: bool) -> None:
    """``Served.done`` of an answer whose bytes already moved."""


def _check_size(access: Access, nbytes: int) -> None:
    total = access.nbytes
    if total != nbytes:
        raise _invalid(f"the request moves {nbytes} bytes but names {total} bytes of cache here")


class Server:
    """Serves the peers' pulls and pushes from one engine's caches (a ``RequestHandler``).

    Its :attr:`serve_table` lists the blocks caches whose small pulls and pushes a stream
    transport may answer in native code straight from its reader thread; every request that
    path leaves (anything else, and every refusal) comes to :meth:`serve`.
    """

    def __init__(
        self,
        caches: CacheService,
        routes: CommRoutes | None = None,
        control: ControlPlane | None = None,
    ) -> None:
        self._caches = caches
        self._routes: CommRoutes = {} if routes is None else routes
        self._control: ControlPlane = {} if control is None else control
        self._log = get_logger("serve")
        self.serve_table = ServeTable()
        caches.registry.add_listener(self._publish)

    def _publish(self) -> None:
        """List the host-memory blocks caches peers may read and write (registry lock held);
        returns once no native answer still uses a cache that left the list."""
        caches = self._caches
        listed = [
            (e.blocks_key.model_id, e.addrs, e.row_bytes, e.num_rows)
            for e in caches.registry.entries()
            if e.blocks_key is not None
            and not e.released
            and e.remote_accessible
            and 0 <= e.blocks_key.model_id < 1 << 64
            and e.addrs
            and all(e.addrs)
            and e.row_bytes > 0
            and e.num_rows > 0
            and not caches.on_device(e)
        ]
        if not self.serve_table.set(listed, after_s(_UNPIN_WAIT_S)):
            self._log.warning("serve_table.still_pinned", waited_s=_UNPIN_WAIT_S)

    def serve(
        self, peer: Hello, kind: RequestKind, body: bytes, nbytes: int, *, stream: bool = False
    ) -> Served:
        """Resolve a request into memory rows, pinning what they touch.

        Device rows that need staging are staged whole, or with ``stream`` handed out as
        pinned chunks while the transport moves them (``Served.stream``).
        """
        try:
            access = decode_access(body)
        except WireError as exc:
            raise _invalid(f"malformed request from cluster {peer.cluster_id}: {exc}") from None
        control = self._control.get(access.target)
        if control is not None:  # a route provider's control plane, not memory
            if isinstance(control, str):
                raise FeatureNotEnabledError(
                    f"cluster {peer.cluster_id} sent a {access.target.name}, but this "
                    f"engine does not enable its route ({control})",
                    status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                )
            return control.serve(peer, kind, access, nbytes)
        may_drop = kind is RequestKind.PULL and access.target is Target.REQ_KEY
        if access.drop_key and not may_drop:
            # Only a pull by req key may drop its key; honouring the flag elsewhere would let
            # a request by index or address drop an unrelated req key of the same cache.
            raise _invalid(f"a {kind.value} by {access.target.name} cannot drop a cache key")
        caches = self._caches
        caches.check_open()
        registry = caches.registry
        commit: Callable[[], None] | None = None
        on_device: Mask | bool
        delivered = len(access.deliver) > 0
        if delivered:
            if nbytes:
                raise _invalid("a request that names the requester's rows carries no payload")
            nbytes = int(access.deliver[:, 1].sum())
        with registry.lock:
            if access.target is Target.ADDRESSES:
                entries, iov, on_device = self._address_rows(access)
                _check_size(access, nbytes)
            else:
                entry, row = self._resolve(access)
                entries = [entry]
                # The size first: a request whose sizes cannot match costs no row table.
                _check_size(access, nbytes)
                iov = access_rows(entry.addrs, entry.row_bytes, entry.num_rows, access, row)
                on_device = caches.on_device(entry)
            if access.drop_key and not entries[0].registered:
                commit = self._dropper(("req", access.ident, access.model_id), entries[0])
            registry.pin(entries)
        if delivered:
            return self._deliver(peer, kind, access, iov, entries, commit)
        staged: Staged | None = None
        streamed: Streamed | None = None
        mask = None if on_device is True or on_device is False else on_device
        if on_device is not False and stream:
            streamed = caches.staging.stream(iov, mask, outbound=kind is RequestKind.PULL)
        elif on_device is not False:
            try:
                if kind is RequestKind.PULL:
                    staged = caches.staging.outbound(iov, mask)
                else:
                    staged = caches.staging.inbound(iov, mask)
            except BaseException:
                registry.unpin(entries)
                raise
            iov = staged.iov

        def done(ok: bool) -> None:
            try:
                if staged is not None:
                    staged.finish(ok)
            finally:
                registry.unpin(entries)

        return Served(iov, nbytes, done, commit, streamed)

    def _deliver(
        self,
        peer: Hello,
        kind: RequestKind,
        access: Access,
        iov: Iov,
        entries: list[CacheEntry],
        commit: Callable[[], None] | None,
    ) -> Served:
        """Move the pinned rows ``iov`` to or from the requester's own rows through the
        domain's communicator; the answer then carries no payload."""
        registry = self._caches.registry
        try:
            route = self._routes.get(peer.cluster_id)
            if route is None:
                raise _invalid(
                    f"cluster {peer.cluster_id} named its own memory but shares no "
                    "communication domain with this engine"
                )
            deliver(route, kind, iov, access.deliver)
        finally:
            registry.unpin(entries)
        return Served(NO_ROWS, 0, _nothing, commit)

    def _resolve(self, access: Access) -> tuple[CacheEntry, int]:
        """The cache a request names and its batch row; a cache registered with
        ``remote_accessible=False`` is not there for peers."""
        entry, row = self._lookup(access)
        if not entry.remote_accessible:
            raise _not_exist(f"cache {entry.cache_id} is not remote accessible")
        return entry, row

    def _lookup(self, access: Access) -> tuple[CacheEntry, int]:
        registry = self._caches.registry
        target = access.target
        if target in (Target.REQ_KEY, Target.PREFIX_KEY):
            kind = "req" if target is Target.REQ_KEY else "prefix"
            found = registry.entry_for_key((kind, access.ident, access.model_id))
            if found is None:
                raise _not_exist(
                    f"no cache holds the key {kind}_id={access.ident} model_id={access.model_id}"
                )
            return found
        if target is Target.CACHE_INDEX:
            entry = registry.get(access.ident)
            if entry is None:
                raise _not_exist(f"cache {access.ident} does not exist")
            return entry, access.row
        entry = registry.entry_for_blocks_key(access.ident)
        if entry is None:
            raise _not_exist(f"no blocks cache is registered under model_id={access.ident}")
        return entry, 0

    def _address_rows(self, access: Access) -> tuple[list[CacheEntry], Iov, Mask | bool]:
        """The rows of an address request, the entries they touch, and which rows lie in
        device memory that needs staging (a mask, or one bool for all rows)."""
        rows = access.rows
        if not len(rows):
            raise _invalid("the request names no memory")
        spans = [
            (addr, addr + entry.tensor_bytes, entry)
            for entry in self._caches.registry.entries()
            if entry.remote_accessible
            for addr in entry.addrs
        ]
        spans.sort(key=lambda span: span[0])
        starts = np.asarray([s for s, _, _ in spans], dtype=np.uint64)
        ends = np.asarray([e for _, e, _ in spans], dtype=np.uint64)
        idx = np.searchsorted(starts, rows[:, 0], side="right").astype(np.int64) - 1
        inside = idx >= 0
        if len(spans):
            safe = np.maximum(idx, 0)
            inside &= rows[:, 0] + rows[:, 1] <= ends[safe]
            inside &= rows[:, 0] + rows[:, 1] >= rows[:, 0]
        if not bool(inside.all()):
            bad = int(np.flatnonzero(~inside)[0])
            raise _invalid(
                f"address {int(rows[bad, 0]):#x} (+{int(rows[bad, 1])} bytes) is not inside "
                "memory allocated or registered here for remote access"
            )
        touched = [spans[i][2] for i in idx.tolist()]
        entries = list({id(entry): entry for entry in touched}.values())
        device = [self._caches.on_device(entry) for entry in entries]
        on_device: Mask | bool = device[0]
        if any(device) and not all(device):
            on_device = np.fromiter((self._caches.on_device(e) for e in touched), np.bool_)
        return entries, np.ascontiguousarray(rows), on_device

    def _dropper(self, identity: KeyIdentity, entry: CacheEntry) -> Callable[[], None]:
        registry = self._caches.registry

        def commit() -> None:
            with registry.lock:
                found = registry.entry_for_key(identity)
                if found is not None and found[0] is entry:
                    registry.drop_key(identity)

        return commit
