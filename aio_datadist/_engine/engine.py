"""The engine: an endpoint's role, cluster id, options and lifecycle (``init``/``finalize``)."""

from __future__ import annotations

import threading
from typing import Any

from aio_datadist._engine.caches import CacheService
from aio_datadist._log import get_logger
from aio_datadist._memory.pool import MemoryPool
from aio_datadist._runtime import select_runtime
from aio_datadist._runtime.base import DeviceRuntime
from aio_datadist._validate import check_int, check_type
from aio_datadist.config import (
    DEFAULT_SYNC_KV_TIMEOUT_MS,
    OPTION_DEVICE_ID,
    OPTION_ENABLE_CACHE_MANAGER,
    OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE,
    OPTION_HOST_MEM_POOL_CONFIG,
    OPTION_MEM_POOL_CONFIG,
    OPTION_SESSION_DEVICE_ID,
    OPTION_SYNC_KV_TIMEOUT,
    parse_mem_pool_cfg,
    prepare_init_options,
)
from aio_datadist.enums import LLMRole, Placement
from aio_datadist.status import LLMStatusCode, ParamInvalidError

__all__ = ("Engine", "EngineSettings")


class EngineSettings:
    """The options of one ``init``, parsed once."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        device = options.get(OPTION_DEVICE_ID)
        if device is None:
            raise ParamInvalidError(
                "init options need a device id (set LLMConfig.device_id)",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        first = options.get(OPTION_SESSION_DEVICE_ID, device.split(";")[0])
        try:
            self.device_id = int(first)
        except ValueError:
            raise ParamInvalidError(
                f"device id {device!r} is not an integer",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            ) from None
        self.cache_manager_mode = options.get(OPTION_ENABLE_CACHE_MANAGER) == "1"
        self.remote_cache_accessible = options.get(OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE) == "1"
        timeout = options.get(OPTION_SYNC_KV_TIMEOUT)
        self.sync_kv_timeout_ms = int(timeout) if timeout else DEFAULT_SYNC_KV_TIMEOUT_MS
        self.device_pool = _pool_cfg(options.get(OPTION_MEM_POOL_CONFIG), host=False)
        self.host_pool = _pool_cfg(options.get(OPTION_HOST_MEM_POOL_CONFIG), host=True)


def _pool_cfg(value: str | None, *, host: bool) -> tuple[int, int] | None:
    return parse_mem_pool_cfg(value, host=host) if value else None


class Engine:
    """One endpoint. Both faces drive it; it owns the cache service between init and finalize."""

    def __init__(self, role: Any, cluster_id: Any) -> None:
        check_type("role", role, LLMRole)
        check_int("cluster_id", cluster_id, "uint64")
        self.role: LLMRole = role
        self.cluster_id: int = cluster_id
        self.settings: EngineSettings | None = None
        self.caches: CacheService | None = None
        self._lock = threading.Lock()
        self._log = get_logger("engine", cluster_id=cluster_id, role=role.name)

    @property
    def initialized(self) -> bool:
        """True between a successful ``init`` and ``finalize``."""
        return self.settings is not None

    def init(self, options: Any) -> None:
        """Validate ``options``, choose the runtime and create the pools.

        A second call on an initialised engine does nothing.

        :raises TypeError: ``options`` is not a dict.
        :raises LLMException: ``LLM_PARAM_INVALID`` for invalid options.
        """
        check_type("options", options, dict)
        with self._lock:
            if self.settings is not None:
                return
            settings = EngineSettings(prepare_init_options(options, self.role))
            runtime = select_runtime(settings.device_id)
            pools: dict[Placement, MemoryPool] = {}
            try:
                for placement, cfg in (
                    (Placement.DEVICE, settings.device_pool),
                    (Placement.HOST, settings.host_pool),
                ):
                    if cfg is not None:
                        pools[placement] = MemoryPool(runtime, placement, *cfg)
            except BaseException:
                _close_all(pools, runtime)
                raise
            log = self._log.bind(device_id=settings.device_id)
            self.caches = CacheService(
                runtime,
                pools,
                remote_cache_accessible=settings.remote_cache_accessible,
                log=get_logger("cache", cluster_id=self.cluster_id, role=self.role.name),
            )
            self.settings = settings
        log.info(
            "engine.initialized",
            runtime=runtime.name,
            cache_manager=settings.cache_manager_mode,
            device_pool=settings.device_pool,
            host_pool=settings.host_pool,
        )

    def cache_service(self) -> CacheService:
        """The cache service, checking the documented preconditions of ``cache_manager``.

        :raises RuntimeError: not initialised.
        :raises LLMException: ``LLM_PARAM_INVALID`` outside CacheManager mode.
        """
        settings, caches = self.settings, self.caches
        if settings is None or caches is None:
            raise RuntimeError("llm datadist is not initialized")
        if not settings.cache_manager_mode:
            raise ParamInvalidError(
                "cache_manager needs CacheManager mode: set LLMConfig.enable_cache_manager = True"
                " (the v1 KvCacheManager API is not supported)",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        return caches

    def finalize(self) -> None:
        """Release every cache, pool and runtime resource; a no-op when not initialised."""
        with self._lock:
            caches, self.caches, self.settings = self.caches, None, None
        if caches is not None:
            caches.close()
            self._log.info("engine.finalized")


def _close_all(pools: dict[Placement, MemoryPool], runtime: DeviceRuntime) -> None:
    for pool in pools.values():
        pool.close()
    runtime.close()
