"""The UCX route: pulls and pushes moved with UCP RMA through the peer's published table.

A transfer that names the peer's memory by blocks key, by cache id and batch index, or by raw
addresses (the one-sided targets) is resolved against the peer's UCX table with the same
checks the same-host route and the serving side use (``onesided.resolve``), paired with the
local rows, and started as one ``ucp_get_nbx`` (pull) or ``ucp_put_nbx`` (push, then a flush
so that completion means the bytes are in the peer's memory) per contiguous piece: a
:class:`Batch`. Anything else (requests by cache key, which may drop the key) goes over the
link: the route declines and the next route takes it.

Completion, without polling. Whoever waits drives the engine's one UCX worker
(:class:`UcxProgress`): a blocking caller progresses it and sleeps on its event fd
(:meth:`UcxProgress.read_for`); an event loop on which a batch did not complete as it started
keeps the event fd in its selector (its pump) while batches started there are pending; and the
engine's progress thread sleeps on the same fd meanwhile. It serves the peers' transfers over
software transports (tcp: the target must progress for a get or put to move), completes what no
one waits for, and fails a batch whose deadline passed: it closes the endpoint by force (UCX
completes every request still in flight as cancelled, so nothing writes the local rows
afterwards), the batch fails with ``LLM_TIMEOUT`` and the link carries the peer's later
transfers. Every request a batch started has completed before its future does.

A large host transfer is cut into parts that the engine's lanes move beside this worker
(``_routes.ucx.lanes``): a lane's part completes on the lane's own thread, and its last
completion signals this worker, so the waiters above wake as for any other completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import numpy as np
import structlog

from aio_datadist._engine.regions import (
    ONE_SIDED_TARGETS,
    BoardEntry,
    RemoteRegions,
    paired,
    resolve,
)
from aio_datadist._engine.request import DONE_FUTURE, Blocks, Completion, Transfer, completed
from aio_datadist._engine.routes import Carrier
from aio_datadist._native import api
from aio_datadist._routes.ucx.remote import Snapshot, UcxRemote
from aio_datadist._routes.ucx.worker import Requests, UcxWorker
from aio_datadist._transport.base import Iov, Payload, RequestKind
from aio_datadist._transport.future import RequestFuture
from aio_datadist.status import (
    KvCacheNotExistError,
    LLMException,
    LLMStatusCode,
    ParamInvalidError,
)

__all__ = ("Batch", "UcxProgress", "UcxRoute")

_S = LLMStatusCode
#: The longest round of progress that starting a batch on an event loop runs: a small batch
#: over shared memory completes in it; the rest moves as the loop's waits progress.
_START_NS = 50_000
#: The same, in any other thread.
_START_THREAD_NS = 20_000_000
#: The longest the progress thread sleeps without looking at the deadlines: a batch due
#: later than its wake-up (a transfer's timeout is usually seconds) does not wake it.
_HORIZON_NS = 250_000_000


class Batch:
    """One transfer's UCX requests; its :attr:`future` completes once every one completed."""

    __slots__ = (
        "_again",
        "_at",
        "_lock",
        "deadline_ns",
        "entries",
        "expired",
        "failure",
        "future",
        "pump",
        "remote",
        "requests",
        "snap",
        "spun",
    )

    def __init__(
        self,
        remote: UcxRemote,
        snap: Snapshot,
        entries: list[BoardEntry],
        requests: list[Requests],
        failure: LLMException | None,
        deadline_ns: int,
    ) -> None:
        self.remote = remote
        self.snap = snap
        self.entries = entries
        self.requests = requests
        self.failure = failure
        self.deadline_ns = deadline_ns
        self.expired = False
        #: The pump of the loop it was started on (counted there while pending), if any.
        self.pump: _LoopPump | None = None
        #: True once it was busy-polled (:meth:`UcxProgress._spin_batch`: once per batch).
        self.spun = False
        self.future: Future[None] = RequestFuture()
        self._at = 0
        self._again = False
        self._lock = threading.Lock()

    def poll(self) -> bool:
        """Look at the requests (never two threads at once); True once the batch completed.

        A thread that finds another one looking leaves a note (``_again``) before it goes:
        the one looking reads the note after it let go and looks again, so a request that
        completed in between (in the thread that left the note) is never missed, and a
        waiter never sleeps on a batch already complete."""
        if self.future.done():
            return True
        self._again = True
        while True:
            if not self._lock.acquire(blocking=False):
                return False  # another thread looks at them now, and again after the note
            try:
                self._again = False
                if self.future.done() or self._scan():
                    return True
            finally:
                self._lock.release()
            if not self._again:
                return False

    def _scan(self) -> bool:
        """(Lock held.) Take the results of the requests completed in order; finish the
        batch once all did: whether it did."""
        requests = self.requests
        while self._at < len(requests):
            request = requests[self._at]
            if not request.done():
                return False
            self.failure = _taken(request, self.failure)
            self._at += 1
        self._finish()
        return True

    def notify(self, worker: UcxWorker) -> None:
        """Have the requests other workers progress (the lanes' parts) signal ``worker`` when
        they complete: whoever waits for the batch sleeps on its event fd."""
        for requests in self.requests:
            requests.notify(worker)

    def expire(self) -> None:
        """The deadline passed: the batch fails with ``LLM_TIMEOUT`` once its requests are
        cancelled (the caller closes the endpoint)."""
        self.expired = True

    def _finish(self) -> None:
        """(Every request completed.) End the transfer and complete the future."""
        error = _outcome(self.remote, self.snap, self.entries, self.failure, self.expired)
        if error is None:
            self.future.set_result(None)
        else:
            self.future.set_exception(error)


