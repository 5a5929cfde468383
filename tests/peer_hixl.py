"""An endpoint of the hixl backend for the cross-process tests, driven line by line.

Usage: python tests/peer_hixl.py PORT CLUSTER OTHER_PORT OTHER_CLUSTER

As cluster CLUSTER with ``transfer_backend="hixl"`` it listens on 127.0.0.1:PORT and
registers a blocks cache of ``TENSORS`` x ``BLOCKS`` blocks under
``BlocksCacheKey(CLUSTER)`` holding :func:`tests.peer_domain.pattern` seeded by CLUSTER,
prints ``ready``, then answers one line per command read from stdin:

* ``link``: ``link_clusters`` to OTHER_CLUSTER at OTHER_PORT; prints the status's name.
* ``pull``: pulls every block of OTHER_CLUSTER; prints ``exact`` when every byte matches,
  else the status's name.
* ``unlink``: ``unlink_clusters`` naming only ``remote_cluster_id``; prints the status.

It finalizes when stdin closes.
"""

from __future__ import annotations

import sys

import numpy as np

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    Placement,
)
from tests.peer_domain import BLOCK_BYTES, BLOCKS, TENSORS, pattern


def main() -> None:
    port, me, other_port, other = (int(a) for a in sys.argv[1:5])
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 5000
    cfg.enable_cache_manager = True
    cfg.transfer_backend = "hixl"
    cfg.listen_ip_info = f"127.0.0.1:{port}"
    dd = LLMDataDist(LLMRole.PROMPT, me)
    dd.init(cfg.generate_options())
    cm = dd.cache_manager
    mine = [pattern(t, me) for t in range(TENSORS)]
    desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.DEVICE)
    cm.register_blocks_cache(desc, [int(t.ctypes.data) for t in mine], BlocksCacheKey(me))
    local = [np.zeros((BLOCKS, BLOCK_BYTES), np.uint8) for _ in range(TENSORS)]
    dst = cm.register_blocks_cache(desc, [int(t.ctypes.data) for t in local], BlocksCacheKey(me, 1))
    print("ready", flush=True)
    for command in sys.stdin:
        command = command.strip()
        info = LLMClusterInfo()
        info.remote_cluster_id = other
        if command == "link":
            info.append_local_ip_info("127.0.0.1", 0)
            info.append_remote_ip_info("127.0.0.1", other_port)
            ret, _ = dd.link_clusters([info], 5000)
            print(ret.name, flush=True)
        elif command == "unlink":
            ret, _ = dd.unlink_clusters([info], 1000)
            print(ret.name, flush=True)
        elif command == "pull":
            for t in local:
                t[...] = 0
            blocks = list(range(BLOCKS))
            try:
                cm.pull_blocks(BlocksCacheKey(other), dst, blocks, blocks)
            except LLMException as exc:
                print(exc.status_code.name, flush=True)
                continue
            exact = all(np.array_equal(t, pattern(i, other)) for i, t in enumerate(local))
            print("exact" if exact else "wrong", flush=True)
    dd.finalize()


if __name__ == "__main__":
    main()
