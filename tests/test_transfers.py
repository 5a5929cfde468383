"""Pulls, pushes and layer-wise transfers between two engines, over every transport.

Each scenario runs over the loopback and TCP transports, and over TCP links whose transfers
take the UCX route (where UCX is installed), through both faces: the decoder
(cluster 2) is the engine under test, blocking or async; the prompt (cluster 1) is an
``AsyncLLMDataDist`` that listens and serves. Memory is checked byte for byte.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    CacheTask,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aio_datadist._routes.ucx import worker as ucx
from aio_datadist._transport.pending import Request
from aio_datadist.status import NotYetLinkError, ParamInvalidError
from tests.conftest import Face, make_options, pool_cfg, push_blocks
from tests.ports import free_port
from tests.providers import peer_memory, ucx_links

S = LLMStatusCode
#: "ucx": TCP links whose transfers take the UCX route (the same-host route off).
TRANSPORTS = (
    ["loopback"]
    + (["tcp"] if importlib.util.find_spec("aio_datadist._transport.tcp") else [])
    + (["ucx"] if ucx.available() is None else [])
)
_ports = itertools.count(31000)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@dataclass
class Pair:
    """A listening async prompt (cluster 1) and a decoder face (cluster 2)."""

    prompt: AsyncLLMDataDist
    decoder: Face
    transport: str
    info: LLMClusterInfo = field(default_factory=LLMClusterInfo)
    keep: list[Any] = field(default_factory=list)

    @property
    def wire(self) -> str:
        """The transport the links run on."""
        return "tcp" if self.transport == "ucx" else self.transport

    async def link(self) -> None:
        ret, rets = await self.decoder.call(self.decoder.dd.link_clusters, [self.info], 5000)
        assert (ret, rets) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        if self.transport == "ucx":  # the route is there once link_clusters returned
            routes = self.decoder.dd._engine.link_table().get(1).routes
            assert [r.name for r in routes][:2] == ["ucx", "staged-ucx"], routes

    def arrays(self, num_tensors: int, rows: int, elems: int, seed: int) -> list[np.ndarray]:
        """Random float32 tensors of ``rows x elems``, kept alive for the test."""
        rng = np.random.default_rng(seed)
        made = [rng.standard_normal((rows, elems)).astype(np.float32) for _ in range(num_tensors)]
        self.keep.append(made)
        return made


PairFactory = Callable[..., Any]


@pytest.fixture
async def make_pair(transport: str, face_kind: str) -> AsyncIterator[PairFactory]:
    made: list[Pair] = []

    async def factory(
        *, remote_accessible: bool = False, link: bool = True, same_host: bool | None = None
    ) -> Pair:
        wire = "tcp" if transport == "ucx" else transport
        port = 0 if wire == "tcp" else next(_ports)
        prompt = AsyncLLMDataDist(LLMRole.PROMPT, 1)
        opts = dict(
            device_pool=pool_cfg(),
            host_pool=pool_cfg(),
            remote_accessible=remote_accessible,
            transport=wire,
            sync_kv_timeout=5000,
            same_host=False if transport == "ucx" else same_host,
            ucx=transport == "ucx" or None,
        )
        await prompt.init(make_options(**opts, listen=f"127.0.0.1:{port}"))
        decoder = Face(face_kind, LLMRole.DECODER, 2)
        pair = Pair(prompt, decoder, transport)
        made.append(pair)
        await decoder.init(make_options(**opts))
        if transport == "ucx":
            _publish_before_return(prompt, decoder)
        address = prompt._engine.link_table().listen_address
        assert address is not None
        pair.info.remote_cluster_id = 1
        pair.info.append_local_ip_info("127.0.0.1", 0)
        pair.info.append_remote_ip_info("127.0.0.1", address[1])
        if link:
            await pair.link()
        return pair

    yield factory
    for pair in made:
        await pair.decoder.finalize()
        await pair.prompt.finalize()


def _publish_before_return(prompt: AsyncLLMDataDist, decoder: Face) -> None:
    """Make the prompt's allocations and registrations return once the decoder applied the
    UCX table that names them (a new cache reaches the UCX route one table round trip after
    it was made, the link carrying it until then): the scenarios then test the route."""
    cm = prompt.cache_manager

    def settled(call: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = await call(*args, **kwargs)
            link = decoder.dd._engine.link_table().get(1)
            if link is not None:
                remote = ucx_links(decoder.dd._engine).route_of(link.channel)
                seq = ucx_links(prompt._engine).board.seq
                await wait_until(lambda: remote is None or remote.seq >= seq)
            return result

        return wrapper

    for name in (
        "allocate_cache",
        "allocate_blocks_cache",
        "register_cache",
        "register_blocks_cache",
    ):
        setattr(cm, name, settled(getattr(cm, name)))


def batch_desc(num_tensors: int = 4, rows: int = 2, elems: int = 1024) -> CacheDesc:
    return CacheDesc(num_tensors, [rows, elems], DataType.DT_FLOAT, Placement.DEVICE)


async def wait_until(predicate: Callable[[], Any], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def expect_status(status: LLMStatusCode, coro: Any) -> LLMException:
    with pytest.raises(LLMException) as info:
        await coro
    assert info.value.status_code == status, info.value
    return info.value


# -- pull_cache ---------------------------------------------------------------------------
async def test_a_pulled_key_is_gone_for_the_very_next_pull(make_pair: PairFactory) -> None:
    # The puller confirms (PULL_DONE) before its call returns, so the peer drops the key
    # before it sees the next request: a repeated pull is refused, every time.
    pair = await make_pair()
    dst = await pair.decoder.cm.allocate_cache(batch_desc(rows=1))
    for req_id in range(30):
        key = CacheKey(1, req_id=100 + req_id)
        src = await pair.prompt.cache_manager.allocate_cache(batch_desc(rows=1), [key])
        await pair.decoder.cm.pull_cache(key, dst)
        await expect_status(S.LLM_KV_CACHE_NOT_EXIST, pair.decoder.cm.pull_cache(key, dst))
        await pair.prompt.cache_manager.deallocate_cache(src)
    await pair.decoder.cm.deallocate_cache(dst)


async def test_pull_cache_by_key_moves_bytes_and_drops_the_key(make_pair: PairFactory) -> None:
    pair = await make_pair()
    pcm = pair.prompt.cache_manager
    keys = [CacheKey(1, req_id=10), CacheKey(1, req_id=11)]
    src = await pcm.allocate_cache(batch_desc(), keys)
    rng = np.random.default_rng(1)
    for view in src.as_numpy():
        view[...] = rng.standard_normal(view.shape)
    dst = await pair.decoder.cm.allocate_cache(batch_desc())

    await pair.decoder.cm.pull_cache(keys[0], dst, batch_index=1)
    for s, d in zip(src.as_numpy(), dst.as_numpy(), strict=True):
        np.testing.assert_array_equal(d[1], s[0])
        assert not d[0].any()

    # the pulled key is gone once the puller confirmed; the other key still pulls
    async def gone() -> bool:
        try:
            await pair.decoder.cm.pull_cache(keys[0], dst, batch_index=0)
        except LLMException as exc:
            return exc.status_code == S.LLM_KV_CACHE_NOT_EXIST
        return False

    deadline = time.monotonic() + 5
    while not await gone():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)

    # layer ranges: remote layer 1 (tensors 2, 3) into local layer 0 (tensors 0, 1)
    await pair.decoder.cm.pull_cache(
        keys[1], dst, 0, src_layer_range=range(1, 2), dst_layer_range=range(0, 1)
    )
    s_views, d_views = src.as_numpy(), dst.as_numpy()
    np.testing.assert_array_equal(d_views[0][0], s_views[2][1])
    np.testing.assert_array_equal(d_views[1][0], s_views[3][1])

    # the prompt's memory returns once the id and every key are gone
    await pcm.deallocate_cache(src)
    await wait_until(lambda: pcm.pool_stats(Placement.DEVICE).used == 0)
    await pair.decoder.cm.deallocate_cache(dst)


async def test_pull_cache_size_and_errors(make_pair: PairFactory) -> None:
    pair = await make_pair()
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    key = CacheKey(1, req_id=7)
    src = await pcm.allocate_cache(batch_desc(rows=1), [key])
    for view in src.as_numpy():
        view[...] = 3.0
    dst = await dcm.allocate_cache(batch_desc(rows=1))
    missing = CacheKey(1, req_id=99)
    await expect_status(S.LLM_KV_CACHE_NOT_EXIST, dcm.pull_cache(missing, dst))
    await expect_status(S.LLM_NOT_YET_LINK, dcm.pull_cache(CacheKey(5, req_id=7), dst))
    await expect_status(S.LLM_PARAM_INVALID, dcm.pull_cache(key, dst, size=1 << 30))
    with pytest.raises(TypeError):
        await dcm.pull_cache(key, dst, bogus=1)
    # a remote row shorter than asked is refused there and the link stays usable
    small = await pcm.allocate_cache(batch_desc(rows=1, elems=16), [CacheKey(1, req_id=8)])
    await expect_status(S.LLM_PARAM_INVALID, dcm.pull_cache(CacheKey(1, req_id=8), dst))
    await dcm.pull_cache(key, dst, size=256)
    for view in dst.as_numpy():
        assert (view[0, :64] == 3.0).all() and not view[0, 64:].any()
    for cache in (src, small):
        await pcm.deallocate_cache(cache)
    await pcm.remove_cache_key(CacheKey(1, req_id=8))
    await dcm.deallocate_cache(dst)


# -- pull_blocks --------------------------------------------------------------------------
async def test_pull_blocks_between_registered_caches(make_pair: PairFactory) -> None:
    pair = await make_pair()
    desc = CacheDesc(4, [8, 256], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = pair.arrays(4, 8, 256, seed=2)
    d_arrays = [np.zeros((8, 256), np.float32) for _ in range(4)]
    pair.keep.append(d_arrays)
    p_cache = await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    d_cache = await pair.decoder.cm.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in d_arrays], BlocksCacheKey(2, 0)
    )
    await pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), d_cache, [0, 3, 5], [7, 1, 2])
    for p, d in zip(p_arrays, d_arrays, strict=True):
        np.testing.assert_array_equal(d[[7, 1, 2]], p[[0, 3, 5]])
        assert not d[[0, 3, 4, 5, 6]].any()
    # positional form of vllm-ascend, with layer ranges
    await pair.decoder.cm.pull_blocks(
        BlocksCacheKey(1, 0),
        d_cache,
        [6],
        [6],
        src_layer_range=range(1, 2),
        dst_layer_range=range(0, 1),
    )
    np.testing.assert_array_equal(d_arrays[0][6], p_arrays[2][6])
    np.testing.assert_array_equal(d_arrays[1][6], p_arrays[3][6])
    assert not d_arrays[2][6].any()
    # bounds are checked on the serving side; the link stays usable
    await expect_status(
        S.LLM_PARAM_INVALID, pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), d_cache, [8], [0])
    )
    await expect_status(
        S.LLM_KV_CACHE_NOT_EXIST,
        pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 5), d_cache, [0], [0]),
    )
    await expect_status(
        S.LLM_PARAM_INVALID, pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), d_cache, [0], [8])
    )
    await pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), d_cache, [1], [0])
    np.testing.assert_array_equal(d_arrays[3][0], p_arrays[3][1])
    await pair.prompt.cache_manager.unregister_cache(p_cache.cache_id)
    await pair.decoder.cm.unregister_cache(d_cache.cache_id)


@pytest.mark.parametrize("transport", ["tcp"], indirect=True)
async def test_small_pulls_and_pushes_of_blocks_are_answered_natively_over_tcp(
    make_pair: PairFactory,
) -> None:
    pair = await make_pair(same_host=False, remote_accessible=True)
    table = pair.prompt._engine.link_table().handler.serve_table  # type: ignore[attr-defined]
    desc = CacheDesc(2, [8, 256], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = pair.arrays(2, 8, 256, seed=4)
    hidden = pair.arrays(2, 8, 256, seed=5)
    p_cache = await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in hidden], BlocksCacheKey(1, 1), remote_accessible=False
    )
    assert table.stats().caches == 1  # only what peers may read
    d_cache = await pair.decoder.cm.allocate_blocks_cache(desc)
    before = table.stats().served
    for i in range(20):
        await pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), d_cache, [i % 8, 7], [i % 8, 0])
    got = d_cache.as_numpy()
    for p, d in zip(p_arrays, got, strict=True):
        np.testing.assert_array_equal(d.view(np.float32).reshape(8, 256)[0], p[7])
    # the server counts a request once its answer is sent: the requester may see it first
    await wait_until(lambda: table.stats().served - before == 20)
    fill = np.full((8, 256), 3.5, np.float32)
    d_view = [d.view(np.float32).reshape(8, 256) for d in got]
    for d in d_view:
        d[2] = fill[2]
    for _ in range(5):
        await push_blocks(pair.decoder, BlocksCacheKey(1, 0), d_cache, [2], [4])
    for p in p_arrays:
        np.testing.assert_array_equal(p[4], fill[2])
    await wait_until(lambda: table.stats().served - before == 25)
    # refusals still come from the general serving path, and the link stays usable
    await expect_status(
        S.LLM_PARAM_INVALID, pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), d_cache, [8], [0])
    )
    await expect_status(
        S.LLM_KV_CACHE_NOT_EXIST,
        pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 1), d_cache, [0], [0]),
    )
    await pair.prompt.cache_manager.unregister_cache(p_cache.cache_id)
    assert table.stats().caches == 0
    await expect_status(
        S.LLM_KV_CACHE_NOT_EXIST,
        pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), d_cache, [0], [0]),
    )
    assert table.stats().served - before == 25
    await pair.decoder.cm.deallocate_blocks_cache(d_cache)


@pytest.mark.parametrize("transport", ["tcp"], indirect=True)
@pytest.mark.parametrize("face_kind", ["async"], indirect=True)
async def test_the_event_loop_reads_the_small_answers_it_awaits_over_tcp(
    make_pair: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    readers: list[str] = []  # the thread that completed each request
    complete = Request.complete

    def spy(req: Request) -> None:
        readers.append(threading.current_thread().name)
        complete(req)

    monkeypatch.setattr(Request, "complete", spy)
    pair = await make_pair(same_host=False, remote_accessible=True)
    desc = CacheDesc(2, [8, 256], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = pair.arrays(2, 8, 256, seed=4)
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    d_cache = await pair.decoder.cm.allocate_blocks_cache(desc)
    readers.clear()
    for i in range(20):
        await pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), d_cache, [i % 8], [i % 8])
        await push_blocks(pair.decoder, BlocksCacheKey(1, 0), d_cache, [i % 8], [i % 8])
    for p, d in zip(p_arrays, d_cache.as_numpy(), strict=True):
        np.testing.assert_array_equal(d.view(np.float32).reshape(8, 256), p)
    # The loop read the answers itself through the link's pump (a pull's payload straight
    # into its rows, in the call or at its readiness) and completed them: all but the few
    # the reader thread met first.
    loop_thread = threading.current_thread().name
    assert len(readers) == 40 and readers.count(loop_thread) >= 30, readers
    await pair.decoder.cm.deallocate_blocks_cache(d_cache)


async def test_pull_blocks_scatters_a_remote_row(make_pair: PairFactory) -> None:
    pair = await make_pair()
    key = CacheKey(1, req_id=3)
    src = await pair.prompt.cache_manager.allocate_cache(batch_desc(rows=1, elems=3 * 64), [key])
    for i, view in enumerate(src.as_numpy()):
        view[...] = np.arange(view.size, dtype=np.float32).reshape(view.shape) + 1000 * i
    blocks = CacheDesc(4, [6, 64], DataType.DT_FLOAT, Placement.DEVICE)
    dst = await pair.decoder.cm.allocate_blocks_cache(blocks)
    await pair.decoder.cm.pull_blocks(key, dst, (), [5, 0, 2])
    for s, d in zip(src.as_numpy(), dst.as_numpy(), strict=True):
        np.testing.assert_array_equal(d[[5, 0, 2]].reshape(-1), s[0])
    # pull_blocks never drops the key
    await pair.decoder.cm.pull_blocks(key, dst, [], [1, 3, 4])
    await pair.prompt.cache_manager.deallocate_cache(src)
    await pair.prompt.cache_manager.remove_cache_key(key)
    await pair.decoder.cm.deallocate_blocks_cache(dst)


# -- pushes -------------------------------------------------------------------------------
async def test_push_blocks_and_push_cache(make_pair: PairFactory) -> None:
    pair = await make_pair(remote_accessible=True)
    desc = CacheDesc(4, [8, 128], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = [np.zeros((8, 128), np.float32) for _ in range(4)]
    d_arrays = pair.arrays(4, 8, 128, seed=4)
    pair.keep.append(p_arrays)
    p_cache = await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    d_cache = await pair.decoder.cm.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in d_arrays], BlocksCacheKey(2, 0)
    )
    await push_blocks(pair.decoder, BlocksCacheKey(1, 0), d_cache, [0, 1, 2], [5, 4, 3])
    for p, d in zip(p_arrays, d_arrays, strict=True):  # landed when the call returned
        np.testing.assert_array_equal(p[[5, 4, 3]], d[[0, 1, 2]])
    await push_blocks(
        pair.decoder,
        BlocksCacheKey(1, 0),
        d_cache,
        src_blocks=[7],
        dst_blocks=[7],
        src_layer_range=range(3, 4),
        dst_layer_range=range(0, 1),
        tensor_num_per_layer=1,
    )
    np.testing.assert_array_equal(p_arrays[0][7], d_arrays[3][7])
    with pytest.raises(LLMException) as info:
        await push_blocks(pair.decoder, BlocksCacheKey(1, 0), d_cache, [0], [9])
    assert info.value.status_code == S.LLM_PARAM_INVALID

    # push_cache: a local batch row into the remote row named by id and index
    rows = await pair.prompt.cache_manager.allocate_cache(batch_desc(rows=2))
    local = await pair.decoder.cm.allocate_cache(batch_desc(rows=2))
    for view in local.as_numpy():
        view[...] = 5.0
    await pair.decoder.cm.push_cache(CacheKeyByIdAndIndex(1, rows.cache_id, 1), local, 0)
    for view in rows.as_numpy():
        assert (view[1] == 5.0).all() and not view[0].any()
    with pytest.raises(TypeError):
        await pair.decoder.cm.pull_cache(CacheKey(1, req_id=1), local)
    await pair.prompt.cache_manager.deallocate_cache(rows)
    await pair.decoder.cm.deallocate_cache(local)
    await pair.prompt.cache_manager.unregister_cache(p_cache.cache_id)
    await pair.decoder.cm.unregister_cache(d_cache.cache_id)


async def test_push_needs_remote_cache_access(make_pair: PairFactory) -> None:
    pair = await make_pair()
    cache = await pair.decoder.cm.allocate_blocks_cache(CacheDesc(2, [4, 16], DataType.DT_FLOAT))
    with pytest.raises(LLMException) as info:
        await push_blocks(pair.decoder, BlocksCacheKey(1, 0), cache, [0], [0])
    assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
    await pair.decoder.cm.deallocate_blocks_cache(cache)


# -- transfer_cache_async -----------------------------------------------------------------
class Recorder(LayerSynchronizer):
    """A plain synchroniser that records the layers it was asked for."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.layers: list[int] = []
        self.fail_at = fail_at

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.layers.append(layer_index)
        return layer_index != self.fail_at


