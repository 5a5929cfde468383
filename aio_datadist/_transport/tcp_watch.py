"""An event loop reading a TCP link through its pump while it awaits requests
(:class:`LoopWatch`): its selector watches a duplicate of the socket, and at each readiness
the loop reads what is there without waiting, completing answers on the loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

from aio_datadist._native.pump import FramePump

__all__ = ("LoopWatch",)


class LoopWatch:
    """One link's watching loop (at most one at a time). ``settle_done`` completes the
    requests the pump listed; ``dup()`` is a duplicate of the socket's descriptor, or None
    once the link broke."""

    def __init__(
        self, pump: FramePump, settle_done: Callable[[], None], dup: Callable[[], int | None]
    ) -> None:
        self._pump = pump
        self._settle_done = settle_done
        self._dup = dup
        # Touched on the watching loop's thread only.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchers = 0
        self._fd = -1  # the duplicate in the loop's selector

    def watch(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        """Let ``loop`` (running in the calling thread) read the link while it awaits; the
        returned call ends this wait's part in it. None when another loop watches.

        The loop keeps watching between its requests; the first frame for the reader
        thread (the peer's requests, refusals, ...) ends the watch until its next request.
        """
        if self._loop is not None and self._loop is not loop:
            return None
        if self._fd < 0 and not self._start(loop):
            return None
        self._loop = loop
        self._watchers += 1
        self._pump.expect()
        return self._unwatch

    def _start(self, loop: asyncio.AbstractEventLoop) -> bool:
        fd = self._dup()
        if fd is None:
            return False
        try:
            loop.add_reader(fd, self._read)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def _read(self) -> None:
        """(On the loop, at the socket's readiness.)"""
        mine = self._pump.poll()
        self._settle_done()
        if not mine:
            self._stop()

    def _unwatch(self) -> None:
        self._watchers -= 1
        if self._watchers == 0 and self._fd < 0:
            self._loop = None

    def _stop(self) -> None:
        """Take the socket out of the loop's selector (on the loop's thread)."""
        fd, self._fd = self._fd, -1
        loop = self._loop
        if self._watchers == 0:
            self._loop = None
        if fd >= 0:
            try:
                if loop is not None and not loop.is_closed():
                    loop.remove_reader(fd)
            finally:
                os.close(fd)

    def end(self) -> None:
        """The link closed: let the duplicate go (its loop may be gone)."""
        loop = self._loop
        if self._fd < 0 or loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop or loop.is_closed():
            self._stop()
            return
        with contextlib.suppress(RuntimeError):  # closed meanwhile: the selector went with it
            loop.call_soon_threadsafe(self._stop)
