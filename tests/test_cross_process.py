"""Transfers with a real second process over TCP: data, stalls, kills, loop responsiveness.

The peer (``tests/peer_prompt.py``) is a blocking-API prompt; the decoder here runs through
both faces and every route: ``link`` (every byte through the socket), ``samehost`` (the
one-sided path, where the kernel allows it) and, where UCX is installed, ``ucx`` (UCP RMA,
the same-host route off at both ends' request). A stalled peer is stopped with SIGSTOP, a
dead one killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist._routes.ucx import worker as ucx
from tests import providers
from tests.conftest import (
    Face,
    fresh_ticks,
    leaked_pool_memory,
    make_options,
    pool_cfg,
    push_blocks,
)
from tests.peer_prompt import ROW_BYTES, TENSORS, pattern, read_ready

S = LLMStatusCode
PEER = Path(__file__).with_name("peer_prompt.py")
#: What a peer's environment adds. UCX patches ``mmap`` and its kin as its library loads,
#: for the registration cache of its RDMA transports (``UCX_MEM_MMAP_HOOK_MODE``): about
#: 0.4 s of each peer's start here, and the suite starts hundreds of peers. A peer serves
#: host memory over the transports UCX has on one host (tcp, cma, shared memory), which
#: never use that cache.
PEER_ENV = {"UCX_MEM_MMAP_HOOK_MODE": os.environ.get("UCX_MEM_MMAP_HOOK_MODE", "none")}
MiB = 1 << 20


class Peer:
    """The prompt process, serving ``blocks`` blocks of ``block_bytes`` per tensor (started
    without ``wait``: it serves once :meth:`ready` returned)."""

    def __init__(
        self,
        blocks: int,
        block_bytes: int,
        script: Path = PEER,
        *,
        cluster_id: int = 1,
        port: int | None = None,
        env: dict[str, str] | None = None,
        wait: bool = True,
    ) -> None:
        self.blocks, self.block_bytes = blocks, block_bytes
        self.cluster_id = cluster_id
        # Port 0 unless given: the peer reports the port it bound (a port picked free here
        # may be taken by another process before the peer binds it).
        self.port = 0 if port is None else port
        #: The peer's command line and environment: a peer started with the same two is
        #: the same peer (:class:`PeerFactory` hands one out for the other).
        self.argv, self.env = Peer.command(
            blocks, block_bytes, script, cluster_id=cluster_id, port=port, env=env
        )
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env
        )
        self._ready = False
        if wait:
            self.ready()

    @staticmethod
    def command(
        blocks: int,
        block_bytes: int,
        script: Path = PEER,
        *,
        cluster_id: int = 1,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        """The command line and environment of a peer of these arguments, started now."""
        root = str(Path(__file__).resolve().parents[1])
        full = dict(
            os.environ,
            PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **PEER_ENV,
            **(env or {}),
        )
        argv = [sys.executable, str(script), str(0 if port is None else port), str(blocks),
                str(block_bytes), str(cluster_id)]  # fmt: skip
        return argv, full

    def ready(self) -> Peer:
        """Wait until the peer serves (it reports its port); itself."""
        if not self._ready:
            assert self.proc.stdout is not None
            try:
                self.port = read_ready(self.proc.stdout)
            except RuntimeError:
                self.close()  # the peer failed to start (its traceback is on stderr)
                raise
            self._ready = True
        return self

    def info(self) -> LLMClusterInfo:
        info = LLMClusterInfo()
        info.remote_cluster_id = self.cluster_id
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", self.port)
        return info

    def signal(self, sig: int) -> None:
        """Send ``sig``; for SIGSTOP, return once every thread of the peer has stopped (a
        thread busy in native code answers requests until the stop reaches it)."""
        self.proc.send_signal(sig)
        if sig != signal.SIGSTOP:
            return
        tasks = Path(f"/proc/{self.proc.pid}/task")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            states = []
            for task in tasks.iterdir():
                with contextlib.suppress(OSError):
                    states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            if states and all(state in "tT" for state in states):
                return
            time.sleep(0.001)
        raise AssertionError(f"peer {self.proc.pid} did not stop")

    def close(self) -> None:
        try:
            self._stop()
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


#: The routes every cross-process scenario runs over.
ROUTES = ["link", "samehost"] + (["ucx"] if ucx.available() is None else [])
#: The routes of the scenarios where the peer stops: over UCX, with UCX's tcp transport
#: only ("ucx-tcp": the target must progress, as over a network; on one host UCX would read
#: with cma, which needs no help from the peer).
STALL_ROUTES = ["link"] + (["ucx-tcp"] if ucx.available() is None else [])
#: What ``UCX_TLS`` each UCX route runs under.
UCX_TLS = {"ucx": None, "ucx-tcp": "tcp,self"}


@pytest.fixture(params=ROUTES)
def route(request: pytest.FixtureRequest) -> str:
    return str(request.param)


#: Peers started for tests to come, not handed out yet (:class:`PeerFactory`).
_POOL: list[Peer] = []
#: Most peers the pool holds (the oldest goes first).
_POOL_MAX = 8


def close_pool() -> None:
    """Close the peers never handed out (the end of the session)."""
    while _POOL:
        _POOL.pop().close()


class PeerFactory:
    """Makes the peers of one test over one route (with the UCX route on where the test
    runs over it) and closes them at its end.

    A peer starts in about a second here, and the tests that use these peers spend most of
    their time waiting on a fault. So a peer is asked for ahead where a test knows it will
    need one (:meth:`prestart`), and each peer handed out has its like started at once for
    the next test that asks for the same (a pool across tests): the call that asks gets it
    serving. A peer is handed out once; every one is a fresh process that served no one."""

    def __init__(self, route: str) -> None:
        self.route = route
        self.made: list[Peer] = []
        self._spares: list[Peer] = []

    def __call__(self, blocks: int = 16, block_bytes: int = 64 * 1024, **kwargs: Any) -> Peer:
        kwargs = self._kwargs(kwargs)
        wanted = Peer.command(blocks, block_bytes, **kwargs)
        for i, spare in enumerate(self._spares):
            if _same(spare, wanted):
                del self._spares[i]
                return spare.ready()
        return self._obtain(blocks, block_bytes, kwargs, wanted).ready()

    def prestart(self, blocks: int = 16, block_bytes: int = 64 * 1024, **kwargs: Any) -> None:
        """Start a peer now for a later call with these arguments."""
        kwargs = self._kwargs(kwargs)
        wanted = Peer.command(blocks, block_bytes, **kwargs)
        self._spares.append(self._obtain(blocks, block_bytes, kwargs, wanted))

    def _kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.route in UCX_TLS:
            tls = UCX_TLS[self.route]
            kwargs = dict(kwargs, env={"AIO_TEST_UCX": "1", **({"UCX_TLS": tls} if tls else {})})
        return kwargs

    def _obtain(
        self,
        blocks: int,
        block_bytes: int,
        kwargs: dict[str, Any],
        wanted: tuple[list[str], dict[str, str]],
    ) -> Peer:
        """The pool's peer like ``wanted``, else a new one; either way its like is started
        into the pool for the next test."""
        found = next((p for p in _POOL if _same(p, wanted)), None)
        if found is not None:
            _POOL.remove(found)
        else:
            found = Peer(blocks, block_bytes, wait=False, **kwargs)
        self.made.append(found)
        if kwargs.get("port") is None:  # (a peer told its port cannot be started twice)
            _POOL.append(Peer(blocks, block_bytes, wait=False, **kwargs))
            while len(_POOL) > _POOL_MAX:
                _POOL.pop(0).close()
        return found

    def close(self) -> None:
        """Close every peer made (spares never handed out included)."""
        for peer in self.made:
            peer.close()


#: What the environment says of the test that runs, not of the peer.
_PER_TEST = ("PYTEST_CURRENT_TEST",)


def _same(peer: Peer, wanted: tuple[list[str], dict[str, str]]) -> bool:
    """Whether ``peer`` was started as ``wanted`` (a command line and environment) says."""
    argv, env = wanted
    if peer.argv != argv:
        return False
    mine = {k: v for k, v in peer.env.items() if k not in _PER_TEST}
    return mine == {k: v for k, v in env.items() if k not in _PER_TEST}


@pytest.fixture
def peer_factory(route: str) -> Iterator[PeerFactory]:
    """Peers that enable the UCX route where the test runs over it."""
    factory = PeerFactory(route)
    yield factory
    factory.close()


def peer_memory(face: Face) -> Any:
    """The decoder's one-sided route to cluster 1 (None when the link carries everything)."""
    assert face.dd._engine.links.get(1) is not None
    return providers.peer_memory(face.dd._engine, 1)


