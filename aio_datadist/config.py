"""``LLMConfig`` (alias ``LlmConfig``), the option-key table, and init-time option parsing.

``LLMConfig.generate_options()`` turns the settings into the ``Dict[str, str]`` that
``LLMDataDist.init`` takes. The engine processes that dict with ``prepare_init_options`` and
reads the memory pools and the listen address with ``parse_mem_pool_cfg`` and
``parse_listen_ip_info``. Every option key lives in the ``OPTION_*`` constants below.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aio_datadist._transport import DEFAULT_BUSY_POLL_US
from aio_datadist._transport.auth import (
    SECRET_ENV,
    LinkSecret,
    decode_secret_option,
    encode_secret_option,
    secret_from_environment,
)
from aio_datadist._validate import check_int, check_type, param_invalid
from aio_datadist.cluster import ip_str_cause, ip_str_to_int
from aio_datadist.enums import LLMRole

__all__ = (
    "LLMConfig",
    "LlmConfig",
    "OPTION_BUF_POOL_CFG",
    "OPTION_CLUSTER_INFO",
    "OPTION_DEPLOY_RES_PATH",
    "OPTION_DEVICE_ID",
    "OPTION_ENABLE_CACHE_MANAGER",
    "OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE",
    "OPTION_ENABLE_SWITCH_ROLE",
    "OPTION_FLOW_GRAPH_MEM_MAX_SIZE",
    "OPTION_GLOBAL_RESOURCE_CONFIG",
    "OPTION_HOST_MEM_POOL_CONFIG",
    "OPTION_KEYS",
    "OPTION_LINK_RETRY_COUNT",
    "OPTION_LINK_SECRET",
    "OPTION_LINK_TOTAL_TIME",
    "OPTION_LISTEN_IP",
    "OPTION_LISTEN_IP_INFO",
    "OPTION_LISTEN_PORT",
    "OPTION_LOCAL_COMM_RES",
    "OPTION_MEMORY_UTILIZATION",
    "OPTION_MEM_POOL_CONFIG",
    "OPTION_OUTPUT_MAX_SIZE",
    "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_RDMA_TRAFFIC_CLASS",
    "OPTION_ROLE",
    "OPTION_SESSION_DEVICE_ID",
    "OPTION_SYNC_KV_TIMEOUT",
    "OPTION_TRANSFER_BACKEND",
    "TRANSFER_BACKEND_HIXL",
    "OPTION_TRANSPORT",
    "OPTION_COMM_BASE_PORT",
    "OPTION_SAME_HOST",
    "OPTION_SHARED_POOLS",
    "OPTION_BUSY_POLL_US",
    "OPTION_METRICS",
    "OPTION_ZERO_ON_ALLOC",
    "OPTION_UCX",
    "OPTION_UCX_LANES",
    "MAX_BUSY_POLL_US",
    "MAX_UCX_LANES",
    "DEFAULT_BUSY_POLL_US",
    "DEFAULT_COMM_BASE_PORT",
    "DEFAULT_MEM_UTILIZATION",
    "DEFAULT_PAGE_SHIFT",
    "DEFAULT_SYNC_KV_TIMEOUT_MS",
    "HOST_MEM_POOL_MAX_BYTES",
    "ROLE_OPTION_VALUES",
    "TRANSPORTS",
    "parse_listen_ip_info",
    "parse_mem_pool_cfg",
    "prepare_init_options",
    "resolve_link_secret",
)

# Option keys of the reference package (spec §5, §7).
OPTION_DEVICE_ID = "ge.exec.deviceId"
OPTION_SESSION_DEVICE_ID = "ge.session_device_id"
OPTION_FLOW_GRAPH_MEM_MAX_SIZE = "ge.flowGraphMemMaxSize"
OPTION_SYNC_KV_TIMEOUT = "llm.SyncKvCacheWaitTime"
OPTION_LISTEN_IP_INFO = "llm.listenIpInfo"
OPTION_LISTEN_IP = "llm.ListenIp"
OPTION_LISTEN_PORT = "llm.ListenPort"
OPTION_ROLE = "llm.Role"
OPTION_ENABLE_CACHE_MANAGER = "llm.EnableCacheManager"
OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE = "llm.EnableRemoteCacheAccessible"
OPTION_MEM_POOL_CONFIG = "llm.MemPoolConfig"
OPTION_HOST_MEM_POOL_CONFIG = "llm.HostMemPoolConfig"
OPTION_RDMA_TRAFFIC_CLASS = "llm.RdmaTrafficClass"
OPTION_RDMA_SERVICE_LEVEL = "llm.RdmaServiceLevel"
OPTION_LOCAL_COMM_RES = "llm.LocalCommRes"
OPTION_LINK_TOTAL_TIME = "llm.LinkTotalTime"
OPTION_LINK_RETRY_COUNT = "llm.LinkRetryCount"
OPTION_TRANSFER_BACKEND = "llm.TransferBackend"
#: The documented ``llm.TransferBackend`` value: the reference's HIXL engine, whose links
#: are one-directional (see ``_engine.links``).
TRANSFER_BACKEND_HIXL = "hixl"
OPTION_GLOBAL_RESOURCE_CONFIG = "llm.GlobalResourceConfig"
OPTION_ENABLE_SWITCH_ROLE = "llm.EnableSwitchRole"
OPTION_DEPLOY_RES_PATH = "llm.deployResPath"
OPTION_BUF_POOL_CFG = "llm.BufPoolCfg"
OPTION_OUTPUT_MAX_SIZE = "llm.OutputMaxSize"
OPTION_MEMORY_UTILIZATION = "llm.MemoryUtilization"
OPTION_CLUSTER_INFO = "llm.ClusterInfo"
# aio_datadist's own choice of transport. Deliberately not llm.TransferBackend, which keeps
# the reference's meaning.
OPTION_TRANSPORT = "aio.Transport"
#: First port of rank-table endpoints for ``link`` (aio_datadist's own option).
OPTION_COMM_BASE_PORT = "aio.CommBasePort"
#: "1" (default) or "0": one-sided transfers with linked processes on this host.
OPTION_SAME_HOST = "aio.SameHost"
#: "1" (default) or "0": the host runtime's pools in shared memory a same-host peer maps
#: (only while same-host transfers are on); "0" keeps them private, on huge pages where the
#: kernel gives them, and same-host peers copy them through the kernel.
OPTION_SHARED_POOLS = "aio.SharedPools"
#: The shared secret that authenticates links (``hex:`` and hex digits for raw bytes).
OPTION_LINK_SECRET = "aio.LinkSecret"
#: Microseconds a TCP link busy-polls for an expected frame before sleeping (0: never).
OPTION_BUSY_POLL_US = "aio.BusyPollUs"
#: "1" or "0" (default): zero every cache's memory when the pool hands it out.
OPTION_ZERO_ON_ALLOC = "aio.ZeroOnAlloc"
#: "1" (default) or "0": record metrics per transfer (``stats()``).
OPTION_METRICS = "aio.Metrics"
#: "1" or "0" (default): the UCX route (UCP RMA) for links whose two ends enable it.
OPTION_UCX = "aio.Ucx"
#: How many UCX workers, each progressed by its own thread, move one large UCX transfer.
OPTION_UCX_LANES = "aio.UcxLanes"

OPTION_KEYS: Mapping[str, str] = {
    "device_id": OPTION_DEVICE_ID,
    "sync_kv_timeout": OPTION_SYNC_KV_TIMEOUT,
    "listen_ip_info": OPTION_LISTEN_IP_INFO,
    "enable_cache_manager": OPTION_ENABLE_CACHE_MANAGER,
    "enable_remote_cache_accessible": OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE,
    "mem_pool_cfg": OPTION_MEM_POOL_CONFIG,
    "host_mem_pool_cfg": OPTION_HOST_MEM_POOL_CONFIG,
    "rdma_traffic_class": OPTION_RDMA_TRAFFIC_CLASS,
    "rdma_service_level": OPTION_RDMA_SERVICE_LEVEL,
    "local_comm_res": OPTION_LOCAL_COMM_RES,
    "link_total_time": OPTION_LINK_TOTAL_TIME,
    "link_retry_count": OPTION_LINK_RETRY_COUNT,
    "transfer_backend": OPTION_TRANSFER_BACKEND,
    "global_resource_config": OPTION_GLOBAL_RESOURCE_CONFIG,
    "enable_switch_role": OPTION_ENABLE_SWITCH_ROLE,
    "deploy_res_path": OPTION_DEPLOY_RES_PATH,
    "buf_pool_cfg": OPTION_BUF_POOL_CFG,
    "output_max_size": OPTION_OUTPUT_MAX_SIZE,
    "mem_utilization": OPTION_MEMORY_UTILIZATION,
    "cluster_info": OPTION_CLUSTER_INFO,
    "transport": OPTION_TRANSPORT,
    "same_host": OPTION_SAME_HOST,
    "link_secret": OPTION_LINK_SECRET,
    "busy_poll_us": OPTION_BUSY_POLL_US,
    "zero_on_alloc": OPTION_ZERO_ON_ALLOC,
    "metrics": OPTION_METRICS,
    "ucx": OPTION_UCX,
    "ucx_lanes": OPTION_UCX_LANES,
}
"""LLMConfig property name -> the option key it writes (``device_id`` also writes
``OPTION_SESSION_DEVICE_ID``)."""

ROLE_OPTION_VALUES: Mapping[LLMRole, str] = {
    LLMRole.PROMPT: "Prompt",
    LLMRole.DECODER: "Decoder",
    LLMRole.MIX: "Mix",
}
"""The ``llm.Role`` value written at init for each role."""

TRANSPORTS: tuple[str, ...] = ("tcp", "loopback")
"""Accepted values of ``LLMConfig.transport`` / ``aio.Transport``."""

DEFAULT_SYNC_KV_TIMEOUT_MS = 1000
"""Bound of blocking transfer calls when ``llm.SyncKvCacheWaitTime`` is not set (ms)."""
DEFAULT_MEM_UTILIZATION = 0.95
DEFAULT_COMM_BASE_PORT = 27000
"""First port of rank endpoints when the rank table gives none (``aio.CommBasePort``)."""
MAX_BUSY_POLL_US = 100_000
"""Largest accepted ``aio.BusyPollUs`` (microseconds)."""
MAX_UCX_LANES = 8
"""Largest accepted ``aio.UcxLanes``."""
DEFAULT_PAGE_SHIFT = 16
"""Pool allocation granularity is ``1 << page_shift`` bytes when the pool config omits it."""
HOST_MEM_POOL_MAX_BYTES = 20 * 2**30
"""Largest host memory pool accepted (20 GiB)."""

_PAGE_SHIFT_RANGE = range(10, 31)


def _bool_opt(value: bool) -> str:
    return "1" if value else "0"


def _check_optional(name: str, value: Any, *types: type) -> None:
    # The reference's type checks let None through for these settings; None then behaves as
    # "not set". Keep that, so ``cfg.x = None`` resets a setting instead of failing.
    check_type(name, value, *types, allow_none=True)


class LLMConfig:
    """Builder of the ``LLMDataDist.init`` options dict; every setting is a validating property.

    ``generate_options()`` (same as ``gen_options()``) writes the settings into ``self.options``
    cumulatively and returns that same dict: ``ge_options`` first, then the key of every
    setting that was set. ``llm.MemoryUtilization`` (default ``"0.95"``) is always present.

    Setters raise ``TypeError`` for a wrong type, ``ValueError`` for an int outside its C range
    and ``LLMException(LLM_PARAM_INVALID)`` for other invalid values. For the str and bool
    settings, assigning ``None`` resets the setting to "not set".
    """

    __slots__ = (
        "_buf_pool_cfg",
        "_busy_poll_us",
        "_cluster_info",
        "_deploy_res_path",
        "_device_id",
        "_enable_cache_manager",
        "_enable_remote_cache_accessible",
        "_enable_switch_role",
        "_ge_options",
        "_global_resource_config",
        "_host_mem_pool_cfg",
        "_link_retry_count",
        "_link_secret",
        "_link_total_time",
        "_listen_ip_info",
        "_local_comm_res",
        "_mem_pool_cfg",
        "_mem_utilization",
        "_metrics",
        "_options",
        "_output_max_size",
        "_rdma_service_level",
        "_rdma_traffic_class",
        "_same_host",
        "_sync_kv_timeout",
        "_transfer_backend",
        "_transport",
        "_ucx",
        "_ucx_lanes",
        "_zero_on_alloc",
    )

    def __init__(self) -> None:
        self._options: dict[str, str] = {}
        self._ge_options: dict[str, str] = {}
        self._device_id: int | list[int] | tuple[int, ...] | None = None
        self._sync_kv_timeout: int | str | None = None
        self._listen_ip_info: str = ""
        self._enable_cache_manager: bool | None = None
        self._enable_remote_cache_accessible: bool | None = None
        self._mem_pool_cfg: str = ""
        self._host_mem_pool_cfg: str = ""
        self._rdma_traffic_class: int | None = None
        self._rdma_service_level: int | None = None
        self._local_comm_res: str | None = None
        self._link_total_time: int | None = None
        self._link_retry_count: int | None = None
        self._transfer_backend: str | None = None
        self._global_resource_config: str | None = None
        self._enable_switch_role: bool = False
        self._deploy_res_path: str = ""
        self._buf_pool_cfg: str = ""
        self._output_max_size: int | None = None
        self._mem_utilization: float = DEFAULT_MEM_UTILIZATION
        self._cluster_info: str = ""
        self._transport: str | None = None
        self._same_host: bool | None = None
        self._link_secret: str | bytes | None = None
        self._busy_poll_us: int | None = None
        self._zero_on_alloc: bool | None = None
        self._metrics: bool | None = None
        self._ucx: bool | None = None
        self._ucx_lanes: int | None = None

    # -- building the options -------------------------------------------------------------

    def generate_options(self) -> dict[str, str]:
        """Write the settings into ``self.options`` and return it (the same dict every call)."""
        return self.gen_options()

    def gen_options(self) -> dict[str, str]:
        """Same as ``generate_options()``."""
        opts = self._options
        if self._ge_options:
            opts.update(self._ge_options)
        device_id = self._device_id
        if device_id is not None:
            if isinstance(device_id, int):
                opts[OPTION_DEVICE_ID] = str(device_id)
                opts[OPTION_SESSION_DEVICE_ID] = str(device_id)
            else:
                opts[OPTION_SESSION_DEVICE_ID] = str(device_id[0])
                opts[OPTION_DEVICE_ID] = ";".join(str(d) for d in device_id)
        if self._sync_kv_timeout is not None:
            opts[OPTION_SYNC_KV_TIMEOUT] = str(self._sync_kv_timeout)
        if self._deploy_res_path:
            opts[OPTION_DEPLOY_RES_PATH] = self._deploy_res_path
        if self._buf_pool_cfg:
            opts[OPTION_BUF_POOL_CFG] = self._buf_pool_cfg
        if self._mem_pool_cfg:
            opts[OPTION_MEM_POOL_CONFIG] = self._mem_pool_cfg
        if self._host_mem_pool_cfg:
            opts[OPTION_HOST_MEM_POOL_CONFIG] = self._host_mem_pool_cfg
        if self._enable_cache_manager is not None:
            opts[OPTION_ENABLE_CACHE_MANAGER] = _bool_opt(self._enable_cache_manager)
        if self._enable_remote_cache_accessible is not None:
            opts[OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE] = _bool_opt(
                self._enable_remote_cache_accessible
            )
        if self._listen_ip_info:
            opts[OPTION_LISTEN_IP_INFO] = self._listen_ip_info
        if self._link_total_time is not None:
            opts[OPTION_LINK_TOTAL_TIME] = str(self._link_total_time)
        if self._link_retry_count is not None:
            opts[OPTION_LINK_RETRY_COUNT] = str(self._link_retry_count)
        if self._rdma_traffic_class is not None:
            opts[OPTION_RDMA_TRAFFIC_CLASS] = str(self._rdma_traffic_class)
        if self._rdma_service_level is not None:
            opts[OPTION_RDMA_SERVICE_LEVEL] = str(self._rdma_service_level)
        if self._local_comm_res is not None:
            # Written even when "": an empty local_comm_res still switches init defaults on.
            opts[OPTION_LOCAL_COMM_RES] = self._local_comm_res
        if self._transfer_backend is not None:
            opts[OPTION_TRANSFER_BACKEND] = self._transfer_backend
        if self._global_resource_config is not None:
            opts[OPTION_GLOBAL_RESOURCE_CONFIG] = self._global_resource_config
        if self._cluster_info:
            opts[OPTION_CLUSTER_INFO] = self._cluster_info
        if self._output_max_size is not None:
            opts[OPTION_OUTPUT_MAX_SIZE] = str(self._output_max_size)
        if self._enable_switch_role:
            opts[OPTION_ENABLE_SWITCH_ROLE] = "1"
        opts[OPTION_MEMORY_UTILIZATION] = str(self._mem_utilization)
        if self._transport is not None:
            opts[OPTION_TRANSPORT] = self._transport
        if self._same_host is not None:
            opts[OPTION_SAME_HOST] = "1" if self._same_host else "0"
        if self._link_secret is not None:
            opts[OPTION_LINK_SECRET] = encode_secret_option(self._link_secret)
        if self._busy_poll_us is not None:
            opts[OPTION_BUSY_POLL_US] = str(self._busy_poll_us)
        if self._zero_on_alloc is not None:
            opts[OPTION_ZERO_ON_ALLOC] = _bool_opt(self._zero_on_alloc)
        if self._metrics is not None:
            opts[OPTION_METRICS] = _bool_opt(self._metrics)
        if self._ucx is not None:
            opts[OPTION_UCX] = _bool_opt(self._ucx)
        if self._ucx_lanes is not None:
            opts[OPTION_UCX_LANES] = str(self._ucx_lanes)
        return opts

    @property
    def options(self) -> dict[str, str]:
        """The dict filled by ``generate_options()`` (empty before the first call)."""
        return self._options

    # -- settings -------------------------------------------------------------------------

    @property
    def ge_options(self) -> dict[str, str]:
        """Extra options merged first into the result, e.g. ``ge.flowGraphMemMaxSize``."""
        return self._ge_options

    @ge_options.setter
    def ge_options(self, ge_options: dict[str, str]) -> None:
        check_type("ge_options", ge_options, dict)
        for key, value in ge_options.items():
            check_type("ge_options key", key, str)
            check_type("ge_options value", value, str)
        self._ge_options = dict(ge_options)

    @property
    def device_id(self) -> int | list[int] | tuple[int, ...] | None:
        """Device id (int >= 0, int32) or list/tuple of them; None until set. Needed for init."""
        return self._device_id

    @device_id.setter
    def device_id(self, device_id: int | list[int] | tuple[int, ...]) -> None:
        check_type("device_id", device_id, list, tuple, int)
        ids = [device_id] if isinstance(device_id, int) else list(device_id)
        if not ids:
            param_invalid("device_id list must not be empty.")
        # Same order as the reference: all types, then signs, then the int32 range.
        for dev_id in ids:
            check_type("device_id", dev_id, int)
        if any(dev_id < 0 for dev_id in ids):
            param_invalid("device_id should be greater than or equal to zero.")
        for dev_id in ids:
            check_int("device_id", dev_id, "int32")
        if isinstance(device_id, int):
            self._device_id = device_id
        else:
            self._device_id = tuple(ids) if isinstance(device_id, tuple) else ids

    @property
    def sync_kv_timeout(self) -> int | str | None:
        """Bound of ``pull_*``/``push_*`` in ms (int or digit str, > 0, int32); None: 1000 ms."""
        return self._sync_kv_timeout

    @sync_kv_timeout.setter
    def sync_kv_timeout(self, sync_kv_timeout: int | str) -> None:
        check_type("sync_kv_timeout", sync_kv_timeout, int, str)
        if isinstance(sync_kv_timeout, str) and not (
            sync_kv_timeout.isascii() and sync_kv_timeout.isdigit()
        ):
            param_invalid(f"sync_kv_timeout must be digit, but got {sync_kv_timeout!r}.")
        value = int(sync_kv_timeout)
        if value <= 0:
            param_invalid(f"sync_kv_timeout should be greater than zero, but got {value}.")
        check_int("sync_kv_timeout", value, "int32")
        self._sync_kv_timeout = sync_kv_timeout

    @property
    def listen_ip_info(self) -> str:
        """Host ``"ip:port"`` to listen on; makes this endpoint a server. "" when not set.

        Any str is stored; ``init`` (and ``switch_role``) then need an IPv4 address for the
        ip and refuse a host name such as ``localhost`` with ``LLM_PARAM_INVALID``.
        """
        return self._listen_ip_info

    @listen_ip_info.setter
    def listen_ip_info(self, listen_ip_info: str | None) -> None:
        _check_optional("listen_ip_info", listen_ip_info, str)
        self._listen_ip_info = listen_ip_info or ""

    @property
    def enable_cache_manager(self) -> bool:
        """CacheManager (v2) mode; must be True for the v2 API. False when not set."""
        return bool(self._enable_cache_manager)

    @enable_cache_manager.setter
    def enable_cache_manager(self, enable_cache_manager: bool | None) -> None:
        _check_optional("enable_cache_manager", enable_cache_manager, bool)
        self._enable_cache_manager = enable_cache_manager

    @property
    def enable_remote_cache_accessible(self) -> bool:
        """Cache the peer's cache table at the first pull; one-sided transfers. Default False."""
        return bool(self._enable_remote_cache_accessible)

    @enable_remote_cache_accessible.setter
    def enable_remote_cache_accessible(self, enable_remote_cache_accessible: bool | None) -> None:
        _check_optional("enable_remote_cache_accessible", enable_remote_cache_accessible, bool)
        self._enable_remote_cache_accessible = enable_remote_cache_accessible

    @property
    def mem_pool_cfg(self) -> str:
        """Device pool JSON ``{"memory_size": bytes, "page_shift": n}``; written if non-empty."""
        return self._mem_pool_cfg

    @mem_pool_cfg.setter
    def mem_pool_cfg(self, mem_pool_cfg: str | None) -> None:
        _check_optional("mem_pool_cfg", mem_pool_cfg, str)
        self._mem_pool_cfg = mem_pool_cfg or ""

    @property
    def host_mem_pool_cfg(self) -> str:
        """Host pool JSON, same format as ``mem_pool_cfg``, at most 20 GiB; written if non-empty."""
        return self._host_mem_pool_cfg

    @host_mem_pool_cfg.setter
    def host_mem_pool_cfg(self, host_mem_pool_cfg: str | None) -> None:
        _check_optional("host_mem_pool_cfg", host_mem_pool_cfg, str)
        self._host_mem_pool_cfg = host_mem_pool_cfg or ""

    @property
    def rdma_traffic_class(self) -> int | None:
        """RDMA traffic class (uint32; docs: [0, 255], multiple of 4). None until set."""
        return self._rdma_traffic_class

    @rdma_traffic_class.setter
    def rdma_traffic_class(self, rdma_traffic_class: int) -> None:
        check_int("rdma_traffic_class", rdma_traffic_class, "uint32")
        self._rdma_traffic_class = rdma_traffic_class

    @property
    def rdma_service_level(self) -> int | None:
        """RDMA service level (uint32; docs: [0, 7]). None until set."""
        return self._rdma_service_level

    @rdma_service_level.setter
    def rdma_service_level(self, rdma_service_level: int) -> None:
        check_int("rdma_service_level", rdma_service_level, "uint32")
        self._rdma_service_level = rdma_service_level

    @property
    def local_comm_res(self) -> str:
        """Local communication resources (JSON or ""); once set, written even when ""."""
        return "" if self._local_comm_res is None else self._local_comm_res

    @local_comm_res.setter
    def local_comm_res(self, local_comm_res: str | None) -> None:
        _check_optional("local_comm_res", local_comm_res, str)
        self._local_comm_res = local_comm_res

    @property
    def link_total_time(self) -> int:
        """Total link timeout in seconds, [0, 2**32-1]; 0 (default) defers to the environment."""
        return 0 if self._link_total_time is None else self._link_total_time

    @link_total_time.setter
    def link_total_time(self, link_total_time: int) -> None:
        check_type("link_total_time", link_total_time, int)
        if not 0 <= link_total_time <= 2**32 - 1:
            param_invalid(
                "link_total_time should be an integer between [0, 2^32-1], "
                f"given value is {link_total_time}"
            )
        self._link_total_time = link_total_time

    @property
    def link_retry_count(self) -> int:
        """Link retries within ``link_total_time``, [1, 100]; default 1."""
        return 1 if self._link_retry_count is None else self._link_retry_count

    @link_retry_count.setter
    def link_retry_count(self, link_retry_count: int) -> None:
        check_type("link_retry_count", link_retry_count, int)
        if not 1 <= link_retry_count <= 100:
            param_invalid(
                "link_retry_count should be an integer between [1, 100], "
                f"given value is {link_retry_count}"
            )
        self._link_retry_count = link_retry_count

    @property
    def transfer_backend(self) -> str:
        """Reference transfer backend (documented value: ``"hixl"``); "" when not set."""
        return "" if self._transfer_backend is None else self._transfer_backend

    @transfer_backend.setter
    def transfer_backend(self, transfer_backend: str | None) -> None:
        _check_optional("transfer_backend", transfer_backend, str)
        self._transfer_backend = transfer_backend

    @property
    def global_resource_config(self) -> str:
        """HIXL global resource JSON, passed through; written whenever set, even ""."""
        return "" if self._global_resource_config is None else self._global_resource_config

    @global_resource_config.setter
    def global_resource_config(self, global_resource_config: str | None) -> None:
        _check_optional("global_resource_config", global_resource_config, str)
        self._global_resource_config = global_resource_config

    @property
    def enable_switch_role(self) -> bool:
        """Allow ``switch_role`` (v1 mode); writes ``llm.EnableSwitchRole = "1"`` only when True."""
        return self._enable_switch_role

    @enable_switch_role.setter
    def enable_switch_role(self, enable_switch_role: bool | None) -> None:
        _check_optional("enable_switch_role", enable_switch_role, bool)
        self._enable_switch_role = bool(enable_switch_role)

    @property
    def deploy_res_path(self) -> str:
        """Deployment resource path (v1/offline); written if non-empty."""
        return self._deploy_res_path

    @deploy_res_path.setter
    def deploy_res_path(self, deploy_res_path: str | None) -> None:
        _check_optional("deploy_res_path", deploy_res_path, str)
        self._deploy_res_path = deploy_res_path or ""

    @property
    def buf_pool_cfg(self) -> str:
        """Buffer pool config (v1/offline); written if non-empty."""
        return self._buf_pool_cfg

    @buf_pool_cfg.setter
    def buf_pool_cfg(self, buf_pool_cfg: str | None) -> None:
        _check_optional("buf_pool_cfg", buf_pool_cfg, str)
        self._buf_pool_cfg = buf_pool_cfg or ""

    @property
    def output_max_size(self) -> int | None:
        """Output size limit (v1/offline); None until set."""
        return self._output_max_size

    @output_max_size.setter
    def output_max_size(self, output_max_size: int | None) -> None:
        _check_optional("output_max_size", output_max_size, int)
        self._output_max_size = output_max_size

    @property
    def mem_utilization(self) -> float:
        """Memory utilisation ratio in [0, 1] (float only); default 0.95, always written."""
        return self._mem_utilization

    @mem_utilization.setter
    def mem_utilization(self, mem_utilization: float) -> None:
        check_type("mem_utilization", mem_utilization, float)
        if not 0.0 <= mem_utilization <= 1.0:  # NaN fails this too
            param_invalid(f"mem_utilization must be in range [0,1], current:{mem_utilization}")
        self._mem_utilization = mem_utilization

    @property
    def cluster_info(self) -> str:
        """Cluster JSON (v1/offline) with ``listen_ip_info[].ip`` converted to ints; "" unset."""
        return self._cluster_info

    @cluster_info.setter
    def cluster_info(self, cluster_info: str) -> None:
        check_type("cluster_info", cluster_info, str)
        try:
            parsed = json.loads(cluster_info)
        except ValueError as exc:
            param_invalid(f"cluster_info is not valid JSON: {exc}")
        if not isinstance(parsed, dict):
            param_invalid("cluster_info must be a JSON object.")
        entries = parsed.get("listen_ip_info")
        if entries is not None:
            if not isinstance(entries, list) or not all(
                isinstance(e, dict) and "ip" in e for e in entries
            ):
                param_invalid("cluster_info listen_ip_info must be a list of objects with 'ip'.")
            for entry in entries:
                entry["ip"] = ip_str_to_int(entry["ip"])
        self._cluster_info = json.dumps(parsed)

    @property
    def transport(self) -> str | None:
        """aio_datadist's transport, ``"tcp"`` or ``"loopback"`` (key ``aio.Transport``).

        None (the default) lets the engine choose. Not part of the reference API.
        """
        return self._transport

    @transport.setter
    def transport(self, transport: str | None) -> None:
        _check_optional("transport", transport, str)
        if transport is not None and transport not in TRANSPORTS:
            param_invalid(f"transport must be one of {list(TRANSPORTS)}, but got {transport!r}.")
        self._transport = transport

    @property
    def same_host(self) -> bool | None:
        """One-sided transfers with linked processes on this host (key ``aio.SameHost``).

        With TCP links between two processes of one host, pulls and pushes of host-memory
        caches read and write the peer's published caches directly (``process_vm_readv`` /
        ``process_vm_writev``) instead of streaming them through the socket. None (the
        default) means on; False keeps every transfer on the link. Not part of the
        reference API.
        """
        return self._same_host

    @same_host.setter
    def same_host(self, same_host: bool | None) -> None:
        _check_optional("same_host", same_host, bool)
        self._same_host = same_host

    @property
    def busy_poll_us(self) -> int | None:
        """Microseconds a TCP link or the UCX route busy-polls for what it expects (key
        ``aio.BusyPollUs``).

        A blocking transfer call reads its own answer: it polls the socket (or progresses
        the UCX worker) without sleeping for up to this long before it sleeps, and a link's
        reader thread (the UCX progress thread) polls as long after each frame (each
        transfer of a peer's it served) for the next. An awaited call of one small request
        polls on the event loop the same way while nothing else is ready to run there. That
        saves the thread wake-ups that dominate a small transfer's latency, for at most this
        much CPU time per wait. None (the default) means ``DEFAULT_BUSY_POLL_US``; 0 turns
        busy polling off. Not part of the reference API.
        """
        return self._busy_poll_us

    @busy_poll_us.setter
    def busy_poll_us(self, busy_poll_us: int | None) -> None:
        _check_optional("busy_poll_us", busy_poll_us, int)
        if busy_poll_us is not None and not 0 <= busy_poll_us <= MAX_BUSY_POLL_US:
            param_invalid(
                f"busy_poll_us must be in [0, {MAX_BUSY_POLL_US}], but got {busy_poll_us}."
            )
        self._busy_poll_us = busy_poll_us

    @property
    def zero_on_alloc(self) -> bool | None:
        """Zero every cache's memory when it is allocated (key ``aio.ZeroOnAlloc``).

        Pool memory is reused: without this, a cache allocated where an earlier cache lived
        holds that cache's bytes until it is written, and a linked peer that reads it first
        (a pull, or a same-host one-sided read) sees them. True zeroes host and device pool
        memory of ``allocate_cache`` and ``allocate_blocks_cache`` before the cache exists
        for anyone, at a cost that grows with the cache (``docs/benchmarks.md``); registered
        memory is the caller's and is never touched. None (the default) and False mean
        off. Not part of the reference API.
        """
        return self._zero_on_alloc

    @zero_on_alloc.setter
    def zero_on_alloc(self, zero_on_alloc: bool | None) -> None:
        _check_optional("zero_on_alloc", zero_on_alloc, bool)
        self._zero_on_alloc = zero_on_alloc

    @property
    def metrics(self) -> bool | None:
        """Record route, op, peer, bytes, duration and status of every transfer, for
        ``stats()`` and the Prometheus exporter (key ``aio.Metrics``). None (the default)
        and True mean on; False records nothing (``stats()`` then has no transfers). Not
        part of the reference API.
        """
        return self._metrics

    @metrics.setter
    def metrics(self, metrics: bool | None) -> None:
        _check_optional("metrics", metrics, bool)
        self._metrics = metrics

    @property
    def ucx(self) -> bool | None:
        """The UCX route for transfers (key ``aio.Ucx``, ``"1"``/``"0"``).

        With True, links whose two ends enable it move the bytes of pulls and pushes by
        blocks key, cache id and batch index, or address with UCP RMA (``ucp_get_nbx`` /
        ``ucp_put_nbx``) between memory both sides registered with UCX; the link keeps its
        handshake, authentication, requests by cache key and refusals. ``init`` then needs
        libucp (``pip install 'aio_datadist[ucx]'``, or ``AIO_DATADIST_UCX=/path/libucp.so``
        for a system UCX, as RDMA needs) and fails with ``LLM_FEATURE_NOT_ENABLED`` saying
        why when it cannot be loaded. None (the default) and False mean off. Not part of the
        reference API.
        """
        return self._ucx

    @ucx.setter
    def ucx(self, ucx: bool | None) -> None:
        _check_optional("ucx", ucx, bool)
        self._ucx = ucx

    @property
    def ucx_lanes(self) -> int | None:
        """How many UCX workers move one large transfer of the UCX route (key
        ``aio.UcxLanes``, 1 to ``MAX_UCX_LANES``).

        The UCX route's own worker moves every transfer; each further lane is a worker
        progressed by a thread of its own. A transfer of host memory of 1 MiB or more
        through one of UCX's cross-memory transports (``cma``, ``knem``, ``xpmem``: the
        initiator's CPU copies the bytes) is cut into one part per lane, so that its bytes
        move on as many cores; over other transports one worker moves it. None (the default) means
        2 where the machine has two or more CPUs, else 1; 1 keeps every transfer on one
        worker. Used only with ``ucx``. Not part of the reference API.
        """
        return self._ucx_lanes

    @ucx_lanes.setter
    def ucx_lanes(self, ucx_lanes: int | None) -> None:
        _check_optional("ucx_lanes", ucx_lanes, int)
        if ucx_lanes is not None and not 1 <= ucx_lanes <= MAX_UCX_LANES:
            param_invalid(f"ucx_lanes must be in [1, {MAX_UCX_LANES}], but got {ucx_lanes}.")
        self._ucx_lanes = ucx_lanes

    @property
    def link_secret(self) -> str | bytes | None:
        """The shared secret that authenticates links (key ``aio.LinkSecret``).

        str (used as UTF-8) or bytes, not empty. Engines linked to each other must all have
        the same secret, or all none: a link between a pair that differs is refused with
        ``LLM_LINK_FAILED`` on both sides. Each side proves that it knows the secret with
        HMAC-SHA256 over fresh nonces; the secret itself never travels and never appears in
        a repr or a log line (the options dict does carry it, spelled ``hex:...`` for
        bytes). None (the default) takes the environment variable
        ``AIO_DATADIST_LINK_SECRET`` when it is set, else links are not authenticated. Not
        part of the reference API.

        :raises TypeError: not str, bytes or None.
        :raises ValueError: empty.
        """
        return self._link_secret

    @link_secret.setter
    def link_secret(self, link_secret: str | bytes | None) -> None:
        _check_optional("link_secret", link_secret, str, bytes)
        if link_secret is not None:
            LinkSecret(link_secret)  # refuses an empty secret
        self._link_secret = link_secret

    def __repr__(self) -> str:
        # Only the settings that differ from a fresh config; self.options is left out and
        # the link secret is never shown.
        changed = ", ".join(
            f"{slot[1:]}={'<hidden>' if slot == '_link_secret' else repr(getattr(self, slot))}"
            for slot in self.__slots__
            if slot != "_options" and getattr(self, slot) != getattr(_DEFAULT_CONFIG, slot)
        )
        return f"LLMConfig({changed})"


