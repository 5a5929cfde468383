"""Pools commit a cache's memory when they hand it out, so no transfer takes a page fault.

The host runtime's memory is committed on first touch; device memory is committed when it is
allocated. So a pool over host memory commits the pages of each allocation that no earlier
allocation held, in one call, before the cache is made: a transfer into a fresh cache then
runs at the speed of one into a warm cache, and memory the host cannot give fails the
allocation (``LLM_OUT_OF_MEMORY``) rather than a later write.
"""

from __future__ import annotations

import os
import resource
from typing import Any

import numpy as np
import pytest

from aio_datadist import CacheDesc, DataType, LLMException, LLMStatusCode, Placement
from aio_datadist._memory.pool import MemoryPool
from aio_datadist._native import api
from aio_datadist._runtime.host import HostRuntime
from aio_datadist.status import ParamInvalidError
from tests.conftest import Face, make_options, pool_cfg

PAGE_SHIFT = 16
PAGE = 1 << PAGE_SHIFT


class _CommittedWhenAllocated(HostRuntime):
    fresh_memory_is_lazy = False


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# -- the pool ----------------------------------------------------------------------------------
def test_a_pool_names_the_pages_no_allocation_held_before() -> None:
    pool = MemoryPool(HostRuntime(0), Placement.HOST, 16 * PAGE, PAGE_SHIFT)
    try:
        a = pool.allocate(3 * PAGE)
        b = pool.allocate(PAGE)
        assert a.to_populate == ((a.addr, 3 * PAGE),) and b.to_populate == ((b.addr, PAGE),)
        assert a.to_zero == () and a.prepare_bytes == 3 * PAGE
        pool.release(a)
        c = pool.allocate(2 * PAGE)  # best fit: a's hole, committed already
        assert c.addr == a.addr and c.to_populate == () and c.prepare_bytes == 0
        pool.release(b)
        pool.release(c)
        d = pool.allocate(6 * PAGE)  # a's three pages, b's one, then two fresh ones
        assert d.addr == a.addr and d.to_populate == ((d.addr + 4 * PAGE, 2 * PAGE),)
        pool.release(d)
    finally:
        pool.close()


def test_a_zeroing_pool_commits_fresh_pages_and_zeroes_used_ones() -> None:
    pool = MemoryPool(HostRuntime(0), Placement.HOST, 8 * PAGE, PAGE_SHIFT, zero=True)
    try:
        a = pool.allocate(PAGE)
        pool.release(a)
        b = pool.allocate(3 * PAGE)
        assert b.to_zero == ((b.addr, PAGE),)
        assert b.to_populate == ((b.addr + PAGE, 2 * PAGE),)
        assert b.prepare_bytes == 3 * PAGE
    finally:
        pool.close()


def test_an_allocation_given_back_unused_leaves_its_fresh_pages_fresh() -> None:
    pool = MemoryPool(HostRuntime(0), Placement.HOST, 8 * PAGE, PAGE_SHIFT, zero=True)
    try:
        a = pool.allocate(2 * PAGE)
        pool.release(a)
        b = pool.allocate(4 * PAGE)  # a's two pages (used), two fresh ones
        assert b.to_populate == ((b.addr + 2 * PAGE, 2 * PAGE),)
        pool.release(b, unused=True)  # committing it failed: nobody used it
        c = pool.allocate(4 * PAGE)
        assert c.addr == b.addr
        assert c.to_populate == b.to_populate  # committed by this one, then
        assert c.to_zero == ((c.addr, 2 * PAGE),)  # and the pages a held are zeroed still
        pool.release(c)
        d = pool.allocate(4 * PAGE)  # released after use: nothing fresh is left
        assert d.to_populate == () and d.to_zero == ((d.addr, 4 * PAGE),)
        pool.release(d)
    finally:
        pool.close()


def test_memory_committed_when_allocated_needs_nothing() -> None:
    pool = MemoryPool(_CommittedWhenAllocated(0), Placement.DEVICE, 4 * PAGE, PAGE_SHIFT)
    try:
        a = pool.allocate(2 * PAGE)
        assert a.to_populate == () and a.prepare_bytes == 0
    finally:
        pool.close()


