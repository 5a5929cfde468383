"""One member of a rank-table domain, as vllm-ascend runs it, for the cross-process tests.

Usage: python tests/peer_domain.py ROLE MY_CLUSTER PROMPT_CLUSTER DECODER_CLUSTER COMM
BASE_PORT, with the rank table on the first line of stdin.

ROLE is ``prompt`` (rank 0) or ``decoder`` (rank 1). Both init as vllm-ascend does (cache
manager, remote caches accessible, no listen address) and register one blocks cache of
``TENSORS`` x ``BLOCKS`` blocks under ``BlocksCacheKey(MY_CLUSTER)``; the prompt's holds
:func:`tests.peer_prompt.pattern` seeded by its cluster id. Each prints ``ready``, waits
for ``go`` on stdin, then calls ``link(COMM, {prompt: 0, decoder: 1}, table)`` and polls
``query_register_mem_status`` until OK. The decoder then pulls every block (reversed) and
prints ``exact`` when every byte matches; the prompt prints ``linked``. Both wait for stdin
to close, then unlink and finalize. Any failure prints ``error <type> <message>`` and
exits with status 1.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
    RegisterMemStatus,
)

TENSORS = 2
BLOCKS = 8
BLOCK_BYTES = 16 * 1024


def pattern(t: int, seed: int) -> np.ndarray:
    """The prompt's tensor ``t`` (position and seed dependent)."""
    words = np.arange(BLOCKS * BLOCK_BYTES // 8, dtype=np.uint64)
    words *= np.uint64(0x9E3779B97F4A7C15)
    words += np.uint64(seed * 1000 + t + 1)
    return words.view(np.uint8).reshape(BLOCKS, BLOCK_BYTES)


def main() -> int:
    role, me, prompt, decoder, comm, base_port = sys.argv[1:7]
    my_id, prompt_id, decoder_id = int(me), int(prompt), int(decoder)
    table = sys.stdin.readline()
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 5000
    cfg.enable_switch_role = True
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    options = dict(cfg.generate_options())
    options["aio.CommBasePort"] = base_port
    dd = LLMDataDist(LLMRole.PROMPT if role == "prompt" else LLMRole.DECODER, my_id)
    dd.init(options)
    try:
        cm = dd.cache_manager
        if role == "prompt":
            tensors = [pattern(t, my_id) for t in range(TENSORS)]
        else:
            tensors = [np.zeros((BLOCKS, BLOCK_BYTES), np.uint8) for _ in range(TENSORS)]
        desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.DEVICE)
        cache = cm.register_blocks_cache(
            desc, [int(t.ctypes.data) for t in tensors], BlocksCacheKey(my_id)
        )
        print("ready", flush=True)
        assert sys.stdin.readline().strip() == "go"
        comm_id = dd.link(comm, {prompt_id: 0, decoder_id: 1}, table)
        while dd.query_register_mem_status(comm_id=comm_id) is not RegisterMemStatus.OK:
            time.sleep(0.01)
        if role == "decoder":
            order = list(range(BLOCKS))[::-1]
            cm.pull_blocks(BlocksCacheKey(prompt_id), cache, order, list(range(BLOCKS)))
            for t, got in enumerate(tensors):
                np.testing.assert_array_equal(got, pattern(t, prompt_id)[order])
            print("exact", flush=True)
        else:
            print("linked", flush=True)
        sys.stdin.read()
        dd.unlink(comm_id)
    except Exception as exc:
        print("error", type(exc).__name__, str(exc).replace("\n", " "), flush=True)
        return 1
    finally:
        dd.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
