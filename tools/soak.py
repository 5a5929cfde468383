#!/usr/bin/env python3
"""Soak: thousands of mixed transfers between two processes, with random cancellations.

    python tools/soak.py --transfers 10000 --seed 1 [--route link|samehost|ucx] [--json]

A prompt process (``tests/peer_prompt.py``) serves a paged cache and a batch row. This
process runs two decoders linked to it, the blocking ``LLMDataDist`` (calls on worker
threads) and an ``AsyncLLMDataDist`` (several tasks at once), and drives a random mix of
``pull_blocks``, ``push_blocks``, ``pull_cache`` and ``push_cache``; async calls are
cancelled at random points. ``--route ucx`` enables UCX at both ends (the same-host route
off), so the transfers take the UCX route; ``UCX_TLS`` in the environment picks its
transports for both processes. Every completed pull is checked byte for byte; every completed
push is read back and checked. Pulls read blocks no push writes; each worker pushes into
blocks of its own.

Checked at the end (the exit status is 1 when one fails): no byte mismatch, no failure
other than cancellations, both decoders' pools back to zero, and flat memory: the private
resident memory (``RssAnon``) of either process grew by less than ``--rss-slack-mib`` between
the sample taken after warm-up (10% of the transfers) and the end. Caches live in shared
memory (``RssShmem``), which fills as the pools are touched, and a same-host peer's caches
mapped here count there too: neither is a leak.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aio_datadist import (  # noqa: E402
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist import _argtypes as argtypes  # noqa: E402
from tests.peer_prompt import ROW_BYTES, TENSORS, pattern, read_ready  # noqa: E402

BLOCKS, BLOCK_BYTES = 64, 64 * 1024
PULL_BLOCKS = 32  # blocks [0, 32) are only read; pushes go to [32, 64)
PUSH_SPAN = 4  # push blocks per worker
ASYNC_WORKERS = 5
MiB = 1 << 20


def rss_mib(pid: int) -> float:
    """Private (anonymous) resident memory of process ``pid`` in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def options(route: str) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = 10_000
    cfg.same_host = route == "samehost"
    cfg.ucx = route == "ucx"
    cfg.mem_pool_cfg = json.dumps({"memory_size": 256 * MiB})
    return dict(cfg.generate_options())


@dataclass
class Tally:
    """What happened, by outcome."""

    done: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    cancelled: int = 0
    mismatches: list[str] = field(default_factory=list)
    bytes_moved: int = 0


