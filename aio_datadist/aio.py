"""The async facade: ``AsyncLLMDataDist`` and ``AsyncCacheManager``, awaited from asyncio.

Same names, arguments, results and errors as the blocking API, as coroutines. Both faces run
the same engine code; this one executes small copies inline on the loop and large ones on a
worker thread, and waits for busy memory without blocking the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import Future
from functools import partial
from types import TracebackType
from typing import Any

import anyio.to_thread

from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.engine import Engine
from aio_datadist._engine.layerwise import LayerJob, plan_layer_job
from aio_datadist._engine.offload import INLINE_BYTES, run_native
from aio_datadist._engine.plan import CopyPlan
from aio_datadist._engine.transfers import (
    GRACE_S,
    BlocksCall,
    Step,
    TransferPlan,
    TransferService,
)
from aio_datadist._memory.pool import PoolStats
from aio_datadist._native import api
from aio_datadist._transport.base import Channel
from aio_datadist.cache import Cache
from aio_datadist.cluster import LinkResults
from aio_datadist.enums import LLMRole, Placement, RegisterMemStatus
from aio_datadist.status import LLMException, LLMStatusCode, LLMTimeoutError
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


def _watch(steps: Iterable[Step]) -> Callable[[], None]:
    """Let the running loop read the answers of ``steps`` sent over links (see
    ``Channel.watch``) until the returned call."""
    loop = asyncio.get_running_loop()
    channels = {step.channel: None for step in steps if step.peer is None}
    ends = [end for channel in channels if (end := channel.watch(loop)) is not None]

    def unwatch() -> None:
        for end in ends:
            end()

    return unwatch


def _settle_waiter(waiter: asyncio.Future[bool], completed: bool) -> None:
    if not waiter.done():
        waiter.set_result(completed)


async def _wait(future: Future[None], deadline_ns: int) -> None:
    """Await a request's future without cancelling it; raise its ``LLMException``.

    One loop future and one timer per wait: cancelling the awaiting task leaves the
    request alone (the transport completes it, and the plan releases its pins then).
    """
    if not future.done():
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()

        def wake(_: object) -> None:
            if _on_loop(loop):  # completed by the loop itself (it read the answer)
                _settle_waiter(waiter, True)
                return
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_settle_waiter, waiter, True)

        future.add_done_callback(wake)
        remaining = max(0.0, (deadline_ns - api.monotonic_ns()) / 1e9) + GRACE_S
        timer = loop.call_later(remaining, _settle_waiter, waiter, False)
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


async def _await_request(channel: Channel, future: Future[None], deadline_ns: int) -> None:
    """Await one request over ``channel`` with the loop watching the link; a cancelled
    caller still waits until nothing writes its memory."""
    unwatch = channel.watch(asyncio.get_running_loop())
    try:
        await _wait(future, deadline_ns)
    except asyncio.CancelledError:
        await _drain([future], deadline_ns)
        raise
    finally:
        if unwatch is not None:
            unwatch()


async def _drain(futures: list[Future[None]], deadline_ns: int) -> None:
    """Wait, through further cancellations, until every request has ended or timed out.

    A cancelled transfer still owns the caller's memory while its requests run (a pull's
    answer lands in the destination); the cancellation goes through once nothing writes it.
    """
    settled = asyncio.ensure_future(
        asyncio.gather(*(_wait(f, deadline_ns) for f in futures), return_exceptions=True)
    )
    while not settled.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(settled)


class AsyncCacheManager(_LoopBound):
    """The cache manager of an ``AsyncLLMDataDist``: every call is a coroutine.

    ``push_blocks`` and ``transfer_cache_async`` return a ``CacheTask`` at once.
    """

    def __init__(
        self, service: CacheService, transfers: TransferService, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._service = service
        self._transfers = transfers
        self._loop = loop
        self._bound_loop = loop
        self._background: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._bound_loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _start(self, plan: TransferPlan, step: Step) -> Future[None]:
        """Start a step; payload moved by the caller goes to a worker thread when large."""
        if step.in_caller and step.nbytes > INLINE_BYTES:
            return await run_native(partial(self._transfers.start, plan, step), nbytes=step.nbytes)
        return self._transfers.start(plan, step)

    async def _transfer(self, plan: TransferPlan) -> None:
        futures: list[Future[None]] = []
        first: LLMException | None = None
        unwatch = _watch(plan.steps)
        try:
            try:
                for step in plan.steps:
                    futures.append(await self._start(plan, step))
            finally:
                plan.seal()
            for future in futures:
                try:
                    await _wait(future, plan.deadline_ns)
                except LLMException as exc:
                    first = first or exc
        except asyncio.CancelledError:
            await _drain(futures, plan.deadline_ns)
            raise
        finally:
            unwatch()
        if first is not None:
            raise first

    async def _run(self, plan: CopyPlan) -> None:
        try:
            await run_native(lambda: self._service.execute(plan), nbytes=plan.nbytes)
        finally:
            self._service.release(plan)

    async def allocate_cache(self, cache_desc: Any, cache_keys: Any = ()) -> Cache:
        """As ``CacheManager.allocate_cache``."""
        self._check_loop()
        return self._service.allocate_cache(cache_desc, cache_keys)

    async def deallocate_cache(self, cache: Any) -> None:
        """As ``CacheManager.deallocate_cache``."""
        self._check_loop()
        self._service.deallocate_cache(cache)

    async def remove_cache_key(self, cache_key: Any) -> None:
        """As ``CacheManager.remove_cache_key``."""
        self._check_loop()
        self._service.remove_cache_key(cache_key)

    async def allocate_blocks_cache(self, cache_desc: Any, blocks_cache_key: Any = None) -> Cache:
        """As ``CacheManager.allocate_blocks_cache``."""
        self._check_loop()
        return self._service.allocate_blocks_cache(cache_desc, blocks_cache_key)

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
        await self._transfer(
            self._transfers.plan_pull_cache(cache_key, cache, batch_index, size, kwargs)
        )

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
        checked = self._transfers.check_pull_blocks(
            src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs
        )
        if isinstance(checked, TransferPlan):
            await self._transfer(checked)
        else:
            await self._blocks(checked)

    def _start_blocks(self, call: BlocksCall) -> tuple[Channel, Future[None] | None, int] | None:
        """Start a small call on its direct route (``TransferService.start_blocks``); None
        when it takes the general plan (big ones do: their copies leave the loop)."""
        if call.nbytes > INLINE_BYTES:
            return None
        return self._transfers.start_blocks(call, exchange=False)

    async def _blocks(self, call: BlocksCall) -> None:
        """Run a checked call between blocks caches: small ones on their direct route,
        awaited without a plan; the rest through the general plan."""
        started = self._start_blocks(call)
        if started is None:
            await self._transfer(self._transfers.plan_blocks(call))
            return
        channel, future, deadline_ns = started
        if future is not None:
            await _await_request(channel, future, deadline_ns)

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
        await self._transfer(
            self._transfers.plan_push_cache(
                dst_cache_key,
                src_cache,
                src_batch_index,
                src_layer_range,
                dst_layer_range,
                size,
                tensor_num_per_layer,
            )
        )

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

        Arguments as the blocking call. Bad arguments raise here, exactly as there
        (``TypeError``, ``ValueError``, ``LLMException``); failures after that (no link,
        timeout, a refusal by the peer) never raise from this call but end the task, which
        may already be done when returned.

        :returns: a ``CacheTask`` with one result. ``await task`` returns ``LLM_SUCCESS`` or
            raises what the blocking ``push_blocks`` raises (with ``.results``);
            ``await task.wait_results()`` gives ``[status]`` and never raises.
        :raises RuntimeError: called outside the engine's event loop.
        """
        self._check_loop()
        call = self._transfers.check_push_blocks(
            dst_cache_key,
            src_cache,
            src_blocks,
            dst_blocks,
            src_layer_range,
            dst_layer_range,
            tensor_num_per_layer,
        )
        task = CacheTask(1, self._loop)
        try:
            started = self._start_blocks(call)
        except LLMException as exc:  # failed in the caller (the peer gone, say)
            task._set_result(0, exc.status_code, exc)
            task._finish()
            return task
        if started is not None:
            channel, future, deadline_ns = started
            if future is None:
                task._set_result(0, LLMStatusCode.LLM_SUCCESS)
                task._finish()
            elif future.done():
                _record(task, 0, future)
                task._finish()
            else:
                self._spawn(self._settle_request(task, channel, future, deadline_ns))
            return task
        try:
            plan = self._transfers.plan_blocks(call)
        except LLMException as exc:  # no link: what the blocking call raises
            task._set_result(0, exc.status_code, exc)
            task._finish()
            return task
        step = plan.steps[0]
        if step.in_caller and step.nbytes > INLINE_BYTES:
            self._spawn(self._settle(task, plan, None))
            return task
        try:
            future = self._transfers.start(plan, step)
        finally:
            plan.seal()
        if future.done():
            _record(task, 0, future)
            task._finish()
        else:
            self._spawn(self._settle(task, plan, future))
        return task

    @staticmethod
    async def _settle_request(
        task: CacheTask, channel: Channel, future: Future[None], deadline_ns: int
    ) -> None:
        try:
            await _await_request(channel, future, deadline_ns)
            task._set_result(0, LLMStatusCode.LLM_SUCCESS)
        except LLMException as exc:
            task._set_result(0, exc.status_code, exc)
        finally:
            task._finish()

    async def _settle(
        self, task: CacheTask, plan: TransferPlan, future: Future[None] | None
    ) -> None:
        unwatch = _watch(plan.steps)
        try:
            if future is None:
                try:
                    future = await self._start(plan, plan.steps[0])
                finally:
                    plan.seal()
            try:
                await _wait(future, plan.deadline_ns)
                task._set_result(0, LLMStatusCode.LLM_SUCCESS)
            except LLMException as exc:
                task._set_result(0, exc.status_code, exc)
        finally:
            unwatch()
            task._finish()

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

        Arguments as the blocking call and checked here, before returning (what the blocking
        call raises for them is raised here). An ``async def`` ``synchronize_layer`` is
        awaited on this loop; a plain one runs on a worker thread. Layer ``k`` moves while
        layer ``k+1`` is awaited.

        :returns: a ``CacheTask`` with one result per config. ``await task`` returns
            ``LLM_SUCCESS`` or raises the first failed config's ``LLMException`` (with
            ``.results``; a synchroniser that raised is its ``__cause__``, and is logged once
            at WARNING); ``await task.wait_results()`` never raises; ``task.cancel()`` stops
            before the next layer, and awaiting the task then raises ``CancelledError``.
        :raises RuntimeError: called outside the engine's event loop.
        """
        self._check_loop()
        job = plan_layer_job(
            self._transfers,
            src_cache,
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
            allow_async=True,
        )
        task = CacheTask(len(job.configs), self._loop)
        self._spawn(self._drive(job, task))
        return task

    async def _synchronize(
        self, job: LayerJob, layer: int, indices: list[int], cancelled: asyncio.Event
    ) -> bool:
        """Wait for the model to finish ``layer``; True to send it.

        False when the task was cancelled meanwhile, or when the synchroniser refused or
        raised; the job records that for the configs ``indices`` (an exception is kept as
        the cause of their failure and logged).
        """
        sync = job.synchronizer.synchronize_layer
        if job.is_async:
            waiter: asyncio.Future[Any] = asyncio.ensure_future(sync(layer, None))
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
            return False
        try:
            answer = waiter.result()
            ready = bool(answer)
        except Exception as exc:
            job.synchronizer_failed(layer, indices, exc)
            return False
        if not ready:
            job.synchronizer_refused(layer, indices, answer)
        return ready

    async def _drive(self, job: LayerJob, task: CacheTask) -> None:
        cancelled = asyncio.Event()
        loop = self._bound_loop
        task._on_cancel(lambda: _call_soon(loop, cancelled.set))
        try:
            for layer in range(job.num_layers):
                indices = job.targets(layer)
                if not indices:
                    continue
                if cancelled.is_set() or job.stopped:
                    break
                if not await self._synchronize(job, layer, indices, cancelled):
                    break
                for i, step in job.steps(layer, indices):
                    job.track(task, i, layer, await self._start(job.plan, step))
            for future in job.futures:
                with contextlib.suppress(LLMException):  # recorded by the job
                    await _wait(future, job.plan.deadline_ns)
        finally:
            job.finish(task)

    def pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Usage of the memory pool for ``placement`` (None when not configured)."""
        return self._service.pool_stats(placement)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to wake
        loop.call_soon_threadsafe(callback)


def _record(task: CacheTask, index: int, future: Future[None]) -> None:
    """Record a completed request's outcome, its exception included, as config ``index``."""
    exc = future.exception()
    if exc is None:
        task._set_result(index, LLMStatusCode.LLM_SUCCESS)
    else:
        status = exc.status_code if isinstance(exc, LLMException) else LLMStatusCode.LLM_FAILED
        task._set_result(index, status, exc)


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
            transfers = self._engine.transfers
            assert transfers is not None
            self._cache_manager = AsyncCacheManager(service, transfers, self._loop)
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
