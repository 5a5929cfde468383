"""``aio-datadist bench``: W1/W2/W3 through the public API between two processes, beside
memcpy and a plain TCP socket measured in the same run.

* **W1**: one pull (or push) of the whole cache: every block of every tensor, one call.
* **W2**: a paged KV pattern: for each of the 64 tensors, up to 64 scattered blocks of
  64 KiB (4096 blocks, 256 MiB at the default size), one call per tensor (awaited together
  on the async face).
* **W3**: one 64 KiB block, ``--iters`` times: p50/p99 latency.

Without ``--connect`` the command starts the serving side itself (this same command with
``--serve``) on 127.0.0.1; with it, run ``aio-datadist bench --serve --listen HOST:PORT`` on
the other host first. The serving side fills its cache with seeded random bytes and the
measuring side checks every byte of W1 and W2 pulls (pushes are pulled back and checked).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from aio_datadist._options import engine_options
from aio_datadist.aio import AsyncLLMDataDist
from aio_datadist.cache import Cache
from aio_datadist.cli._console import Progress
from aio_datadist.cluster import LLMClusterInfo
from aio_datadist.data_type import DataType
from aio_datadist.enums import LLMRole, Placement
from aio_datadist.sync import LLMDataDist
from aio_datadist.types import BlocksCacheKey, CacheDesc

__all__ = ("BLOCK", "Bench", "TENSORS", "run", "serve")

BLOCK = 64 << 10
TENSORS = 64
_W2_BLOCKS = 64
_SERVER_ID, _CLIENT_ID = 1, 2
_REPS = 3


def layout(size_mib: int) -> tuple[int, int]:
    """``(tensors, blocks per tensor)`` of a cache of ``size_mib`` MiB.

    :raises ValueError: under 4 MiB (one block of each tensor) or not a multiple of 4 MiB.
    """
    nbytes = size_mib << 20
    if nbytes < TENSORS * BLOCK or nbytes % (TENSORS * BLOCK):
        raise ValueError(
            f"--size-mib must be a multiple of {TENSORS * BLOCK >> 20}, got {size_mib}"
        )
    return TENSORS, nbytes // (TENSORS * BLOCK)


def _options(*, same_host: bool, size_mib: int, listen: str | None, ucx: bool) -> dict[str, str]:
    return engine_options(
        transport="tcp",
        pool_bytes=(2 * size_mib + 16) << 20,
        timeout_ms=120_000,
        listen=listen,
        same_host=same_host,
        ucx=ucx or None,
    )


def _desc(blocks: int) -> CacheDesc:
    return CacheDesc(TENSORS, [blocks, BLOCK], DataType.DT_UINT8, Placement.DEVICE)


def _pattern(tensor: int, blocks: int) -> np.ndarray:
    """The serving side's bytes of ``tensor``, the same on both sides."""
    return np.random.default_rng(tensor).integers(0, 256, (blocks, BLOCK), dtype=np.uint8)


# -- the serving side ------------------------------------------------------------------------
def serve(listen: str, plain_port: int, size_mib: int, *, same_host: bool, ucx: bool) -> None:
    """Serve a cache of ``size_mib`` MiB at ``listen`` and plain bytes at ``plain_port``
    until stdin closes (or the process is stopped); prints ``ready`` once listening."""
    _, blocks = layout(size_mib)
    dd = LLMDataDist(LLMRole.PROMPT, _SERVER_ID)
    dd.init(_options(same_host=same_host, size_mib=size_mib, listen=listen, ucx=ucx))
    try:
        cache = dd.cache_manager.allocate_blocks_cache(_desc(blocks), BlocksCacheKey(_SERVER_ID, 0))
        for t, view in enumerate(cache.as_numpy()):
            view[...] = _pattern(t, blocks)
        plain = socket.create_server((listen.rsplit(":", 1)[0], plain_port))
        first = cache.as_numpy()[0]
        threading.Thread(target=_plain_server, args=(plain, first), daemon=True).start()
        print("ready", flush=True)
        sys.stdin.read()
    finally:
        dd.finalize()


def _plain_server(listener: socket.socket, source: np.ndarray) -> None:
    """For each connection: read an 8-byte length, send that many bytes (from ``source``,
    repeated) with ``sendall``."""
    view = memoryview(source.reshape(-1).data)
    while True:
        conn, _ = listener.accept()
        with conn:
            header = conn.recv(8, socket.MSG_WAITALL)
            if len(header) < 8:
                continue
            left = int.from_bytes(header, "little")
            while left > 0:
                step = min(left, len(view))
                conn.sendall(view[:step])
                left -= step


# -- the measuring side ----------------------------------------------------------------------
@dataclass
class Bench:
    """What to measure and against whom."""

    host: str
    port: int
    plain_port: int
    size_mib: int
    face: str
    op: str
    same_host: bool
    ucx: bool
    iters: int


