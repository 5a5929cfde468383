"""A serving team's tests of its own retry and timeout paths, with the testing kit.

Run with pytest and pytest-asyncio: ``pytest docs/snippets/test_retry_example.py``.
"""

import asyncio

import pytest
import pytest_asyncio

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode

pytest_plugins = ["aio_datadist.testing.plugin"]

RETRIED = {LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_LINK_FAILED}


async def fetch_blocks(cm, key, cache, src, dst, attempts=3):
    """The code under test: pull blocks, retrying what a retry may cure."""
    for attempt in range(attempts):
        try:
            await cm.pull_blocks(key, cache, src, dst)
            return attempt
        except LLMException as exc:
            if exc.status_code not in RETRIED or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@pytest_asyncio.fixture
async def caches(datadist_pair):
    desc = CacheDesc(2, [16, 1024], DataType.DT_UINT8)
    key = BlocksCacheKey(datadist_pair.prompt_cluster_id, 0)
    src = await datadist_pair.prompt.cache_manager.allocate_blocks_cache(desc, key)
    dst = await datadist_pair.decoder.cache_manager.allocate_blocks_cache(desc)
    for view in src.as_numpy():
        view[...] = 7
    return datadist_pair, key, dst


@pytest.mark.asyncio
async def test_two_timeouts_then_success(caches):
    pair, key, dst = caches
    pair.faults.fail_next(2, LLMStatusCode.LLM_TIMEOUT)
    assert await fetch_blocks(pair.decoder.cache_manager, key, dst, [3], [3]) == 2
    assert all((view[3] == 7).all() for view in dst.as_numpy())


@pytest.mark.asyncio
async def test_a_missing_cache_is_not_retried(caches):
    pair, key, dst = caches
    pair.faults.fail_next(1, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    with pytest.raises(LLMException) as info:
        await fetch_blocks(pair.decoder.cache_manager, key, dst, [3], [3])
    assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert pair.faults.injected == 1


@pytest.mark.asyncio
async def test_a_stalled_peer_meets_the_callers_own_timeout(caches):
    pair, key, dst = caches
    pair.faults.stall()
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.1):  # the serving loop's own budget, shorter than the link's
            await pair.decoder.cache_manager.pull_blocks(key, dst, [4], [4])
    pair.faults.release()  # the held pull completes; nothing is left in flight


@pytest.mark.asyncio
async def test_a_dead_peer_fails_the_link(caches):
    pair, key, dst = caches
    pair.faults.drop()
    with pytest.raises(LLMException) as info:
        await fetch_blocks(pair.decoder.cache_manager, key, dst, [5], [5])
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
