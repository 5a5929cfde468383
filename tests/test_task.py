"""CacheTask semantics, blocking and awaited, with a producer on another thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from aio_datadist import CacheTask, LayerSynchronizer, LLMException, LLMStatusCode
from aio_datadist.status import KvCacheNotExistError, LLMFailedError, LLMTimeoutError
from aio_datadist.synchronizer import is_async_synchronizer

S, F, T = LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_FAILED, LLMStatusCode.LLM_TIMEOUT
KV = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def finish_later(
    task: CacheTask, results: list[LLMStatusCode], gate: threading.Event
) -> threading.Thread:
    def run() -> None:
        gate.wait(5)
        for i, r in enumerate(results):
            task._set_result(i, r)
        task._finish()

    t = threading.Thread(target=run)
    t.start()
    return t


def test_blocking_wait_timeout_then_results() -> None:
    task = CacheTask(2)
    gate = threading.Event()
    t = finish_later(task, [S, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST], gate)
    assert task.synchronize(timeout_in_millis=10) == T
    assert task.get_results(timeout_in_millis=0) == [T, T]
    assert not task.done()
    gate.set()
    assert task.synchronize() == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert task.get_results() == [S, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST]
    assert task.synchronize() == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST  # repeatable
    assert task.done() and not task.cancel()
    t.join()


def test_never_started_configs_are_none_and_count_as_success() -> None:
    task = CacheTask(3)
    task._set_result(0, S)
    task._finish()
    assert task.get_results() == [S, None, None]
    assert task.synchronize() == S


def test_timeout_argument_is_checked() -> None:
    task = CacheTask(1)
    with pytest.raises(ValueError):
        task.synchronize(-1)
    with pytest.raises(TypeError):
        task.get_results(1.5)


async def test_await_from_several_coroutines() -> None:
    task = CacheTask(1)
    gate = threading.Event()
    t = finish_later(task, [S], gate)
    waiters = [asyncio.create_task(task.wait_results()) for _ in range(3)]
    plain = asyncio.ensure_future(task)
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    gate.set()
    assert await plain == S
    assert [await w for w in waiters] == [[S]] * 3
    assert await task == S  # awaiting a finished task is immediate and repeatable
    await asyncio.to_thread(t.join)


async def test_cancelling_the_awaiter_does_not_cancel_the_task() -> None:
    task = CacheTask(1)
    waiter = asyncio.ensure_future(task)
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not task.done()
    task._set_result(0, S)
    task._finish()
    assert await task == S


async def test_cancel_runs_callbacks_and_reports_status() -> None:
    task = CacheTask(2)
    seen: list[str] = []
    task._on_cancel(lambda: seen.append("cancel"))
    assert task.cancel()
    assert seen == ["cancel"] and task._cancelled
    task._on_cancel(lambda: seen.append("late"))  # registered after cancel: runs at once
    assert seen == ["cancel", "late"]
    task._set_result(0, F)
    task._finish()
    for _ in range(2):  # as awaiting a cancelled asyncio.Task, every time
        with pytest.raises(asyncio.CancelledError):
            await task
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert await task.wait_results() == [F, None]  # never raises
    assert task.synchronize(0) == F
    assert not task.cancel()


async def test_await_raises_the_first_failure_with_every_result() -> None:
    task = CacheTask(4)
    error = KvCacheNotExistError("cache 7 does not exist", status_code=KV)
    task._set_result(0, S)
    task._set_result(1, KV, error)
    task._set_result(2, F)
    task._set_result(1, KV)  # a later report without the exception keeps it
    task._finish()
    with pytest.raises(KvCacheNotExistError) as info:
        await task
    assert info.value is error and info.value.results == [S, KV, F, None]
    depth = len(_frames(info.value))
    with pytest.raises(KvCacheNotExistError) as again:  # repeatable, the traceback stays put
        await task
    assert again.value is error and len(_frames(again.value)) == depth
    assert await task.wait_results() == [S, KV, F, None]
    assert task.synchronize() == KV and task.get_results() == [S, KV, F, None]


async def test_await_builds_the_exception_when_only_a_status_is_known() -> None:
    task = CacheTask(2)
    task._set_result(0, T, LLMFailedError("stale", status_code=F))  # code differs: not used
    task._finish()
    with pytest.raises(LLMTimeoutError) as info:
        await task
    assert info.value.status_code == T and info.value.results == [T, None]
    assert "transfer config 0" in str(info.value)
    foreign = CacheTask(1)
    cause = OSError("socket closed")
    foreign._set_result(0, F, cause)
    foreign._finish()
    with pytest.raises(LLMException) as other:
        await foreign
    assert other.value.status_code == F and other.value.__cause__ is cause
    assert "OSError: socket closed" in str(other.value)


async def test_await_of_a_successful_task_is_success() -> None:
    task = CacheTask(2)
    task._set_result(0, S)
    task._finish()
    assert await task == S  # a config never attempted counts as success
    assert list(await asyncio.gather(task, task)) == [S, S]


def _frames(exc: BaseException) -> list[object]:
    frames: list[object] = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def test_a_config_unfinished_at_cancel_never_reports_success() -> None:
    """Requests that complete after ``cancel()`` do not make their config a success."""
    task = CacheTask(3)
    task._set_result(0, S)  # finished before the cancel
    assert task.cancel()
    task._set_result(1, S)  # its last request completed after the cancel
    task._set_result(0, S)
    task._set_result(1, S)
    task._finish()
    assert task.get_results(0) == [S, F, None]
    assert task.synchronize(0) == F


async def test_blocking_wait_on_the_producing_loop_is_refused() -> None:
    task = CacheTask(1, loop=asyncio.get_running_loop())
    with pytest.raises(RuntimeError, match="await the task"):
        task.synchronize()
    task._finish()
    assert task.synchronize() == S  # done: no wait needed, allowed


def test_layer_synchronizer_is_abstract() -> None:
    with pytest.raises(TypeError):
        LayerSynchronizer()  # type: ignore[abstract]

    class Plain(LayerSynchronizer):
        def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    class Awaited(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            return True

    assert not is_async_synchronizer(Plain())
    assert is_async_synchronizer(Awaited())
