"""The fault matrix: every transfer call against a peer process that dies, stalls or leaves.

Each case runs a real prompt process (``tests/peer_prompt.py``) and checks the same
invariants: the call fails with a documented ``LLMException`` code within its deadline (never
a hang), the decoder's pool is back to its usage before the call, nothing is reported
transferred that was not, and the decoder's other links (or a fresh one) still work.
Routes: ``link`` (every byte on the socket), ``samehost`` (one-sided where the kernel
allows) and, where UCX is installed, ``ucx`` (UCP RMA; the scenarios where the peer stops
run it with UCX's tcp transport, ``ucx-tcp``, where the target must progress); faces:
blocking and async.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    CacheTask,
    DataType,
    LayerSynchronizer,
    LLMException,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)
from tests.conftest import Face, push_blocks
from tests.peer_prompt import ROW_BYTES, TENSORS, pattern
from tests.test_cross_process import (  # noqa: F401 - fixtures
    STALL_ROUTES,
    MiB,
    Peer,
    blocks_desc,
    decoder,
    link,
    peer_factory,
    route,
)

S = LLMStatusCode
#: Codes a transfer may report when its peer died or the link went away.
GONE = {S.LLM_LINK_FAILED, S.LLM_NOT_YET_LINK}
BLOCKS, BLOCK_BYTES = 32, 256 * 1024  # 4 tensors x 8 MiB on the peer
TIMEOUT_MS = 3000
SLACK_S = 5.0


class Ready(LayerSynchronizer):
    """Every layer is ready at once."""

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


class Caches:
    """The decoder's caches the operations move: a blocks cache and a one-row batch cache."""

    def __init__(self, face: Face, blocks: Any, rows: Any, peer: Peer) -> None:
        self.face, self.blocks, self.rows, self.peer = face, blocks, rows, peer

    @classmethod
    async def make(cls, face: Face, peer: Peer) -> Caches:
        blocks = await face.cm.allocate_blocks_cache(blocks_desc(BLOCKS, BLOCK_BYTES))
        rows = await face.cm.allocate_cache(CacheDesc(TENSORS, [1, ROW_BYTES], DataType.DT_UINT8))
        return cls(face, blocks, rows, peer)

    async def release(self) -> None:
        await self.face.cm.deallocate_blocks_cache(self.blocks)
        await self.face.cm.deallocate_cache(self.rows)


async def _task_status(face: Face, task: CacheTask) -> None:
    if face.kind == "sync":
        results = await asyncio.to_thread(task.get_results, 30_000)
    else:
        results = await task.wait_results()
    failed = [r for r in results if r != S.LLM_SUCCESS]
    if failed:
        assert failed[0] is not None, results
        raise LLMException(f"transfer_cache_async: {results}", status_code=failed[0])


def _all() -> list[int]:
    return list(range(BLOCKS))


async def pull_blocks(c: Caches) -> None:
    key = BlocksCacheKey(c.peer.cluster_id, 0)
    await c.face.cm.pull_blocks(key, c.blocks, _all(), _all())


async def push_all_blocks(c: Caches) -> None:
    await push_blocks(c.face, BlocksCacheKey(c.peer.cluster_id, 0), c.blocks, _all(), _all())


async def pull_cache(c: Caches) -> None:
    await c.face.cm.pull_cache(CacheKeyByIdAndIndex(c.peer.cluster_id, 2, 0), c.rows)


async def push_cache(c: Caches) -> None:
    await c.face.cm.push_cache(CacheKeyByIdAndIndex(c.peer.cluster_id, 2, 0), c.rows, 0)


async def layerwise(c: Caches) -> None:
    key = BlocksCacheKey(c.peer.cluster_id, 0)
    task = c.face.dd.cache_manager.transfer_cache_async(
        c.blocks,
        Ready(),
        [TransferWithCacheKeyConfig(key, range(0, 2), range(0, 2))],
        src_block_indices=_all(),
        dst_block_indices=_all(),
    )
    await _task_status(c.face, task)


Op = Callable[[Caches], Awaitable[None]]
OPS: dict[str, Op] = {
    "pull_blocks": pull_blocks,
    "push_blocks": push_all_blocks,
    "pull_cache": pull_cache,
    "push_cache": push_cache,
    "transfer_cache_async": layerwise,
}


async def fails_in_time(call: Awaitable[Any], codes: set[LLMStatusCode], limit_s: float) -> None:
    """``call`` raises an LLMException with one of ``codes`` within ``limit_s``."""
    start = time.monotonic()
    with pytest.raises(LLMException) as info:
        await asyncio.wait_for(call, limit_s + SLACK_S)
    elapsed = time.monotonic() - start
    assert info.value.status_code in codes, info.value
    assert elapsed < limit_s + SLACK_S, elapsed


