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

Threads: each channel has one reader thread (reads headers with no deadline between frames,
Python once per frame) and one sender thread. One thread reads frames at a time (the read
lock): a blocking caller may take it to read its own answer (``read_for``, busy polling);
meanwhile the reader thread stays off the socket, so senders never pay for waking it. The
reader never blocks on a send: an answer it produces is sent inline only while nothing else
waits to send and only as far as the socket takes it without waiting; the rest (and every
answer while the sender thread is busy) goes to the sender thread, which then owns the send
lock. Two readers blocked sending to each other would deadlock; this rule makes that
impossible. Requests are sent by the caller's thread under the per-channel send lock (a push
sends its payload there too).

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
import enum
import fcntl
import functools
import itertools
import os
import socket
import struct
import sys
import termios
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
    sock_take_answer,
    sock_wait_readable,
)
from aio_datadist._native.serve import ServeWorker
from aio_datadist._transport import DEFAULT_BUSY_POLL_US
from aio_datadist._transport._wire import (
    HEADER,
    HEADER_KIND,
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

__all__ = ("LOOP_READ_BYTES", "SERVE_LIMITS", "STALL_TIMEOUT", "TcpChannel")

#: Seconds without a byte moving, mid-frame, after which the channel breaks.
STALL_TIMEOUT = 30.0
#: Seconds ``close(notify_peer=True)`` waits for BYE_ACK when no timeout is given.
BYE_TIMEOUT = 5.0
#: Served pulls waiting for their PULL_DONE; beyond this the oldest is forgotten.
MAX_UNCOMMITTED = 4096
#: How long an idle reader sleeps in one native call (it just calls again).
_IDLE_S = 60.0
#: After a caller read its own answer, the reader thread stays off the socket this long,
#: looking every ``_PARK_TICK_S`` instead: a thread asleep on the socket makes every sender
#: wake it, which costs the sender more than the message on a virtual machine.
_CALLERS_NS = 5_000_000
_PARK_TICK_S = 0.001
#: While an event loop reads the socket, the reader thread looks this often whether the
#: loop closed without giving the socket back. Parked for a loop or for callers, it reads
#: the next frame itself once one waited a whole tick with no reader coming to the socket
#: (a blocked loop, callers gone quiet).
_LOOP_PARK_S = 0.002
#: ... backing off to this while the link is idle.
_LOOP_PARK_MAX_S = 0.1
#: How much of the peer's work each link made from now on may hold (a process may set its
#: own limits before it links).
SERVE_LIMITS = ServeLimits()
#: An answer's payload rows are copied behind its header, so that one call (inline in the
#: reader, when the socket takes it all) sends both, up to this many rows; a bigger table is
#: sent as it is, by the sender thread.
_COPY_ROWS = 1 << 16


class _Later(enum.Enum):
    """What the loop learns when no more of the next frame is there yet: ask again later."""

    LATER = enum.auto()


_LATER = _Later.LATER
#: Largest answer frame (header, body and payload) an awaiting event loop reads itself; a
#: bigger one goes to the reader thread, so the loop never copies for long.
LOOP_READ_BYTES = 256 << 10
#: Row tables up to this many rows are summed as Python ints (:func:`_iov_problem`).
_FEW_ROWS = 16
#: Scratch buffer for draining unwanted payloads.
_SCRATCH = 1 << 20

_HEADER_SIZE = HEADER.size
_NO_PAYLOAD = (FrameKind.PULL, FrameKind.PULL_DONE, FrameKind.PUSH_ACK, FrameKind.ERROR)
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
_ANSWERS = (FrameKind.PULL_DATA, FrameKind.PUSH_ACK, FrameKind.ERROR)
_NONE: Iov = np.empty((0, 2), dtype=np.uint64)  # no payload rows
_PUSH_KIND = pack_header(FrameKind.PUSH)[HEADER_KIND]  # a header's kind field
#: The kind fields of the peer's requests, each answered by a frame of this side's.
_PEER_REQUESTS = frozenset(
    pack_header(kind)[HEADER_KIND] for kind in (FrameKind.PULL, FrameKind.PUSH, FrameKind.PING)
)
_KIND_END = HEADER_KIND.stop  # header bytes needed to tell a frame's kind


def _error(status: LLMStatusCode, message: str) -> LLMException:
    return LLMException(message, status_code=status)


def _on_loop(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether the calling thread runs ``loop``."""
    if loop is None:
        return False
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


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
        self._callers_until = 0  # monotonic ns: until then callers read (see read_for)
        self._park = threading.Event()  # set: the parked reader thread goes back to the socket
        self._served = False  # the last frame read came from the peer's side of a request
        self._log = get_logger("tcp", remote=remote, remote_cluster_id=peer.cluster_id)
        self._ids = itertools.count(1)
        # Lock order: _rlock, _slock, then _lock; never the other way round.
        self._rlock = threading.Lock()  # one reader of incoming frames at a time
        self._slock = threading.Lock()  # one frame at a time on the socket
        self._lock = threading.Lock()  # state below
        self._pending = PendingRequests(self._lock, self._taking, self._link_failed)
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
        # Bytes of the next frame's header already taken off the socket (by the loop, which
        # never waits for the rest: whoever reads next goes on from there).
        self._hdr_have = 0
        self._scratch: bytearray | None = None
        # Payload bytes of an answer nobody takes, still to discard before the next frame:
        # the reader thread drains them, so a reading caller never waits on a stalled peer.
        self._owed = 0
        # Small pulls and pushes of blocks the reader thread answers in native code.
        table = handler.serve_table
        self._native: ServeWorker | None = None if table is None else table.worker()
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        # An event loop reading the answers of the requests it awaits (see watch); its
        # state is touched on that loop's thread only.
        self._watch_loop: asyncio.AbstractEventLoop | None = None
        self._watchers = 0
        self._loop_fd = -1  # a duplicate of the socket's descriptor, in the loop's selector
        # An answer the loop is receiving as its bytes arrive: the request, the rows still
        # to fill, the bytes still due, and the timer that gives up at its deadline.
        self._loop_req: Request | None = None
        self._loop_iov: Iov | None = None
        self._loop_left = 0
        self._loop_timer: asyncio.TimerHandle | None = None
        # Times another reader came to the socket (a caller, or the loop to read, to start or
        # to end a call): the reader thread sees it is alive (a loop busy starting or
        # finishing thousands of calls reads after).
        self._reads = 0

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
        failure, broke = self._send_request(
            "pull",
            "request",
            deadline_ns,
            lambda: sock_send_bytes(self._fd, ctl, self._send_deadline(deadline_ns)),
        )
        if failure is not None:
            self._pending.settle(rid, failure)
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

    def _sent(self, req: Request, failure: LLMException | None, broke: str) -> None:
        """A busy request's frame went out (or failed): unless it failed, it now waits for
        its answer like any other."""
        self._pending.sent(req, failure)
        if broke:
            self._break(broke)

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
        """Run a small request's whole round trip in the calling thread when no other thread
        reads or sends on the link: send it, busy-poll for its answer and take the answer in
        native code, with no request table entry, future or timer. Holding the read lock
        from before the send, this caller is the only one who can meet the answer; when it
        does not come within the busy-poll time (or another frame comes first), the request
        is registered like any other and the caller waits for it as usual.

        While it holds the read lock it never waits on the socket or the send lock: two
        ends exchanging at once must each keep reading the other. A request the socket
        cannot take at once whole is registered, the read lock let go, and the rest sent
        as for any request. An event loop (``on_loop``, watching this link) exchanges
        requests of at most :data:`LOOP_READ_BYTES` and receives a payload still arriving
        when the busy-poll time ends as it receives any answer (:meth:`watch`).
        """
        if self._spin_ns <= 0 or not isinstance(local, np.ndarray):
            return super().exchange(kind, body, local, nbytes, deadline_ns)
        if on_loop and (
            nbytes > LOOP_READ_BYTES or self._loop_fd < 0 or not _on_loop(self._watch_loop)
        ):
            return super().exchange(kind, body, local, nbytes, deadline_ns)
        if not self._rlock.acquire(blocking=False):
            return super().exchange(kind, body, local, nbytes, deadline_ns)
        if not self._at_frame_start() or self.closed or not self._slock.acquire(blocking=False):
            self._rlock.release()
            return super().exchange(kind, body, local, nbytes, deadline_ns)
        return self._exchange(kind, body, local, nbytes, deadline_ns, on_loop)

    def _exchange(
        self,
        kind: RequestKind,
        body: bytes,
        local: Iov,
        nbytes: int,
        deadline_ns: int,
        on_loop: bool,
    ) -> Future[None] | None:
        """:meth:`exchange` from the point where it holds both the read and the send lock;
        it lets both go."""
        pull = kind is RequestKind.PULL
        call = "pull" if pull else "push"
        reading = sending = True
        future: Future[None] | None = None
        try:
            problem = _iov_problem(local, nbytes)
            if problem is not None:
                raise _error(LLMStatusCode.LLM_PARAM_INVALID, f"{call}: {problem}")
            rid = next(self._ids)
            try:
                ctl = _request_ctl(kind, rid, body, nbytes)
            except (WireError, struct.error) as exc:
                raise _error(LLMStatusCode.LLM_PARAM_INVALID, f"{call}: {exc}") from None
            self._callers_until = now_ns() + _CALLERS_NS  # the reader thread stays off
            self._reads += 1
            try:  # a deadline in the past: never waits
                if pull:
                    sock_send_bytes(self._fd, ctl, 1)
                else:
                    sock_sendv(self._fd, OutFrame(ctl, local).iov, 1)
            except NetTimeout as exc:  # no room for all of it: the usual machinery goes on
                frame = OutFrame(ctl, None if pull else local)
                req = Request(rid, kind, local if pull else None, nbytes, deadline_ns, busy=True)
                self._pending.add(req)
                self._rlock.release()
                reading = False
                self._unpark()
                sending = False  # _sending lets the send lock go
                rest = iov_skip(frame.iov, exc.transferred)
                failure, broke = self._sending(
                    call,
                    "request",
                    lambda: sock_sendv(self._fd, rest, self._send_deadline(deadline_ns)),
                )
                self._sent(req, failure, broke)
                return req.future
            except IO_ERRORS as exc:
                self._break(f"send failed: {exc}")
                raise self._link_failed() from None
            self._slock.release()
            sending = False
            future = self._take_answer(kind, rid, local, nbytes, deadline_ns, on_loop)
            return future
        finally:
            if sending:
                self._slock.release()
            if reading:
                self._rlock.release()
                if future is not None:
                    self._unpark()  # the answer is the reader thread's to take now

    def _take_answer(
        self,
        kind: RequestKind,
        rid: int,
        local: Iov,
        nbytes: int,
        deadline_ns: int,
        on_loop: bool,
    ) -> Future[None] | None:
        """Busy-poll for the answer of the request ``rid`` just sent (read lock held) and
        take it here; else register the request. None when the answer was taken. On a loop
        a payload still arriving when the busy-poll time ends goes on arriving on the loop."""
        pull = kind is RequestKind.PULL
        answer, into = (FrameKind.PULL_DATA, local) if pull else (FrameKind.PUSH_ACK, _NONE)
        patience_ns = deadline_ns
        if on_loop:  # the loop never waits for bytes past its busy-poll time
            patience_ns = now_ns() + self._spin_ns
            if 0 < deadline_ns < patience_ns:
                patience_ns = deadline_ns
        try:
            if sock_take_answer(
                self._fd,
                answer,
                rid,
                into,
                nbytes if pull else 0,
                spin_ns=self._spin_ns,
                deadline_ns=patience_ns,
            ):
                return None
        except NetTimeout as exc:
            if patience_ns != deadline_ns:  # the loop takes the rest as its bytes arrive
                return self._loop_continue(rid, local, nbytes, deadline_ns, exc.transferred)
            self._owed = nbytes - exc.transferred  # the deadline passed: drop the rest
            raise _error(
                LLMStatusCode.LLM_TIMEOUT,
                f"{kind.value} {rid}: deadline passed after {exc.transferred} of {nbytes} bytes",
            ) from None
        except (PeerClosed, OSError) as exc:
            self._break(f"receive failed: {exc}")
            raise self._link_failed() from None
        # Not here yet: once the read lock goes, the answer is anyone's to read.
        req = Request(rid, kind, local if pull else None, nbytes, deadline_ns)
        self._pending.add(req)
        return req.future

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

    def _end_watch(self) -> None:
        """Let the watching loop's descriptor go with the link (its loop may be gone)."""
        loop = self._watch_loop
        if self._loop_fd < 0 or loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        # An answer the loop was receiving is failed by the reader thread on its way out.
        if running is loop or loop.is_closed():
            self._stop_watching()
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile: the selector went with it
            loop.call_soon_threadsafe(self._stop_watching)

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
        self._park.set()
        self._outbox.stop()
        failed = self._pending.fail_all()
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

    # -- backpressure: how much of the peer's work a link holds -------------------------------
    def _hold_back(self) -> bool | None:
        """(``_rlock`` held.) True when the reader must leave the next frame on the socket
        for now: it is one of the peer's requests and the link holds as much of the peer's
        work as it may. None when too little of its header came to tell (what came is
        taken; the reader waits for the rest as for any header)."""
        if not self._outbox.over_limits():
            return False
        return self._peer_request_next()

    def _peer_request_next(self) -> bool | None:
        """Whether the next frame is one of the peer's requests (``_rlock`` held; never
        waits); None when too little of its header came to tell, which is then taken (as the
        loop takes a header still arriving), so that waiting for the rest never spins."""
        if self._loop_req is not None or self._owed:
            return False
        have = self._hdr_have
        if have >= _KIND_END:
            return bytes(self._hdr[HEADER_KIND]) in _PEER_REQUESTS
        try:
            more = self._sock.recv(_KIND_END - have, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None if have else False
        except OSError:  # the socket failed: whoever reads next reports it
            return False
        if not more:
            return False  # closed: whoever reads next reports it
        if have + len(more) < _KIND_END:
            view = memoryview(self._hdr)[have : have + len(more)]
            try:
                self._hdr_have = have + self._sock.recv_into(view, len(more), socket.MSG_DONTWAIT)
            except OSError:
                return False
            return None
        return (bytes(self._hdr[:have]) + more)[HEADER_KIND] in _PEER_REQUESTS

    # -- reading -----------------------------------------------------------------------------
    def _read_loop(self) -> None:
        reason = "closed"
        # Busy-poll only right after a frame of the peer's requests (a request, PULL_DONE):
        # in a run of small requests the next one follows within microseconds. After an
        # answer to this side's own request the next frame waits for this side's next move,
        # and the CPU is better left to it.
        spin = 0
        try:
            stalled = -1  # the readers' count when a frame was last seen waiting unread
            tick = _LOOP_PARK_S
            while not self._broken:
                park_s = self._parked_for(tick)
                if park_s > 0:  # another reader has the socket: off it, looking each tick
                    self._park.wait(park_s)
                    self._park.clear()
                    self._reclaim_from_closed_loop()
                    if self._hdr_have == _HEADER_SIZE:  # a frame another reader began and left
                        failure = self._read_for_absent_reader()
                        if failure is not None:
                            reason = failure
                            break
                        continue
                    if self._parked_for(tick) <= 0:
                        tick = _LOOP_PARK_S
                        continue  # the socket is this thread's again
                    if not self._readable_now():
                        stalled = -1
                        tick = min(2 * tick, _LOOP_PARK_MAX_S)  # an idle link: look less often
                        continue
                    tick = _LOOP_PARK_S
                    if stalled != self._reads:  # give the other reader a tick to come to it
                        stalled = self._reads
                        continue
                    # A frame waited a whole tick and no reader came: the loop is blocked
                    # (a synchronous call on it, say), or the callers went quiet. Take it
                    # here, so the peer's requests are served whatever the others do.
                    stalled = -1
                    failure = self._read_for_absent_reader()
                    if failure is not None:
                        reason = failure
                        break
                    continue
                if self._hdr_have == _HEADER_SIZE:
                    readable = True  # a frame the loop began and left: no bytes need come
                else:
                    owed = self._owed or self._hdr_have
                    wait_s = self._stall_s if owed else _IDLE_S
                    readable = sock_wait_readable(self._fd, after_s(wait_s), spin_ns=spin)
                    if not readable and owed and (self._owed or self._hdr_have):
                        reason = f"the peer stalled mid-frame for {self._stall_s} s"
                        break
                spin = 0
                if not readable or self._parked_for(tick) > 0:
                    continue  # (another reader began meanwhile: the frame is its, first)
                with self._rlock:  # a caller reading its own answer has it meanwhile
                    if self._broken:
                        break
                    if self._loop_fd >= 0:
                        continue  # the loop began watching while this thread waited
                    held = self._hold_back()
                    if held is None:
                        continue  # part of a header came: wait for the rest
                    if not held:
                        # A caller may have taken what woke this thread; small pulls and
                        # pushes may be answered natively.
                        waiting = self._answer_natively()
                        if isinstance(waiting, str):
                            reason = waiting
                            break
                        if not waiting:
                            spin = self._spin_ns if self._served else 0
                            continue
                        failure = self._read_frame()
                if held:
                    self._outbox.pause()  # the peer's next request waits; nothing is read
                    continue
                if failure is not None:
                    reason = failure
                    break
                spin = self._spin_ns if self._served else 0
        except OSError as exc:
            reason = f"socket error: {exc}"
        finally:
            self._break(reason)
            # Only now may the descriptor go: no sender holds the lock with the link up, and
            # no caller reads from it.
            with self._rlock, self._slock, self._lock:
                if self._loop_req is not None:  # the loop stopped watching mid-answer
                    self._loop_abort(self._link_failed())
                self._sock.close()

    def _answer_natively(self) -> bool | str:
        """Answer the small pulls and pushes of blocks waiting on the socket in native code
        (``_rlock`` held); whether a frame then waits for :meth:`_read_frame`, or why the
        channel must break.

        Only while the sender thread is idle and the send lock free, as for any answer the
        reader sends; the rest of an answer the kernel took in part goes to the sender.
        """
        native = self._native
        if native is None or not self._at_frame_start():
            return self._frame_waiting()
        if not self._outbox.idle() or not self._slock.acquire(blocking=False):
            return self._readable_now()
        handed_over = False
        try:
            if self._broken:
                return False
            result = native.serve(self._fd, MAX_PAYLOAD, self._spin_ns)
            if result.served:
                self._served = True
            partial = result.partial
            if partial is None:
                return result.pending
            self._served = True
            kind = FrameKind(partial.kind)
            ctl = _frame(kind, partial.request_id, payload_len=partial.nbytes)
            rows = partial.rows if len(partial.rows) else None
            job = OutFrame(ctl, rows, partial.release, answer=True)
            job.iov = iov_skip(job.iov, partial.sent)
            job.lock_held = handed_over = True
            self._outbox.enqueue(job)
            return self._readable_now()
        except (PeerClosed, OSError) as exc:
            return f"send failed: {exc}"
        finally:
            if not handed_over:
                self._slock.release()

    def read_for(self, future: Future[None], deadline_ns: int) -> None:
        """Busy-poll for up to the busy-poll time and read arriving frames in this thread
        while ``future`` is pending; return once it completed, the time passed with nothing
        arriving, the reader thread took the frame, the peer's push comes next (the reader
        thread receives it), the peer's next request waits over the link's limits, or the
        channel broke.

        The caller then waits for ``future`` as usual. Reading here saves the reader
        thread's wake-up and the hand-over of the answer, which together cost more than a
        small request's round trip on a busy or virtual machine.
        """
        spin = self._spin_ns
        if spin <= 0:
            return
        if not self._rlock.acquire(blocking=False):
            self._unpark()  # another thread reads; the reader thread must not doze meanwhile
            return
        self._callers_until = now_ns() + _CALLERS_NS
        self._reads += 1
        try:
            while not future.done() and not self._broken and self._at_frame_start():
                limit = now_ns() + spin
                if deadline_ns > 0:
                    limit = min(limit, deadline_ns)
                try:
                    if not sock_wait_readable(self._fd, limit, spin_ns=spin):
                        return
                except OSError:
                    return  # closed meanwhile: the reader thread reports it
                if (
                    self._hold_back() is not False
                    or self._peer_push_next()
                    or not self._read_frame_here("a reading caller")
                ):
                    return
        finally:
            self._rlock.release()
            if not future.done() or self._pending or not self._at_frame_start():
                self._unpark()  # answers still to come: the reader thread takes over now

    def watch(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        """Let ``loop`` (running in the calling thread) read the answers of the requests it
        awaits; the returned call ends this wait's part in it.

        While the loop watches, its selector watches the socket and the reader thread stays
        off it. The loop takes each answer of at most :data:`LOOP_READ_BYTES` itself,
        receiving its payload straight into the request's rows as the bytes arrive (never
        waiting: it goes on at the next readiness) and completing the request there: no
        reader-thread wake-up and no hand-over to the loop, which on a virtual machine cost
        more than the answer; a header still arriving is taken as its bytes come. The loop keeps
        watching between its requests. The first frame of anything else (the peer's
        requests, a bigger answer, a payload for segments) sends the reader thread back to
        the socket at that frame, and the loop stops watching until its next request. When
        another thread held the read lock (it took a frame while the loop was paused), the
        loop watches again :data:`_LOOP_PARK_S` later while its calls still wait.
        """
        if self._watch_loop is not None and self._watch_loop is not loop:
            return None  # another loop watches this link; this one waits as usual
        if self._loop_fd < 0 and not self._start_watching(loop):
            return None
        self._watch_loop = loop
        self._watchers += 1
        self._reads += 1
        self._callers_until = now_ns() + _CALLERS_NS
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

    def _watch_again(self) -> None:
        """(On the loop, a moment after another thread held the read lock.) Watch the socket
        again while calls on this loop still wait, so that a frame the reader thread took
        (a loop paused by the collector, say) does not leave it every answer after."""
        loop = self._watch_loop
        if self._watchers and self._loop_fd < 0 and loop is not None and _on_loop(loop):
            self._start_watching(loop)

    def _unwatch(self) -> None:
        # The loop keeps watching: its next request finds the socket in its selector and
        # the reader thread parked. The first frame not for it ends the watch.
        self._watchers -= 1
        self._reads += 1
        if self._watchers == 0 and self._loop_fd < 0:
            self._watch_loop = None

    def _disarm(self, failure: LLMException | None = None) -> None:
        """Stop the loop watching the socket and send the reader thread back to it (on the
        loop's thread, ``_rlock`` held). An answer the loop was receiving fails with
        ``failure`` (the link's failure by default) and the rest of its bytes are owed to
        the reader thread."""
        if self._loop_req is not None:
            self._loop_abort(failure or self._link_failed())
        self._stop_watching()

    def _stop_watching(self) -> None:
        """Take the socket out of the loop's selector and send the reader thread back to it
        (on the loop's thread). An answer the loop was receiving stays the loop's request:
        whoever reads next finishes it (:meth:`_read_frame`)."""
        fd, self._loop_fd = self._loop_fd, -1
        loop = self._watch_loop
        if self._watchers == 0:
            self._watch_loop = None
        self._unpark()
        if fd >= 0:
            try:
                if loop is not None and not loop.is_closed():
                    loop.remove_reader(fd)
            finally:
                os.close(fd)

    def _parked_for(self, tick: float) -> float:
        """How long the reader thread stays off the socket before it looks again (0: it
        reads): while an event loop watches, one ``tick``; while callers read their own
        answers (their window, :data:`_CALLERS_NS`, runs from each call), up to the
        window's end, at most :data:`_PARK_TICK_S`."""
        if self._loop_fd >= 0:
            return tick
        left = self._callers_until - now_ns()
        return min(left / 1e9, _PARK_TICK_S) if left > 0 else 0.0

    def _read_for_absent_reader(self) -> str | None:
        """Read the next frame in the reader thread while another reader has the socket
        but did not come to it (the rest of an answer a loop was receiving, or any frame but
        a request of the peer's held back over the limits); why the channel must break, if
        so."""
        with self._rlock:
            if self._broken:
                return None
            held = self._hold_back()
            if held is None:
                return None
            if not held:
                return self._read_frame()
        self._outbox.pause()
        return None

    def _at_frame_start(self) -> bool:
        """Whether the next byte on the socket starts a frame (``_rlock`` held): no answer
        the loop receives is in flight, no header is half taken and nothing is owed. Only
        :meth:`_read_frame` reads anywhere else."""
        return self._loop_req is None and not self._owed and not self._hdr_have

    def _reclaim_from_closed_loop(self) -> None:
        """The reader thread's check while parked for a loop: a loop that closed without
        giving the socket back (its selector went with it) leaves it to this thread."""
        loop = self._watch_loop
        if self._loop_fd >= 0 and loop is not None and loop.is_closed():
            with self._rlock:
                if self._loop_req is not None:
                    self._loop_abort(self._link_failed())
                fd, self._loop_fd = self._loop_fd, -1
                if fd >= 0:
                    os.close(fd)

    def _loop_read(self) -> None:
        """The socket is readable (on the watching loop's thread): take the answers there,
        as their bytes arrive, or hand the socket back to the reader thread."""
        self._reads += 1
        if not self._rlock.acquire(blocking=False):  # another thread reads and completes
            loop = self._watch_loop
            self._stop_watching()
            if self._watchers and loop is not None:
                loop.call_later(_LOOP_PARK_S, self._watch_again)
            return
        try:
            self._callers_until = now_ns() + _CALLERS_NS
            while True:
                if self._broken:
                    self._disarm()
                    return
                if self._loop_req is not None:
                    done = self._receive_loop_answer(wait=False)
                    if isinstance(done, str):
                        self._break(done)
                        return
                    if not done:
                        return  # the rest comes later
                    continue  # (the next header's read says when nothing more came)
                if self._owed:
                    self._disarm()
                    return
                next_up = self._loop_answer_next()
                if next_up is None:
                    self._disarm()
                    return
                if isinstance(next_up, _Later):
                    return
                if next_up.kind is FrameKind.PULL_DATA:
                    if not self._loop_begin(next_up):
                        self._disarm()
                        return
                    continue
                if not self._read_frame_here("an event loop reading an answer"):
                    self._disarm()
                    return
        finally:
            self._rlock.release()

    def _loop_begin(self, header: FrameHeader) -> bool:
        """Start receiving the pull answer ``header`` announces on the loop (``_rlock``
        held); False, nothing read, when the reader thread must take it instead (no such
        request, a size that does not match, a payload for segments)."""
        size = header.payload_len
        req = self._pending.claim(
            header.request_id,
            RequestKind.PULL,
            lambda r: r.nbytes == size and isinstance(r.dst, np.ndarray),
        )
        if req is None:
            return False
        assert isinstance(req.dst, np.ndarray)
        self._hdr_have = 0  # the header was taken by _loop_answer_next
        self._loop_receiving(req, req.dst, req.nbytes)
        return True

    def _loop_receiving(self, req: Request, iov: Iov, left: int) -> None:
        """The loop receives the rest of ``req``'s answer, ``left`` bytes into ``iov``, as
        they arrive (``_rlock`` held; the header was read)."""
        self._served = False
        self._loop_req, self._loop_iov, self._loop_left = req, iov, left

    def _loop_waits(self) -> None:
        """The answer the loop receives waits for bytes still to come: fail it at its
        deadline (one timer, armed only then: most answers have arrived whole)."""
        req, loop = self._loop_req, self._watch_loop
        if (
            self._loop_timer is None
            and req is not None
            and req.deadline_ns > 0
            and loop is not None
        ):
            self._loop_timer = loop.call_at(req.deadline_ns / 1e9, self._loop_expired, req)

    def _loop_continue(
        self, rid: int, local: Iov, nbytes: int, deadline_ns: int, moved: int
    ) -> Future[None]:
        """An exchange on the loop took the header and ``moved`` payload bytes of pull
        ``rid``'s answer: the loop receives the rest (``_rlock`` held)."""
        req = Request(rid, RequestKind.PULL, local, nbytes, deadline_ns)
        self._loop_receiving(req, iov_skip(local, moved), nbytes - moved)
        self._loop_waits()
        return req.future

    def _receive_loop_answer(self, *, wait: bool) -> bool | str:
        """Receive the rest of the answer the loop began (``_rlock`` held) and complete it
        once whole: True once it ended, False while bytes are still due, or why the channel
        must break. ``wait``: in a thread that may wait (the loop stopped coming to it),
        until the request's deadline (the stall timeout without one), failing it with
        ``LLM_TIMEOUT`` then (the rest is owed); otherwise (on the loop) only what arrived."""
        req, iov = self._loop_req, self._loop_iov
        assert req is not None and iov is not None
        if self._loop_left:
            deadline = (req.deadline_ns or after_s(self._stall_s)) if wait else 1
            try:
                sock_recvv(self._fd, iov, deadline)  # 1: in the past, takes what is there
            except NetTimeout as exc:
                self._loop_left -= exc.transferred
                if not wait:
                    self._loop_iov = iov_skip(iov, exc.transferred)
                    self._loop_waits()
                    return False
                moved = req.nbytes - self._loop_left
                self._loop_abort(
                    _error(
                        LLMStatusCode.LLM_TIMEOUT,
                        f"pull {req.rid}: deadline passed after {moved} of {req.nbytes} bytes",
                    )
                )
                return True
            except (PeerClosed, OSError) as exc:
                self._loop_abort(self._link_failed())
                return f"receive failed: {exc}"
        self._loop_done()
        req.outcome = None
        self._landed(req)
        return True

    def _loop_done(self) -> None:
        if self._loop_timer is not None:
            self._loop_timer.cancel()
        self._loop_req, self._loop_iov, self._loop_left, self._loop_timer = None, None, 0, None

    def _loop_abort(self, failure: LLMException) -> None:
        """Fail the answer the loop was receiving; its rows are no longer touched, and the
        bytes still due are owed (the reader thread discards them)."""
        req, left = self._loop_req, self._loop_left
        assert req is not None
        self._loop_done()
        self._owed += left
        req.outcome = failure
        req.complete()

    def _loop_expired(self, req: Request) -> None:
        """The deadline of the answer the loop receives passed (on the loop): fail it and let
        the reader thread discard the rest."""
        if self._loop_req is not req:
            return
        if not self._rlock.acquire(blocking=False):  # held for a moment: look again soon
            loop = asyncio.get_running_loop()
            self._loop_timer = loop.call_later(_LOOP_PARK_S, self._loop_expired, req)
            return
        try:
            if self._loop_req is req:
                moved = req.nbytes - self._loop_left
                self._disarm(
                    _error(
                        LLMStatusCode.LLM_TIMEOUT,
                        f"pull {req.rid}: deadline passed after {moved} of {req.nbytes} bytes",
                    )
                )
        finally:
            self._rlock.release()

    def _loop_answer_next(self) -> FrameHeader | _Later | None:
        """What is next on the socket for the loop (``_rlock`` held): the header of an answer
        it takes (one of at most :data:`LOOP_READ_BYTES`; a pull's payload may still be
        arriving, any other answer has arrived whole), :data:`_LATER` while its header is
        still arriving, or None when the reader thread must take the next frame (anything
        else, or an answer whose body has not all arrived)."""
        # A header seen whole is taken only for an answer the loop takes; a header still
        # arriving is taken as it arrives (never waited for unread: with the receive buffer
        # full, the peer could not send the rest, and the selector would report the socket
        # ready forever).
        have = self._hdr_have
        if have == 0:
            try:
                head = self._sock.recv(_HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return _LATER
            except OSError:
                return None
            if not head:
                return None  # closed: the reader thread reports it
            if len(head) == _HEADER_SIZE:
                try:
                    header = decode_header(head)
                except WireError:
                    return None  # the reader thread breaks the link over it
                if not self._loop_takes(header, _HEADER_SIZE):
                    return None  # left on the socket for the reader thread
                recv_view(self._fd, memoryview(self._hdr), self._stall_s)  # there, whole
                self._hdr_have = _HEADER_SIZE
                return header
        try:
            n = self._sock.recv_into(
                memoryview(self._hdr)[have:], _HEADER_SIZE - have, socket.MSG_DONTWAIT
            )
        except BlockingIOError:
            return _LATER
        except OSError:
            return None
        if n == 0:
            return None
        self._hdr_have = have = have + n
        if have < _HEADER_SIZE:
            return _LATER
        try:
            header = decode_header(self._hdr)
        except WireError:
            return None
        # Taken whole only now: the reader thread goes on from it at once if the loop
        # does not take the frame (_frame_waiting).
        return header if self._loop_takes(header, 0) else None

    def _loop_takes(self, header: FrameHeader, unread: int) -> bool:
        """Whether the loop takes the frame ``header`` starts, with ``unread`` bytes of the
        header still on the socket: an answer of at most :data:`LOOP_READ_BYTES`, a pull's
        payload as it arrives, any other answer only once it has arrived whole."""
        size = _HEADER_SIZE + header.body_len + header.payload_len
        if header.kind not in _ANSWERS or size > LOOP_READ_BYTES:
            return False
        if header.kind is FrameKind.PULL_DATA:
            return not header.body_len
        arrived = fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0")
        rest = unread + header.body_len + header.payload_len
        return int.from_bytes(arrived, sys.byteorder) >= rest

    def _frame_waiting(self) -> bool:
        """Whether a frame waits for a reader (``_rlock`` held, or a glance): a header taken
        whole that the loop left, or bytes on the socket."""
        return self._hdr_have == _HEADER_SIZE or self._readable_now()

    def _read_frame_here(self, who: str) -> bool:
        """:meth:`_read_frame` in a thread other than the reader's (``_rlock`` held);
        False when the channel broke over it."""
        try:
            failure = self._read_frame()
        except BaseException:  # interrupted mid-frame: the stream is out of step
            self._break(f"{who} was interrupted mid-frame")
            raise
        if failure is not None:
            self._break(failure)
            return False
        return True

    def _peer_push_next(self) -> bool:
        """True when the next frame is a push of the peer's: its payload takes as long as
        the peer does, so the reader thread receives it, not a caller with a deadline."""
        try:
            head = self._sock.recv(HEADER_KIND.stop, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:  # nothing there after all, or the socket failed: _read_frame says
            return False
        return head[HEADER_KIND] == _PUSH_KIND

    def _unpark(self) -> None:
        """Send the reader thread back to the socket at once."""
        self._callers_until = 0
        self._park.set()

    def _read_frame(self) -> str | None:
        """Read and handle one frame (``_rlock`` held), after discarding what is owed; why
        the channel must break, if so."""
        if self._loop_req is not None:
            done = self._receive_loop_answer(wait=True)
            return done if isinstance(done, str) else None
        try:
            if self._owed:
                owed, self._owed = self._owed, 0
                self._drain(owed)
                return None
            have = self._hdr_have
            if have < _HEADER_SIZE:
                recv_view(self._fd, memoryview(self._hdr)[have:], self._stall_s)
            self._hdr_have = 0
            header = decode_header(self._hdr)
            self._served = header.kind not in _ANSWERS
            self._dispatch(header)
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

    def _readable_now(self) -> bool:
        """One check that never sleeps (a deadline in the past)."""
        return sock_wait_readable(self._fd, 1)

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
            self._pending.settle(rid, None, RequestKind.PUSH)
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
        req = self._pending.claim(h.request_id, RequestKind.PULL)
        if req is None:  # abandoned (deadline) or unknown: keep the stream in sync
            self._owed = h.payload_len
            return
        if h.payload_len != req.nbytes:
            req.outcome = _error(
                LLMStatusCode.LLM_FAILED,
                f"the peer answered {h.payload_len} bytes for a pull of {req.nbytes}",
            )
            req.complete()
            self._owed = h.payload_len
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
            self._owed = h.payload_len - moved
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
        self._pending.settle(h.request_id, _error(status_from_wire(h.status), message))

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