async def results(face: Face, task: CacheTask) -> list[LLMStatusCode | None]:
    if face.kind == "sync":
        return await asyncio.to_thread(task.get_results, 10_000)
    return await task.wait_results()


async def test_transfer_cache_async_by_key(make_pair: PairFactory) -> None:
    pair = await make_pair(remote_accessible=True)
    layers = 3
    desc = CacheDesc(2 * layers, [6, 64], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = [np.zeros((6, 64), np.float32) for _ in range(2 * layers)]
    d_arrays = pair.arrays(2 * layers, 6, 64, seed=5)
    pair.keep.append(p_arrays)
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    d_cache = await pair.decoder.cm.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in d_arrays], BlocksCacheKey(2, 0)
    )
    sync = Recorder()
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        d_cache,
        sync,
        [TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(1, 3), range(0, 2))],
        src_block_indices=[0, 2],
        dst_block_indices=[4, 1],
    )
    assert await results(pair.decoder, task) == [S.LLM_SUCCESS]
    assert task.synchronize(0) == S.LLM_SUCCESS and task.done()
    assert sync.layers == [1, 2]
    for src_layer, dst_layer in ((1, 0), (2, 1)):
        for j in range(2):
            p, d = p_arrays[2 * dst_layer + j], d_arrays[2 * src_layer + j]
            np.testing.assert_array_equal(p[[4, 1]], d[[0, 2]])
    assert not p_arrays[4].any() and not p_arrays[5].any()

    # a synchroniser that fails stops the task with LLM_PARAM_INVALID
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        d_cache,
        Recorder(fail_at=0),
        [TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 3), range(0, 3))],
        src_block_indices=[0],
        dst_block_indices=[0],
    )
    assert await results(pair.decoder, task) == [S.LLM_PARAM_INVALID]
    # a config whose layers never ran stays None
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        d_cache,
        Recorder(fail_at=0),
        [
            TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 1), range(0, 1)),
            TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(2, 3), range(2, 3)),
        ],
        src_block_indices=[0],
        dst_block_indices=[0],
    )
    assert await results(pair.decoder, task) == [S.LLM_PARAM_INVALID, None]
    await pair.decoder.cm.unregister_cache(d_cache.cache_id)