def ucx_route(face: Face) -> Any:
    """The decoder's UCX route to cluster 1 (None when the link has none)."""
    link = face.dd._engine.links.get(1)
    assert link is not None
    return next((r for r in link.routes if r.name == "ucx"), None)


def check_route(face: Face, route: str) -> None:
    """The transfers took the route the test asked for (or the kernel refused it)."""
    memory = peer_memory(face)
    if route in UCX_TLS:
        found = ucx_route(face)
        assert memory is None and found is not None and found.remote.usable
        return
    assert ucx_route(face) is None
    if route == "link":
        assert memory is None
        return
    assert memory is not None
    if not memory.enabled:
        pytest.skip("the kernel refuses cross-process memory access here")


@pytest.fixture
async def decoder(
    face_kind: str, route: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Callable[..., Any]]:
    faces: list[Face] = []
    if UCX_TLS.get(route):
        monkeypatch.setenv("UCX_TLS", UCX_TLS[route])

    async def factory(timeout_ms: int = 5000, remote_accessible: bool = True) -> Face:
        face = Face(face_kind, LLMRole.DECODER, 2)
        faces.append(face)
        await face.init(
            make_options(
                device_pool=pool_cfg(512 * MiB),
                remote_accessible=remote_accessible,
                transport="tcp",
                sync_kv_timeout=timeout_ms,
                same_host=route == "samehost",
                ucx=route in UCX_TLS or None,
            )
        )
        return face

    yield factory
    for face in faces:
        leaked = await leaked_pool_memory(face)
        await face.finalize()
        assert not leaked, f"pool memory leaked: {leaked}"