_DEFAULT_CONFIG = LLMConfig()

LlmConfig = LLMConfig


# -- init-time parsing --------------------------------------------------------------------


def parse_listen_ip_info(value: str) -> tuple[str, int]:
    """Split a listen address ``"ip:port"`` into ``(ip, port)``.

    The ip must be an IPv4 address, as ``LLMClusterInfo.append_*_ip_info`` takes it: a host
    name such as ``localhost`` is refused here, in the same words.

    Raises ``TypeError`` for a non-str, ``LLMException(LLM_PARAM_INVALID)`` when the value is
    not two ``:``-separated parts, the ip is empty or not an IPv4 address, ``ValueError`` when
    the port is not a decimal integer in uint16.
    """
    check_type("listen_ip_info", value, str)
    parts = value.split(":")
    if len(parts) != 2:
        param_invalid(f'llm.listenIpInfo "{value}" is invalid, format should be "ip:port"')
    ip, port_text = parts
    if not ip:
        param_invalid(f'llm.listenIpInfo "{value}" is invalid, the ip is empty')
    try:
        ip_str_to_int(ip)
    except RuntimeError:
        param_invalid(f'llm.listenIpInfo "{value}" is invalid: {ip_str_cause(ip)}')
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f'llm.listenIpInfo "{value}" is invalid, port must be a decimal integer')
    port = int(port_text)
    check_int("listen port", port, "uint16")
    return ip, port