def _best(fn: Callable[[], None], reps: int = _REPS) -> tuple[float, float]:
    """(best wall seconds, CPU seconds of that rep) of ``reps`` runs of ``fn``."""
    best = (float("inf"), 0.0)
    for _ in range(reps):
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        took = (time.perf_counter() - wall, time.process_time() - cpu)
        best = min(best, took)
    return best


def _memcpy(nbytes: int) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)
    wall, _ = _best(lambda: np.copyto(dst, src))
    return nbytes / wall / 1e9


def _plain_socket(host: str, port: int, nbytes: int) -> float:
    buf = bytearray(min(nbytes, 4 << 20))
    view = memoryview(buf)

    def once() -> None:
        with socket.create_connection((host, port)) as s:
            s.sendall(nbytes.to_bytes(8, "little"))
            left = nbytes
            while left:
                got = s.recv_into(view[: min(left, len(view))])
                if not got:
                    raise ConnectionError("the serving side closed the plain socket early")
                left -= got

    wall, _ = _best(once)
    return nbytes / wall / 1e9


class _Calls:
    """The transfer calls of one face, as plain blocking functions (the async face's run
    on its own event loop in this thread)."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.key = BlocksCacheKey(_SERVER_ID, 0)
        opts = _options(
            same_host=bench.same_host, size_mib=bench.size_mib, listen=None, ucx=bench.ucx
        )
        info = LLMClusterInfo()
        info.remote_cluster_id = _SERVER_ID
        info.append_local_ip_info("127.0.0.1" if bench.host == "127.0.0.1" else "0.0.0.0", 0)
        info.append_remote_ip_info(bench.host, bench.port)
        _, self.blocks = layout(bench.size_mib)
        self.loop: asyncio.AbstractEventLoop | None = None
        if bench.face == "sync":
            self.dd: Any = LLMDataDist(LLMRole.DECODER, _CLIENT_ID)
            self.dd.init(opts)
            ret, results = self.dd.link_clusters([info], 10_000)
            self.cache: Cache = self.dd.cache_manager.allocate_blocks_cache(_desc(self.blocks))
        else:
            self.loop = asyncio.new_event_loop()
            self.dd = AsyncLLMDataDist(LLMRole.DECODER, _CLIENT_ID)
            ret, results = self.loop.run_until_complete(self._async_init(opts, info))
        if ret != 0:
            self.close()
            raise RuntimeError(f"link to {bench.host}:{bench.port} failed: {results.errors[0]}")

    async def _async_init(self, opts: dict[str, str], info: LLMClusterInfo) -> Any:
        await self.dd.init(opts)
        linked = await self.dd.link_clusters([info], 10_000)
        self.cache = await self.dd.cache_manager.allocate_blocks_cache(_desc(self.blocks))
        return linked

    def transfer(self, calls: list[tuple[range, list[int], list[int]]], op: str) -> None:
        """Run ``(tensors, remote blocks, local blocks)`` calls: in turn on the blocking
        face, awaited together on the async face."""

        def one(cm: Any, tensors: range, remote: list[int], local: list[int]) -> Any:
            kw = {"src_layer_range": tensors, "dst_layer_range": tensors, "tensor_num_per_layer": 1}
            if op == "pull":
                return cm.pull_blocks(self.key, self.cache, remote, local, **kw)
            return cm.push_blocks(self.key, self.cache, local, remote, **kw)

        if self.loop is None:
            for call in calls:
                one(self.dd.cache_manager, *call)
            return

        async def gather() -> None:
            cm = self.dd.cache_manager  # on the loop it belongs to
            await asyncio.gather(*(one(cm, *call) for call in calls))

        self.loop.run_until_complete(gather())

    def timed(self, calls: list[tuple[range, list[int], list[int]]], op: str) -> list[float]:
        """Seconds each of ``calls`` took, made one after the other (awaited in one running
        event loop on the async face, as a serving loop would)."""
        if self.loop is None:
            out = []
            for call in calls:
                started = time.perf_counter()
                self.transfer([call], op)
                out.append(time.perf_counter() - started)
            return out

        async def each() -> list[float]:
            cm = self.dd.cache_manager
            times = []
            for tensors, remote, local in calls:
                kw = {
                    "src_layer_range": tensors,
                    "dst_layer_range": tensors,
                    "tensor_num_per_layer": 1,
                }
                started = time.perf_counter()
                if op == "pull":
                    await cm.pull_blocks(self.key, self.cache, remote, local, **kw)
                else:
                    await cm.push_blocks(self.key, self.cache, local, remote, **kw)
                times.append(time.perf_counter() - started)
            return times

        return self.loop.run_until_complete(each())

    def close(self) -> None:
        if self.loop is None:
            self.dd.finalize()
            return
        self.loop.run_until_complete(self.dd.finalize())
        self.loop.close()


def _check(cache: Cache, blocks: int, picks: list[tuple[range, list[int], list[int]]]) -> None:
    """Every byte that landed in ``cache`` is the serving side's (``picks``: the calls)."""
    views = cache.as_numpy()
    for tensors, remote, local in picks:
        for t in tensors:
            want = _pattern(t, blocks)[remote]
            if not np.array_equal(views[t][local], want):
                raise RuntimeError(f"tensor {t}: the bytes that landed differ from the source")


