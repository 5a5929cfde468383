"""The future of a request in flight: a ``concurrent.futures.Future`` light enough for tens
of thousands at once.

A standard future builds a ``threading.Condition`` (a lock, a deque and five bound methods)
when it is made. A link with 10,000 awaited requests in flight then holds some 100,000 of
those objects, and Python's cyclic collector walks all of them again and again while new
requests are made: measured, a quarter of the CPU time of such a wave. A
:class:`RequestFuture` is one object and a list: state changes take one lock shared by
every request future (held for a few attribute writes), and a ``threading.Event`` is made
only for a thread that blocks on the result.

It is running from birth and cannot be cancelled (a cancelled request would read as done
while the transport may still write into its memory), and it works wherever a standard
future does in this project: ``result``/``exception`` with a timeout, done callbacks, and
``asyncio.wrap_future``. ``concurrent.futures.wait`` and ``as_completed`` are not supported.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

__all__ = ("RequestFuture",)

_RUNNING = "RUNNING"
_FINISHED = "FINISHED"

#: Guards the state of every request future; held only to write or read a few attributes.
_LOCK = threading.Lock()
_log = logging.getLogger("concurrent.futures")


class RequestFuture(Future[None]):
    """A running, uncancellable future completed once by the transport."""

    #: The id of the request it completes (0: none); a waiter finds the request by it.
    request_id = 0

    def __init__(self) -> None:  # no Condition: see the module docstring
        self._state = _RUNNING
        self._result: None = None
        self._exception: BaseException | None = None
        self._done_callbacks: list[Callable[[Future[None]], object]] = []
        self._event: threading.Event | None = None

    def __repr__(self) -> str:
        if self._state != _FINISHED:
            return f"<RequestFuture at {id(self):#x} state=running>"
        outcome = "ok" if self._exception is None else type(self._exception).__name__
        return f"<RequestFuture at {id(self):#x} state=finished {outcome}>"

    # -- state ------------------------------------------------------------------------------
    def cancel(self) -> bool:
        """Never cancels: the request runs until the transport completes it."""
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return self._state == _RUNNING

    def done(self) -> bool:
        return self._state == _FINISHED

    def set_running_or_notify_cancel(self) -> bool:
        """Running from birth: nothing to do."""
        return True

    # -- waiting ----------------------------------------------------------------------------
    def add_done_callback(self, fn: Callable[[Future[None]], object]) -> None:
        with _LOCK:
            if self._state != _FINISHED:
                self._done_callbacks.append(fn)
                return
        try:
            fn(self)
        except Exception:
            _log.exception("exception calling callback for %r", self)

    def _wait(self, timeout: float | None) -> None:
        if self._state == _FINISHED:
            return
        with _LOCK:
            if self._state == _FINISHED:
                return
            event = self._event
            if event is None:
                event = self._event = threading.Event()
        if not event.wait(timeout):
            raise FutureTimeout()

    def result(self, timeout: float | None = None) -> None:
        self._wait(timeout)
        error = self._exception
        if error is not None:
            raise error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._exception

    # -- completing -------------------------------------------------------------------------
    def _finish(self, error: BaseException | None) -> None:
        with _LOCK:
            if self._state == _FINISHED:
                raise InvalidStateError(f"{self!r} is already finished")
            self._exception = error
            self._state = _FINISHED
            callbacks, self._done_callbacks = self._done_callbacks, []
            event = self._event
        if event is not None:
            event.set()
        for fn in callbacks:
            try:
                fn(self)
            except Exception:
                _log.exception("exception calling callback for %r", self)

    def set_result(self, result: Any) -> None:
        """Complete successfully (a request's result is always None)."""
        self._finish(None)

    def set_exception(self, exception: BaseException | None) -> None:
        """Complete with ``exception``."""
        self._finish(exception)
