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
import functools
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
    sock_recvv,
    sock_send_bytes,
    sock_sendv,
)
from aio_datadist._native.pump import BROKEN, LATE, FramePump, Outcome, PumpEvent
from aio_datadist._native.serve import ServeWorker
from aio_datadist._transport import DEFAULT_BUSY_POLL_US
from aio_datadist._transport._wire import (
    HEADER,
    MAX_PAYLOAD,
    PULL_NBYTES,
    FrameHeader,
    FrameKind,
    WireError,
    decode_error_text,
    decode_header,
    encode_error_text,
    pack_header,
    status_from_wire,
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
    Served,
    ServeLimits,
)
from aio_datadist._transport.deadlines import after_s, now_ns
from aio_datadist._transport.pending import PendingRequests, Request, new_future
from aio_datadist._transport.tcp_io import (
    IO_ERRORS,
    iov_skip,
    move_payload,
    recv_view,
    recvv_all,
    sendv_all,
)
from aio_datadist._transport.tcp_send import Outbox, OutFrame
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ("SERVE_LIMITS", "STALL_TIMEOUT", "TcpChannel")

#: Seconds without a byte moving, mid-frame, after which the channel breaks.
STALL_TIMEOUT = 30.0
#: Seconds ``close(notify_peer=True)`` waits for BYE_ACK when no timeout is given.
BYE_TIMEOUT = 5.0
#: Served pulls waiting for their PULL_DONE; beyond this the oldest is forgotten.
MAX_UNCOMMITTED = 4096
#: How long an idle pump sleeps in one native call (it just calls again).
_IDLE_NS = 60_000_000_000
#: A blocking waiter sleeps on its request at most this long at a time (then looks again,
#: so the thread stays interruptible).
_WAIT_SLICE_NS = 100_000_000
#: How much of the peer's work each link made from now on may hold (a process may set its
#: own limits before it links).
SERVE_LIMITS = ServeLimits()
#: An answer's payload rows are copied behind its header, so that one call (inline in the
#: reader, when the socket takes it all) sends both, up to this many rows; a bigger table is
#: sent as it is, by the sender thread.
_COPY_ROWS = 1 << 16


#: Row tables up to this many rows are summed as Python ints (:func:`_iov_problem`).
_FEW_ROWS = 16
#: Scratch buffer for draining unwanted payloads.
_SCRATCH = 1 << 20

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


def _iov_problem(iov: object, nbytes: int) -> str | None:
    """None when ``iov`` is well-formed rows (or segments) that add up to ``nbytes``; else
    what is wrong."""
    if not isinstance(iov, np.ndarray) and hasattr(iov, "segments"):
        size = getattr(iov, "nbytes", None)
        return None if size == nbytes else f"segments hold {size} bytes, not {nbytes}"
    if not isinstance(iov, np.ndarray) or iov.dtype != np.uint64:
        return "memory rows must be a uint64 numpy array"
    if iov.ndim != 2 or iov.shape[1] != 2:
        return f"memory rows must have shape (n, 2), not {iov.shape}"
    if not (iov.flags.c_contiguous and iov.flags.aligned):
        return "memory rows must be C-contiguous"
    # (A few rows add up faster as Python ints than through numpy.)
    total = sum(iov[:, 1].tolist()) if iov.shape[0] <= _FEW_ROWS else int(iov[:, 1].sum())
    if total != nbytes:
        return f"memory rows add up to {total} bytes, not {nbytes}"
    return None


class _CutFrame(Exception):
    """A frame stopped after some of it was sent: the link cannot carry on."""

    def __init__(self, failure: LLMException, reason: str) -> None:
        super().__init__(reason)
        self.failure = failure
        self.reason = reason


class _Commit:
    """A served pull whose commit waits for the requester's PULL_DONE."""

    __slots__ = ("asked", "fn", "sent")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.sent: bool | None = None  # None while the payload is still being sent
        self.asked = False  # PULL_DONE arrived before the send finished


