"""The peer's requests on one end of a TCP link (:class:`PeerServer`): answered in native
code where the engine's serve table can (``_native/serve.c``), else planned by the engine's
handler and sent through the link's outbox, which never waits on the socket from the reader.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import structlog

from aio_datadist._native.api import PeerClosed
from aio_datadist._native.serve import ServeWorker
from aio_datadist._transport._wire import (
    MAX_PAYLOAD,
    PULL_NBYTES,
    FrameHeader,
    FrameKind,
    WireError,
    encode_error_text,
    pack_header,
)
from aio_datadist._transport.base import Hello, RequestHandler, RequestKind, Served
from aio_datadist._transport.tcp_io import (
    iov_problem,
    iov_skip,
    move_payload,
    recv_view,
    recvv_all,
)
from aio_datadist._transport.tcp_send import Outbox, OutFrame
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ("MAX_UNCOMMITTED", "PeerServer")

#: Served pulls waiting for their PULL_DONE; beyond this the oldest is forgotten.
MAX_UNCOMMITTED = 4096
#: An answer's payload rows are copied behind its header, so that one call (inline in the
#: reader, when the socket takes it all) sends both, up to this many rows; a bigger table is
#: sent as it is, by the sender thread.
_COPY_ROWS = 1 << 16
#: Scratch buffer for draining unwanted payloads.
_SCRATCH = 1 << 20


class _Commit:
    """A served pull whose commit waits for the requester's PULL_DONE."""

    __slots__ = ("asked", "fn", "sent")

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.sent: bool | None = None  # None while the payload is still being sent
        self.asked = False  # PULL_DONE arrived before the send finished


class PeerServer:
    """Serves the peer's requests of one link, in its reader thread (see the module
    docstring); ``broken()`` says whether the link broke."""

    def __init__(
        self,
        fd: int,
        peer: Hello,
        handler: RequestHandler,
        outbox: Outbox,
        slock: threading.Lock,
        *,
        stall_s: float,
        spin_ns: int,
        broken: Callable[[], bool],
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self._fd = fd
        self.peer = peer
        self._handler = handler
        self._outbox = outbox
        self._slock = slock
        self._stall_s = stall_s
        self._spin_ns = spin_ns
        self._broken = broken
        self._log = log
        self._lock = threading.Lock()  # the commits
        self._commits: dict[int, _Commit] = {}
        self._scratch: bytearray | None = None
        # Small pulls and pushes of blocks answered in native code.
        table = handler.serve_table
        self._native: ServeWorker | None = None if table is None else table.worker()

    def forget(self) -> None:
        """The link broke: served pulls waiting for their PULL_DONE never commit."""
        with self._lock:
            self._commits.clear()

    def answer_natively(self) -> bool | str:
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
            if self._broken():
                return True
            result = native.serve(self._fd, MAX_PAYLOAD, self._spin_ns)
            partial = result.partial
            if partial is None:
                return result.served > 0
            kind = FrameKind(partial.kind)
            ctl = pack_header(kind, partial.request_id, payload_len=partial.nbytes)
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

    def _serve(self, kind: RequestKind, rid: int, body: bytes, nbytes: int) -> Served | None:
        """The handler's answer, or None after answering ERROR."""
        try:
            served = self._handler.serve(self.peer, kind, body, nbytes, stream=True)
        except LLMException as exc:
            self.reply_error(rid, exc.status_code, str(exc))
            return None
        except Exception as exc:
            self._log.warning("tcp.serve_failed", kind=kind.value, exc_info=True)
            self.reply_error(rid, LLMStatusCode.LLM_FAILED, f"serving failed: {exc!r}")
            return None
        problem = (
            f"served {served.nbytes} bytes for a request of {nbytes}"
            if served.nbytes != nbytes
            else iov_problem(served.iov if served.stream is None else served.stream, nbytes)
        )
        if problem is not None:
            self._call_done(served.done, False)
            self.reply_error(rid, LLMStatusCode.LLM_PARAM_INVALID, problem)
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

    def on_pull(self, h: FrameHeader, body: bytearray) -> None:
        if len(body) < PULL_NBYTES.size:
            raise WireError("PULL body lacks its byte count")
        nbytes = int(PULL_NBYTES.unpack_from(body)[0])
        rid = h.request_id
        if nbytes > MAX_PAYLOAD:  # the frame itself was whole: refuse the request only
            message = f"a pull of {nbytes} bytes exceeds {MAX_PAYLOAD}"
            self.reply_error(rid, LLMStatusCode.LLM_PARAM_INVALID, message)
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
        ctl = pack_header(FrameKind.PULL_DATA, rid, payload_len=nbytes)
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

    def on_pull_done(self, rid: int) -> None:
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

    def on_push(self, h: FrameHeader, body: bytearray) -> None:
        rid, nbytes = h.request_id, h.payload_len
        served = self._serve(RequestKind.PUSH, rid, bytes(body), nbytes)
        if served is None:
            self.drain(nbytes)
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
            self.drain(nbytes - moved)
            self.reply_error(rid, error.status_code, f"push not stored: {error}")
            return
        if error is not None:
            self._call_done(served.done, False)
            raise error
        failure = self._call_done(served.done, True)
        if failure is not None:
            self.reply_error(rid, LLMStatusCode.LLM_FAILED, f"push not stored: {failure}")
            return
        self._outbox.send_or_queue(OutFrame(pack_header(FrameKind.PUSH_ACK, rid), answer=True))

    def reply_error(self, rid: int, status: LLMStatusCode, message: str) -> None:
        body = encode_error_text(message)
        ctl = pack_header(FrameKind.ERROR, rid, status=int(status), body_len=len(body)) + body
        self._outbox.send_or_queue(OutFrame(ctl, answer=True))

    def read_body(self, n: int) -> bytearray:
        buf = bytearray(n)
        if n:
            recv_view(self._fd, memoryview(buf), self._stall_s)
        return buf

    def drain(self, n: int) -> None:
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
