"""Transfers of device caches under accelerator runtimes, over every transport and both faces.

The runtimes run over the fake libcudart and libascendcl of ``tests/fakelibs``, whose device
memory cannot be read as host memory: every byte that crosses a link must be staged through
the runtime's pinned host buffers, or the byte checks here fail. Memory is read back and
written through the runtime only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)
from aio_datadist._memory.staging import Staging
from aio_datadist._runtime.base import DeviceRuntime
from tests import providers
from tests.acl_fake import FAKE_VARS, FakeAcl, read_device, write_device
from tests.conftest import Face, make_options, pool_cfg, push_blocks
from tests.fakelibs import build
from tests.peer_prompt import TENSORS, pattern
from tests.test_cross_process import Peer, link, peer_memory
from tests.test_runtime_cuda import _fake as fake_cudart
from tests.test_transfers import (  # noqa: F401 - fixtures
    Pair,
    PairFactory,
    Recorder,
    expect_status,
    make_pair,
    results,
    transport,
    wait_until,
)

S = LLMStatusCode
DEVICE_PEER = Path(__file__).with_name("peer_device.py")
BLOCKS = 8
ELEMS = 256


@pytest.fixture(params=["cuda", "acl"])
def accelerator(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> Iterator[str]:
    """The engines of the test run on this accelerator runtime (over its fake library)."""
    name = str(request.param)
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", name)
    if name == "cuda":
        fake = fake_cudart()
        monkeypatch.setenv("AIO_DATADIST_CUDART", str(fake.path))
        monkeypatch.setenv("FAKE_CUDA_DEVICES", "1")
        fake.reset()
        yield name
        return
    for var in FAKE_VARS:
        monkeypatch.delenv(var, raising=False)
    path = build("fake_ascendcl.c", "libascendcl.so")
    monkeypatch.setenv("AIO_DATADIST_ASCENDCL", str(path))
    monkeypatch.setenv("AIO_DATADIST_HCCL", str(tmp_path / "absent-libhccl.so"))
    acl = FakeAcl(path, tmp_path / "acl.log")
    yield name
    acl.assert_released()  # staging buffers included


def runtime(engine: Any) -> DeviceRuntime:
    """The runtime of an ``AsyncLLMDataDist`` or a test face."""
    dd = engine.dd if isinstance(engine, Face) else engine
    rt: DeviceRuntime = dd._engine.caches.runtime
    assert not rt.device_memory_is_host
    return rt


def write(engine: Any, cache: Cache, seed: int) -> list[np.ndarray]:
    """Random bytes into every tensor of a device cache; returns them as ``(rows, -1)`` arrays."""
    rt, desc = runtime(engine), cache.cache_desc
    rng = np.random.default_rng(seed)
    out = []
    for addr in cache.tensor_addrs:
        data = rng.integers(0, 256, desc.size, dtype=np.uint8)
        write_device(rt, addr, data.tobytes())
        out.append(data.reshape(desc.shape[0], -1))
    return out


def read(engine: Any, cache: Cache) -> list[np.ndarray]:
    """Every tensor of a device cache as ``(rows, -1)`` bytes, read through the runtime."""
    rt, desc = runtime(engine), cache.cache_desc
    return [
        np.frombuffer(read_device(rt, addr, desc.size), np.uint8).reshape(desc.shape[0], -1)
        for addr in cache.tensor_addrs
    ]


def blocks_desc(num_tensors: int = 4, placement: Placement = Placement.DEVICE) -> CacheDesc:
    return CacheDesc(num_tensors, [BLOCKS, ELEMS], DataType.DT_FLOAT, placement)


async def test_pull_device_blocks_and_rows(accelerator: str, make_pair: PairFactory) -> None:
    pair: Pair = await make_pair()
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    dst = await dcm.allocate_blocks_cache(blocks_desc())
    sent = write(pair.prompt, src, seed=1)
    before = read(pair.decoder, dst)
    await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [0, 3, 5], [7, 1, 2])
    for s, d in zip(sent, read(pair.decoder, dst), strict=True):
        np.testing.assert_array_equal(d[[7, 1, 2]], s[[0, 3, 5]])
    # a refused pull leaves the destination as it was
    before = read(pair.decoder, dst)
    await expect_status(S.LLM_PARAM_INVALID, dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [9], [0]))
    for b, d in zip(before, read(pair.decoder, dst), strict=True):
        np.testing.assert_array_equal(b, d)

    # host blocks of the peer into device blocks (one-sided over TCP, the peer's host memory
    # being on its region board)
    host_src = await pcm.allocate_blocks_cache(
        blocks_desc(placement=Placement.HOST), BlocksCacheKey(1, 1)
    )
    host_views = [v.view(np.uint8).reshape(BLOCKS, -1) for v in host_src.as_numpy()]
    for i, view in enumerate(host_views):
        view[...] = 10 + i
    await dcm.pull_blocks(BlocksCacheKey(1, 1), dst, [2, 6], [4, 0])
    memory = providers.peer_memory(pair.decoder.dd._engine, 1)
    assert (memory is not None) == (pair.transport == "tcp")
    for i, d in enumerate(read(pair.decoder, dst)):
        assert (d[[4, 0]] == 10 + i).all()
    await pcm.deallocate_blocks_cache(host_src)

    # a batch row by key, into a row of a device cache
    key = CacheKey(1, req_id=4)
    rows_desc = CacheDesc(2, [2, 1024], DataType.DT_FLOAT16, Placement.DEVICE)
    row_src = await pcm.allocate_cache(rows_desc, [key])
    row_dst = await dcm.allocate_cache(rows_desc)
    sent = write(pair.prompt, row_src, seed=2)
    await dcm.pull_cache(key, row_dst, batch_index=1)
    for s, d in zip(sent, read(pair.decoder, row_dst), strict=True):
        np.testing.assert_array_equal(d[1], s[0])
    await pcm.deallocate_blocks_cache(src)
    await pcm.deallocate_cache(row_src)
    await dcm.deallocate_blocks_cache(dst)
    await dcm.deallocate_cache(row_dst)


@pytest.mark.parametrize("transport", ["tcp"], indirect=True)
async def test_device_bytes_stream_over_tcp_in_small_chunks(
    accelerator: str, make_pair: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 KiB chunks, so every transfer here crosses the socket as dozens of staged pieces on
    # both ends; no same-host route, so every byte does cross it.
    monkeypatch.setattr("aio_datadist._runtime.cuda.STAGE_CHUNK_BYTES", 4096)
    monkeypatch.setattr("aio_datadist._memory.staging.STREAM_CHUNK_BYTES", 4096)
    streams: list[bool] = []
    stream = Staging.stream

    def spy(self: Staging, iov: Any, on_device: Any = None, *, outbound: bool) -> Any:
        streams.append(outbound)
        return stream(self, iov, on_device, outbound=outbound)

    monkeypatch.setattr(Staging, "stream", spy)
    pair: Pair = await make_pair(remote_accessible=True, same_host=False)
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    desc = CacheDesc(4, [16, 4096], DataType.DT_FLOAT, Placement.DEVICE)  # 16 KiB blocks
    src = await pcm.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    dst = await dcm.allocate_blocks_cache(desc)
    sent = write(pair.prompt, src, seed=11)
    picked, into = [15, 0, 7, 3, 9, 12, 1, 4, 8, 2], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, picked, into)
    for s_, d in zip(sent, read(pair.decoder, dst), strict=True):
        np.testing.assert_array_equal(d[into], s_[picked])
    assert sorted(set(streams)) == [False, True]  # the decoder received, the prompt sent
    streams.clear()
    back = write(pair.decoder, dst, seed=12)
    await push_blocks(pair.decoder, BlocksCacheKey(1, 0), dst, [5, 6, 7], [10, 11, 13])
    for b, r in zip(back, read(pair.prompt, src), strict=True):
        np.testing.assert_array_equal(r[[10, 11, 13]], b[[5, 6, 7]])
    assert sorted(set(streams)) == [False, True]  # the decoder sent, the prompt received
    # untouched blocks of the prompt stay as they were
    for s_, r in zip(sent, read(pair.prompt, src), strict=True):
        keep = [i for i in range(16) if i not in (10, 11, 13)]
        np.testing.assert_array_equal(r[keep], s_[keep])
    await pcm.deallocate_blocks_cache(src)
    await dcm.deallocate_blocks_cache(dst)


@pytest.mark.parametrize("side", ["sender", "receiver"])
@pytest.mark.parametrize("transport", ["tcp"], indirect=True)
async def test_a_device_copy_failing_mid_stream(
    accelerator: str, make_pair: PairFactory, monkeypatch: pytest.MonkeyPatch, side: str
) -> None:
    # The fourth staged piece of every stream of one side fails to copy. A sender cannot
    # finish the frame in flight, so that link breaks; a receiver drains the rest and fails
    # just that request. Either way the call reports it, pins come back, the link works after.
    monkeypatch.setattr("aio_datadist._runtime.cuda.STAGE_CHUNK_BYTES", 4096)
    monkeypatch.setattr("aio_datadist._memory.staging.STREAM_CHUNK_BYTES", 4096)
    chunks = Staging.chunks

    def failing(self: Staging, iov: Any, outbound: bool) -> Any:
        for i, piece in enumerate(chunks(self, iov, outbound)):
            if i == 3 and outbound == (side == "sender"):
                raise LLMException("device copy failed", status_code=S.LLM_FAILED)
            yield piece

    pair: Pair = await make_pair(remote_accessible=True, same_host=False)
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    desc = CacheDesc(2, [8, 4096], DataType.DT_FLOAT, Placement.DEVICE)
    src = await pcm.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    dst = await dcm.allocate_blocks_cache(desc)

    def used() -> tuple[int, int]:
        return pcm.pool_stats(Placement.DEVICE).used, pair.decoder.pool_used()[Placement.DEVICE]

    before = used()
    sent = write(pair.prompt, src, seed=13)
    expected = {
        ("pull", "sender"): S.LLM_LINK_FAILED,  # the prompt's answer broke off
        ("push", "sender"): S.LLM_FAILED,  # the decoder's own request broke off
        ("pull", "receiver"): S.LLM_FAILED,
        ("push", "receiver"): S.LLM_FAILED,  # answered by the prompt
    }
    for call in ("pull", "push"):
        monkeypatch.setattr(Staging, "chunks", failing)
        if call == "pull":
            moved = dcm.pull_blocks(BlocksCacheKey(1, 0), dst, list(range(8)), list(range(8)))
        else:
            moved = push_blocks(pair.decoder, BlocksCacheKey(1, 0), dst, [0, 1, 2], [0, 1, 2])
        await expect_status(expected[call, side], moved)
        monkeypatch.setattr(Staging, "chunks", chunks)
        if side == "sender":  # both ends notice the break before the decoder links again
            await wait_until(lambda: pair.decoder.dd._engine.links.get(1) is None)
            await wait_until(lambda: pair.prompt._engine.links.get(2) is None)
            await pair.link()
        await wait_until(lambda: used() == before)
        await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [4, 5], [4, 5])
        for s_, d in zip(sent, read(pair.decoder, dst), strict=True):
            np.testing.assert_array_equal(d[[4, 5]], s_[[4, 5]])
    await pcm.deallocate_blocks_cache(src)
    await dcm.deallocate_blocks_cache(dst)


async def test_push_between_device_and_host(accelerator: str, make_pair: PairFactory) -> None:
    pair: Pair = await make_pair(remote_accessible=True)
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    remote = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    local = await dcm.allocate_blocks_cache(blocks_desc())
    sent = write(pair.decoder, local, seed=3)
    await push_blocks(pair.decoder, BlocksCacheKey(1, 0), local, [0, 1, 2], [5, 4, 3])
    for s, r in zip(sent, read(pair.prompt, remote), strict=True):
        np.testing.assert_array_equal(r[[5, 4, 3]], s[[0, 1, 2]])

    # host blocks into device blocks, then device blocks back into host blocks
    host = await dcm.allocate_blocks_cache(blocks_desc(placement=Placement.HOST))
    host_views = [v.view(np.uint8).reshape(BLOCKS, -1) for v in host.as_numpy()]
    for i, view in enumerate(host_views):
        view[...] = i + 1
    await push_blocks(pair.decoder, BlocksCacheKey(1, 0), host, [6], [7])
    for i, r in enumerate(read(pair.prompt, remote)):
        assert (r[7] == i + 1).all()
    await dcm.pull_blocks(BlocksCacheKey(1, 0), host, [5], [0])
    for s, view in zip(sent, host_views, strict=True):
        np.testing.assert_array_equal(view[0], s[0])

    # push_cache: a device batch row into a remote device row named by id and index
    rows_desc = CacheDesc(2, [2, 512], DataType.DT_FLOAT, Placement.DEVICE)
    remote_rows = await pcm.allocate_cache(rows_desc)
    local_rows = await dcm.allocate_cache(rows_desc)
    sent = write(pair.decoder, local_rows, seed=4)
    await pair.decoder.cm.push_cache(CacheKeyByIdAndIndex(1, remote_rows.cache_id, 1), local_rows)
    for s, r in zip(sent, read(pair.prompt, remote_rows), strict=True):
        np.testing.assert_array_equal(r[1], s[0])
    await pcm.deallocate_blocks_cache(remote)
    await pcm.deallocate_cache(remote_rows)
    for blocks in (local, host):
        await dcm.deallocate_blocks_cache(blocks)
    await dcm.deallocate_cache(local_rows)


async def test_layerwise_transfer_of_device_caches(
    accelerator: str, make_pair: PairFactory
) -> None:
    pair: Pair = await make_pair(remote_accessible=True)
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    layers = 3
    remote = await pcm.allocate_blocks_cache(blocks_desc(2 * layers), BlocksCacheKey(1, 0))
    local = await dcm.allocate_blocks_cache(blocks_desc(2 * layers))
    sent = write(pair.decoder, local, seed=5)
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        local,
        Recorder(),
        [TransferWithCacheKeyConfig(BlocksCacheKey(1, 0), range(1, 3), range(0, 2))],
        src_block_indices=[0, 2],
        dst_block_indices=[4, 1],
    )
    assert await results(pair.decoder, task) == [S.LLM_SUCCESS]
    got = read(pair.prompt, remote)
    for src_layer, dst_layer in ((1, 0), (2, 1)):
        for j in range(2):
            np.testing.assert_array_equal(
                got[2 * dst_layer + j][[4, 1]], sent[2 * src_layer + j][[0, 2]]
            )
    await pcm.deallocate_blocks_cache(remote)
    await dcm.deallocate_blocks_cache(local)


async def test_layerwise_transfer_by_address_into_device_memory(
    accelerator: str, make_pair: PairFactory
) -> None:
    pair: Pair = await make_pair()
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    layers = 2
    remote = await pcm.allocate_blocks_cache(blocks_desc(2 * layers), BlocksCacheKey(1, 0))
    local = await dcm.allocate_blocks_cache(blocks_desc(2 * layers))
    sent = write(pair.decoder, local, seed=6)
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        local,
        Recorder(),
        [TransferConfig(1, list(remote.tensor_addrs), range(0, layers))],
        src_block_indices=[3],
        dst_block_indices=[6],
    )
    assert await results(pair.decoder, task) == [S.LLM_SUCCESS]
    for s, r in zip(sent, read(pair.prompt, remote), strict=True):
        np.testing.assert_array_equal(r[6], s[3])
    await pcm.deallocate_blocks_cache(remote)
    await dcm.deallocate_blocks_cache(local)


# -- same host, two processes: the peer's device memory mapped through CUDA IPC --------------
@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both processes run the CUDA runtime over the fake libcudart."""
    fake = fake_cudart()
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "cuda")
    monkeypatch.setenv("AIO_DATADIST_CUDART", str(fake.path))
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "1")


