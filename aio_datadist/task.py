"""``CacheTask``: the handle of a background transfer, waited on blocking or awaited.

One class serves both faces. A producer (the engine) fills per-config results (a status
and, for a failure, the exception behind it) and finishes the task from any thread or loop;
consumers call :meth:`CacheTask.synchronize` / :meth:`CacheTask.get_results` (blocking, with
a timeout, returning status codes) or ``await`` the task (raising the first failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any

from aio_datadist._validate import check_int
from aio_datadist.status import LLMException, LLMStatusCode, lookup

__all__ = ("CacheTask",)

_Result = LLMStatusCode | None


class CacheTask:
    """Handle of a background transfer with one result per transfer config.

    A result of ``None`` means that config's layers were never attempted. The blocking
    methods return status codes; ``await task`` returns ``LLM_SUCCESS`` or raises the
    ``LLMException`` of the first failed config (see :meth:`__await__`).
    """

    def __init__(self, num_results: int = 1, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._cond = threading.Condition()
        self._results: list[_Result] = [None] * num_results
        self._errors: list[BaseException | None] = [None] * num_results
        # What awaiting raises, built once after the task finished: (exception, traceback).
        self._failure: tuple[LLMException, TracebackType | None] | None = None
        self._failure_built = False
        self._done = False
        self._cancel_requested = False
        self._cancel_callbacks: list[Callable[[], None]] = []
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._loop = loop

    # -- producer side --------------------------------------------------------------------
    def _set_result(
        self, index: int, status: LLMStatusCode, error: BaseException | None = None
    ) -> None:
        """Record config ``index``'s outcome; producers report a success once it finished.

        ``error`` is the exception behind a failure, raised by ``await task`` when this is
        the first failed config; a later call without one keeps it (it is used only while
        its status code matches the result). After :meth:`cancel`, a config that had not
        finished never becomes a success: its requests may still complete, but the caller
        was told the task stopped.
        """
        with self._cond:
            if self._done:
                return
            if (
                status == LLMStatusCode.LLM_SUCCESS
                and self._cancel_requested
                and self._results[index] != LLMStatusCode.LLM_SUCCESS
            ):
                status = LLMStatusCode.LLM_FAILED
            self._results[index] = status
            if error is not None:
                self._errors[index] = error

    def _finish(self) -> None:
        with self._cond:
            if self._done:
                return
            self._done = True
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, fut in waiters:
            # A closed waiter loop raises RuntimeError: nobody is left to wake there.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut)

    def _on_cancel(self, callback: Callable[[], None]) -> None:
        with self._cond:
            if not self._cancel_requested:
                self._cancel_callbacks.append(callback)
                return
        callback()

    @property
    def _cancelled(self) -> bool:
        return self._cancel_requested

    # -- consumer side --------------------------------------------------------------------
    def done(self) -> bool:
        """True once the transfer has finished (successfully or not).

        Never blocks; once True, the results no longer change.
        """
        return self._done

    def cancel(self) -> bool:
        """Stop the transfer before its next layer; False if it had already finished.

        Layers not yet started are not transferred; a layer being copied finishes. Configs
        that had not finished report ``LLM_FAILED``; configs never started stay None.
        """
        with self._cond:
            if self._done:
                return False
            self._cancel_requested = True
            callbacks, self._cancel_callbacks = self._cancel_callbacks, []
        for callback in callbacks:
            callback()
        return True

    def _wait(self, timeout_in_millis: int | None) -> bool:
        check_int("timeout_in_millis", timeout_in_millis, "uint32", allow_none=True)
        if not self._done and self._loop is not None:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                raise RuntimeError(
                    "CacheTask.synchronize/get_results would block the event loop that runs "
                    "the transfer: await the task instead"
                )
        timeout = None if timeout_in_millis is None else timeout_in_millis / 1000
        with self._cond:
            return self._cond.wait_for(lambda: self._done, timeout)

    def _status(self) -> LLMStatusCode:
        for result in self._results:
            if result is not None and result != LLMStatusCode.LLM_SUCCESS:
                return result
        return LLMStatusCode.LLM_SUCCESS

    def synchronize(self, timeout_in_millis: int | None = None) -> LLMStatusCode:
        """Wait for the transfer; return ``LLM_TIMEOUT`` if it is still running at the deadline.

        Otherwise the first result that is neither success nor None, else ``LLM_SUCCESS``.

        :param timeout_in_millis: uint32 milliseconds; None waits forever.
        """
        if not self._wait(timeout_in_millis):
            return LLMStatusCode.LLM_TIMEOUT
        return self._status()

    def get_results(self, timeout_in_millis: int | None = None) -> list[LLMStatusCode | None]:
        """Wait for the transfer; return one status per config (None: never attempted).

        At the deadline, returns ``[LLM_TIMEOUT] * len(configs)``.
        """
        if not self._wait(timeout_in_millis):
            return [LLMStatusCode.LLM_TIMEOUT] * len(self._results)
        return list(self._results)

    async def _wait_async(self) -> None:
        with self._cond:
            if self._done:
                return
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, fut))
        await fut

    def _first_failure(self) -> tuple[LLMException, TracebackType | None] | None:
        """The exception of the first failed config with ``.results`` set; None when every
        config succeeded or never started. Built once, after the task finished."""
        with self._cond:
            if not self._failure_built:
                self._failure_built = True
                for index, status in enumerate(self._results):
                    if status is None or status == LLMStatusCode.LLM_SUCCESS:
                        continue
                    exc = _as_exception(index, status, self._errors[index])
                    exc.results = list(self._results)
                    self._failure = (exc, exc.__traceback__)
                    break
            return self._failure

    def __await__(self) -> Generator[Any, None, LLMStatusCode]:
        """``await task``: wait for the transfer; ``LLM_SUCCESS`` when no config failed.

        Cheap and repeatable, from any number of coroutines. Cancelling the awaiting
        coroutine leaves the transfer running; only :meth:`cancel` stops it.

        :returns: ``LLM_SUCCESS`` (configs never attempted count as success, as in
            :meth:`synchronize`).
        :raises LLMException: the first failed config's error (the subclass registered for
            its status code; for ``push_blocks`` what the blocking call raises), with
            ``.results`` holding every config's status as :meth:`get_results` gives it and,
            when the failure came from the ``LayerSynchronizer``, its exception as
            ``__cause__``.
        :raises asyncio.CancelledError: the task was stopped by :meth:`cancel`.
        """
        yield from self._wait_async().__await__()
        if self._cancel_requested:
            raise asyncio.CancelledError("the CacheTask was cancelled by CacheTask.cancel()")
        failure = self._first_failure()
        if failure is not None:
            exc, tb = failure
            # The traceback of the first raise, every time: repeated awaits must not grow it.
            raise exc.with_traceback(tb)
        return LLMStatusCode.LLM_SUCCESS

    async def wait_results(self) -> list[LLMStatusCode | None]:
        """Await the transfer and return what ``get_results()`` would; never raises for a
        failed or cancelled transfer.

        :returns: one status per config, in order; None for a config never attempted.
        """
        await self._wait_async()
        return list(self._results)

    def __repr__(self) -> str:
        state = "done" if self._done else ("cancelling" if self._cancel_requested else "running")
        return f"<CacheTask {state} results={[str(r) for r in self._results]}>"


def _as_exception(index: int, status: LLMStatusCode, error: BaseException | None) -> LLMException:
    """The exception for a failed config: the recorded one when it carries ``status``,
    else one built from the code (chained to a recorded foreign error)."""
    if isinstance(error, LLMException) and error.status_code == status:
        return error
    message = f"transfer config {index} failed with {status!s}"
    if error is not None and not isinstance(error, LLMException):
        message = f"{message}: {type(error).__name__}: {error}"
    exc = lookup(status)(message, status_code=status)
    if error is not None and not isinstance(error, LLMException):
        exc.__cause__ = error
    return exc


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
