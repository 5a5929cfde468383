"""The answers to this side's requests that come to the link's Python
(:class:`PythonAnswers`): refusals (``ERROR``), and the pulls the pump's table does not
take (a payload for staging segments, a pull that asks the peer to commit, an answer that
does not match its request)."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from aio_datadist._native.api import NetTimeout, sock_recvv
from aio_datadist._transport._wire import (
    FrameHeader,
    FrameKind,
    decode_error_text,
    pack_header,
    status_from_wire,
)
from aio_datadist._transport.base import Iov, RequestKind
from aio_datadist._transport.pending import PendingRequests, Request
from aio_datadist._transport.tcp_io import move_payload, recvv_all
from aio_datadist._transport.tcp_send import Outbox, OutFrame
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ("PythonAnswers",)


class PythonAnswers:
    """Takes one link's answers that come to Python, in its reader thread. ``held(rid)``:
    the pump holds request ``rid`` (else it is out of its table from now on); ``end(rid,
    outcome)`` ends a request the pump does not hold; ``drain(n)`` discards payload bytes;
    ``link_failed(why)`` is the failure of a request on a link that breaks."""

    def __init__(
        self,
        fd: int,
        stall_s: float,
        pending: PendingRequests,
        outbox: Outbox,
        *,
        held: Callable[[int], bool],
        end: Callable[[int, LLMException | None], bool],
        drain: Callable[[int], None],
        link_failed: Callable[[str], LLMException],
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self._fd = fd
        self._stall_s = stall_s
        self._pending = pending
        self._outbox = outbox
        self._held = held
        self._end = end
        self._drain = drain
        self._link_failed = link_failed
        self._log = log

    def on_pull_data(self, h: FrameHeader) -> None:
        req = (
            None
            if self._held(h.request_id)
            else self._pending.claim(h.request_id, RequestKind.PULL)
        )
        if req is None:  # abandoned (deadline) or unknown: keep the stream in sync
            self._drain(h.payload_len)
            return
        if h.payload_len != req.nbytes:
            req.outcome = LLMException(
                f"the peer answered {h.payload_len} bytes for a pull of {req.nbytes}",
                status_code=LLMStatusCode.LLM_FAILED,
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
            req.outcome = LLMException(
                f"pull {req.rid}: deadline passed after {moved} of {req.nbytes} bytes",
                status_code=LLMStatusCode.LLM_TIMEOUT,
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
            OutFrame(pack_header(FrameKind.PULL_DONE, req.rid), after=lambda ok: req.complete())
        )

    def on_error(self, h: FrameHeader, body: bytearray) -> None:
        message = decode_error_text(body)
        if h.request_id == 0:
            self._log.warning(
                "tcp.peer_error", status=str(status_from_wire(h.status)), message=message
            )
            return
        self._end(h.request_id, LLMException(message, status_code=status_from_wire(h.status)))
