#!/usr/bin/env python3
"""Event-loop lag while a 256 MiB pull runs, two processes over TCP on 127.0.0.1.

Run: python benchmarks/bench_loop_lag.py [--reps 5]

A prompt process serves a 256 MiB blocks cache (4 tensors x 64 blocks of 1 MiB); this
process awaits ``pull_blocks`` of all of it through ``AsyncLLMDataDist`` while a ticker
coroutine sleeps 1 ms at a time and records how late it wakes. Prints the lag percentiles
and the transfer bandwidth, per repetition and overall.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time

import numpy as np

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    Placement,
)

TENSORS, BLOCKS, BLOCK = 4, 64, 1 << 20


def desc() -> CacheDesc:
    return CacheDesc(TENSORS, [BLOCKS, BLOCK], DataType.DT_UINT8, Placement.DEVICE)


def options(listen: str | None = None) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 60_000
    if listen:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


def serve(port: int) -> None:
    mem = [np.full((BLOCKS, BLOCK), t + 1, dtype=np.uint8) for t in range(TENSORS)]
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(options(f"127.0.0.1:{port}"))
    dd.cache_manager.register_blocks_cache(
        desc(), [int(m.ctypes.data) for m in mem], BlocksCacheKey(1, 0)
    )
    print("ready", flush=True)
    sys.stdin.read()
    dd.finalize()


async def measure(port: int, reps: int) -> None:
    mem = [np.full((BLOCKS, BLOCK), 0, dtype=np.uint8) for _ in range(TENSORS)]
    async with AsyncLLMDataDist(LLMRole.DECODER, 2) as dd:
        await dd.init(options())
        cache = await dd.cache_manager.register_blocks_cache(
            desc(), [int(m.ctypes.data) for m in mem], BlocksCacheKey(2, 0)
        )
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        await dd.link_clusters([info], 5000)
        blocks = list(range(BLOCKS))
        all_lags: list[float] = []
        for rep in range(reps):
            lags: list[float] = []
            stop = asyncio.Event()

            async def ticker(lags: list[float] = lags, stop: asyncio.Event = stop) -> None:
                while not stop.is_set():
                    start = time.perf_counter()
                    await asyncio.sleep(0.001)
                    lags.append(time.perf_counter() - start - 0.001)

            tick = asyncio.create_task(ticker())
            await asyncio.sleep(0.01)
            start = time.perf_counter()
            await dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, blocks, blocks)
            elapsed = time.perf_counter() - start
            stop.set()
            await tick
            assert all((m == t + 1).all() for t, m in enumerate(mem)), "byte mismatch"
            ms = np.array(lags) * 1e3
            print(
                f"rep {rep}: {TENSORS * BLOCKS * BLOCK / elapsed / 1e9:.2f} GB/s, "
                f"{len(ms)} ticks, lag p50 {np.percentile(ms, 50):.3f} ms, "
                f"p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.3f} ms"
            )
            all_lags += lags
            for m in mem:
                m.fill(0)
        ms = np.array(all_lags) * 1e3
        print(
            f"overall: lag p50 {np.percentile(ms, 50):.3f} ms, p99 {np.percentile(ms, 99):.3f} "
            f"ms, max {ms.max():.3f} ms"
        )
        await dd.unlink_clusters([info], 5000)
        await dd.cache_manager.unregister_cache(cache.cache_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    peer = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None and peer.stdin is not None
        assert peer.stdout.readline().strip() == "ready"
        asyncio.run(measure(port, args.reps))
        peer.stdin.close()
        peer.wait(30)
    finally:
        if peer.poll() is None:
            peer.kill()


if __name__ == "__main__":
    main()