async def link(face: Face, peer: Peer) -> None:
    assert await face.call(face.dd.link_clusters, [peer.info()], 5000) == (
        S.LLM_SUCCESS,
        [S.LLM_SUCCESS],
    )


def blocks_desc(blocks: int, block_bytes: int) -> CacheDesc:
    return CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)


async def test_pull_and_push_across_processes(decoder: Any, peer_factory: Any, route: str) -> None:
    peer = peer_factory(16, 64 * 1024)
    face = await decoder()
    await link(face, peer)
    cache = await face.cm.allocate_blocks_cache(blocks_desc(16, 64 * 1024))
    await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [3, 0, 15], [0, 1, 2])
    for t, view in enumerate(cache.as_numpy()):
        np.testing.assert_array_equal(view[[0, 1, 2]], pattern(t, 16, 64 * 1024)[[3, 0, 15]])
    # push into the peer, then pull the pushed blocks back elsewhere
    for view in cache.as_numpy():
        view[5] = 0xAB
    await push_blocks(face, BlocksCacheKey(1, 0), cache, [5], [9])
    await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [9], [6])
    assert all((view[6] == 0xAB).all() for view in cache.as_numpy())
    # a batch row by cache id and index (the peer's second cache)
    rows = await face.cm.allocate_cache(CacheDesc(TENSORS, [2, ROW_BYTES], DataType.DT_UINT8))
    await face.cm.pull_cache(CacheKeyByIdAndIndex(1, 2, 0), rows, batch_index=1)
    assert [int(v[1, 0]) for v in rows.as_numpy()] == [7, 8, 9, 10]
    # refusals are the serving side's on either route
    with pytest.raises(LLMException) as info:
        await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [16], [0])
    assert info.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as info:
        await face.cm.pull_cache(CacheKeyByIdAndIndex(1, 99, 0), rows)
    assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    check_route(face, route)
    await face.cm.deallocate_cache(rows)
    await face.cm.deallocate_blocks_cache(cache)


