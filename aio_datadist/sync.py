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
from aio_datadist._engine.layerwise import plan_layer_job
from aio_datadist._engine.links import LinkTable
from aio_datadist._engine.planner import Planner
from aio_datadist._engine.request import Plan
from aio_datadist._engine.routes import Waiting
from aio_datadist._log import get_logger
from aio_datadist.cache import Cache
from aio_datadist.cluster import LinkResults
from aio_datadist.enums import LLMRole, Placement, RegisterMemStatus
from aio_datadist.status import LLMException, LLMFailedError, LLMStatusCode, ParamInvalidError
from aio_datadist.synchronizer import LayerSynchronizer
from aio_datadist.task import CacheTask

__all__ = ("LLMDataDist", "CacheManager")

_log = get_logger("sync")


def drive(call: Call, synchronizer: LayerSynchronizer | None = None) -> None:
    """Run ``call`` to its end in this thread: start each transfer here, wait for each
    here, and ask ``synchronizer`` here; failures go back into the call."""
    reply: Any = None
    error: Exception | None = None
    while True:
        try:
            op = call.send(reply) if error is None else call.throw(error)
        except StopIteration:
            return
        reply, error = None, None
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


class CacheManager:
    """Allocates, registers and copies the caches of one ``LLMDataDist`` (``cache_manager``)."""

    def __init__(self, service: CacheService, planner: Planner, links: LinkTable) -> None:
        self._service = service
        self._planner = planner
        self._links = links

    def _run(self, plan: Plan) -> None:
        drive(run_call(plan, self._links, Waiting.CALLER))

    def allocate_cache(self, cache_desc: Any, cache_keys: Any = ()) -> Cache:
        """Allocate a batch cache from the pool of its placement, one key per batch row.

        :raises LLMException: ``LLM_PARAM_INVALID`` (no pool for the placement, too many,
            duplicate or already bound keys), ``LLM_OUT_OF_MEMORY`` (pool exhausted).
        """
        return self._service.allocate_cache(cache_desc, cache_keys)

    def deallocate_cache(self, cache: Any) -> None:
        """Release a batch cache; its memory returns once every key was pulled or removed."""
        self._service.deallocate_cache(cache)

    def remove_cache_key(self, cache_key: Any) -> None:
        """Unbind a key so that its row can no longer be pulled; unknown keys are a no-op."""
        self._service.remove_cache_key(cache_key)

    def allocate_blocks_cache(self, cache_desc: Any, blocks_cache_key: Any = None) -> Cache:
        """Allocate a blocks (PagedAttention) cache; dimension 0 of the shape is the block count."""
        return self._service.allocate_blocks_cache(cache_desc, blocks_cache_key)

    def deallocate_blocks_cache(self, cache: Any) -> None:
        """Release a pool-allocated blocks cache; unknown or released caches are a no-op."""
        self._service.deallocate_blocks_cache(cache)

    def register_cache(
        self, cache_desc: Any, addrs: Any, cache_keys: Any = (), remote_accessible: Any = None
    ) -> Cache:
        """Register user memory (a list with one address per tensor) as a batch cache."""
        return self._service.register_cache(cache_desc, addrs, cache_keys, remote_accessible)

    def register_blocks_cache(
        self,
        cache_desc: Any,
        addrs: Any,
        blocks_cache_key: Any = None,
        remote_accessible: Any = None,
    ) -> Cache:
        """Register user memory (a list with one address per tensor) as a blocks cache."""
        return self._service.register_blocks_cache(
            cache_desc, addrs, blocks_cache_key, remote_accessible
        )

    def unregister_cache(self, cache_id: Any) -> None:
        """Forget a registered cache; returns after any copy still using it has finished."""
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
        """Copy bytes ``[offset, offset + size)`` of one batch row of every tensor of ``src``.

        ``size=-1`` copies the rest of the row. Rows are ``cache_desc.size // batch_size`` bytes.
        """
        plan = self._service.plan_copy_cache(
            dst, src, dst_batch_index, src_batch_index, offset, size, req_id
        )
        self._service.execute(plan)

    def copy_blocks(self, cache: Any, copy_block_info: Any) -> None:
        """Copy blocks inside one blocks cache: ``{src_block: [dst_block, ...]}``."""
        self._service.execute(self._service.plan_copy_blocks(cache, copy_block_info))

    def swap_blocks(self, src_cache: Any, dst_cache: Any, src_to_dst: Any) -> None:
        """Copy blocks between a HOST and a DEVICE blocks cache: ``{src_block: dst_block}``."""
        self._service.execute(self._service.plan_swap_blocks(src_cache, dst_cache, src_to_dst))

    def remap_registered_memory(self, mem_infos: Any) -> None:
        """Reserved in the documented API: validates, then raises ``LLM_FEATURE_NOT_ENABLED``."""
        self._service.remap_registered_memory(mem_infos)

    def pull_cache(
        self, cache_key: Any, cache: Any, batch_index: Any = 0, size: Any = -1, **kwargs: Any
    ) -> None:
        """Pull one batch row of a remote cache into row ``batch_index`` of ``cache``.

        A pull by a ``CacheKey`` with a req_id drops that key on the remote side when the
        remote cache was pool-allocated. Keyword arguments: ``src_layer_range``,
        ``dst_layer_range``, ``tensor_num_per_layer``.

        :raises LLMException: ``LLM_NOT_YET_LINK``, ``LLM_KV_CACHE_NOT_EXIST``,
            ``LLM_TIMEOUT`` (``sync_kv_timeout``), ``LLM_LINK_FAILED``, ``LLM_PARAM_INVALID``.
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
        """Pull remote blocks (``BlocksCacheKey``) or one remote row (cache key) into blocks.

        Block ``src_blocks[i]`` lands in local block ``dst_blocks[i]``; errors as ``pull_cache``.
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

        Needs ``enable_remote_cache_accessible``; returns once the bytes are in remote memory.
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

        Needs ``enable_remote_cache_accessible``; returns once the bytes are in remote memory.
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
    ) -> CacheTask:
        """Push ``src_cache`` layer by layer in a background thread; returns its ``CacheTask``.

        Each layer starts once ``layer_synchronizer.synchronize_layer(layer, None)`` returned
        True. Arguments are checked before returning; transfer errors go to the task.
        """
        job = plan_layer_job(
            self._planner,
            src_cache,
            layer_synchronizer,
            transfer_configs,
            src_block_indices,
            dst_block_indices,
            dst_block_memory_size,
            allow_async=False,
        )
        task = CacheTask(len(job.configs))
        call = run_layers(job, task, self._links, Waiting.CALLER)
        threading.Thread(
            target=drive, args=(call, job.synchronizer), name="aio_datadist-layers", daemon=True
        ).start()
        return task

    def pool_stats(self, placement: Placement = Placement.DEVICE) -> PoolStats | None:
        """Usage of the memory pool for ``placement`` (None when not configured)."""
        return self._service.pool_stats(placement)


