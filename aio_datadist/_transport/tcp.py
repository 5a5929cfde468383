"""One end of a TCP link between engines in different processes or on different hosts
(:class:`TcpChannel`: its requests and its readers); ``tcp_connect`` makes links (listen,
connect, the handshake), ``tcp_send`` sends the answers and holds the link's backpressure,
``pending`` keeps the requests awaiting answers, ``tcp_io`` moves rows through the socket.

Every frame is the fixed header of ``_wire``, its control body, then its bulk payload,
which moves with one scatter-gather native call straight from or into the memory rows of
the request (no copy through Python objects; the GIL is released while bytes move).

Frames and what they carry (``rid``: the header's ``request_id``)::

    HELLO      client -> server   body: HelloBody (cluster id, role, to_cluster_id, extensions)
    HELLO_ACK  server -> client   body: the server's HelloBody
    AUTH       handshake only, when both ends have a link secret (``auth``): the server's
               nonce, then the client's proof, then the server's proof after HELLO_ACK
    ERROR      rid 0 answers a HELLO: status = the refusal code, body = UTF-8 message;
               rid n answers request n: status = the LLMStatusCode, body = UTF-8 message
    PULL       rid, body: u64 nbytes (the payload the requester expects), then the engine's
               opaque request body; payload_len 0
    PULL_DATA  rid, payload_len = nbytes, payload: the bytes of the served rows
    PULL_DONE  rid of a pull asked with ``commit``; sent once every byte landed
    PUSH       rid, body: the engine's request body, payload_len = nbytes, payload: the bytes
    PUSH_ACK   rid; sent once every byte is in the serving side's memory
    BYE        the sender closes the link; answered with BYE_ACK, then both ends close;
               status 0: an unlink (the link goes at both ends), LLM_ENGINE_FINALIZED: the
               sender's engine goes away (the link fails at the other end)
    PING/PONG  liveness (answered, never sent by this module)

Threads: each channel has one reader thread, the link's pump, and one sender thread. The
pump (``_native/pump.c``) is the only reader of the socket: the answers of this side's
requests entered in its table complete in C, and every other frame comes back to the
reader thread's Python, which reads the rest of that frame and returns to the pump. A
blocking caller waits for its request in the pump (a short busy-poll, then a futex); the
reader thread completes the futures of requests nobody waits for that way. The reader never
blocks on a send: an answer it produces is sent inline only while nothing else waits to send
and only as far as the socket takes it without waiting; the rest (and every answer while the
sender thread is busy) goes to the sender thread, which then owns the send lock. Two readers
blocked sending to each other would deadlock; this rule makes that impossible. Requests are
sent by the caller's thread under the per-channel send lock (a push sends its payload there
too).

Backpressure: the peer's work a link holds is bounded (:class:`ServeLimits`: bytes held by
queued frames, the peer's requests whose answers are not yet fully sent). Over a limit, whoever
reads leaves the peer's next request on the socket (answers to this side's requests are still
read) until the sender drained to half of it; TCP flow control then holds the peer, and no
request is dropped (``tcp_send.Outbox``). :meth:`TcpChannel.stats` counts what the link
holds and its pauses.

Deadlines: a request carries an absolute ``monotonic_ns()`` deadline (0: none); the
link's table of pending requests (``pending``) fails a request nobody answered in time with
``LLM_TIMEOUT``, through one reaper timer per link at its earliest pending deadline. A request
completes a :class:`~aio_datadist._transport.future.RequestFuture` (light enough for tens of
thousands in flight). A payload that arrives too late fails its request with ``LLM_TIMEOUT`` and
is drained into scratch memory, so the stream stays in sync and the link stays up. Frames
in progress are bounded by a stall timeout (no byte moved for ``stall_timeout`` seconds):
a stalled peer breaks the channel, which fails every pending request with
``LLM_LINK_FAILED``. A request's future completes only once the transport no longer
touches its memory rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import struct
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future

import numpy as np

from aio_datadist._log import get_logger
from aio_datadist._native.api import (
    NetTimeout,
    PeerClosed,
    sock_send_bytes,
    sock_sendv,
)
from aio_datadist._native.pump import BROKEN, LATE, FramePump, Outcome, PumpEvent
from aio_datadist._transport import DEFAULT_BUSY_POLL_US
from aio_datadist._transport._wire import (
    HEADER,
    PULL_NBYTES,
    FrameHeader,
    FrameKind,
    WireError,
    decode_header,
    pack_header,
)
from aio_datadist._transport.base import (
    Channel,
    ChannelStats,
    Hello,
    Iov,
    LinkRefused,
    Payload,
    RequestHandler,
    RequestKind,
    ServeLimits,
)
from aio_datadist._transport.deadlines import after_s, now_ns
from aio_datadist._transport.pending import PendingRequests, Request, new_future
from aio_datadist._transport.tcp_answers import PythonAnswers
from aio_datadist._transport.tcp_io import (
    IO_ERRORS,
    iov_problem,
    move_payload,
    recv_view,
    sendv_all,
)
from aio_datadist._transport.tcp_send import Outbox, OutFrame
from aio_datadist._transport.tcp_serve import PeerServer
from aio_datadist._transport.tcp_watch import LoopWatch
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ("SERVE_LIMITS", "STALL_TIMEOUT", "TcpChannel")

#: Seconds without a byte moving, mid-frame, after which the channel breaks.
STALL_TIMEOUT = 30.0
#: Seconds ``close(notify_peer=True)`` waits for BYE_ACK when no timeout is given.
BYE_TIMEOUT = 5.0
#: How long an idle pump sleeps in one native call (it just calls again).
_IDLE_NS = 60_000_000_000
#: A blocking waiter sleeps on its request at most this long at a time (then looks again,
#: so the thread stays interruptible).
_WAIT_SLICE_NS = 100_000_000
#: How much of the peer's work each link made from now on may hold (a process may set its
#: own limits before it links).
SERVE_LIMITS = ServeLimits()


_HEADER_SIZE = HEADER.size
_NO_BODY = (
    FrameKind.PULL_DATA,
    FrameKind.PULL_DONE,
    FrameKind.PUSH_ACK,
    FrameKind.BYE,
    FrameKind.BYE_ACK,
    FrameKind.PING,
    FrameKind.PONG,
)
#: Why a link closed, as its channel tells: the peer unlinked or finalized and said so
#: (BYE, whose header status says which: LLM_SUCCESS or LLM_ENGINE_FINALIZED)...
_PEER_UNLINKED = "the peer unlinked"
_PEER_FINALIZED = "the peer finalized"
#: ...or its end went away without a word: its process exited or was killed, or it dropped
#: the link with a forced unlink.
_PEER_VANISHED = (
    "the peer's end of the connection closed without an unlink (its process exited or was "
    "killed, or it unlinked with force=True)"
)
_NONE: Iov = np.empty((0, 2), dtype=np.uint64)  # no payload rows


def _error(status: LLMStatusCode, message: str) -> LLMException:
    return LLMException(message, status_code=status)


def _failed(future: Future[None], status: LLMStatusCode, message: str) -> Future[None]:
    future.set_exception(_error(status, message))
    return future


def _frame(
    kind: FrameKind, rid: int = 0, *, status: int = 0, body_len: int = 0, payload_len: int = 0
) -> bytes:
    return pack_header(kind, rid, status=status, body_len=body_len, payload_len=payload_len)


def _request_ctl(kind: RequestKind, rid: int, body: bytes, nbytes: int) -> bytes:
    """The control bytes of a request frame: its header and body (a pull's body starts with
    the payload size it asks for; a push's payload follows the body)."""
    if kind is RequestKind.PULL:
        head = _frame(FrameKind.PULL, rid, body_len=PULL_NBYTES.size + len(body))
        return head + PULL_NBYTES.pack(nbytes) + body
    return _frame(FrameKind.PUSH, rid, body_len=len(body), payload_len=nbytes) + body


class _CutFrame(Exception):
    """A frame stopped after some of it was sent: the link cannot carry on."""

    def __init__(self, failure: LLMException, reason: str) -> None:
        super().__init__(reason)
        self.failure = failure
        self.reason = reason


class TcpChannel(Channel):
    """One end of a TCP link; both ends request and serve.

    ``limits`` bound the peer's work the link holds (default :data:`SERVE_LIMITS`): over
    them, its reader leaves the peer's next request on the socket until the sender drained
    the link to half of them (:meth:`stats` counts the pauses).
    """

    watched = True

    pull_in_caller = False
    push_in_caller = True
    streams = True

    def __init__(
        self,
        sock: socket.socket,
        peer: Hello,
        handler: RequestHandler,
        *,
        remote: str,
        stall_timeout: float = STALL_TIMEOUT,
        busy_poll_us: int = DEFAULT_BUSY_POLL_US,
        limits: ServeLimits | None = None,
    ) -> None:
        self.peer = peer
        self.remote = remote
        self._sock = sock
        self._fd = sock.fileno()
        self._handler = handler
        self._stall_s = stall_timeout
        self._spin_ns = max(0, int(busy_poll_us)) * 1000
        self._log = get_logger("tcp", remote=remote, remote_cluster_id=peer.cluster_id)
        self._ids = itertools.count(1)
        try:  # the one reader of the socket (see the module docstring)
            self._pump = FramePump(self._fd, stall_timeout)
        except OSError as exc:
            reason = f"cannot read the link: {exc}"
            raise LinkRefused(LLMStatusCode.LLM_LINK_FAILED, reason) from exc
        # Lock order: _slock, then _lock; never the other way round.
        self._slock = threading.Lock()  # one frame at a time on the socket
        self._lock = threading.Lock()  # state below
        self._pending = PendingRequests(
            self._lock, self._taking, self._link_failed, held=self._held_by_pump
        )
        self._callbacks: list[Callable[[Channel], None]] = []
        self._broken = False
        # Why it closes: set by the peer's BYE as it arrives (the link breaks once BYE_ACK
        # is out), else by whatever breaks it.
        self._reason: str | None = None
        self._unlinked = False  # the peer's BYE was an unlink
        self._closing = False  # no new requests
        self._local_close = False  # this end closes: its own on_close callbacks do not run
        self._peer_knows = False  # BYE exchanged (either way)
        self._bye_acked = False
        self._bye_wake = threading.Event()  # BYE_ACK came or the channel broke
        self._gone = threading.Event()
        self._outbox = Outbox(
            self._fd,
            self._slock,
            stall_timeout,
            SERVE_LIMITS if limits is None else limits,
            self._log,
            broken=lambda: self._broken,
            fail=self._break,
            awaiting=lambda: bool(self._pending),
        )
        self._hdr = bytearray(_HEADER_SIZE)
        self._server = PeerServer(
            self._fd,
            peer,
            handler,
            self._outbox,
            self._slock,
            stall_s=stall_timeout,
            spin_ns=self._spin_ns,
            broken=lambda: self._broken,
            log=self._log,
        )
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._watch = LoopWatch(self._pump, self._settle_done, self._dup_fd)
        self._answers = PythonAnswers(
            self._fd,
            stall_timeout,
            self._pending,
            self._outbox,
            held=self._held_by_pump,
            end=self._end,
            drain=self._server.drain,
            link_failed=self._link_failed,
            log=self._log,
        )

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<TcpChannel {self.remote} cluster={self.peer.cluster_id} {state}>"

    def start(self) -> None:
        """Start the reader and sender threads (once the handshake is done).

        :raises LinkRefused: ``LLM_LINK_FAILED`` when a thread cannot start; the channel
            is then broken, and its socket left to the caller (to refuse the peer, close).
        """
        reader = threading.Thread(
            target=self._read_loop, name=f"aio-dd-tcp-read-{self.remote}", daemon=True
        )
        sender = threading.Thread(
            target=self._outbox.run, name=f"aio-dd-tcp-send-{self.remote}", daemon=True
        )
        # Known before they run: each thread tells itself apart by these.
        self._sender, self._reader = sender, reader
        try:
            sender.start()
            reader.start()
        except RuntimeError as exc:  # out of threads: nothing of this link may stay
            if not sender.is_alive():
                self._sender = None
            self._reader = None
            reason = f"cannot start the link's threads: {exc}"
            self._break(reason, shutdown=False)
            self._join(after_s(1.0))
            raise LinkRefused(LLMStatusCode.LLM_LINK_FAILED, reason) from exc

    @contextlib.contextmanager
    def sends_held(self) -> Generator[None, None, None]:
        """Hold every send of this channel (requests and answers queue) while the block
        runs: the listener's HELLO_ACK goes out before anything else."""
        with self._slock:
            yield

    def abort(self, reason: str) -> None:
        """Break this end now for ``reason`` (the handshake could not be finished)."""
        self._break(reason)

    # -- Channel contract --------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closing or self._broken

    @property
    def close_reason(self) -> str | None:
        return self._reason

    @property
    def unlinked_by_peer(self) -> bool:
        return self._unlinked

    def on_close(self, callback: Callable[[Channel], None]) -> None:
        with self._lock:
            if not self._broken and not self._local_close:
                self._callbacks.append(callback)
                return
        callback(self)

    def stats(self) -> ChannelStats:
        return self._outbox.stats()

    def pull(
        self, body: bytes, dst: Payload, nbytes: int, deadline_ns: int, *, commit: bool = False
    ) -> Future[None]:
        problem = iov_problem(dst, nbytes)
        if problem is not None:
            return _failed(new_future(), LLMStatusCode.LLM_PARAM_INVALID, f"pull: {problem}")
        rid = next(self._ids)
        try:
            ctl = _request_ctl(RequestKind.PULL, rid, body, nbytes)
        except (WireError, struct.error) as exc:
            return _failed(new_future(), LLMStatusCode.LLM_PARAM_INVALID, f"pull: {exc}")
        req = Request(rid, RequestKind.PULL, dst, nbytes, deadline_ns, commit=commit)
        if not self._pending.add(req):
            return req.future
        if not commit and isinstance(dst, np.ndarray):  # else its answer comes to Python
            try:
                self._pump.enter(rid, FrameKind.PULL_DATA, dst, nbytes, deadline_ns)
            except LLMException as exc:  # rows the native layer refuses: nothing was sent
                self._pending.settle(rid, _error(exc.status_code, f"pull: {exc}"))
                return req.future
        failure, broke = self._send_request(
            "pull",
            "request",
            deadline_ns,
            lambda: sock_send_bytes(self._fd, ctl, self._send_deadline(deadline_ns)),
        )
        if failure is not None:
            self._end(rid, failure)
        if broke:
            self._break(broke)
        return req.future

    def push(self, body: bytes, src: Payload, nbytes: int, deadline_ns: int) -> Future[None]:
        problem = iov_problem(src, nbytes)
        if problem is not None:
            return _failed(new_future(), LLMStatusCode.LLM_PARAM_INVALID, f"push: {problem}")
        rid = next(self._ids)
        try:
            ctl = _request_ctl(RequestKind.PUSH, rid, body, nbytes)
        except (WireError, struct.error) as exc:
            return _failed(new_future(), LLMStatusCode.LLM_PARAM_INVALID, f"push: {exc}")
        req = Request(rid, RequestKind.PUSH, None, nbytes, deadline_ns, busy=True)
        if not self._pending.add(req):
            return req.future
        self._pump.enter(rid, FrameKind.PUSH_ACK, None, 0, deadline_ns)

        def sendv(iov: Iov) -> None:
            if deadline_ns > 0:
                sock_sendv(self._fd, iov, deadline_ns)
            else:
                sendv_all(self._fd, iov, self._stall_s)

        if isinstance(src, np.ndarray):
            frame = OutFrame(ctl, src)

            def send() -> None:
                sendv(frame.iov)
        else:

            def send() -> None:
                sendv(OutFrame(ctl).iov)
                moved, error = move_payload(sendv, src)
                if error is None:
                    return
                if isinstance(error, LLMException):
                    raise _CutFrame(error, "a push's payload could not be staged mid-frame")
                if isinstance(error, NetTimeout):  # counts the control bytes already sent
                    raise NetTimeout(str(error), len(ctl) + moved) from error
                raise error

        failure, broke = self._send_request("push", "payload", deadline_ns, send)
        self._sent(req, failure, broke)
        return req.future

    def spin(self, future: Future[None], deadline_ns: int) -> None:
        """Read the link through the pump for ``future`` (a request of this link) in the
        calling thread, for up to the busy-poll time when nobody else reads it; a payload
        still arriving then stays the pump's, for the next driver."""
        rid = getattr(future, "request_id", 0)
        if future.done() or not rid or self._spin_ns <= 0:
            return
        until = now_ns() + self._spin_ns
        if 0 < deadline_ns < until:
            until = deadline_ns
        got = self._pump.wait(rid, self._spin_ns, until)
        if got is not True and got is not False:
            self._settle(got)

    def _sent(self, req: Request, failure: LLMException | None, broke: str) -> None:
        """A busy request's frame went out (or failed): unless it failed, it now waits for
        its answer like any other."""
        if failure is not None:
            self._pump.forget(req.rid)
        self._pending.sent(req, failure)
        if broke:
            self._break(broke)

    def _send_request(
        self, call: str, what: str, deadline_ns: int, send: Callable[[], None]
    ) -> tuple[LLMException | None, str]:
        """Send a request under the send lock: (its failure or None, why the link broke or "")."""
        if not self._acquire_send(deadline_ns):
            return _error(
                LLMStatusCode.LLM_TIMEOUT, f"{call}: the link stayed busy past the deadline"
            ), ""
        return self._sending(call, what, send)

    def _sending(
        self, call: str, what: str, send: Callable[[], None]
    ) -> tuple[LLMException | None, str]:
        """:meth:`_send_request` with the send lock held; it lets the lock go."""
        try:
            if self._broken:
                return self._link_failed(), ""
            send()
        except NetTimeout as exc:
            failure = _error(LLMStatusCode.LLM_TIMEOUT, f"{call}: {what} not sent by the deadline")
            return failure, (f"a {call} was cut off by its deadline" if exc.transferred else "")
        except IO_ERRORS as exc:
            return self._link_failed(f"send failed: {exc}"), f"send failed: {exc}"
        except LLMException as exc:  # rows the native layer refused; nothing was sent
            return exc, ""
        except _CutFrame as exc:
            return exc.failure, exc.reason
        finally:
            self._slock.release()
        return None, ""

    def close(
        self, *, notify_peer: bool, timeout: float | None = None, finalizing: bool = False
    ) -> bool:
        """Close this end (see ``Channel.close``); returns once this channel's threads ended
        (within ``timeout``), so nothing of it touches memory afterwards."""
        limit = BYE_TIMEOUT if timeout is None else max(0.0, timeout)
        deadline = after_s(limit)
        bye = int(LLMStatusCode.LLM_ENGINE_FINALIZED) if finalizing else 0
        told = self._close(notify_peer, limit, deadline, bye)
        self._join(deadline)
        self._watch.end()
        return told

    def _join(self, deadline_ns: int) -> None:
        """Wait until the reader and sender threads ended, at most until ``deadline_ns``."""
        me = threading.current_thread()
        for thread in (self._sender, self._reader):
            if thread is not None and thread is not me and thread.is_alive():
                thread.join(max(0.0, (deadline_ns - now_ns()) / 1e9))

    def _close(self, notify_peer: bool, limit: float, deadline: int, bye: int = 0) -> bool:
        with self._lock:
            if self._broken:
                return self._peer_knows or not notify_peer
            first = not self._local_close
            self._local_close = self._closing = True
        if not first:  # another thread is closing it
            self._gone.wait(limit)
            return self._peer_knows or not notify_peer
        told = False
        if notify_peer:
            # BYE goes out behind the frames already queued, from the sender thread: a
            # long answer holding the send lock only delays it (it is never dropped because
            # the lock was busy), within the close's time.
            went = threading.Event()
            outcome: list[bool] = []

            def after(ok: bool) -> None:
                outcome.append(ok)
                went.set()

            self._outbox.enqueue(OutFrame(_frame(FrameKind.BYE, status=bye), after=after))
            sent = went.wait(max(0.0, (deadline - now_ns()) / 1e9)) and outcome[0]
            if not sent:
                self._log.info("tcp.bye_failed", reason="not sent within the close's time")
            if sent:
                if threading.current_thread() is self._reader:
                    told = True  # our own reader would read the BYE_ACK: do not wait for it
                else:
                    self._bye_wake.wait(max(0.0, (deadline - now_ns()) / 1e9))
                    # A peer that closed at the same time sent BYE itself: it knows too.
                    told = self._bye_acked or self._peer_knows
        with self._lock:
            told = self._peer_knows = self._peer_knows or told
        self._break("closed by this side")
        return told or not notify_peer

    # -- requests: bookkeeping ---------------------------------------------------------------
    def _link_failed(self, breaking: str | None = None) -> LLMException:
        """The failure of a request on this closed link; ``breaking``: why it is about to
        break (for a failure made before :meth:`_break` records it)."""
        reason = self._reason or breaking
        why = f": {reason}" if reason else ""
        return _error(
            LLMStatusCode.LLM_LINK_FAILED,
            f"link to cluster {self.peer.cluster_id} at {self.remote} is closed{why}",
        )

    def _taking(self) -> bool:
        """Whether the link takes new requests (``_lock`` held)."""
        return not (self._closing or self._broken)

    def _held_by_pump(self, rid: int) -> bool:
        """Whether the pump holds request ``rid`` (its payload moving, or its outcome not yet
        taken): then only whoever takes that outcome may end it; else it is out of the
        pump's table from now on."""
        return not self._pump.forget(rid)

    def _end(self, rid: int, outcome: LLMException | None, kind: RequestKind | None = None) -> bool:
        """End request ``rid`` with ``outcome`` unless the pump holds it; False if it did not
        (then it is not this caller's to end, or it is not pending)."""
        if self._held_by_pump(rid):
            return False
        return self._pending.settle(rid, outcome, kind)

    def _settle(self, outcome: Outcome) -> None:
        """End the request the pump completed with ``outcome``."""
        rid, code = outcome.request_id, outcome.code
        if code == LATE:
            failure: LLMException | None = _error(
                LLMStatusCode.LLM_TIMEOUT,
                f"pull {rid}: deadline passed after {outcome.moved} bytes of its payload",
            )
        elif code == BROKEN:
            failure = self._link_failed("receive failed")
        else:
            failure = None
        self._pending.settle(rid, failure)

    def _settle_done(self) -> None:
        """End the requests the pump completed that no caller claimed."""
        for outcome in self._pump.take_done():
            self._settle(outcome)

    def _acquire_send(self, deadline_ns: int) -> bool:
        if deadline_ns <= 0:
            return self._slock.acquire()
        return self._slock.acquire(timeout=max(0.0, (deadline_ns - now_ns()) / 1e9))

    def _send_deadline(self, deadline_ns: int) -> int:
        return deadline_ns if deadline_ns > 0 else after_s(self._stall_s)

    # -- breaking ----------------------------------------------------------------------------
    def _break(self, reason: str, *, shutdown: bool = True) -> None:
        """Close this end now: fail pending requests, stop the sender, run on_close callbacks;
        the socket is shut down (unless ``shutdown`` is False: no reader thread ever ran)."""
        with self._lock:
            if self._broken:
                return
            self._broken = self._closing = True
            if self._reason is None:  # the peer's BYE said why first
                self._reason = reason
            local = self._local_close
            callbacks, self._callbacks = ([] if local else self._callbacks), []
            # Wakes the reader and any sender; the reader closes the descriptor on its way out.
            if shutdown:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
        self._bye_wake.set()
        self._outbox.stop()
        failed = self._pending.fail_all()
        self._server.forget()
        if self._reader is None:  # no reader thread ever ran: the pump's descriptor goes now
            self._pump.close()
        if local or self._peer_knows:
            self._log.info("tcp.closed", reason=reason, failed_requests=failed)
        else:
            self._log.warning("tcp.broken", reason=reason, failed_requests=failed)
        self._gone.set()
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                self._log.warning("tcp.on_close_failed", exc_info=True)

    # -- sending answers ---------------------------------------------------------------------
    # -- reading: the pump -------------------------------------------------------------------
    def _read_loop(self) -> None:
        """The reader thread: the pump reads every frame; this thread takes what it hands back
        (a frame for Python, the peer's request, the outcomes nobody claimed)."""
        reason = "closed"
        # Busy-poll right after the peer's requests: in a run of small requests the next
        # one follows within microseconds. (While answers are due the pump busy-polls anyway.)
        spin_first = False
        pump = self._pump
        try:
            while not self._broken:
                event, header = pump.run(self._spin_ns, spin_first, _IDLE_NS)
                spin_first = False
                failure: str | None = None
                if event is PumpEvent.DONE:
                    self._settle_done()
                elif event is PumpEvent.FRAME:
                    failure = self._read_frame(header)
                elif event is PumpEvent.PEER:
                    spin_first = True
                    failure = self._on_peer_request()
                elif event is PumpEvent.STALLED:
                    failure = f"the peer stalled mid-frame for {self._stall_s} s"
                elif event is PumpEvent.CLOSED:
                    failure = _PEER_VANISHED
                if failure is not None:
                    reason = failure
                    break
        except OSError as exc:
            reason = f"socket error: {exc}"
        except Exception:
            self._log.warning("tcp.reader_failed", exc_info=True)
            reason = "internal error in the reader"
        finally:
            self._break(reason)
            pump.close()
            self._settle_done()  # what was in the table fails with the link
            # Only now may the descriptor go: no sender holds the lock with the link up.
            with self._slock, self._lock:
                self._sock.close()

    def _on_peer_request(self) -> str | None:
        """One of the peer's requests waits on the socket: answer it (and those after it) in
        native code where the serve table can, else read it here; over the link's limits,
        leave it there until the sender drained. Why the channel must break, if so."""
        if self._outbox.over_limits():
            self._outbox.pause()  # the peer's request waits; TCP flow control holds the peer
            return None
        served = self._server.answer_natively()
        if isinstance(served, str):
            return served
        return None if served else self._read_frame(None)

    def read_for(self, future: Future[None], deadline_ns: int) -> None:
        """Wait in this thread for ``future`` (a request of this link) until it completed or
        its deadline passed: for the busy-poll time this thread reads the link through the
        pump when nobody else does (its answer then costs no hand-over), then it sleeps until
        the reader thread's read wakes it; it completes its request itself."""
        rid = getattr(future, "request_id", 0)
        if not rid:
            return
        pump, spin = self._pump, self._spin_ns
        while not future.done():
            now = now_ns()
            if 0 < deadline_ns <= now:
                return  # the deadline's own timer ends it
            until = now + _WAIT_SLICE_NS
            if 0 < deadline_ns < until:
                until = deadline_ns
            got = pump.wait(rid, spin, until)
            if got is False:
                return  # out of the table: whoever took it out ends it
            if got is not True:
                self._settle(got)
                return
            spin = 0

    def watch(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        """Let ``loop`` (running in the calling thread) read the link through the pump while
        it awaits requests (:class:`~aio_datadist._transport.tcp_watch.LoopWatch`)."""
        return self._watch.watch(loop)

    def _dup_fd(self) -> int | None:
        """A duplicate of the socket's descriptor, for a loop's selector; None once broken."""
        with self._lock:  # the descriptor closes only after _broken is set, under _lock
            return None if self._broken else os.dup(self._fd)

    def _read_frame(self, header: bytes | None) -> str | None:
        """Read and handle the frame whose header the pump handed back (None: read the
        header here first); why the channel must break, if so."""
        try:
            if header is None:
                recv_view(self._fd, memoryview(self._hdr), self._stall_s)
                header = bytes(self._hdr)
            self._dispatch(decode_header(header))
        except PeerClosed:
            return _PEER_VANISHED
        except NetTimeout:
            return f"the peer stalled mid-frame for {self._stall_s} s"
        except WireError as exc:
            return f"malformed frame: {exc}"
        except OSError as exc:
            return f"socket error: {exc}"
        except Exception:
            self._log.warning("tcp.reader_failed", exc_info=True)
            return "internal error in the reader"
        return None

    def _dispatch(self, h: FrameHeader) -> None:
        kind = h.kind
        if h.payload_len and kind not in (FrameKind.PULL_DATA, FrameKind.PUSH):
            raise WireError(f"{kind.name} frame with a payload")
        if h.body_len and kind in _NO_BODY:
            raise WireError(f"{kind.name} frame with a body")
        rid = h.request_id
        if kind is FrameKind.PULL_DATA:
            self._answers.on_pull_data(h)
        elif kind is FrameKind.PUSH_ACK:
            self._end(rid, None, RequestKind.PUSH)
        elif kind is FrameKind.ERROR:
            self._answers.on_error(h, self._server.read_body(h.body_len))
        elif kind is FrameKind.PULL:
            self._server.on_pull(h, self._server.read_body(h.body_len))
        elif kind is FrameKind.PUSH:
            self._server.on_push(h, self._server.read_body(h.body_len))
        elif kind is FrameKind.PULL_DONE:
            self._server.on_pull_done(rid)
        elif kind is FrameKind.PING:
            self._outbox.send_or_queue(OutFrame(_frame(FrameKind.PONG, rid), answer=True))
        elif kind is FrameKind.BYE:
            self._on_bye(h.status)
        elif kind is FrameKind.BYE_ACK:
            self._bye_acked = True
            self._bye_wake.set()
        elif kind is FrameKind.PONG:
            pass
        else:
            raise WireError(f"unexpected {kind.name} frame on an established link")

    # -- answers to our requests -------------------------------------------------------------
    def _on_bye(self, status: int) -> None:
        finalized = status == LLMStatusCode.LLM_ENGINE_FINALIZED
        reason = _PEER_FINALIZED if finalized else _PEER_UNLINKED
        with self._lock:
            # Closed from now on, and why: a caller that finds it closed before BYE_ACK is
            # out reads the peer's reason.
            self._closing = True
            self._peer_knows = True
            self._unlinked = not finalized
            if self._reason is None:
                self._reason = reason
        self._outbox.send_or_queue(
            OutFrame(_frame(FrameKind.BYE_ACK), after=lambda ok: self._break(reason))
        )

    # -- serving the peer's requests ---------------------------------------------------------
