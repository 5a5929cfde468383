#!/usr/bin/env python3
"""Benchmark: device blocks between two processes on one GPU, over each route.

Run: python benchmarks/bench_cuda_routes.py [--route all|link|ipc|ucx|ucx-tcp]
                                            [--blocks 1024] [--calls 300]

A prompt process (``tests/peer_device.py``) serves a device blocks cache of 4 tensors x
``--blocks`` blocks of 64 KiB under the CUDA runtime; a decoder process (this script, once per
route) links to it over TCP on 127.0.0.1 and pulls into its own device blocks cache through the
blocking API:

* bulk: every block in a random order, one call (4 x 64 MiB with the defaults), median of 5;
  then the same blocks pushed back (``push_blocks``), median of 5;
* single: one block (4 x 64 KiB) per call, ``--calls`` calls after 50 warm-ups, p50 and p99.

Routes: ``link`` (device bytes staged through pinned buffers and the socket), ``ipc`` (the
same-host route: the peer's device memory mapped through CUDA IPC), ``ucx`` (UCP RMA on CUDA
memory, UCX's own choice of transports: ``cuda_ipc`` on one GPU) and ``ucx-tcp`` (UCX over
``tcp,cuda_copy,self``). ``--route all`` runs each in a fresh process and, for scale, times
torch's device-to-device copy of the bulk bytes in one process (``dst.copy_(src)``) and its
gather of the same blocks (``index_select``). Needs a CUDA device and, for the torch figures,
torch; exits 0 with a message otherwise; the UCX routes need UCX (``aio_datadist[ucx]``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aio_datadist import _argtypes as argtypes  # noqa: E402

BLOCK = 64 << 10
TENSORS = 4
ROUTES = ("link", "ipc", "ucx", "ucx-tcp")
UCX_TCP = "tcp,cuda_copy,self"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_route(route: str, blocks: int, calls: int) -> dict[str, float | str]:
    """Pull over ``route`` from a fresh peer; the figures as a dict."""
    os.environ["AIO_DATADIST_RUNTIME"] = "cuda"
    if route == "ucx-tcp":
        os.environ["UCX_TLS"] = UCX_TCP
    from aio_datadist import (
        BlocksCacheKey,
        CacheDesc,
        DataType,
        LLMClusterInfo,
        LLMConfig,
        LLMDataDist,
        LLMRole,
        Placement,
    )

    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if route.startswith("ucx"):
        env["AIO_TEST_UCX"] = "1"
    peer = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "peer_device.py"),
            str(port),
            str(blocks),
            str(BLOCK),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert peer.stdout is not None and peer.stdin is not None
    for line in peer.stdout:  # UCX prints its own warnings to stdout
        if line.split()[:1] == [b"ready"]:
            break
    else:
        raise SystemExit(f"bench_cuda_routes: the peer did not start (exit {peer.wait()})")
    total = TENSORS * blocks * BLOCK
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.transport = "tcp"
    cfg.same_host = route == "ipc"
    cfg.ucx = route.startswith("ucx")
    cfg.mem_pool_cfg = json.dumps({"memory_size": total + (64 << 20)})
    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(dict(cfg.generate_options()))
    try:
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        dd.link_clusters([info], 5000)
        cm = dd.cache_manager
        desc = CacheDesc(TENSORS, [blocks, BLOCK], DataType.DT_UINT8, Placement.DEVICE)
        cache = cm.allocate_blocks_cache(desc)
        key = BlocksCacheKey(1, 0)
        order = [int(b) for b in np.random.default_rng(1).permutation(blocks)]
        every = list(range(blocks))
        bulk = []
        cm.pull_blocks(key, cache, order, every)
        for _ in range(5):
            start = time.perf_counter()
            cm.pull_blocks(key, cache, order, every)
            bulk.append(time.perf_counter() - start)
        push = []
        for _ in range(6):
            start = time.perf_counter()
            cm.push_blocks(key, cache, every, order)
            push.append(time.perf_counter() - start)
        push = push[1:]
        single = []
        for i in range(calls + 50):
            b = order[i % blocks]
            start = time.perf_counter()
            cm.pull_blocks(key, cache, [b], [b])
            single.append(time.perf_counter() - start)
        single = sorted(single[50:])
        cm.deallocate_blocks_cache(cache)
    finally:
        dd.finalize()
        peer.stdin.close()
        peer.wait(30)
    return {
        "route": route,
        "bulk_gbps": total / statistics.median(bulk) / 1e9,
        "bulk_ms": statistics.median(bulk) * 1e3,
        "push_gbps": total / statistics.median(push) / 1e9,
        "single_p50_us": single[len(single) // 2] * 1e6,
        "single_p99_us": single[int(len(single) * 0.99)] * 1e6,
    }


def torch_scale(blocks: int) -> None:
    """Torch's copies of the bulk bytes inside one process, for scale."""
    try:
        import torch
    except ImportError:
        print("torch is not installed: no in-process figures for scale")
        return
    total = TENSORS * blocks * BLOCK
    src = torch.randint(0, 255, (TENSORS * blocks, BLOCK), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    index = torch.randperm(TENSORS * blocks, device="cuda")

    def timed(fn: object) -> float:
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()  # type: ignore[operator]
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    copy = timed(lambda: dst.copy_(src))
    gather = timed(lambda: torch.index_select(src, 0, index, out=dst))
    for name, seconds in (("torch copy_ (one process)", copy), ("torch index_select", gather)):
        print(f"{name:<28} bulk {total / seconds / 1e9:7.2f} GB/s ({seconds * 1e3:.3f} ms)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", choices=("all", *ROUTES), default="all")
    parser.add_argument("--blocks", type=argtypes.positive_int, default=1024)
    parser.add_argument("--calls", type=argtypes.positive_int, default=300)
    parser.add_argument("--json", action="store_true", help="print one JSON line (one route)")
    args = parser.parse_args()
    from aio_datadist._runtime.base import RuntimeUnavailable
    from aio_datadist._runtime.cuda import open_runtime

    try:
        open_runtime(0).close()
    except RuntimeUnavailable as exc:
        print(f"bench_cuda_routes: the CUDA runtime is unavailable: {exc}")
        return 0
    if args.route != "all":
        result = one_route(args.route, args.blocks, args.calls)
        print(json.dumps(result) if args.json else result)
        return 0
    from aio_datadist._routes.ucx import worker as ucx

    routes = ROUTES if ucx.available() is None else ROUTES[:2]
    total = TENSORS * args.blocks * BLOCK
    print(
        f"bulk: {TENSORS} x {args.blocks} blocks of 64 KiB = {total >> 20} MiB per call; "
        f"single: {TENSORS} x 64 KiB per call"
    )
    for route in routes:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--route",
                route,
                "--blocks",
                str(args.blocks),
                "--calls",
                str(args.calls),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode != 0:
            print(f"{route:<28} failed: {out.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{route:<28} bulk {r['bulk_gbps']:7.2f} GB/s ({r['bulk_ms']:.3f} ms)   "
            f"push {r['push_gbps']:7.2f} GB/s   "
            f"single p50 {r['single_p50_us']:7.1f} us  p99 {r['single_p99_us']:7.1f} us"
        )
    torch_scale(args.blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
