"""Two processes, the async face: a prompt serves a paged KV cache, a decoder pulls from it.

Run it as it is (it starts the prompt as a second process, links to it over TCP on
127.0.0.1, pulls four blocks, checks them and prints what moved)::

    python examples/two_processes.py

or run the two sides yourself: ``--role prompt --port 26000`` in one shell, ``--role decoder
--port 26000`` in another.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import numpy as np

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMRole,
    LLMStatusCode,
)

PROMPT, DECODER = 1, 2  # cluster ids
BLOCKS, BLOCK_BYTES = 16, 64 << 10
DESC = CacheDesc(2, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8)  # K and V, 16 blocks each


def config(listen: str | None = None) -> LLMConfig:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True  # peers may pull from (and push into) it
    cfg.mem_pool_cfg = '{"memory_size": 67108864}'
    if listen is not None:
        cfg.listen_ip_info = listen
    return cfg


async def prompt(port: int) -> None:
    """Serve one blocks cache, filled with block numbers, until stdin closes."""
    async with AsyncLLMDataDist(LLMRole.PROMPT, PROMPT) as dd:
        await dd.init(config(f"127.0.0.1:{port}").generate_options())
        kv = await dd.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(PROMPT, 0))
        for tensor in kv.as_numpy():
            tensor[...] = np.arange(BLOCKS, dtype=np.uint8)[:, None]
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.read)  # serve until told to stop


async def decoder(port: int) -> None:
    """Link to the prompt, pull blocks 3, 5, 7 and 9 into blocks 0-3, check them."""
    async with AsyncLLMDataDist(LLMRole.DECODER, DECODER) as dd:
        await dd.init(config().generate_options())
        info = LLMClusterInfo()
        info.remote_cluster_id = PROMPT
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        ret, rets = await dd.link_clusters([info], 5000)
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise SystemExit(f"link failed: {rets.errors[0]}")
        kv = await dd.cache_manager.allocate_blocks_cache(DESC)
        await dd.cache_manager.pull_blocks(
            BlocksCacheKey(PROMPT, 0), kv, [3, 5, 7, 9], [0, 1, 2, 3]
        )
        for tensor in kv.as_numpy():
            assert (tensor[:4, 0] == [3, 5, 7, 9]).all()
        print(f"pulled 4 blocks x 2 tensors ({8 * BLOCK_BYTES >> 10} KiB), every byte checked")
        await dd.cache_manager.deallocate_blocks_cache(kv)
        await dd.unlink_clusters([info], 5000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=("both", "prompt", "decoder"), default="both")
    parser.add_argument("--port", type=int, default=26000, help="the prompt's TCP port")
    args = parser.parse_args()
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be from 1 to 65535, got {args.port}")
    if args.role == "prompt":
        asyncio.run(prompt(args.port))
        return
    if args.role == "decoder":
        asyncio.run(decoder(args.port))
        return
    side = subprocess.Popen(
        [sys.executable, __file__, "--role", "prompt", "--port", str(args.port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert side.stdin is not None and side.stdout is not None
    try:
        if side.stdout.readline().strip() != "ready":
            raise SystemExit("the prompt process did not start")
        asyncio.run(decoder(args.port))
    finally:
        side.stdin.close()
        side.wait(30)


if __name__ == "__main__":
    main()
