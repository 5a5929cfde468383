"""The documented blocking API: ``LLMDataDist`` and its ``CacheManager``, name for name.

Thin drivers over the engine: they check the documented preconditions, then run the engine's
calls in the caller's thread. A transfer call is the engine's generator
(``_engine.driver``), driven by :func:`drive` here: starts run in the caller, and the caller
waits for each request itself, reading its answer where the link can. No event loop is
needed or started.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, ClassVar

from aio_datadist._engine.caches import CacheService, PoolStats
from aio_datadist._engine.driver import Call, Start, Wait, run_call, run_layers
from aio_datadist._engine.engine import Engine
from aio_datadist._engine.layerwise import LayerJob
from aio_datadist._engine.links import LinkTable
from aio_datadist._engine.planner import Planner
from aio_datadist._engine.request import Plan
from aio_datadist._log import get_logger
from aio_datadist.cache import Cache
from aio_datadist.cluster import LinkResults
from aio_datadist.enums import LLMRole, Placement, RegisterMemStatus
from aio_datadist.stats import DataDistStats
from aio_datadist.status import LLMException, LLMFailedError, LLMStatusCode, ParamInvalidError
from aio_datadist.synchronizer import LayerSynchronizer
from aio_datadist.task import CacheTask

__all__ = ("LLMDataDist", "CacheManager")

_log = get_logger("sync")


def drive(call: Call, synchronizer: LayerSynchronizer | None = None) -> None:
    """Run ``call`` to its end in this thread: start each transfer here, wait for each
    here, and ask ``synchronizer`` here; failures go back into the call."""
    op = next(call, None)  # (None: the call ended before it needed anything of its face)
    while op is not None:
        reply: Any = None
        error: Exception | None = None
        try:
            if isinstance(op, Start):
                reply = op.begin()
            elif isinstance(op, Wait):
                op.completion.wait()
            else:
                assert synchronizer is not None
                reply = synchronizer.synchronize_layer(op.layer, None)
        except Exception as exc:
            error = exc
        try:
            op = call.send(reply) if error is None else call.throw(error)
        except StopIteration:
            return


class CacheManager:
    """Allocates, registers, copies and transfers the caches of one ``LLMDataDist``.

    Obtained from ``LLMDataDist.cache_manager`` (CacheManager mode), never constructed. Every
    call blocks the calling thread until it is done, except ``transfer_cache_async``, which
    returns a ``CacheTask``; calls from several threads at once are safe. After ``finalize``
    every call raises ``LLMException(LLM_FAILED)``.
    """

    def __init__(self, service: CacheService, planner: Planner, links: LinkTable) -> None:
        self._service = service
        self._planner = planner
        self._links = links

    def _run(self, plan: Plan) -> None:
        drive(run_call(plan, self._links, inline=True))

    def allocate_cache(self, cache_desc: Any, cache_keys: Any = ()) -> Cache:
        """Allocate a batch cache from the memory pool of its placement, one key per row.

        Needs the pool of ``cache_desc.placement`` (``LLMConfig.mem_pool_cfg`` for DEVICE,
        ``host_mem_pool_cfg`` for HOST). ``cache_keys[i]`` names row ``i`` for a remote
        ``pull_cache``; a key with ``req_id=2**64-1`` is a placeholder that binds nothing, and
        trailing rows may go unnamed. Keys are checked before any memory is taken; a refused call
        binds no key and keeps no memory. With ``zero_on_alloc`` the memory is zeroed first.

        Host memory no cache held before is committed (so no transfer takes a page fault on
        it), and with ``zero_on_alloc`` the memory is zeroed, in the calling thread.

        :param cache_desc: the ``CacheDesc`` of every tensor: ``shape[0]`` is the batch size,
            ``num_tensors`` > 0.
        :param cache_keys: list or tuple of ``CacheKey``, at most ``shape[0]`` of them, none twice,
            none already bound to a live cache. Default: no names.
        :returns: the new ``Cache`` (``is_blocks_cache`` False).
        :raises TypeError: wrong argument types.
        :raises LLMException: ``LLM_PARAM_INVALID`` (no pool for the placement, an empty descriptor,
            too many, duplicate or already bound keys), ``LLM_OUT_OF_MEMORY`` (the pool cannot hold
            it), ``LLM_FAILED`` after ``finalize``.
        """
        return self._service.allocate_cache(cache_desc, cache_keys)

    def deallocate_cache(self, cache: Any) -> None:
        """Release a batch cache made by ``allocate_cache``.

        The cache id is dropped at once and ``cache.tensor_addrs`` becomes ``[]``; the memory
        returns to the pool once every key bound to its rows was pulled (by ``CacheKey``) or removed
        with ``remove_cache_key``. An unknown or already released cache is a no-op.

        With the UCX route, waits in the calling thread until the linked peers that could reach
        the cache acknowledged that they no longer can (one round trip; a peer that does not
        answer in ``ucxboard.ACK_TIMEOUT_S`` has its link broken).

        :param cache: the batch ``Cache`` to release.
        :raises TypeError: ``cache`` is not a ``Cache``.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a blocks cache or registered memory (use
            ``deallocate_blocks_cache`` / ``unregister_cache``), ``LLM_FAILED`` after ``finalize``.
        """
        held = self._service.deallocate_cache(cache)
        if held is not None:
            self._service.registry.wait_let_go(held)

    def remove_cache_key(self, cache_key: Any) -> None:
        """Unbind a ``CacheKey`` so that its row can no longer be pulled.

        When the last key of a deallocated cache goes, its memory returns to the pool. An unknown,
        placeholder or already removed key is a no-op.

        :param cache_key: the ``CacheKey`` given to ``allocate_cache`` or ``register_cache``.
        :raises TypeError: ``cache_key`` is not a ``CacheKey``.
        :raises LLMException: ``LLM_FAILED`` after ``finalize``.
        """
        self._service.remove_cache_key(cache_key)

    def allocate_blocks_cache(self, cache_desc: Any, blocks_cache_key: Any = None) -> Cache:
        """Allocate a blocks (PagedAttention) cache from the memory pool of its placement.

        Dimension 0 of ``cache_desc.shape`` is the number of blocks. The pool rules and zeroing are
        those of ``allocate_cache``.

        Host memory no cache held before is committed (so no transfer takes a page fault on
        it), and with ``zero_on_alloc`` the memory is zeroed, in the calling thread.

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
        """
        return self._service.allocate_blocks_cache(cache_desc, blocks_cache_key)

    def deallocate_blocks_cache(self, cache: Any) -> None:
        """Release a blocks cache made by ``allocate_blocks_cache``.

        Its memory returns to the pool and ``cache.tensor_addrs`` becomes ``[]``. An unknown or
        already released cache is a no-op. With the UCX route, waits for the linked peers as
        ``deallocate_cache`` does.

        :param cache: the blocks ``Cache`` to release.
        :raises TypeError: ``cache`` is not a ``Cache``.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a batch cache or registered memory,
            ``LLM_FAILED`` after ``finalize``.
        """
        held = self._service.deallocate_blocks_cache(cache)
        if held is not None:
            self._service.registry.wait_let_go(held)

    def register_cache(
        self, cache_desc: Any, addrs: Any, cache_keys: Any = (), remote_accessible: Any = None
    ) -> Cache:
        """Register memory the caller allocated as a batch cache, one address per tensor.

        The memory stays the caller's and must outlive the cache (``unregister_cache`` first);
        registered ranges must not overlap. Register before linking: peers learn of registered
        memory when they link.

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
        """
        return self._service.register_cache(cache_desc, addrs, cache_keys, remote_accessible)

    def register_blocks_cache(
        self,
        cache_desc: Any,
        addrs: Any,
        blocks_cache_key: Any = None,
        remote_accessible: Any = None,
    ) -> Cache:
        """Register memory the caller allocated as a blocks cache, one address per tensor.

        As ``register_cache``, for a PagedAttention cache whose dimension 0 indexes blocks; the
        optional key names it for a remote ``pull_blocks``/``push_blocks``.

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
        """
        return self._service.register_blocks_cache(
            cache_desc, addrs, blocks_cache_key, remote_accessible
        )

    def unregister_cache(self, cache_id: Any) -> None:
        """Forget a registered cache; its memory goes back to the caller.

        Completes once no copy or transfer still uses the memory (and, with the UCX route, once the
        linked peers that could reach it acknowledged that they no longer can). An unknown or
        already unregistered id, or the id of a pool-allocated cache, is a no-op. Unlink the peers
        that may still address the memory first.

        Waits in the calling thread for copies still using the memory.

        :param cache_id: ``Cache.cache_id`` of a registered cache (int64).
        :raises TypeError: ``cache_id`` is not an int.
        :raises ValueError: ``cache_id`` outside int64.
        :raises LLMException: ``LLM_FAILED`` after ``finalize``.
        """
        busy = self._service.unregister_cache(cache_id)
        if busy is not None:
            self._service.registry.wait_unpinned(busy)

    def copy_cache(
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

        The copy runs in the calling thread.

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
        """
        plan = self._planner.copy_cache(
            dst, src, dst_batch_index, src_batch_index, offset, size, req_id
        )
        self._service.execute(plan)

    def copy_blocks(self, cache: Any, copy_block_info: Any) -> None:
        """Copy blocks inside one blocks cache, in every tensor.

        Every source block is read before any destination is written, so overlapping maps copy
        correctly; a block named as destination twice takes the last source.

        The copy runs in the calling thread.

        :param cache: a blocks ``Cache`` of this engine.
        :param copy_block_info: dict ``{src_block: [dst_block, ...]}`` of uint64 indices in
            ``[0, num_blocks)``.
        :raises TypeError: wrong argument types.
        :raises ValueError: an index outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` (not a blocks cache, an index out of range),
            ``LLM_KV_CACHE_NOT_EXIST`` (the cache is unknown or released), ``LLM_FAILED`` after
            ``finalize``.
        """
        self._service.execute(self._planner.copy_blocks(cache, copy_block_info))

    def swap_blocks(self, src_cache: Any, dst_cache: Any, src_to_dst: Any) -> None:
        """Copy blocks between a HOST and a DEVICE blocks cache (swap in or swap out).

        HOST to DEVICE swaps in, DEVICE to HOST swaps out; the host side usually comes from
        ``Cache.create_cpu_cache``.

        The copy runs in the calling thread.

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
        """
        self._service.execute(self._planner.swap_blocks(src_cache, dst_cache, src_to_dst))

    def remap_registered_memory(self, mem_infos: Any) -> None:
        """Reserved in the documented API: validates ``mem_infos``, then always raises.

        In the reference it registers device memory repaired after a memory fault with the NIC
        again; this implementation has no such registration to repair, so it raises
        ``LLM_FEATURE_NOT_ENABLED`` once the arguments are valid.

        :param mem_infos: a ``MemInfo`` or a list of them, each ``MEM_TYPE_DEVICE`` with
            ``addr != 0`` and ``size > 0``.
        :raises TypeError: wrong argument types.
        :raises LLMException: ``LLM_PARAM_INVALID`` for an invalid entry, ``LLM_FAILED`` after
            ``finalize``, else always ``LLM_FEATURE_NOT_ENABLED``.
        """
        self._service.remap_registered_memory(mem_infos)

    def pull_cache(
        self, cache_key: Any, cache: Any, batch_index: Any = 0, size: Any = -1, **kwargs: Any
    ) -> None:
        """Pull one batch row of a remote cache into row ``batch_index`` of ``cache``.

        A pull by a ``CacheKey`` with a ``req_id`` drops that key on the remote side when the remote
        cache was pool-allocated, so a second pull of it finds nothing.

        Starts the request and waits for its answer in the calling thread.

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
        """
        self._run(self._planner.pull_cache(cache_key, cache, batch_index, size, kwargs))

    def pull_blocks(
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

        Starts the requests and waits for their answers in the calling thread.

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
        """
        self._run(
            self._planner.pull_blocks(src_cache_key, dst_cache, src_blocks, dst_blocks, kwargs)
        )

    def push_cache(
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

        Sends the layers and waits for their acknowledgements in the calling thread.

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
        """
        self._run(
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

    def push_blocks(
        self,
        dst_cache_key: Any,
        src_cache: Any,
        src_blocks: Any = (),
        dst_blocks: Any = (),
        src_layer_range: Any = None,
        dst_layer_range: Any = None,
        tensor_num_per_layer: Any = 2,
    ) -> None:
        """Push local blocks ``src_blocks[i]`` into remote blocks ``dst_blocks[i]``.

        Needs ``enable_remote_cache_accessible`` on both ends; the remote blocks cache is the one
        registered or allocated under ``dst_cache_key``.

        Sends the blocks and waits for their acknowledgements in the calling thread; returns once
        the bytes are in the remote memory.

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
        :raises TypeError: wrong argument types.
        :raises ValueError: an int or key id outside its range.
        :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` (``enable_remote_cache_accessible`` is
            off), ``LLM_PARAM_INVALID`` (not a blocks cache, empty ``dst_blocks``, block lists of
            different lengths, an index or layer range out of range), ``LLM_KV_CACHE_NOT_EXIST``
            (the local cache, or the remote cache, does not exist), ``LLM_NOT_YET_LINK`` (no link to
            the remote cluster, or a two-sided domain not linked yet), ``LLM_LINK_FAILED`` (the link
            broke), ``LLM_TIMEOUT`` (not done within ``sync_kv_timeout``; the link must be rebuilt),
            ``LLM_FAILED`` after ``finalize``.
        """
        self._run(
            self._planner.push_blocks(
                dst_cache_key,
                src_cache,
                src_blocks,
                dst_blocks,
                src_layer_range,
                dst_layer_range,
                tensor_num_per_layer,
            )
        )

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

        A daemon thread started here drives the layers: it calls ``synchronize_layer`` (a plain
        ``def``; an ``async def`` raises ``TypeError`` here, it needs ``AsyncLLMDataDist``) and
        waits for the requests. Wait with ``task.synchronize()`` or ``task.get_results()`` (status
        codes, optional timeout in ms) or, from a coroutine, ``await task``. Transfer failures
        (``LLM_NOT_YET_LINK``, ``LLM_LINK_FAILED``, ``LLM_TIMEOUT``, ``LLM_KV_CACHE_NOT_EXIST``)
        become the failed configs' results; ``task.cancel()`` stops before the next layer.

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
        :returns: a ``CacheTask`` with one result per config, in order.
        :raises TypeError: wrong argument types, configs of the wrong kind, not a
            ``LayerSynchronizer`` or an ``async def`` one.
        :raises ValueError: an int outside its range.
        :raises LLMException: ``LLM_PARAM_INVALID`` (a HOST source, ``num_tensors`` not a
            multiple of ``tensor_num_per_layer``, ``tensor_num_per_layer`` < 1, a bad layer range,
            block list or block size), ``LLM_KV_CACHE_NOT_EXIST`` (the source cache is
            unknown or released), ``LLM_FAILED`` after ``finalize``.
        """
        planned = self._planner.layer_job(
            src_cache,
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
            allow_async=False,
            tensor_num_per_layer=tensor_num_per_layer,
        )
        job = LayerJob(self._planner, planned)
        task = CacheTask(len(job.configs))
        call = run_layers(job, task, self._links)
        threading.Thread(
            target=drive, args=(call, job.synchronizer), name="aio_datadist-layers", daemon=True
        ).start()
        return task

    def pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Usage of the memory pool for ``placement``, or None when it is not configured.

        A snapshot: ``capacity``, ``used``, ``free``, ``largest_free`` (the biggest run one
        allocation could get now), ``allocations`` and ``page_size``, every size in bytes.

        :param placement: ``Placement.DEVICE`` (the default, ``mem_pool_cfg``) or ``Placement.HOST``
            (``host_mem_pool_cfg``).
        :returns: a ``PoolStats``, or None without a pool for ``placement``.
        :raises TypeError: ``placement`` is not a ``Placement``.
        """
        return self._service.pool_stats(placement)


class LLMDataDist:
    """One LLM-DataDist endpoint of the blocking API: links, and caches through ``cache_manager``.

    ``LLMDataDist(role, cluster_id)`` checks that ``role`` is an ``LLMRole`` (``TypeError``) and
    ``cluster_id`` a uint64 (``ValueError``); nothing else happens before ``init``. At most one
    may be initialised per process at a time (``AsyncLLMDataDist`` has no such limit). Every
    call blocks the calling thread; no event loop is needed or started.
    """

    _live: ClassVar[LLMDataDist | None] = None
    _live_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self._engine = Engine(role, cluster_id)
        self._cache_manager: CacheManager | None = None

    @property
    def _role(self) -> LLMRole:
        return self._engine.role

    def _check_init(self) -> Engine:
        if not self._engine.initialized:
            raise RuntimeError("llm datadist is not initialized")
        return self._engine

    def init(self, options: dict[str, str]) -> None:
        """Initialise from ``LLMConfig.generate_options()``; a second call does nothing.

        Chooses the runtime for ``device_id``, creates the memory pools the options configure and,
        with ``listen_ip_info``, starts listening for links. Call ``finalize`` before the process
        exits.

        At most one ``LLMDataDist`` may be initialised per process at a time (the reference's rule;
        ``AsyncLLMDataDist`` has no such limit). An ``atexit`` hook finalises one left initialised.

        :param options: dict of str to str, normally ``LLMConfig(...).generate_options()``;
            ``device_id`` is required.
        :raises TypeError: ``options`` is not a dict.
        :raises ValueError: a listen port that is not a decimal integer.
        :raises LLMException: ``LLM_PARAM_INVALID`` (invalid or missing options), ``LLM_FAILED``
            (another ``LLMDataDist`` is initialised in this process, or the listen address cannot be
            bound).
        """
        if self._engine.initialized:
            return
        with LLMDataDist._live_lock:
            if LLMDataDist._live is not None and LLMDataDist._live is not self:
                raise LLMFailedError(
                    "Cannot init multiple LLMDataDists", status_code=LLMStatusCode.LLM_FAILED
                )
            self._engine.init(options)
            LLMDataDist._live = self

    def finalize(self) -> None:
        """Release every link, cache, pool and listener that ``init`` created.

        Links are closed and pool memory is freed (registered memory stays the caller's; views from
        ``Cache.as_numpy`` stay safe to touch). A no-op when not initialised; the endpoint may be
        initialised again afterwards. Do not run it concurrently with other calls.

        It also frees the one-per-process slot, so another ``LLMDataDist`` may ``init``.
        """
        self._engine.finalize()
        self._cache_manager = None
        with LLMDataDist._live_lock:
            if LLMDataDist._live is self:
                LLMDataDist._live = None

    @property
    def cache_manager(self) -> CacheManager:
        """The cache manager (CacheManager mode: ``enable_cache_manager=True``).

        :raises RuntimeError: before ``init`` or after ``finalize``.
        :raises LLMException: ``LLM_PARAM_INVALID`` outside CacheManager mode.
        """
        service = self._engine.cache_service()
        if self._cache_manager is None or self._cache_manager._service is not service:
            planner, links = self._engine.planner, self._engine.links
            assert planner is not None and links is not None
            self._cache_manager = CacheManager(service, planner, links)
        return self._cache_manager

    def link_clusters(
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

        The handshakes run in parallel while the calling thread waits.

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
        :raises RuntimeError: before ``init`` or after ``finalize``.
        """
        return self._engine.link_clusters(clusters, timeout)

    def unlink_clusters(
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

        The calling thread waits while the peers are told.

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
        :raises RuntimeError: before ``init`` or after ``finalize``.
        """
        return self._engine.unlink_clusters(clusters, timeout, force)

    def switch_role(self, role: Any, switch_options: Any = None) -> None:
        """Switch this endpoint's role, listening or not as ``switch_options`` says.

        With ``llm.listenIpInfo`` ("ip:port") in ``switch_options``, as
        ``LLMConfig(listen_ip_info=...).generate_options()`` gives it, the endpoint listens there
        (any previous listener is closed first); without it the endpoint stops listening. Switching
        to the same role is allowed. Every link must be gone first.

        :param role: the new ``LLMRole``.
        :param switch_options: dict of str to str, or None (the default) to stop listening.
        :raises TypeError: ``role`` is not an ``LLMRole`` or ``switch_options`` not a dict.
        :raises ValueError: a listen port that is not a decimal integer or outside uint16.
        :raises LLMException: ``LLM_EXIST_LINK`` while any link exists, ``LLM_PARAM_INVALID`` for a
            listen address not in ip:port form, ``LLM_FEATURE_NOT_ENABLED`` for a new listen address
            with the hixl backend, ``LLM_FAILED`` when the address cannot be bound.
        :raises RuntimeError: before ``init`` or after ``finalize``.
        """
        self._engine.switch_role(role, switch_options)

    def link(self, comm_name: Any, cluster_rank_info: Any, rank_table: Any) -> int:
        """Two-sided link with every member of a rank table's communication domain.

        Every member calls it at about the same time; it returns once all are linked. Configure
        pools or register memory first; afterwards the ``register_*`` calls refuse
        ``remote_accessible=True``. ``docs/design.md`` says how a rank's TCP endpoint is found.

        The calling thread waits for the other members.

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
        :raises RuntimeError: before ``init`` or after ``finalize``.
        """
        return self._engine.link(comm_name, cluster_rank_info, rank_table)

    def unlink(self, comm_id: Any) -> None:
        """Unlink every member of a communication domain made by ``link``.

        Both ends of each member's link go, and the domain's communicator is released; the links are
        gone even when releasing the communicator fails.

        :param comm_id: the id ``link`` returned (uint64).
        :raises TypeError: ``comm_id`` is not an int.
        :raises ValueError: ``comm_id`` outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` for an unknown ``comm_id``,
            ``LLM_FEATURE_NOT_ENABLED`` with the hixl backend, or the collective library's failure
            to release the communicator.
        :raises RuntimeError: before ``init`` or after ``finalize``.
        """
        self._engine.unlink(comm_id)

    def query_register_mem_status(self, comm_id: Any) -> RegisterMemStatus:
        """Whether a communication domain made by ``link`` is ready for transfers.

        ``RegisterMemStatus.OK`` while every member is linked, ``FAILED`` once a member's link
        broke. ``link`` returns only once the domain is linked, so ``PREPARING`` is never returned.

        :param comm_id: the id ``link`` returned (uint64).
        :returns: a ``RegisterMemStatus``.
        :raises TypeError: ``comm_id`` is not an int.
        :raises ValueError: ``comm_id`` outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` for an unknown ``comm_id``,
            ``LLM_FEATURE_NOT_ENABLED`` with the hixl backend.
        :raises RuntimeError: before ``init`` or after ``finalize``.
        """
        return self._engine.query_register_mem_status(comm_id)

    @property
    def kv_cache_manager(self) -> Any:
        """The v1 KvCacheManager, which this implementation does not provide.

        :raises RuntimeError: before ``init``.
        :raises LLMException: ``LLM_PARAM_INVALID`` always after ``init``.
        """
        self._check_init()
        raise ParamInvalidError(
            "kv_cache_manager belongs to the v1 API, which is not supported: use cache_manager",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )

    def stats(self) -> DataDistStats:
        """A snapshot of what this engine moved and holds: transfers by route and op (counts
        by status, bytes, latency percentiles of the recent ones), by peer cluster, what each
        live link holds, and the memory pools' usage.

        Cheap and thread-safe: it takes no I/O and may be called from any thread (an
        exporter's, say). Transfers are recorded unless ``LLMConfig.metrics`` is False.

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
        return f"<LLMDataDist role={self._engine.role!s} cluster_id={self.cluster_id} {state}>"


@atexit.register
def _finalize_at_exit() -> None:
    live = LLMDataDist._live
    if live is None:
        return
    try:
        live.finalize()
    except LLMException as exc:  # logged, never raised, at interpreter exit
        _log.error("llm_datadist.finalize_at_exit_failed", error=str(exc))
