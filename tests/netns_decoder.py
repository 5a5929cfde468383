"""A decoder process for the two-namespace test: links to a prompt, moves and checks bytes.

Usage: python tests/netns_decoder.py HOST PORT BLOCKS BLOCK_BYTES

Links (as cluster 2, the same-host route off; the UCX route too with ``AIO_TEST_UCX=1``) to
the prompt of ``tests/peer_prompt.py`` at ``HOST:PORT``, pulls every block of its blocks
cache and checks each byte, pushes blocks and pulls them back, and prints one JSON line: the
link's routes, the UCX transports its endpoint uses, the pull's throughput, and ``ok``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from tests.providers import ucx_links

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from tests.peer_prompt import TENSORS, pattern


def main() -> None:
    host, port, blocks, block_bytes = sys.argv[1], *(int(a) for a in sys.argv[2:5])
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = 20_000
    cfg.same_host = False
    cfg.ucx = os.environ.get("AIO_TEST_UCX") == "1"
    cfg.mem_pool_cfg = json.dumps({"memory_size": 2 * TENSORS * blocks * block_bytes})
    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(cfg.generate_options())
    try:
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info(host, 0)
        info.append_remote_ip_info(host, port)
        ret, _ = dd.link_clusters([info], 10_000)
        assert ret == LLMStatusCode.LLM_SUCCESS, ret
        link = dd._engine.links.get(1)
        routes = [r.name for r in link.routes]
        ucx = ucx_links(dd._engine)
        remote = None if ucx is None else ucx.route_of(link.channel)
        cm = dd.cache_manager
        desc = CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)
        cache = cm.allocate_blocks_cache(desc)
        start = time.perf_counter()
        cm.pull_blocks(BlocksCacheKey(1, 0), cache, list(range(blocks)), list(range(blocks)))
        elapsed = time.perf_counter() - start
        ok = all(
            np.array_equal(view, pattern(t, blocks, block_bytes))
            for t, view in enumerate(cache.as_numpy())
        )
        for view in cache.as_numpy():
            view[0] = 0xC3
        cm.push_blocks(BlocksCacheKey(1, 0), cache, [0], [blocks - 1])
        cm.pull_blocks(BlocksCacheKey(1, 0), cache, [blocks - 1], [1])
        ok = ok and all((view[1] == 0xC3).all() for view in cache.as_numpy())
        print(
            json.dumps(
                {
                    "routes": routes,
                    "transports": [] if remote is None else remote.transports(),
                    "pull_mb_s": round(TENSORS * blocks * block_bytes / elapsed / 1e6, 1),
                    "ok": ok,
                }
            ),
            flush=True,
        )
        cm.deallocate_blocks_cache(cache)
    finally:
        dd.finalize()


if __name__ == "__main__":
    main()
