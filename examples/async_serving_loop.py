"""KV transfers awaited inside an asyncio server that keeps answering other requests.

Run: python examples/async_serving_loop.py

One event loop runs a small line-protocol server (a stand-in for a serving front end) and two
engines linked over TCP on 127.0.0.1: a prefill engine that pushes its paged KV cache layer
by layer with ``transfer_cache_async`` as an ``async def`` synchroniser reports each layer
done, and a decoder engine that pulls blocks. Meanwhile a client pings the server every
millisecond; the script prints how fast the pings were answered while bytes moved.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time

import numpy as np

# numpy buffers stand in for device memory here: use the host runtime even where an
# accelerator exists (device caches on an accelerator are not host-addressable).
os.environ["AIO_DATADIST_RUNTIME"] = "host"

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)

LAYERS, BLOCKS, BLOCK_BYTES = 16, 128, 64 * 1024  # 2 x 16 tensors x 8 MiB per engine
PROMPT_ID, DECODER_ID = 1, 2


def options(listen: str | None = None) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = 10_000
    if listen is not None:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


def desc() -> CacheDesc:
    return CacheDesc(2 * LAYERS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.DEVICE)


class ModelLayers(LayerSynchronizer):
    """Reports each layer done after a simulated forward step, without blocking the loop."""

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        await asyncio.sleep(0.002)  # the model computes layer `layer_index`
        return True


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The other work of the serving loop: answer every line with "pong"."""
    while await reader.readline():
        writer.write(b"pong\n")
        await writer.drain()
    writer.close()


async def pinger(port: int, stop: asyncio.Event, rtts: list[float]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while not stop.is_set():
        start = time.perf_counter()
        writer.write(b"ping\n")
        await reader.readline()
        rtts.append(time.perf_counter() - start)
        await asyncio.sleep(0.001)
    writer.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    p_mem = [np.full((BLOCKS, BLOCK_BYTES), t, dtype=np.uint8) for t in range(2 * LAYERS)]
    d_mem = [np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(2 * LAYERS)]
    async with (
        AsyncLLMDataDist(LLMRole.PROMPT, PROMPT_ID) as prompt,
        AsyncLLMDataDist(LLMRole.DECODER, DECODER_ID) as decoder,
    ):
        prompt_port = free_port()
        await prompt.init(options(f"127.0.0.1:{prompt_port}"))
        await decoder.init(options())
        p_cache = await prompt.cache_manager.register_blocks_cache(
            desc(), [int(a.ctypes.data) for a in p_mem], BlocksCacheKey(PROMPT_ID, 0)
        )
        d_cache = await decoder.cache_manager.register_blocks_cache(
            desc(), [int(a.ctypes.data) for a in d_mem], BlocksCacheKey(DECODER_ID, 0)
        )
        info = LLMClusterInfo()
        info.remote_cluster_id = PROMPT_ID
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", prompt_port)
        ret, _ = await decoder.link_clusters([info], 5000)
        assert ret == LLMStatusCode.LLM_SUCCESS

        stop, rtts = asyncio.Event(), []
        ping = asyncio.create_task(pinger(port, stop, rtts))
        started = time.perf_counter()
        # prefill pushes every layer into the decoder's blocks as the model finishes it
        config = TransferWithCacheKeyConfig(
            BlocksCacheKey(DECODER_ID, 0), range(0, LAYERS), range(0, LAYERS)
        )
        blocks = list(range(BLOCKS))
        task = prompt.cache_manager.transfer_cache_async(
            p_cache, ModelLayers(), [config], blocks, blocks
        )
        # ...while the decoder pulls the same blocks back, several requests at once
        pulls = [
            decoder.cache_manager.pull_blocks(
                BlocksCacheKey(PROMPT_ID, 0), d_cache, blocks[i::4], blocks[i::4]
            )
            for i in range(4)
        ]
        await asyncio.gather(*pulls)
        await task  # LLM_SUCCESS, or raises the first failed config's LLMException
        elapsed = time.perf_counter() - started
        stop.set()
        await ping
        assert all((d == t).all() for t, d in enumerate(d_mem)), "byte mismatch"
        moved = 2 * sum(a.nbytes for a in p_mem)
        await decoder.unlink_clusters([info], 5000)
        await prompt.cache_manager.unregister_cache(p_cache.cache_id)
        await decoder.cache_manager.unregister_cache(d_cache.cache_id)
    server.close()
    await server.wait_closed()
    ms = np.array(rtts) * 1e3
    print(f"moved {moved / 2**20:.0f} MiB in {elapsed * 1e3:.0f} ms, every byte checked")
    print(
        f"{len(ms)} pings answered meanwhile: p50 {np.percentile(ms, 50):.2f} ms, "
        f"p99 {np.percentile(ms, 99):.2f} ms, max {ms.max():.2f} ms"
    )


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()  # --help; no options
    asyncio.run(main())
