"""The cache service: every local CacheManager call, written once for both faces.

Calls that only change bookkeeping run to completion here. Local copies are planned by the
engine's one planner (``_engine.planner``: validate, resolve, pin, build a
:class:`CopyPlan`) and run by :meth:`execute` (one runtime call per batch), so each face
decides where the bytes move: the blocking face in the caller's thread, the async face
inline or on a worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from aio_datadist._engine.plan import CopyPlan
from aio_datadist._engine.registry import CacheEntry, CacheRegistry, KeyIdentity
from aio_datadist._memory.pool import Allocation, MemoryPool, PoolStats
from aio_datadist._memory.staging import Staging
from aio_datadist._runtime.base import DeviceRuntime
from aio_datadist._validate import (
    INVALID_ID,
    check_int,
    check_int_list,
    check_type,
)
from aio_datadist.cache import Cache
from aio_datadist.enums import Memtype, Placement
from aio_datadist.status import (
    FeatureNotEnabledError,
    KvCacheNotExistError,
    LLMFailedError,
    LLMStatusCode,
    ParamInvalidError,
)
from aio_datadist.types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheLayout,
    MemInfo,
    check_blocks_key_range,
)

__all__ = ("CacheService", "PoolStats", "Reservation", "key_identity")


def _invalid(message: str) -> ParamInvalidError:
    return ParamInvalidError(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _not_exist(message: str) -> KvCacheNotExistError:
    return KvCacheNotExistError(message, status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


def key_identity(key: CacheKey) -> KeyIdentity | None:
    """The identity a key is bound under, or None for a placeholder (no valid id)."""
    if key.prefix_id != INVALID_ID:
        return ("prefix", key.prefix_id, key.model_id)
    if key.req_id != INVALID_ID:
        return ("req", key.req_id, key.model_id)
    return None


@dataclass(eq=False)
class Reservation:
    """Pool memory taken for a cache that does not exist yet (:meth:`CacheService.reserve`)."""

    layout: CacheLayout
    keys: Any
    blocks_key: BlocksCacheKey | None
    pool: MemoryPool
    allocation: Allocation
    #: Bytes from one tensor's start to the next (page-rounded tensor size).
    stride: int

    @property
    def prepare_bytes(self) -> int:
        """Bytes to commit or zero (``aio.ZeroOnAlloc``) before the cache is made; 0 for
        none (:meth:`CacheService.prepare`)."""
        return self.allocation.prepare_bytes


class CacheService:
    """Caches, pools and copies of one initialised engine; unusable after :meth:`close`."""

    def __init__(
        self,
        runtime: DeviceRuntime,
        pools: Mapping[Placement, MemoryPool],
        *,
        remote_cache_accessible: bool,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self.runtime = runtime
        self.pools = dict(pools)
        self.remote_cache_accessible = remote_cache_accessible
        self.registry = CacheRegistry()
        #: Pinned host buffers through which device rows take host-only routes.
        self.staging = Staging(runtime)
        #: Set once a two-sided ``link`` exists: registrations default to not remote-accessible.
        self.two_sided_linked = False
        self._log = log
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------
    def check_open(self) -> None:
        """Raise ``LLMException(LLM_FAILED)`` once the engine was finalized."""
        if self._closed:
            raise LLMFailedError(
                "cache manager is not usable: its LLMDataDist was finalized",
                status_code=LLMStatusCode.LLM_FAILED,
            )

    def close(self) -> None:
        """Forget every cache and close the pools (their memory goes once no view holds it)."""
        with self.registry.lock:
            if self._closed:
                return
            self._closed = True
            self.registry.clear()
        for pool in self.pools.values():
            pool.close()
        self.staging.close()
        self.runtime.close()

    def pool_stats(self, placement: Placement) -> PoolStats | None:
        """Usage of the pool for ``placement``; None when no such pool is configured."""
        check_type("placement", placement, Placement)
        pool = self.pools.get(placement)
        return None if pool is None else pool.stats()

    def on_device(self, entry: CacheEntry) -> bool:
        """True when ``entry`` lives in device memory that host-only routes must stage."""
        return entry.placement is Placement.DEVICE and self.staging.needed

    # -- resolution -----------------------------------------------------------------------
    def entry(self, cache: Any, name: str = "cache") -> CacheEntry:
        """The live entry behind a ``Cache`` of this engine.

        :raises TypeError: ``cache`` is not a ``Cache``.
        :raises LLMException: ``LLM_KV_CACHE_NOT_EXIST`` when it is unknown or released.
        """
        if type(cache) is not Cache:
            check_type(name, cache, Cache)
        self.check_open()
        entry: CacheEntry | None = (
            self.registry.get(cache._cache_id) if cache._owner is self else None
        )
        if entry is None or entry.cache is not cache:
            raise _not_exist(f"{name} (cache_id={cache.cache_id}) does not exist in this engine")
        return entry

    # -- allocation -----------------------------------------------------------------------
    @staticmethod
    def _freeze(desc: CacheDesc, *, is_blocks: bool) -> CacheLayout:
        """The caller's descriptor, read once: everything after works on this copy."""
        if is_blocks:
            # The reference marks the descriptor a blocks API took.
            desc._is_blocks = True
        return CacheLayout.of(desc, is_blocks=is_blocks)

    def _pool_for(self, desc: CacheLayout, call: str) -> MemoryPool:
        pool = self.pools.get(desc.placement)
        if pool is None:
            option = "mem_pool_cfg" if desc.placement is Placement.DEVICE else "host_mem_pool_cfg"
            raise _invalid(
                f"{call} needs a memory pool for {desc.placement!s}: set LLMConfig.{option}"
            )
        return pool

    @staticmethod
    def _tensor_bytes(desc: CacheLayout) -> int:
        if desc.num_tensors <= 0:
            raise _invalid(f"num_tensors must be > 0, but got {desc.num_tensors}")
        size = desc.tensor_bytes
        if size <= 0:
            raise _invalid(f"cache size must be > 0, but shape {list(desc.shape)} gives {size}")
        return size

    def _row_keys(self, desc: CacheLayout, cache_keys: Any) -> list[tuple[KeyIdentity, int]]:
        check_type("cache_keys", cache_keys, list, tuple)
        for i, key in enumerate(cache_keys):
            check_type(f"cache_keys[{i}]", key, CacheKey)
        if len(cache_keys) > desc.batch_size:
            raise _invalid(
                f"got {len(cache_keys)} cache keys for a batch size of {desc.batch_size}"
            )
        rows: list[tuple[KeyIdentity, int]] = []
        seen: set[KeyIdentity] = set()
        for row, key in enumerate(cache_keys):
            identity = key_identity(key)
            if identity is None:
                continue
            if identity in seen:
                raise _invalid(f"cache key {key} appears twice in one call")
            if self.registry.key_bound(identity):
                raise _invalid(f"cache key {key} is already bound to a live cache")
            seen.add(identity)
            rows.append((identity, row))
        return rows

    @staticmethod
    def _check_blocks_key_arg(key: Any) -> None:
        """Type and uint64 range of a ``blocks_cache_key`` argument, checked before any other
        work of the call."""
        check_type("blocks_cache_key", key, BlocksCacheKey, allow_none=True)
        if key is not None:
            check_blocks_key_range("blocks_cache_key", key)

    def _check_blocks_key(self, key: Any) -> None:
        self._check_blocks_key_arg(key)
        if key is not None and self.registry.blocks_key_bound(key.model_id):
            raise _invalid(f"blocks cache key {key} is already bound to a live cache")

    def _names(
        self, desc: CacheLayout, keys: Any, blocks_key: Any, is_blocks: bool
    ) -> list[tuple[KeyIdentity, int]]:
        """Check the names a new cache will take: row keys (batch) or a blocks key."""
        if is_blocks:
            self._check_blocks_key(blocks_key)
            return []
        return self._row_keys(desc, keys)

    def _insert(
        self,
        desc: CacheLayout,
        addrs: list[int],
        rows: list[tuple[KeyIdentity, int]],
        blocks_key: BlocksCacheKey | None,
        *,
        is_blocks: bool,
        remote_accessible: bool,
        stride: int,
        pool: MemoryPool | None = None,
        allocation: Allocation | None = None,
    ) -> Cache:
        """Create the ``Cache`` and its registry entry; the caller holds the registry lock."""
        cache_id = self.registry.next_id()
        cache = Cache(cache_id, desc, list(addrs), None, pool is None, is_blocks)
        cache._owner = self
        cache._keepalive = None if pool is None else pool.arena
        entry = CacheEntry(
            cache_id=cache_id,
            cache=cache,
            desc=desc,
            addrs=tuple(addrs),
            is_blocks=is_blocks,
            registered=pool is None,
            remote_accessible=remote_accessible,
            tensor_stride=stride,
            pool=pool,
            allocation=allocation,
        )
        self.registry.add(entry, rows, blocks_key if is_blocks else None)
        return cache

    def reserve(
        self,
        desc: Any,
        keys: Any,
        blocks_key: Any,
        *,
        is_blocks: bool,
        call: str,
    ) -> Reservation:
        """First step of an allocate call: validate, freeze the layout, take pool memory.

        The memory belongs to no cache yet: commit and zero it (:meth:`prepare`, when
        ``reservation.prepare_bytes``) with no lock held, then :meth:`commit` it, or
        :meth:`abandon` it.

        :raises TypeError: wrong argument types.
        :raises LLMException: ``LLM_PARAM_INVALID`` for an invalid descriptor or key,
            ``LLM_OUT_OF_MEMORY`` when the pool is full.
        """
        check_type("cache_desc", desc, CacheDesc)
        if is_blocks:
            self._check_blocks_key_arg(blocks_key)
        self.check_open()
        layout = self._freeze(desc, is_blocks=is_blocks)
        tensor_bytes = self._tensor_bytes(layout)
        pool = self._pool_for(layout, call)
        stride = pool.round_up(tensor_bytes)
        with self.registry.lock:
            self._names(layout, keys, blocks_key, is_blocks)  # refuse names before memory
            allocation = pool.allocate(stride * layout.num_tensors)
        return Reservation(
            layout=layout,
            keys=keys,
            blocks_key=blocks_key,
            pool=pool,
            allocation=allocation,
            stride=stride,
        )

    def prepare(self, reservation: Reservation) -> None:
        """Commit the fresh pages of a reservation's memory (``Allocation.to_populate``), then
        zero the runs its pool names (``Allocation.to_zero``); done on return.

        Runs without the registry lock: large caches take milliseconds per GiB.

        :raises LLMException: ``LLM_OUT_OF_MEMORY`` when the memory cannot be committed.
        """
        allocation = reservation.allocation
        for addr, n in allocation.to_populate:
            self.runtime.populate(addr, n)
        device = reservation.pool.placement is Placement.DEVICE
        zero = self.runtime.zero_device if device else self.runtime.zero_host
        for addr, n in allocation.to_zero:
            zero(addr, n)

    def commit(self, reservation: Reservation) -> Cache:
        """Make the cache of a reservation and bind its names; the memory is given back
        when that fails (a name bound meanwhile, or the engine finalized)."""
        r, layout = reservation, reservation.layout
        is_blocks = layout.is_blocks
        try:
            with self.registry.lock:
                self.check_open()
                rows = self._names(layout, r.keys, r.blocks_key, is_blocks)
                addrs = [r.allocation.addr + i * r.stride for i in range(layout.num_tensors)]
                cache = self._insert(
                    layout,
                    addrs,
                    rows,
                    r.blocks_key,
                    is_blocks=is_blocks,
                    remote_accessible=True,
                    stride=r.stride,
                    pool=r.pool,
                    allocation=r.allocation,
                )
        except BaseException:
            self.abandon(r)
            raise
        self._log.debug(
            "cache.allocated",
            cache_id=cache.cache_id,
            placement=str(layout.placement),
            nbytes=r.allocation.nbytes,
            keys=len(rows),
            blocks=is_blocks,
            zeroed=sum(n for _, n in r.allocation.to_zero),
        )
        return cache

    @staticmethod
    def abandon(reservation: Reservation) -> None:
        """Give a reservation's memory back to its pool (an allocate call that failed); its
        fresh pages stay to be committed by the next allocation over them."""
        reservation.pool.release(reservation.allocation, unused=True)

    def _allocate(
        self,
        desc: Any,
        keys: Any,
        blocks_key: Any,
        *,
        is_blocks: bool,
        call: str,
    ) -> Cache:
        reservation = self.reserve(desc, keys, blocks_key, is_blocks=is_blocks, call=call)
        try:
            self.prepare(reservation)
        except BaseException:
            self.abandon(reservation)
            raise
        return self.commit(reservation)

    def reserve_cache(self, cache_desc: Any, cache_keys: Any = ()) -> Reservation:
        """:meth:`reserve` for ``allocate_cache``."""
        return self.reserve(cache_desc, cache_keys, None, is_blocks=False, call="allocate_cache")

    def reserve_blocks_cache(self, cache_desc: Any, blocks_cache_key: Any = None) -> Reservation:
        """:meth:`reserve` for ``allocate_blocks_cache``."""
        return self.reserve(
            cache_desc, (), blocks_cache_key, is_blocks=True, call="allocate_blocks_cache"
        )

    def allocate_cache(self, cache_desc: Any, cache_keys: Any = ()) -> Cache:
        """Allocate a batch cache from the pool of its placement and bind ``cache_keys``."""
        return self._allocate(cache_desc, cache_keys, None, is_blocks=False, call="allocate_cache")

    def allocate_blocks_cache(self, cache_desc: Any, blocks_cache_key: Any = None) -> Cache:
        """Allocate a blocks (PagedAttention) cache, optionally named by ``blocks_cache_key``."""
        return self._allocate(
            cache_desc, (), blocks_cache_key, is_blocks=True, call="allocate_blocks_cache"
        )

    def _deallocate(self, cache: Any, *, is_blocks: bool, call: str) -> CacheEntry | None:
        check_type("cache", cache, Cache)
        self.check_open()
        if cache.is_blocks_cache != is_blocks:
            raise _invalid(
                f"{call} takes a {'blocks' if is_blocks else 'batch'} cache, but cache "
                f"{cache.cache_id} is a {'blocks' if cache.is_blocks_cache else 'batch'} cache"
            )
        with self.registry.lock:
            entry = self.registry.get(cache.cache_id) if cache._owner is self else None
            if entry is None or entry.cache is not cache:
                return None
            if entry.registered:
                raise _invalid(
                    f"cache {cache.cache_id} is registered memory: release it with unregister_cache"
                )
            self.registry.release(entry)
            held = entry.holds > 0
        self._log.debug("cache.deallocated", cache_id=cache.cache_id, keys_left=len(entry.keys))
        return entry if held else None

    def deallocate_cache(self, cache: Any) -> CacheEntry | None:
        """Drop the id reference of a batch cache; memory returns once no key remains.
        Returns its entry while a linked peer may still reach it (wait with
        ``registry.wait_let_go``)."""
        return self._deallocate(cache, is_blocks=False, call="deallocate_cache")

    def deallocate_blocks_cache(self, cache: Any) -> CacheEntry | None:
        """Release a pool-allocated blocks cache; returns its entry as
        :meth:`deallocate_cache` does."""
        return self._deallocate(cache, is_blocks=True, call="deallocate_blocks_cache")

    def remove_cache_key(self, cache_key: Any) -> None:
        """Unbind ``cache_key``; an unknown or already removed key is a no-op."""
        check_type("cache_key", cache_key, CacheKey)
        self.check_open()
        identity = key_identity(cache_key)
        if identity is None:
            return
        with self.registry.lock:
            removed = self.registry.drop_key(identity)
        if removed:
            self._log.debug("cache_key.removed", req_id=cache_key.req_id)

    # -- registration ---------------------------------------------------------------------
    def _register(
        self,
        desc: Any,
        addrs: Any,
        keys: Any,
        blocks_key: Any,
        remote_accessible: Any,
        *,
        is_blocks: bool,
    ) -> Cache:
        check_type("cache_desc", desc, CacheDesc)
        check_int_list("addrs", addrs, "uint64", containers=(list,))
        check_type("remote_accessible", remote_accessible, bool, allow_none=True)
        if is_blocks:
            self._check_blocks_key_arg(blocks_key)
        self.check_open()
        layout = self._freeze(desc, is_blocks=is_blocks)
        tensor_bytes = self._tensor_bytes(layout)
        if not addrs:
            raise _invalid("addrs must not be empty")
        if len(addrs) != layout.num_tensors:
            raise _invalid(
                f"addrs has {len(addrs)} entries but cache_desc.num_tensors is {layout.num_tensors}"
            )
        if 0 in addrs:
            raise _invalid("addrs must not contain a null address")
        if remote_accessible is None:
            remote_accessible = layout.placement is Placement.DEVICE and not self.two_sided_linked
        elif remote_accessible and self.two_sided_linked:
            raise _invalid("remote_accessible=True is refused after a two-sided link()")
        with self.registry.lock:
            rows = self._names(layout, keys, blocks_key, is_blocks)
            cache = self._insert(
                layout,
                addrs,
                rows,
                blocks_key,
                is_blocks=is_blocks,
                remote_accessible=remote_accessible,
                stride=tensor_bytes,
            )
        self._log.debug(
            "cache.registered",
            cache_id=cache.cache_id,
            tensors=len(addrs),
            tensor_bytes=tensor_bytes,
            blocks=is_blocks,
            remote_accessible=remote_accessible,
        )
        return cache

    def register_cache(
        self, cache_desc: Any, addrs: Any, cache_keys: Any = (), remote_accessible: Any = None
    ) -> Cache:
        """Register user memory (one address per tensor) as a batch cache."""
        return self._register(
            cache_desc, addrs, cache_keys, None, remote_accessible, is_blocks=False
        )

    def register_blocks_cache(
        self,
        cache_desc: Any,
        addrs: Any,
        blocks_cache_key: Any = None,
        remote_accessible: Any = None,
    ) -> Cache:
        """Register user memory (one address per tensor) as a blocks cache."""
        return self._register(
            cache_desc, addrs, (), blocks_cache_key, remote_accessible, is_blocks=True
        )

    def unregister_cache(self, cache_id: Any) -> CacheEntry | None:
        """Forget a registered cache; returns its entry when copies still use it or a linked
        peer may still reach it (to wait on)."""
        check_int("cache_id", cache_id, "int64")
        self.check_open()
        with self.registry.lock:
            entry = self.registry.get(cache_id)
            if entry is None or not entry.registered:
                return None
            self.registry.remove(entry)
        self._log.debug("cache.unregistered", cache_id=cache_id)
        return entry if entry.pins or entry.holds else None

    def remap_registered_memory(self, mem_infos: Any) -> None:
        """Validate ``mem_infos``, then refuse: the call is reserved in the documented API."""
        check_type("mem_infos", mem_infos, MemInfo, list)
        items = mem_infos if isinstance(mem_infos, list) else [mem_infos]
        for i, info in enumerate(items):
            check_type(f"mem_infos[{i}]", info, MemInfo)
            if info.mem_type is not Memtype.MEM_TYPE_DEVICE:
                raise _invalid(f"mem_infos[{i}].mem_type must be MEM_TYPE_DEVICE")
            if info.addr == 0 or info.size <= 0:
                raise _invalid(f"mem_infos[{i}] needs addr != 0 and size > 0")
        self.check_open()
        raise FeatureNotEnabledError(
            "remap_registered_memory is reserved in LLM-DataDist and not supported: there is "
            "no NIC registration to repair after a device memory fault",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )

    # -- copies ---------------------------------------------------------------------------
    def execute(self, plan: CopyPlan) -> None:
        """Run a plan's batches through the runtime, then release its pins."""
        try:
            if plan.stage_bytes:
                self._execute_staged(plan)
            else:
                for ops in plan.batches:
                    if len(ops):
                        self.runtime.copy_batch(ops, plan.kind)
        finally:
            self.release(plan)

    def _execute_staged(self, plan: CopyPlan) -> None:
        rt = self.runtime
        alloc, free = (
            (rt.alloc_device, rt.free_device)
            if plan.stage_device
            else (rt.alloc_host, rt.free_host)
        )
        scratch = alloc(plan.stage_bytes)
        try:
            gather, scatter = (b.copy() for b in plan.batches)
            gather[:, 0] += np.uint64(scratch)
            scatter[:, 1] += np.uint64(scratch)
            rt.copy_batch(gather, plan.kind)
            rt.copy_batch(scatter, plan.kind)
        finally:
            free(scratch, plan.stage_bytes)

    def release(self, plan: CopyPlan) -> None:
        """Release a plan's pins (idempotent); for plans abandoned before execution."""
        pinned, plan.pinned = plan.pinned, []
        if pinned:
            self.registry.unpin(pinned)  # type: ignore[arg-type]