@pytest.mark.parametrize("per_layer", [1, 3])
async def test_transfer_cache_async_by_key_with_tensor_num_per_layer(
    make_pair: PairFactory, per_layer: int
) -> None:
    """A layer of ``tensor_num_per_layer`` tensors (one: K and V joined, as vLLM's pages and
    MLA's latent cache keep them) moves as a unit."""
    pair = await make_pair(remote_accessible=True)
    layers = 3
    num = per_layer * layers
    desc = CacheDesc(num, [5, 32], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = [np.zeros((5, 32), np.float32) for _ in range(num)]
    d_arrays = pair.arrays(num, 5, 32, seed=11)
    pair.keep.append(p_arrays)
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    d_cache = await pair.decoder.cm.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in d_arrays], BlocksCacheKey(2, 0)
    )
    sync = Recorder()
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        d_cache,
        sync,
        [TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(1, 3), range(0, 2))],
        src_block_indices=[3, 0],
        dst_block_indices=[1, 4],
        tensor_num_per_layer=per_layer,
    )
    assert await results(pair.decoder, task) == [S.LLM_SUCCESS]
    assert sync.layers == [1, 2]
    for src_layer, dst_layer in ((1, 0), (2, 1)):
        for j in range(per_layer):
            p, d = p_arrays[per_layer * dst_layer + j], d_arrays[per_layer * src_layer + j]
            np.testing.assert_array_equal(p[[1, 4]], d[[3, 0]])
    for j in range(per_layer):  # destination layer 2 was not written
        assert not p_arrays[per_layer * 2 + j].any()
    cm = pair.decoder.dd.cache_manager
    key = [TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, 1), range(0, 1))]
    for bad in (2, 0):  # not a whole number of layers; fewer than one tensor per layer
        with pytest.raises(LLMException) as info:
            cm.transfer_cache_async(d_cache, Recorder(), key, [0], [0], tensor_num_per_layer=bad)
        assert info.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        cm.transfer_cache_async(d_cache, Recorder(), key, [0], [0], tensor_num_per_layer="1")
    await pair.decoder.cm.unregister_cache(d_cache.cache_id)


