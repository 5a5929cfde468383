"""Blocking socket I/O over memory rows for a TCP link, with a stall timeout: every call
gives up only after ``stall_s`` seconds in which no byte moved (or at a deadline), so a large
frame takes as long as it needs and a stalled peer is found."""

from __future__ import annotations

from collections.abc import Callable, Generator

import numpy as np

from aio_datadist._native.api import NetTimeout, PeerClosed, sock_recv_into, sock_recvv, sock_sendv
from aio_datadist._transport.base import Iov, Payload
from aio_datadist._transport.deadlines import after_s
from aio_datadist.status import LLMException

__all__ = (
    "IO_ERRORS",
    "iov_problem",
    "iov_skip",
    "move_payload",
    "recv_view",
    "recvv_all",
    "sendv_all",
    "until_stall",
)

#: What a socket call of a link may raise when the peer or the socket fails.
IO_ERRORS = (NetTimeout, PeerClosed, OSError)


def iov_skip(iov: Iov, k: int) -> Iov:
    """The rows left after the first ``k`` bytes of ``iov`` moved."""
    if k <= 0:
        return iov
    ends = np.cumsum(iov[:, 1], dtype=np.uint64)
    i = int(np.searchsorted(ends, np.uint64(k), side="right"))
    rest: Iov = iov[i:].copy()
    if rest.shape[0]:
        off = k - (int(ends[i - 1]) if i else 0)
        rest[0, 0] += np.uint64(off)
        rest[0, 1] -= np.uint64(off)
    return rest


def until_stall(io: Callable[[int, Iov, int], None], fd: int, iov: Iov, stall_s: float) -> None:
    """Run ``io`` over every byte of ``iov``; NetTimeout only after a stall of ``stall_s``."""
    while True:
        try:
            io(fd, iov, after_s(stall_s))
            return
        except NetTimeout as exc:
            if exc.transferred == 0:
                raise
            iov = iov_skip(iov, exc.transferred)


def move_payload(io: Callable[[Iov], None], payload: Payload) -> tuple[int, Exception | None]:
    """Run ``io`` over the payload's rows, piece by piece for segments.

    Returns the bytes moved through the socket and the failure (None on success): a
    ``NetTimeout``/``PeerClosed``/``OSError`` of ``io``, or the ``LLMException`` of a piece
    that could not be staged. Segments stopped by a failure are closed (the piece in hand is
    dropped).
    """
    if isinstance(payload, np.ndarray):
        try:
            io(payload)
        except (NetTimeout, PeerClosed) as exc:
            return exc.transferred, exc
        except (OSError, LLMException) as exc:
            return 0, exc
        return int(payload[:, 1].sum()) if payload.shape[0] else 0, None
    moved = 0
    pieces: Generator[Iov, None, None] = payload.segments()
    try:
        for piece in pieces:
            try:
                io(piece)
            except (NetTimeout, PeerClosed) as exc:
                return moved + exc.transferred, exc
            except OSError as exc:
                return moved, exc
            moved += int(piece[:, 1].sum())
    except LLMException as exc:
        return moved, exc
    finally:
        pieces.close()
    return moved, None


def sendv_all(fd: int, iov: Iov, stall_s: float) -> None:
    """Send every byte of ``iov``; NetTimeout only after ``stall_s`` seconds of no progress."""
    until_stall(sock_sendv, fd, iov, stall_s)


def recvv_all(fd: int, iov: Iov, stall_s: float) -> None:
    """Receive exactly the bytes of ``iov``; NetTimeout only after a stall of ``stall_s``."""
    until_stall(sock_recvv, fd, iov, stall_s)


def recv_view(fd: int, view: memoryview, stall_s: float) -> None:
    """Fill ``view``; NetTimeout only after ``stall_s`` seconds of no progress."""
    while len(view):
        try:
            sock_recv_into(fd, view, after_s(stall_s))
            return
        except NetTimeout as exc:
            if exc.transferred == 0:
                raise
            view = view[exc.transferred :]


#: Row tables up to this many rows are summed as Python ints (:func:`iov_problem`).
_FEW_ROWS = 16


def iov_problem(iov: object, nbytes: int) -> str | None:
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
