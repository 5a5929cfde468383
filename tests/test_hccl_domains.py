"""Rank-table domains backed by HCCL: device bytes between members move through the
communicator, over every transport and both faces.

Both engines run on the fake libascendcl (device memory that is not host memory) and the
fake libhccl of ``tests/fakelibs``, whose communicators of one rank table in one process
reach each other's bound memory. The fake checks every one-sided descriptor against the
memory both ranks bound, so a byte outside it fails the test.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
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
    LLMException,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
    TransferWithCacheKeyConfig,
)
from aio_datadist._memory.staging import Staging
from tests.acl_fake import FAKE_VARS, FakeAcl
from tests.conftest import push_blocks
from tests.fakelibs import build
from tests.test_device_transfers import blocks_desc, read, runtime, write
from tests.test_transfers import (  # noqa: F401 - fixtures
    Pair,
    PairFactory,
    Recorder,
    expect_status,
    link_domain,
    make_pair,
    rank_table,
    results,
    transport,
    wait_until,
)

S = LLMStatusCode


class FakeHccl:
    """The fake libhccl as the tests see it: its call log and its live objects."""

    def __init__(self, path: Path, log: Path) -> None:
        self.log = log
        self._lib = ctypes.CDLL(str(path))
        self._lib.fake_hccl_live.argtypes = [ctypes.c_char_p]
        self._lib.fake_hccl_live.restype = ctypes.c_long

    def calls(self) -> list[str]:
        """Names of the logged calls, oldest first."""
        text = self.log.read_text() if self.log.exists() else ""
        return [line.split()[0] for line in text.splitlines()]

    def count(self, name: str) -> int:
        return self.calls().count(name)

    def live(self) -> tuple[int, int, int]:
        """Live communicators, registered memories and bindings."""
        return tuple(  # type: ignore[return-value]
            int(self._lib.fake_hccl_live(what)) for what in (b"comms", b"mems", b"bindings")
        )


@pytest.fixture
def hccl(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHccl]:
    """Both engines on the fake ACL runtime with the fake libhccl present."""
    for var in (*FAKE_VARS, "FAKE_HCCL_FAIL"):
        monkeypatch.delenv(var, raising=False)
    acl_path = build("fake_ascendcl.c", "libascendcl.so")
    hccl_path = build("fake_hccl.c", "libhccl.so")
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "acl")
    monkeypatch.setenv("AIO_DATADIST_ASCENDCL", str(acl_path))
    monkeypatch.setenv("AIO_DATADIST_HCCL", str(hccl_path))
    monkeypatch.setenv("FAKE_HCCL_LOG", str(tmp_path / "hccl.log"))
    acl = FakeAcl(acl_path, tmp_path / "acl.log")
    fake = FakeHccl(hccl_path, tmp_path / "hccl.log")
    yield fake
    assert fake.live() == (0, 0, 0)  # every communicator left, every registration gone
    acl.assert_released()


def no_staging(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any transfer stages device rows through host buffers."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("device rows were staged instead of moved by the communicator")

    for name in ("inbound", "outbound", "stream"):
        monkeypatch.setattr(Staging, name, refuse)


async def domain(pair: Pair) -> int:
    """Link the pair's rank-table domain; the decoder's comm id."""
    p_comm, d_comm = await link_domain(pair, rank_table(pair))
    assert p_comm == d_comm == 1, (p_comm, d_comm)
    return int(d_comm)


async def unlink(pair: Pair, comm_id: int) -> None:
    await pair.decoder.call(pair.decoder.dd.unlink, comm_id)
    await pair.prompt.unlink(comm_id)


async def test_device_transfers_between_members_go_through_the_communicator(
    hccl: FakeHccl, make_pair: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair: Pair = await make_pair(link=False, remote_accessible=True)
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    dst = await dcm.allocate_blocks_cache(blocks_desc())
    # a cache of the application's own device memory, registered before link
    rt = runtime(pair.prompt)
    desc = blocks_desc(2)
    own = [rt.alloc_device(desc.size) for _ in range(2)]
    registered = await pcm.register_blocks_cache(desc, own, BlocksCacheKey(1, 1))
    comm_id = await domain(pair)
    assert await pair.decoder.call(pair.decoder.dd.query_register_mem_status, comm_id) is (
        RegisterMemStatus.OK
    )
    # each rank bound its two pools; the prompt also its registered cache (one range each)
    assert hccl.count("HcclCommBindMem") == 2 + 2 + 2
    assert hccl.count("HcclCommPrepare") == 2
    no_staging(monkeypatch)

    sent = write(pair.prompt, src, seed=1)
    await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [0, 3, 5], [7, 1, 2])
    for s, d in zip(sent, read(pair.decoder, dst), strict=True):
        np.testing.assert_array_equal(d[[7, 1, 2]], s[[0, 3, 5]])
    assert hccl.count("HcclBatchPut") == 1  # the prompt wrote the decoder's blocks

    back = write(pair.decoder, dst, seed=2)
    await push_blocks(pair.decoder, BlocksCacheKey(1, 0), dst, [6, 4], [2, 3])
    for b, r in zip(back, read(pair.prompt, src), strict=True):
        np.testing.assert_array_equal(r[[2, 3]], b[[6, 4]])
    assert hccl.count("HcclBatchGet") == 1  # the prompt read the decoder's blocks

    mine = write(pair.prompt, registered, seed=3)
    small = await dcm.allocate_blocks_cache(desc)
    await dcm.pull_blocks(BlocksCacheKey(1, 1), small, [1, 7], [0, 1])
    for m, d in zip(mine, read(pair.decoder, small), strict=True):
        np.testing.assert_array_equal(d[[0, 1]], m[[1, 7]])

    # a batch row by cache id and index
    rows_desc = CacheDesc(2, [2, 1024], DataType.DT_FLOAT16, Placement.DEVICE)
    row_src = await pcm.allocate_cache(rows_desc)
    row_dst = await dcm.allocate_cache(rows_desc)
    rows = write(pair.prompt, row_src, seed=4)
    await dcm.pull_cache(CacheKeyByIdAndIndex(1, row_src.cache_id, 1), row_dst, batch_index=0)
    for s, d in zip(rows, read(pair.decoder, row_dst), strict=True):
        np.testing.assert_array_equal(d[0], s[1])
    assert hccl.count("HcclBatchPut") == 3

    # layer by layer
    layered = blocks_desc(4)
    remote = await pcm.allocate_blocks_cache(layered, BlocksCacheKey(1, 2))
    local = await dcm.allocate_blocks_cache(layered)
    sent = write(pair.decoder, local, seed=5)
    task = pair.decoder.dd.cache_manager.transfer_cache_async(
        local,
        Recorder(),
        [TransferWithCacheKeyConfig(BlocksCacheKey(1, 2), range(0, 2), range(0, 2))],
        src_block_indices=[0, 2],
        dst_block_indices=[4, 1],
    )
    assert await results(pair.decoder, task) == [S.LLM_SUCCESS]
    got = read(pair.prompt, remote)
    for t in range(4):
        np.testing.assert_array_equal(got[t][[4, 1]], sent[t][[0, 2]])
    assert hccl.count("HcclBatchGet") == 3  # one push per layer

    await unlink(pair, comm_id)
    assert hccl.live() == (0, 0, 0)
    for cache in (src, registered, remote):
        await pcm.deallocate_blocks_cache(cache) if cache is not registered else (
            await pcm.unregister_cache(cache.cache_id)
        )
    for addr in own:
        rt.free_device(addr, desc.size)
    await pcm.deallocate_cache(row_src)
    for cache in (dst, small, local):
        await dcm.deallocate_blocks_cache(cache)
    await dcm.deallocate_cache(row_dst)


async def test_refusals_and_library_failures_leave_the_domain_usable(
    hccl: FakeHccl, make_pair: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair: Pair = await make_pair(link=False)
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    dst = await dcm.allocate_blocks_cache(blocks_desc())
    comm_id = await domain(pair)
    sent = write(pair.prompt, src, seed=6)

    def used() -> tuple[int, int]:
        return pcm.pool_stats(Placement.DEVICE).used, pair.decoder.pool_used()[Placement.DEVICE]

    before, kept = used(), read(pair.decoder, dst)
    # refused by the serving side before the communicator moves anything
    await expect_status(S.LLM_PARAM_INVALID, dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [8], [0]))
    await expect_status(
        S.LLM_KV_CACHE_NOT_EXIST, dcm.pull_blocks(BlocksCacheKey(1, 9), dst, [0], [0])
    )
    assert hccl.count("HcclBatchPut") == 0
    # the library fails the transfer: the call reports it, the pins come back
    monkeypatch.setenv("FAKE_HCCL_FAIL", "HcclBatchPut")
    with pytest.raises(LLMException) as info:
        await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [1])
    assert info.value.status_code == S.LLM_FAILED and "HcclResult 4" in str(info.value)
    for k, d in zip(kept, read(pair.decoder, dst), strict=True):
        np.testing.assert_array_equal(k, d)
    monkeypatch.delenv("FAKE_HCCL_FAIL")
    await wait_until(lambda: used() == before)
    await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [1])
    for s, d in zip(sent, read(pair.decoder, dst), strict=True):
        np.testing.assert_array_equal(d[1], s[1])

    # a pull by key that fails keeps the key; the one that succeeds drops it
    key = CacheKey(1, req_id=4)
    rows_desc = CacheDesc(2, [2, 1024], DataType.DT_FLOAT16, Placement.DEVICE)
    row_src = await pcm.allocate_cache(rows_desc, [key])
    row_dst = await dcm.allocate_cache(rows_desc)
    rows = write(pair.prompt, row_src, seed=4)
    monkeypatch.setenv("FAKE_HCCL_FAIL", "HcclBatchPut")
    await expect_status(S.LLM_FAILED, dcm.pull_cache(key, row_dst, batch_index=1))
    monkeypatch.delenv("FAKE_HCCL_FAIL")
    await dcm.pull_cache(key, row_dst, batch_index=1)
    for s, d in zip(rows, read(pair.decoder, row_dst), strict=True):
        np.testing.assert_array_equal(d[1], s[0])
    await expect_status(S.LLM_KV_CACHE_NOT_EXIST, dcm.pull_cache(key, row_dst, batch_index=0))

    await unlink(pair, comm_id)
    await pcm.deallocate_blocks_cache(src)
    await pcm.deallocate_cache(row_src)
    await dcm.deallocate_blocks_cache(dst)
    await dcm.deallocate_cache(row_dst)


async def test_memory_outside_the_domain_takes_the_link(
    hccl: FakeHccl, make_pair: PairFactory
) -> None:
    pair: Pair = await make_pair(link=False)
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    src = await pcm.allocate_blocks_cache(blocks_desc(2), BlocksCacheKey(1, 0))
    comm_id = await domain(pair)
    # device memory the decoder registers after link is not bound: staged over the link
    rt = runtime(pair.decoder)
    desc = blocks_desc(2)
    own = [rt.alloc_device(desc.size) for _ in range(2)]
    late = await dcm.register_blocks_cache(desc, own)
    sent = write(pair.prompt, src, seed=7)
    await dcm.pull_blocks(BlocksCacheKey(1, 0), late, [2, 3], [0, 5])
    for s, d in zip(sent, read(pair.decoder, late), strict=True):
        np.testing.assert_array_equal(d[[0, 5]], s[[2, 3]])
    assert hccl.count("HcclBatchPut") == 0
    # and registering memory for the members after link is refused
    with pytest.raises(LLMException) as info:
        await pcm.register_blocks_cache(desc, own, BlocksCacheKey(1, 5), remote_accessible=True)
    assert info.value.status_code == S.LLM_PARAM_INVALID
    await unlink(pair, comm_id)
    await dcm.unregister_cache(late.cache_id)
    for addr in own:
        rt.free_device(addr, desc.size)
    await pcm.deallocate_blocks_cache(src)


@pytest.mark.parametrize(
    "failing", ["HcclCommInitClusterInfo", "HcclCommBindMem", "HcclCommPrepare"]
)
async def test_a_domain_the_library_refuses_fails_link_and_leaves_nothing(
    hccl: FakeHccl, make_pair: PairFactory, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    pair: Pair = await make_pair(link=False)
    monkeypatch.setenv("FAKE_HCCL_FAIL", failing)
    outcomes = await link_domain(pair, rank_table(pair))
    for outcome in outcomes:
        assert isinstance(outcome, LLMException), outcomes
        assert outcome.status_code == S.LLM_LINK_FAILED
    # a member that gave up first may leave the other failing on its departure instead
    assert any("HcclResult 4" in str(outcome) for outcome in outcomes), outcomes
    assert hccl.live() == (0, 0, 0)
    await wait_until(lambda: pair.decoder.dd._engine.links.get(1) is None)
    await wait_until(lambda: pair.prompt._engine.links.get(2) is None)
    monkeypatch.delenv("FAKE_HCCL_FAIL")
    comm_id = await domain(pair)
    await unlink(pair, comm_id)


async def test_finalize_leaves_the_communicator(hccl: FakeHccl, make_pair: PairFactory) -> None:
    pair: Pair = await make_pair(link=False)
    await domain(pair)
    assert hccl.live()[0] == 2
    await pair.decoder.finalize()
    await pair.prompt.finalize()
    assert hccl.live() == (0, 0, 0)
    assert hccl.count("HcclCommDestroy") == 2


async def test_a_failed_domain_keeps_the_links_made_before_it(
    hccl: FakeHccl, make_pair: PairFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair: Pair = await make_pair(link=True)  # linked with link_clusters first
    monkeypatch.setenv("FAKE_HCCL_FAIL", "HcclCommPrepare")
    outcomes = await link_domain(pair, rank_table(pair))
    assert all(isinstance(o, LLMException) for o in outcomes), outcomes
    monkeypatch.delenv("FAKE_HCCL_FAIL")
    assert pair.decoder.dd._engine.links.get(1) is not None
    assert pair.prompt._engine.links.get(2) is not None
    dcm = pair.decoder.cm
    src = await pair.prompt.cache_manager.allocate_blocks_cache(
        blocks_desc(2), BlocksCacheKey(1, 0)
    )
    dst = await dcm.allocate_blocks_cache(blocks_desc(2))
    sent = write(pair.prompt, src, seed=8)
    await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [3], [4])  # over the link, staged
    for s, d in zip(sent, read(pair.decoder, dst), strict=True):
        np.testing.assert_array_equal(d[4], s[3])
    assert hccl.count("HcclBatchPut") == 0
    await pair.prompt.cache_manager.deallocate_blocks_cache(src)
    await dcm.deallocate_blocks_cache(dst)