async def test_transfer_cache_async_by_address_with_one_tensor_per_layer(
    make_pair: PairFactory,
) -> None:
    pair = await make_pair()
    desc = CacheDesc(3, [4, 16], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = [np.zeros((4, 16), np.float32) for _ in range(3)]
    pair.keep.append(p_arrays)
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    src = pair.arrays(3, 4, 16, seed=12)
    s_cache = await pair.decoder.cm.register_blocks_cache(desc, [int(a.ctypes.data) for a in src])
    addrs = [int(a.ctypes.data) for a in p_arrays[1:]]  # layers 1 and 2, one address each
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        s_cache,
        Recorder(),
        [TransferConfig(1, addrs, range(1, 3))],
        src_block_indices=[2, 0],
        dst_block_indices=[3, 1],
        tensor_num_per_layer=1,
    )
    assert await results(pair.decoder, task) == [S.LLM_SUCCESS]
    for layer in (1, 2):
        np.testing.assert_array_equal(p_arrays[layer][[3, 1]], src[layer][[2, 0]])
    assert not p_arrays[0].any()
    with pytest.raises(LLMException):  # two addresses for one layer of one tensor
        pair.decoder.dd.cache_manager.transfer_cache_async(
            s_cache,
            Recorder(),
            [TransferConfig(1, addrs, range(1, 2))],
            [0],
            [0],
            tensor_num_per_layer=1,
        )
    await pair.decoder.cm.unregister_cache(s_cache.cache_id)