def _w2_calls(blocks: int, rng: np.random.Generator) -> list[tuple[range, list[int], list[int]]]:
    n = min(_W2_BLOCKS, blocks)
    return [
        (
            range(t, t + 1),
            rng.permutation(blocks)[:n].tolist(),
            rng.permutation(blocks)[:n].tolist(),
        )
        for t in range(TENSORS)
    ]


def run(bench: Bench, step: Progress) -> dict[str, Any]:
    """Measure everything; the results as plain data."""
    nbytes = bench.size_mib << 20
    results: dict[str, Any] = {
        "route": "ucx" if bench.ucx else ("same-host" if bench.same_host else "tcp"),
        "face": bench.face,
        "op": bench.op,
        "size_mib": bench.size_mib,
        "target": f"{bench.host}:{bench.port}",
    }
    results["memcpy_GBps"] = round(_memcpy(nbytes), 3)
    step("memcpy")
    results["socket_GBps"] = round(_plain_socket(bench.host, bench.plain_port, nbytes), 3)
    step("plain socket")
    calls = _Calls(bench)
    try:
        blocks = calls.blocks
        everything = [(range(0, TENSORS), list(range(blocks)), list(range(blocks)))]
        if bench.op == "push":  # the local cache holds the source bytes; pulled back to check
            for t, view in enumerate(calls.cache.as_numpy()):
                view[...] = _pattern(t, blocks)
        wall, cpu = _best(lambda: calls.transfer(everything, bench.op))
        if bench.op == "push":
            for view in calls.cache.as_numpy():
                view[...] = 0
            calls.transfer(everything, "pull")
        _check(calls.cache, blocks, everything)
        results["W1_GBps"] = round(nbytes / wall / 1e9, 3)
        results["W1_cpu_s_per_GB"] = round(cpu / (nbytes / 1e9), 4)
        step("W1")
        rng = np.random.default_rng(7)
        w2 = _w2_calls(blocks, rng)
        w2_bytes = sum(len(c[1]) for c in w2) * BLOCK
        wall, cpu = _best(lambda: calls.transfer(w2, bench.op))
        if bench.op == "pull":
            _check(calls.cache, blocks, w2)
        results["W2_GBps"] = round(w2_bytes / wall / 1e9, 3)
        results["W2_cpu_s_per_GB"] = round(cpu / (w2_bytes / 1e9), 4)
        results["W2_blocks"] = w2_bytes // BLOCK
        step("W2")
        singles = [
            (
                range(i % TENSORS, i % TENSORS + 1),
                [int(rng.integers(blocks))],
                [int(rng.integers(blocks))],
            )
            for i in range(bench.iters + 10)
        ]
        lat = calls.timed(singles, bench.op)
        us = np.array(lat[10:]) * 1e6
        results["W3_p50_us"] = round(float(np.percentile(us, 50)), 1)
        results["W3_p99_us"] = round(float(np.percentile(us, 99)), 1)
        step("W3")
        results["link_routes"] = list(calls.dd.stats().link_routes.get(_SERVER_ID, ()))
    finally:
        calls.close()
    for w in ("W1", "W2"):
        results[f"{w}_vs_memcpy"] = round(results[f"{w}_GBps"] / results["memcpy_GBps"], 3)
        results[f"{w}_vs_socket"] = round(results[f"{w}_GBps"] / results["socket_GBps"], 3)
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_server(size_mib: int, *, same_host: bool, ucx: bool) -> Iterator[tuple[int, int]]:
    """The serving side as a child process on 127.0.0.1: ``(port, plain port)``."""
    port, plain = _free_port(), _free_port()
    args = [sys.executable, "-m", "aio_datadist", "bench", "--serve"]
    args += ["--listen", f"127.0.0.1:{port}", "--plain-port", str(plain)]
    args += [
        "--size-mib",
        str(size_mib),
        "--route",
        "ucx" if ucx else ("samehost" if same_host else "tcp"),
    ]
    child = subprocess.Popen(
        args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"the serving side did not start (exit status {child.wait(30)})")
        yield port, plain
    finally:
        if child.stdin is not None:
            child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()
