"""The door to worker threads: inline below the threshold, and never abandoned on cancel."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aio_datadist._engine.offload import INLINE_BYTES, run_native


async def test_small_work_runs_inline_and_large_work_on_a_thread() -> None:
    here = threading.get_ident()
    assert await run_native(threading.get_ident, nbytes=INLINE_BYTES) == here
    assert await run_native(threading.get_ident, nbytes=INLINE_BYTES + 1) != here


async def test_a_cancelled_caller_waits_for_its_thread() -> None:
    finished: list[float] = []

    def slow() -> None:
        time.sleep(0.3)
        finished.append(time.monotonic())

    task = asyncio.ensure_future(run_native(slow, nbytes=INLINE_BYTES + 1))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # the cancellation comes through only once the thread stopped touching memory
    assert finished and finished[0] <= time.monotonic()
    task = asyncio.ensure_future(run_native(slow, nbytes=INLINE_BYTES + 1))
    await asyncio.sleep(0.05)
    for _ in range(3):  # repeated cancellations change nothing
        task.cancel()
        await asyncio.sleep(0.01)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(finished) == 2
