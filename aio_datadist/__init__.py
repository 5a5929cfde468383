"""aio_datadist: the LLM-DataDist KV-cache transfer API, blocking and asyncio-native.

``import aio_datadist as llm_datadist`` works for callers of the documented blocking API;
``AsyncLLMDataDist`` is the same API as coroutines.
"""

from __future__ import annotations

import os as _os
from typing import Any as _Any

_os.environ.setdefault("AUTO_USE_UC_MEMORY", "0")

from aio_datadist._log import _enable_from_env, enable_logging
from aio_datadist._native import features as _native_features
from aio_datadist._version import __version__
from aio_datadist.aio import AsyncCacheManager, AsyncLLMDataDist
from aio_datadist.cache import Cache
from aio_datadist.cluster import LinkResults, LLMClusterInfo
from aio_datadist.config import LLMConfig, LlmConfig
from aio_datadist.data_type import DataType
from aio_datadist.enums import LLMRole, MemType, Memtype, Placement, RegisterMemStatus
from aio_datadist.stats import DataDistStats
from aio_datadist.status import (
    AlreadyLinkError,
    ClusterNumExceedLimitError,
    DeviceOutOfMemoryError,
    EngineFinalizedError,
    ExistLinkError,
    FeatureNotEnabledError,
    KvCacheNotExistError,
    LinkBusyError,
    LinkFailedError,
    LLMException,
    LLMFailedError,
    LLMStatusCode,
    LLMTimeoutError,
    NotifyPromptUnlinkFailedError,
    NotYetLinkError,
    OutOfMemoryError,
    ParamInvalidError,
    ProcessingLinkError,
    RepeatRequestError,
    Status,
    UnlinkFailedError,
)
from aio_datadist.sync import LLMDataDist
from aio_datadist.synchronizer import LayerSynchronizer
from aio_datadist.task import CacheTask
from aio_datadist.types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCache,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

#: What this build can do, worked out on first use: native kernels, the runtimes it can load
#: (``runtime:cuda`` and ``runtime:acl`` load their vendor library at ``init``; whether a
#: device exists is decided there, see ``AIO_DATADIST_RUNTIME``) and, where libucp loads,
#: the UCX route: ``ucx``, ``ucx:version=<x.y.z>``, ``ucx:path=<the libucp loaded>``, one
#: ``ucx:transport=<tl/device>`` per transport UCX offers under the current ``UCX_*``
#: environment, and one ``ucx:memory=<type>`` per memory type it reaches.
features: frozenset[str]


def _features() -> frozenset[str]:
    from aio_datadist._routes.ucx.worker import ucx_info

    found = set(_native_features | {"runtime:host", "runtime:cuda", "runtime:acl"})
    info = ucx_info()
    if info["available"]:
        found |= {"ucx", f"ucx:version={info['version']}", f"ucx:path={info['path']}"}
        found |= {f"ucx:transport={tl}" for tl in info.get("transports", [])}
        found |= {f"ucx:memory={memory}" for memory in info.get("memory_types", [])}
    return frozenset(found)


# The reference also lists the v1 names TensorDesc, Tensor and KvCacheManager; they are left
# out here so that ``from aio_datadist import *`` works without the v1 package.
__all__ = [
    "LLMClusterInfo",
    "LLMStatusCode",
    "LLMException",
    "LLMRole",
    "LlmConfig",
    "LLMConfig",
    "DataType",
    "Status",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "KvCache",
    "Cache",
    "BlocksCacheKey",
    "LLMDataDist",
    "Placement",
    "RegisterMemStatus",
    "LayerSynchronizer",
    "TransferConfig",
    "CacheTask",
    "TransferWithCacheKeyConfig",
    "Memtype",
    "MemInfo",
    "MemType",
    "AsyncLLMDataDist",
    "AsyncCacheManager",
    "LinkResults",
    "DataDistStats",
    "enable_logging",
    "features",
    "__version__",
    # The LLMException subclasses, one per status code (aio_datadist's own names).
    "LLMFailedError",
    "KvCacheNotExistError",
    "RepeatRequestError",
    "ParamInvalidError",
    "EngineFinalizedError",
    "NotYetLinkError",
    "AlreadyLinkError",
    "LinkFailedError",
    "UnlinkFailedError",
    "NotifyPromptUnlinkFailedError",
    "ClusterNumExceedLimitError",
    "ProcessingLinkError",
    "DeviceOutOfMemoryError",
    "ExistLinkError",
    "FeatureNotEnabledError",
    "LLMTimeoutError",
    "LinkBusyError",
    "OutOfMemoryError",
]

#: The documented v2 names, in the reference package's order (the first 23 of ``__all__``).
v2_list = __all__[:23]

_V1_NAMES = frozenset({"TensorDesc", "Tensor", "KvCacheManager"})


def __getattr__(name: str) -> _Any:
    if name == "features":
        value = globals()["features"] = _features()
        return value
    if name in _V1_NAMES:
        raise ImportError(
            f"{name} belongs to the v1 llm_datadist API (package llm_datadist_v1), "
            "which aio_datadist does not support"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_enable_from_env()
