#!/usr/bin/env python3
"""One 64 KiB block over TCP, blocking: our ``pull_blocks``/``push_blocks`` beside a plain
socket floor, alternated in one run.

Run: python benchmarks/bench_round_trip.py [--pairs 4] [--calls 200] [--op read|write]

The W3 pattern of the shared harness, two processes on 127.0.0.1: each side holds 2 GiB
(64 tensors x 512 blocks of 64 KiB, pre-faulted), and every call moves one random block
of one random tensor into a random block of the same tensor on the other side. Each pair
measures, one after the other:

* ``floor``: two Python processes with plain sockets, both busy-polling with
  ``MSG_DONTWAIT``: a 16-byte request, then a 40-byte header and the 64 KiB payload in one
  ``sendmsg`` (read), or the request, header and payload one way and a 40-byte answer back
  (write). No library, no checks: what this machine charges for the round trip itself.
* ``aio``: the same calls through ``LLMDataDist`` over TCP (the same-host route off).

Prints the p50 and p99 latency of each phase (after 10 warm-up calls) and the p50 ratio.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import time

import numpy as np

os.environ.setdefault("AIO_DATADIST_RUNTIME", "host")  # numpy memory stands in for caches

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
from aio_datadist import _argtypes as argtypes

TENSORS, BLOCKS, BLOCK = 64, 512, 64 << 10
TENSOR = BLOCKS * BLOCK
HEADER = 40
WARM = 10
_START, _STOP = 1 << 63, (1 << 63) + 1


def desc() -> CacheDesc:
    return CacheDesc(TENSORS, [BLOCKS, BLOCK], DataType.DT_UINT8, Placement.DEVICE)


def options(listen: str | None = None) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = 60_000
    cfg.same_host = False
    if listen:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


def _spin_recv(conn: socket.socket, view: memoryview) -> None:
    """Receive exactly ``len(view)`` bytes, busy-polling."""
    got = 0
    while got < len(view):
        try:
            n = conn.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            continue
        if n == 0:
            raise ConnectionError("the other side closed the socket")
        got += n


def _floor_server(conn: socket.socket, mem: np.ndarray) -> None:
    """Answer floor requests: blocking between phases, busy-polling within one."""
    view, req = mem.data, bytearray(16)
    header = bytes(HEADER)
    while True:
        if conn.recv_into(req, 16, socket.MSG_WAITALL) < 16:
            return
        if int.from_bytes(req[:8], "little") != _START:
            raise ValueError("a floor phase must begin with START")
        while True:
            _spin_recv(conn, memoryview(req))
            off, write = int.from_bytes(req[:8], "little"), req[8]
            if off == _STOP:
                break
            if write:
                _spin_recv(conn, memoryview(bytearray(HEADER)))
                _spin_recv(conn, view[off : off + BLOCK])
                conn.sendall(header)
            else:
                conn.sendmsg([header, view[off : off + BLOCK]])


def serve(port: int) -> None:
    """The prompt side: a blocks cache served by the library, and the floor's socket."""
    mem = np.full(TENSORS * TENSOR, 1, dtype=np.uint8)
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(options(f"127.0.0.1:{port}"))
    base = int(mem.ctypes.data)
    dd.cache_manager.register_blocks_cache(
        desc(), [base + t * TENSOR for t in range(TENSORS)], BlocksCacheKey(1, 0)
    )
    with socket.create_server(("127.0.0.1", 0)) as listener:
        print("ready", listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _floor_server(conn, mem)
    dd.finalize()


def _plan(rng: random.Random, n: int) -> list[tuple[int, int, int]]:
    """(tensor, local block, remote block) of ``n`` calls."""
    return [
        (rng.randrange(TENSORS), rng.randrange(BLOCKS), rng.randrange(BLOCKS)) for _ in range(n)
    ]


def _percentiles(seconds: list[float]) -> tuple[float, float]:
    us = np.array(seconds[WARM:]) * 1e6
    return float(np.percentile(us, 50)), float(np.percentile(us, 99))


def floor_phase(
    conn: socket.socket, mem: np.ndarray, calls: list[tuple[int, int, int]], write: bool
) -> list[float]:
    view, header = mem.data, memoryview(bytearray(HEADER))
    conn.sendall(_START.to_bytes(8, "little") + bytes(8))
    times = []
    for tensor, local, remote in calls:
        lo, ro = tensor * TENSOR + local * BLOCK, tensor * TENSOR + remote * BLOCK
        request = ro.to_bytes(8, "little") + bytes([write]) + bytes(7)
        start = time.perf_counter()
        if write:
            conn.sendmsg([request, bytes(HEADER), view[lo : lo + BLOCK]])
            _spin_recv(conn, header)
        else:
            conn.sendall(request)
            _spin_recv(conn, header)
            _spin_recv(conn, view[lo : lo + BLOCK])
        times.append(time.perf_counter() - start)
    conn.sendall(_STOP.to_bytes(8, "little") + bytes(8))
    return times


def aio_phase(
    dd: LLMDataDist, cache: object, calls: list[tuple[int, int, int]], write: bool
) -> list[float]:
    cm, key = dd.cache_manager, BlocksCacheKey(1, 0)
    times = []
    for tensor, local, remote in calls:
        layers = range(tensor, tensor + 1)
        start = time.perf_counter()
        if write:
            cm.push_blocks(
                key,
                cache,
                [local],
                [remote],
                src_layer_range=layers,
                dst_layer_range=layers,
                tensor_num_per_layer=1,
            )
        else:
            cm.pull_blocks(
                key,
                cache,
                [remote],
                [local],
                src_layer_range=layers,
                dst_layer_range=layers,
                tensor_num_per_layer=1,
            )
        times.append(time.perf_counter() - start)
    return times


def _check_and_reset(mem: np.ndarray, calls: list[tuple[int, int, int]], write: bool) -> None:
    """After reads, every block read holds the prompt side's bytes (1); put back 2s."""
    if write:
        return
    for tensor, local in {(tensor, local) for tensor, local, _ in calls}:
        block = mem[tensor * TENSOR + local * BLOCK :][:BLOCK]
        if not (block == 1).all():
            raise RuntimeError(f"block {local} of tensor {tensor} was not read whole")
        block[:] = 2


def measure(port: int, raw_port: int, pairs: int, n: int, write: bool) -> None:
    mem = np.full(TENSORS * TENSOR, 2, dtype=np.uint8)
    base = int(mem.ctypes.data)
    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(options())
    cache = dd.cache_manager.register_blocks_cache(
        desc(), [base + t * TENSOR for t in range(TENSORS)], BlocksCacheKey(2, 0)
    )
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    dd.link_clusters([info], 5000)
    rng = random.Random(1)
    op = "write" if write else "read"
    ratios = []
    try:
        with socket.create_connection(("127.0.0.1", raw_port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for pair in range(pairs):
                calls = _plan(rng, n + WARM)
                floor = _percentiles(floor_phase(conn, mem, calls, write))
                _check_and_reset(mem, calls, write)
                calls = _plan(rng, n + WARM)
                ours = _percentiles(aio_phase(dd, cache, calls, write))
                _check_and_reset(mem, calls, write)
                ratios.append(ours[0] / floor[0])
                print(
                    f"pair {pair} {op}: floor p50 {floor[0]:6.1f} us p99 {floor[1]:7.1f} | "
                    f"aio p50 {ours[0]:6.1f} us p99 {ours[1]:7.1f} | ratio {ratios[-1]:.2f}",
                    flush=True,
                )
    finally:
        dd.unlink_clusters([info], 5000)
        dd.cache_manager.unregister_cache(cache.cache_id)
        dd.finalize()
    print(f"{op}: median p50 ratio aio / floor {float(np.median(ratios)):.2f} over {pairs} pairs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", type=argtypes.port, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=argtypes.positive_int, default=4)
    parser.add_argument("--calls", type=argtypes.positive_int, default=200)
    parser.add_argument("--op", choices=("read", "write"), default="read")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    peer = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert peer.stdout is not None
        word, raw_port = peer.stdout.readline().split()
        assert word == "ready"
        measure(port, int(raw_port), args.pairs, args.calls, args.op == "write")
        peer.wait(60)
    finally:
        if peer.poll() is None:
            peer.kill()


if __name__ == "__main__":
    main()
