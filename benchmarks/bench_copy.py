"""Benchmark: native ``copy_batch`` against numpy in the same run.

Cases:

* contiguous: one 64 MiB copy (ours: a one-row batch; numpy: ``np.copyto``);
* paged: 4096 blocks of 64 KiB (256 MiB) scattered by random permutations of block indices
  on both sides (ours: one ``copy_batch`` call; numpy: fancy-index copy
  ``dst[idx_d] = src[idx_s]`` on a (4096, 65536) uint8 view, and a Python loop of
  ``np.copyto`` per block).

Ours runs with threads=1 and with the library default. Each timing is the median of 5
repetitions after one warm-up; GB/s means 1e9 bytes per second. Run::

    python benchmarks/bench_copy.py
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from aio_datadist._native import api

REPS = 5
CONTIG_BYTES = 64 << 20
BLOCK = 64 << 10
NBLOCKS = 4096

U8 = npt.NDArray[np.uint8]


def median_seconds(fn: Callable[[], None], reps: int = REPS) -> float:
    """Median wall time of ``fn`` over ``reps`` runs, after one untimed warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def filled(nbytes: int, seed: int) -> U8:
    """A buffer with every page touched, so page faults stay out of the timings."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def bench_contiguous(threads_default: int) -> list[tuple[str, str, float]]:
    src = filled(CONTIG_BYTES, 1)
    dst = np.zeros_like(src)
    ops = np.array([[dst.ctypes.data, src.ctypes.data, CONTIG_BYTES]], dtype=np.uint64)
    rows = [
        ("numpy.copyto", "1", median_seconds(lambda: np.copyto(dst, src))),
        ("copy_batch", "1", median_seconds(lambda: api.copy_batch(ops, threads=1))),
        (
            "copy_batch",
            str(threads_default),
            median_seconds(lambda: api.copy_batch(ops, threads=threads_default)),
        ),
    ]
    assert np.array_equal(dst, src)
    return [(f"{name} (threads={th})", "contiguous", t) for name, th, t in rows]


def bench_paged(threads_default: int) -> list[tuple[str, str, float]]:
    rng = np.random.default_rng(2)
    src = filled(NBLOCKS * BLOCK, 3).reshape(NBLOCKS, BLOCK)
    dst = np.zeros_like(src)
    idx_s = rng.permutation(NBLOCKS)
    idx_d = rng.permutation(NBLOCKS)
    ops = np.empty((NBLOCKS, 3), dtype=np.uint64)
    ops[:, 0] = dst.ctypes.data + idx_d.astype(np.uint64) * BLOCK
    ops[:, 1] = src.ctypes.data + idx_s.astype(np.uint64) * BLOCK
    ops[:, 2] = BLOCK
    pairs = list(zip(idx_d.tolist(), idx_s.tolist(), strict=True))

    def fancy() -> None:
        dst[idx_d] = src[idx_s]

    def loop() -> None:
        for d, s in pairs:
            np.copyto(dst[d], src[s])

    def check() -> None:
        assert np.array_equal(dst[idx_d], src[idx_s])
        dst[:] = 0

    results = []
    for name, fn in (
        ("numpy fancy index", fancy),
        ("numpy.copyto loop", loop),
        ("copy_batch (threads=1)", lambda: api.copy_batch(ops, threads=1)),
        (
            f"copy_batch (threads={threads_default})",
            lambda: api.copy_batch(ops, threads=threads_default),
        ),
    ):
        results.append((name, "paged", median_seconds(fn)))
        check()
    return results


def main() -> None:
    """Run both cases and print a markdown table followed by the ratios."""
    threads_default = api.copy_threads()
    print(
        f"# bench_copy: {platform.machine()}, {os.cpu_count()} CPUs, numpy {np.__version__}, "
        f"default copy threads {threads_default}, split threshold {api.SPLIT_THRESHOLD >> 20} MiB"
    )
    print()
    rows = bench_contiguous(threads_default) + bench_paged(threads_default)
    sizes = {"contiguous": CONTIG_BYTES, "paged": NBLOCKS * BLOCK}
    print("| case | method | median ms | GB/s |")
    print("|---|---|---:|---:|")
    for name, case, t in rows:
        label = "contiguous 64 MiB" if case == "contiguous" else "paged 4096 x 64 KiB"
        print(f"| {label} | {name} | {t * 1e3:.2f} | {sizes[case] / t / 1e9:.2f} |")
    print()
    by = {(case, name): t for name, case, t in rows}
    d = threads_default
    ratios = [
        ("contiguous", "copy_batch (threads=1)", "numpy.copyto (threads=1)"),
        ("contiguous", f"copy_batch (threads={d})", "numpy.copyto (threads=1)"),
        ("paged", "copy_batch (threads=1)", "numpy fancy index"),
        ("paged", f"copy_batch (threads={d})", "numpy fancy index"),
        ("paged", "copy_batch (threads=1)", "numpy.copyto loop"),
        ("paged", f"copy_batch (threads={d})", "numpy.copyto loop"),
    ]
    print("Speed-ups (time of numpy / time of ours):")
    for case, ours, theirs in ratios:
        print(f"- {case}: {ours} vs {theirs}: {by[(case, theirs)] / by[(case, ours)]:.2f}x")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()  # --help; no options
    main()
