#!/usr/bin/env python3
"""Event-loop lag while a 256 MiB pull runs, two processes on 127.0.0.1.

Run: python benchmarks/bench_loop_lag.py [--reps 5] [--route tcp|samehost]

A prompt process serves a 256 MiB blocks cache (4 tensors x 64 blocks of 1 MiB); this
process awaits ``pull_blocks`` of all of it through ``AsyncLLMDataDist`` while a ticker
coroutine sleeps 1 ms at a time and records how late it wakes. ``--route tcp`` (the
default) keeps every byte on the TCP link; ``--route samehost`` lets the pull take the
one-sided same-host route (the library's default on one host).

For scale, the same run first measures the lag with no transfer at all (``idle``) and
while a worker thread of this process receives the same 256 MiB from the prompt process
over a plain TCP socket (``raw-tcp``, ``socket.recv_into``): the part of the lag the
machine's scheduler adds to any transfer that keeps both ends busy.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable

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
from aio_datadist import _argtypes as argtypes

TENSORS, BLOCKS, BLOCK = 4, 64, 1 << 20
TOTAL = TENSORS * BLOCKS * BLOCK


def desc() -> CacheDesc:
    return CacheDesc(TENSORS, [BLOCKS, BLOCK], DataType.DT_UINT8, Placement.DEVICE)


def options(route: str, listen: str | None = None) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.sync_kv_timeout = 60_000
    cfg.same_host = route == "samehost"
    if listen:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


def _send_raw(listener: socket.socket, mem: list[np.ndarray]) -> None:
    """Send all of ``mem`` to every connection ``listener`` accepts, until it closes."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            for m in mem:
                conn.sendall(m.data.cast("B"))


def serve(port: int, route: str) -> None:
    mem = [np.full((BLOCKS, BLOCK), t + 1, dtype=np.uint8) for t in range(TENSORS)]
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(options(route, f"127.0.0.1:{port}"))
    dd.cache_manager.register_blocks_cache(
        desc(), [int(m.ctypes.data) for m in mem], BlocksCacheKey(1, 0)
    )
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_send_raw, args=(raw, mem), daemon=True).start()
    print("ready", raw.getsockname()[1], flush=True)
    sys.stdin.read()
    raw.close()
    dd.finalize()


def _recv_raw(raw_port: int, mem: list[np.ndarray]) -> None:
    with socket.create_connection(("127.0.0.1", raw_port)) as conn:
        for m in mem:
            view, got = m.data.cast("B"), 0
            while got < len(view):
                n = conn.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("the prompt process closed the raw socket")
                got += n


async def _lags_during(transfer: Callable[[], Awaitable[object]]) -> tuple[list[float], float]:
    """(the ticker's lags in seconds, the transfer's seconds) while ``transfer`` runs."""
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await transfer()
    elapsed = time.perf_counter() - start
    stop.set()
    await tick
    return lags, elapsed


def _report(label: str, lags: list[float], elapsed: float | None = None) -> None:
    ms = np.array(lags) * 1e3
    rate = "" if elapsed is None else f"{TOTAL / elapsed / 1e9:.2f} GB/s, "
    print(
        f"{label}: {rate}{len(ms)} ticks, lag p50 {np.percentile(ms, 50):.3f} ms, "
        f"p99 {np.percentile(ms, 99):.3f} ms, max {ms.max():.3f} ms"
    )


async def measure(port: int, raw_port: int, reps: int, route: str) -> None:
    mem = [np.full((BLOCKS, BLOCK), 0, dtype=np.uint8) for _ in range(TENSORS)]

    def check_and_clear() -> None:
        assert all((m == t + 1).all() for t, m in enumerate(mem)), "byte mismatch"
        for m in mem:
            m.fill(0)

    async def idle() -> None:
        await asyncio.sleep(0.25)

    loop = asyncio.get_running_loop()
    lags, _ = await _lags_during(idle)
    _report("idle", lags)
    raw_lags: list[float] = []
    for rep in range(reps):
        lags, elapsed = await _lags_during(
            lambda: loop.run_in_executor(None, _recv_raw, raw_port, mem)
        )
        check_and_clear()
        _report(f"raw-tcp rep {rep}", lags, elapsed)
        raw_lags += lags

    async with AsyncLLMDataDist(LLMRole.DECODER, 2) as dd:
        await dd.init(options(route))
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
            lags, elapsed = await _lags_during(
                lambda: dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, blocks, blocks)
            )
            check_and_clear()
            _report(f"aio {route} rep {rep}", lags, elapsed)
            all_lags += lags
        _report("overall raw-tcp", raw_lags)
        _report(f"overall aio {route}", all_lags)
        await dd.unlink_clusters([info], 5000)
        await dd.cache_manager.unregister_cache(cache.cache_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=argtypes.port, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=argtypes.positive_int, default=5)
    parser.add_argument("--route", choices=("tcp", "samehost"), default="tcp")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.route)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    peer = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--route", args.route],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None and peer.stdin is not None
        word, raw_port = peer.stdout.readline().split()
        assert word == "ready"
        asyncio.run(measure(port, int(raw_port), args.reps, args.route))
        peer.stdin.close()
        peer.wait(30)
    finally:
        if peer.poll() is None:
            peer.kill()


if __name__ == "__main__":
    main()
