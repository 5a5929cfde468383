"""Local KV-cache management with aio_datadist, through the blocking API and the async facade.

Run: python examples/quickstart.py

A prefill engine allocates a paged KV cache from its device pool, fills it, copies blocks,
swaps blocks out to host memory and back, and checks every byte; then the same steps run
through ``AsyncLLMDataDist`` inside an asyncio program. On a machine without an accelerator,
device memory is host memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np

import aio_datadist as llm_datadist

# numpy buffers stand in for device memory here: use the host runtime even where an
# accelerator exists (device caches on an accelerator are not host-addressable).
os.environ["AIO_DATADIST_RUNTIME"] = "host"

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
)

LAYERS, BLOCKS, BLOCK_ELEMS = 4, 64, 16 * 1024  # 4 layers x {K,V}, 64 blocks of 32 KiB (fp16)


def options() -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = json.dumps({"memory_size": 64 << 20, "page_shift": 16})
    return cfg.generate_options()


def kv_desc(placement: Placement = Placement.DEVICE) -> CacheDesc:
    return CacheDesc(2 * LAYERS, [BLOCKS, BLOCK_ELEMS], DataType.DT_FLOAT16, placement)


def host_cache(bufs: list[np.ndarray]) -> Cache:
    return Cache.create_cpu_cache(kv_desc(Placement.HOST), [b.ctypes.data for b in bufs])


def blocking_demo() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(options())
    try:
        cm = dd.cache_manager
        kv = cm.allocate_blocks_cache(kv_desc(), BlocksCacheKey(1, 0))
        tensors = kv.as_numpy()
        rng = np.random.default_rng(0)
        for t in tensors:
            t[...] = rng.standard_normal(t.shape).astype(np.float16)
        before = [t.copy() for t in tensors]

        cm.copy_blocks(kv, {0: [10, 11], 1: [12]})
        assert all(
            np.array_equal(t[10], b[0]) and np.array_equal(t[12], b[1])
            for t, b in zip(tensors, before, strict=True)
        )

        host_bufs = [np.zeros((BLOCKS, BLOCK_ELEMS), np.float16) for _ in range(2 * LAYERS)]
        host = host_cache(host_bufs)
        every_block = {b: b for b in range(BLOCKS)}
        cm.swap_blocks(kv, host, every_block)  # swap out every block (first touch of host pages)
        start = time.perf_counter()
        cm.swap_blocks(kv, host, every_block)
        took = time.perf_counter() - start
        nbytes = kv.cache_desc.size * kv.cache_desc.num_tensors
        assert all(np.array_equal(h, t) for h, t in zip(host_bufs, tensors, strict=True))
        for t in tensors:
            t[...] = 0
        cm.swap_blocks(host, kv, {3: 3})  # swap one block back in
        assert all(np.array_equal(t[3], h[3]) for t, h in zip(tensors, host_bufs, strict=True))
        cm.deallocate_blocks_cache(kv)
        print(
            f"blocking: copy_blocks and swap_blocks verified; swap-out of "
            f"{nbytes / 2**20:.0f} MiB at {nbytes / took / 1e9:.1f} GB/s"
        )
        print(f"blocking: pool usage after release: {cm.pool_stats(Placement.DEVICE).used} bytes")
    finally:
        dd.finalize()


async def async_demo() -> None:
    async with AsyncLLMDataDist(LLMRole.DECODER, 2) as dd:
        await dd.init(options())
        cm = dd.cache_manager
        kv = await cm.allocate_blocks_cache(kv_desc())
        tensors = kv.as_numpy()
        for i, t in enumerate(tensors):
            t[...] = i
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        host_bufs = [np.zeros((BLOCKS, BLOCK_ELEMS), np.float16) for _ in range(2 * LAYERS)]
        for _ in range(20):  # the loop keeps serving other coroutines meanwhile
            await cm.swap_blocks(kv, host_cache(host_bufs), {b: b for b in range(BLOCKS)})
        tick_task.cancel()
        assert all((h == i).all() for i, h in enumerate(host_bufs))
        await cm.deallocate_blocks_cache(kv)
        print(f"async: 20 swap-outs verified while a 1 ms ticker ran {ticks} times")


def main() -> None:
    print(f"aio_datadist {llm_datadist.__version__}; features: {sorted(llm_datadist.features)}")
    blocking_demo()
    asyncio.run(async_demo())
    print("OK")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()  # --help; no options
    main()
