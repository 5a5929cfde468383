#!/usr/bin/env python3
"""Small pulls in a steady loop: the latency of one call through each face and route.

Run: python benchmarks/bench_small_pull.py [--face sync|async] [--route link|samehost|ucx]
                                            [--calls 3000] [--blocks 1] [--concurrent N]
                                            [--metrics on|off] [--op pull|push]

A prompt process (``tests/peer_prompt.py``: 4 tensors x 64 blocks of 64 KiB) serves over TCP
on 127.0.0.1 (``--route ucx``: both sides with the UCX route on, the same-host route off);
this process links to it and pulls ``--blocks`` random blocks of one tensor per
call, ``--calls`` times, one call after the other: the blocking ``pull_blocks`` in a plain
loop, or the awaited one in one long-running event loop (the shared harness instead starts
its loop for every call, which it then mostly measures). Prints the p50/p99 latency after
100 warm-up calls, the process CPU time per call (every thread; busy polling included) and
GB/s at the p50. ``--concurrent N`` (async face) instead awaits N pulls at once over the one
link, ``--calls`` times, and prints the wall time of each wave and the CPU time per transfer.
``--op push`` pushes the blocks instead (``push_blocks`` into the peer's blocks cache; the
awaited face awaits its task). Uses the public API only, so the same script measures any two
builds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("AIO_DATADIST_RUNTIME", "host")  # numpy memory stands in for caches

import aio_datadist
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

ROOT = Path(__file__).resolve().parents[1]
TENSORS, BLOCKS, BLOCK = 4, 64, 64 * 1024
WARMUP = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def options(route: str, timeout_ms: int = 1000, metrics: bool = True) -> dict[str, str]:
    cfg = LLMConfig()
    if hasattr(cfg, "metrics"):  # (older builds have no metrics to switch)
        cfg.metrics = metrics
    cfg.sync_kv_timeout = timeout_ms  # a wave of concurrent calls shares the one link
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.mem_pool_cfg = json.dumps({"memory_size": 256 << 20})
    cfg.transport = "tcp"
    cfg.same_host = route == "samehost"
    if route == "ucx" or hasattr(cfg, "ucx"):  # (older builds have no UCX route)
        cfg.ucx = route == "ucx"
    return dict(cfg.generate_options())


def report(args: argparse.Namespace, lat: list[float], cpu: float) -> None:
    ms = np.array(lat[WARMUP:]) * 1e6
    p50 = float(np.percentile(ms, 50))
    print(
        f"{args.face:5} {args.route:8} {args.op:4} blocks={args.blocks} p50 {p50:.1f} us "
        f"p99 {np.percentile(ms, 99):.1f} us  cpu/call {cpu / len(lat) * 1e6:.1f} us  "
        f"{args.blocks * BLOCK / p50 / 1e3:.2f} GB/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--face", choices=("sync", "async"), default="async")
    parser.add_argument("--route", choices=("link", "samehost", "ucx"), default="link")
    parser.add_argument("--calls", type=argtypes.positive_int, default=3000)
    parser.add_argument("--blocks", type=argtypes.positive_int, default=1)
    parser.add_argument("--concurrent", type=argtypes.non_negative_int, default=0)
    parser.add_argument(
        "--metrics", choices=("on", "off"), default="on", help="record metrics per transfer"
    )
    parser.add_argument("--op", choices=("pull", "push"), default="pull")
    args = parser.parse_args()
    if args.blocks > BLOCKS:
        parser.error(f"--blocks must be at most {BLOCKS} (the peer's blocks)")
    port = free_port()
    # The peer runs the build this process imported (another tree's, to compare builds).
    build = Path(aio_datadist.__file__).resolve().parents[1]
    path = os.pathsep.join([str(build), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    if args.route == "ucx":
        env["AIO_TEST_UCX"] = "1"
    peer = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "peer_prompt.py"),
            str(port),
            str(BLOCKS),
            str(BLOCK),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert peer.stdout is not None and peer.stdout.readline().split()[:1] == [b"ready"]
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    desc = CacheDesc(TENSORS, [BLOCKS, BLOCK], DataType.DT_UINT8, Placement.DEVICE)
    rng = np.random.default_rng(1)
    n = args.calls + WARMUP
    picks = [
        (
            rng.permutation(BLOCKS)[: args.blocks].tolist(),
            rng.permutation(BLOCKS)[: args.blocks].tolist(),
        )
        for _ in range(n)
    ]

    push = args.op == "push"

    def call_args(i: int) -> tuple[list[int], list[int], dict[str, Any]]:
        layer = range(i % TENSORS, i % TENSORS + 1)
        kwargs = {"src_layer_range": layer, "dst_layer_range": layer, "tensor_num_per_layer": 1}
        return picks[i][0], picks[i][1], kwargs

    try:
        if args.face == "sync":
            dd = LLMDataDist(LLMRole.DECODER, 2)
            dd.init(options(args.route, metrics=args.metrics == "on"))
            cm = dd.cache_manager
            cache = cm.allocate_blocks_cache(desc)
            assert dd.link_clusters([info], 5000)[0] == 0
            lat = []
            cpu = time.process_time()
            for i in range(n):
                src, dst, kwargs = call_args(i)
                t = time.perf_counter()
                if push:
                    cm.push_blocks(BlocksCacheKey(1), cache, dst, src, **kwargs)
                else:
                    cm.pull_blocks(BlocksCacheKey(1), cache, src, dst, **kwargs)
                lat.append(time.perf_counter() - t)
            report(args, lat, time.process_time() - cpu)
            dd.finalize()
        else:

            async def run() -> None:
                dd = AsyncLLMDataDist(LLMRole.DECODER, 2)
                await dd.init(
                    options(
                        args.route,
                        600_000 if args.concurrent else 1000,
                        metrics=args.metrics == "on",
                    )
                )
                cm = dd.cache_manager
                cache = await cm.allocate_blocks_cache(desc)
                assert (await dd.link_clusters([info], 5000))[0] == 0
                if args.concurrent:
                    await waves(cm, cache)
                else:
                    lat = []
                    cpu = time.process_time()
                    for i in range(n):
                        src, dst, kwargs = call_args(i)
                        t = time.perf_counter()
                        if push:
                            await cm.push_blocks(BlocksCacheKey(1), cache, dst, src, **kwargs)
                        else:
                            await cm.pull_blocks(BlocksCacheKey(1), cache, src, dst, **kwargs)
                        lat.append(time.perf_counter() - t)
                    report(args, lat, time.process_time() - cpu)
                await dd.finalize()

            async def waves(cm: Any, cache: Any) -> None:
                width = args.concurrent
                for wave in range(args.calls):
                    calls = [call_args(i % n) for i in range(wave * width, (wave + 1) * width)]
                    cpu, t = time.process_time(), time.perf_counter()
                    await asyncio.gather(
                        *(
                            (cm.push_blocks if push else cm.pull_blocks)(
                                BlocksCacheKey(1),
                                cache,
                                *((dst, src) if push else (src, dst)),
                                **kwargs,
                            )
                            for src, dst, kwargs in calls
                        )
                    )
                    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
                    print(
                        f"async {args.route:8} {width} concurrent pulls: wall {wall * 1e3:.1f} ms "
                        f"({wall / width * 1e6:.1f} us/transfer)  "
                        f"cpu/transfer {cpu / width * 1e6:.1f} us"
                    )

            asyncio.run(run())
    finally:
        assert peer.stdin is not None
        peer.stdin.close()
        peer.wait(10)


if __name__ == "__main__":
    main()