async def test_pull_by_key_drops_the_key_on_the_peer(decoder: Any, peer_factory: Any) -> None:
    peer = peer_factory(4, 4096)
    face = await decoder(remote_accessible=False)
    await link(face, peer)
    rows = await face.cm.allocate_cache(CacheDesc(TENSORS, [2, ROW_BYTES], DataType.DT_UINT8))
    await face.cm.pull_cache(CacheKey(1, req_id=1), rows, batch_index=1)
    assert [int(v[1, 0]) for v in rows.as_numpy()] == [7, 8, 9, 10]
    deadline = time.monotonic() + 5
    while True:
        try:
            await face.cm.pull_cache(CacheKey(1, req_id=1), rows)
        except LLMException as exc:
            assert exc.status_code == S.LLM_KV_CACHE_NOT_EXIST
            break
        assert time.monotonic() < deadline
    await face.cm.deallocate_cache(rows)


@pytest.mark.parametrize("route", STALL_ROUTES, indirect=True)
async def test_stalled_peer_times_out_within_the_deadline(decoder: Any, peer_factory: Any) -> None:
    peer = peer_factory(16, 64 * 1024)
    face = await decoder(timeout_ms=500)
    await link(face, peer)
    cache = await face.cm.allocate_blocks_cache(blocks_desc(16, 64 * 1024))
    peer.signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(LLMException) as info:
            await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [1], [1])
        elapsed = time.monotonic() - start
        assert info.value.status_code == S.LLM_TIMEOUT
        assert 0.4 < elapsed < 3.0, elapsed
        with pytest.raises(LLMException) as info:
            await push_blocks(face, BlocksCacheKey(1, 0), cache, [1], [1])
        assert info.value.status_code in (S.LLM_TIMEOUT, S.LLM_LINK_FAILED)
    finally:
        peer.signal(signal.SIGCONT)
    await face.cm.deallocate_blocks_cache(cache)


@pytest.mark.parametrize("route", [r for r in ROUTES if r != "link"], indirect=True)
async def test_one_sided_transfers_need_no_help_from_a_stalled_peer(
    decoder: Any, peer_factory: Any, route: str
) -> None:
    # UCX between two processes of one host reads with cma (process_vm_readv), as the
    # same-host route does: the peer's threads take no part.
    peer = peer_factory(16, 64 * 1024)
    face = await decoder(timeout_ms=500)
    await link(face, peer)
    cache = await face.cm.allocate_blocks_cache(blocks_desc(16, 64 * 1024))
    peer.signal(signal.SIGSTOP)
    try:
        await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [4], [1])
        check_route(face, route)
        for t, view in enumerate(cache.as_numpy()):
            np.testing.assert_array_equal(view[1], pattern(t, 16, 64 * 1024)[4])
        # a pull by key still needs the peer, and times out
        rows = await face.cm.allocate_cache(CacheDesc(TENSORS, [1, ROW_BYTES], DataType.DT_UINT8))
        with pytest.raises(LLMException) as info:
            await face.cm.pull_cache(CacheKeyByIdAndIndex(1, 99, 0), rows)
        assert info.value.status_code == S.LLM_TIMEOUT
    finally:
        peer.signal(signal.SIGCONT)
    # (Releasing a cache the UCX peer may reach waits for its acknowledgement: not while
    # it is stopped.)
    await face.cm.deallocate_cache(rows)
    await face.cm.deallocate_blocks_cache(cache)


