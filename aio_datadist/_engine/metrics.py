"""Metrics per transfer: what every started request moved, by which route, how long it took
and how it ended, recorded in one place of the pipeline (``driver._begin``).

A :class:`TransferMetrics` belongs to one engine. Each transfer is recorded once, when it
ends: in the calling thread for a request completed there (a one-sided copy, an exchange),
else in the thread that completes its future. Recording only appends what ended to a queue
(no lock): the queue is folded into the figures below by whoever reads them, and by the
recording thread once :data:`FOLD_AT` transfers wait, :data:`FOLD_STEP` of them at a time,
so a transfer pays a few bytecodes right after its bytes moved (when the caches are cold),
the folding runs in warm loops, and no one transfer pays for folding hundreds (a fold of
256 was a 130-200 us call every 256 calls, the p99 of a steady loop of small calls). An
engine with ``LLMConfig.metrics = False`` has no recorder at all.

Kept per (route, op): counts by status, bytes of the transfers that succeeded, a latency
histogram with fixed bounds (:data:`BUCKETS_S`, for Prometheus) and the durations of the
last :data:`RECENT` transfers (for exact recent percentiles). Kept per peer cluster: counts,
failures and bytes. A failed transfer is also logged (``transfer.failed``) with what names
it on the peer (``req_id``, ``prefix_id``, ``cache_id`` or ``model_id``).
"""

from __future__ import annotations

import array
import bisect
import collections
import functools
import itertools
import operator
import threading
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import structlog

from aio_datadist._engine.access import Target
from aio_datadist._engine.request import Transfer
from aio_datadist._transport.base import RequestKind
from aio_datadist._transport.deadlines import now_ns
from aio_datadist.stats import BUCKETS_S, RECENT, PeerSnapshot, RouteSnapshot
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ("TransferMetrics",)

_BOUNDS_NS = tuple(int(b * 1e9) for b in BUCKETS_S)
#: Status codes whose failures are logged as warnings (the link or the peer failed); other
#: refusals (a missing cache, a bad argument) are logged at info.
_SERIOUS = frozenset(
    {LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_FAILED}
)


@dataclass(slots=True)
class _Series:
    by_status: dict[int, int] = field(default_factory=dict)
    nbytes: int = 0
    total_ns: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    #: The last :data:`RECENT` durations, a ring written at ``count % RECENT`` (C ints: no
    #: Python object kept per transfer, so recording allocates nothing that lives on).
    recent: array.array[int] = field(default_factory=lambda: array.array("q", bytes(8 * RECENT)))
    count: int = 0

    def durations(self) -> npt.NDArray[np.int64]:
        """A copy of the durations in the ring (in no particular order)."""
        return np.frombuffer(self.recent, dtype=np.int64, count=min(self.count, RECENT)).copy()


@dataclass(slots=True)
class _Peer:
    transfers: int = 0
    failed: int = 0
    nbytes: int = 0


_SUCCESS = int(LLMStatusCode.LLM_SUCCESS)
#: The recording thread folds the queue once this many ended transfers wait in it...
FOLD_AT = 256
#: ... this many at a time.
FOLD_STEP = 32
#: What the queue holds of an ended transfer: route, op, peer cluster, status, bytes moved,
#: nanoseconds taken.
_Ended = tuple[str, RequestKind, int, int, int, int]
_FAILED = int(LLMStatusCode.LLM_FAILED)


#: What groups the transfers of one fold: route, op, peer cluster.
_group_of = operator.itemgetter(0, 1, 2)
#: The histogram bucket of a duration in nanoseconds.
_bucket = functools.partial(bisect.bisect_left, _BOUNDS_NS)


def _ring_write(ring: array.array[int], written: int, values: tuple[int, ...]) -> None:
    """Write ``values`` on in ``ring`` after ``written`` earlier ones (at ``written %
    len(ring)``, wrapping); only the last ``len(ring)`` of them when there are more."""
    size = len(ring)
    kept = values[-size:]
    at = (written + len(values) - len(kept)) % size
    first = min(len(kept), size - at)
    ring[at : at + first] = array.array("q", kept[:first])
    if first < len(kept):
        ring[: len(kept) - first] = array.array("q", kept[first:])


def _by_route_op(item: tuple[tuple[str, RequestKind], _Series]) -> tuple[str, str]:
    route, kind = item[0]
    return route, kind.value


def _names(transfer: Transfer) -> dict[str, int]:
    """What names the transfer's memory on the peer, for the failure log."""
    remote = transfer.remote
    if remote is not None:
        return {"model_id": remote.model_id}
    access = transfer.access
    key = {
        Target.REQ_KEY: "req_id",
        Target.PREFIX_KEY: "prefix_id",
        Target.CACHE_INDEX: "cache_id",
        Target.BLOCKS_KEY: "model_id",
    }.get(access.target)
    return {} if key is None else {key: access.ident}