async def test_transfer_cache_async_by_address(make_pair: PairFactory) -> None:
    pair = await make_pair()
    layers = 2
    p_desc = CacheDesc(2 * layers, [4, 256], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = [np.zeros((4, 256), np.float32) for _ in range(2 * layers)]
    pair.keep.append(p_arrays)
    await pair.prompt.cache_manager.register_blocks_cache(
        p_desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    # a batch source row of 1.5 blocks goes into destination blocks 3 and 0
    src = await pair.decoder.cm.allocate_cache(batch_desc(2 * layers, rows=2, elems=384))
    for view in src.as_numpy():
        view[...] = np.random.default_rng(6).standard_normal(view.shape)
    addrs = [int(a.ctypes.data) for a in p_arrays]
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        src,
        Recorder(),
        [TransferConfig(1, addrs, range(0, layers), src_batch_index=1)],
        dst_block_indices=[3, 0],
        dst_block_memory_size=256 * 4,
    )
    assert await results(pair.decoder, task) == [S.LLM_SUCCESS]
    for s, p in zip(src.as_numpy(), p_arrays, strict=True):
        np.testing.assert_array_equal(p[3], s[1][:256])
        np.testing.assert_array_equal(p[0][:128], s[1][256:])
        assert not p[0][128:].any() and not p[1].any()
    # an address outside the peer's memory is refused there
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        src, Recorder(), [TransferConfig(1, [64, 64, 64, 64])]
    )
    assert await results(pair.decoder, task) == [S.LLM_PARAM_INVALID]
    await pair.decoder.cm.deallocate_cache(src)


async def test_transfer_cache_async_validation(make_pair: PairFactory) -> None:
    pair = await make_pair()
    cm = pair.decoder.dd.cache_manager
    cache = await pair.decoder.cm.allocate_cache(batch_desc())
    with pytest.raises(TypeError):
        cm.transfer_cache_async(None, Recorder(), [TransferConfig(1, [1, 2, 3, 4])])
    with pytest.raises(TypeError):
        cm.transfer_cache_async(cache, object(), [TransferConfig(1, [1, 2, 3, 4])])
    with pytest.raises(TypeError):
        cm.transfer_cache_async(
            cache, Recorder(), [TransferWithCacheKeyConfig(BlocksCacheKey(1), range(1), range(1))]
        )
    with pytest.raises(LLMException):
        cm.transfer_cache_async(cache, Recorder(), [TransferConfig(1, [1, 2])])
    with pytest.raises(LLMException):
        cm.transfer_cache_async(cache, Recorder(), [TransferConfig(1, [1, 2, 3, 4])], [0], [])
    with pytest.raises(LLMException):  # a batch source into blocks needs their size
        cm.transfer_cache_async(cache, Recorder(), [TransferConfig(1, [1, 2, 3, 4])], None, [0])
    await pair.decoder.cm.deallocate_cache(cache)


@pytest.mark.parametrize("face_kind", ["async"], indirect=True)
async def test_async_synchroniser_overlap_and_cancel(make_pair: PairFactory) -> None:
    pair = await make_pair(remote_accessible=True)
    layers = 4
    desc = CacheDesc(2 * layers, [2, 64], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = [np.zeros((2, 64), np.float32) for _ in range(2 * layers)]
    d_arrays = pair.arrays(2 * layers, 2, 64, seed=7)
    pair.keep.append(p_arrays)
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    cm = pair.decoder.dd.cache_manager
    d_cache = await cm.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in d_arrays], BlocksCacheKey(2, 0)
    )
    ready = [asyncio.Event() for _ in range(layers)]
    asked: list[int] = []

    class Events(LayerSynchronizer):
        async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
            asked.append(layer_index)
            await ready[layer_index].wait()
            return True

    config = TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, layers), range(0, layers))
    task = cm.transfer_cache_async(d_cache, Events(), [config], [0, 1], [0, 1])
    ready[0].set()
    await wait_until(lambda: asked == [0, 1])  # layer 1 is awaited while layer 0 moves
    await wait_until(lambda: bool(p_arrays[0].any()))
    assert not task.done()
    assert task.cancel()
    with pytest.raises(asyncio.CancelledError):  # the task's own cancel, not this coroutine's
        await task
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    assert await task.wait_results() == [S.LLM_FAILED]
    np.testing.assert_array_equal(p_arrays[1], d_arrays[1])
    assert not any(p.any() for p in p_arrays[2:])  # nothing after the cancelled layer
    assert not task.cancel()

    # several coroutines await one task; all layers ready at once
    for event in ready:
        event.set()
    task = cm.transfer_cache_async(d_cache, Events(), [config], [0, 1], [0, 1])
    assert await asyncio.gather(task, task, task.wait_results()) == [
        S.LLM_SUCCESS,
        S.LLM_SUCCESS,
        [S.LLM_SUCCESS],
    ]
    for p, d in zip(p_arrays, d_arrays, strict=True):
        np.testing.assert_array_equal(p, d)
    await cm.unregister_cache(d_cache.cache_id)