class TcpChannel(Channel):
    """One end of a TCP link; both ends request and serve.

    ``limits`` bound the peer's work the link holds (default :data:`SERVE_LIMITS`): over
    them, its reader leaves the peer's next request on the socket until the sender drained
    the link to half of them (:meth:`stats` counts the pauses).
    """

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
        self._commits: dict[int, _Commit] = {}
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
        self._scratch: bytearray | None = None
        # Small pulls and pushes of blocks the reader thread answers in native code.
        table = handler.serve_table
        self._native: ServeWorker | None = None if table is None else table.worker()
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        # An event loop reading the link through the pump (see watch); touched on that
        # loop's thread only.
        self._watch_loop: asyncio.AbstractEventLoop | None = None
        self._watchers = 0
        self._loop_fd = -1  # a duplicate of the socket's descriptor, in the loop's selector

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
        problem = _iov_problem(dst, nbytes)
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
        problem = _iov_problem(src, nbytes)
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

    def exchange(
        self,
        kind: RequestKind,
        body: bytes,
        local: Payload,
        nbytes: int,
        deadline_ns: int,
        *,
        on_loop: bool = False,
    ) -> Future[None] | None:
        """Start a request whose caller waits for it next, and read the link for it in the
        calling thread for up to the busy-poll time (an event loop too: it never waits
        longer, and an answer still to come then completes at its selector's readiness)."""
        future = super().exchange(kind, body, local, nbytes, deadline_ns, on_loop=on_loop)
        rid = getattr(future, "request_id", 0)
        if future is None or future.done() or not rid or self._spin_ns <= 0:
            return future
        until = now_ns() + self._spin_ns
        if 0 < deadline_ns < until:
            until = deadline_ns
        got = self._pump.wait(rid, self._spin_ns, until)
        if got is not True and got is not False:
            self._settle(got)
        return future

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
        self._end_watch()
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
            self._commits.clear()
            # Wakes the reader and any sender; the reader closes the descriptor on its way out.
            if shutdown:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
        self._bye_wake.set()
        self._outbox.stop()
        failed = self._pending.fail_all()
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
    def _reply_error(self, rid: int, status: LLMStatusCode, message: str) -> None:
        body = encode_error_text(message)
        ctl = _frame(FrameKind.ERROR, rid, status=int(status), body_len=len(body)) + body
        self._outbox.send_or_queue(OutFrame(ctl, answer=True))

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
        served = self._answer_natively()
        if isinstance(served, str):
            return served
        return None if served else self._read_frame(None)

    def _answer_natively(self) -> bool | str:
        """Answer the small pulls and pushes of blocks waiting on the socket in native code;
        whether it answered any (else the first frame is one for :meth:`_read_frame`), or
        why the channel must break.

        Only while the sender thread is idle and the send lock free, as for any answer the
        reader sends; the rest of an answer the kernel took in part goes to the sender.
        """
        native = self._native
        if native is None or not self._outbox.idle() or not self._slock.acquire(blocking=False):
            return False
        handed_over = False
        try:
            if self._broken:
                return True
            result = native.serve(self._fd, MAX_PAYLOAD, self._spin_ns)
            partial = result.partial
            if partial is None:
                return result.served > 0
            kind = FrameKind(partial.kind)
            ctl = _frame(kind, partial.request_id, payload_len=partial.nbytes)
            rows = partial.rows if len(partial.rows) else None
            job = OutFrame(ctl, rows, partial.release, answer=True)
            job.iov = iov_skip(job.iov, partial.sent)
            job.lock_held = handed_over = True
            self._outbox.enqueue(job)
            return True
        except (PeerClosed, OSError) as exc:
            return f"send failed: {exc}"
        finally:
            if not handed_over:
                self._slock.release()

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
        it awaits requests; the returned call ends this wait's part in it.

        The loop's selector watches (a duplicate of) the socket; at each readiness the loop
        reads what is there without waiting, completing answers (its own among them) on the
        loop. It keeps watching between its requests; the first frame for the reader thread
        (the peer's requests, refusals, ...) ends the watch until its next request.
        """
        if self._watch_loop is not None and self._watch_loop is not loop:
            return None  # another loop watches this link; this one waits as usual
        if self._loop_fd < 0 and not self._start_watching(loop):
            return None
        self._watch_loop = loop
        self._watchers += 1
        self._pump.expect()
        return self._unwatch

    def _start_watching(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Put (a duplicate of) the socket in ``loop``'s selector; False once broken."""
        with self._lock:  # the descriptor closes only after _broken is set, under _lock
            if self._broken:
                return False
            fd = os.dup(self._fd)
        try:
            loop.add_reader(fd, self._loop_read)
        except BaseException:
            os.close(fd)
            raise
        self._loop_fd = fd
        return True

    def _loop_read(self) -> None:
        """(On the watching loop, at the socket's readiness.)"""
        mine = self._pump.poll()
        self._settle_done()
        if not mine:
            self._stop_watching()

    def _unwatch(self) -> None:
        self._watchers -= 1
        if self._watchers == 0 and self._loop_fd < 0:
            self._watch_loop = None

    def _stop_watching(self) -> None:
        """Take the socket out of the loop's selector (on the loop's thread)."""
        fd, self._loop_fd = self._loop_fd, -1
        loop = self._watch_loop
        if self._watchers == 0:
            self._watch_loop = None
        if fd >= 0:
            try:
                if loop is not None and not loop.is_closed():
                    loop.remove_reader(fd)
            finally:
                os.close(fd)

    def _end_watch(self) -> None:
        """Let the watching loop's descriptor go with the link (its loop may be gone)."""
        loop = self._watch_loop
        if self._loop_fd < 0 or loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or loop.is_closed():
            self._stop_watching()
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile: the selector went with it
            loop.call_soon_threadsafe(self._stop_watching)

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

    def _read_body(self, n: int) -> bytearray:
        buf = bytearray(n)
        if n:
            recv_view(self._fd, memoryview(buf), self._stall_s)
        return buf

    def _drain(self, n: int) -> None:
        """Read and discard ``n`` payload bytes."""
        if n <= 0:
            return
        if self._scratch is None:
            self._scratch = bytearray(_SCRATCH)
        view = memoryview(self._scratch)
        while n > 0:
            step = min(n, _SCRATCH)
            recv_view(self._fd, view[:step], self._stall_s)
            n -= step

    def _dispatch(self, h: FrameHeader) -> None:
        kind = h.kind
        if h.payload_len and kind not in (FrameKind.PULL_DATA, FrameKind.PUSH):
            raise WireError(f"{kind.name} frame with a payload")
        if h.body_len and kind in _NO_BODY:
            raise WireError(f"{kind.name} frame with a body")
        rid = h.request_id
        if kind is FrameKind.PULL_DATA:
            self._on_pull_data(h)
        elif kind is FrameKind.PUSH_ACK:
            self._end(rid, None, RequestKind.PUSH)
        elif kind is FrameKind.ERROR:
            self._on_error(h, self._read_body(h.body_len))
        elif kind is FrameKind.PULL:
            self._on_pull(h, self._read_body(h.body_len))
        elif kind is FrameKind.PUSH:
            self._on_push(h, self._read_body(h.body_len))
        elif kind is FrameKind.PULL_DONE:
            self._on_pull_done(rid)
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
    def _on_pull_data(self, h: FrameHeader) -> None:
        req = (
            None
            if self._held_by_pump(h.request_id)
            else self._pending.claim(h.request_id, RequestKind.PULL)
        )
        if req is None:  # abandoned (deadline) or unknown: keep the stream in sync
            self._drain(h.payload_len)
            return
        if h.payload_len != req.nbytes:
            req.outcome = _error(
                LLMStatusCode.LLM_FAILED,
                f"the peer answered {h.payload_len} bytes for a pull of {req.nbytes}",
            )
            req.complete()
            self._drain(h.payload_len)
            return
        assert req.dst is not None

        def recv(iov: Iov) -> None:
            if req.deadline_ns > 0:
                sock_recvv(self._fd, iov, req.deadline_ns)
            else:
                recvv_all(self._fd, iov, self._stall_s)

        try:
            moved, error = move_payload(recv, req.dst)
        except BaseException as exc:
            req.outcome = self._link_failed(f"receive failed: {exc!r}")
            req.complete()
            raise
        if isinstance(error, NetTimeout):
            # dst is no longer touched: fail the request now, then drain the rest.
            req.outcome = _error(
                LLMStatusCode.LLM_TIMEOUT,
                f"pull {req.rid}: deadline passed after {moved} of {req.nbytes} bytes",
            )
        elif isinstance(error, LLMException):  # rows the native layer refused, or staging
            req.outcome = error
        elif error is not None:
            req.outcome = self._link_failed(f"receive failed: {error!r}")
            req.complete()
            raise error
        if error is not None:
            req.complete()
            self._drain(h.payload_len - moved)
            return
        req.outcome = None
        self._landed(req)

    def _landed(self, req: Request) -> None:
        """Every byte of pull ``req`` landed: complete it. A pull that asked the peer to
        commit (drop the key it named) sends PULL_DONE first, and completes once that frame
        is out: the caller's next request follows it on the link, so a pull of the same key
        meets the key dropped."""
        if not req.commit:
            req.complete()
            return
        self._outbox.send_or_queue(
            OutFrame(_frame(FrameKind.PULL_DONE, req.rid), after=lambda ok: req.complete())
        )

    def _on_error(self, h: FrameHeader, body: bytearray) -> None:
        message = decode_error_text(body)
        if h.request_id == 0:
            self._log.warning(
                "tcp.peer_error", status=str(status_from_wire(h.status)), message=message
            )
            return
        self._end(h.request_id, _error(status_from_wire(h.status), message))

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
    def _serve(self, kind: RequestKind, rid: int, body: bytes, nbytes: int) -> Served | None:
        """The handler's answer, or None after answering ERROR."""
        try:
            served = self._handler.serve(self.peer, kind, body, nbytes, stream=True)
        except LLMException as exc:
            self._reply_error(rid, exc.status_code, str(exc))
            return None
        except Exception as exc:
            self._log.warning("tcp.serve_failed", kind=kind.value, exc_info=True)
            self._reply_error(rid, LLMStatusCode.LLM_FAILED, f"serving failed: {exc!r}")
            return None
        problem = (
            f"served {served.nbytes} bytes for a request of {nbytes}"
            if served.nbytes != nbytes
            else _iov_problem(served.iov if served.stream is None else served.stream, nbytes)
        )
        if problem is not None:
            self._call_done(served.done, False)
            self._reply_error(rid, LLMStatusCode.LLM_PARAM_INVALID, problem)
            return None
        return served

    def _call_done(self, done: Callable[[bool], None], ok: bool) -> str | None:
        """Tell the handler the transport is done with what it served (``Served.done``); why
        finishing failed, if it did."""
        try:
            done(ok)
        except Exception as exc:
            self._log.warning("tcp.done_failed", exc_info=True)
            return str(exc)
        return None

    def _call_commit(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self._log.warning("tcp.commit_failed", exc_info=True)

    def _on_pull(self, h: FrameHeader, body: bytearray) -> None:
        if len(body) < PULL_NBYTES.size:
            raise WireError("PULL body lacks its byte count")
        nbytes = int(PULL_NBYTES.unpack_from(body)[0])
        rid = h.request_id
        if nbytes > MAX_PAYLOAD:  # the frame itself was whole: refuse the request only
            message = f"a pull of {nbytes} bytes exceeds {MAX_PAYLOAD}"
            self._reply_error(rid, LLMStatusCode.LLM_PARAM_INVALID, message)
            return
        request = bytes(memoryview(body)[PULL_NBYTES.size :])
        served = self._serve(RequestKind.PULL, rid, request, nbytes)
        if served is None:
            return
        commit: _Commit | None = None
        if served.commit is not None:
            commit = _Commit(served.commit)
            with self._lock:
                if len(self._commits) >= MAX_UNCOMMITTED:
                    oldest = next(iter(self._commits))
                    del self._commits[oldest]
                    self._log.warning("tcp.commit_forgotten", request_id=oldest)
                self._commits[rid] = commit
        ctl = _frame(FrameKind.PULL_DATA, rid, payload_len=nbytes)
        # The answer keeps the handler's ``done``, not ``served``: a queued answer holds one
        # row table (the frame's copy, or a big one as the handler made it), never two.
        after = functools.partial(self._pull_sent, rid, served.done, commit)
        rows = len(served.iov)
        if served.stream is not None:  # the stream holds the handler's rows
            job = OutFrame(ctl, after=after, stream=served.stream, answer=True, stream_rows=rows)
        elif rows > _COPY_ROWS:
            job = OutFrame(ctl, after=after, tail=served.iov, answer=True)
        else:
            job = OutFrame(ctl, served.iov, after, answer=True)
        self._outbox.send_or_queue(job)

    def _pull_sent(
        self, rid: int, done: Callable[[bool], None], commit: _Commit | None, ok: bool
    ) -> None:
        self._call_done(done, ok)
        if commit is None:
            return
        with self._lock:
            commit.sent = ok
            run = ok and commit.asked
            if (run or not ok) and self._commits.get(rid) is commit:
                del self._commits[rid]
        if run:
            self._call_commit(commit.fn)

    def _on_pull_done(self, rid: int) -> None:
        with self._lock:
            commit = self._commits.get(rid)
            if commit is None:
                return
            if commit.sent is None:
                commit.asked = True
                return
            del self._commits[rid]
        if commit.sent:
            self._call_commit(commit.fn)

    def _on_push(self, h: FrameHeader, body: bytearray) -> None:
        rid, nbytes = h.request_id, h.payload_len
        served = self._serve(RequestKind.PUSH, rid, bytes(body), nbytes)
        if served is None:
            self._drain(nbytes)
            return
        payload = served.iov if served.stream is None else served.stream
        try:
            moved, error = move_payload(
                lambda iov: recvv_all(self._fd, iov, self._stall_s), payload
            )
        except BaseException:
            self._call_done(served.done, False)
            raise
        if isinstance(error, LLMException):  # rows refused, or staging failed part way
            self._call_done(served.done, False)
            self._drain(nbytes - moved)
            self._reply_error(rid, error.status_code, f"push not stored: {error}")
            return
        if error is not None:
            self._call_done(served.done, False)
            raise error
        failure = self._call_done(served.done, True)
        if failure is not None:
            self._reply_error(rid, LLMStatusCode.LLM_FAILED, f"push not stored: {failure}")
            return
        self._outbox.send_or_queue(OutFrame(_frame(FrameKind.PUSH_ACK, rid), answer=True))
