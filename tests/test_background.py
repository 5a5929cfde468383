"""Copies the native copy workers run while an event loop goes on (``_engine.background``)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import pytest

from aio_datadist._engine.background import start_on_loop
from aio_datadist._native import api

MiB = 1 << 20


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rows(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    return np.array([[dst.ctypes.data, src.ctypes.data, src.nbytes]], dtype=np.uint64)


async def _copy_each(src: np.ndarray, dsts: list[np.ndarray]) -> None:
    """Copy ``src`` into each of ``dsts`` at once in the background of this loop; check
    every byte and that each copy ended well."""
    verdicts: list[OSError | None] = []

    def begin(dst: np.ndarray) -> Any:
        return lambda signal: api.vm_copy_batch(
            os.getpid(), _rows(dst, src), write=False, signal=signal
        )

    try:
        started = [start_on_loop(begin(dst), verdicts.append, 0) for dst in dsts]
    except PermissionError as exc:
        pytest.skip(f"the kernel refuses cross-process memory access here: {exc}")
    assert all(c is not None and not c.done() for c in started)  # the loop completes them
    futures = [c.future for c in started if c is not None]
    await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), 20)
    assert verdicts == [None] * len(dsts)
    for dst in dsts:
        np.testing.assert_array_equal(dst, src)


async def test_copies_end_on_the_loop_and_leave_no_descriptor() -> None:
    src = np.random.default_rng(1).integers(0, 256, 4 * MiB, dtype=np.uint8)
    before = _fds()
    await _copy_each(src, [np.zeros_like(src) for _ in range(3)])
    assert _fds() == before  # the signal is given up once no copy runs


async def test_a_fault_while_completing_is_the_futures_failure() -> None:
    src = np.ones(2 * MiB, dtype=np.uint8)
    dst = np.zeros_like(src)

    def finish(error: OSError | None) -> None:
        raise RuntimeError("a fault of the verdict itself")

    try:
        started = start_on_loop(
            lambda signal: api.vm_copy_batch(
                os.getpid(), _rows(dst, src), write=False, signal=signal
            ),
            finish,
            0,
        )
    except PermissionError as exc:
        pytest.skip(f"the kernel refuses cross-process memory access here: {exc}")
    assert started is not None
    with pytest.raises(RuntimeError, match="verdict itself"):
        await asyncio.wait_for(asyncio.wrap_future(started.future), 10)


async def test_a_copy_that_fails_hands_its_error_to_the_verdict() -> None:
    dst = np.zeros(2 * MiB, dtype=np.uint8)
    rows = np.array([[dst.ctypes.data, 4096, dst.nbytes]], dtype=np.uint64)  # unmapped source
    verdicts: list[OSError | None] = []
    try:
        started = start_on_loop(
            lambda signal: api.vm_copy_batch(os.getpid(), rows, write=False, signal=signal),
            verdicts.append,
            0,
        )
    except PermissionError as exc:
        pytest.skip(f"the kernel refuses cross-process memory access here: {exc}")
    assert started is not None
    await asyncio.wait_for(asyncio.wrap_future(started.future), 10)
    assert len(verdicts) == 1 and isinstance(verdicts[0], OSError)


async def test_many_copies_in_flight_are_each_looked_at_about_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 32 copies run at once; each post of the signal reaps the copies that ended, oldest
    # first, not every running copy (that was about n * n / 2 looks for n copies).
    src = np.random.default_rng(2).integers(0, 256, 2 * MiB, dtype=np.uint8)
    dsts = [np.zeros_like(src) for _ in range(32)]
    looks = 0
    reap = api.CopyTask.reap

    def counted(self: api.CopyTask, *, wait: bool = False) -> bool:
        nonlocal looks
        looks += 1
        return reap(self, wait=wait)

    monkeypatch.setattr(api.CopyTask, "reap", counted)
    await _copy_each(src, dsts)
    assert looks <= 3 * len(dsts)