async def test_a_failed_push_blocks_task_raises_what_the_blocking_call_raises(
    make_pair: PairFactory,
) -> None:
    pair = await make_pair(remote_accessible=True)
    desc = CacheDesc(2, [8, 64], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = [np.zeros((8, 64), np.float32) for _ in range(2)]
    pair.keep.append(p_arrays)
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    d_cache = await pair.decoder.cm.allocate_blocks_cache(desc)
    failures = [
        (BlocksCacheKey(1, 0), [9], ParamInvalidError),  # refused by the peer: 8 blocks
        (BlocksCacheKey(5, 0), [0], NotYetLinkError),  # refused here: no link
    ]
    for key, dst_blocks, error in failures:
        assert error.code is not None
        call = pair.decoder.cm.push_blocks(key, d_cache, [0], dst_blocks)
        if pair.decoder.kind == "async":
            assert isinstance(call, CacheTask)
            assert await call.wait_results() == [error.code]  # never raises
        with pytest.raises(error) as info:
            await call  # the blocking call, or the task
        assert info.value.status_code == error.code
        assert "transfer config" not in str(info.value)  # the failure's own message
        if isinstance(call, CacheTask):
            assert info.value.results == [error.code]
            with pytest.raises(error) as again:
                await call
            assert again.value is info.value
            assert call.synchronize(0) == error.code
    await push_blocks(pair.decoder, BlocksCacheKey(1, 0), d_cache, [1], [2])
    await pair.decoder.cm.deallocate_blocks_cache(d_cache)


class Raising(LayerSynchronizer):
    """A plain synchroniser that raises ``error`` for ``layer``."""

    def __init__(self, layer: int, error: Exception) -> None:
        self.layer, self.error = layer, error

    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        if layer_index == self.layer:
            raise self.error
        return True


class AsyncRaising(Raising):
    """The same as an ``async def``."""

    async def synchronize_layer(  # type: ignore[override]
        self, layer_index: int, timeout_in_millis: int | None
    ) -> bool:
        return super().synchronize_layer(layer_index, timeout_in_millis)


async def test_an_exception_in_the_synchroniser_is_kept_and_logged_once(
    make_pair: PairFactory, caplog: pytest.LogCaptureFixture
) -> None:
    pair = await make_pair(remote_accessible=True)
    layers = 3
    desc = CacheDesc(2 * layers, [2, 64], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = [np.zeros((2, 64), np.float32) for _ in range(2 * layers)]
    d_arrays = pair.arrays(2 * layers, 2, 64, seed=8)
    pair.keep.append(p_arrays)
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    d_cache = await pair.decoder.cm.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in d_arrays], BlocksCacheKey(2, 0)
    )
    config = [TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(0, layers), range(0, layers))]
    kinds = [Raising] + ([AsyncRaising] if pair.decoder.kind == "async" else [])
    caplog.set_level(logging.WARNING, logger="aio_datadist")
    cm = pair.decoder.dd.cache_manager
    for kind in kinds:
        for p in p_arrays:
            p[...] = 0
        boom = ValueError("boom")
        caplog.clear()
        task = cm.transfer_cache_async(d_cache, kind(1, boom), config, [0], [0])
        if pair.decoder.kind == "sync":
            assert await asyncio.to_thread(task.synchronize, 10_000) == S.LLM_PARAM_INVALID
        else:
            with pytest.raises(ParamInvalidError) as info:
                await task
            assert str(info.value) == "synchronize_layer(1) raised ValueError: boom"
            assert info.value.__cause__ is boom
            assert info.value.results == [S.LLM_PARAM_INVALID]
        assert task.get_results(0) == [S.LLM_PARAM_INVALID]
        warnings = [
            r
            for r in caplog.records
            if r.name.startswith("aio_datadist") and r.levelno >= logging.WARNING
        ]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert warnings[0].levelno == logging.WARNING
        assert warnings[0].getMessage().startswith("task.synchronizer_failed layer=1")
        assert warnings[0].exc_info is not None and warnings[0].exc_info[1] is boom
        np.testing.assert_array_equal(p_arrays[0][0], d_arrays[0][0])  # layer 0 went
        assert not any(p.any() for p in p_arrays[2:])  # nothing from layer 1 on

    # returning False fails the task too, without a log line
    caplog.clear()
    task = cm.transfer_cache_async(d_cache, Recorder(fail_at=0), config, [0], [0])
    if pair.decoder.kind == "async":
        with pytest.raises(ParamInvalidError, match=r"synchronize_layer\(0\) returned False"):
            await task
    assert await results(pair.decoder, task) == [S.LLM_PARAM_INVALID]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    await pair.decoder.cm.unregister_cache(d_cache.cache_id)


async def test_a_blocks_cache_key_outside_uint64_is_refused_before_any_link_lookup(
    make_pair: PairFactory,
) -> None:
    pair = await make_pair(remote_accessible=True)
    desc = CacheDesc(2, [4, 64], DataType.DT_FLOAT, Placement.DEVICE)
    d_cache = await pair.decoder.cm.allocate_blocks_cache(desc)
    cm = pair.decoder.dd.cache_manager
    for key, named in (
        (BlocksCacheKey(-1, 0), "cluster_id -1"),
        (BlocksCacheKey(1, 2**64), f"model_id {2**64}"),
    ):
        refused = f"{key!r}: BlocksCacheKey {named} is outside uint64"
        with pytest.raises(ValueError) as info:
            await pair.decoder.cm.pull_blocks(key, d_cache, [0], [0])
        assert str(info.value).startswith(f"src_cache_key {refused}")
        with pytest.raises(ValueError) as info:
            await push_blocks(pair.decoder, key, d_cache, [0], [0])
        assert str(info.value).startswith(f"dst_cache_key {refused}")
        with pytest.raises(ValueError) as info:
            cm.transfer_cache_async(
                d_cache,
                Recorder(),
                [TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1))],
                [0],
                [0],
            )
        assert str(info.value).startswith(f"transfer_configs[0].cache_key {refused}")
    await pair.decoder.cm.deallocate_blocks_cache(d_cache)


