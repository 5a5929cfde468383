"""``zero_on_alloc`` (``aio.ZeroOnAlloc``): pool memory is zeroed before a cache is made of it.

Pool memory is reused. Without the option, a cache allocated where an earlier one lived holds
that cache's bytes until it is written; with it, the cache reads zeros locally and to a
linked peer, whatever the pool held.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist._memory.pool import MemoryPool
from aio_datadist._runtime.host import HostRuntime
from aio_datadist.config import OPTION_ZERO_ON_ALLOC
from tests.conftest import Face, make_options, pool_cfg

STALE = 0xAB
_ports = itertools.count(39200)


def zeroing_options(**kwargs: Any) -> dict[str, str]:
    options = make_options(device_pool=pool_cfg(), host_pool=pool_cfg(), **kwargs)
    options[OPTION_ZERO_ON_ALLOC] = "1"
    return options


def fill(cache: Cache, value: int) -> None:
    for view in cache.as_numpy():
        view.view(np.uint8)[...] = value


def all_zero(cache: Cache) -> bool:
    return all(not v.view(np.uint8).any() for v in cache.as_numpy())


# -- the setting -----------------------------------------------------------------------------
def test_zero_on_alloc_setting() -> None:
    cfg = LLMConfig()
    assert cfg.zero_on_alloc is None
    assert OPTION_ZERO_ON_ALLOC not in cfg.generate_options()
    cfg.zero_on_alloc = True
    assert cfg.generate_options()[OPTION_ZERO_ON_ALLOC] == "1"
    cfg.zero_on_alloc = False
    assert cfg.generate_options()[OPTION_ZERO_ON_ALLOC] == "0"
    for wrong in ("1", 1, 0.0):
        with pytest.raises(TypeError):
            cfg.zero_on_alloc = wrong
    assert cfg.zero_on_alloc is False
    cfg.zero_on_alloc = None
    assert cfg.zero_on_alloc is None
    assert "zero_on_alloc=True" in repr(_with(zero_on_alloc=True))


def _with(**settings: Any) -> LLMConfig:
    cfg = LLMConfig()
    for name, value in settings.items():
        setattr(cfg, name, value)
    return cfg


@pytest.mark.parametrize("value", ["", "yes", "2", "true"])
def test_init_refuses_a_bad_zero_on_alloc_option(value: str) -> None:
    dd = LLMDataDist(LLMRole.DECODER, 7)
    options = make_options(host_pool=pool_cfg())
    options[OPTION_ZERO_ON_ALLOC] = value
    with pytest.raises(LLMException) as exc:
        dd.init(options)
    assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert OPTION_ZERO_ON_ALLOC in str(exc.value)


async def test_off_by_default(face: Face) -> None:
    # Off by default: pool memory is handed out as the pool holds it (not zeroed here).
    settings = face.dd._engine.settings
    assert settings is not None and settings.zero_on_alloc is False
    caches = face.dd._engine.caches
    assert caches is not None
    assert [pool.zero for pool in caches.pools.values()] == [False, False]
    cache = await face.cm.allocate_cache(CacheDesc(1, [4, 4096], DataType.DT_UINT8))
    assert caches.registry.get(cache.cache_id).allocation.to_zero == ()
    await face.cm.deallocate_cache(cache)


# -- which pages a pool zeroes ---------------------------------------------------------------
PAGE_SHIFT = 16
PAGE = 1 << PAGE_SHIFT


class _UnknownContents(HostRuntime):
    fresh_memory_is_zero = False


@pytest.mark.parametrize("fresh_is_zero", [True, False])
def test_a_pool_zeroes_only_pages_handed_out_before(fresh_is_zero: bool) -> None:
    runtime = HostRuntime(0) if fresh_is_zero else _UnknownContents(0)
    pool = MemoryPool(runtime, Placement.HOST, 16 * PAGE, PAGE_SHIFT, zero=True)
    try:
        a = pool.allocate(3 * PAGE)
        b = pool.allocate(PAGE)
        if fresh_is_zero:  # never handed out: already zero, nothing to do
            assert a.to_zero == () and b.to_zero == ()
        else:  # contents unknown: the whole allocation
            assert a.to_zero == ((a.addr, 3 * PAGE),) and b.to_zero == ((b.addr, PAGE),)
        pool.release(a)
        c = pool.allocate(2 * PAGE)  # best fit: a's hole
        assert c.addr == a.addr and c.to_zero == ((c.addr, 2 * PAGE),)
        pool.release(b)
        pool.release(c)
        d = pool.allocate(6 * PAGE)  # a's three pages, b's one, then two fresh ones
        assert d.addr == a.addr
        fresh_runs = ((d.addr, 4 * PAGE),) if fresh_is_zero else ((d.addr, 6 * PAGE),)
        assert d.to_zero == fresh_runs
        pool.release(d)
    finally:
        pool.close()


def test_a_pool_that_does_not_zero_names_nothing() -> None:
    pool = MemoryPool(HostRuntime(0), Placement.HOST, 4 * PAGE, PAGE_SHIFT)
    try:
        a = pool.allocate(PAGE)
        pool.release(a)
        assert pool.allocate(PAGE).to_zero == ()
    finally:
        pool.close()


# -- local reads ---------------------------------------------------------------------------
@pytest.mark.parametrize("placement", [Placement.HOST, Placement.DEVICE])
@pytest.mark.parametrize("blocks", [False, True], ids=["batch", "blocks"])
async def test_a_cache_in_reused_memory_reads_zeros(
    make_face: Any, placement: Placement, blocks: bool
) -> None:
    face: Face = make_face()
    await face.init(zeroing_options())
    desc = CacheDesc(3, [4, 3000], DataType.DT_FLOAT16, placement)
    allocate = face.cm.allocate_blocks_cache if blocks else face.cm.allocate_cache
    free = face.cm.deallocate_blocks_cache if blocks else face.cm.deallocate_cache
    first = await allocate(desc)
    fill(first, STALE)
    addrs = first.tensor_addrs
    await free(first)
    second = await allocate(desc)
    assert second.tensor_addrs == addrs  # the same memory, handed out again
    assert all_zero(second)
    await free(second)


async def test_a_large_cache_is_zeroed(make_face: Any) -> None:
    # Over the async face's inline limit (1 MiB): zeroed on a worker thread.
    face: Face = make_face()
    await face.init(zeroing_options())
    desc = CacheDesc(2, [8, 1 << 20], DataType.DT_UINT8, Placement.HOST)
    first = await face.cm.allocate_cache(desc)
    fill(first, STALE)
    await face.cm.deallocate_cache(first)
    second = await face.cm.allocate_cache(desc)
    assert all_zero(second)
    await face.cm.deallocate_cache(second)


async def test_a_failed_zeroing_gives_the_memory_back(
    make_face: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    face: Face = make_face()
    await face.init(zeroing_options())
    runtime = face.dd._engine.caches.runtime

    def refuse(addr: int, nbytes: int) -> None:
        raise LLMException("the memset failed", status_code=LLMStatusCode.LLM_FAILED)

    desc = CacheDesc(1, [4, 4 << 20], DataType.DT_UINT8, Placement.HOST)  # 16 MiB: off the loop
    await face.cm.deallocate_cache(await face.cm.allocate_cache(desc))  # used memory: to zero
    monkeypatch.setattr(runtime, "zero_host", refuse)
    with pytest.raises(LLMException) as exc:
        await face.cm.allocate_cache(desc, [CacheKey(1, req_id=1)])
    assert exc.value.status_code == LLMStatusCode.LLM_FAILED
    assert face.pool_used()[Placement.HOST] == 0
    monkeypatch.undo()
    cache = await face.cm.allocate_cache(desc, [CacheKey(1, req_id=1)])  # the key is free
    await face.cm.deallocate_cache(cache)
    await face.cm.remove_cache_key(CacheKey(1, req_id=1))
    assert face.pool_used()[Placement.HOST] == 0


# -- what a linked peer reads ------------------------------------------------------------
async def test_a_peer_pulls_zeros_from_reused_memory(make_face: Any) -> None:
    port = next(_ports)
    prompt = AsyncLLMDataDist(LLMRole.PROMPT, 1)
    await prompt.init(zeroing_options(listen=f"127.0.0.1:{port}"))
    try:
        decoder: Face = make_face(LLMRole.DECODER, 2)
        await decoder.init(make_options(device_pool=pool_cfg()))
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        _, rets = await decoder.call(decoder.dd.link_clusters, [info], 5000)
        assert rets == [LLMStatusCode.LLM_SUCCESS]
        pcm = prompt.cache_manager
        desc = CacheDesc(2, [2, 4096], DataType.DT_UINT8)

        # A batch cache by key: the earlier cache's bytes are gone from the memory.
        old = await pcm.allocate_cache(desc)
        fill(old, STALE)
        stale_addrs = old.tensor_addrs
        await pcm.deallocate_cache(old)
        key = CacheKey(1, req_id=3)
        fresh = await pcm.allocate_cache(desc, [key])
        assert fresh.tensor_addrs == stale_addrs
        dst = await decoder.cm.allocate_cache(desc)
        fill(dst, 0x11)
        await decoder.cm.pull_cache(key, dst, batch_index=1)
        for view in dst.as_numpy():
            assert not view[1].any() and bool((view[0] == 0x11).all())

        # A blocks cache: every block reads zero before its first write.
        old_blocks = await pcm.allocate_blocks_cache(desc)
        fill(old_blocks, STALE)
        stale_addrs = old_blocks.tensor_addrs
        await pcm.deallocate_blocks_cache(old_blocks)
        blocks = await pcm.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
        assert blocks.tensor_addrs == stale_addrs
        dst_blocks = await decoder.cm.allocate_blocks_cache(desc)
        fill(dst_blocks, 0x11)
        await decoder.cm.pull_blocks(BlocksCacheKey(1, 0), dst_blocks, [0, 1], [1, 0])
        assert all_zero(dst_blocks)

        await decoder.cm.deallocate_cache(dst)
        await decoder.cm.deallocate_blocks_cache(dst_blocks)
        await decoder.finalize()
        await pcm.deallocate_cache(fresh)
        await pcm.deallocate_blocks_cache(blocks)
    finally:
        await prompt.finalize()