def resolve_link_secret(options: Mapping[str, str]) -> LinkSecret | None:
    """The link secret of ``aio.LinkSecret``, else of ``AIO_DATADIST_LINK_SECRET``; or None.

    Raises ``LLMException(LLM_PARAM_INVALID)`` for an empty or malformed value (the message
    never shows the value).
    """
    text = options.get(OPTION_LINK_SECRET)
    source = OPTION_LINK_SECRET if text is not None else SECRET_ENV
    try:
        return decode_secret_option(text) if text is not None else secret_from_environment()
    except (TypeError, ValueError) as exc:
        param_invalid(f"{source} is not a valid link secret: {exc}")


def parse_mem_pool_cfg(value: str, *, host: bool) -> tuple[int, int]:
    """Parse a pool config JSON into ``(memory_size, page_shift)``.

    ``memory_size`` is a required positive int (bytes); ``page_shift`` an optional int in
    [10, 31), default 16. Other keys are ignored. A host pool (``host=True``) may hold at most
    20 GiB. Raises ``TypeError`` for a non-str and ``LLMException(LLM_PARAM_INVALID)`` for
    anything else that is wrong.
    """
    name = "host_mem_pool_cfg" if host else "mem_pool_cfg"
    check_type(name, value, str)
    try:
        cfg = json.loads(value)
    except ValueError as exc:
        param_invalid(f"{name} is not valid JSON ({exc}): {value!r}")
    if not isinstance(cfg, dict):
        param_invalid(f"{name} must be a JSON object, but got {value!r}")
    if "memory_size" not in cfg:
        param_invalid(f"{name} lacks the required memory_size: {value!r}")
    memory_size = cfg["memory_size"]
    if not _is_json_int(memory_size) or memory_size <= 0:
        param_invalid(f"{name} memory_size must be a positive integer, but got {memory_size!r}")
    if memory_size > 2**63 - 1:
        param_invalid(f"{name} memory_size {memory_size} does not fit in int64")
    if host and memory_size > HOST_MEM_POOL_MAX_BYTES:
        param_invalid(
            f"{name} memory_size {memory_size} exceeds the host pool limit of "
            f"{HOST_MEM_POOL_MAX_BYTES} bytes (20 GiB)"
        )
    page_shift = cfg.get("page_shift", DEFAULT_PAGE_SHIFT)
    if not _is_json_int(page_shift) or page_shift not in _PAGE_SHIFT_RANGE:
        param_invalid(f"{name} page_shift must be an integer in [10, 31), but got {page_shift!r}")
    return memory_size, page_shift


