"""A linked peer's UCX table as this side applied it: the endpoint to the peer's worker, its
unpacked remote keys, and the transfers started under each table (the requester's half of
the release protocol, ``_routes.ucx.board``).

A transfer starts under the current table (:meth:`UcxRemote.start`): it resolves and
bounds-checks its access against it and starts its bytes through the table's keys, all
under the lock a new table is applied under. One that completed in that call is over; one
still in flight holds a :class:`Snapshot` of the table until it ends (:meth:`UcxRemote.end`).
A new table from the peer (sequence ``N``) applies at once: later transfers see only it.
Its acknowledgement goes back once no transfer started under an older table is in flight;
only then may the peer free what ``N`` withdrew. Remote keys that ``N`` dropped are
destroyed at that point too, never under a transfer using them.

With lanes (``_routes.ucx.lanes``) there is one endpoint per lane, each lane's worker to the
peer's worker, and the table's remote keys are unpacked on each: a transfer large enough is
cut into parts, one per lane, each started on its lane's endpoint through its lane's keys.

The endpoint is made in peer error-handling mode: a failed peer fails its requests, and
closing the endpoint by force cancels what is in flight (a transfer past its deadline). The
one exception is a peer on this host when UCX has a cross-memory transport (``cma``, ``knem``,
``xpmem``): those have no peer-failure handling, so the endpoint is made without it to let
them in. They read and write the peer's memory with no help from the peer, so nothing waits
for a stalled peer, and a dead one fails the request at once (the kernel refuses).
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import structlog

from aio_datadist._engine.regions import BoardEntry, RemoteRegions
from aio_datadist._engine.request import Transfer
from aio_datadist._native.api import BlockPairs, PairsRefused
from aio_datadist._routes.ucx.lanes import CROSS_MEMORY, LANE_MIN_BYTES, UcxLane
from aio_datadist._routes.ucx.table import UcxTable
from aio_datadist._routes.ucx.worker import (
    Endpoint,
    RemoteKey,
    RemoteKeys,
    Requests,
    UcxWorker,
    rma,
)
from aio_datadist._transport.base import Iov
from aio_datadist.status import LLMException

__all__ = ("CLOSE_S", "Find", "Snapshot", "Started", "UcxRemote")

#: An endpoint's failure status (None while it is sound).
_FAILURE = operator.attrgetter("failure")

#: Seconds closing the endpoint may take (its requests are cancelled, not waited for).
CLOSE_S = 5.0


class Snapshot(NamedTuple):
    """The peer's table as one transfer sees it, from start to end."""

    seq: int
    regions: RemoteRegions
    #: The table's remote keys as unpacked on each lane's endpoint (the engine's worker first).
    keys: tuple[RemoteKeys, ...]


#: What a transfer reaches in the peer's table (:meth:`UcxRemote.start`): given the table's
#: regions, the transfer, the local rows it moves (None: its own) and whether its block pairs
#: were refused, the entries and the ops; None when the table does not show it.
Find = Callable[
    [RemoteRegions, Transfer, Iov | None, bool],
    tuple[list[BoardEntry], npt.NDArray[np.uint64] | BlockPairs] | None,
]
#: A transfer started (:meth:`UcxRemote.start`): the snapshot it ends with (None: it ended in
#: the call), the peer's entries it reaches, the requests in flight, the failure so far.
Started = tuple[Snapshot | None, list[BoardEntry], list[Requests], LLMException | None]


