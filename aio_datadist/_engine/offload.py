"""The one door to worker threads: small native work runs inline, large work on a thread.

A thread hop costs 100-200 µs on a small machine, more than copying a few 64 KiB blocks, so
work below :data:`INLINE_BYTES` runs on the event loop (the native call releases the GIL and
finishes in well under a millisecond). Larger work goes to a worker thread limited by a
dedicated capacity limiter. (A mover with threads of its own takes large work there itself:
the same-host route's copies on the native copy workers, ``_engine.background``.) A running
native call is never abandoned on cancellation: it may be writing memory that cancellation
would free, so the caller waits for it to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

__all__ = ("INLINE_BYTES", "WORKER_THREADS", "run_native")

T = TypeVar("T")

#: Work moving at most this many bytes runs inline (about 100 µs of memcpy).
INLINE_BYTES = 1 << 20
#: Worker threads that may run native work at once, per event loop.
WORKER_THREADS = 4

_limiters: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


def _limiter() -> anyio.CapacityLimiter:
    loop = asyncio.get_running_loop()
    limiter = _limiters.get(loop)
    if limiter is None:
        limiter = _limiters[loop] = anyio.CapacityLimiter(WORKER_THREADS)
    return limiter


async def run_native(fn: Callable[[], T], *, nbytes: int) -> T:
    """Run ``fn`` inline when it moves at most :data:`INLINE_BYTES`, else on a worker thread."""
    if nbytes <= INLINE_BYTES:
        return fn()
    # anyio stops waiting for its thread when the awaiting asyncio task is cancelled; the
    # work then runs on unwatched. Shield it, and on cancellation wait for it to end before
    # letting the cancellation through.
    work = asyncio.ensure_future(anyio.to_thread.run_sync(fn, limiter=_limiter()))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(work)
        if not work.cancelled():
            work.exception()  # retrieved: the cancellation is what the caller sees
        raise
