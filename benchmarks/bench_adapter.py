#!/usr/bin/env python3
"""aio_datadist in the shared peer harness (W1/W2/W3, two processes on 127.0.0.1).

Run beside the peers, in one run (compare only figures of one run):

    A=$PWD/benchmarks/bench_adapter.py
    EXTRA="$A:aio-tcp-async $A:aio-tcp-blocking $A:aio-samehost-async $A:aio-samehost-blocking" \\
        ../shared/bench/run_peers.sh

The harness's ``PY`` must have aio_datadist installed (``$PY -m pip install -e .``, or this
tree on ``PYTHONPATH``; the ``aio-ucx-*`` variants need UCX: the ``[ucx]`` extra, or
``AIO_DATADIST_UCX``). Its ``common.py`` is found through ``AIO_BENCH_HARNESS`` or at
``../shared/bench/peers``.

Variants: ``aio-tcp-*`` (every byte on the TCP link), ``aio-samehost-*`` (one-sided with
``process_vm_readv``), ``aio-ucx-*`` (the UCX route with the transports UCX picks: cma on one
host) and ``aio-ucx-tcp-*`` (the UCX route with UCX's tcp transport only), each through the
async face and the blocking one.

CPU time: each run also prints one ``AIO_CPU`` line: for W1 and W2, the bytes moved and the
CPU seconds both processes spent while the initiator's calls ran (the initiator's whole
process; the target's threads but its main one, which runs the harness's checksums, read
from ``/proc``), and their sum per GB; W3 is timed without sampling. The line also names
the link's routes, in order (a UCX route that could not be made leaves the link's).

Two hosts, simulated (``benchmarks/bench_veth.py``): with ``AIO_BENCH_TARGET_NETNS`` the
target process enters that network namespace before it starts, listens on
``AIO_BENCH_LISTEN_IP`` and applies ``AIO_BENCH_TARGET_ENV`` (a JSON object) to its
environment.

Both sides register the harness's 2 GiB buffer as one blocks cache: 64 tensors (32 layers x
K/V) of 512 blocks of 64 KiB. A harness descriptor list becomes block lists per tensor;
tensors sharing one list go in one ``pull_blocks``/``push_blocks`` call (W1: all blocks of
8 tensors), the others one call per tensor, awaited together on the async face (W2: 64 calls
in flight on one link) or made in turn on the blocking face.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HARNESS = os.environ.get(
    "AIO_BENCH_HARNESS",
    str(Path(__file__).resolve().parents[2] / "shared" / "bench" / "peers"),
)
sys.path.insert(0, HARNESS)
try:
    import common
except ImportError:  # the harness is not there: say so (main), import on
    common = None

# numpy buffers stand in for device memory here: use the host runtime even where an
# accelerator exists (device caches on an accelerator are not host-addressable).
os.environ["AIO_DATADIST_RUNTIME"] = "host"

from aio_datadist import (  # noqa: E402
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)

TENSORS = common.LAYERS * common.KV if common is not None else 0
TARGET_ID, INITIATOR_ID = 1, 2


def _desc() -> CacheDesc:
    return CacheDesc(TENSORS, [common.NBLOCKS, common.BLOCK], DataType.DT_UINT8, Placement.DEVICE)


def _options(
    transport: str, same_host: bool, ucx: bool, lanes: int | None, listen: str | None = None
) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    cfg.sync_kv_timeout = 60_000
    cfg.transport = transport
    cfg.same_host = same_host
    cfg.ucx = ucx
    cfg.ucx_lanes = lanes
    if listen is not None:
        cfg.listen_ip_info = listen
    return cfg.generate_options()


_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2


def _enter_netns(name: str) -> None:
    """Move this thread (the one that starts the engine) into the network namespace
    ``name``, as ``ip netns exec`` does: the namespace, then a mount namespace of its own
    with ``/sys`` mounted again, so that ``/sys/class/net`` (where UCX finds its devices)
    shows that namespace's devices."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), f"setns({name})")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system) the threads of process ``pid`` but its main one used
    so far: the transfer's threads; the harness's checksums run in the main thread."""
    used = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        if int(task) == pid:
            continue
        try:
            fields = Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        used += int(fields[11]) + int(fields[12])
    return used / os.sysconf("SC_CLK_TCK")


def _workload(lengths: list[int]) -> str:
    """Which harness workload a descriptor list is (W1: one 256 MiB run, W2: a batch of
    4096 blocks, W3: one block)."""
    if len(lengths) > 1:
        return "W2"
    return "W3" if lengths[0] <= common.BLOCK else "W1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AioDataDistAdapter:
    """The harness adapter: the target serves; the initiator pulls or pushes blocks."""

    name = "aio_datadist"

    def __init__(
        self,
        transport: str = "tcp",
        face: str = "async",
        same_host: bool = False,
        ucx: bool = False,
        ucx_lanes: int | None = None,
    ) -> None:
        self.transport = transport
        self.face = face
        self.same_host = same_host
        self.ucx = ucx
        self.lanes = ucx_lanes
        self.dd: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # per workload: [bytes, initiator CPU s, target CPU s, wall s]
        self.cpu: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])

    # -- target -----------------------------------------------------------------------
    def target_init(self, addr: int, size: int) -> tuple[int, int, str, int]:
        """Serve the buffer; the metadata is the listen port, the buffer's address, the
        listen address and the target's pid."""
        netns = os.environ.get("AIO_BENCH_TARGET_NETNS")
        if netns:
            _enter_netns(netns)
        os.environ.update(json.loads(os.environ.get("AIO_BENCH_TARGET_ENV", "{}")))
        host = os.environ.get("AIO_BENCH_LISTEN_IP", "127.0.0.1")
        port = _free_port()
        self.dd = LLMDataDist(LLMRole.PROMPT, TARGET_ID)
        self.dd.init(
            _options(self.transport, self.same_host, self.ucx, self.lanes, f"{host}:{port}")
        )
        self.cache = self.dd.cache_manager.register_blocks_cache(
            _desc(), self._addrs(addr), BlocksCacheKey(TARGET_ID, 0)
        )
        return port, addr, host, os.getpid()

    def target_close(self) -> None:
        self.dd.cache_manager.unregister_cache(self.cache.cache_id)
        self.dd.finalize()

    # -- initiator --------------------------------------------------------------------
    def init_init(self, addr: int, size: int, remote_meta: tuple[int, int, str, int]) -> None:
        port, self.remote_base, host, self.target_pid = remote_meta
        self.base = addr
        self.key = BlocksCacheKey(TARGET_ID, 0)
        info = LLMClusterInfo()
        info.remote_cluster_id = TARGET_ID
        info.append_local_ip_info(host, 0)
        info.append_remote_ip_info(host, port)
        self.info = info
        if self.face == "blocking":
            self.dd = LLMDataDist(LLMRole.DECODER, INITIATOR_ID)
            self.dd.init(_options(self.transport, self.same_host, self.ucx, self.lanes))
            self.cm = self.dd.cache_manager
            self.cache = self.cm.register_blocks_cache(
                _desc(), self._addrs(addr), BlocksCacheKey(INITIATOR_ID, 0)
            )
            ret, _ = self.dd.link_clusters([info], 5000)
        else:
            self.loop = asyncio.new_event_loop()
            ret = self.loop.run_until_complete(self._async_init(addr, info))
        if ret != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters failed: {ret}")
        link = self.dd._engine.link_table().get(TARGET_ID)
        self.routes = [r.name for r in link.routes]  # reported with the CPU figures

    async def _async_init(self, addr: int, info: LLMClusterInfo) -> LLMStatusCode:
        self.dd = AsyncLLMDataDist(LLMRole.DECODER, INITIATOR_ID)
        await self.dd.init(_options(self.transport, self.same_host, self.ucx, self.lanes))
        self.cm = self.dd.cache_manager
        self.cache = await self.cm.register_blocks_cache(
            _desc(), self._addrs(addr), BlocksCacheKey(INITIATOR_ID, 0)
        )
        ret, _ = await self.dd.link_clusters([info], 5000)
        return ret

    def init_close(self) -> None:
        per_gb = {
            name: {
                "bytes": int(n),
                "initiator_cpu_s": round(mine, 4),
                "target_cpu_s": round(theirs, 4),
                "wall_s": round(wall, 4),
                "cpu_s_per_gb": round((mine + theirs) / (n / 1e9), 4),
            }
            for name, (n, mine, theirs, wall) in sorted(self.cpu.items())
        }
        print("AIO_CPU " + json.dumps({**per_gb, "routes": self.routes}), flush=True)
        if self.loop is not None:
            self.loop.run_until_complete(self._async_close())
            self.loop.close()
        else:
            self.dd.unlink_clusters([self.info], 5000)
            self.cm.unregister_cache(self.cache.cache_id)
            self.dd.finalize()

    async def _async_close(self) -> None:
        await self.dd.unlink_clusters([self.info], 5000)
        await self.cm.unregister_cache(self.cache.cache_id)
        await self.dd.finalize()

    # -- transfers --------------------------------------------------------------------
    @staticmethod
    def _addrs(base: int) -> list[int]:
        return [base + t * common.TENSOR for t in range(TENSORS)]

    def _calls(
        self, local: list[int], remote: list[int], lengths: list[int], remote_base: int
    ) -> list[tuple[range, list[int], list[int]]]:
        """Group descriptors into (tensor range, local blocks, remote blocks) calls."""
        if len(lengths) == 1:  # W3: one descriptor, inside one tensor on both sides
            lt, lo = divmod(local[0] - self.base, common.TENSOR)
            rt, ro = divmod(remote[0] - remote_base, common.TENSOR)
            n = lengths[0]
            if lt == rt and lo + n <= common.TENSOR and ro + n <= common.TENSOR:
                lb, rb, k = lo // common.BLOCK, ro // common.BLOCK, n // common.BLOCK
                return [(range(lt, lt + 1), list(range(lb, lb + k)), list(range(rb, rb + k)))]
        per_tensor: dict[int, tuple[list[int], list[int]]] = defaultdict(lambda: ([], []))
        for lo, ro, n in zip(local, remote, lengths, strict=True):
            lo, ro = lo - self.base, ro - remote_base
            for k in range(n // common.BLOCK):
                lt, lb = divmod(lo + k * common.BLOCK, common.TENSOR)
                rt, rb = divmod(ro + k * common.BLOCK, common.TENSOR)
                if lt != rt:
                    raise ValueError("a descriptor crosses tensors differently on each side")
                blocks = per_tensor[lt]
                blocks[0].append(lb // common.BLOCK)
                blocks[1].append(rb // common.BLOCK)
        calls: list[tuple[range, list[int], list[int]]] = []
        for t in sorted(per_tensor):
            lb, rb = per_tensor[t]
            last = calls[-1] if calls else None
            if last and last[0].stop == t and last[1] == lb and last[2] == rb:
                calls[-1] = (range(last[0].start, t + 1), lb, rb)
            else:
                calls.append((range(t, t + 1), lb, rb))
        return calls

    def xfer(self, op: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        calls = self._calls(local, remote, lengths, self.remote_base)
        key = self.key
        workload = _workload(lengths)
        if workload == "W3":  # a latency: no CPU sampling in its way
            self._move(op, key, calls)
            return
        mine, theirs, wall = time.process_time(), _cpu_s(self.target_pid), time.perf_counter()
        self._move(op, key, calls)
        tally = self.cpu[workload]
        tally[0] += sum(lengths)
        tally[1] += time.process_time() - mine
        tally[2] += _cpu_s(self.target_pid) - theirs
        tally[3] += time.perf_counter() - wall

    def _move(self, op: str, key: BlocksCacheKey, calls: list[Any]) -> None:
        if self.loop is None:
            for tensors, lb, rb in calls:
                self._one(op, key, tensors, lb, rb)
        else:
            self.loop.run_until_complete(self._all(op, key, calls))

    def _one(
        self, op: str, key: BlocksCacheKey, tensors: range, lb: list[int], rb: list[int]
    ) -> Any:
        if op == "read":
            return self.cm.pull_blocks(
                key,
                self.cache,
                rb,
                lb,
                src_layer_range=tensors,
                dst_layer_range=tensors,
                tensor_num_per_layer=1,
            )
        return self.cm.push_blocks(
            key,
            self.cache,
            lb,
            rb,
            src_layer_range=tensors,
            dst_layer_range=tensors,
            tensor_num_per_layer=1,
        )

    async def _all(self, op: str, key: BlocksCacheKey, calls: list[Any]) -> None:
        # A failed call raises its LLMException: pull_blocks itself, push_blocks's task
        # when awaited. One call is awaited as a caller would (no task to gather it in).
        if len(calls) == 1:
            await self._one(op, key, *calls[0])
            return
        await asyncio.gather(*(self._one(op, key, *c) for c in calls))


VARIANTS = {
    # every byte through the TCP link (the same-host path switched off)
    "aio-tcp-async": ({"transport": "tcp", "face": "async"}, {}),
    "aio-tcp-blocking": ({"transport": "tcp", "face": "blocking"}, {}),
    # the default on one host: one-sided process_vm_readv/writev
    "aio-samehost-async": ({"transport": "tcp", "face": "async", "same_host": True}, {}),
    "aio-samehost-blocking": ({"transport": "tcp", "face": "blocking", "same_host": True}, {}),
    # the UCX route (UCP RMA), with the transports UCX picks (cma between two processes of
    # one host), then with its tcp transport only, on the loopback device (as NIXL's nixl-ucx-tcp)
    "aio-ucx-async": ({"transport": "tcp", "face": "async", "ucx": True}, {}),
    "aio-ucx-blocking": ({"transport": "tcp", "face": "blocking", "ucx": True}, {}),
    # the same on one UCX worker (aio.UcxLanes=1; the default moves large transfers on two)
    "aio-ucx-1lane-async": ({"transport": "tcp", "face": "async", "ucx": True, "ucx_lanes": 1}, {}),
    "aio-ucx-1lane-blocking": (
        {"transport": "tcp", "face": "blocking", "ucx": True, "ucx_lanes": 1},
        {},
    ),
    "aio-ucx-tcp-async": (
        {"transport": "tcp", "face": "async", "ucx": True},
        {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"},
    ),
    "aio-ucx-tcp-blocking": (
        {"transport": "tcp", "face": "blocking", "ucx": True},
        {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"},
    ),
    "aio-ucx-tcp-1lane-async": (
        {"transport": "tcp", "face": "async", "ucx": True, "ucx_lanes": 1},
        {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"},
    ),
    "aio-ucx-tcp-1lane-blocking": (
        {"transport": "tcp", "face": "blocking", "ucx": True, "ucx_lanes": 1},
        {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"},
    ),
}


def _without_harness() -> int:
    """``--help`` without the harness, and a one-line error for anything else."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variant", choices=sorted(VARIANTS))
    _, unknown = parser.parse_known_args()  # --help exits here
    where = f"the shared peer harness (common.py) is not at {HARNESS}: set AIO_BENCH_HARNESS"
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} ({where})")
    parser.error(where)
    return 2


if __name__ == "__main__":
    sys.exit(_without_harness() if common is None else common.cli(AioDataDistAdapter, VARIANTS))