class LLMDataDist:
    """One LLM-DataDist endpoint (blocking API). At most one may be initialised per process."""

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

        :raises LLMException: ``LLM_FAILED`` when another LLMDataDist is initialised in this
            process; ``LLM_PARAM_INVALID`` for invalid options.
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
        """Release everything ``init`` created; a no-op when not initialised."""
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
        """Link to each listed server (in parallel); returns ``(overall, per_cluster)``.

        Link failures are reported in the result, never raised: ``per_cluster`` is a
        :class:`~aio_datadist.cluster.LinkResults` whose ``errors`` say why each failed.
        ``timeout`` is in ms (> 0).

        :raises TypeError: ``clusters`` is not a list/tuple of ``LLMClusterInfo``.
        :raises ValueError: ``timeout`` outside int32.
        :raises LLMException: ``LLM_PARAM_INVALID`` for ``timeout <= 0`` or a cluster
            without ``remote_cluster_id`` (or local ip, when ``local_comm_res`` is unset).
        """
        return self._engine.link_clusters(clusters, timeout)

    def unlink_clusters(
        self, clusters: Any, timeout: Any = 3000, force: Any = False
    ) -> tuple[LLMStatusCode, LinkResults]:
        """Unlink clusters: gracefully (both ends) or with ``force`` (this end only).

        Results as :meth:`link_clusters`. With the hixl backend only this side's link goes,
        named by ``remote_cluster_id`` alone, and ``force`` is ignored.
        """
        return self._engine.unlink_clusters(clusters, timeout, force)

    def switch_role(self, role: Any, switch_options: Any = None) -> None:
        """Switch role; ``llm.listenIpInfo`` in ``switch_options`` makes this a server there.

        :raises LLMException: ``LLM_EXIST_LINK`` while links exist.
        """
        self._engine.switch_role(role, switch_options)

    def link(self, comm_name: Any, cluster_rank_info: Any, rank_table: Any) -> int:
        """Two-sided link with the members of a rank table's domain; returns its comm id.

        Every member calls it at the same time; see ``docs/design.md`` for how a rank's
        endpoint is found on TCP.
        """
        return self._engine.link(comm_name, cluster_rank_info, rank_table)

    def unlink(self, comm_id: Any) -> None:
        """Unlink a communication domain made by ``link``."""
        self._engine.unlink(comm_id)

    def query_register_mem_status(self, comm_id: Any) -> RegisterMemStatus:
        """``RegisterMemStatus.OK`` once the domain is linked (``FAILED`` if a link broke)."""
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

    @property
    def cluster_id(self) -> int:
        """The cluster id given at construction."""
        return self._engine.cluster_id

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
