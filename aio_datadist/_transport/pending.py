"""The requests one end of a link awaits answers to: by id, each with its deadline.

A request's answer is read by the link's pump, and its deadline is watched by
the process-wide reaper (``deadlines``) through one timer per link, set at the earliest
pending deadline (not one per request: a link may hold tens of thousands). Whoever ends a
request takes it out of the table first, so each request ends exactly once: answered, failed
by the peer, overdue (``LLM_TIMEOUT``) or failed with the link.

A request whose payload is still being sent (``busy``) is completed by its sender: whoever
settles it meanwhile only records the outcome (:meth:`PendingRequests.sent`). A request the
link's pump holds (its payload moving into its rows, or its outcome not yet taken) is ended
only by whoever takes that outcome: neither its deadline nor the link failing ends it
meanwhile (``held``).
"""

from __future__ import annotations

import contextlib
import heapq
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from aio_datadist._transport.base import Payload, RequestKind
from aio_datadist._transport.deadlines import Timer, now_ns, reaper
from aio_datadist._transport.future import RequestFuture
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ("PendingRequests", "Request", "new_future")


def new_future() -> Future[None]:
    """A request's future: running from birth and never cancelled (a cancelled one would
    report "done" while the transport may still write into its memory)."""
    return RequestFuture()


class Request:
    """A request of this side waiting for its answer."""

    __slots__ = (
        "busy",
        "commit",
        "deadline_ns",
        "dst",
        "future",
        "has_outcome",
        "kind",
        "nbytes",
        "outcome",
        "rid",
    )

    def __init__(
        self,
        rid: int,
        kind: RequestKind,
        dst: Payload | None,
        nbytes: int,
        deadline_ns: int,
        commit: bool = False,
        busy: bool = False,
    ) -> None:
        self.rid = rid
        self.kind = kind
        self.dst = dst
        self.nbytes = nbytes
        self.deadline_ns = deadline_ns
        self.commit = commit
        self.future = RequestFuture()
        self.future.request_id = rid
        # While busy (a push still sending its payload) the sender completes the future;
        # whoever settles it meanwhile only records the outcome.
        self.busy = busy
        self.has_outcome = False
        self.outcome: LLMException | None = None

    def complete(self) -> None:
        """Complete the future with :attr:`outcome` (None: success); a second time is a no-op."""
        with contextlib.suppress(InvalidStateError):
            if self.outcome is None:
                self.future.set_result(None)
            else:
                self.future.set_exception(self.outcome)