async def pool_settles(face: Face, used: int) -> None:
    """The decoder's device pool returns to ``used`` (pins drop once requests end)."""
    deadline = time.monotonic() + SLACK_S
    while face.pool_used()[Placement.DEVICE] != used:
        assert time.monotonic() < deadline, (face.pool_used(), used)
        await asyncio.sleep(0.01)


#: The healthy peer :func:`still_works` links after the fault.
HEALTHY: dict[str, Any] = {"blocks": 4, "block_bytes": 4096, "cluster_id": 3}


async def still_works(face: Face, peer_factory: Any) -> None:
    """A healthy peer (a fresh process) links and serves exact bytes after the fault."""
    other = peer_factory(**HEALTHY)
    await link(face, other)
    cache = await face.cm.allocate_blocks_cache(blocks_desc(4, 4096))
    await face.cm.pull_blocks(BlocksCacheKey(3, 0), cache, [2], [0])
    for t, view in enumerate(cache.as_numpy()):
        np.testing.assert_array_equal(view[0], pattern(t, 4, 4096)[2])
    await face.cm.deallocate_blocks_cache(cache)


async def linked(
    decoder: Any, peer_factory: Any, timeout_ms: int = TIMEOUT_MS, *, healthy: bool = False
) -> tuple[Peer, Face, Caches, int]:
    """A peer process, a decoder linked to it, the decoder's caches and its pool usage. With
    ``healthy``, the healthy peer of :func:`still_works` starts beside it."""
    if healthy:
        peer_factory.prestart(**HEALTHY)
    peer = peer_factory(BLOCKS, BLOCK_BYTES)
    face = await decoder(timeout_ms=timeout_ms)
    await link(face, peer)
    caches = await Caches.make(face, peer)
    return peer, face, caches, face.pool_used()[Placement.DEVICE]


def kill(peer: Peer) -> None:
    peer.signal(signal.SIGKILL)
    peer.proc.wait(10)


def later(delay: float, fn: Callable[[], Any]) -> threading.Timer:
    """Run ``fn`` on a timer thread: it fires even while a blocking call holds the loop."""
    timer = threading.Timer(delay, fn)
    timer.start()
    return timer


async def repeat(caches: Caches, op: str) -> None:
    """Run ``op`` until it fails."""
    while True:
        await OPS[op](caches)
        await asyncio.sleep(0)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("when", ["before", "during", "after"])
async def test_peer_killed(decoder: Any, peer_factory: Any, route: str, op: str, when: str) -> None:
    peer, face, caches, used = await linked(decoder, peer_factory, healthy=True)
    run = OPS[op]
    if when == "before":
        kill(peer)
        await fails_in_time(run(caches), GONE, TIMEOUT_MS / 1000)
    elif when == "after":
        await run(caches)
        if op.startswith("pull"):  # what was reported transferred is there
            got = caches.rows.as_numpy() if op == "pull_cache" else caches.blocks.as_numpy()
            for t, view in enumerate(got):
                want = [t + 7] if op == "pull_cache" else pattern(t, BLOCKS, BLOCK_BYTES)
                assert (view[0] == want[0]).all()
        kill(peer)
        await fails_in_time(run(caches), GONE, TIMEOUT_MS / 1000)
    else:
        killer = later(0.2, lambda: kill(peer))
        try:
            await fails_in_time(repeat(caches, op), GONE, TIMEOUT_MS / 1000 + 2)
        finally:
            killer.join()
    await pool_settles(face, used)
    await caches.release()
    await still_works(face, peer_factory)


@pytest.mark.parametrize("op", ["pull_blocks", "push_blocks", "transfer_cache_async"])
@pytest.mark.parametrize("route", STALL_ROUTES, indirect=True)
async def test_peer_stalls_mid_transfer(decoder: Any, peer_factory: Any, op: str) -> None:
    peer, face, caches, used = await linked(decoder, peer_factory, 1000, healthy=True)
    stopper = later(0.2, lambda: peer.signal(signal.SIGSTOP))
    try:
        await fails_in_time(repeat(caches, op), {S.LLM_TIMEOUT, S.LLM_LINK_FAILED}, 1.0 + 2)
    finally:
        stopper.join()
        peer.signal(signal.SIGCONT)
    await pool_settles(face, used)
    await caches.release()
    await still_works(face, peer_factory)


