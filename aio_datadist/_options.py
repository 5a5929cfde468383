"""Options of an engine in cache manager mode with remote cache access, for the library's
own tools (the testing kit, the ``aio-datadist`` command)."""

from __future__ import annotations

import json

from aio_datadist.config import LLMConfig

__all__ = ("engine_options",)


def engine_options(
    *,
    transport: str,
    pool_bytes: int,
    timeout_ms: int,
    listen: str | None = None,
    same_host: bool | None = None,
    host_pool_bytes: int | None = None,
    link_secret: str | bytes | None = None,
    ucx: bool | None = None,
) -> dict[str, str]:
    """The option strings of such an engine on device 0 with a device pool of
    ``pool_bytes`` (and a host pool of ``host_pool_bytes``), listening at ``listen``."""
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.transport = transport
    cfg.sync_kv_timeout = timeout_ms
    cfg.mem_pool_cfg = json.dumps({"memory_size": pool_bytes})
    if host_pool_bytes is not None:
        cfg.host_mem_pool_cfg = json.dumps({"memory_size": host_pool_bytes})
    if same_host is not None:
        cfg.same_host = same_host
    if link_secret is not None:
        cfg.link_secret = link_secret
    if listen is not None:
        cfg.listen_ip_info = listen
    if ucx is not None:
        cfg.ucx = ucx
    return dict(cfg.generate_options())
