"""A prompt process serving a device blocks cache, for the same-host device tests.

Usage: python tests/peer_device.py PORT BLOCKS BLOCK_BYTES

Under the runtime ``AIO_DATADIST_RUNTIME`` names, it allocates a ``Placement.DEVICE`` blocks
cache of 4 tensors x BLOCKS blocks of BLOCK_BYTES from its pool under
``BlocksCacheKey(1, 0)``, writes :func:`tests.peer_prompt.pattern` into it through the
runtime, prints ``ready`` and the port it listens on (PORT 0: one the system picks) and
serves until stdin closes. With ``AIO_TEST_UCX=1`` it enables
the UCX route (``LLMConfig.ucx``).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
)
from aio_datadist._runtime.base import CopyKind
from tests.peer_prompt import TENSORS, pattern


def main() -> None:
    port, blocks, block_bytes = (int(a) for a in sys.argv[1:4])
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    cache_bytes = TENSORS * blocks * block_bytes
    cfg.mem_pool_cfg = json.dumps({"memory_size": max(1 << 24, cache_bytes + (8 << 20))})
    if os.environ.get("AIO_TEST_UCX") == "1":
        cfg.ucx = True
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(cfg.generate_options())
    cm = dd.cache_manager
    desc = CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)
    cache = cm.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    runtime = dd._engine.caches.runtime  # type: ignore[union-attr]
    for t, addr in enumerate(cache.tensor_addrs):
        data = np.ascontiguousarray(pattern(t, blocks, block_bytes))
        ops = np.array([[addr, data.ctypes.data, data.nbytes]], dtype=np.uint64)
        runtime.copy_batch(ops, CopyKind.HOST_TO_DEVICE)
    print("ready", dd.listen_address[1], flush=True)  # the bound port (asked: 0)
    sys.stdin.read()
    dd.finalize()


if __name__ == "__main__":
    main()
