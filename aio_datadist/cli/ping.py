"""``aio-datadist ping HOST:PORT``: link to a listener and time a request's round trip."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from aio_datadist._options import engine_options
from aio_datadist.cluster import LinkResults, LLMClusterInfo
from aio_datadist.data_type import DataType
from aio_datadist.enums import LLMRole
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.sync import LLMDataDist
from aio_datadist.types import BlocksCacheKey, CacheDesc

__all__ = ("ping",)

#: A model id no listener serves: the round trip is a pull the peer refuses at once.
_NO_MODEL = 2**63 - 1


def ping(
    host: str,
    port: int,
    *,
    cluster_id: int,
    count: int,
    timeout_ms: int,
    same_host: bool,
    local_ip: str,
) -> dict[str, Any]:
    """Link to ``host:port`` (cluster ``cluster_id``) from ``local_ip`` with the secret of
    the environment, then time ``count`` request round trips (a pull of a blocks cache the
    peer does not have: it refuses at once, so the time is the link's and the peer's
    serving path's); the outcome as plain data, ``ok`` False with the reason on failure."""
    options = engine_options(
        transport="tcp", pool_bytes=1 << 20, timeout_ms=timeout_ms, same_host=same_host
    )
    local_id = (os.getpid() << 16) | 0xA10
    dd = LLMDataDist(LLMRole.DECODER, local_id)
    dd.init(options)
    out: dict[str, Any] = {"target": f"{host}:{port}", "cluster_id": cluster_id}
    try:
        info = LLMClusterInfo()
        info.remote_cluster_id = cluster_id
        info.append_local_ip_info(local_ip, 0)
        info.append_remote_ip_info(host, port)
        started = time.perf_counter()
        ret, results = dd.link_clusters([info], timeout_ms)
        out["link_ms"] = round((time.perf_counter() - started) * 1e3, 3)
        if ret != LLMStatusCode.LLM_SUCCESS:
            status = results[0] if results else ret
            out.update(ok=False, status=LLMStatusCode(status).name, reason=_reason(results))
            return out
        cache = dd.cache_manager.allocate_blocks_cache(CacheDesc(1, [1, 64], DataType.DT_UINT8))
        rtts = []
        for _ in range(count):
            started = time.perf_counter()
            try:
                dd.cache_manager.pull_blocks(BlocksCacheKey(cluster_id, _NO_MODEL), cache, [0], [0])
            except LLMException as exc:
                if exc.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:
                    name = LLMStatusCode(exc.status_code).name
                    out.update(ok=False, status=name, reason=str(exc))
                    return out
            rtts.append(time.perf_counter() - started)
        stats = dd.stats()
        us = np.array(rtts) * 1e6
        out.update(
            ok=True,
            routes=list(stats.link_routes.get(cluster_id, ())),
            authenticated=bool(os.environ.get("AIO_DATADIST_LINK_SECRET")),
            rtt_us={
                "min": round(float(us.min()), 1),
                "p50": round(float(np.percentile(us, 50)), 1),
                "max": round(float(us.max()), 1),
            },
        )
        return out
    finally:
        dd.finalize()


def _reason(results: LinkResults) -> str:
    """Why the link failed, from ``link_clusters``' results."""
    return "; ".join(str(e) for e in results.errors if e is not None) or "no reason given"