@pytest.mark.parametrize("side", ["local", "remote"])
async def test_link_closed_during_transfers(
    decoder: Any, peer_factory: Any, route: str, side: str
) -> None:
    peer, face, caches, used = await linked(decoder, peer_factory, healthy=True)
    loop = asyncio.get_running_loop()
    unlinking: list[Any] = []

    def close() -> None:
        if side == "remote":  # the peer finalizes: it says goodbye and goes away
            peer.close()
            return
        # a forced unlink from another thread while pulls run (on the async face, the
        # unlink runs on the loop: it is collected below, never waited for here)
        unlink = face.dd.unlink_clusters([peer.info()], 1000, True)
        if face.kind == "async":
            unlinking.append(asyncio.run_coroutine_threadsafe(unlink, loop))

    closer = later(0.2, close)
    try:
        await fails_in_time(repeat(caches, "pull_blocks"), GONE, TIMEOUT_MS / 1000)
    finally:
        await asyncio.to_thread(closer.join)
        for future in unlinking:
            await asyncio.wait_for(asyncio.wrap_future(future), 10)
    await pool_settles(face, used)
    await fails_in_time(pull_blocks(caches), GONE, TIMEOUT_MS / 1000)
    await caches.release()
    await still_works(face, peer_factory)


async def test_listener_restarted_and_relinked(decoder: Any, peer_factory: Any, route: str) -> None:
    peer = peer_factory(BLOCKS, BLOCK_BYTES)
    face = await decoder(timeout_ms=TIMEOUT_MS)
    await link(face, peer)
    caches = await Caches.make(face, peer)
    await pull_blocks(caches)
    kill(peer)
    await fails_in_time(pull_blocks(caches), GONE, TIMEOUT_MS / 1000)
    # a new prompt process on the same port, same cluster id: relink and pull again
    again = peer_factory(BLOCKS, BLOCK_BYTES, port=peer.port)
    deadline = time.monotonic() + 5
    while True:
        ret, _ = await face.call(face.dd.link_clusters, [again.info()], 2000)
        if ret == S.LLM_SUCCESS:
            break
        assert ret in (S.LLM_ALREADY_LINK, S.LLM_LINK_FAILED, S.LLM_TIMEOUT) and (
            time.monotonic() < deadline
        ), ret
        if ret == S.LLM_ALREADY_LINK:  # the dead link not forgotten yet
            await face.call(face.dd.unlink_clusters, [again.info()], 1000, True)
        await asyncio.sleep(0.05)
    for view in caches.blocks.as_numpy():
        view[...] = 0
    await pull_blocks(caches)
    for t, view in enumerate(caches.blocks.as_numpy()):
        np.testing.assert_array_equal(view, pattern(t, BLOCKS, BLOCK_BYTES))
    await caches.release()


@pytest.mark.parametrize("route", STALL_ROUTES, indirect=True)
async def test_every_call_that_takes_a_timeout_keeps_it(decoder: Any, peer_factory: Any) -> None:
    face = await decoder(timeout_ms=800)
    # one stalled peer per call (cluster ids 11, 12, ...): a timed-out push takes its link down
    for cluster_id, op in enumerate(("pull_blocks", "push_blocks", "pull_cache", "push_cache"), 11):
        peer = peer_factory(BLOCKS, BLOCK_BYTES, cluster_id=cluster_id)
        await link(face, peer)
        caches = await Caches.make(face, peer)
        used = face.pool_used()[Placement.DEVICE]
        peer.signal(signal.SIGSTOP)
        try:
            await fails_in_time(OPS[op](caches), {S.LLM_TIMEOUT}, 0.8)
        finally:
            peer.signal(signal.SIGCONT)
        await pool_settles(face, used)
        await caches.release()
    peer = peer_factory(BLOCKS, BLOCK_BYTES, cluster_id=20)
    await link(face, peer)
    caches = await Caches.make(face, peer)
    peer.signal(signal.SIGSTOP)
    try:
        # a layer-wise task: synchronize and get_results honour their own timeouts
        task = face.dd.cache_manager.transfer_cache_async(
            caches.blocks,
            Ready(),
            [TransferWithCacheKeyConfig(BlocksCacheKey(20, 0), range(0, 2), range(0, 2))],
            src_block_indices=_all(),
            dst_block_indices=_all(),
        )
        start = time.monotonic()
        assert await asyncio.to_thread(task.synchronize, 100) == S.LLM_TIMEOUT
        assert await asyncio.to_thread(task.get_results, 100) == [S.LLM_TIMEOUT]
        assert time.monotonic() - start < 0.2 + SLACK_S
        with pytest.raises(LLMException) as info:
            await _task_status(face, task)
        assert info.value.status_code in {S.LLM_TIMEOUT, S.LLM_LINK_FAILED}
    finally:
        peer.signal(signal.SIGCONT)
    await caches.release()
    # unlink of a stalled peer, and a link to a listener that never answers the handshake,
    # return within their timeouts
    peer = peer_factory(4, 4096, cluster_id=21)
    await link(face, peer)
    peer.signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        await face.call(face.dd.unlink_clusters, [peer.info()], 500, True)
        assert time.monotonic() - start < 0.5 + SLACK_S
        assert face.dd._engine.links.get(21) is None
        start = time.monotonic()
        ret, rets = await face.call(face.dd.link_clusters, [peer.info()], 500)
        assert ret != S.LLM_SUCCESS and rets[0] != S.LLM_SUCCESS
        assert time.monotonic() - start < 0.5 + SLACK_S
    finally:
        peer.signal(signal.SIGCONT)
    # a port nobody listens on refuses at once
    peer.close()
    ret, rets = await face.call(face.dd.link_clusters, [peer.info()], 500)
    assert (ret, rets) == (S.LLM_LINK_FAILED, [S.LLM_LINK_FAILED])


