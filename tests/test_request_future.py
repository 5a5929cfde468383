"""The transport's request future behaves as a running ``concurrent.futures.Future`` for every
use the project makes of one: waits with timeouts, done callbacks from any thread, asyncio."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

from aio_datadist._transport.future import RequestFuture
from aio_datadist.status import LLMException, LLMStatusCode


def test_it_runs_from_birth_and_cannot_be_cancelled() -> None:
    future = RequestFuture()
    assert isinstance(future, Future)
    assert future.running() and not future.done() and not future.cancelled()
    assert future.cancel() is False and not future.cancelled()
    assert future.set_running_or_notify_cancel() is True
    with pytest.raises(FutureTimeout):
        future.result(timeout=0.01)
    future.set_result(None)
    assert future.done() and not future.running() and future.result() is None
    assert future.exception() is None
    with pytest.raises(InvalidStateError):
        future.set_result(None)
    with pytest.raises(InvalidStateError):
        future.set_exception(RuntimeError("late"))
    assert "finished ok" in repr(future)


def test_a_failure_is_raised_to_every_waiter() -> None:
    future = RequestFuture()
    error = LLMException("gone", status_code=LLMStatusCode.LLM_LINK_FAILED)
    future.set_exception(error)
    assert future.exception() is error
    with pytest.raises(LLMException) as info:
        future.result()
    assert info.value is error
    assert "LLMException" in repr(future) or "Error" in repr(future)


def test_callbacks_run_once_each_whenever_they_are_added(caplog: pytest.LogCaptureFixture) -> None:
    future = RequestFuture()
    seen: list[object] = []
    future.add_done_callback(seen.append)

    def broken(_: object) -> None:
        raise RuntimeError("a callback's bug")

    future.add_done_callback(broken)  # logged, never stops the others
    future.add_done_callback(seen.append)
    future.set_result(None)
    future.add_done_callback(seen.append)  # already done: runs at once
    assert seen == [future, future, future]
    assert "a callback's bug" in caplog.text


def test_threads_blocked_on_it_wake_when_another_completes_it() -> None:
    futures = [RequestFuture() for _ in range(200)]
    woke: list[int] = []
    lock = threading.Lock()

    def wait(i: int) -> None:
        futures[i].result(timeout=10)
        with lock:
            woke.append(i)

    waiters = [threading.Thread(target=wait, args=(i,)) for i in range(len(futures))]
    for t in waiters:
        t.start()
    completers = [
        threading.Thread(target=lambda part=part: [f.set_result(None) for f in part])
        for part in (futures[0::2], futures[1::2])
    ]
    for t in completers:
        t.start()
    for t in completers + waiters:
        t.join(10)
    assert sorted(woke) == list(range(len(futures)))


async def test_asyncio_awaits_it_through_wrap_future() -> None:
    ok, failed = RequestFuture(), RequestFuture()
    threading.Timer(0.01, ok.set_result, (None,)).start()
    error = LLMException("late", status_code=LLMStatusCode.LLM_TIMEOUT)
    threading.Timer(0.01, failed.set_exception, (error,)).start()
    assert await asyncio.wait_for(asyncio.wrap_future(ok), 10) is None
    with pytest.raises(LLMException) as info:
        await asyncio.wait_for(asyncio.wrap_future(failed), 10)
    assert info.value is error
    # Cancelling the awaiting side leaves the request alone.
    pending = RequestFuture()
    wrapped = asyncio.wrap_future(pending)
    wrapped.cancel()
    await asyncio.sleep(0)
    assert pending.running() and not pending.cancelled()
    pending.set_result(None)
