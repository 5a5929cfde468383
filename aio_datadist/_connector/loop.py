"""The event loop a node's engine runs on: one daemon thread, started once, stopped at close.

Serving engines call their connector's hooks from their own threads; those hooks hand work to
this loop (:meth:`LoopThread.call`, :meth:`LoopThread.submit`) and return at once. Every task
the loop runs for the node is :meth:`~LoopThread.spawn`-ed, so an exception nobody awaits is
still logged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from aio_datadist._log import get_logger

__all__ = ("LoopThread",)

T = TypeVar("T")
_log = get_logger("connector.loop")


class LoopThread:
    """An asyncio event loop running in a daemon thread of its own."""

    def __init__(self, name: str, log: Any = None) -> None:
        self._log = log if log is not None else _log
        self._name = name
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._unhandled)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (for ``call_soon_threadsafe`` and friends)."""
        return self._loop

    def start(self) -> None:
        """Start the thread; a second call does nothing."""
        if not self._started:
            self._started = True
            self._thread.start()

    def _unhandled(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """An error no task owned (a callback handed over with :meth:`call`): logged on the
        node's logger, with its traceback."""
        exc = context.get("exception")
        self._log.error(
            "connector.callback_failed",
            loop=self._name,
            message=context.get("message", ""),
            error=f"{type(exc).__name__}: {exc}" if exc is not None else None,
            exc_info=exc,
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def on_loop(self) -> bool:
        """True in the loop's own thread."""
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon; from any thread, never waits. A call after
        :meth:`stop` is dropped (the node is closing)."""
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # closed between the check and the call
            return

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; a future of its result, for another thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for it from another thread, at most ``timeout``
        seconds (then it is cancelled and ``TimeoutError`` raised). For set-up and shut-down,
        never for a serving engine's per-step hooks."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"{self._name}: gave up after {timeout:g} s") from None

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        """(On the loop.) Run ``coro`` as a task the loop keeps until it ends; an exception
        it ends with is logged with ``what``, never lost."""
        task = self._loop.create_task(coro, name=f"{self._name}:{what}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.error(
                "connector.task_failed",
                task=task.get_name(),
                error=f"{type(exc).__name__}: {exc}",
                exc_info=exc,
            )

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the loop's remaining tasks, stop it and join the thread (call it from
        another thread, after the node's own shut-down ran on the loop)."""
        if not self._started or self._loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                self.run(self._cancel_tasks(), timeout)
            except TimeoutError:
                self._log.warning("connector.stop_slow", loop=self._name)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.close()
