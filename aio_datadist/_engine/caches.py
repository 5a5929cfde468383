"""The cache service: every local CacheManager call, written once for both faces.

Calls that only change bookkeeping run to completion here. Calls that move bytes are split
into ``plan_*`` (validate, resolve, pin, build a :class:`CopyPlan`) and :meth:`execute`
(one runtime call per batch), so each face decides where the bytes move: the blocking face
in the caller's thread, the async face inline or on a worker thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from aio_datadist._engine.plan import CopyPlan, Ops, block_ops, row_ops, staged
from aio_datadist._engine.registry import CacheEntry, CacheRegistry, KeyIdentity
from aio_datadist._memory.pool import Allocation, MemoryPool, PoolStats
from aio_datadist._memory.staging import Staging
from aio_datadist._runtime.base import CopyKind, DeviceRuntime
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

#: A planned block map: ``(sources, destinations, a destination is also a source)``.
BlockMap = tuple["npt.NDArray[np.uint64]", "npt.NDArray[np.uint64]", bool]

_KINDS = {
    (Placement.HOST, Placement.HOST): CopyKind.HOST_TO_HOST,
    (Placement.HOST, Placement.DEVICE): CopyKind.HOST_TO_DEVICE,
    (Placement.DEVICE, Placement.HOST): CopyKind.DEVICE_TO_HOST,
    (Placement.DEVICE, Placement.DEVICE): CopyKind.DEVICE_TO_DEVICE,
}


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
    def _plan(self, batches: list[Ops], kind: CopyKind, entries: Sequence[CacheEntry]) -> CopyPlan:
        nbytes = int(sum(int(b[:, 2].sum()) for b in batches))
        self.registry.pin(entries)
        return CopyPlan(batches, kind, nbytes, pinned=list(entries))

    def plan_copy_cache(
        self,
        dst: Any,
        src: Any,
        dst_batch_index: Any = 0,
        src_batch_index: Any = 0,
        offset: Any = 0,
        size: Any = -1,
        req_id: Any = None,
    ) -> CopyPlan:
        """Plan ``copy_cache``: bytes ``[offset, offset+size)`` of one batch row, per tensor."""
        check_type("dst", dst, Cache)
        check_type("src", src, Cache)
        check_int("dst_batch_index", dst_batch_index, "uint32")
        check_int("src_batch_index", src_batch_index, "uint32")
        check_int("offset", offset, "uint64")
        check_int("size", size, "int64")
        check_int("req_id", req_id, "uint64", allow_none=True)
        if size != -1 and size <= 0:
            raise _invalid(f"size must be -1 or > 0, but got {size}")
        with self.registry.lock:
            d, s = self.entry(dst, "dst"), self.entry(src, "src")
            if d.is_blocks or s.is_blocks:
                raise _invalid("copy_cache does not take blocks caches; use copy_blocks")
            if d.desc.num_tensors != s.desc.num_tensors:
                raise _invalid(
                    f"dst has {d.desc.num_tensors} tensors but src has {s.desc.num_tensors}"
                )
            if dst_batch_index >= d.desc.batch_size:
                raise _invalid(
                    f"dst_batch_index {dst_batch_index} >= dst batch size {d.desc.batch_size}"
                )
            if src_batch_index >= s.desc.batch_size:
                raise _invalid(
                    f"src_batch_index {src_batch_index} >= src batch size {s.desc.batch_size}"
                )
            d_stride, s_stride = d.row_bytes, s.row_bytes
            if offset > 0 and (offset >= s_stride or offset >= d_stride):
                raise _invalid(
                    f"offset {offset} is not inside a row (src row {s_stride} bytes, "
                    f"dst row {d_stride} bytes)"
                )
            nbytes = s_stride - offset if size == -1 else size
            if nbytes > s_stride - offset or nbytes > d_stride - offset:
                raise _invalid(
                    f"copy of {nbytes} bytes at offset {offset} does not fit in a row "
                    f"(src row {s_stride} bytes, dst row {d_stride} bytes)"
                )
            ops = row_ops(
                d.addrs,
                s.addrs,
                dst_batch_index * d_stride + offset,
                src_batch_index * s_stride + offset,
                nbytes,
            )
            if d is s and dst_batch_index == src_batch_index:
                ops = ops[:0]
            plan = self._plan([ops], _KINDS[s.placement, d.placement], [d, s])
        self._log.debug(
            "cache.copy", dst=dst.cache_id, src=src.cache_id, nbytes=plan.nbytes, req_id=req_id
        )
        return plan

    @staticmethod
    def _block_indices(
        name: str, values: npt.NDArray[np.uint64], num_blocks: int
    ) -> npt.NDArray[np.uint64]:
        if len(values) and int(values.max()) >= num_blocks:
            bad = int(values[values >= num_blocks][0])
            raise _invalid(f"{name} block index {bad} is outside [0, {num_blocks})")
        return values

    def plan_copy_blocks(self, cache: Any, copy_block_info: Any) -> CopyPlan:
        """Plan ``copy_blocks``: each source block to each of its destination blocks.

        Every source is read before any destination is written (overlapping maps copy
        through a scratch buffer); a block named as destination twice takes the last source.
        """
        check_type("cache", cache, Cache)
        check_type("copy_block_info", copy_block_info, dict)
        srcs, dsts, overlap = _copy_map(copy_block_info)
        with self.registry.lock:
            entry = self.entry(cache)
            if not entry.is_blocks:
                raise _invalid(f"copy_blocks needs a blocks cache, cache {cache.cache_id} is not")
            num_blocks = entry.num_rows
            dsts = self._block_indices("destination", dsts, num_blocks)
            srcs = self._block_indices("source", srcs, num_blocks)
            ops = block_ops(entry.addrs, entry.addrs, dsts, srcs, entry.row_bytes)
            kind = _KINDS[entry.placement, entry.placement]
            plan = self._plan([ops], kind, [entry])
            if overlap:
                gather, scatter, plan.stage_bytes = staged(ops)
                plan.batches = [gather, scatter]
                plan.stage_device = entry.placement is Placement.DEVICE
        return plan

    def plan_swap_blocks(self, src_cache: Any, dst_cache: Any, src_to_dst: Any) -> CopyPlan:
        """Plan ``swap_blocks``: blocks between a host and a device blocks cache."""
        check_type("src_cache", src_cache, Cache)
        check_type("dst_cache", dst_cache, Cache)
        check_type("src_to_dst", src_to_dst, dict)
        srcs, dsts, _ = _swap_map(src_to_dst)
        pair = (src_cache._layout.placement, dst_cache._layout.placement)
        if pair not in ((Placement.HOST, Placement.DEVICE), (Placement.DEVICE, Placement.HOST)):
            raise _invalid(
                f"swap_blocks moves blocks between HOST and DEVICE, but got {pair[0]!s} -> "
                f"{pair[1]!s}"
            )
        with self.registry.lock:
            sides = [
                self._swap_side(src_cache, "src_cache"),
                self._swap_side(dst_cache, "dst_cache"),
            ]
            (s_addrs, s_blocks, s_bytes, s_entry), (d_addrs, d_blocks, d_bytes, d_entry) = sides
            if s_bytes != d_bytes:
                raise _invalid(f"block sizes differ: src {s_bytes} bytes, dst {d_bytes} bytes")
            if len(s_addrs) != len(d_addrs):
                raise _invalid(f"num_tensors differ: src {len(s_addrs)}, dst {len(d_addrs)}")
            dsts = self._block_indices("dst_cache", dsts, d_blocks)
            srcs = self._block_indices("src_cache", srcs, s_blocks)
            ops = block_ops(d_addrs, s_addrs, dsts, srcs, s_bytes)
            entries = [e for e in (s_entry, d_entry) if e is not None]
            return self._plan([ops], _KINDS[pair], entries)

    def _swap_side(
        self, cache: Cache, name: str
    ) -> tuple[Sequence[int], int, int, CacheEntry | None]:
        if not cache.is_blocks_cache:
            raise _invalid(f"swap_blocks needs blocks caches, {name} is not one")
        if cache._owner is None and cache.cache_id == -1:
            layout = cache._layout
            if not cache._tensor_addrs:
                raise _not_exist(f"{name} has no tensor addresses")
            if layout.batch_size <= 0:
                raise _invalid(f"{name} has {layout.batch_size} blocks")
            block_bytes = layout.tensor_bytes // layout.batch_size
            return cache._tensor_addrs, layout.batch_size, block_bytes, None
        entry = self.entry(cache, name)
        return entry.addrs, entry.num_rows, entry.row_bytes, entry

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


_UINT64_MAX = 2**64 - 1


def _plain_uint64s(*lists: list[Any]) -> bool:
    """Whether every item of ``lists`` is a plain ``int`` in uint64 range (checked at C
    speed, for long block maps; the item-by-item check then names a wrong one)."""
    for values in lists:
        if values and (
            not set(map(type, values)) <= {int} or min(values) < 0 or max(values) > _UINT64_MAX
        ):
            return False
    return True


def _block_map(last: dict[int, int]) -> BlockMap:
    """``{dst: src}`` as arrays, and whether a destination is also a source."""
    dsts = np.fromiter(last.keys(), dtype=np.uint64, count=len(last))
    srcs = np.fromiter(last.values(), dtype=np.uint64, count=len(last))
    return srcs, dsts, not last.keys().isdisjoint(last.values())


def _copy_map(info: dict[Any, Any]) -> BlockMap:
    """The block map of ``copy_blocks`` ``{src: [dst, ...]}``: each destination once, from
    the last source that names it, checked as the API documents."""
    keys, values = list(info), list(info.values())
    if set(map(type, values)) <= {list, tuple}:
        flat = list(itertools.chain.from_iterable(values))
        if _plain_uint64s(keys, flat):
            repeated = itertools.chain.from_iterable(map(itertools.repeat, keys, map(len, values)))
            return _block_map(dict(zip(flat, repeated, strict=True)))
    last: dict[int, int] = {}
    for src_block, dst_blocks in info.items():  # raises, naming the wrong item
        check_int("copy_block_info key", src_block, "uint64")
        check_int_list(f"copy_block_info[{src_block}]", dst_blocks, "uint64")
        for dst_block in dst_blocks:
            last[dst_block] = src_block
    return _block_map(last)


def _swap_map(info: dict[Any, Any]) -> BlockMap:
    """The block map of ``swap_blocks`` ``{src: dst}``: each destination once, from the last
    source that names it, checked as the API documents."""
    if not _plain_uint64s(list(info), list(info.values())):
        for src_block, dst_block in info.items():  # raises, naming the wrong item
            check_int("src_to_dst key", src_block, "uint64")
            check_int(f"src_to_dst[{src_block}]", dst_block, "uint64")
    return _block_map({dst: src for src, dst in info.items()})
