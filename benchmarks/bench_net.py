"""Benchmark: native ``sock_sendv``/``sock_recvv`` against Python's socket calls, same run.

1 GiB crosses a TCP connection on 127.0.0.1 between two processes (a forked sender, this
process receiving), once per method and round:

* ours: the 256 MiB source is sent four times in groups of 16 chunks of 4 MiB, each group
  one ``sock_sendv`` call whose rows visit the chunks in a shuffled order; the receiver
  scatters each group into the same shuffled chunks with one ``sock_recvv`` call;
* python: ``socket.sendall(memoryview(chunk))`` per 4 MiB chunk in the same order, and a
  ``recv_into`` loop per chunk on the receiving side.

Both use the same connection (TCP_NODELAY, default buffers). The receiver's clock runs
from its "go" byte to the last byte; rounds alternate the methods and the median is
printed. After each method the received buffer's crc32 must equal the source's. GB/s
means 1e9 bytes per second. Run::

    python benchmarks/bench_net.py
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
import zlib

import numpy as np
import numpy.typing as npt

from aio_datadist._native import api

CHUNK = 4 << 20
BUF_BYTES = 256 << 20
NCHUNKS = BUF_BYTES // CHUNK
GROUP = 16  # chunks per sock_sendv / sock_recvv call: 64 MiB
PASSES = 4  # 4 x 256 MiB = 1 GiB per method and round
TOTAL = BUF_BYTES * PASSES
ROUNDS = 3
METHODS = ("ours", "python")

U8 = npt.NDArray[np.uint8]


def chunk_order() -> list[int]:
    """The shuffled chunk order both sides agree on (a fixed seed)."""
    return [int(k) for k in np.random.default_rng(1).permutation(NCHUNKS)]


def group_iovs(buf: U8, order: list[int]) -> list[npt.NDArray[np.uint64]]:
    """One ``(addr, len)`` table per group of GROUP chunks of ``buf``, in ``order``."""
    base = buf.ctypes.data
    iovs = []
    for g in range(0, NCHUNKS, GROUP):
        rows = [(base + k * CHUNK, CHUNK) for k in order[g : g + GROUP]]
        iovs.append(np.array(rows, dtype=np.uint64))
    return iovs


def send_all(sock: socket.socket, src: U8, method: str) -> None:
    fd = sock.fileno()
    order = chunk_order()
    if method == "ours":
        iovs = group_iovs(src, order)
        for _ in range(PASSES):
            for iov in iovs:
                api.sock_sendv(fd, iov)
    else:
        view = memoryview(src)  # type: ignore[arg-type]
        for _ in range(PASSES):
            for k in order:
                sock.sendall(view[k * CHUNK : (k + 1) * CHUNK])


def recv_all(sock: socket.socket, dst: U8, method: str) -> None:
    fd = sock.fileno()
    order = chunk_order()
    if method == "ours":
        iovs = group_iovs(dst, order)
        for _ in range(PASSES):
            for iov in iovs:
                api.sock_recvv(fd, iov)
    else:
        view = memoryview(dst)  # type: ignore[arg-type]
        for _ in range(PASSES):
            for k in order:
                got, end = k * CHUNK, (k + 1) * CHUNK
                while got < end:
                    n = sock.recv_into(view[got:end])
                    if n == 0:
                        raise ConnectionError("sender closed early")
                    got += n


def sender(port: int, src: U8) -> None:
    """Child process: connect, then send one method's 1 GiB per "go" byte received."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        api.sock_tune(sock.fileno(), nodelay=True)
        while True:
            cmd = sock.recv(1)
            if cmd in (b"", b"q"):
                return
            send_all(sock, src, METHODS[cmd[0]])


def main() -> None:
    """Time both methods over ROUNDS rounds and print GB/s and the ratio."""
    src = np.random.default_rng(2).integers(0, 256, BUF_BYTES, dtype=np.uint8)
    crc_src = zlib.crc32(src)  # type: ignore[arg-type]
    dst = np.zeros_like(src)  # pages touched here, so faults stay out of the timings
    print(
        f"# bench_net: {platform.machine()}, {os.cpu_count()} CPUs, {TOTAL >> 30} GiB per "
        f"method and round over TCP 127.0.0.1 between two processes, {CHUNK >> 20} MiB chunks, "
        f"{ROUNDS} rounds (median)"
    )
    with socket.create_server(("127.0.0.1", 0)) as srv:
        child = mp.get_context("fork").Process(target=sender, args=(srv.getsockname()[1], src))
        child.start()
        sock, _ = srv.accept()
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    with sock:
        api.sock_tune(sock.fileno(), nodelay=True)
        for _ in range(ROUNDS):
            for i, method in enumerate(METHODS):
                dst[:] = 0
                t0 = time.perf_counter()
                sock.sendall(bytes([i]))
                recv_all(sock, dst, method)
                times[method].append(time.perf_counter() - t0)
                crc = zlib.crc32(dst)  # type: ignore[arg-type]
                assert crc == crc_src, f"{method}: crc32 {crc:#x} != {crc_src:#x}"
        sock.sendall(b"q")
    child.join(10)
    assert child.exitcode == 0, f"sender exited with {child.exitcode}"

    med = {m: statistics.median(ts) for m, ts in times.items()}
    for m in METHODS:
        label = (
            "ours   (sock_sendv/sock_recvv, 16 x 4 MiB rows per call)"
            if m == "ours"
            else "python (socket.sendall/recv_into per 4 MiB chunk)"
        )
        runs = ", ".join(f"{TOTAL / t / 1e9:.2f}" for t in times[m])
        print(f"{label}: {TOTAL / med[m] / 1e9:.2f} GB/s (rounds: {runs})")
    print(f"crc32 verified: {crc_src:#010x}")
    print(f"ratio ours/python: {med['python'] / med['ours']:.2f}x")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__).parse_args()  # --help; no options
    main()