class TransferMetrics:
    """The transfer metrics of one engine (thread-safe)."""

    def __init__(self, log: structlog.stdlib.BoundLogger) -> None:
        self._log = log
        self._lock = threading.Lock()  # held while folding, and to read the figures
        self._ended: collections.deque[_Ended] = collections.deque()
        self._series: dict[tuple[str, RequestKind], _Series] = {}
        self._peers: dict[int, _Peer] = {}

    def record(
        self, route: str, transfer: Transfer, started_ns: int, failure: BaseException | None
    ) -> None:
        """One transfer on ``route`` ended (``failure``: why, or None when it succeeded)."""
        took = now_ns() - started_ns
        ended = self._ended
        if failure is None:
            ended.append(
                (route, transfer.kind, transfer.cluster_id, _SUCCESS, transfer.nbytes, took)
            )
            if len(ended) >= FOLD_AT:
                self._fold(FOLD_STEP)
            return
        status = int(failure.status_code) if isinstance(failure, LLMException) else _FAILED
        ended.append((route, transfer.kind, transfer.cluster_id, status, 0, took))
        self._log_failure(route, transfer, LLMStatusCode(status), took, failure)

    def _fold(self, most: int | None = None) -> None:
        """Fold the transfers recorded so far (the ``most`` oldest of them) into the series
        and peers; those recorded meanwhile wait for the next fold. The work per transfer
        runs in C (``zip``, ``sum``, ``Counter``): Python loops over the groups of one
        route, op and peer, usually one."""
        ended = self._ended
        with self._lock:
            count = len(ended) if most is None else min(most, len(ended))
            if not count:
                return
            popleft = ended.popleft
            rows = [popleft() for _ in itertools.repeat(None, count)]
            keys = set(map(_group_of, rows))
            if len(keys) == 1:
                groups = {keys.pop(): rows}
            else:
                groups = {}
                for row in rows:
                    groups.setdefault(_group_of(row), []).append(row)
            for (route, kind, cluster_id), group in groups.items():
                self._fold_group(route, kind, cluster_id, group)

    def _fold_group(
        self, route: str, kind: RequestKind, cluster_id: int, group: list[_Ended]
    ) -> None:
        """(Lock held.) Fold ``group``, transfers of one route, op and peer."""
        _, _, _, statuses, sizes, tooks = zip(*group, strict=True)
        n, nbytes = len(group), sum(sizes)
        series = self._series.get((route, kind))
        if series is None:
            series = self._series[route, kind] = _Series()
        by_status = series.by_status
        ended_as = collections.Counter(statuses)
        for status, times in ended_as.items():
            by_status[status] = by_status.get(status, 0) + times
        series.nbytes += nbytes
        series.total_ns += sum(tooks)
        buckets = series.buckets
        for bucket, times in collections.Counter(map(_bucket, tooks)).items():
            buckets[bucket] += times
        _ring_write(series.recent, series.count, tooks)
        series.count += n
        peer = self._peers.get(cluster_id)
        if peer is None:
            peer = self._peers[cluster_id] = _Peer()
        peer.transfers += n
        peer.nbytes += nbytes
        peer.failed += n - ended_as[_SUCCESS]

    def _log_failure(
        self,
        route: str,
        transfer: Transfer,
        status: LLMStatusCode,
        took: int,
        failure: BaseException,
    ) -> None:
        emit = self._log.warning if status in _SERIOUS else self._log.info
        emit(
            "transfer.failed",
            route=route,
            op=transfer.kind.value,
            peer_cluster_id=transfer.cluster_id,
            nbytes=transfer.nbytes,
            status=status.name,
            duration_us=round(took / 1e3, 1),
            reason=str(failure),
            **_names(transfer),
        )

    def routes(self) -> list[RouteSnapshot]:
        """A snapshot of every (route, op) seen, sorted by route then op."""
        self._fold()
        with self._lock:
            taken = [
                (
                    route,
                    kind.value,
                    {LLMStatusCode(code).name: n for code, n in s.by_status.items()},
                    s.nbytes,
                    s.total_ns,
                    tuple(s.buckets),
                    s.durations(),
                )
                for (route, kind), s in sorted(self._series.items(), key=_by_route_op)
            ]
        out = []
        for route, op, by_status, nbytes, total_ns, buckets, recent in taken:
            p50, p90, p99 = (
                np.percentile(recent, (50, 90, 99)) / 1e3 if len(recent) else (0.0, 0.0, 0.0)
            )
            out.append(
                RouteSnapshot(
                    route=route,
                    op=op,
                    by_status=by_status,
                    bytes=nbytes,
                    seconds=total_ns / 1e9,
                    buckets=buckets,
                    p50_us=float(p50),
                    p90_us=float(p90),
                    p99_us=float(p99),
                    max_us=float(recent.max()) / 1e3 if len(recent) else 0.0,
                )
            )
        return out

    def peers(self) -> list[PeerSnapshot]:
        """A snapshot per peer cluster, sorted by cluster id."""
        self._fold()
        with self._lock:
            return [
                PeerSnapshot(cluster_id, p.transfers, p.failed, p.nbytes)
                for cluster_id, p in sorted(self._peers.items())
            ]
