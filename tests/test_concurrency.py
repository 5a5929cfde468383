"""Threads and coroutines using one engine at once; memory in use by a copy is never freed."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

import numpy as np

from aio_datadist import (
    AsyncLLMDataDist,
    CacheDesc,
    CacheKey,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from tests.conftest import make_options, pool_cfg


def test_concurrent_allocate_and_free_from_threads() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(make_options(device_pool=pool_cfg(memory_size=16 << 20, page_shift=12)))
    cm = dd.cache_manager
    errors: list[BaseException] = []
    oom = 0
    lock = threading.Lock()

    def worker(seed: int) -> None:
        nonlocal oom
        rng = random.Random(seed)
        live = []
        try:
            for i in range(300):
                if live and rng.random() < 0.45:
                    cache, key = live.pop(rng.randrange(len(live)))
                    cm.deallocate_cache(cache)
                    if key is not None:
                        cm.remove_cache_key(key)
                    continue
                key = CacheKey(1, req_id=seed * 10_000 + i) if rng.random() < 0.5 else None
                desc = CacheDesc(2, [1, rng.randint(1, 300_000)], DataType.DT_UINT8)
                try:
                    live.append((cm.allocate_cache(desc, [key] if key else []), key))
                except LLMException as exc:
                    assert exc.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
                    with lock:
                        oom += 1
            for cache, key in live:
                cm.deallocate_cache(cache)
                if key is not None:
                    cm.remove_cache_key(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        stats = cm.pool_stats(Placement.DEVICE)
        assert stats.used == 0 and stats.allocations == 0
        assert stats.largest_free == stats.capacity
    finally:
        dd.finalize()


async def test_deallocate_during_a_copy_defers_the_free() -> None:
    async with AsyncLLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(make_options(device_pool=pool_cfg(memory_size=128 << 20)))
        cm = dd.cache_manager
        desc = CacheDesc(2, [1, 24 << 20], DataType.DT_UINT8)  # big: runs on a worker thread
        src, dst = await cm.allocate_cache(desc), await cm.allocate_cache(desc)
        for v in src.as_numpy():
            v[...] = 7
        copy = asyncio.create_task(cm.copy_cache(dst, src))
        await asyncio.sleep(0)  # the copy is planned and running off the loop
        await cm.deallocate_cache(src)
        used_during = cm.pool_stats(Placement.DEVICE).used
        await copy
        assert all((v == 7).all() for v in dst.as_numpy())
        assert used_during == 2 * 2 * (24 << 20)  # src's memory stayed while the copy ran
        assert cm.pool_stats(Placement.DEVICE).used == 2 * (24 << 20)
        await cm.deallocate_cache(dst)
        assert cm.pool_stats(Placement.DEVICE).used == 0


async def test_cancelled_copy_releases_its_pins() -> None:
    async with AsyncLLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(make_options(device_pool=pool_cfg(memory_size=128 << 20)))
        cm = dd.cache_manager
        desc = CacheDesc(2, [1, 24 << 20], DataType.DT_UINT8)
        src, dst = await cm.allocate_cache(desc), await cm.allocate_cache(desc)
        copy = asyncio.create_task(cm.copy_cache(dst, src))
        await asyncio.sleep(0)
        copy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await copy
        await cm.deallocate_cache(src)
        await cm.deallocate_cache(dst)
        assert cm.pool_stats(Placement.DEVICE).used == 0


async def test_unregister_waits_for_a_running_copy() -> None:
    async with AsyncLLMDataDist(LLMRole.PROMPT, 1) as dd:
        await dd.init(make_options(device_pool=pool_cfg(memory_size=64 << 20)))
        cm = dd.cache_manager
        user = np.zeros((1, 24 << 20), np.uint8)
        desc = CacheDesc(1, [1, 24 << 20], DataType.DT_UINT8)
        reg = await cm.register_cache(desc, [user.ctypes.data])
        src = await cm.allocate_cache(desc)
        src.as_numpy()[0][...] = 3
        copy = asyncio.create_task(cm.copy_cache(reg, src))
        await asyncio.sleep(0)
        await cm.unregister_cache(reg.cache_id)
        # unregister returned only after the copy into the user's memory had finished:
        # every byte is there before the copy's own coroutine has been resumed.
        assert (user == 3).all()
        await copy
        await cm.deallocate_cache(src)
