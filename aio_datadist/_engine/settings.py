"""The options of one ``init``, parsed once (:class:`EngineSettings`)."""

from __future__ import annotations

import os

from aio_datadist.config import (
    DEFAULT_BUSY_POLL_US,
    DEFAULT_COMM_BASE_PORT,
    DEFAULT_SYNC_KV_TIMEOUT_MS,
    MAX_BUSY_POLL_US,
    MAX_UCX_LANES,
    OPTION_BUSY_POLL_US,
    OPTION_COMM_BASE_PORT,
    OPTION_DEVICE_ID,
    OPTION_ENABLE_CACHE_MANAGER,
    OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE,
    OPTION_HOST_MEM_POOL_CONFIG,
    OPTION_LINK_RETRY_COUNT,
    OPTION_LINK_TOTAL_TIME,
    OPTION_LISTEN_IP,
    OPTION_LISTEN_PORT,
    OPTION_LOCAL_COMM_RES,
    OPTION_MEM_POOL_CONFIG,
    OPTION_METRICS,
    OPTION_SAME_HOST,
    OPTION_SESSION_DEVICE_ID,
    OPTION_SHARED_POOLS,
    OPTION_SYNC_KV_TIMEOUT,
    OPTION_TRANSFER_BACKEND,
    OPTION_TRANSPORT,
    OPTION_UCX,
    OPTION_UCX_LANES,
    OPTION_ZERO_ON_ALLOC,
    TRANSFER_BACKEND_HIXL,
    parse_mem_pool_cfg,
    resolve_link_secret,
)
from aio_datadist.status import (
    LLMStatusCode,
    ParamInvalidError,
)

__all__ = ("EngineSettings",)


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
        self.transport = options.get(OPTION_TRANSPORT)
        self.comm_base_port = _int_option(options, OPTION_COMM_BASE_PORT, DEFAULT_COMM_BASE_PORT)
        self.same_host = options.get(OPTION_SAME_HOST, "1") != "0"
        #: Pools in shared memory same-host peers map (``aio.SharedPools``), only where a
        #: same-host peer can be: same-host transfers on, over TCP.
        self.shared_pools = (
            self.same_host
            and (self.transport or "tcp") == "tcp"
            and options.get(OPTION_SHARED_POOLS) != "0"
        )
        #: Zero pool memory before a cache is made of it (``aio.ZeroOnAlloc``).
        self.zero_on_alloc = options.get(OPTION_ZERO_ON_ALLOC) == "1"
        #: Record every transfer for ``stats()`` (``aio.Metrics``, on unless "0").
        self.metrics = options.get(OPTION_METRICS) != "0"
        #: The UCX route for links whose two ends enable it (``aio.Ucx``).
        self.ucx = options.get(OPTION_UCX) == "1"
        #: UCX workers that move one large UCX transfer (``aio.UcxLanes``).
        self.ucx_lanes = _int_option(options, OPTION_UCX_LANES, min(2, os.cpu_count() or 1))
        if not 1 <= self.ucx_lanes <= MAX_UCX_LANES:
            raise ParamInvalidError(
                f"option {OPTION_UCX_LANES}={self.ucx_lanes} is outside [1, {MAX_UCX_LANES}]",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        self.link_secret = resolve_link_secret(options)
        self.busy_poll_us = _int_option(options, OPTION_BUSY_POLL_US, DEFAULT_BUSY_POLL_US)
        if not 0 <= self.busy_poll_us <= MAX_BUSY_POLL_US:
            raise ParamInvalidError(
                f"option {OPTION_BUSY_POLL_US}={self.busy_poll_us} is outside "
                f"[0, {MAX_BUSY_POLL_US}]",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        self.link_total_time_s = _int_option(options, OPTION_LINK_TOTAL_TIME, 0)
        self.link_retry_count = _int_option(options, OPTION_LINK_RETRY_COUNT, 1)
        self.local_comm_res = options.get(OPTION_LOCAL_COMM_RES)
        #: The reference's HIXL engine: one-directional links, no rank-table domains.
        self.hixl = options.get(OPTION_TRANSFER_BACKEND, "").lower() == TRANSFER_BACKEND_HIXL
        ip, port = options.get(OPTION_LISTEN_IP), options.get(OPTION_LISTEN_PORT)
        self.listen: tuple[str, int] | None = None if ip is None else (ip, int(port or 0))


def _int_option(options: dict[str, str], key: str, default: int) -> int:
    value = options.get(key)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ParamInvalidError(
            f"option {key}={value!r} is not an integer",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from None


def _pool_cfg(value: str | None, *, host: bool) -> tuple[int, int] | None:
    return parse_mem_pool_cfg(value, host=host) if value else None