# -- the native call ---------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_populating_commits_every_page_and_keeps_the_bytes(shared: bool) -> None:
    nbytes = 8 << 20
    if shared:
        addr, fd = api.host_alloc_shared(nbytes)
    else:
        addr, fd = api.host_alloc(nbytes), -1
    try:
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * nbytes).from_address(addr))
        view[: nbytes // 2] = 7  # half written already: those bytes stay
        api.host_populate(addr, nbytes)
        before = _faults()
        view[nbytes // 2 :] = 9
        # 1,024 pages of 4 KiB, none faulted (a sanitizer's shadow memory may: 1 in 8)
        assert _faults() - before < 1024 // 4
        assert (view[: nbytes // 2] == 7).all() and (view[nbytes // 2 :] == 9).all()
    finally:
        api.host_free(addr, nbytes)
        if fd >= 0:
            os.close(fd)


@pytest.mark.parametrize(
    ("addr", "nbytes", "error"),
    [
        (4096 + 1, 4096, ParamInvalidError),
        (0, 4096, ParamInvalidError),
        (4096, 0, ParamInvalidError),
        (4096, -1, ParamInvalidError),
        ("4096", 4096, TypeError),
        (4096, 1.5, TypeError),
        (2**64 - 4096, 8192, ParamInvalidError),
    ],
)
def test_populating_refuses_bad_arguments(addr: Any, nbytes: Any, error: type) -> None:
    with pytest.raises(error):
        api.host_populate(addr, nbytes)


def test_populating_memory_not_mapped_fails_clearly() -> None:
    addr = api.host_alloc(4096)
    api.host_free(addr, 4096)
    with pytest.raises((OSError, LLMException)):
        api.host_populate(addr, 4096)


# -- through both faces ------------------------------------------------------------------------
@pytest.mark.parametrize("placement", [Placement.DEVICE, Placement.HOST])
async def test_a_fresh_cache_is_written_without_page_faults(
    make_face: Any, placement: Placement
) -> None:
    face: Face = make_face()
    # Over TCP with the same-host route on, pools are shared memory: 4 KiB pages here.
    await face.init(make_options(transport="tcp", device_pool=pool_cfg(), host_pool=pool_cfg()))
    runtime = face.dd._engine.caches.runtime
    desc = CacheDesc(2, [4, 1 << 20], DataType.DT_UINT8, placement)  # 8 MiB: 2,048 pages
    cache = await face.cm.allocate_blocks_cache(desc)
    assert runtime.host_share(cache.tensor_addrs[0], 4 << 20) is not None
    views = [v.view(np.uint8) for v in cache.as_numpy()]
    before = _faults()
    for view in views:
        view[...] = 5
    assert _faults() - before < 2048 // 4  # (a sanitizer's shadow memory may fault: 1 in 8)
    await face.cm.deallocate_blocks_cache(cache)


async def test_memory_that_cannot_be_committed_fails_the_allocation(
    make_face: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    face: Face = make_face()
    await face.init(make_options(device_pool=pool_cfg(), host_pool=pool_cfg()))
    runtime = face.dd._engine.caches.runtime

    def refuse(addr: int, nbytes: int) -> None:
        api.host_populate(addr, 2**62)  # more than any host has: the native refusal

    monkeypatch.setattr(runtime, "populate", refuse)
    desc = CacheDesc(1, [4, 4 << 20], DataType.DT_UINT8, Placement.HOST)  # off the loop
    with pytest.raises(LLMException) as exc:
        await face.cm.allocate_cache(desc)
    assert exc.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
    assert face.pool_used()[Placement.HOST] == 0
    # The memory the failed call took is still fresh: the next allocation commits it.
    committed: list[int] = []
    monkeypatch.setattr(runtime, "populate", lambda addr, nbytes: committed.append(nbytes))
    cache = await face.cm.allocate_cache(desc)
    assert sum(committed) == 4 * (4 << 20)
    await face.cm.deallocate_cache(cache)
