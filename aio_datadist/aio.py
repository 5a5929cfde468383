"""The async facade: ``AsyncLLMDataDist`` and ``AsyncCacheManager``, awaited from asyncio.

Same names, arguments, results and errors as the blocking API, as coroutines. Both faces run
the same engine code: a transfer call is the engine's generator (``_engine.driver``), which
:class:`_Driver` runs on the event loop. It goes inline as far as it can (starts of small
payloads, requests already complete), runs large payloads moved in the caller on a worker
thread, and awaits the rest with the loop watching the link (it may read small answers
itself). Local copies run inline when small and on a worker thread when large.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable, Coroutine
from functools import partial
from types import TracebackType
from typing import Any

import anyio.to_thread

from aio_datadist._engine.caches import CacheService, PoolStats, Reservation
from aio_datadist._engine.driver import (
    Call,
    Start,
    Synchronize,
    TaskCancelled,
    Wait,
    run_call,
    run_layers,
    settle,
)
from aio_datadist._engine.engine import Engine
from aio_datadist._engine.layerwise import plan_layer_job
from aio_datadist._engine.links import LinkTable
from aio_datadist._engine.offload import INLINE_BYTES, run_native
from aio_datadist._engine.plan import CopyPlan
from aio_datadist._engine.planner import Planner
from aio_datadist._engine.request import Completion, Plan
from aio_datadist._engine.routes import Waiting
from aio_datadist.cache import Cache
from aio_datadist.cluster import LinkResults
from aio_datadist.enums import LLMRole, Placement, RegisterMemStatus
from aio_datadist.status import LLMStatusCode, LLMTimeoutError
from aio_datadist.synchronizer import LayerSynchronizer, is_async_synchronizer
from aio_datadist.task import CacheTask

__all__ = ("AsyncLLMDataDist", "AsyncCacheManager")


class _LoopBound:
    """Refuses use from any loop or thread other than the one the engine was initialised on."""

    _loop: asyncio.AbstractEventLoop | None

    def _check_loop(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is None or running is not self._loop:
            raise RuntimeError(
                "this AsyncLLMDataDist belongs to the event loop it was initialised on; "
                "use the blocking LLMDataDist from other threads"
            )


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """True in the thread running ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _loop_idle() -> bool:
    """True when nothing but the running callback is ready on the running loop, so that a
    busy-poll of a few microseconds delays no other task. Known for asyncio's own loops
    (their ready queue); any other loop counts as busy."""
    ready = getattr(asyncio.get_running_loop(), "_ready", None)
    return isinstance(ready, collections.deque) and not ready


def _wake(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[bool], _: object) -> None:
    """A request ``waiter`` awaits completed: settle it on ``loop`` (at once when the loop
    itself completed it, having read the answer)."""
    if _on_loop(loop):
        _settle_waiter(waiter, True)
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(_settle_waiter, waiter, True)


def _settle_waiter(waiter: asyncio.Future[bool], completed: bool) -> None:
    if not waiter.done():
        waiter.set_result(completed)


async def _wait(completion: Completion) -> None:
    """Await a started request without cancelling it; raise its ``LLMException``.

    One loop future and one timer per wait: cancelling the awaiting task leaves the
    request alone (the transport completes it, and the plan releases its pins then).
    """
    future = completion.future
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        future.add_done_callback(partial(_wake, loop, waiter))
        timer = loop.call_later(completion.timeout_s(), _settle_waiter, waiter, False)
        try:
            completed = await waiter
        finally:
            timer.cancel()
        if not completed:
            raise LLMTimeoutError(
                "transfer did not complete within sync_kv_timeout",
                status_code=LLMStatusCode.LLM_TIMEOUT,
            )
    future.result()


async def _drain(started: list[Completion]) -> None:
    """Wait, through further cancellations, until every request has ended or timed out.

    A cancelled transfer still owns the caller's memory while its requests run (a pull's
    answer lands in the destination); the cancellation goes through once nothing writes it.
    """
    settled = asyncio.ensure_future(
        asyncio.gather(
            *(_wait(c) for c in started if not c.done()),
            return_exceptions=True,
        )
    )
    while not settled.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(settled)


