"""A linked peer's UCX table as this side applied it: the endpoint to the peer's worker, its
unpacked remote keys, and the transfers started under each table (the requester's half of
the release protocol, ``_engine.ucxboard``).

A transfer takes a :class:`Snapshot` of the current table (:meth:`UcxRemote.begin`),
resolves and bounds-checks its access against it, moves its bytes through the snapshot's
keys and ends (:meth:`UcxRemote.end`). A new table from the peer (sequence ``N``) applies at
once: later transfers see only it. Its acknowledgement goes back once no transfer started
under an older table is in flight; only then may the peer free what ``N`` withdrew. Remote
keys that ``N`` dropped are destroyed at that point too, never under a transfer using them.

The endpoint is made in peer error-handling mode: a failed peer fails its requests, and
closing the endpoint by force cancels what is in flight (a transfer past its deadline). The
one exception is a peer on this host when UCX has a cross-memory transport (``cma``, ``knem``,
``xpmem``): those have no peer-failure handling, so the endpoint is made without it to let
them in. They read and write the peer's memory with no help from the peer, so nothing waits
for a stalled peer, and a dead one fails the request at once (the kernel refuses).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import structlog

from aio_datadist._engine.regions import BoardEntry, RemoteRegions
from aio_datadist._engine.ucxtable import KeySpans, UcxTable
from aio_datadist._transport.ucx import Endpoint, RemoteKey, Request, Requests, UcxWorker, rma
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ("CLOSE_S", "Snapshot", "UcxRemote")

#: Seconds closing the endpoint may take (its requests are cancelled, not waited for).
CLOSE_S = 5.0


@dataclass(frozen=True, slots=True, eq=False)
class Snapshot:
    """The peer's table as one transfer sees it, from start to end."""

    seq: int
    regions: RemoteRegions
    keys: tuple[RemoteKey, ...]
    spans: KeySpans