class Worker:
    """One stream of transfers through one face, with its own push blocks and caches."""

    def __init__(self, index: int, cm: Any, blocking: bool, rng: random.Random) -> None:
        self.index, self.cm, self.blocking, self.rng = index, cm, blocking, rng
        self.own_blocks = list(
            range(PULL_BLOCKS + PUSH_SPAN * index, PULL_BLOCKS + PUSH_SPAN * (index + 1))
        )
        self.blocks: Any = None
        self.rows: Any = None

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        fn = getattr(self.cm, name)
        if self.blocking:
            return await asyncio.to_thread(fn, *args, **kwargs)
        result = fn(*args, **kwargs)
        if asyncio.iscoroutine(result):
            return await result
        try:
            status = await result  # push_blocks: a CacheTask
        except asyncio.CancelledError:
            # Cancelling the wait leaves the push running, and it still reads the source
            # blocks: they are reused only once it has ended.
            await result
            raise
        if status != LLMStatusCode.LLM_SUCCESS:
            raise LLMException(f"{name}: {status}", status_code=status)
        return None

    async def setup(self) -> None:
        desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.DEVICE)
        self.blocks = await self.call("allocate_blocks_cache", desc)
        self.rows = await self.call(
            "allocate_cache", CacheDesc(TENSORS, [1, ROW_BYTES], DataType.DT_UINT8)
        )

    async def teardown(self) -> None:
        await self.call("deallocate_blocks_cache", self.blocks)
        await self.call("deallocate_cache", self.rows)

    async def one(self, tally: Tally, cancel_rate: float) -> None:
        """One random transfer (and its check); cancelled at a random point now and then."""
        kind = self.rng.choice(("pull_blocks", "push_blocks", "pull_cache", "push_cache"))
        run = getattr(self, kind)
        if self.blocking or self.rng.random() >= cancel_rate:
            try:
                tally.bytes_moved += await run(tally)
                tally.done[kind] += 1
            except LLMException as exc:
                tally.failed[f"{kind}:{exc.status_code.name}"] += 1
            return
        task = asyncio.ensure_future(run(tally))
        await asyncio.sleep(self.rng.uniform(0, 0.002))
        task.cancel()
        try:
            tally.bytes_moved += await task
            tally.done[kind] += 1
        except asyncio.CancelledError:
            tally.cancelled += 1
        except LLMException as exc:
            tally.failed[f"{kind}:{exc.status_code.name}"] += 1

    def _views(self) -> list[np.ndarray]:
        return self.blocks.as_numpy()

    async def pull_blocks(self, tally: Tally) -> int:
        n = self.rng.randint(1, 8)
        src = self.rng.sample(range(PULL_BLOCKS), n)
        dst = self.rng.sample(range(BLOCKS), n)
        await self.call("pull_blocks", BlocksCacheKey(1, 0), self.blocks, src, dst)
        for t, view in enumerate(self._views()):
            want = pattern(t, BLOCKS, BLOCK_BYTES)[src]
            if not np.array_equal(view[dst], want):
                tally.mismatches.append(f"worker {self.index}: pull_blocks {src}->{dst} tensor {t}")
        return n * TENSORS * BLOCK_BYTES

    async def push_blocks(self, tally: Tally) -> int:
        block = self.rng.choice(self.own_blocks)
        value = self.rng.randrange(256)
        for view in self._views():
            view[0] = value
        await self.call("push_blocks", BlocksCacheKey(1, 0), self.blocks, [0], [block])
        await self.call("pull_blocks", BlocksCacheKey(1, 0), self.blocks, [block], [1])
        if not all((view[1] == value).all() for view in self._views()):
            tally.mismatches.append(f"worker {self.index}: push_blocks into block {block}")
        return 2 * TENSORS * BLOCK_BYTES

    async def pull_cache(self, tally: Tally) -> int:
        await self.call("pull_cache", CacheKeyByIdAndIndex(1, 2, 0), self.rows)
        if [int(v[0, 0]) for v in self.rows.as_numpy()] != [t + 7 for t in range(TENSORS)]:
            tally.mismatches.append(f"worker {self.index}: pull_cache")
        return TENSORS * ROW_BYTES

    async def push_cache(self, tally: Tally) -> int:
        for t, view in enumerate(self.rows.as_numpy()):
            view[...] = t + 7  # what the peer's row holds: pulls stay checkable
        await self.call("push_cache", CacheKeyByIdAndIndex(1, 2, 0), self.rows, 0)
        return TENSORS * ROW_BYTES


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["AIO_DATADIST_RUNTIME"] = "host"
    if args.route == "ucx":
        env["AIO_TEST_UCX"] = "1"
    os.environ["AIO_DATADIST_RUNTIME"] = "host"
    peer = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests" / "peer_prompt.py"),
            "0",  # the peer reports the port it bound
            str(BLOCKS),
            str(BLOCK_BYTES),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert peer.stdout is not None
    port = read_ready(peer.stdout)
    blocking = LLMDataDist(LLMRole.DECODER, 2)
    blocking.init(options(args.route))
    awaited = AsyncLLMDataDist(LLMRole.DECODER, 3)
    await awaited.init(options(args.route))
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    assert blocking.link_clusters([info], 5000)[0] == LLMStatusCode.LLM_SUCCESS
    assert (await awaited.link_clusters([info], 5000))[0] == LLMStatusCode.LLM_SUCCESS
    workers = [Worker(0, blocking.cache_manager, True, random.Random(rng.random()))] + [
        Worker(i, awaited.cache_manager, False, random.Random(rng.random()))
        for i in range(1, 1 + ASYNC_WORKERS)
    ]
    for w in workers:
        await w.setup()
    tally = Tally()
    remaining = args.transfers
    warm = max(1, args.transfers // 10)
    samples: dict[str, dict[str, float]] = {
        "start": {"self": rss_mib(os.getpid()), "peer": rss_mib(peer.pid)}
    }
    started = time.perf_counter()

    async def drive(w: Worker) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await w.one(tally, args.cancel_rate)
            if "warm" not in samples and args.transfers - remaining >= warm:
                samples["warm"] = {"self": rss_mib(os.getpid()), "peer": rss_mib(peer.pid)}

    await asyncio.gather(*(drive(w) for w in workers))
    elapsed = time.perf_counter() - started
    samples["end"] = {"self": rss_mib(os.getpid()), "peer": rss_mib(peer.pid)}
    for w in workers:
        await w.teardown()
    pools = {
        "blocking": blocking.cache_manager.pool_stats(Placement.DEVICE).used,
        "async": awaited.cache_manager.pool_stats(Placement.DEVICE).used,
    }
    blocking.finalize()
    await awaited.finalize()
    assert peer.stdin is not None
    peer.stdin.close()
    peer.wait(10)
    warm_sample = samples.get("warm", samples["start"])
    growth = {k: samples["end"][k] - warm_sample[k] for k in ("self", "peer")}
    problems = list(tally.mismatches[:10])
    if tally.failed:
        problems.append(f"failures: {dict(tally.failed)}")
    if any(pools.values()):
        problems.append(f"pool not back to zero: {pools}")
    if any(g > args.rss_slack_mib for g in growth.values()):
        problems.append(f"RSS grew {growth} MiB after warm-up (slack {args.rss_slack_mib})")
    return {
        "transfers": args.transfers,
        "route": args.route,
        "seed": args.seed,
        "completed": dict(tally.done),
        "cancelled": tally.cancelled,
        "failed": dict(tally.failed),
        "mismatches": len(tally.mismatches),
        "elapsed_s": round(elapsed, 2),
        "transfers_per_s": round(args.transfers / elapsed, 1),
        "gb_moved": round(tally.bytes_moved / 1e9, 3),
        "rss_mib": {k: {p: round(v, 1) for p, v in s.items()} for k, s in samples.items()},
        "rss_growth_after_warmup_mib": {k: round(v, 1) for k, v in growth.items()},
        "pool_used_at_end": pools,
        "problems": problems,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transfers", type=argtypes.positive_int, default=10_000)
    parser.add_argument("--seed", type=argtypes.non_negative_int, default=1)
    parser.add_argument("--cancel-rate", type=argtypes.fraction, default=0.1)
    parser.add_argument("--route", choices=("link", "samehost", "ucx"), default="link")
    parser.add_argument("--rss-slack-mib", type=argtypes.non_negative_float, default=32.0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    report = asyncio.run(soak(args))
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