class _Driver:
    """Runs one call of the engine (``_engine.driver``) on the event loop.

    :meth:`advance` goes as far as the call can without waiting: starts whose payload is
    small or not moved in the caller, and waits for requests already complete. :meth:`finish`
    awaits the rest. The loop watches each link the call's requests cross from before the
    first is sent until the call ends, so it reads their answers itself (``Channel.watch``).
    A cancelled awaiting task cancels nothing already started: it waits until those
    requests ended, then lets the cancellation through.
    """

    def __init__(
        self,
        call: Call,
        synchronizer: LayerSynchronizer | None = None,
        cancelled: asyncio.Event | None = None,
    ) -> None:
        self._call = call
        self._synchronizer = synchronizer
        self._cancelled = cancelled
        self._reply: Any = None
        self._error: Exception | None = None
        self._op: Start | Wait | Synchronize | None = None
        self._started: list[Completion] = []
        self._watching: dict[object, Callable[[], None]] = {}
        #: True once the call ended.
        self.done = False

    def _next(self) -> Start | Wait | Synchronize | None:
        reply, error = self._reply, self._error
        self._reply, self._error = None, None
        try:
            return self._call.send(reply) if error is None else self._call.throw(error)
        except StopIteration:
            self.done = True
            self._unwatch()
            return None
        except BaseException:
            self._unwatch()
            raise

    def _watch(self, start: Start) -> None:
        """Watch the link ``start`` will cross, before its request goes out."""
        watched = start.watch(asyncio.get_running_loop())
        if watched is not None:
            link, end = watched
            if link in self._watching:
                end()  # watched already for this call
            else:
                self._watching[link] = end

    def _unwatch(self) -> None:
        watching, self._watching = self._watching, {}
        for end in watching.values():
            end()

    def _begun(self, completion: Completion) -> None:
        self._started.append(completion)
        self._reply = completion

    def advance(self) -> None:
        """Run the call inline until it needs to wait (or ends)."""
        while self._op is None:
            op = self._next()
            if op is None:
                return
            if isinstance(op, Start) and not (op.nbytes > INLINE_BYTES and op.in_caller()):
                if op.waiting is Waiting.LOOP_EXCHANGE and not _loop_idle():
                    op.waiting = Waiting.LOOP  # others are ready to run: never busy-poll
                self._watch(op)
                self._begun(op.begin())
            elif isinstance(op, Wait) and op.completion.done():
                self._error = op.completion.exception()  # type: ignore[assignment]
            else:
                self._op = op

    async def finish(self) -> None:
        """Run the call to its end on the loop."""
        try:
            while True:
                self.advance()
                op, self._op = self._op, None
                if op is None:
                    return
                try:
                    if isinstance(op, Start):
                        op.waiting = Waiting.LOOP  # moved on a worker thread
                        self._watch(op)
                        self._begun(await run_native(op.begin, nbytes=op.nbytes))
                    elif isinstance(op, Wait):
                        await _wait(op.completion)
                    else:
                        self._reply = await self._synchronize(op.layer)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self._error = exc
        except asyncio.CancelledError:
            self._call.close()
            try:
                await _drain(self._started)
            finally:
                self._unwatch()
            raise

    async def _synchronize(self, layer: int) -> Any:
        """What the synchroniser says of ``layer``: an ``async def`` awaited here, a plain
        one on a worker thread (never on the loop).

        :raises TaskCancelled: the task was cancelled meanwhile.
        """
        synchronizer, cancelled = self._synchronizer, self._cancelled
        assert synchronizer is not None and cancelled is not None
        sync = synchronizer.synchronize_layer
        waiter: asyncio.Future[Any]
        if is_async_synchronizer(synchronizer):
            waiter = asyncio.ensure_future(sync(layer, None))
        else:
            waiter = asyncio.ensure_future(
                anyio.to_thread.run_sync(partial(sync, layer, None), abandon_on_cancel=True)
            )
        stop = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not waiter.done():
            waiter.cancel()
            raise TaskCancelled
        return waiter.result()


