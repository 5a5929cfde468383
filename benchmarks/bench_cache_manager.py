"""Local cache-manager throughput and latency through the public API, beside numpy.

Run: python benchmarks/bench_cache_manager.py

Cases (one run, same buffers, median of REPS):
  * swap_blocks device -> host of 4096 scattered 64 KiB blocks (256 MiB), blocking and async,
    against numpy fancy indexing and a numpy.copyto loop over the same blocks;
  * copy_blocks of the same 4096 blocks inside one cache;
  * latency of one 64 KiB block (swap_blocks), blocking and awaited: p50 / p99 of 2000 calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from aio_datadist import (
    AsyncLLMDataDist,
    Cache,
    CacheDesc,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
)

BLOCK = 64 << 10
NBLOCKS = 8192  # cache size: 512 MiB
MOVED = 4096  # blocks moved per call: 256 MiB
REPS = 5
LAT_CALLS = 2000


def options() -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.mem_pool_cfg = json.dumps({"memory_size": (NBLOCKS + 16) * BLOCK})
    return cfg.generate_options()


def median_s(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(REPS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def row(name: str, secs: float, nbytes: int = MOVED * BLOCK) -> tuple[str, float]:
    print(f"| {name} | {secs * 1e3:.2f} | {nbytes / secs / 1e9:.2f} |")
    return name, secs


def main() -> None:
    rng = np.random.default_rng(0)
    src_idx = rng.permutation(NBLOCKS)[:MOVED]
    dst_idx = rng.permutation(NBLOCKS)[:MOVED]
    host_buf = np.zeros((NBLOCKS, BLOCK), np.uint8)
    host = Cache.create_cpu_cache(
        CacheDesc(1, [NBLOCKS, BLOCK], DataType.DT_UINT8, Placement.HOST), [host_buf.ctypes.data]
    )
    desc = CacheDesc(1, [NBLOCKS, BLOCK], DataType.DT_UINT8)
    swap_map = dict(zip(src_idx.tolist(), dst_idx.tolist(), strict=True))
    # copy_blocks inside one cache: sources from the first half, destinations the second.
    copy_map = {
        int(s): [int(d)]
        for s, d in zip(
            rng.permutation(NBLOCKS // 2)[: MOVED // 2],
            NBLOCKS // 2 + rng.permutation(NBLOCKS // 2)[: MOVED // 2],
            strict=True,
        )
    }

    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(options())
    cm = dd.cache_manager
    kv = cm.allocate_blocks_cache(desc)
    (dev,) = kv.as_numpy()
    dev[...] = rng.integers(0, 256, dev.shape, dtype=np.uint8)

    print("| case | median ms | GB/s |\n|---|---:|---:|")
    results = dict(
        [
            row(
                "numpy fancy index (host[dst] = dev[src])",
                median_s(lambda: host_buf.__setitem__(dst_idx, dev[src_idx])),
            ),
            row(
                "numpy.copyto loop over blocks",
                median_s(lambda: [np.copyto(host_buf[d], dev[s]) for s, d in swap_map.items()]),
            ),
            row("swap_blocks, blocking", median_s(lambda: cm.swap_blocks(kv, host, swap_map))),
            ("verified", float(np.array_equal(host_buf[dst_idx], dev[src_idx]))),
            row(
                "copy_blocks, blocking (2048 blocks)",
                median_s(lambda: cm.copy_blocks(kv, copy_map)),
                MOVED // 2 * BLOCK,
            ),
        ]
    )

    assert results.pop("verified") == 1.0, "swap_blocks moved the wrong bytes"
    one = {int(src_idx[0]): int(dst_idx[0])}
    lat = []
    for _ in range(LAT_CALLS):
        t = time.perf_counter()
        cm.swap_blocks(kv, host, one)
        lat.append(time.perf_counter() - t)
    cm.deallocate_blocks_cache(kv)
    dd.finalize()

    async def async_part() -> tuple[float, list[float]]:
        async with AsyncLLMDataDist(LLMRole.PROMPT, 2) as adl:
            await adl.init(options())
            acm = adl.cache_manager
            akv = await acm.allocate_blocks_cache(desc)
            akv.as_numpy()[0][...] = 1
            times = []
            for _ in range(REPS + 1):
                t = time.perf_counter()
                await acm.swap_blocks(akv, host, swap_map)
                times.append(time.perf_counter() - t)
            alat = []
            for _ in range(LAT_CALLS):
                t = time.perf_counter()
                await acm.swap_blocks(akv, host, one)
                alat.append(time.perf_counter() - t)
            await acm.deallocate_blocks_cache(akv)
            return statistics.median(times[1:]), alat

    asecs, alat = asyncio.run(async_part())
    results.update([row("swap_blocks, awaited (worker thread)", asecs)])
    base = results["numpy fancy index (host[dst] = dev[src])"]
    loop = results["numpy.copyto loop over blocks"]
    print()
    for name in ("swap_blocks, blocking", "swap_blocks, awaited (worker thread)"):
        print(
            f"- {name}: {base / results[name]:.2f}x numpy fancy index, "
            f"{loop / results[name]:.2f}x numpy.copyto loop"
        )
    for name, xs in (("blocking", lat), ("awaited (inline)", alat)):
        xs = sorted(xs)
        print(
            f"- one 64 KiB block, {name}: p50 {xs[len(xs) // 2] * 1e6:.1f} us, "
            f"p99 {xs[int(len(xs) * 0.99)] * 1e6:.1f} us"
        )


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()  # --help; no options
    main()