class UcxRemote:
    """What one peer offers over UCX (one link), and the endpoint that reaches it.

    ``host`` is this side's host identity (``ucxtable.host_identity``) and ``cross_memory``
    whether UCX has a cross-memory transport here; ``ack(seq)`` queues the acknowledgement of
    the peer's table ``seq`` (called with no lock held).
    """

    def __init__(
        self,
        worker: UcxWorker,
        host: bytes,
        ack: Callable[[int], None],
        log: structlog.stdlib.BoundLogger,
        *,
        cross_memory: bool = False,
    ) -> None:
        self._worker = worker
        self._host = host
        self._cross_memory = cross_memory
        self._ack = ack
        self._log = log
        self._lock = threading.Lock()
        self._ep: Endpoint | None = None
        self._table: UcxTable | None = None
        self._keys: tuple[RemoteKey, ...] = ()
        self._spans = KeySpans(())
        self._inflight: dict[int, int] = {}
        self._retired: list[tuple[int, RemoteKey]] = []
        self._applied = 0
        self._acked = 0
        #: Why the route is off for good (None while it may carry transfers).
        self.reason: str | None = None

    # -- state ----------------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        """True while transfers may start: a table applied, the endpoint open and sound."""
        ep = self._ep
        return self.reason is None and ep is not None and ep.failure is None

    @property
    def seq(self) -> int:
        """The sequence of the table applied last (0: none yet)."""
        return self._applied

    def transports(self) -> list[str]:
        """The ``tl/device`` of the endpoint's lanes (empty before the first table)."""
        ep = self._ep
        if ep is None or not self.usable:
            return []
        try:
            return ep.transports()
        except LLMException:
            return []

    # -- the peer's tables ----------------------------------------------------------------
    def apply(self, table: UcxTable) -> bool:
        """Apply the peer's ``table``; True the first time (the route may now be used).
        A table no newer than the applied one is ignored.

        :raises LLMException: the table cannot be used (the endpoint or a remote key cannot
            be made): the route is off for good, as :meth:`close` leaves it.
        """
        with self._lock:
            if self.reason is not None:
                return False
            current = self._table
            if current is not None and table.seq <= current.seq:
                return False
            first = self._ep is None
            failed: LLMException | None = None
            due = 0
            try:
                if first:
                    same_host = bool(self._host) and table.host == self._host
                    self._ep = Endpoint(
                        self._worker,
                        table.address,
                        peer_errors=not (same_host and self._cross_memory),
                        name="aio-dd",
                    )
                self._unpack(table)
            except LLMException as exc:
                self.reason = f"the peer's UCX table cannot be used: {exc}"
                failed = exc
            else:
                self._table, self._spans = table, KeySpans(table.keys)
                self._applied = table.seq
                due = self._settle()
        if failed is not None:
            self._shut()
            raise failed
        if due:
            self._ack(due)
        return first

    def _unpack(self, table: UcxTable) -> None:
        """(Lock held.) The remote keys of ``table``: the applied table's where the peer sent
        the same registration, new ones unpacked; the rest retire at ``table.seq``."""
        ep = self._ep
        assert ep is not None
        old: dict[tuple[int, int, str, bytes], RemoteKey] = {}
        if self._table is not None:
            for key, rkey in zip(self._table.keys, self._keys, strict=True):
                old[(key.addr, key.nbytes, key.memory, key.rkey)] = rkey
        made: list[RemoteKey] = []
        try:
            for key in table.keys:
                same = old.pop((key.addr, key.nbytes, key.memory, key.rkey), None)
                made.append(
                    same if same is not None else RemoteKey(ep, key.rkey, key.addr, key.nbytes)
                )
        except LLMException:
            reused = set(map(id, self._keys))
            for made_key in made:
                if id(made_key) not in reused:
                    made_key.close()
            raise
        self._retired += [(table.seq, rkey) for rkey in old.values()]
        self._keys = tuple(made)

    # -- transfers --------------------------------------------------------------------------
    def begin(self) -> Snapshot | None:
        """Start a transfer under the current table; None when the route cannot take it."""
        with self._lock:
            table = self._table
            if table is None or not self.usable:
                return None
            self._inflight[table.seq] = self._inflight.get(table.seq, 0) + 1
            return Snapshot(table.seq, table.regions, self._keys, self._spans)

    def issue(
        self,
        snap: Snapshot,
        ops: npt.NDArray[np.uint64],
        key_of: npt.NDArray[np.intp],
        *,
        write: bool,
        local_memory: str,
    ) -> tuple[list[Request | Requests], LLMException | None]:
        """Start the gets (puts with ``write``) of ``ops`` (``(local, remote, nbytes)``) through
        the snapshot's keys, and for a push a flush after them: see ``ucx.rma``.

        :raises LLMException: ``LLM_LINK_FAILED`` once the route closed; the bounds check's
            ``LLM_PARAM_INVALID`` (nothing started).
        """
        with self._lock:
            ep = self._ep
            if self.reason is not None or ep is None:
                raise LLMException(
                    f"the UCX route to the peer closed: {self.reason}",
                    status_code=LLMStatusCode.LLM_LINK_FAILED,
                )
            requests, failure = rma(
                ep, ops, snap.keys, key_of, write=write, local_memory=local_memory
            )
            started: list[Request | Requests] = [requests]
            if write and failure is None:
                try:
                    started.append(ep.flush_request())
                except LLMException as exc:
                    failure = exc
        return started, failure

    def end(self, snap: Snapshot) -> None:
        """A transfer started with ``snap`` is over (its requests complete)."""
        with self._lock:
            left = self._inflight[snap.seq] - 1
            if left:
                self._inflight[snap.seq] = left
            else:
                del self._inflight[snap.seq]
            due = self._settle()
        if due:
            self._ack(due)

    def still_there(self, snap: Snapshot, entries: list[BoardEntry]) -> bool:
        """True when the peer still publishes ``entries`` as they were in ``snap``."""
        with self._lock:
            table = self._table
        if table is None:
            return False
        if table.seq == snap.seq:
            return True
        return all(table.regions.by_id.get(e.cache_id) == e for e in entries)

    def _settle(self) -> int:
        """(Lock held.) Destroy retired keys no transfer may use, and return the sequence to
        acknowledge now (0: none): the applied one, once no older transfer is in flight."""
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
            ep, self._ep = self._ep, None
            keys, self._keys = self._keys, ()
            retired, self._retired = self._retired, []
        if ep is not None:
            try:
                ep.close(time.monotonic_ns() + int(CLOSE_S * 1e9), force=True)
            except LLMException as exc:
                self._log.info("ucx.endpoint_close_failed", reason=str(exc))
        for rkey in keys:
            rkey.close()
        for _, rkey in retired:
            rkey.close()