class PendingRequests:
    """The requests of one link end awaiting answers (thread-safe).

    It shares ``lock`` with the link's own state: ``taking()``, asked under it, says
    whether the link takes new requests, so none slips in after the link stopped taking
    them; ``failure()`` is the failure of a request the link no longer takes; ``held(rid)``
    (never called under ``lock``) says whether someone else ends request ``rid`` (its
    transport still moves it), which otherwise it forgets.
    """

    def __init__(
        self,
        lock: threading.Lock,
        taking: Callable[[], bool],
        failure: Callable[[], LLMException],
        held: Callable[[int], bool] | None = None,
    ) -> None:
        self._lock = lock
        self._held = held
        self._taking = taking
        self._failure = failure
        self._by_id: dict[int, Request] = {}
        # Deadlines of the pending requests, (deadline, rid), earliest first (entries of
        # answered requests stay until they come up); one reaper timer fires at the
        # earliest (``_expiry_at``, 0: none).
        self._deadlines: list[tuple[int, int]] = []
        self._expiry_at = 0
        self._timer: Timer | None = None
        self._ended = False  # failed with the link: no timer is set any more

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, req: Request) -> bool:
        """Add ``req``; False, its future failed, when its deadline passed already or the
        link takes no new request."""
        if req.deadline_ns > 0 and req.deadline_ns <= now_ns():
            req.future.set_exception(
                LLMException(
                    "the deadline passed before the request",
                    status_code=LLMStatusCode.LLM_TIMEOUT,
                )
            )
            return False
        deadline = req.deadline_ns
        wake = False
        with self._lock:
            if self._ended or not self._taking():
                failure: LLMException | None = self._failure()
            else:
                failure = None
                self._by_id[req.rid] = req
                if deadline > 0:
                    wake = self._add_deadline(deadline, req.rid)
        if failure is not None:
            req.future.set_exception(failure)
            return False
        if wake:
            self._schedule_expiry(deadline)
        return True

    def claim(
        self, rid: int, kind: RequestKind, fits: Callable[[Request], bool] | None = None
    ) -> Request | None:
        """Take request ``rid`` of ``kind`` out of the table to move its payload (nothing
        else may end it then); None when there is none, it is busy, or ``fits`` refuses it
        (it stays then)."""
        with self._lock:
            req = self._by_id.get(rid)
            if req is None or req.kind is not kind or req.busy:
                return None
            if fits is not None and not fits(req):
                return None
            del self._by_id[rid]
            return req

    def settle(
        self, rid: int, outcome: LLMException | None, kind: RequestKind | None = None
    ) -> bool:
        """End pending request ``rid`` (of ``kind``) with ``outcome``; False if none. A busy
        one only records it: its sender completes it (:meth:`sent`)."""
        with self._lock:
            req = self._by_id.get(rid)
            if req is None or (kind is not None and req.kind is not kind):
                return False
            del self._by_id[rid]
            if not req.has_outcome:
                req.has_outcome, req.outcome = True, outcome
            if req.busy:
                return True
        req.complete()
        return True

    def sent(self, req: Request, failure: LLMException | None) -> None:
        """A busy request's frame went out (``failure`` None) or failed: unless it failed,
        it now waits for its answer like any other; it completes now if it already ended."""
        with self._lock:
            req.busy = False
            if failure is not None:
                if self._by_id.get(req.rid) is req:
                    del self._by_id[req.rid]
                if not req.has_outcome:
                    req.has_outcome, req.outcome = True, failure
            done = req.has_outcome
        if done:
            req.complete()

    def fail_all(self) -> int:
        """The link broke: fail every pending request with ``failure()`` (a busy one when
        its sender is done with it; a held one stays for whoever holds it), take no new one
        and set no more timers. Returns how many were pending."""
        with self._lock:
            self._ended = True
            rids = list(self._by_id)
        held = self._held
        kept = {rid for rid in rids if held(rid)} if held is not None else set()
        with self._lock:
            pending, self._by_id = self._by_id, {}
            for rid in kept:
                if rid in pending:
                    self._by_id[rid] = pending.pop(rid)
            self._deadlines.clear()
            self._expiry_at = 0
            timer, self._timer = self._timer, None
            to_complete = []
            for req in pending.values():
                if not req.has_outcome:
                    req.has_outcome, req.outcome = True, self._failure()
                if not req.busy:
                    to_complete.append(req)
        if timer is not None:
            timer.cancel()
        for req in to_complete:
            req.complete()
        return len(pending)

    # -- deadlines ---------------------------------------------------------------------------
    def _add_deadline(self, deadline_ns: int, rid: int) -> bool:
        """Note request ``rid``'s deadline (``lock`` held); True when it is earlier than the
        link's expiry timer, which must then be brought forward."""
        heap = self._deadlines
        if len(heap) > 2 * len(self._by_id) + 1024:  # mostly answered: drop those
            heap[:] = [(r.deadline_ns, r.rid) for r in self._by_id.values() if r.deadline_ns]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, (deadline_ns, rid))
        if self._expiry_at and self._expiry_at <= deadline_ns:
            return False
        self._expiry_at = deadline_ns
        return True

    def _schedule_expiry(self, when_ns: int) -> None:
        """Run :meth:`_expire_due` at ``when_ns``."""
        timer = reaper.schedule(when_ns, self._expire_due)
        with self._lock:
            if when_ns != self._expiry_at or self._ended:  # superseded meanwhile
                stale: Timer | None = timer
            else:
                stale, self._timer = self._timer, timer
        if stale is not None:
            stale.cancel()

    def _expire_due(self) -> None:
        """(Reaper thread.) Fail every request whose deadline passed with ``LLM_TIMEOUT``;
        then wait for the next deadline."""
        now = now_ns()
        due: list[int] = []
        with self._lock:
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                due.append(heapq.heappop(heap)[1])
            self._expiry_at = heap[0][0] if heap else 0
            nxt = self._expiry_at
        held = self._held
        for rid in due:
            if held is not None and held(rid):
                continue  # whoever holds it ends it (its deadline bounds the payload)
            self.settle(
                rid,
                LLMException(
                    f"request {rid} was not answered in time",
                    status_code=LLMStatusCode.LLM_TIMEOUT,
                ),
            )
        if nxt:
            self._schedule_expiry(nxt)