async def test_same_host_device_memory_moves_through_ipc(fake_cuda: None, face_kind: str) -> None:
    blocks, block_bytes = 16, 4096
    peer = Peer(blocks, block_bytes, script=DEVICE_PEER)
    face = Face(face_kind, LLMRole.DECODER, 2)
    try:
        await face.init(
            make_options(
                device_pool=pool_cfg(),
                host_pool=pool_cfg(),
                remote_accessible=True,
                transport="tcp",
                same_host=True,
            )
        )
        await link(face, peer)
        desc = CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)
        dev = await face.cm.allocate_blocks_cache(desc)
        await face.cm.pull_blocks(BlocksCacheKey(1, 0), dev, [3, 0, 15], [0, 1, 2])
        for t, got in enumerate(read(face, dev)):
            np.testing.assert_array_equal(
                got[[0, 1, 2]], pattern(t, blocks, block_bytes)[[3, 0, 15]]
            )
        memory = peer_memory(face)
        assert memory is not None and memory.device_sharing and memory._mapped

        # into host memory, and back out of device memory into the peer's
        host_desc = CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
        host = await face.cm.allocate_blocks_cache(host_desc)
        await face.cm.pull_blocks(BlocksCacheKey(1, 0), host, [7], [7])
        for t, view in enumerate(host.as_numpy()):
            np.testing.assert_array_equal(view[7], pattern(t, blocks, block_bytes)[7])
        await push_blocks(face, BlocksCacheKey(1, 0), dev, [0], [9])
        await face.cm.pull_blocks(BlocksCacheKey(1, 0), host, [9], [1])
        for t, view in enumerate(host.as_numpy()):
            np.testing.assert_array_equal(view[1], pattern(t, blocks, block_bytes)[3])
        # the serving side's refusals are unchanged
        await expect_status(
            S.LLM_PARAM_INVALID, face.cm.pull_blocks(BlocksCacheKey(1, 0), dev, [16], [0])
        )
        assert memory.device_sharing
        await face.cm.deallocate_blocks_cache(dev)
        await face.cm.deallocate_blocks_cache(host)
    finally:
        await face.finalize()
        peer.close()
