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
from aio_datadist._engine.layerwise import LayerJob
from aio_datadist._engine.links import LinkTable
from aio_datadist._engine.offload import run_native
from aio_datadist._engine.plan import CopyPlan
from aio_datadist._engine.planner import Planner
from aio_datadist._engine.request import Completion, Plan
from aio_datadist.cache import Cache
from aio_datadist.cluster import LinkResults
from aio_datadist.enums import LLMRole, Placement, RegisterMemStatus
from aio_datadist.stats import DataDistStats
from aio_datadist.status import LLMStatusCode, LLMTimeoutError
from aio_datadist.synchronizer import LayerSynchronizer, is_async_synchronizer
from aio_datadist.task import CacheTask

__all__ = ("AsyncLLMDataDist", "AsyncCacheManager")


class _LoopBound:
    """Refuses use from any loop or thread other than the one the engine was initialised on."""

    _loop: asyncio.AbstractEventLoop | None

    def _check_loop(self) -> None:
        running = asyncio._get_running_loop()  # (None outside a running loop)
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


class _Overdue:
    """The waits of one event loop for started requests, and the safety net under them: a
    wait whose request outlived its deadline plus ``GRACE_S`` (a transport that never
    reported) gives up with ``LLM_TIMEOUT``.

    The waits whose nets fall in the same second share one loop timer, so thousands of awaited
    calls in flight cost the loop's timer heap a few entries, not one each (each a heap
    operation of Python comparisons and an object the collector walks while the call waits).
    """

    __slots__ = ("_loop", "_slots")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        #: Waiters by the whole second of the loop's clock at which their net gives up.
        self._slots: dict[int, set[asyncio.Future[bool]]] = {}

    def waiter(self, completion: Completion) -> asyncio.Future[bool]:
        """A future of the loop set True once ``completion`` completes, or False when its
        net gives up first (call on the loop)."""
        loop = self._loop
        waiter: asyncio.Future[bool] = loop.create_future()
        slot = -int(-(loop.time() + completion.timeout_s()) // 1)  # (the second after)
        waiters = self._slots.get(slot)
        if waiters is None:
            waiters = self._slots[slot] = set()
            loop.call_at(slot, self._give_up, slot)
        waiters.add(waiter)
        completion.add_done_callback(partial(_wake, self, slot, waiter))
        return waiter

    def settle(self, slot: int, waiter: asyncio.Future[bool]) -> None:
        """(On the loop.) The request ``waiter`` awaits completed."""
        waiters = self._slots.get(slot)
        if waiters is not None:
            waiters.discard(waiter)
        if not waiter.done():
            waiter.set_result(True)

    def _give_up(self, slot: int) -> None:
        for waiter in self._slots.pop(slot, ()):
            if not waiter.done():
                waiter.set_result(False)


def _wake(overdue: _Overdue, slot: int, waiter: asyncio.Future[bool], _: object) -> None:
    """A request ``waiter`` awaits completed: settle it on the loop (at once when the loop
    itself completed it, having read the answer)."""
    loop = overdue._loop
    if _on_loop(loop):
        overdue.settle(slot, waiter)
        return
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(overdue.settle, slot, waiter)


def _overdue_error() -> LLMTimeoutError:
    return LLMTimeoutError(
        "transfer did not complete within sync_kv_timeout",
        status_code=LLMStatusCode.LLM_TIMEOUT,
    )


async def _wait(completion: Completion, overdue: _Overdue) -> None:
    """Await a started request without cancelling it; raise its ``LLMException``.

    Cancelling the awaiting task leaves the request alone (the transport completes it, and
    the plan releases its pins then).
    """
    if not completion.done() and not await overdue.waiter(completion):
        raise _overdue_error()
    completion.raise_failure()


async def _drain(started: list[Completion], overdue: _Overdue) -> None:
    """Wait, through further cancellations, until every request has ended or timed out.

    A cancelled transfer still owns the caller's memory while its requests run (a pull's
    answer lands in the destination); the cancellation goes through once nothing writes it.
    """
    settled = asyncio.ensure_future(
        asyncio.gather(
            *(_wait(c, overdue) for c in started if not c.done()),
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

    __slots__ = (
        "_call",
        "_cancelled",
        "_end",
        "_error",
        "_first",
        "_op",
        "_overdue",
        "_plan",
        "_pump",
        "_reply",
        "_synchronizer",
        "_watching",
        "done",
    )

    def __init__(
        self,
        call: Call,
        plan: Plan,
        overdue: _Overdue,
        synchronizer: LayerSynchronizer | None = None,
        cancelled: asyncio.Event | None = None,
        first: Start | Wait | Synchronize | None = None,
    ) -> None:
        self._call = call
        #: The call's plan: a cancelled call waits for the requests it holds in flight.
        self._plan = plan
        self._overdue = overdue
        #: What the call asked before the driver existed (see :func:`_advance`).
        self._first = first
        self._synchronizer = synchronizer
        self._cancelled = cancelled
        self._reply: Any = None
        self._error: Exception | None = None
        self._op: Start | Wait | Synchronize | None = None
        #: The first pump watched for the call and the call that ends that watch; the
        #: others, by pump (made on first use: a call mostly crosses one link).
        self._pump: object = None
        self._end: Callable[[], None] | None = None
        self._watching: dict[object, Callable[[], None]] | None = None
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

    def _watch(self, start: Start) -> bool:
        """Watch the link ``start`` will cross, before its request goes out; True when the
        loop then reads its answers (the request is not moved in the caller)."""
        watched = start.watch()
        if watched is None:
            return False
        pump, end = watched
        if self._end is None:
            self._pump, self._end = pump, end
        elif pump is self._pump or (self._watching is not None and pump in self._watching):
            end()  # watched already for this call
        elif self._watching is None:
            self._watching = {pump: end}
        else:
            self._watching[pump] = end
        return True

    def _unwatch(self) -> None:
        end, watching = self._end, self._watching
        self._pump = self._end = self._watching = None
        if end is not None:
            end()
        if watching:
            for more in watching.values():
                more()

    def advance(self) -> None:
        """Run the call inline until it needs to wait (or ends)."""
        while self._op is None:
            op, self._first = self._first, None
            if op is None:
                op = self._next()
                if op is None:
                    return
            if isinstance(op, Start) and not op.offloaded():
                self._watch(op)
                self._reply = op.begin()
            elif isinstance(op, Wait) and self._completed(op.completion):
                self._error = op.completion.exception()  # type: ignore[assignment]
            else:
                self._op = op

    def _completed(self, completion: Completion) -> bool:
        """True when ``completion`` is done, or got done while this thread drove it for the
        busy-poll time: done only if the call has no other request and the loop nothing
        else to run (a payload still arriving then arrives on the loop)."""
        if completion.done():
            return True
        if len(self._plan.transfers) != 1 or not _loop_idle():
            return False
        completion.spin()
        return completion.done()

    async def finish(self) -> None:
        """Run the call to its end on the loop."""
        try:
            while True:
                self.advance()
                op, self._op = self._op, None
                if op is None:
                    return
                try:
                    if isinstance(op, Start):  # moved on a worker thread
                        self._watch(op)
                        self._reply = await run_native(op.begin, nbytes=op.nbytes)
                    elif isinstance(op, Wait):  # (as _wait, without a coroutine of its own)
                        completion = op.completion
                        if not completion.done() and not await self._overdue.waiter(completion):
                            raise _overdue_error()
                        completion.raise_failure()
                    else:
                        self._reply = await self._synchronize(op.layer)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self._error = exc
        except asyncio.CancelledError:
            self._call.close()
            try:  # every request the call started was tracked by its plan before any await
                await _drain(self._plan.inflight(), self._overdue)
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


def _advance(call: Call, plan: Plan, overdue: _Overdue) -> _Driver | None:
    """Run ``call`` (of ``plan``) inline as far as it goes: None when it ended there (a
    small call that completed inline needs no driver), else the driver whose ``finish()``
    awaits the rest."""
    op = next(call, None)  # (None: the call ended)
    if op is None:
        return None
    driver = _Driver(call, plan, overdue, first=op)
    driver.advance()
    return None if driver.done else driver


class _CacheMemory(_LoopBound):
    """The calls of an ``AsyncCacheManager`` that manage its memory: allocate, register and
    release caches, and their keys (the copies and transfers are the manager's own).
    """

    def __init__(self, service: CacheService, loop: asyncio.AbstractEventLoop) -> None:
        self._service = service
        self._loop = loop
        self._bound_loop = loop

    async def _allocate(self, reservation: Reservation) -> Cache:
        """Commit and zero a reservation's memory (off the loop when large), then make its
        cache."""
        if reservation.prepare_bytes:
            try:
                await run_native(
                    lambda: self._service.prepare(reservation), nbytes=reservation.prepare_bytes
                )
            except BaseException:
                self._service.abandon(reservation)
                raise
        return self._service.commit(reservation)

    async def allocate_cache(self, cache_desc: Any, cache_keys: Any = ()) -> Cache:
        """Allocate a batch cache from the memory pool of its placement, one key per row.

        Needs the pool of ``cache_desc.placement`` (``LLMConfig.mem_pool_cfg`` for DEVICE,
        ``host_mem_pool_cfg`` for HOST). ``cache_keys[i]`` names row ``i`` for a remote
        ``pull_cache``; a key with ``req_id=2**64-1`` is a placeholder that binds nothing, and
        trailing rows may go unnamed. Keys are checked before any memory is taken; a refused call
        binds no key and keeps no memory. With ``zero_on_alloc`` the memory is zeroed first.

        Validation and the pool allocation run inline. Host memory no cache held before is
        committed (so no transfer takes a page fault on it), and with ``zero_on_alloc`` memory
        is zeroed: inline when that is at most 1 MiB, else on a worker thread while the loop
        runs on (the reservation is given back if the awaiting task is cancelled).

        :param cache_desc: the ``CacheDesc`` of every tensor: ``shape[0]`` is the batch size,
            ``num_tensors`` > 0.
        :param cache_keys: list or tuple of ``CacheKey``, at most ``shape[0]`` of them, none twice,
            none already bound to a live cache. Default: no names.
        :returns: the new ``Cache`` (``is_blocks_cache`` False).
        :raises TypeError: wrong argument types.
        :raises LLMException: ``LLM_PARAM_INVALID`` (no pool for the placement, an empty descriptor,
            too many, duplicate or already bound keys), ``LLM_OUT_OF_MEMORY`` (the pool cannot hold
            it), ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        return await self._allocate(self._service.reserve_cache(cache_desc, cache_keys))

    async def deallocate_cache(self, cache: Any) -> None:
        """Release a batch cache made by ``allocate_cache``.

        The cache id is dropped at once and ``cache.tensor_addrs`` becomes ``[]``; the memory
        returns to the pool once every key bound to its rows was pulled (by ``CacheKey``) or removed
        with ``remove_cache_key``. An unknown or already released cache is a no-op.

        Runs inline; with the UCX route, the wait for the linked peers that could reach the cache
        to acknowledge that they no longer can (as the blocking call waits) runs on a worker
        thread and is awaited.

        :param cache: the batch ``Cache`` to release.
        :raises TypeError: ``cache`` is not a ``Cache``.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a blocks cache or registered memory (use
            ``deallocate_blocks_cache`` / ``unregister_cache``), ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        held = self._service.deallocate_cache(cache)
        if held is not None:
            await anyio.to_thread.run_sync(self._service.registry.wait_let_go, held)

    async def remove_cache_key(self, cache_key: Any) -> None:
        """Unbind a ``CacheKey`` so that its row can no longer be pulled.

        When the last key of a deallocated cache goes, its memory returns to the pool. An unknown,
        placeholder or already removed key is a no-op.

        Runs inline: nothing is awaited.

        :param cache_key: the ``CacheKey`` given to ``allocate_cache`` or ``register_cache``.
        :raises TypeError: ``cache_key`` is not a ``CacheKey``.
        :raises LLMException: ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        self._service.remove_cache_key(cache_key)

    async def allocate_blocks_cache(self, cache_desc: Any, blocks_cache_key: Any = None) -> Cache:
        """Allocate a blocks (PagedAttention) cache from the memory pool of its placement.

        Dimension 0 of ``cache_desc.shape`` is the number of blocks. The pool rules and zeroing are
        those of ``allocate_cache``.

        Validation and the pool allocation run inline; committing fresh host memory and zeroing
        (``zero_on_alloc``) run inline up to 1 MiB, else on a worker thread, as in
        ``allocate_cache``.

        :param cache_desc: the ``CacheDesc`` of every tensor, ``num_tensors`` > 0.
        :param blocks_cache_key: a ``BlocksCacheKey`` (uint64 ids) naming the cache for a remote
            ``pull_blocks``/``push_blocks``, not bound to a live cache; None (the default) leaves it
            unnamed.
        :returns: the new ``Cache`` (``is_blocks_cache`` True).
        :raises TypeError: wrong argument types.
        :raises ValueError: an id of ``blocks_cache_key`` outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` (no pool for the placement, an empty descriptor,
            the key already bound), ``LLM_OUT_OF_MEMORY`` (the pool cannot hold it), ``LLM_FAILED``
            after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        return await self._allocate(
            self._service.reserve_blocks_cache(cache_desc, blocks_cache_key)
        )

    async def deallocate_blocks_cache(self, cache: Any) -> None:
        """Release a blocks cache made by ``allocate_blocks_cache``.

        Its memory returns to the pool and ``cache.tensor_addrs`` becomes ``[]``. An unknown or
        already released cache is a no-op.

        Runs inline; with the UCX route, the wait for the linked peers runs on a worker thread
        and is awaited, as in ``deallocate_cache``.

        :param cache: the blocks ``Cache`` to release.
        :raises TypeError: ``cache`` is not a ``Cache``.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a batch cache or registered memory,
            ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        held = self._service.deallocate_blocks_cache(cache)
        if held is not None:
            await anyio.to_thread.run_sync(self._service.registry.wait_let_go, held)

    async def register_cache(
        self, cache_desc: Any, addrs: Any, cache_keys: Any = (), remote_accessible: Any = None
    ) -> Cache:
        """Register memory the caller allocated as a batch cache, one address per tensor.

        The memory stays the caller's and must outlive the cache (``unregister_cache`` first);
        registered ranges must not overlap. Register before linking: peers learn of registered
        memory when they link.

        Runs inline: nothing is awaited.

        :param cache_desc: the ``CacheDesc`` of every tensor (``shape[0]`` batch rows).
        :param addrs: a list (not a tuple) of ``num_tensors`` non-zero uint64 addresses.
        :param cache_keys: list or tuple of ``CacheKey`` naming rows, checked as in
            ``allocate_cache``; default none.
        :param remote_accessible: whether peers may read and write this memory; None (the default)
            means True for DEVICE placement and False for HOST, and False after a two-sided
            ``link``, which refuses True.
        :returns: the new ``Cache`` (``is_blocks_cache`` False).
        :raises TypeError: wrong argument types (``addrs`` as a tuple included).
        :raises ValueError: an address outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` (empty ``addrs``, a count other than
            ``num_tensors``, a null address, a bad or already bound key, ``remote_accessible=True``
            after a two-sided ``link``), ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        return self._service.register_cache(cache_desc, addrs, cache_keys, remote_accessible)

    async def register_blocks_cache(
        self,
        cache_desc: Any,
        addrs: Any,
        blocks_cache_key: Any = None,
        remote_accessible: Any = None,
    ) -> Cache:
        """Register memory the caller allocated as a blocks cache, one address per tensor.

        As ``register_cache``, for a PagedAttention cache whose dimension 0 indexes blocks; the
        optional key names it for a remote ``pull_blocks``/``push_blocks``.

        Runs inline: nothing is awaited.

        :param cache_desc: the ``CacheDesc`` of every tensor (``shape[0]`` blocks).
        :param addrs: a list (not a tuple) of ``num_tensors`` non-zero uint64 addresses.
        :param blocks_cache_key: a ``BlocksCacheKey`` (uint64 ids) not bound to a live cache, or
            None (the default).
        :param remote_accessible: whether peers may read and write this memory; None (the default)
            means True for DEVICE placement and False for HOST, and False after a two-sided
            ``link``, which refuses True.
        :returns: the new ``Cache`` (``is_blocks_cache`` True).
        :raises TypeError: wrong argument types (``addrs`` as a tuple included).
        :raises ValueError: an address or key id outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` (empty ``addrs``, a count other than
            ``num_tensors``, a null address, a bad or already bound key, ``remote_accessible=True``
            after a two-sided ``link``), ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        return self._service.register_blocks_cache(
            cache_desc, addrs, blocks_cache_key, remote_accessible
        )

    async def unregister_cache(self, cache_id: Any) -> None:
        """Forget a registered cache; its memory goes back to the caller.

        Completes once no copy or transfer still uses the memory (and, with the UCX route, once the
        linked peers that could reach it acknowledged that they no longer can). An unknown or
        already unregistered id, or the id of a pool-allocated cache, is a no-op. Unlink the peers
        that may still address the memory first.

        The cache is forgotten inline; when copies still use the memory, the wait for them runs on a
        worker thread and is awaited.

        :param cache_id: ``Cache.cache_id`` of a registered cache (int64).
        :raises TypeError: ``cache_id`` is not an int.
        :raises ValueError: ``cache_id`` outside int64.
        :raises LLMException: ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        busy = self._service.unregister_cache(cache_id)
        if busy is not None:
            await anyio.to_thread.run_sync(self._service.registry.wait_unpinned, busy)

    async def remap_registered_memory(self, mem_infos: Any) -> None:
        """Reserved in the documented API: validates ``mem_infos``, then always raises.

        In the reference it registers device memory repaired after a memory fault with the NIC
        again; this implementation has no such registration to repair, so it raises
        ``LLM_FEATURE_NOT_ENABLED`` once the arguments are valid.

        Runs inline: nothing is awaited.

        :param mem_infos: a ``MemInfo`` or a list of them, each ``MEM_TYPE_DEVICE`` with
            ``addr != 0`` and ``size > 0``.
        :raises TypeError: wrong argument types.
        :raises LLMException: ``LLM_PARAM_INVALID`` for an invalid entry, ``LLM_FAILED`` after
            ``finalize``, else always ``LLM_FEATURE_NOT_ENABLED``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        self._service.remap_registered_memory(mem_infos)

    def pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Usage of the memory pool for ``placement``, or None when it is not configured.

        A snapshot: ``capacity``, ``used``, ``free``, ``largest_free`` (the biggest run one
        allocation could get now), ``allocations`` and ``page_size``, every size in bytes.

        A plain method (not a coroutine): it reads counters and never waits.

        :param placement: ``Placement.DEVICE`` (the default, ``mem_pool_cfg``) or ``Placement.HOST``
            (``host_mem_pool_cfg``).
        :returns: a ``PoolStats``, or None without a pool for ``placement``.
        :raises TypeError: ``placement`` is not a ``Placement``.
        """
        return self._service.pool_stats(placement)


class AsyncCacheManager(_CacheMemory):
    """The cache manager of an ``AsyncLLMDataDist``: the blocking cache manager's calls, awaited.

    Obtained from ``AsyncLLMDataDist.cache_manager``, never constructed. Every call takes the
    same arguments and raises the same errors as the blocking one and is a coroutine, except
    ``push_blocks`` and ``transfer_cache_async``, which return an awaitable ``CacheTask`` at
    once, and ``pool_stats``. Calls belong to the event loop the engine was initialised on
    (``RuntimeError`` elsewhere); each method says what runs inline on the loop and what on a
    worker thread. After ``finalize`` every call raises ``LLMException(LLM_FAILED)``.
    """

    def __init__(
        self,
        service: CacheService,
        planner: Planner,
        links: LinkTable,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(service, loop)
        self._planner = planner
        self._links = links
        self._overdue = _Overdue(loop)
        self._background: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._bound_loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _begin(self, plan: Plan) -> _Driver | None:
        """Run a pull or push call inline as far as it goes; the caller awaits ``finish()``
        of the driver returned, if any (no coroutine of its own: thousands of awaited calls
        in flight each hold one object less)."""
        return _advance(run_call(plan, self._links), plan, self._overdue)

    async def _run(self, plan: CopyPlan) -> None:
        try:
            await run_native(lambda: self._service.execute(plan), nbytes=plan.nbytes)
        finally:
            self._service.release(plan)

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
        """Copy bytes ``[offset, offset + size)`` of one batch row, in every tensor.

        Row ``src_batch_index`` of each tensor of ``src`` goes to the same bytes of row
        ``dst_batch_index`` of ``dst``; a row is ``cache_desc.size // batch_size`` bytes. Copy a
        whole multi-row cache one row at a time.

        Validation runs inline; the copy runs inline when it moves at most 1 MiB, else on a worker
        thread. Cancelling the awaiting task waits for a started copy to end before the cancellation
        goes through.

        :param dst: the destination batch ``Cache``.
        :param src: the source batch ``Cache``, with as many tensors as ``dst`` (shapes and data
            types may differ).
        :param dst_batch_index: row of ``dst`` (uint32, below its batch size); default 0.
        :param src_batch_index: row of ``src`` (uint32, below its batch size); default 0.
        :param offset: byte offset inside the rows (uint64; when > 0, below both row sizes); default
            0.
        :param size: bytes to copy (int64): -1 (the default) for the rest of the row after
            ``offset``, else > 0 and fitting in both rows.
        :param req_id: uint64 or None; used in logs only.
        :raises TypeError: wrong argument types.
        :raises ValueError: an int outside its range.
        :raises LLMException: ``LLM_PARAM_INVALID`` (a blocks cache, tensor counts differ, an index,
            offset or size out of range), ``LLM_KV_CACHE_NOT_EXIST`` (a cache unknown to this engine
            or released), ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        await self._run(
            self._planner.copy_cache(
                dst, src, dst_batch_index, src_batch_index, offset, size, req_id
            )
        )

    async def copy_blocks(self, cache: Any, copy_block_info: Any) -> None:
        """Copy blocks inside one blocks cache, in every tensor.

        Every source block is read before any destination is written, so overlapping maps copy
        correctly; a block named as destination twice takes the last source.

        Validation runs inline; the copy runs inline up to 1 MiB, else on a worker thread (a
        cancelled await lets a started copy end first).

        :param cache: a blocks ``Cache`` of this engine.
        :param copy_block_info: dict ``{src_block: [dst_block, ...]}`` of uint64 indices in
            ``[0, num_blocks)``.
        :raises TypeError: wrong argument types.
        :raises ValueError: an index outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` (not a blocks cache, an index out of range),
            ``LLM_KV_CACHE_NOT_EXIST`` (the cache is unknown or released), ``LLM_FAILED`` after
            ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        await self._run(self._planner.copy_blocks(cache, copy_block_info))

    async def swap_blocks(self, src_cache: Any, dst_cache: Any, src_to_dst: Any) -> None:
        """Copy blocks between a HOST and a DEVICE blocks cache (swap in or swap out).

        HOST to DEVICE swaps in, DEVICE to HOST swaps out; the host side usually comes from
        ``Cache.create_cpu_cache``.

        Validation runs inline; the copy runs inline up to 1 MiB, else on a worker thread (a
        cancelled await lets a started copy end first).

        :param src_cache: the blocks ``Cache`` to read.
        :param dst_cache: the blocks ``Cache`` to write: the other placement, the same block size
            and ``num_tensors``.
        :param src_to_dst: dict ``{src_block: dst_block}`` of uint64 indices within each cache's
            blocks.
        :raises TypeError: wrong argument types.
        :raises ValueError: an index outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` (both caches on one placement, a batch cache,
            block sizes or tensor counts differ, an index out of range), ``LLM_KV_CACHE_NOT_EXIST``
            (a cache unknown or released), ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        await self._run(self._planner.swap_blocks(src_cache, dst_cache, src_to_dst))

    async def pull_cache(
        self, cache_key: Any, cache: Any, batch_index: Any = 0, size: Any = -1, **kwargs: Any
    ) -> None:
        """Pull one batch row of a remote cache into row ``batch_index`` of ``cache``.

        A pull by a ``CacheKey`` with a ``req_id`` drops that key on the remote side when the remote
        cache was pool-allocated, so a second pull of it finds nothing.

        Validation and planning run inline, then the requests start: small payloads inline (one
        small request with nothing else ready on the loop makes its whole round trip inline), a
        payload of more than 1 MiB sent from this side on a worker thread; the loop reads the
        answers while the call is awaited. A call that completes inline returns without suspending.
        Cancelling the awaiting task cancels nothing already started: it waits until those requests
        ended (a pull's answer may still write the destination), then the cancellation goes through.

        :param cache_key: where to read: a ``CacheKey`` (exactly one of ``req_id`` and ``prefix_id``
            valid) or a ``CacheKeyByIdAndIndex``, which is required with
            ``enable_remote_cache_accessible``; its ``cluster_id`` names the remote cluster.
        :param cache: the local batch ``Cache`` to write.
        :param batch_index: its row (uint32, below the batch size); default 0.
        :param size: int64: -1 (the default) for a full local row per tensor, else a byte count > 0
            no larger than a row.
        :param kwargs: ``src_layer_range`` and ``dst_layer_range`` (a ``range`` of step 1 from >= 0,
            or None for every layer) and ``tensor_num_per_layer`` (>= 1, default 2); other keywords
            raise ``TypeError``.
        :raises TypeError: wrong argument types, an unknown keyword, a ``CacheKey`` with
            ``enable_remote_cache_accessible``.
        :raises ValueError: an int outside its range.
        :raises LLMException: ``LLM_PARAM_INVALID`` (a blocks cache, a bad index, size or layer
            range), ``LLM_KV_CACHE_NOT_EXIST`` (the local cache, or the remote key, cache or row,
            does not exist), ``LLM_NOT_YET_LINK`` (no link to the remote cluster, or a two-sided
            domain not linked yet), ``LLM_LINK_FAILED`` (the link broke), ``LLM_TIMEOUT`` (not done
            within ``sync_kv_timeout``; the link must be rebuilt), ``LLM_FAILED`` after
            ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        driver = self._begin(self._planner.pull_cache(cache_key, cache, batch_index, size, kwargs))
        if driver is not None:
            await driver.finish()

    async def pull_blocks(
        self,
        src_cache_key: Any,
        dst_cache: Any,
        src_blocks: Any = (),
        dst_blocks: Any = (),
        **kwargs: Any,
    ) -> None:
        """Pull remote blocks, or one remote batch row, into blocks of a local blocks cache.

        With a ``BlocksCacheKey``, remote block ``src_blocks[i]`` lands in local block
        ``dst_blocks[i]``; with a row key, that one remote row is scattered into ``dst_blocks``.

        Validation and planning run inline, then the requests start: small payloads inline (one
        small request with nothing else ready on the loop makes its whole round trip inline), a
        payload of more than 1 MiB sent from this side on a worker thread; the loop reads the
        answers while the call is awaited. A call that completes inline returns without suspending.
        Cancelling the awaiting task cancels nothing already started: it waits until those requests
        ended (a pull's answer may still write the destination), then the cancellation goes through.

        :param src_cache_key: a ``BlocksCacheKey`` (a remote blocks cache), or a ``CacheKey`` /
            ``CacheKeyByIdAndIndex`` (a remote batch row); its ``cluster_id`` names the remote
            cluster.
        :param dst_cache: the local blocks ``Cache`` to write.
        :param src_blocks: remote block indices (uint64): as many as ``dst_blocks`` with a
            ``BlocksCacheKey``, empty (the default) with a row key.
        :param dst_blocks: local block indices (uint64, non-empty, below the block count).
        :param kwargs: ``src_layer_range`` and ``dst_layer_range`` (a ``range`` of step 1 from >= 0,
            or None for every layer) and ``tensor_num_per_layer`` (>= 1, default 2); other keywords
            raise ``TypeError``.
        :raises TypeError: wrong argument types or an unknown keyword.
        :raises ValueError: an int outside its range.
        :raises LLMException: ``LLM_PARAM_INVALID`` (not a blocks cache, empty ``dst_blocks``, block
            lists of different lengths, ``src_blocks`` with a row key, an index or layer range out
            of range), ``LLM_KV_CACHE_NOT_EXIST`` (the local cache, or the remote key or cache, does
            not exist), ``LLM_NOT_YET_LINK`` (no link to the remote cluster, or a two-sided domain
            not linked yet), ``LLM_LINK_FAILED`` (the link broke), ``LLM_TIMEOUT`` (not done within
            ``sync_kv_timeout``; the link must be rebuilt), ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        driver = self._begin(
            self._planner.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs)
        )
        if driver is not None:
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
        """Push one local batch row into the remote row named by a ``CacheKeyByIdAndIndex``.

        Needs ``enable_remote_cache_accessible`` on both ends. Completes once the bytes are in the
        remote memory, so the peer may read them as soon as it learns of the push.

        Validation and planning run inline, then the requests start: small payloads inline (one
        small request with nothing else ready on the loop makes its whole round trip inline), a
        payload of more than 1 MiB sent from this side on a worker thread; the loop reads the
        answers while the call is awaited. A call that completes inline returns without suspending.
        Cancelling the awaiting task cancels nothing already started: it waits until those requests
        ended (a pull's answer may still write the destination), then the cancellation goes through.

        :param dst_cache_key: the remote row:
            ``CacheKeyByIdAndIndex(cluster_id, cache_id, batch_index)``.
        :param src_cache: the local batch ``Cache`` to read.
        :param src_batch_index: its row (uint32, below the batch size); default 0.
        :param src_layer_range: local layers to send (a ``range`` of step 1 from >= 0); None (the
            default) for every layer, ``range(0, num_tensors // tensor_num_per_layer)``.
        :param dst_layer_range: remote layers to write, as long as ``src_layer_range``; None for
            every layer.
        :param size: must be -1 (the default): a whole row per tensor.
        :param tensor_num_per_layer: tensors per layer, in ``[1, num_tensors]``; default 2 (K and
            V).
        :raises TypeError: wrong argument types.
        :raises ValueError: an int outside its range.
        :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` (``enable_remote_cache_accessible`` is
            off), ``LLM_PARAM_INVALID`` (a blocks cache, a bad index, size or layer range),
            ``LLM_KV_CACHE_NOT_EXIST`` (the local cache, or the remote cache or row, does not
            exist), ``LLM_NOT_YET_LINK`` (no link to the remote cluster, or a two-sided domain not
            linked yet), ``LLM_LINK_FAILED`` (the link broke), ``LLM_TIMEOUT`` (not done within
            ``sync_kv_timeout``; the link must be rebuilt), ``LLM_FAILED`` after ``finalize``.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
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
        if driver is not None:
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
        """Push local blocks into remote blocks in the background; returns a ``CacheTask`` at once.

        Local block ``src_blocks[i]`` goes to remote block ``dst_blocks[i]`` of the cache registered
        or allocated under ``dst_cache_key``; needs ``enable_remote_cache_accessible`` on both ends.

        Not a coroutine. Validation and planning run inline, and bad arguments raise here as in the
        blocking call; the push then runs on this event loop (small payloads inline, more than 1 MiB
        on a worker thread). A small push may complete before the call returns: the task is then
        already ``done()``. Every failure after validation goes to the task, which has one result:
        ``await task`` returns ``LLM_SUCCESS`` once the bytes are in the remote memory, or raises
        what the blocking ``push_blocks`` raises (``NotYetLinkError``, ``LinkFailedError``,
        ``LLMTimeoutError``, ``KvCacheNotExistError``, ...); ``await task.wait_results()`` returns
        ``[status]`` and never raises. Cancelling a coroutine that awaits the task leaves the push
        running. ``task.cancel()`` does not recall requests already sent, but the task then reports
        ``LLM_FAILED`` (never success) and ``await task`` raises ``asyncio.CancelledError``.

        :param dst_cache_key: the remote blocks cache's ``BlocksCacheKey`` (uint64 ids).
        :param src_cache: the local blocks ``Cache`` to read.
        :param src_blocks: local block indices (uint64, below the block count), as many as
            ``dst_blocks``.
        :param dst_blocks: remote block indices (uint64, non-empty).
        :param src_layer_range: local layers to send (a ``range`` of step 1 from >= 0); None (the
            default) for every layer, ``range(0, num_tensors // tensor_num_per_layer)``.
        :param dst_layer_range: remote layers to write, as long as ``src_layer_range``; None for
            every layer.
        :param tensor_num_per_layer: tensors per layer, in ``[1, num_tensors]``; default 2 (K and
            V).
        :returns: a ``CacheTask`` with one result, to ``await``.
        :raises TypeError: wrong argument types.
        :raises ValueError: an int or key id outside its range.
        :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` (``enable_remote_cache_accessible`` is
            off), ``LLM_PARAM_INVALID`` (not a blocks cache, empty ``dst_blocks``, block lists of
            different lengths, an index or layer range out of range), ``LLM_KV_CACHE_NOT_EXIST``
            (the local cache is unknown or released), ``LLM_FAILED`` after ``finalize``; transfer
            failures are the task's.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
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
        driver = _advance(settle(run_call(plan, self._links), task), plan, self._overdue)
        if driver is not None:
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
        *,
        tensor_num_per_layer: Any = 2,
    ) -> CacheTask:
        """Push ``src_cache`` to one or more destinations layer by layer, in the background.

        Layer ``k`` is sent once ``layer_synchronizer.synchronize_layer(k, None)`` returned True
        (False, or an exception, fails the task with ``LLM_PARAM_INVALID``); the wait for layer
        ``k+1`` overlaps the transfer of layer ``k``. The arguments are checked before the call
        returns; failures of the transfer itself go to the returned task.

        Not a coroutine. The arguments are checked inline and bad ones raise here, as in the
        blocking call; the layers are then driven by a task on this event loop. An ``async def``
        ``synchronize_layer`` is awaited on the loop; a plain one runs on a worker thread, never on
        the loop. Layer payloads start inline, or on a worker thread above 1 MiB, and the loop reads
        the answers.

        ``await task`` returns ``LLM_SUCCESS`` or raises the ``LLMException`` subclass of the first
        failed config (``NotYetLinkError``, ``LinkFailedError``, ``LLMTimeoutError``,
        ``KvCacheNotExistError``; ``ParamInvalidError`` when the synchroniser returned False or
        raised, its exception then the ``__cause__``), whose ``.results`` hold every config's
        status; ``await task.wait_results()`` returns the statuses and never raises. Several
        coroutines may await one task, and cancelling one of them leaves the transfer running.
        ``task.cancel()`` stops before the next layer (a layer being sent finishes): unfinished
        configs report ``LLM_FAILED`` and ``await task`` raises ``asyncio.CancelledError``. The
        blocking ``task.synchronize()``/``get_results()`` raise ``RuntimeError`` on the loop's
        thread while the task runs.

        :param src_cache: the DEVICE ``Cache`` to send (batch or blocks); ``num_tensors`` a
            multiple of ``tensor_num_per_layer`` (even by default: K and V per layer).
        :param layer_synchronizer: a ``LayerSynchronizer`` saying when each layer is ready.
        :param transfer_configs: list or tuple of ``TransferConfig`` (destination by address), or of
            ``TransferWithCacheKeyConfig`` (by key) when ``enable_remote_cache_accessible`` is on;
            layer ranges within ``[0, num_tensors // tensor_num_per_layer)``; a ``TransferConfig``
            names ``tensor_num_per_layer`` addresses per layer.
        :param src_block_indices: blocks of a blocks source to send (uint64), or None.
        :param dst_block_indices: destination blocks (uint64), as many as ``src_block_indices``;
            required with a blocks source.
        :param dst_block_memory_size: bytes per destination block (uint64), needed for a batch
            source with ``dst_block_indices``; None or 0 for a batch destination.
        :param tensor_num_per_layer: keyword only, not in the reference API: how many consecutive
            tensors make one layer (int32, >= 1; default 2, K and V). 1 suits caches that hold a
            layer's K and V in one tensor, as vLLM's pages and MLA's latent cache do.
        :returns: a ``CacheTask`` with one result per config, in order, to ``await``.
        :raises TypeError: wrong argument types, configs of the wrong kind, not a
            ``LayerSynchronizer``.
        :raises ValueError: an int outside its range.
        :raises LLMException: ``LLM_PARAM_INVALID`` (a HOST source, ``num_tensors`` not a
            multiple of ``tensor_num_per_layer``, ``tensor_num_per_layer`` < 1, a bad layer range,
            block list or block size), ``LLM_KV_CACHE_NOT_EXIST`` (the source cache is
            unknown or released), ``LLM_FAILED`` after ``finalize``; transfer failures are the
            task's.
        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        self._check_loop()
        planned = self._planner.layer_job(
            src_cache,
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
            allow_async=True,
            tensor_num_per_layer=tensor_num_per_layer,
        )
        job = LayerJob(self._planner, planned)
        task = CacheTask(len(job.configs), self._loop)
        cancelled = asyncio.Event()
        loop = self._bound_loop
        task._on_cancel(lambda: _call_soon(loop, cancelled.set))
        call = run_layers(job, task, self._links)
        self._spawn(_Driver(call, job.plan, self._overdue, job.synchronizer, cancelled).finish())
        return task


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
        """Initialise from ``LLMConfig.generate_options()``; a second call does nothing.

        Chooses the runtime for ``device_id``, creates the memory pools the options configure and,
        with ``listen_ip_info``, starts listening for links. Call ``finalize`` before the process
        exits.

        The set-up (runtime, pools, listener) runs on a worker thread and is awaited; the engine is
        then bound to the running event loop, and every later call must come from that loop. Any
        number of ``AsyncLLMDataDist`` may be initialised in one process.

        :param options: dict of str to str, normally ``LLMConfig(...).generate_options()``;
            ``device_id`` is required.
        :raises TypeError: ``options`` is not a dict.
        :raises ValueError: a listen port that is not a decimal integer.
        :raises LLMException: ``LLM_PARAM_INVALID`` (invalid or missing options), ``LLM_FAILED``
            (the listen address cannot be bound).
        :raises RuntimeError: initialised already, from another event loop.
        """
        if self._engine.initialized:
            self._check_loop()
            return
        loop = asyncio.get_running_loop()
        await anyio.to_thread.run_sync(self._engine.init, options)
        self._loop = loop

    async def finalize(self) -> None:
        """Release every link, cache, pool and listener that ``init`` created.

        Links are closed and pool memory is freed (registered memory stays the caller's; views from
        ``Cache.as_numpy`` stay safe to touch). A no-op when not initialised; the endpoint may be
        initialised again afterwards. Do not run it concurrently with other calls.

        Runs inline on the event loop; ``async with`` calls it on exit.

        :raises RuntimeError: called from another event loop or thread than the one ``init`` ran on.
        """
        if not self._engine.initialized:
            return
        self._check_loop()
        self._engine.finalize()
        self._cache_manager = None
        self._loop = None

    async def __aenter__(self) -> AsyncLLMDataDist:
        """Enter ``async with``: returns this endpoint as it is (``init`` stays explicit).

        Leaving the block finalizes the endpoint.
        """
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leave ``async with``: ``await self.finalize()``, whether the block raised or not.

        An exception of the block propagates unchanged.
        """
        await self.finalize()

    @property
    def cache_manager(self) -> AsyncCacheManager:
        """The ``AsyncCacheManager`` of this endpoint (CacheManager mode).

        :raises RuntimeError: before ``init``, after ``finalize``, or from another event loop or
            thread than the one ``init`` ran on.
        :raises LLMException: ``LLM_PARAM_INVALID`` outside CacheManager mode
            (``enable_cache_manager`` not set).
        """
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
        """Link to each listed server, in parallel; returns ``(overall, per_cluster)``.

        One-sided links from this endpoint to each cluster's listener. Failures are reported, never
        raised: ``overall`` is ``LLM_SUCCESS`` only when every cluster linked, else the code of the
        last failure in input order; ``per_cluster`` holds one status per cluster, in input order
        (``LLM_LINK_FAILED``, ``LLM_ALREADY_LINK``, ``LLM_PARAM_INVALID`` for a cluster without a
        remote ip, ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` for every cluster of a call naming more than
        16), and its ``errors`` say why each one failed. An empty list gives
        ``(LLM_PARAM_INVALID, [])``. Register memory before linking.

        The whole call (checks and handshakes) runs on a worker thread and is awaited; the loop
        keeps serving other tasks.

        :param clusters: list or tuple of ``LLMClusterInfo``, each with ``remote_cluster_id`` and
            the server's ip:port set (and a local ip when ``local_comm_res`` is unset); at most 16.
        :param timeout: milliseconds each link may take (int32, > 0; above 200, or 2000 with TLS, is
            advised); default 3000.
        :returns: ``(overall, per_cluster)``: an ``LLMStatusCode`` and a ``LinkResults`` (a list of
            ``LLMStatusCode`` with ``.errors``).
        :raises TypeError: ``clusters`` is not a list or tuple of ``LLMClusterInfo``.
        :raises ValueError: ``timeout`` outside int32.
        :raises LLMException: ``LLM_PARAM_INVALID`` for ``timeout <= 0`` or a cluster without
            ``remote_cluster_id`` (or without a local ip when ``local_comm_res`` is unset).
        :raises RuntimeError: before ``init`` or after ``finalize``, or from another event loop or
            thread than the one ``init`` ran on.
        """
        self._check_init_loop()
        return await anyio.to_thread.run_sync(self._engine.link_clusters, clusters, timeout)

    async def unlink_clusters(
        self, clusters: Any, timeout: Any = 3000, force: Any = False
    ) -> tuple[LLMStatusCode, LinkResults]:
        """Unlink clusters: gracefully (both ends) or with ``force`` (this end only).

        Results as ``link_clusters``, never raised. A graceful unlink tells the server, which drops
        its end too; it needs exactly one remote ip per cluster (``LLM_PARAM_INVALID``), reports
        ``LLM_NOT_YET_LINK`` for a cluster that is not linked, and
        ``LLM_NOTIFY_PROMPT_UNLINK_FAILED`` when the server could not be told (call
        ``unlink_clusters`` there to clean up). ``force=True`` drops this end only and succeeds even
        when the peer is gone; both sides call it then. With the hixl backend only this side's link
        goes, named by ``remote_cluster_id`` alone, and ``force`` is ignored.

        The whole call runs on a worker thread and is awaited.

        :param clusters: list or tuple of ``LLMClusterInfo``, each with ``remote_cluster_id`` and
            the server's ip:port set (and a local ip when ``local_comm_res`` is unset); at most 16.
        :param timeout: milliseconds each link may take (int32, > 0; above 200, or 2000 with TLS, is
            advised); default 3000.
        :param force: bool: drop this end only; default False.
        :returns: ``(overall, per_cluster)`` as ``link_clusters`` returns them.
        :raises TypeError: ``clusters`` is not a list or tuple of ``LLMClusterInfo``, or ``force``
            is not a bool.
        :raises ValueError: ``timeout`` outside int32.
        :raises LLMException: ``LLM_PARAM_INVALID`` for ``timeout <= 0`` or a cluster without
            ``remote_cluster_id``.
        :raises RuntimeError: before ``init`` or after ``finalize``, or from another event loop or
            thread than the one ``init`` ran on.
        """
        self._check_init_loop()
        return await anyio.to_thread.run_sync(
            self._engine.unlink_clusters, clusters, timeout, force
        )

    async def switch_role(self, role: Any, switch_options: Any = None) -> None:
        """Switch this endpoint's role, listening or not as ``switch_options`` says.

        With ``llm.listenIpInfo`` ("ip:port") in ``switch_options``, as
        ``LLMConfig(listen_ip_info=...).generate_options()`` gives it, the endpoint listens there
        (any previous listener is closed first); without it the endpoint stops listening. Switching
        to the same role is allowed. Every link must be gone first.

        Runs inline on the event loop: opening or closing a listener does not wait on peers.

        :param role: the new ``LLMRole``.
        :param switch_options: dict of str to str, or None (the default) to stop listening.
        :raises TypeError: ``role`` is not an ``LLMRole`` or ``switch_options`` not a dict.
        :raises ValueError: a listen port that is not a decimal integer or outside uint16.
        :raises LLMException: ``LLM_EXIST_LINK`` while any link exists, ``LLM_PARAM_INVALID`` for a
            listen address not in ip:port form, ``LLM_FEATURE_NOT_ENABLED`` for a new listen address
            with the hixl backend, ``LLM_FAILED`` when the address cannot be bound.
        :raises RuntimeError: before ``init`` or after ``finalize``, or from another event loop or
            thread than the one ``init`` ran on.
        """
        self._check_init_loop()
        self._engine.switch_role(role, switch_options)

    async def link(self, comm_name: Any, cluster_rank_info: Any, rank_table: Any) -> int:
        """Two-sided link with every member of a rank table's communication domain.

        Every member calls it at about the same time; it returns once all are linked. Configure
        pools or register memory first; afterwards the ``register_*`` calls refuse
        ``remote_accessible=True``. ``docs/design.md`` says how a rank's TCP endpoint is found.

        Runs on a worker thread while it waits for the other members, and is awaited.

        :param comm_name: the domain's name: a non-empty str of fewer than 128 characters.
        :param cluster_rank_info: dict of cluster id (uint64) to rank (uint32), 2 to 4 entries with
            this cluster among them, ranks ascending in dict order.
        :param rank_table: the rank table, a JSON str (version 1.0 or 1.2 schema).
        :returns: the domain's ``comm_id`` (an int from 1), for ``unlink`` and
            ``query_register_mem_status``.
        :raises TypeError: wrong argument types.
        :raises ValueError: an id or rank outside its range.
        :raises LLMException: ``LLM_PARAM_INVALID`` (a bad name, rank info or rank table, this
            cluster not a member), ``LLM_LINK_FAILED`` (the members did not all link in time, or the
            collective library refused the domain), ``LLM_FEATURE_NOT_ENABLED`` with the hixl
            backend.
        :raises RuntimeError: before ``init`` or after ``finalize``, or from another event loop or
            thread than the one ``init`` ran on.
        """
        self._check_init_loop()
        return await anyio.to_thread.run_sync(
            self._engine.link, comm_name, cluster_rank_info, rank_table
        )

    async def unlink(self, comm_id: Any) -> None:
        """Unlink every member of a communication domain made by ``link``.

        Both ends of each member's link go, and the domain's communicator is released; the links are
        gone even when releasing the communicator fails.

        Runs on a worker thread (closing links waits on the peers) and is awaited.

        :param comm_id: the id ``link`` returned (uint64).
        :raises TypeError: ``comm_id`` is not an int.
        :raises ValueError: ``comm_id`` outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` for an unknown ``comm_id``,
            ``LLM_FEATURE_NOT_ENABLED`` with the hixl backend, or the collective library's failure
            to release the communicator.
        :raises RuntimeError: before ``init`` or after ``finalize``, or from another event loop or
            thread than the one ``init`` ran on.
        """
        self._check_init_loop()
        await anyio.to_thread.run_sync(self._engine.unlink, comm_id)

    async def query_register_mem_status(self, comm_id: Any) -> RegisterMemStatus:
        """Whether a communication domain made by ``link`` is ready for transfers.

        ``RegisterMemStatus.OK`` while every member is linked, ``FAILED`` once a member's link
        broke. ``link`` returns only once the domain is linked, so ``PREPARING`` is never returned.

        Runs inline on the event loop: nothing is awaited.

        :param comm_id: the id ``link`` returned (uint64).
        :returns: a ``RegisterMemStatus``.
        :raises TypeError: ``comm_id`` is not an int.
        :raises ValueError: ``comm_id`` outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` for an unknown ``comm_id``,
            ``LLM_FEATURE_NOT_ENABLED`` with the hixl backend.
        :raises RuntimeError: before ``init`` or after ``finalize``, or from another event loop or
            thread than the one ``init`` ran on.
        """
        self._check_init_loop()
        return self._engine.query_register_mem_status(comm_id)

    def _check_init_loop(self) -> None:
        self._engine.link_table()
        self._check_loop()

    def stats(self) -> DataDistStats:
        """A snapshot of what this engine moved and holds: transfers by route and op (counts
        by status, bytes, latency percentiles of the recent ones), by peer cluster, what each
        live link holds, and the memory pools' usage.

        Cheap and thread-safe: it takes no I/O and may be called from any thread (an
        exporter's, say); unlike the other methods it is not a coroutine. Transfers are
        recorded unless ``LLMConfig.metrics`` is False.

        :returns: a ``DataDistStats``.
        :raises RuntimeError: before ``init`` or after ``finalize``.
        """
        return self._engine.stats()

    @property
    def cluster_id(self) -> int:
        """The cluster id given at construction."""
        return self._engine.cluster_id

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """Where this endpoint listens for links, as ``(ip, port)``, or None for a client.

        The port is the one bound: the system's choice when ``listen_ip_info`` named port 0.
        Not part of the reference API.

        :raises RuntimeError: before ``init`` or after ``finalize``.
        """
        return self._engine.link_table().listen_address

    def __repr__(self) -> str:
        state = "initialized" if self._engine.initialized else "not initialized"
        return f"<AsyncLLMDataDist role={self._engine.role!s} cluster_id={self.cluster_id} {state}>"
