"""What zero_on_alloc costs: allocate_cache with the option off and on, in one run.

Run: python benchmarks/bench_zero_on_alloc.py [--sizes 64,1024] [--reps 5] [--placement host]

For each cache size (MiB) and each setting, one engine (the blocking API) with a pool just
large enough measures:
  * the first allocation from a fresh pool, whose pages were never handed out (on the host
    runtime they read zero already and are skipped; other runtimes zero them too), and the
    first write of that cache (where the kernel commits its pages);
  * the median allocation of memory an earlier cache filled with 0xAB and released
    (allocate, time, deallocate; ``--reps`` times);
and, as a yardstick, numpy's ``fill(0)`` of the same bytes. Every zeroed cache is checked to
read zero. The cache is one tensor of uint8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import NoReturn

import numpy as np

from aio_datadist import Cache, CacheDesc, DataType, LLMConfig, LLMDataDist, LLMRole, Placement

MiB = 1 << 20
PAGE_SHIFT = 21  # 2 MiB pool pages: every size here is whole pages


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block.
        self.exit(2, f"{self.prog}: error: {message}\n")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not sizes or any(not 1 <= s <= 16 * 1024 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be MiB in [1, 16384]: {text!r}")
    return sizes


def _reps(text: str) -> int:
    try:
        reps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= reps <= 1000:
        raise argparse.ArgumentTypeError(f"reps must be in [1, 1000], got {reps}")
    return reps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _Parser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--sizes", type=_sizes, default=[64, 1024], help="cache sizes in MiB (default 64,1024)"
    )
    parser.add_argument(
        "--reps", type=_reps, default=5, help="timed allocations per case (default 5)"
    )
    parser.add_argument(
        "--placement",
        choices=("host", "device"),
        default="host",
        help="pool of the caches (default host; device is host memory without an accelerator)",
    )
    return parser.parse_args(argv)


def options(pool_bytes: int, placement: Placement, zero: bool) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    pool = json.dumps({"memory_size": pool_bytes, "page_shift": PAGE_SHIFT})
    if placement is Placement.HOST:
        cfg.host_mem_pool_cfg = pool
    else:
        cfg.mem_pool_cfg = pool
    cfg.zero_on_alloc = zero
    return cfg.generate_options()


def zeroed(cache: Cache) -> bool:
    return all(not v.any() for v in cache.as_numpy())


def measure(nbytes: int, placement: Placement, zero: bool, reps: int) -> tuple[float, float, float]:
    """(first allocation from a fresh pool, first write of that cache, median allocation of
    reused memory), seconds."""
    desc = CacheDesc(1, [nbytes], DataType.DT_UINT8, placement)
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    page = 1 << PAGE_SHIFT
    dd.init(options(-(-nbytes // page) * page, placement, zero))
    try:
        cm = dd.cache_manager
        t = time.perf_counter()
        cache = cm.allocate_cache(desc)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        cache.as_numpy()[0][...] = 0xAB
        first_write = time.perf_counter() - t
        times = []
        for i in range(reps):
            if i:
                cache.as_numpy()[0][...] = 0xAB
            cm.deallocate_cache(cache)
            t = time.perf_counter()
            cache = cm.allocate_cache(desc)
            times.append(time.perf_counter() - t)
            if zero and not zeroed(cache):
                sys.exit("a cache allocated with zero_on_alloc does not read zero")
        cm.deallocate_cache(cache)
    finally:
        dd.finalize()
    return cold, first_write, statistics.median(times)


def numpy_fill(nbytes: int, reps: int) -> float:
    buf = np.full(nbytes, 0xAB, np.uint8)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        buf.fill(0)
        times.append(time.perf_counter() - t)
        buf.fill(0xAB)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    placement = Placement.HOST if args.placement == "host" else Placement.DEVICE
    print(f"# {args.placement} caches, median of {args.reps} allocations of reused memory")
    print(
        "| cache | zero_on_alloc | first allocation (fresh pool) ms | its first write ms "
        "| reused memory ms | GB/s |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    summary = []
    for mib in args.sizes:
        nbytes = mib * MiB
        got = {}
        for zero in (False, True):
            cold, first_write, warm = measure(nbytes, placement, zero, args.reps)
            got[zero] = (cold, warm)
            rate = f"{nbytes / warm / 1e9:.1f}" if zero else "-"
            print(
                f"| {mib} MiB | {'on' if zero else 'off'} | {cold * 1e3:.3f} | "
                f"{first_write * 1e3:.1f} | {warm * 1e3:.3f} | {rate} |"
            )
        fill = numpy_fill(nbytes, args.reps)
        print(
            f"| {mib} MiB | numpy fill(0) | - | - | {fill * 1e3:.3f} | {nbytes / fill / 1e9:.1f} |"
        )
        summary.append((mib, got))
    print()
    for mib, got in summary:
        (cold_off, warm_off), (cold_on, warm_on) = got[False], got[True]
        print(
            f"- {mib} MiB: reused memory {warm_on * 1e3:.2f} ms on vs {warm_off * 1e3:.3f} ms off "
            f"(+{(warm_on - warm_off) * 1e3:.2f} ms, {warm_on / warm_off:.1f}x); fresh pool "
            f"{cold_on * 1e3:.1f} ms vs {cold_off * 1e3:.3f} ms"
        )


if __name__ == "__main__":
    main()