class UcxRemote:
    """What one peer offers over UCX (one link), and the endpoint that reaches it.

    ``host`` is this side's host identity (``ucxtable.host_identity``) and ``cross_memory``
    whether UCX has a cross-memory transport here; ``ack(seq)`` queues the acknowledgement of
    the peer's table ``seq`` (called with no lock held); ``lanes`` the engine's lanes beside
    its own ``worker``.
    """

    def __init__(
        self,
        worker: UcxWorker,
        host: bytes,
        ack: Callable[[int], None],
        log: structlog.stdlib.BoundLogger,
        *,
        cross_memory: bool = False,
        lanes: Sequence[UcxLane] = (),
    ) -> None:
        self._worker = worker
        self._lanes = tuple(lanes)
        #: The thread progressing each lane's worker (None for the engine's own worker).
        self._threads = (None, *(lane.thread for lane in self._lanes))
        self._host = host
        self._cross_memory = cross_memory
        self._ack = ack
        self._log = log
        self._lock = threading.Lock()
        #: One endpoint per lane, the engine's worker's first (empty before the first table).
        self._eps: tuple[Endpoint, ...] = ()
        #: Whether large transfers are cut across the lanes (None: not known yet).
        self._cut: bool | None = None
        self._table: UcxTable | None = None
        self._keys: tuple[RemoteKeys, ...] = ()
        self._inflight: dict[int, int] = {}
        self._retired: list[tuple[int, RemoteKey]] = []
        self._applied = 0
        self._acked = 0
        #: Why the route is off for good (None while it may carry transfers).
        self.reason: str | None = None

    # -- state ----------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        """True while transfers may start: a table applied, the endpoints open and sound."""
        eps = self._eps
        return self.reason is None and bool(eps) and not any(map(_FAILURE, eps))

    @property
    def seq(self) -> int:
        """The sequence of the table applied last (0: none yet)."""
        return self._applied

    def transports(self) -> list[str]:
        """The ``tl/device`` of the endpoint's lanes (empty before the first table)."""
        eps = self._eps
        if not eps or not self.usable:
            return []
        try:
            return eps[0].transports()
        except LLMException:
            return []

    # -- the peer's tables ----------------------------------------------------------------
    def apply(self, table: UcxTable) -> bool:
        """Apply the peer's ``table``; True the first time (the route may now be used).
        A table no newer than the applied one is ignored. Once the route is off for good
        nothing reads through a table again: a newer one is acknowledged as soon as the
        transfers started under older ones ended, so that the peer may free what it withdrew.

        :raises LLMException: the table cannot be used (the endpoint or a remote key cannot
            be made): the route is off for good, as :meth:`close` leaves it.
        """
        first = False
        failed: LLMException | None = None
        due = 0
        with self._lock:
            if self.reason is not None:  # off for good: acknowledge, apply nothing
                if table.seq > self._applied:
                    self._applied = table.seq
                    due = self._settle()
            elif self._table is not None and table.seq <= self._table.seq:
                return False
            else:
                first = not self._eps
                try:
                    if first:
                        self._connect(table)
                    self._unpack(table)
                except LLMException as exc:
                    self.reason = f"the peer's UCX table cannot be used: {exc}"
                    failed = exc
                else:
                    self._table = table
                    self._applied = table.seq
                    due = self._settle()
        if failed is not None:
            self._shut()
            raise failed
        if due:
            self._ack(due)
        return first

    def _connect(self, table: UcxTable) -> None:
        """(Lock held.) One endpoint per lane to the worker of the peer's first ``table``."""
        same_host = bool(self._host) and table.host == self._host
        for worker in (self._worker, *(lane.worker for lane in self._lanes)):
            ep = Endpoint(
                worker,
                table.address,
                peer_errors=not (same_host and self._cross_memory),
                name="aio-dd",
            )
            self._eps = (*self._eps, ep)

    def _unpack(self, table: UcxTable) -> None:
        """(Lock held.) The remote keys of ``table`` on each lane's endpoint: the applied
        table's where the peer sent the same registration, new ones unpacked; the rest retire
        at ``table.seq``."""
        applied = self._table.keys if self._table is not None else ()
        olds: list[dict[tuple[int, int, str, bytes], RemoteKey]] = [
            {
                (key.addr, key.nbytes, key.memory, key.rkey): rkey
                for key, rkey in zip(applied, lane_keys.keys, strict=True)
            }
            for lane_keys in self._keys
        ]
        made: list[list[RemoteKey]] = []
        try:
            for lane, ep in enumerate(self._eps):
                old = olds[lane] if lane < len(olds) else {}
                row: list[RemoteKey] = []
                made.append(row)
                for key in table.keys:
                    same = old.pop((key.addr, key.nbytes, key.memory, key.rkey), None)
                    row.append(
                        same if same is not None else RemoteKey(ep, key.rkey, key.addr, key.nbytes)
                    )
        except LLMException:
            reused = {id(k) for lane_keys in self._keys for k in lane_keys.keys}
            for row in made:
                for made_key in row:
                    if id(made_key) not in reused:
                        made_key.close()
            raise
        self._retired += [(table.seq, rkey) for old in olds for rkey in old.values()]
        self._keys = tuple(RemoteKeys(ep, row) for ep, row in zip(self._eps, made, strict=True))

    # -- transfers --------------------------------------------------------------------------
    def start(
        self,
        find: Find,
        transfer: Transfer,
        local: Iov | None,
        *,
        write: bool,
        local_memory: str,
        nbytes: int,
        progress_ns: int,
    ) -> Started | None:
        """Start a transfer under the current table, then progress for up to ``progress_ns``
        (``ucx.rma``): ``find(regions, transfer, local, refused)`` names the peer's entries
        ``transfer`` reaches and its ops (``(local, remote, nbytes)`` between the rows
        ``local``, None: its own, and the peer's memory; ``nbytes`` in all; or block pairs),
        or None when the table does not show it; ``refused`` is True when it is asked again
        because the native call refused its block pairs
        (:class:`~aio_datadist._native.api.PairsRefused`).
        For a push (``write``) a flush follows the puts. Host transfers of
        :data:`~aio_datadist._routes.ucx.lanes.LANE_MIN_BYTES` or more are cut into one part
        per lane.

        None when the route cannot take the transfer (nothing started). Else the requests
        still in flight with the snapshot they end with (:meth:`end`), or, when every request
        completed in the call, an empty list and no snapshot: the table could not change
        meanwhile (it is applied under the same lock), so the transfer ended where it began.

        :raises LLMException: the bounds check's ``LLM_PARAM_INVALID`` (nothing started).
        """
        with self._lock:
            table, eps = self._table, self._eps
            if table is None or not self.usable:
                return None
            regions, keys = table.regions, self._keys
            refused = False
            while True:
                found = find(regions, transfer, local, refused)
                if found is None:
                    return None
                entries, ops = found
                parts = keys[:1]
                if (
                    len(eps) > 1
                    and local_memory == "host"
                    and nbytes >= LANE_MIN_BYTES
                    and self._cuts(eps[0])
                ):
                    parts = keys
                try:
                    requests, failure = rma(
                        ops,
                        parts,
                        write=write,
                        local_memory=local_memory,
                        flush=write,
                        lanes=self._threads,
                        progress_ns=progress_ns,
                    )
                except PairsRefused:  # (block pairs only) found again as the serving side would
                    refused = True
                    continue
                break
            if not requests:
                return None, entries, requests, failure
            seq = table.seq
            inflight = self._inflight
            inflight[seq] = inflight.get(seq, 0) + 1
            return Snapshot(seq, regions, keys), entries, requests, failure

    def _cuts(self, ep: Endpoint) -> bool:
        """(Lock held.) Whether a large host transfer is cut across the lanes: when ``ep``
        (the engine worker's endpoint) reaches the peer through a cross-memory transport
        (:data:`~aio_datadist._routes.ucx.lanes.CROSS_MEMORY`). Known once UCX chose the
        endpoint's transports; until then, not cut."""
        if self._cut is None:
            try:
                found = ep.transports()
            except LLMException:  # the endpoint failed: the transfer fails as it can
                return False
            if not found:
                return False
            self._cut = any(tl.split("/")[0] in CROSS_MEMORY for tl in found)
        return self._cut

    def end(self, snap: Snapshot, entries: list[BoardEntry]) -> bool:
        """A transfer started with ``snap`` is over (its requests complete): whether the
        peer still publishes ``entries`` (what it reached) as they were in ``snap``."""
        seq = snap.seq
        with self._lock:
            inflight = self._inflight
            left = inflight[seq] - 1
            if left:
                inflight[seq] = left
            else:
                del inflight[seq]
            due = self._settle()
            table = self._table  # (a table is replaced whole, never changed)
        if due:
            self._ack(due)
        if table is None:
            return False
        if table.seq == seq:
            return True
        return all(table.regions.by_id.get(e.cache_id) == e for e in entries)

    def _settle(self) -> int:
        """(Lock held.) Destroy retired keys no transfer may use, and return the sequence to
        acknowledge now (0: none): the applied one, once no older transfer is in flight."""
        if not self._retired and self._applied <= self._acked:
            return 0  # (nothing to destroy or acknowledge: the usual case)
        oldest = min(self._inflight, default=self._applied)
        if self._retired:
            keep = []
            for seq, rkey in self._retired:
                if seq <= oldest:
                    rkey.close()
                else:
                    keep.append((seq, rkey))
            self._retired = keep
        if self._applied > self._acked and oldest >= self._applied:
            self._acked = self._applied
            return self._applied
        return 0

    # -- closing ---------------------------------------------------------------------------
    def close(self, reason: str) -> None:
        """Turn the route off for good: close the endpoint by force (requests still in
        flight fail, and complete, at once) and destroy the remote keys."""
        with self._lock:
            if self.reason is None:
                self.reason = reason
        self._shut()

    def _shut(self) -> None:
        with self._lock:
            eps, self._eps = self._eps, ()
            self._cut = None
            keys, self._keys = self._keys, ()
            retired, self._retired = self._retired, []
        for ep in eps:
            try:
                ep.close(time.monotonic_ns() + int(CLOSE_S * 1e9), force=True)
            except LLMException as exc:
                self._log.info("ucx.endpoint_close_failed", reason=str(exc))
        for lane_keys in keys:
            for rkey in lane_keys.keys:
                rkey.close()
        for _, rkey in retired:
            rkey.close()
