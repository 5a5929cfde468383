"""The process-wide deadline reaper: one thread that runs callbacks when their deadlines pass.

Transports give every request an absolute deadline (``monotonic_ns()``); the reaper fails the
requests nobody answered in time. Scheduling is a heap push under a lock and cancelling only
marks the entry, so the fast path (a request answered well before its deadline) costs a few
microseconds and never wakes the reaper thread unless the new deadline is the earliest one.
Cancelled entries are dropped lazily and the heap is rebuilt once they are the majority.

Callbacks run on the reaper thread, must be quick, and must tolerate running after the
thing they guard already finished (a cancel may race with the deadline).
"""

from __future__ import annotations

import heapq
import math
import os
import threading
import time
from collections.abc import Callable

from aio_datadist._log import get_logger
from aio_datadist._native.api import monotonic_ns

__all__ = ("Reaper", "Timer", "after_s", "now_ns", "reaper")

_log = get_logger("deadlines")


def _pick_clock() -> Callable[[], int]:
    """``time.monotonic_ns`` when it reads the native layer's clock, else the native reading.

    Both are ``CLOCK_MONOTONIC`` on Linux; Python's needs no call into C (which would release
    and re-take the GIL, a chance for another thread to get in on every reading).
    """
    before = monotonic_ns()
    python = time.monotonic_ns()
    after = monotonic_ns()
    if before - 1_000_000 <= python <= after + 1_000_000:
        return time.monotonic_ns
    return monotonic_ns


#: ``monotonic_ns()`` of the native layer: the clock of every deadline.
now_ns: Callable[[], int] = _pick_clock()


def after_s(seconds: float) -> int:
    """The absolute deadline ``seconds`` from now (never 0, which means "none" natively)."""
    return max(1, now_ns() + math.ceil(seconds * 1e9))


#: Rebuild the heap once at least this many entries are cancelled and they are the majority.
_COMPACT_MIN = 1024


class Timer:
    """A scheduled callback; :meth:`cancel` stops it if it has not run yet."""

    __slots__ = ("_owner", "fn", "seq", "when")

    def __init__(self, when: int, seq: int, fn: Callable[[], None], owner: Reaper) -> None:
        self.when = when
        self.seq = seq
        self.fn: Callable[[], None] | None = fn
        self._owner = owner

    def __lt__(self, other: Timer) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)

    def cancel(self) -> None:
        """Do not run the callback (it may already be running). Idempotent."""
        if self.fn is not None:
            self._owner._cancelled(self)


class Reaper:
    """Runs callbacks at absolute ``monotonic_ns()`` deadlines on one daemon thread."""

    def __init__(self, name: str = "aio-dd-deadlines") -> None:
        self._name = name
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[Timer] = []
        self._seq = 0
        self._ncancelled = 0
        self._thread: threading.Thread | None = None
        # What the thread sleeps for: 0 busy (it looks at the heap again before sleeping),
        # -1 until notified, else a monotonic_ns time; a new earliest entry wakes it.
        self._waiting_until = 0

    def schedule(self, when_ns: int, fn: Callable[[], None]) -> Timer:
        """Call ``fn()`` on the reaper thread once ``monotonic_ns() >= when_ns``."""
        with self._cond:
            self._seq += 1
            timer = Timer(when_ns, self._seq, fn, self)
            heapq.heappush(self._heap, timer)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._heap[0] is timer:
                waiting = self._waiting_until
                if waiting < 0 or 0 < when_ns < waiting:
                    self._cond.notify()
        return timer

    def _cancelled(self, timer: Timer) -> None:
        with self._cond:
            if timer.fn is None:
                return
            timer.fn = None
            self._ncancelled += 1
            if self._ncancelled >= _COMPACT_MIN and 2 * self._ncancelled > len(self._heap):
                self._heap = [t for t in self._heap if t.fn is not None]
                heapq.heapify(self._heap)
                self._ncancelled = 0

    def __len__(self) -> int:
        """Scheduled callbacks, cancelled ones not yet dropped included."""
        with self._cond:
            return len(self._heap)

    def _run(self) -> None:
        while True:
            due: list[Callable[[], None]] = []
            with self._cond:
                heap = self._heap
                while heap and heap[0].fn is None:
                    heapq.heappop(heap)
                    self._ncancelled -= 1
                if not heap:
                    self._waiting_until = -1  # any new entry is the earliest
                    self._cond.wait()
                    self._waiting_until = 0
                    continue
                now = now_ns()
                first = heap[0].when
                if first > now:
                    self._waiting_until = first
                    self._cond.wait((first - now) / 1e9)
                    self._waiting_until = 0
                    continue
                while heap and heap[0].when <= now:
                    timer = heapq.heappop(heap)
                    if timer.fn is None:
                        self._ncancelled -= 1
                    else:
                        due.append(timer.fn)
                        timer.fn = None
            for fn in due:
                try:
                    fn()
                except Exception:
                    _log.warning("deadline.callback_failed", exc_info=True)


#: The process-wide reaper.
reaper = Reaper()

if hasattr(os, "register_at_fork"):
    # A forked child has no reaper thread; start afresh there.
    os.register_at_fork(after_in_child=reaper._reset)
