"""Copies the native copy workers run while an event loop goes on.

The same-host route awaited on an event loop hands a large copy to the native copy workers
(``api.vm_copy_batch``/``vm_copy_blocks`` with a signal) instead of a Python worker thread:
no thread hop, and the loop sleeps in its selector until the worker that finishes the copy
posts the loop's signal, an eventfd the loop reads. Each loop has one signal while it has
copies running; on each post it reaps the copies that ended and completes their futures,
on the loop, through the caller's ``finish`` (which turns the outcome into the transfer's
result: a failure as ``LLMException``, a cache the peer released meanwhile).

A loop that cannot watch a descriptor (``add_reader`` not implemented), or a moment with no
descriptor left for the signal, has its copies run in the caller instead. A copy is never
abandoned: a task collected before it was reaped (its loop went away) waits for its copy to
end (``api.CopyTask``), and the signal's fd stays open until the last copy started with it
posted. A blocking wait in the loop's own thread (a blocking call inside one of its
callbacks, which holds the loop) reaps its copy itself: the completion's pump is the loop's
copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import weakref
from collections.abc import Callable
from concurrent.futures import Future

from aio_datadist._engine.request import Completion
from aio_datadist._native import api
from aio_datadist._transport.future import RequestFuture

__all__ = ("Finish", "start_on_loop")

#: Turns a copy's outcome (None, or the ``OSError`` it failed with) into the transfer's:
#: returns on success, raises ``LLMException`` on failure.
Finish = Callable[[OSError | None], None]
#: Starts a copy with the given signal (None: copy it here): its task, or None when it was
#: copied in the caller.
Begin = Callable[[api.CopySignal | None], api.CopyTask | None]


class _LoopCopies:
    """The running background copies of one event loop, and the signal it reads; the
    :class:`~aio_datadist._engine.request.Pump` of their completions."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._signal: api.CopySignal | None = None
        #: The running copies by their futures, oldest first.
        self._running: dict[Future[None], tuple[api.CopyTask, Finish]] = {}
        #: False for a loop that cannot watch a descriptor: its copies run in the caller.
        self.watchable = True

    def start(self, begin: Begin, finish: Finish, deadline_ns: int) -> Completion | None:
        signal = self._signal
        if signal is None:
            signal = self._open()
            if signal is None:
                begin(None)  # copied in the caller after all
                return None
        task = None
        try:
            task = begin(signal)
        finally:
            if task is None and not self._running:
                self._idle()
        if task is None:
            return None
        future = RequestFuture()
        self._running[future] = (task, finish)
        return Completion(future, deadline_ns, self)

    def read_for(self, future: Future[None], deadline_ns: int) -> None:
        """A blocking wait for ``future`` in the loop's own thread, which holds the loop:
        wait for its copy here and complete it (a copy is never cut short, so the wait
        outlasts ``deadline_ns`` if the copy does). In any other thread, nothing: the loop
        completes it."""
        if asyncio._get_running_loop() is not self._loop:
            return
        entry = self._running.pop(future, None)
        if entry is None:
            return
        task, finish = entry
        _complete(task, future, finish, wait=True)
        if not self._running:
            self._idle()

    def spin(self, future: Future[None], deadline_ns: int) -> None:
        """Nothing: a background copy is large, so no busy-poll would see it end."""
        return

    #: No watch: the loop reads the copies' signal whenever one runs.
    watched = False

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """None: the loop reads the copies' signal whenever one runs."""
        return None

    def _open(self) -> api.CopySignal | None:
        """A signal the loop reads; None when none can be had (no descriptor left now, or a
        loop that cannot watch one)."""
        if not self.watchable:
            return None
        try:
            signal = api.CopySignal()
        except OSError:
            return None
        try:
            self._loop.add_reader(signal.fd, self._ended)
        except NotImplementedError:
            signal.close()
            self.watchable = False
            return None
        self._signal = signal
        return signal

    def _ended(self) -> None:
        """The signal was posted: complete the copies that ended, oldest first.

        Each copy posts once as it ends, and the signal counts the posts since the last read;
        the workers run copies oldest first. So the loop looks at the oldest copies until as
        many ended as were posted, not at every running copy on every post (with 64 copies
        in flight that was a reap call for each of 32 copies on average, per copy ended).
        A copy seen ended before its post counts toward this read, and its post, when it
        comes, wakes the loop for the copy it left.
        """
        signal = self._signal
        posted = 0
        if signal is not None:
            with contextlib.suppress(BlockingIOError):
                posted = int.from_bytes(os.read(signal.fd, 8), sys.byteorder)
        ended = 0
        for future, (task, finish) in list(self._running.items()):
            if ended >= posted:
                break
            if _complete(task, future, finish):
                del self._running[future]
                ended += 1
        if not self._running:
            self._idle()

    def _idle(self) -> None:
        """No copy runs: stop reading the signal and give it up."""
        signal, self._signal = self._signal, None
        if signal is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # the loop closed meanwhile
                self._loop.remove_reader(signal.fd)
            signal.close()


def _complete(
    task: api.CopyTask, future: Future[None], finish: Finish, *, wait: bool = False
) -> bool:
    """Complete ``future`` with ``finish``'s verdict once ``task`` ended (``wait``: wait for
    that); False while it runs. Whatever goes wrong is the future's failure, never lost in
    the loop's callback."""
    error: OSError | None = None
    try:
        if not task.reap(wait=wait):
            return False
    except OSError as exc:
        error = exc
    except Exception as exc:  # not a copy's failure (the task is gone all the same)
        future.set_exception(exc)
        return True
    try:
        finish(error)
    except Exception as exc:  # the transfer's LLMException, or a fault of its own
        future.set_exception(exc)
    else:
        future.set_result(None)
    return True


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopCopies] = (
    weakref.WeakKeyDictionary()
)


def start_on_loop(begin: Begin, finish: Finish, deadline_ns: int) -> Completion | None:
    """Start a copy in the background of the running event loop: ``begin(signal)`` starts
    it; None when it was copied in the caller (done), else its completion (with
    ``deadline_ns``), which the loop completes when it ended, with ``finish``'s verdict.

    :raises: what ``begin`` raises (nothing started).
    """
    loop = asyncio.get_running_loop()
    copies = _loops.get(loop)
    if copies is None:
        copies = _loops[loop] = _LoopCopies(loop)
    return copies.start(begin, finish, deadline_ns)
