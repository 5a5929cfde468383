"""The async facade: ``AsyncLLMDataDist`` and ``AsyncCacheManager``, awaited from asyncio.

Same names, arguments, results and errors as the blocking API, as coroutines. Both faces run
the same engine code; this one executes small copies inline on the loop and large ones on a
worker thread, and waits for busy memory without blocking the loop.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

import anyio.to_thread

from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.engine import Engine
from aio_datadist._engine.offload import run_native
from aio_datadist._engine.plan import CopyPlan
from aio_datadist._memory.pool import PoolStats
from aio_datadist.cache import Cache
from aio_datadist.enums import LLMRole, Placement

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


class AsyncCacheManager(_LoopBound):
    """The cache manager of an ``AsyncLLMDataDist``: every call is a coroutine."""

    def __init__(self, service: CacheService, loop: asyncio.AbstractEventLoop) -> None:
        self._service = service
        self._loop = loop

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

    def pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Usage of the memory pool for ``placement`` (None when not configured)."""
        return self._service.pool_stats(placement)


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
            self._cache_manager = AsyncCacheManager(service, self._loop)
        return self._cache_manager

    @property
    def cluster_id(self) -> int:
        """The cluster id given at construction."""
        return self._engine.cluster_id

    def __repr__(self) -> str:
        state = "initialized" if self._engine.initialized else "not initialized"
        return f"<AsyncLLMDataDist role={self._engine.role!s} cluster_id={self.cluster_id} {state}>"