def _is_json_int(value: Any) -> bool:
    # JSON true/false decode to bool, which must not count as 0/1.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_flow_graph_mem_max_size(options: Mapping[str, Any]) -> None:
    value = options.get(OPTION_FLOW_GRAPH_MEM_MAX_SIZE)
    if value is None:
        return
    check_type(OPTION_FLOW_GRAPH_MEM_MAX_SIZE, value, str)
    if len(value.split(",")) != 1:
        param_invalid(f"{OPTION_FLOW_GRAPH_MEM_MAX_SIZE} only support one mem pool in llm datadist")
    if not (value.isascii() and value.isdigit()):
        param_invalid(f"{OPTION_FLOW_GRAPH_MEM_MAX_SIZE} must be digit, config value={value}")


def prepare_init_options(options: dict[str, str], role: LLMRole) -> dict[str, str]:
    """Return the processed copy of ``options`` that ``init`` works on (spec §7).

    Adds ``llm.Role``; turns ``llm.EnableCacheManager`` and ``llm.EnableRemoteCacheAccessible``
    on when ``llm.LocalCommRes`` is present and they are absent; applies the
    ``llm.TransferBackend`` rules; in CacheManager mode splits ``llm.listenIpInfo`` into
    ``llm.ListenIp`` / ``llm.ListenPort``. ``options`` itself is not changed.

    Raises ``TypeError`` when ``options`` is not a dict of str to str or ``role`` is not an
    ``LLMRole``; ``ValueError`` for a bad listen port; ``LLMException(LLM_PARAM_INVALID)`` for
    a bad ``ge.flowGraphMemMaxSize``, ``llm.LocalCommRes`` or ``llm.TransferBackend`` outside
    CacheManager mode, ``llm.TransferBackend`` without remote cache access or
    ``llm.listenIpInfo``, a malformed ``llm.listenIpInfo`` (a host name instead of an IPv4
    address included), an unknown ``aio.Transport`` or an ``aio.ZeroOnAlloc`` or
    ``aio.Metrics`` other than ``"1"`` / ``"0"``.
    """
    check_type("options", options, dict)
    check_type("role", role, LLMRole)
    for key, value in options.items():
        check_type("options key", key, str)
        check_type(f"options[{key!r}]", value, str)
    _check_flow_graph_mem_max_size(options)

    result = dict(options)
    result[OPTION_ROLE] = ROLE_OPTION_VALUES[role]
    has_local_comm_res = OPTION_LOCAL_COMM_RES in options
    if has_local_comm_res:
        result.setdefault(OPTION_ENABLE_CACHE_MANAGER, "1")
        result.setdefault(OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE, "1")
    cache_manager_mode = result.get(OPTION_ENABLE_CACHE_MANAGER) == "1"
    if has_local_comm_res and not cache_manager_mode:
        param_invalid(
            f"{OPTION_LOCAL_COMM_RES} is not supported when "
            f"{OPTION_ENABLE_CACHE_MANAGER} is not configured."
        )
    if OPTION_TRANSFER_BACKEND in options:
        backend = options[OPTION_TRANSFER_BACKEND]
        if backend and backend.lower() != TRANSFER_BACKEND_HIXL:
            param_invalid(
                f"{OPTION_TRANSFER_BACKEND}={backend!r} is not supported; the documented "
                f"value is {TRANSFER_BACKEND_HIXL!r}"
            )
        if not cache_manager_mode:
            param_invalid(
                f"{OPTION_TRANSFER_BACKEND} is not supported when "
                f"{OPTION_ENABLE_CACHE_MANAGER} is not configured."
            )
        result.setdefault(OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE, "1")
        if result[OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE] != "1":
            param_invalid(
                f"{OPTION_TRANSFER_BACKEND} is not supported when "
                f"{OPTION_ENABLE_REMOTE_CACHE_ACCESSIBLE} is not enable."
            )
        if OPTION_LISTEN_IP_INFO not in options:
            param_invalid(
                f"{OPTION_TRANSFER_BACKEND} is not supported when "
                f"{OPTION_LISTEN_IP_INFO} is not configured."
            )
    if cache_manager_mode and OPTION_LISTEN_IP_INFO in options:
        ip, port = parse_listen_ip_info(options[OPTION_LISTEN_IP_INFO])
        result[OPTION_LISTEN_IP] = ip
        result[OPTION_LISTEN_PORT] = str(port)
    transport = result.get(OPTION_TRANSPORT)
    if transport is not None and transport not in TRANSPORTS:
        param_invalid(f"{OPTION_TRANSPORT} must be one of {list(TRANSPORTS)}, got {transport!r}")
    for key in (OPTION_ZERO_ON_ALLOC, OPTION_METRICS, OPTION_UCX, OPTION_SHARED_POOLS):
        switch = result.get(key)
        if switch is not None and switch not in ("1", "0"):
            param_invalid(f'{key} must be "1" or "0", got {switch!r}')
    return result