@pytest.mark.parametrize("face_kind", ["async"], indirect=True)
@pytest.mark.parametrize("route", STALL_ROUTES, indirect=True)
async def test_cancelled_pull_writes_nothing_after_the_cancel(
    decoder: Any, peer_factory: Any
) -> None:
    # The peer holds the answer; the awaiting task is cancelled meanwhile. The cancellation
    # surfaces only once the answer has landed, and the destination does not change after.
    peer, face, caches, used = await linked(decoder, peer_factory)
    for view in caches.blocks.as_numpy():
        view[...] = 0
    peer.signal(signal.SIGSTOP)
    resumer = later(0.3, lambda: peer.signal(signal.SIGCONT))
    try:
        task = asyncio.ensure_future(pull_blocks(caches))
        await asyncio.sleep(0.05)
        task.cancel()
        start = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - start > 0.1  # it waited for the stalled answer
    finally:
        resumer.join()
        peer.signal(signal.SIGCONT)
    landed = [view.copy() for view in caches.blocks.as_numpy()]
    for t, view in enumerate(landed):
        np.testing.assert_array_equal(view, pattern(t, BLOCKS, BLOCK_BYTES))
    await asyncio.sleep(0.2)
    for view, before in zip(caches.blocks.as_numpy(), landed, strict=True):
        np.testing.assert_array_equal(view, before)
    await pool_settles(face, used)
    await caches.release()


@pytest.mark.parametrize("face_kind", ["async"], indirect=True)
async def test_cancelled_awaits_at_random_points(
    decoder: Any, peer_factory: Any, route: str
) -> None:
    _, face, caches, used = await linked(decoder, peer_factory)
    rng = random.Random(5)
    for _ in range(12):
        op = OPS[rng.choice(sorted(OPS))]
        task = asyncio.ensure_future(op(caches))
        await asyncio.sleep(rng.uniform(0, 0.03))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await pool_settles(face, used)
    # CacheTask.cancel() at random points: a config unfinished at the cancel never reports
    # success
    key = BlocksCacheKey(1, 0)
    for _ in range(8):
        cache_task = face.dd.cache_manager.transfer_cache_async(
            caches.blocks,
            Ready(),
            [TransferWithCacheKeyConfig(key, range(i, i + 1), range(i, i + 1)) for i in (0, 1)],
            src_block_indices=_all(),
            dst_block_indices=_all(),
        )
        await asyncio.sleep(rng.uniform(0, 0.02))
        cancelled = cache_task.cancel()
        results = await cache_task.wait_results()
        if cancelled:  # success only for a config that finished before the cancel
            assert all(r in (S.LLM_SUCCESS, S.LLM_FAILED, None) for r in results), results
        else:
            assert results == [S.LLM_SUCCESS, S.LLM_SUCCESS]
        await pool_settles(face, used)
    # the link is intact: what a push stores, a pull brings back byte for byte
    sent = [
        np.full(view.shape, 0x5A + t, np.uint8) for t, view in enumerate(caches.blocks.as_numpy())
    ]
    for view, data in zip(caches.blocks.as_numpy(), sent, strict=True):
        view[...] = data
    await push_all_blocks(caches)
    for view in caches.blocks.as_numpy():
        view[...] = 0
    await pull_blocks(caches)
    for view, data in zip(caches.blocks.as_numpy(), sent, strict=True):
        np.testing.assert_array_equal(view, data)
    await caches.release()