# -- links through the faces --------------------------------------------------------------
async def test_link_unlink_and_switch_role(make_pair: PairFactory) -> None:
    pair = await make_pair(link=False)
    dd = pair.decoder
    cache = await dd.cm.allocate_cache(batch_desc())
    await expect_status(S.LLM_NOT_YET_LINK, dd.cm.pull_cache(CacheKey(1, req_id=1), cache))
    await pair.link()
    assert await dd.call(dd.dd.link_clusters, [pair.info], 5000) == (
        S.LLM_ALREADY_LINK,
        [S.LLM_ALREADY_LINK],
    )
    options = LLMConfig()
    options.listen_ip_info = "127.0.0.1:0" if pair.wire == "tcp" else "127.0.0.1:31999"
    await expect_status(
        S.LLM_EXIST_LINK, dd.call(dd.dd.switch_role, LLMRole.PROMPT, options.generate_options())
    )
    assert await dd.call(dd.dd.unlink_clusters, [pair.info], 5000) == (
        S.LLM_SUCCESS,
        [S.LLM_SUCCESS],
    )
    await wait_until(lambda: pair.prompt._engine.link_table().get(2) is None)
    assert await dd.call(dd.dd.unlink_clusters, [pair.info], 5000) == (
        S.LLM_NOT_YET_LINK,
        [S.LLM_NOT_YET_LINK],
    )
    presence = dd.dd._engine.link_table().local.presence
    assert (presence is not None) == (pair.transport == "tcp")
    await dd.call(dd.dd.switch_role, LLMRole.PROMPT, options.generate_options())
    assert dd.dd._engine.link_table().listen_address is not None
    await dd.call(dd.dd.switch_role, LLMRole.DECODER)
    assert dd.dd._engine.link_table().listen_address is None
    # the new role keeps the same-host identity (and with it the one-sided route)
    local = dd.dd._engine.link_table().local
    assert local.role is LLMRole.DECODER and local.presence == presence
    await pair.link()
    if presence is not None:
        assert peer_memory(dd.dd._engine, 1) is not None
    await dd.cm.deallocate_cache(cache)


async def test_listen_address_is_the_bound_address(face_kind: str) -> None:
    """A listener on port 0 reports the port the system chose; a client reports None."""
    server, client = Face(face_kind, LLMRole.PROMPT, 1), Face("async", LLMRole.DECODER, 2)
    with pytest.raises(RuntimeError):
        _ = server.dd.listen_address
    try:
        await server.init(make_options(transport="tcp", listen="127.0.0.1:0"))
        await client.init(make_options(transport="tcp"))
        host, port = server.dd.listen_address
        assert host == "127.0.0.1" and port > 0
        assert client.dd.listen_address is None
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        ret, _ = await client.dd.link_clusters([info], 5000)
        assert ret == S.LLM_SUCCESS
    finally:
        await client.finalize()
        await server.finalize()
    with pytest.raises(RuntimeError):
        _ = server.dd.listen_address


async def test_peer_finalize_breaks_the_link(make_pair: PairFactory) -> None:
    pair = await make_pair()
    cache = await pair.decoder.cm.allocate_cache(batch_desc())
    await pair.prompt.finalize()
    await wait_until(lambda: pair.decoder.dd._engine.link_table().get(1) is None)
    # A closed peer reads as a failed link, saying who closed it, until unlinked.
    error = await expect_status(
        S.LLM_LINK_FAILED, pair.decoder.cm.pull_cache(CacheKey(1, req_id=1), cache)
    )
    assert "cluster 1" in str(error) and "the peer finalized" in str(error)
    ret, _ = await pair.decoder.call(pair.decoder.dd.unlink_clusters, [pair.info], 1000, True)
    assert ret == S.LLM_SUCCESS
    await expect_status(
        S.LLM_NOT_YET_LINK, pair.decoder.cm.pull_cache(CacheKey(1, req_id=1), cache)
    )
    await pair.decoder.cm.deallocate_cache(cache)


async def test_blocking_calls_from_many_threads(make_pair: PairFactory, face_kind: str) -> None:
    if face_kind != "sync":
        pytest.skip("threads use the blocking face")
    pair = await make_pair()
    desc = CacheDesc(2, [16, 512], DataType.DT_FLOAT, Placement.DEVICE)
    p_arrays = pair.arrays(2, 16, 512, seed=8)
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in p_arrays], BlocksCacheKey(1, 0)
    )
    cm = pair.decoder.dd.cache_manager
    caches = [cm.allocate_blocks_cache(desc) for _ in range(4)]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(20):
                order = np.random.default_rng(i).permutation(16).tolist()
                cm.pull_blocks(BlocksCacheKey(1, 0), caches[i], order, list(range(16)))
                for p, d in zip(p_arrays, caches[i].as_numpy(), strict=True):
                    np.testing.assert_array_equal(d, p[order])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    await asyncio.to_thread(lambda: [t.join(30) for t in threads])
    assert not errors, errors
    for cache in caches:
        cm.deallocate_blocks_cache(cache)


# -- rank-table links ---------------------------------------------------------------------


def rank_table(pair: Pair) -> str:
    """A rank table of two ranks on 127.0.0.1, with free endpoints on the pair's transport."""
    ports = [free_port(), free_port()] if pair.wire == "tcp" else [next(_ports), next(_ports)]
    return rank_table_of(ports)