class AsyncCacheManager(_LoopBound):
    """The cache manager of an ``AsyncLLMDataDist``: every call is a coroutine.

    ``push_blocks`` and ``transfer_cache_async`` return a ``CacheTask`` at once.
    """

    def __init__(
        self,
        service: CacheService,
        planner: Planner,
        links: LinkTable,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._service = service
        self._planner = planner
        self._links = links
        self._loop = loop
        self._bound_loop = loop
        self._background: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._bound_loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _begin(self, plan: Plan) -> _Driver:
        """Run a pull or push call inline as far as it goes; the caller awaits
        ``finish()`` unless it is ``done`` (no coroutine of its own: thousands of awaited
        calls in flight each hold one object less)."""
        driver = _Driver(run_call(plan, self._links, Waiting.LOOP))
        driver.advance()
        return driver

    async def _run(self, plan: CopyPlan) -> None:
        try:
            await run_native(lambda: self._service.execute(plan), nbytes=plan.nbytes)
        finally:
            self._service.release(plan)

    async def _allocate(self, reservation: Reservation) -> Cache:
        """Zero a reservation's memory (off the loop when large), then make its cache."""
        if reservation.zero_bytes:
            try:
                await run_native(
                    lambda: self._service.clear(reservation), nbytes=reservation.zero_bytes
                )
            except BaseException:
                self._service.abandon(reservation)
                raise
        return self._service.commit(reservation)

    async def allocate_cache(self, cache_desc: Any, cache_keys: Any = ()) -> Cache:
        """As ``CacheManager.allocate_cache``; with ``zero_on_alloc``, a large cache is
        zeroed on a worker thread."""
        self._check_loop()
        return await self._allocate(self._service.reserve_cache(cache_desc, cache_keys))

    async def deallocate_cache(self, cache: Any) -> None:
        """As ``CacheManager.deallocate_cache``."""
        self._check_loop()
        self._service.deallocate_cache(cache)

    async def remove_cache_key(self, cache_key: Any) -> None:
        """As ``CacheManager.remove_cache_key``."""
        self._check_loop()
        self._service.remove_cache_key(cache_key)

    async def allocate_blocks_cache(self, cache_desc: Any, blocks_cache_key: Any = None) -> Cache:
        """As ``CacheManager.allocate_blocks_cache`` (zeroing as :meth:`allocate_cache`)."""
        self._check_loop()
        return await self._allocate(
            self._service.reserve_blocks_cache(cache_desc, blocks_cache_key)
        )

    async def deallocate_blocks_cache(self, cache: Any) -> None:
        """As ``CacheManager.deallocate_blocks_cache``."""
        self._check_loop()
        self._service.deallocate_blocks_cache(cache)

    async def register_cache(
        self, cache_desc: Any, addrs: Any, cache_keys: Any = (), remote_accessible: Any = None
    ) -> Cache:
        """As ``CacheManager.register_cache``."""
        self._check_loop()
        return self._service.register_cache(cache_desc, addrs, cache_keys, remote_accessible)

    async def register_blocks_cache(
        self,
        cache_desc: Any,
        addrs: Any,
        blocks_cache_key: Any = None,
        remote_accessible: Any = None,
    ) -> Cache:
        """As ``CacheManager.register_blocks_cache``."""
        self._check_loop()
        return self._service.register_blocks_cache(
            cache_desc, addrs, blocks_cache_key, remote_accessible
        )

    async def unregister_cache(self, cache_id: Any) -> None:
        """As ``CacheManager.unregister_cache``; waits for busy memory off the loop."""
        self._check_loop()
        busy = self._service.unregister_cache(cache_id)
        if busy is not None:
            await anyio.to_thread.run_sync(self._service.registry.wait_unpinned, busy)

    async def copy_cache(
        self,
        dst: Any,
        src: Any,
        dst_batch_index: Any = 0,
        src_batch_index: Any = 0,
        offset: Any = 0,
        size: Any = -1,
        req_id: Any = None,
    ) -> None:
        """As ``CacheManager.copy_cache``."""
        self._check_loop()
        await self._run(
            self._service.plan_copy_cache(
                dst, src, dst_batch_index, src_batch_index, offset, size, req_id
            )
        )

    async def copy_blocks(self, cache: Any, copy_block_info: Any) -> None:
        """As ``CacheManager.copy_blocks``."""
        self._check_loop()
        await self._run(self._service.plan_copy_blocks(cache, copy_block_info))

    async def swap_blocks(self, src_cache: Any, dst_cache: Any, src_to_dst: Any) -> None:
        """As ``CacheManager.swap_blocks``."""
        self._check_loop()
        await self._run(self._service.plan_swap_blocks(src_cache, dst_cache, src_to_dst))

    async def remap_registered_memory(self, mem_infos: Any) -> None:
        """As ``CacheManager.remap_registered_memory`` (reserved: always raises)."""
        self._check_loop()
        self._service.remap_registered_memory(mem_infos)

    async def pull_cache(
        self, cache_key: Any, cache: Any, batch_index: Any = 0, size: Any = -1, **kwargs: Any
    ) -> None:
        """As ``CacheManager.pull_cache``."""
        self._check_loop()
        driver = self._begin(self._planner.pull_cache(cache_key, cache, batch_index, size, kwargs))
        if not driver.done:
            await driver.finish()

    async def pull_blocks(
        self,
        src_cache_key: Any,
        dst_cache: Any,
        src_blocks: Any = (),
        dst_blocks: Any = (),
        **kwargs: Any,
    ) -> None:
        """As ``CacheManager.pull_blocks``."""
        self._check_loop()
        driver = self._begin(
            self._planner.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs)
        )
        if not driver.done:
            await driver.finish()

    async def push_cache(
        self,
        dst_cache_key: Any,
        src_cache: Any,
        src_batch_index: Any = 0,
        src_layer_range: Any = None,
        dst_layer_range: Any = None,
        size: Any = -1,
        tensor_num_per_layer: Any = 2,
    ) -> None:
        """As ``CacheManager.push_cache``."""
        self._check_loop()
        driver = self._begin(
            self._planner.push_cache(
                dst_cache_key,
                src_cache,
                src_batch_index,
                src_layer_range,
                dst_layer_range,
                size,
                tensor_num_per_layer,
            )
        )
        if not driver.done:
            await driver.finish()

    def push_blocks(
        self,
        dst_cache_key: Any,
        src_cache: Any,
        src_blocks: Any = (),
        dst_blocks: Any = (),
        src_layer_range: Any = None,
        dst_layer_range: Any = None,
        tensor_num_per_layer: Any = 2,
    ) -> CacheTask:
        """As ``CacheManager.push_blocks``, returning an awaitable ``CacheTask`` at once.

        Bad arguments raise here, exactly as the blocking call. Everything after (no link,
        a refusal, a timeout) goes to the task: ``await task`` raises what the blocking
        ``push_blocks`` raises, ``await task.wait_results()`` returns the status. A small
        push may complete inline (the task is then already ``done()``).
        """
        self._check_loop()
        plan = self._planner.push_blocks(
            dst_cache_key,
            src_cache,
            src_blocks,
            dst_blocks,
            src_layer_range,
            dst_layer_range,
            tensor_num_per_layer,
        )
        task = CacheTask(1, self._loop)
        driver = _Driver(settle(run_call(plan, self._links, Waiting.LOOP), task))
        driver.advance()
        if not driver.done:
            self._spawn(driver.finish())
        return task

    def transfer_cache_async(
        self,
        src_cache: Any,
        layer_synchronizer: Any,
        transfer_configs: Any,
        src_block_indices: Any = None,
        dst_block_indices: Any = None,
        dst_block_memory_size: Any = None,
    ) -> CacheTask:
        """As ``CacheManager.transfer_cache_async``, driven on this event loop.

        An ``async def`` ``synchronize_layer`` is awaited here; a plain one runs on a worker
        thread. Bad arguments raise here; transfer failures go to the task, whose ``await``
        raises the first failed config's ``LLMException``. ``task.cancel()`` stops before
        the next layer (``await task`` then raises ``CancelledError``).
        """
        self._check_loop()
        job = plan_layer_job(
            self._planner,
            src_cache,
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
            allow_async=True,
        )
        task = CacheTask(len(job.configs), self._loop)
        cancelled = asyncio.Event()
        loop = self._bound_loop
        task._on_cancel(lambda: _call_soon(loop, cancelled.set))
        call = run_layers(job, task, self._links, Waiting.LOOP)
        self._spawn(_Driver(call, job.synchronizer, cancelled).finish())
        return task

    def pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Usage of the memory pool for ``placement`` (None when not configured)."""
        return self._service.pool_stats(placement)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to wake
        loop.call_soon_threadsafe(callback)


class AsyncLLMDataDist(_LoopBound):
    """An LLM-DataDist endpoint for asyncio. Any number may live in one process.

    ``async with AsyncLLMDataDist(role, cluster_id) as engine`` finalizes on exit; ``init``
    stays explicit.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._engine = Engine(role, cluster_id)
        self._loop = None
        self._cache_manager: AsyncCacheManager | None = None

    async def init(self, options: dict[str, str]) -> None:
        """As ``LLMDataDist.init``; binds the engine to the running event loop."""
        if self._engine.initialized:
            self._check_loop()
            return
        loop = asyncio.get_running_loop()
        await anyio.to_thread.run_sync(self._engine.init, options)
        self._loop = loop

    async def finalize(self) -> None:
        """As ``LLMDataDist.finalize``."""
        if not self._engine.initialized:
            return
        self._check_loop()
        self._engine.finalize()
        self._cache_manager = None
        self._loop = None

    async def __aenter__(self) -> AsyncLLMDataDist:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.finalize()

    @property
    def cache_manager(self) -> AsyncCacheManager:
        """The async cache manager; same preconditions as ``LLMDataDist.cache_manager``."""
        service = self._engine.cache_service()
        self._check_loop()
        assert self._loop is not None
        if self._cache_manager is None or self._cache_manager._service is not service:
            planner, links = self._engine.planner, self._engine.links
            assert planner is not None and links is not None
            self._cache_manager = AsyncCacheManager(service, planner, links, self._loop)
        return self._cache_manager

    async def link_clusters(
        self, clusters: Any, timeout: Any = 3000
    ) -> tuple[LLMStatusCode, LinkResults]:
        """As ``LLMDataDist.link_clusters``; the handshakes run on a worker thread."""
        self._check_init_loop()
        return await anyio.to_thread.run_sync(self._engine.link_clusters, clusters, timeout)

    async def unlink_clusters(
        self, clusters: Any, timeout: Any = 3000, force: Any = False
    ) -> tuple[LLMStatusCode, LinkResults]:
        """As ``LLMDataDist.unlink_clusters``."""
        self._check_init_loop()
        return await anyio.to_thread.run_sync(
            self._engine.unlink_clusters, clusters, timeout, force
        )

    async def switch_role(self, role: Any, switch_options: Any = None) -> None:
        """As ``LLMDataDist.switch_role``."""
        self._check_init_loop()
        self._engine.switch_role(role, switch_options)

    async def link(self, comm_name: Any, cluster_rank_info: Any, rank_table: Any) -> int:
        """As ``LLMDataDist.link``; waits for the other members on a worker thread."""
        self._check_init_loop()
        return await anyio.to_thread.run_sync(
            self._engine.link, comm_name, cluster_rank_info, rank_table
        )

    async def unlink(self, comm_id: Any) -> None:
        """As ``LLMDataDist.unlink``."""
        self._check_init_loop()
        await anyio.to_thread.run_sync(self._engine.unlink, comm_id)

    async def query_register_mem_status(self, comm_id: Any) -> RegisterMemStatus:
        """As ``LLMDataDist.query_register_mem_status``."""
        self._check_init_loop()
        return self._engine.query_register_mem_status(comm_id)

    def _check_init_loop(self) -> None:
        self._engine.link_table()
        self._check_loop()

    @property
    def cluster_id(self) -> int:
        """The cluster id given at construction."""
        return self._engine.cluster_id

    def __repr__(self) -> str:
        state = "initialized" if self._engine.initialized else "not initialized"
        return f"<AsyncLLMDataDist role={self._engine.role!s} cluster_id={self.cluster_id} {state}>"
