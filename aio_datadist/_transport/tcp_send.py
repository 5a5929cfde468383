"""The sending side of one end of a TCP link: the frames it has to send, the sender thread
that sends them in order, and the peer's work they hold (backpressure).

A request goes out from its caller's thread under the link's send lock. An answer to one of
the peer's requests goes out from the reader thread at once when the sender thread is idle
and the send lock free, and through the queue otherwise, so answers keep their order.
:class:`ServeLimits` bound the peer's work the link holds: bytes held by queued frames and
answers not yet fully sent. Over them the reader leaves the peer's next request on the
socket (:meth:`Outbox.pause`) until the sender drained the link to half of them; TCP flow
control then holds the peer, and no request is dropped.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import numpy as np
import structlog

from aio_datadist._native.api import NetTimeout, bytes_address, sock_sendv
from aio_datadist._transport.base import ChannelStats, Iov, Segments, ServeLimits
from aio_datadist._transport.deadlines import now_ns
from aio_datadist._transport.tcp_io import IO_ERRORS, iov_skip, move_payload, sendv_all
from aio_datadist.status import LLMException

__all__ = ("OutFrame", "Outbox")

#: Bytes a queued frame counts for each row of its row table (two uint64).
_ROW_BYTES = 16
#: A reader paused over the limits looks again this often whether this side now awaits
#: answers on the link (the limits then count twice), besides being woken by the sender.
_PAUSE_TICK_S = 0.1


class OutFrame:
    """One frame for the sender thread: control bytes, then optional payload rows (copied
    behind them, so one call sends both), ``tail`` rows (sent as they are: a big row table is
    not copied) and a ``stream``.

    ``answer``: it answers one of the peer's requests. ``stream_rows``: rows of the row table
    ``stream`` holds. What the frame holds in memory while queued is ``held`` bytes.
    """

    __slots__ = (
        "_finished",
        "after",
        "answer",
        "held",
        "iov",
        "keep",
        "lock_held",
        "stream",
        "tail",
    )

    def __init__(
        self,
        ctl: bytes,
        payload: Iov | None = None,
        after: Callable[[bool], None] | None = None,
        stream: Segments | None = None,
        *,
        tail: Iov | None = None,
        answer: bool = False,
        stream_rows: int = 0,
    ) -> None:
        addr, self.keep = bytes_address(ctl)  # the iov points into ctl: kept with the frame
        n = 0 if payload is None else payload.shape[0]
        iov: Iov = np.empty((n + 1, 2), dtype=np.uint64)
        iov[0, 0] = addr
        iov[0, 1] = len(ctl)
        if payload is not None:
            iov[1:] = payload
        self.iov = iov
        self.tail = tail  # payload rows after ``iov`` (sender thread only)
        self.stream = stream  # the payload after those, streamed (sender thread only)
        self.answer = answer
        tail_rows = 0 if tail is None else tail.shape[0]
        self.held = len(ctl) + _ROW_BYTES * (n + 1 + tail_rows + stream_rows)
        self.after = after
        self.lock_held = False  # the send lock is held for this job (a partial inline send)
        self._finished = False

    def finish(self, ok: bool, log: structlog.stdlib.BoundLogger) -> None:
        """Run ``after(ok)`` once."""
        if self._finished:
            return
        self._finished = True
        if self.after is not None:
            try:
                self.after(ok)
            except Exception:
                log.warning("tcp.callback_failed", exc_info=True)


class Outbox:
    """The frames of one link end waiting for its sender thread (:meth:`run`), and the
    peer's work the link holds (thread-safe).

    ``send_lock`` is the link's: one frame at a time on socket ``fd``. ``broken()`` says
    whether the link broke, ``fail(reason)`` breaks it, ``awaiting()`` whether this side
    awaits answers on the link (the limits then count twice: those answers may wait behind
    the peer's requests, and two ends that each waited for the other to read would stall).
    """

    def __init__(
        self,
        fd: int,
        send_lock: threading.Lock,
        stall_s: float,
        limits: ServeLimits,
        log: structlog.stdlib.BoundLogger,
        *,
        broken: Callable[[], bool],
        fail: Callable[[str], None],
        awaiting: Callable[[], bool],
    ) -> None:
        self._fd = fd
        self._slock = send_lock
        self._stall_s = stall_s
        self._limits = limits
        self._log = log
        self._broken = broken
        self._fail = fail
        self._awaiting = awaiting
        self._queue: collections.deque[OutFrame] = collections.deque()
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # the queue and the state below
        self._room = threading.Condition(lock)  # a paused reader waits on it
        self._active = False  # the sender thread is sending a frame
        self._stopping = False
        self._exited = False
        # The peer's work the link holds: bytes held by queued frames, answers to the
        # peer's requests not yet fully sent, their high-water marks, and the reader's
        # pauses over the limits.
        self._queued_bytes = 0
        self._queued_bytes_max = 0
        self._answers = 0
        self._answers_max = 0
        self._pauses = 0
        self._paused_ns = 0
        self._paused_since = 0  # monotonic ns while paused, else 0

    def idle(self) -> bool:
        """Whether the sender thread has nothing queued or in hand (and still runs)."""
        with self._cond:
            return not self._queue and not self._active and not self._exited

    def send_or_queue(self, job: OutFrame) -> None:
        """Send an answer from the reader thread without ever waiting on the socket: at once
        when the sender thread is idle and the send lock free, else through the queue."""
        # A streamed payload may wait on device copies, and a big row table takes long: only
        # the sender thread sends those.
        if (
            self.idle()
            and job.stream is None
            and job.tail is None
            and self._slock.acquire(blocking=False)
        ):
            if self._broken():
                self._slock.release()
                job.finish(False, self._log)
                return
            try:
                sock_sendv(self._fd, job.iov, 1)  # a deadline in the past: no waiting
            except NetTimeout as exc:
                # The sender thread is idle and only this thread queues work: hand it the
                # rest of the frame together with the send lock.
                job.iov = iov_skip(job.iov, exc.transferred)
                job.lock_held = True
                self.enqueue(job)
                return
            except Exception as exc:  # I/O failed, or (a bug) rows the native layer refused
                self._slock.release()
                job.finish(False, self._log)
                self._fail(f"send failed: {exc}")
                return
            self._slock.release()
            job.finish(True, self._log)
            return
        self.enqueue(job)

    def enqueue(self, job: OutFrame) -> None:
        """Queue ``job`` for the sender thread (with the send lock, when ``job.lock_held``);
        a sender thread that ended finishes it as failed."""
        with self._cond:
            exited = self._exited
            if not exited:
                self._queue.append(job)
                self._queued_bytes += job.held
                self._queued_bytes_max = max(self._queued_bytes_max, self._queued_bytes)
                if job.answer:
                    self._answers += 1
                    self._answers_max = max(self._answers_max, self._answers)
                self._cond.notify()
        if exited:
            if job.lock_held:
                self._slock.release()
            job.finish(False, self._log)

    def run(self) -> None:
        """The sender thread: send the queued frames in order until :meth:`stop`."""
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    self._exited = True
                    return
                job = self._queue.popleft()
                self._active = True
            try:
                self._send(job)
            except Exception:  # a bug; never leave a job unfinished or the thread dead
                self._log.warning("tcp.sender_failed", exc_info=True)
                job.finish(False, self._log)
                self._fail("internal error in the sender")
            finally:
                with self._cond:
                    self._active = False
                    self._queued_bytes -= job.held
                    if job.answer:
                        self._answers -= 1
                    if self._paused_since and not self.over_limits(0.5):
                        self._room.notify()

    def _send(self, job: OutFrame) -> None:
        if not job.lock_held:
            self._slock.acquire()
        job.lock_held = False
        ok = False
        failure = ""
        try:
            if not self._broken():
                sendv_all(self._fd, job.iov, self._stall_s)
                if job.tail is not None:
                    sendv_all(self._fd, job.tail, self._stall_s)
                if job.stream is not None:
                    _, error = move_payload(
                        lambda iov: sendv_all(self._fd, iov, self._stall_s), job.stream
                    )
                    if isinstance(error, LLMException):
                        failure = f"a payload could not be staged mid-frame: {error}"
                    elif error is not None:
                        raise error
                ok = not failure
        except IO_ERRORS as exc:
            failure = f"send failed: {exc}"
        finally:
            self._slock.release()
        job.finish(ok, self._log)
        if failure:
            self._fail(failure)

    def stop(self) -> None:
        """The link broke: the sender thread sends what is queued (or fails it, once the
        socket is down) and ends; a paused reader wakes."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            self._room.notify_all()

    # -- backpressure ------------------------------------------------------------------------
    def over_limits(self, share: float = 1.0) -> bool:
        """Whether the link holds ``share`` of its limits of the peer's work, or more (a
        glance, or under the queue's lock); twice that while this side awaits answers."""
        limits = self._limits
        if self._awaiting():
            share *= 2
        return (
            self._queued_bytes >= limits.queued_bytes * share
            or self._answers >= limits.requests * share
        )

    def pause(self) -> None:
        """(Reader thread, no lock held.) Leave the peer's requests on the socket until the
        sender drained the link to half its limits, or the link broke; meanwhile TCP flow
        control holds the peer. Other links are not concerned."""
        with self._cond:
            if not self.over_limits():  # drained meanwhile
                return
            start = self._paused_since = now_ns()
            self._pauses += 1
            try:
                while not self._broken() and not self._exited and self.over_limits(0.5):
                    self._room.wait(_PAUSE_TICK_S)
            finally:
                self._paused_since = 0
                self._paused_ns += now_ns() - start
                held_ms = (now_ns() - start) / 1e6
        self._log.debug("tcp.reading_paused", paused_ms=round(held_ms, 3))

    def stats(self) -> ChannelStats:
        """What the link holds of the peer's work now, its high-water marks and pauses."""
        with self._cond:
            since = self._paused_since
            paused_ns = self._paused_ns + (now_ns() - since if since else 0)
            return ChannelStats(
                queued_bytes=self._queued_bytes,
                queued_bytes_max=self._queued_bytes_max,
                requests=self._answers,
                requests_max=self._answers_max,
                pauses=self._pauses,
                paused_s=paused_ns / 1e9,
                paused=bool(since),
            )
