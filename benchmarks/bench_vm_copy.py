#!/usr/bin/env python3
"""Cross-process batched copy (``process_vm_readv``) beside in-process memcpy, same run.

Run: python benchmarks/bench_vm_copy.py [--reps 5]

A child process holds 256 MiB; this process reads it as 4096 scattered 64 KiB rows with
``api.vm_copy_batch`` (one and two threads), and copies the same pattern between two local
buffers with ``api.copy_batch``. Prints GB/s (best of ``reps``) and the ratio; then the
same rows as 64 batches of 64 rows (4 MiB) made one after the other, the shape of the API's
W2 (64 calls), where every batch is split across the threads and pays their wake-ups; the
same reads from the child's shared memory (``api.host_alloc_shared``, what the host runtime's
caches live in) mapped here (``api.host_map_peer``) and copied with memcpy (pid 0), as the
same-host route does; then the
p50 latency of a single 64 KiB read (the one-sided W3 floor without the API's planning):
of one block read again and again (hot), and of a random block of the child's second
256 MiB, an anonymous ``mmap`` of 4 KiB pages like the shared harness's buffers, into a
random block of a local one (cold, as W3 reads).
"""

from __future__ import annotations

import argparse
import mmap
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from aio_datadist import _argtypes as argtypes
from aio_datadist._native import api

SIZE, ROW = 256 << 20, 64 << 10
_CHILD = (
    "import ctypes, mmap, os, numpy as np, sys; from aio_datadist._native import api; "
    "b = np.ones({size}, np.uint8); "
    "m = mmap.mmap(-1, {size}); c = np.frombuffer(m, np.uint8); c[:] = 1; "
    "a, fd = api.host_alloc_shared({size}); "
    "np.ctypeslib.as_array((ctypes.c_uint8 * {size}).from_address(a))[:] = 1; "
    "print(b.ctypes.data, c.ctypes.data, a, fd, os.fstat(fd).st_ino, flush=True); "
    "sys.stdin.read()"
)


def scattered(dst: int, src: int) -> np.ndarray:
    n = SIZE // ROW
    return np.array(
        [[dst + i * ROW, src + (i * 7919 % n) * ROW, ROW] for i in range(n)], dtype=np.uint64
    )


def best_gbps(fn: object, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return SIZE / min(times) / 1e9


def cold_read_us(pid: int, there: int) -> float:
    """p50 of single 64 KiB reads from random blocks of ``there`` (4 KiB pages) into random
    blocks of a local anonymous mapping."""
    mine = mmap.mmap(-1, SIZE)
    local = np.frombuffer(mine, np.uint8)
    local[:] = 2
    rng = np.random.default_rng(3)
    n = SIZE // ROW
    lat = []
    for src, dst in zip(rng.integers(0, n, 310), rng.integers(0, n, 310), strict=True):
        one = np.array(
            [[int(local.ctypes.data) + int(dst) * ROW, there + int(src) * ROW, ROW]],
            dtype=np.uint64,
        )
        t = time.perf_counter_ns()
        api.vm_copy_batch(pid, one, write=False)
        lat.append(time.perf_counter_ns() - t)
    del local
    mine.close()
    return float(np.percentile(lat[10:], 50)) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=argtypes.positive_int, default=5)
    reps = parser.parse_args().reps
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD.format(size=SIZE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    there, paged, _, fd_no, ino = (int(a) for a in child.stdout.readline().split())
    local, src = np.zeros(SIZE, np.uint8), np.ones(SIZE, np.uint8)
    remote_ops = scattered(int(local.ctypes.data), there)
    local_ops = scattered(int(local.ctypes.data), int(src.ctypes.data))
    try:
        mapped = api.host_map_peer(child.pid, fd_no, ino, SIZE)
        mapped_ops = scattered(int(local.ctypes.data), mapped)
        print(f"4096 x 64 KiB scattered rows, 256 MiB, best of {reps}")
        for threads in (1, 2):
            vm = best_gbps(
                lambda t=threads: api.vm_copy_batch(child.pid, remote_ops, write=False, threads=t),
                reps,
            )
            here = best_gbps(
                lambda t=threads: api.vm_copy_batch(0, mapped_ops, write=False, threads=t), reps
            )
            mem = best_gbps(lambda t=threads: api.copy_batch(local_ops, threads=t), reps)
            print(
                f"  threads={threads}: vm_copy_batch {vm:6.2f} GB/s   mapped {here:6.2f} GB/s   "
                f"copy_batch (memcpy) {mem:6.2f} GB/s   ratios {vm / mem:.2f} / {here / mem:.2f}"
            )

        def in_turn(pid: int, ops: np.ndarray) -> Callable[[], None]:
            stream = [ops[k : k + 64] for k in range(0, len(ops), 64)]

            def run() -> None:
                for batch in stream:
                    api.vm_copy_batch(pid, batch, write=False)

            return run

        vm_turn = best_gbps(in_turn(child.pid, remote_ops), reps)
        mapped_turn = best_gbps(in_turn(0, mapped_ops), reps)
        print(
            f"  64 batches of 4 MiB in turn: vm_copy_batch {vm_turn:6.2f} GB/s   mapped "
            f"{mapped_turn:6.2f} GB/s (threads={api.copy_threads()})"
        )
        api.host_free(mapped, SIZE)
        one = np.array([[int(local.ctypes.data), there, ROW]], dtype=np.uint64)
        lat = []
        for _ in range(310):
            t = time.perf_counter_ns()
            api.vm_copy_batch(child.pid, one, write=False)
            lat.append(time.perf_counter_ns() - t)
        print(f"  one 64 KiB read: p50 {np.percentile(lat[10:], 50) / 1e3:.1f} us (hot)")
        print(f"  one 64 KiB read: p50 {cold_read_us(child.pid, paged):.1f} us (cold)")
    except PermissionError as exc:
        print(f"the kernel refuses cross-process memory access here: {exc}")
    finally:
        child.stdin.close()
        child.wait()


if __name__ == "__main__":
    main()