def _taken(request: Requests, failure: LLMException | None) -> LLMException | None:
    """(``request`` done.) The batch's failure once ``request``'s result was taken (the
    first failure stays), its count given back to its worker."""
    if failure is None:
        try:
            request.result()
        except LLMException as exc:
            failure = exc
    request.release()
    return failure


def _outcome(
    remote: UcxRemote,
    snap: Snapshot,
    entries: list[BoardEntry],
    failure: LLMException | None,
    expired: bool,
) -> LLMException | None:
    """(Every request of a batch completed.) End its transfer: its failure, if any."""
    still_there = remote.end(snap, entries)
    if expired:
        return LLMException(
            "UCX transfer did not complete within sync_kv_timeout", status_code=_S.LLM_TIMEOUT
        )
    if failure is not None:
        return failure
    if not still_there:
        return KvCacheNotExistError(
            "the peer released the cache while it was being transferred",
            status_code=_S.LLM_KV_CACHE_NOT_EXIST,
        )
    return None


class UcxProgress:
    """Drives the engine's UCX worker: its progress thread, waiting callers and event loops
    (see the module docstring). It is what a UCX completion hands its waiters.

    The worker is made ``UCS_THREAD_MODE_MULTI``: a transfer starts in the caller's thread,
    may be waited for on an event loop or in another thread, and the progress thread
    progresses the same worker meanwhile.
    """

    #: No loop watches the worker from before a transfer starts: a batch started on a loop
    #: that did not complete at once puts the loop's pump to work (:meth:`_add`), so an
    #: awaited transfer starts as a blocking one does, inline.
    watched = False

    def __init__(
        self, worker: UcxWorker, log: structlog.stdlib.BoundLogger, *, spin_ns: int = 0
    ) -> None:
        self.worker = worker
        self._log = log
        #: How long a blocking waiter busy-polls the worker before it sleeps, and the progress
        #: thread after it served the peers.
        self.spin_ns = spin_ns
        self._lock = threading.Lock()
        self._pending: dict[Batch, None] = {}
        self._earliest = 0
        #: Until when the progress thread sleeps at most: a batch due later wakes no one.
        self._sleep_until = 0
        self._wake = False  # the progress thread must look at the deadlines again
        self._active = 0  # waiters progressing the worker now (the progress thread waits)
        self._back = False  # the progress thread stepped back for them (asleep on its waker)
        #: The same count for the thread's native wait, which stands down while it is > 0.
        self._turn_c = api.UcxTurn()
        #: Wakes the progress thread (its sleep on the worker's event fd may miss events
        #: another thread progressed).
        self._waker = _Waker()
        self._stop = threading.Event()
        self._pumps: dict[asyncio.AbstractEventLoop, _LoopPump] = {}
        self._thread = threading.Thread(target=self._run, name="aio-dd-ucx", daemon=True)
        self._thread.start()

    # -- batches ----------------------------------------------------------------------------
    @staticmethod
    def start_ns() -> int:
        """How long starting a batch progresses the worker in this thread: on an event loop
        a short round (its waits progress in bounded rounds); in any other thread what it
        can move now (over shared memory, the whole batch), as a blocking caller would."""
        return _START_NS if asyncio._get_running_loop() is not None else _START_THREAD_NS

    def settle(self, batch: Batch) -> Future[None]:
        """See whether ``batch`` completed as it started (:meth:`start_ns`), or, in a thread
        other than an event loop's (whose caller waits for it next), within
        :attr:`spin_ns` of busy-polling (:meth:`_spin_batch`: over tcp the peer's answer
        usually comes within it, and the batch ends here, never seen by the progress
        thread); else hand it to whoever progresses next (a waiter, a loop's pump, the
        progress thread), its lanes' parts signalling the worker as they complete (a part
        that completed while this thread moved its own wakes no one). Its future either
        way."""
        if batch.poll():
            return batch.future
        if self.spin_ns and asyncio._get_running_loop() is None and self._spin_batch(batch):
            return batch.future
        batch.notify(self.worker)
        self._add(batch)
        return batch.future

    @contextlib.contextmanager
    def _foreground(self) -> Iterator[None]:
        """A waiter progresses the worker meanwhile: the progress thread steps back (two
        threads progressing one worker only contend for its lock), minding the deadlines."""
        with self._lock:
            self._waiting(1)
        try:
            yield
        finally:
            self._leave()

    def _waiting(self, change: int) -> int:
        """(Lock held.) One more (1) or one fewer (-1) waiter progressing the worker; the
        progress thread's native wait stands down while there is one (it sees a new one
        when it next wakes, and leaves the events to it from then). How that wait is
        parked now (``UcxTurn.waiters``)."""
        self._active += change
        return self._turn_c.waiters(self._active)

    def _leave(self, _: object = None) -> None:
        """A waiter stopped progressing: the last one gives the worker back to the thread,
        which it wakes if the thread stepped back (in Python, or parked in its native wait
        for good: that resumes without coming back to Python). A thread parked for its spin
        time resumes by itself: a waiter that leaves within it (one small transfer) writes
        nothing, and the next one usually comes before the thread looks again."""
        with self._lock:
            parked = self._waiting(-1)
            wake = not self._active and (self._back or parked == api.UcxTurn.PARKED)
        if wake:
            self._waker.wake()

    def _add(self, batch: Batch) -> None:
        loop = asyncio._get_running_loop()
        with self._lock:
            self._pending[batch] = None
            if not self._earliest or batch.deadline_ns < self._earliest:
                self._earliest = batch.deadline_ns
            if batch.deadline_ns < self._sleep_until:  # the thread would sleep past it
                self._wake = True
            wake = self._wake
            if loop is not None:  # the loop's pump progresses the worker while it waits
                pump = self._pumps.get(loop)
                if pump is None:
                    pump = self._pumps[loop] = _LoopPump()
                batch.pump = pump
                pump.pending += 1
                if not pump.active:
                    pump.active = True
                    self._waiting(1)  # from now: the task may start after more batches
                    if pump.task is None:
                        pump.task = loop.create_task(self._pump())
                        pump.task.add_done_callback(functools.partial(self._pump_ended, pump))
            progressed = self._active > 0
        if wake:
            self._signal()
        if progressed:  # a waiter asleep on the event fd must progress the new requests
            with contextlib.suppress(LLMException):
                self.worker.signal()

    def _signal(self) -> None:
        """Wake the progress thread, and have it look at the deadlines and its stop."""
        self._turn_c.look()
        self._waker.wake()

    def poll(self) -> bool:
        """Complete the batches whose requests all completed; False (never ready: the
        progress loops of :meth:`read_for` and :meth:`watch` ask this after each round)."""
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return False
        done = [b for b in pending if b.poll()]
        if done:
            self._forget(done)
        return False

    def _expire(self, batch: Batch) -> None:
        """Fail ``batch`` for its deadline: close its route by force (the requests complete,
        cancelled); its link carries the peer's later transfers."""
        if batch.future.done():
            return
        batch.expire()
        self._log.warning("ucx.deadline_missed", fallback="link")
        batch.remote.close("a UCX transfer missed its deadline")
        self.poll()  # what the close cancelled completes now

    def _expire_due(self) -> None:
        now = time.monotonic_ns()
        with self._lock:
            due = [b for b in self._pending if b.deadline_ns <= now and not b.expired]
            later = [b.deadline_ns for b in self._pending if b.deadline_ns > now]
            self._earliest = min(later, default=0)
        for batch in due:
            self._expire(batch)
        if due:
            self.poll()

    # -- waiters ----------------------------------------------------------------------------
    def spin(self, future: Future[None], deadline_ns: int) -> None:
        """Busy-poll the worker for :attr:`spin_ns` for ``future``'s batch in this thread (an
        event loop with nothing else to run, whose call has no other request); what is
        still in flight then arrives through the loop's watch."""
        if self.spin_ns and not future.done():
            self._spin(future)

    def read_for(self, future: Future[None], deadline_ns: int) -> None:
        """Progress the worker in this thread until ``future`` completed or ``deadline_ns``
        passed (a blocking face waiting for a completion): busy-polling for
        :attr:`spin_ns` first, then sleeping on its event fd. Another thread that completes
        the future wakes this one (its own eventfd)."""
        if self.spin_ns and self._spin(future):
            return
        try:
            waker = _thread_waker()
        except OSError:  # no descriptor for it: wait on the future, the thread progresses
            return
        future.add_done_callback(waker.wake)
        try:
            with self._foreground():
                self.worker.wait_until(
                    lambda: self.poll() or future.done(), deadline_ns, wake_fd=waker.fd
                )
        except LLMException:  # the worker closed: the future fails as it can
            return
        finally:
            waker.clear()

    def _spin(self, future: Future[None]) -> bool:
        """Busy-poll the worker for :attr:`spin_ns` while the requests this worker moves for
        ``future``'s batch are in flight (over tcp the peer's answer usually comes within
        it), the progress thread standing down meanwhile; complete the batch once they all
        did. Whether ``future`` completed."""
        with self._lock:
            batch = next((b for b in self._pending if b.future is future), None)
        if batch is None:
            return future.done()
        if self._spin_batch(batch):
            self._forget([batch])
        return future.done()

    def _spin_batch(self, batch: Batch) -> bool:
        """Busy-poll the worker for :attr:`spin_ns` while the requests it moves for
        ``batch`` are in flight, the progress thread standing down meanwhile, unless the
        batch was busy-polled already (in its start: a transfer busy-polls once, then its
        waiter sleeps); whether the batch then completed (:meth:`Batch.poll`)."""
        if batch.spun:
            return batch.poll()
        batch.spun = True
        for requests in batch.requests:
            if requests.worker is self.worker:
                try:
                    with self._foreground():
                        requests.spin(self.spin_ns)
                except LLMException:  # the worker closed: the batch fails as it can
                    return False
                break
        return batch.poll()

    def _forget(self, done: list[Batch]) -> None:
        """Take the completed batches ``done`` off the pending ones; a loop's pump stops
        counting as a waiter once no batch started on its loop is pending."""
        left = 0
        with self._lock:
            pending = self._pending
            for batch in done:
                if batch not in pending:
                    continue
                del pending[batch]
                pump = batch.pump
                if pump is not None:
                    pump.pending -= 1
                    if not pump.pending and pump.active:
                        pump.active = False
                        left += 1
            if not pending:
                self._earliest = 0
        for _ in range(left):
            self._leave()

    def watch(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        """None: no watch is needed (:attr:`watched` is False). A batch started on a loop
        that did not complete at once puts the loop's pump to work itself (:meth:`_add`)
        until no batch started there is pending."""
        return None

    async def _pump(self) -> None:
        """Progress the worker on the running loop until cancelled (at finalize). It counts
        as a waiter while batches started on the loop are pending (:class:`_LoopPump`);
        between them it stays asleep on the worker's event fd, so that no call makes or ends
        a task for it (the loop's ready queue then stays empty for the next call's
        busy-poll)."""
        with contextlib.suppress(LLMException):  # the worker closed (finalize)
            await self.worker.wait_until_async(self.poll)

    def _pump_ended(self, pump: _LoopPump, _: object) -> None:
        """The pump's task ended (cancelled at finalize, or its worker closed)."""
        with self._lock:
            leave, pump.active, pump.task = pump.active, False, None
        if leave:
            self._leave()

    # -- the progress thread ----------------------------------------------------------------
    def _turn(self) -> bool:
        """After a round of progress in the progress thread: complete batches, fail the ones
        past their deadline; True when the thread must stop, look at the deadlines again, or
        step back for a waiter that progresses."""
        self.poll()
        with self._lock:
            due = self._earliest and self._earliest <= time.monotonic_ns()
            wake = self._wake or self._active > 0  # cleared where the deadline is read again
        if due:
            self._expire_due()
        return self._stop.is_set() or wake or bool(due)

    def _serve(self, deadline_ns: int | None) -> None:
        """Progress the worker and sleep on its event fd until :meth:`_turn` says to stop:
        in native waits without the GIL, which come back to Python only when woken, at the
        deadline, or, while batches are pending, when progress found work (a batch may have
        completed). A serving process's thread thus answers a peer's transfer over a
        software transport without running any Python."""
        while True:
            with self._lock:
                pending = bool(self._pending)
            served = self.worker.serve_until(
                self._turn_c, self._waker.fd, deadline_ns, pending, self.spin_ns
            )
            if served is None:  # a worker below UCS_THREAD_MODE_MULTI: its lock serializes
                self.worker.wait_until(self._turn, deadline_ns, wake_fd=self._waker.fd)
                return
            self._waker.clear()
            if self._turn() or (deadline_ns is not None and time.monotonic_ns() >= deadline_ns):
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                deadline = self._earliest or None
                # At most _HORIZON_NS, so that a batch due later need not wake the thread.
                horizon = time.monotonic_ns() + _HORIZON_NS
                until = self._sleep_until = horizon if deadline is None else min(deadline, horizon)
                self._wake = False
                stepped_back = self._back = self._active > 0
            try:
                if stepped_back:  # a waiter progresses: only the deadlines are this thread's
                    self._waker.sleep(until)
                else:
                    self._serve(until)
            except LLMException:  # the worker closed under the thread: it is finalize
                return
            except Exception:  # never the end of the thread: log and go on
                self._log.warning("ucx.progress_failed", exc_info=True)
                time.sleep(0.01)
            if deadline is not None and time.monotonic_ns() >= deadline:
                self._expire_due()
                self.poll()  # what the expiry cancelled completes now: a waiter may sleep on

    def close(self) -> None:
        """Stop the progress thread and the loops' pumps (finalize, before the worker goes);
        batches still pending fail with ``LLM_LINK_FAILED``."""
        self._stop.set()
        self._signal()
        if self._thread is not threading.current_thread():
            self._thread.join(10)
        with self._lock:
            pumps, self._pumps = self._pumps, {}
            pending, self._pending = list(self._pending), {}
        for pump in pumps.values():
            if pump.task is not None:
                pump.task.cancel()
        for batch in pending:
            if not batch.future.done():
                batch.remote.close("the engine was finalized")
                with contextlib.suppress(LLMException):
                    self.worker.wait_until(batch.poll, time.monotonic_ns() + 5_000_000_000)
            if not batch.future.done():
                batch.future.set_exception(
                    LLMException("the engine was finalized", status_code=_S.LLM_LINK_FAILED)
                )


class _LoopPump:
    """What one event loop does for the worker: its pump task (made with the first batch
    started on the loop that did not complete at once, kept until finalize), the batches
    started on the loop still pending, and whether the pump counts as a waiter (while one
    is)."""

    __slots__ = ("active", "pending", "task")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.pending = 0
        self.active = False


class _Waker:
    """An eventfd a thread sleeps on besides the worker's, closed when the last reference
    goes (the thread's, and those of the futures whose completion writes to it)."""

    __slots__ = ("fd",)

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def wake(self, _: object = None) -> None:
        """Make the eventfd readable."""
        with contextlib.suppress(OSError):
            os.eventfd_write(self.fd, 1)

    def clear(self) -> None:
        """Take what was written."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def sleep(self, deadline_ns: int | None) -> None:
        """Sleep until woken or ``deadline_ns`` (``time.monotonic_ns()``)."""
        timeout = -1
        if deadline_ns is not None:
            timeout = max(0, -(-(deadline_ns - time.monotonic_ns()) // 1_000_000))
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        if poller.poll(timeout):
            self.clear()

    def __del__(self) -> None:
        os.close(self.fd)


_wakers = threading.local()


def _thread_waker() -> _Waker:
    """This thread's waker for :meth:`UcxProgress.read_for` (made once per thread)."""
    waker: _Waker | None = getattr(_wakers, "waker", None)
    if waker is None:
        waker = _wakers.waker = _Waker()
    return waker


class UcxRoute(Carrier):
    """Transfers with one peer moved by UCP RMA through its published table."""

    name = "ucx"
    rank = 40

    def __init__(self, remote: UcxRemote, progress: UcxProgress, *, cuda: bool) -> None:
        self.remote = remote
        self.progress = progress
        #: Device rows of this engine's runtime go to UCX directly (it reaches CUDA memory).
        self.cuda = cuda

    def link(self) -> UcxProgress:
        return self.progress

    def in_caller(self, transfer: Transfer) -> bool:
        # Starting only issues the requests (microseconds each): the bytes move as the
        # worker is progressed, by waiters in bounded rounds or by the progress thread.
        return False

    def takes(self, transfer: Transfer) -> bool:
        """True when the route may take ``transfer``'s request, its rows aside."""
        return not transfer.commit and transfer.target in ONE_SIDED_TARGETS and self.remote.usable

    def accepts(self, transfer: Transfer) -> bool:
        return (not transfer.device or self.cuda) and self.takes(transfer)

    def start(self, transfer: Transfer, deadline_ns: int) -> Completion | None:
        memory = "cuda" if transfer.device else "host"
        future = self._start(transfer, None, deadline_ns, memory)
        if future is None:
            return None
        return completed(future, deadline_ns, self.progress)

    def send(
        self,
        transfer: Transfer,
        local: Payload,
        deadline_ns: int,
        *,
        local_memory: str = "host",
    ) -> Future[None] | None:
        """Start ``transfer``'s bytes between the rows ``local`` and the peer's memory; its
        future, or None when the route declines it (nothing moved; the next route takes it).

        :raises LLMException: the peer's table refuses the access (``LLM_PARAM_INVALID``, as
            the serving side would), or the route closed (``LLM_LINK_FAILED``).
        """
        if not isinstance(local, np.ndarray):
            raise TypeError("the UCX route moves memory rows, not segments")
        return self._start(transfer, local, deadline_ns, local_memory)

    def _start(
        self, transfer: Transfer, local: Iov | None, deadline_ns: int, memory: str
    ) -> Future[None] | None:
        """:meth:`send` between ``local`` (None: the transfer's own local memory) and the
        peer's memory: started under the peer's current table (:meth:`UcxRemote.start`, the
        ops as :func:`_found` finds them), then progressed for
        :meth:`UcxProgress.start_ns`."""
        started = self.remote.start(
            _found,
            transfer,
            local,
            write=transfer.kind is RequestKind.PUSH,
            local_memory=memory,
            nbytes=transfer.nbytes,
            progress_ns=self.progress.start_ns(),
        )
        if started is None:
            return None
        snap, entries, requests, failure = started
        if snap is None:  # every request completed in the call
            if failure is None:
                return DONE_FUTURE
            future: Future[None] = RequestFuture()
            future.set_exception(failure)
            return future
        batch = Batch(self.remote, snap, entries, requests, failure, deadline_ns)
        return self.progress.settle(batch)


def _found(
    regions: RemoteRegions, transfer: Transfer, local: Iov | None, refused: bool
) -> tuple[list[BoardEntry], np.ndarray | api.BlockPairs] | None:
    """The peer's entries that ``transfer`` reaches in ``regions`` and its ops between them
    and the rows ``local`` (None: the transfer's own): whole blocks between two blocks
    caches as block pairs (paired in the native call that starts them), unless the native
    call ``refused`` them; every other transfer resolved and bounds-checked as the serving
    side would, which names what is wrong. None when the table does not show the access."""
    if local is None and not refused:
        found = _block_pairs(regions, transfer)
        if found is not None:
            return found
    resolved = resolve(regions, transfer.access)
    if resolved is None:
        return None
    entries, rows = resolved
    ops = paired(transfer.kind, transfer.rows if local is None else local, rows)
    if transfer.kind is RequestKind.PUSH:  # (remote, local, n) -> (local, remote, n)
        ops = ops[:, [1, 0, 2]]
    return entries, ops


def _block_pairs(
    regions: RemoteRegions, transfer: Transfer
) -> tuple[list[BoardEntry], api.BlockPairs] | None:
    """The whole blocks of a transfer between two blocks caches, both layouts' blocks paired
    (``api.BlockPairs``), with the peer's entry; None for any other transfer, or one the
    table does not show as it names it."""
    remote, local = transfer.remote, transfer.local
    if remote is None or local.__class__ is not Blocks:
        return None
    assert isinstance(local, Blocks)
    if remote.seg != local.seg or remote.count != local.count:
        return None
    found = _pairing(
        regions,
        remote.model_id,
        local.layout,
        local.start,
        remote.start,
        local.count,
        local.seg,
    )
    if found is None:
        return None
    try:
        return found[0], api.BlockPairs(found[1], local.blocks, remote.blocks)
    except ParamInvalidError:
        return None


@functools.lru_cache(maxsize=256)
def _pairing(
    regions: RemoteRegions,
    model_id: int,
    local_layout: api.BlockLayout,
    local_start: int,
    remote_start: int,
    count: int,
    seg: int,
) -> tuple[list[BoardEntry], api.PairedLayouts] | None:
    """The peer's blocks cache ``model_id`` in ``regions`` (one table), as the one entry a
    transfer reaches, with its layout paired with the local one (``api.PairedLayouts``);
    None when the table has no such cache or the layouts do not pair. Kept for the
    pairings seen lately: a loop of transfers between two caches pairs them once per table."""
    entry = regions.by_model.get(model_id)
    if entry is None:
        return None
    try:
        layouts = api.PairedLayouts(
            (local_layout, local_start), (regions.layout(entry), remote_start), count, seg
        )
    except ParamInvalidError:
        return None
    return [entry], layouts