def rank_table_of(ports: list[int]) -> str:
    """A rank table of one rank per port, all on 127.0.0.1."""
    return json.dumps(
        {
            "version": "1.0",
            "server_count": "1",
            "server_list": [
                {
                    "server_id": "127.0.0.1",
                    "host_ip": "127.0.0.1",
                    "device": [
                        {
                            "device_id": str(i),
                            "device_ip": "127.0.0.1",
                            "rank_id": str(i),
                            "port": port,
                        }
                        for i, port in enumerate(ports)
                    ],
                }
            ],
        }
    )


async def link_domain(pair: Pair, table: str) -> tuple[Any, Any]:
    """``link`` of the prompt (rank 0) and the decoder (rank 1) together; both outcomes
    (a comm id, or the exception raised)."""
    dd = pair.decoder

    async def decoder_link() -> Any:
        if dd.kind == "sync":
            return await asyncio.to_thread(dd.dd.link, "comm", {1: 0, 2: 1}, table)
        return await dd.dd.link("comm", {1: 0, 2: 1}, table)

    got = await asyncio.gather(
        pair.prompt.link("comm", {1: 0, 2: 1}, table), decoder_link(), return_exceptions=True
    )
    return got[0], got[1]


def test_finalize_ends_a_domain_link_still_waiting_for_its_members() -> None:
    # Rank 1 links to rank 0, which never comes: finalizing the engine ends that wait at
    # once with LLM_LINK_FAILED, rather than at the link's deadline (a thread left waiting
    # would keep the process from exiting until then).
    from aio_datadist import LLMDataDist, LLMRole

    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(make_options(transport="tcp"))
    table = rank_table_of([free_port(), free_port()])
    outcome: list[BaseException | int] = []

    def link() -> None:
        try:
            outcome.append(dd.link("comm", {1: 0, 2: 1}, table))
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=link)
    waiter.start()
    time.sleep(0.3)  # retrying its connection to rank 0
    assert waiter.is_alive()
    started = time.monotonic()
    dd.finalize()
    waiter.join(10)
    assert not waiter.is_alive() and time.monotonic() - started < 5
    assert isinstance(outcome[0], LLMException), outcome
    assert outcome[0].status_code == S.LLM_LINK_FAILED
    assert "finalized" in str(outcome[0])


async def test_rank_table_link(make_pair: PairFactory) -> None:
    from aio_datadist import RegisterMemStatus

    pair = await make_pair(link=False)
    table = rank_table(pair)
    dd = pair.decoder
    with pytest.raises(LLMException):
        await dd.call(dd.dd.link, "", {1: 0, 2: 1}, table)
    with pytest.raises(LLMException):
        await dd.call(dd.dd.link, "c", {1: 1, 2: 0}, table)
    key = CacheKey(1, req_id=4)
    src = await pair.prompt.cache_manager.allocate_cache(batch_desc(rows=1), [key])
    for view in src.as_numpy():
        view[...] = 9.0
    p_comm, comm_id = await link_domain(pair, table)
    assert comm_id == 1 and p_comm == 1
    assert await dd.call(dd.dd.query_register_mem_status, comm_id) is RegisterMemStatus.OK
    dst = await dd.cm.allocate_cache(batch_desc(rows=1))
    await dd.cm.pull_cache(key, dst)
    assert all((v == 9.0).all() for v in dst.as_numpy())
    await dd.call(dd.dd.unlink, comm_id)
    await wait_until(lambda: pair.prompt._engine.link_table().get(2) is None)
    with pytest.raises(LLMException):
        await dd.call(dd.dd.query_register_mem_status, comm_id)
    await pair.prompt.cache_manager.deallocate_cache(src)
    await dd.cm.deallocate_cache(dst)


async def hidden_cache(pair: Pair) -> list[np.ndarray]:
    """A blocks cache the prompt registers with ``remote_accessible=False``; its arrays."""
    desc = CacheDesc(2, [4, 256], DataType.DT_FLOAT, Placement.DEVICE)
    hidden = pair.arrays(2, 4, 256, seed=9)
    await pair.prompt.cache_manager.register_blocks_cache(
        desc, [int(a.ctypes.data) for a in hidden], BlocksCacheKey(1, 0), remote_accessible=False
    )
    return hidden


async def test_memory_registered_as_not_remote_accessible_is_not_offered(
    make_pair: PairFactory,
) -> None:
    pair = await make_pair(remote_accessible=True)
    hidden = await hidden_cache(pair)
    sent = [a.copy() for a in hidden]
    dcm = pair.decoder.cm
    local = await dcm.allocate_blocks_cache(
        CacheDesc(2, [4, 256], DataType.DT_FLOAT, Placement.DEVICE)
    )
    for view in local.as_numpy():
        view[...] = 1.0
    key = BlocksCacheKey(1, 0)
    await expect_status(S.LLM_KV_CACHE_NOT_EXIST, dcm.pull_blocks(key, local, [0], [0]))
    with pytest.raises(LLMException) as info:
        await push_blocks(pair.decoder, key, local, [1], [1])
    assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        local, Recorder(), [TransferWithCacheKeyConfig(key, range(0, 1), range(0, 1))]
    )
    assert await results(pair.decoder, task) == [S.LLM_KV_CACHE_NOT_EXIST]
    for before, after in zip(sent, hidden, strict=True):
        np.testing.assert_array_equal(before, after)
    assert all((view == 1.0).all() for view in local.as_numpy())
    await dcm.deallocate_blocks_cache(local)


async def test_raw_addresses_of_memory_not_remote_accessible_are_refused(
    make_pair: PairFactory,
) -> None:
    pair = await make_pair()
    hidden = await hidden_cache(pair)
    sent = [a.copy() for a in hidden]
    src = await pair.decoder.cm.allocate_cache(batch_desc(2, rows=1, elems=256))
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        src, Recorder(), [TransferConfig(1, [int(a.ctypes.data) for a in hidden])]
    )
    assert await results(pair.decoder, task) == [S.LLM_PARAM_INVALID]
    for before, after in zip(sent, hidden, strict=True):
        np.testing.assert_array_equal(before, after)
    await pair.decoder.cm.deallocate_cache(src)
