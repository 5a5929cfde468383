"""A prompt process for the cross-process tests: serves a known paged cache over TCP.

Usage: python tests/peer_prompt.py PORT BLOCKS BLOCK_BYTES [CLUSTER_ID]

As cluster CLUSTER_ID (default 1) it registers a blocks cache of 4 tensors x BLOCKS blocks
of BLOCK_BYTES under ``BlocksCacheKey(CLUSTER_ID, 0)`` (tensor ``t`` filled by
:func:`pattern`), allocates a batch cache (id 2) with ``CacheKey(CLUSTER_ID, req_id=1)``
bound to row 0, prints ``ready`` and the port it listens on (PORT 0: one the system
picks) and serves until stdin closes. Remote caches are
accessible, so peers may also push into it.

With ``AIO_TEST_THREAD_BUDGET=N`` in the environment it then runs as user ``nobody`` (when
started as root) with ``RLIMIT_NPROC`` set so that at most N more threads can start. With
``AIO_TEST_UCX=1`` it enables the UCX route (``LLMConfig.ucx``); ``AIO_TEST_LISTEN_IP`` is the
address it listens on (``127.0.0.1`` by default).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import IO

import numpy as np

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
)

TENSORS = 4


def read_ready(stdout: IO[bytes]) -> int:
    """The port a peer (this script or ``tests/peer_device.py``) reports once it serves; lines
    before it are skipped (UCX may print warnings to stdout).

    :raises RuntimeError: the peer exited first.
    """
    for line in stdout:
        word, _, port = line.decode(errors="replace").partition(" ")
        if word.strip() == "ready":
            return int(port)
    raise RuntimeError("the peer exited before it served")


ROW_BYTES = 4096


def pattern(t: int, blocks: int, block_bytes: int) -> np.ndarray:
    """The bytes of tensor ``t`` (cheap, position dependent, reproducible)."""
    words = np.arange(blocks * block_bytes // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words += np.uint64(t + 1)
    return words.view(np.uint8).reshape(blocks, block_bytes)


def tasks_of(uid: int) -> int:
    """Threads of every process of ``uid`` (what ``RLIMIT_NPROC`` counts)."""
    count = 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            status = (proc / "status").read_text()
            owner = int(status.split("\nUid:", 1)[1].split()[0])
            if owner == uid:
                count += len(os.listdir(proc / "task"))
        except (OSError, IndexError, ValueError):
            continue
    return count


def limit_threads(budget: int) -> None:
    """Let at most ``budget`` more threads of this user start."""
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    limit = tasks_of(os.getuid()) + budget
    resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))


def main() -> None:
    port, blocks, block_bytes = (int(a) for a in sys.argv[1:4])
    cluster_id = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    tensors = [pattern(t, blocks, block_bytes) for t in range(TENSORS)]
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.listen_ip_info = f"{os.environ.get('AIO_TEST_LISTEN_IP', '127.0.0.1')}:{port}"
    cfg.mem_pool_cfg = json.dumps({"memory_size": 1 << 24})
    if os.environ.get("AIO_TEST_UCX") == "1":
        cfg.ucx = True
    dd = LLMDataDist(LLMRole.PROMPT, cluster_id)
    dd.init(cfg.generate_options())
    cm = dd.cache_manager
    desc = CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)
    cm.register_blocks_cache(
        desc, [int(t.ctypes.data) for t in tensors], BlocksCacheKey(cluster_id, 0)
    )
    rows = cm.allocate_cache(
        CacheDesc(TENSORS, [1, ROW_BYTES], DataType.DT_UINT8), [CacheKey(cluster_id, req_id=1)]
    )
    for t, view in enumerate(rows.as_numpy()):
        view[...] = t + 7
    budget = os.environ.get("AIO_TEST_THREAD_BUDGET")
    if budget is not None:
        limit_threads(int(budget))
    print("ready", dd.listen_address[1], flush=True)  # the bound port (asked: 0)
    sys.stdin.read()
    dd.finalize()


if __name__ == "__main__":
    main()