async def test_peer_killed_mid_transfer(decoder: Any, peer_factory: Any) -> None:
    blocks, block_bytes = 64, 1 * MiB  # 4 tensors x 64 MiB on the peer
    peer = peer_factory(blocks, block_bytes)
    face = await decoder(timeout_ms=20_000)
    await link(face, peer)
    cache = await face.cm.allocate_blocks_cache(blocks_desc(blocks, block_bytes))
    used = face.pool_used()[Placement.DEVICE]

    async def pull_all() -> None:
        for _ in range(50):
            await face.cm.pull_blocks(
                BlocksCacheKey(1, 0), cache, list(range(blocks)), list(range(blocks))
            )

    loop = asyncio.get_running_loop()
    killer = loop.call_later(0.3, peer.signal, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(LLMException) as info:
        if face.kind == "sync":
            await asyncio.to_thread(lambda: asyncio.run(pull_all()))
        else:
            await pull_all()
    killer.cancel()
    assert info.value.status_code == S.LLM_LINK_FAILED
    assert time.monotonic() - start < 10
    assert face.pool_used()[Placement.DEVICE] == used  # nothing pinned or leaked
    await face.cm.deallocate_blocks_cache(cache)
    # The memory returns once no request of the failed call holds it. The broken link fails
    # its pending requests one after another, and the call may raise at the first of them
    # before the teardown reaches the others (no byte of theirs moves after the break).
    assert not await leaked_pool_memory(face)


async def test_a_killed_peer_reads_as_a_failed_link_until_unlinked(
    decoder: Any, peer_factory: Any
) -> None:
    peer = peer_factory(4, 4096)
    face = await decoder()
    await link(face, peer)
    cache = await face.cm.allocate_blocks_cache(blocks_desc(4, 4096))
    await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0])
    peer.signal(signal.SIGKILL)
    peer.proc.wait(10)
    table = face.dd._engine.link_table()
    for _ in range(500):  # until this side has seen the connection close
        if table.get(1) is None:
            break
        await asyncio.sleep(0.01)
    for _ in range(3):  # every call says so, with who closed the link and when
        with pytest.raises(LLMException) as info:
            await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0])
        assert info.value.status_code == S.LLM_LINK_FAILED, info.value
        message = str(info.value)
        assert "cluster 1 (127.0.0.1:" in message and " failed at 20" in message
        assert "closed without an unlink" in message or "reset" in message, message
    assert len(table) == 0  # not a link: switch_role may go on
    # A forced unlink clears it; then the cluster is simply not linked.
    ret, rets = await face.call(face.dd.unlink_clusters, [peer.info()], 1000, True)
    assert (ret, rets, rets.errors) == (S.LLM_SUCCESS, [S.LLM_SUCCESS], [None])
    with pytest.raises(LLMException) as info:
        await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0], [0])
    assert info.value.status_code == S.LLM_NOT_YET_LINK
    # A new peer under the same cluster id links and serves again, without an unlink.
    again = peer_factory(4, 4096)
    await link(face, again)
    again.signal(signal.SIGKILL)
    again.proc.wait(10)
    third = peer_factory(4, 4096)
    await link(face, third)  # relinking over a failed link needs no unlink
    await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [2], [1])
    np.testing.assert_array_equal(cache.as_numpy()[0][1], pattern(0, 4, 4096)[2])
    await face.cm.deallocate_blocks_cache(cache)


@pytest.mark.parametrize("face_kind", ["async"], indirect=True)
async def test_a_thousand_concurrent_awaited_pulls_over_one_link(
    decoder: Any, peer_factory: Any, route: str
) -> None:
    # Answers of many requests in flight interleave on the socket with the loop busy
    # starting the rest: whoever reads them, every byte lands where its request said.
    blocks, block_bytes = 16, 64 * 1024
    peer = peer_factory(blocks, block_bytes)
    face = await decoder(timeout_ms=60_000)
    await link(face, peer)
    cache = await face.cm.allocate_blocks_cache(blocks_desc(blocks, block_bytes))

    def pull(i: int) -> Any:  # one block of one tensor
        layer = range(i % TENSORS, i % TENSORS + 1)
        return face.cm.pull_blocks(
            BlocksCacheKey(1, 0),
            cache,
            [i % blocks],
            [i % blocks],
            src_layer_range=layer,
            dst_layer_range=layer,
            tensor_num_per_layer=1,
        )

    await asyncio.gather(*(pull(i) for i in range(1000)))
    for t, view in enumerate(cache.as_numpy()):  # block b came from tensor b % TENSORS
        pulled = [b for b in range(blocks) if b % TENSORS == t]
        np.testing.assert_array_equal(view[pulled], pattern(t, blocks, block_bytes)[pulled])
    check_route(face, route)
    await face.cm.deallocate_blocks_cache(cache)


@pytest.mark.parametrize("face_kind", ["async"], indirect=True)
async def test_event_loop_keeps_running_during_a_256_mib_pull(
    decoder: Any, peer_factory: Any, loop_lag: list[float]
) -> None:
    blocks, block_bytes = 64, 1 * MiB
    peer = peer_factory(blocks, block_bytes)
    face = await decoder(timeout_ms=60_000)
    await link(face, peer)
    cache = await face.cm.allocate_blocks_cache(blocks_desc(blocks, block_bytes))
    expected = pattern(3, blocks, block_bytes)[63]
    # Twice: on the same-host route the first pull proves the kernel's access on a worker
    # thread, the second runs on the native copy workers and completes on the loop.
    for _ in range(2):
        # Making the pattern and checking the last pull held this loop; only the pull counts.
        lags_before = await fresh_ticks(loop_lag)
        await face.cm.pull_blocks(
            BlocksCacheKey(1, 0), cache, list(range(blocks)), list(range(blocks))
        )
        ticks = loop_lag[lags_before:]
        assert len(ticks) >= 5, "the ticker did not run during the transfer"
        assert max(ticks) < 0.25, f"event loop blocked for {max(ticks) * 1e3:.0f} ms"
        view = cache.as_numpy()[3]
        np.testing.assert_array_equal(view[63], expected)
        view[63] = 0
    await face.cm.deallocate_blocks_cache(cache)


@pytest.mark.parametrize("face_kind", ["async"], indirect=True)
async def test_large_awaited_transfers_at_once_and_a_cancelled_one(
    decoder: Any, peer_factory: Any, route: str
) -> None:
    # Large awaited transfers move off the loop (on the same-host route, on the native copy
    # workers): many at once, pulls and pushes, land every byte, and a cancelled one lets
    # its cancellation through only once its bytes stopped moving.
    blocks, block_bytes = 32, 256 * 1024  # 8 MiB a tensor
    peer = peer_factory(blocks, block_bytes)
    face = await decoder(timeout_ms=60_000)
    await link(face, peer)
    cache = await face.cm.allocate_blocks_cache(blocks_desc(blocks, block_bytes))
    key, every = BlocksCacheKey(1, 0), list(range(blocks))
    want = [pattern(t, blocks, block_bytes) for t in range(TENSORS)]
    await face.cm.pull_blocks(key, cache, every, every)
    views = cache.as_numpy()
    for view in views:
        view[...] = 0

    def pull(t: int, remote: list[int], local: list[int]) -> Any:  # 2 MiB of one tensor
        layer = range(t, t + 1)
        return face.cm.pull_blocks(
            key,
            cache,
            remote,
            local,
            src_layer_range=layer,
            dst_layer_range=layer,
            tensor_num_per_layer=1,
        )

    backwards = every[::-1]
    calls = [(t, backwards[c::4], every[c::4]) for t in range(TENSORS) for c in range(4)]
    await asyncio.gather(*(pull(*call) for call in calls))
    for t, remote, local in calls:
        np.testing.assert_array_equal(views[t][local], want[t][remote])
    # push 16 blocks of every tensor (16 MiB) over the peer's upper half, pull them back
    for t, view in enumerate(views):
        view[:16] = (t + 1) * 17
    await push_blocks(face, key, cache, every[:16], every[16:])
    await face.cm.pull_blocks(key, cache, every[16:], every[16:])
    for t, view in enumerate(views):
        assert (view[16:] == (t + 1) * 17).all()
    # a cancelled pull of everything: when the cancellation arrives, nothing writes the
    # cache any more (the pull completed first, or it never started)
    for view in views:
        view[...] = 0
    task = asyncio.ensure_future(face.cm.pull_blocks(key, cache, every[:16], every[:16]))
    await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    landed = [view[:16].copy() for view in views]
    await asyncio.sleep(0.05)
    for t, view in enumerate(views):
        np.testing.assert_array_equal(view[:16], landed[t])
        assert (landed[t] == 0).all() or (landed[t] == want[t][:16]).all()
    check_route(face, route)
    await face.cm.deallocate_blocks_cache(cache)
