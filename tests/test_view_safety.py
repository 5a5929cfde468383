"""A cache keeps the layout it was made with: nothing done to a descriptor moves its bounds.

``CacheDesc.update_dim`` and the list ``CacheDesc.shape`` returns belong to the caller. Views,
copies and transfers of a cache use the layout frozen when the cache was allocated or
registered, so a changed descriptor can neither widen a view over a neighbouring cache nor
send a copy past the end of the memory (which, with a huge dimension, killed the process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist import (
    AsyncLLMDataDist,
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from tests.conftest import Face, make_options, pool_cfg

ROOT = Path(__file__).resolve().parent.parent
ROWS, ELEMS = 4, 16384  # one tensor of uint8: exactly one 64 KiB pool page
SHAPE = (ROWS, ELEMS)
INT64 = st.integers(-(2**63), 2**63 - 1)


def every_desc(desc: CacheDesc, cache: Cache) -> list[CacheDesc]:
    """The descriptor given to the allocate call and the one the cache hands out."""
    return [desc, cache.cache_desc]


def fill(cache: Cache, value: int) -> None:
    for view in cache.as_numpy():
        view[...] = value


def holds(cache: Cache, value: int) -> bool:
    return all(bool((v == value).all()) for v in cache.as_numpy())


# -- the descriptor's shape is the caller's copy ---------------------------------------------
def test_shape_returns_a_copy() -> None:
    desc = CacheDesc(2, [4, 8], DataType.DT_FLOAT)
    shape = desc.shape
    assert shape == [4, 8] and isinstance(shape, list)
    shape[0] = 1 << 36
    shape.append(3)
    assert desc.shape == [4, 8]
    assert desc.size == 4 * 8 * 4
    assert desc.shape is not desc.shape


async def test_cache_desc_and_tensor_addrs_are_copies(face: Face) -> None:
    desc = CacheDesc(2, list(SHAPE), DataType.DT_UINT8)
    cache = await face.cm.allocate_cache(desc)
    addrs = cache.tensor_addrs
    cache.tensor_addrs[0] = 8  # a copy: the cache keeps its addresses
    assert cache.tensor_addrs == addrs
    got = cache.cache_desc
    got.update_dim(0, 1)
    assert got.shape == [1, ELEMS]
    assert cache.cache_desc.shape == list(SHAPE) and cache.cache_desc.size == ROWS * ELEMS
    desc.update_dim(1, 2)
    assert cache.cache_desc.shape == list(SHAPE)
    assert [v.shape for v in cache.as_numpy()] == [SHAPE, SHAPE]
    await face.cm.deallocate_cache(cache)


# -- views -----------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", [Placement.HOST, Placement.DEVICE])
async def test_a_grown_descriptor_does_not_widen_the_view(face: Face, placement: Placement) -> None:
    desc = CacheDesc(1, list(SHAPE), DataType.DT_UINT8, placement)
    cache = await face.cm.allocate_cache(desc)
    neighbour = await face.cm.allocate_cache(
        CacheDesc(1, list(SHAPE), DataType.DT_UINT8, placement)
    )
    # The neighbour starts where the cache ends: a view one row too long reaches it.
    assert neighbour.tensor_addrs[0] == cache.tensor_addrs[0] + ROWS * ELEMS
    fill(neighbour, 0x5A)
    for d in every_desc(desc, cache):
        d.update_dim(0, 2 * ROWS)
    (view,) = cache.as_numpy()
    assert view.shape == SHAPE
    view[...] = 1
    assert holds(neighbour, 0x5A)
    assert holds(cache, 1)
    await face.cm.deallocate_cache(neighbour)
    await face.cm.deallocate_cache(cache)


async def test_a_registered_cache_keeps_its_layout(face: Face) -> None:
    memory = np.zeros(2 * ROWS * ELEMS, np.uint8)
    desc = CacheDesc(1, list(SHAPE), DataType.DT_UINT8, Placement.HOST)
    cache = await face.cm.register_cache(desc, [memory.ctypes.data], remote_accessible=False)
    desc.update_dim(0, 2 * ROWS)
    (view,) = cache.as_numpy()
    assert view.shape == SHAPE
    view[...] = 1
    assert int(memory[: ROWS * ELEMS].min()) == 1 and not memory[ROWS * ELEMS :].any()
    await face.cm.unregister_cache(cache.cache_id)


# -- copies ----------------------------------------------------------------------------------
async def test_copies_and_swaps_ignore_a_changed_descriptor(face: Face) -> None:
    desc = CacheDesc(1, list(SHAPE), DataType.DT_UINT8, Placement.HOST)
    src = await face.cm.allocate_cache(desc)
    dst = await face.cm.allocate_cache(CacheDesc(1, list(SHAPE), DataType.DT_UINT8))
    blocks = await face.cm.allocate_blocks_cache(CacheDesc(1, list(SHAPE), DataType.DT_UINT8))
    guard = await face.cm.allocate_cache(CacheDesc(1, list(SHAPE), DataType.DT_UINT8))
    fill(guard, 0x5A)
    fill(src, 3)
    for cache in (src, dst, blocks):
        for d in every_desc(desc, cache):
            d.update_dim(1, 2 * ELEMS)
    await face.cm.copy_cache(dst, src, dst_batch_index=ROWS - 1, src_batch_index=0)
    (d_view,) = dst.as_numpy()
    assert d_view.shape == SHAPE and bool((d_view[ROWS - 1] == 3).all())
    await face.cm.copy_blocks(blocks, {0: [ROWS - 1]})
    # A CPU cache keeps the layout it was wrapped with too.
    host = np.full(ROWS * ELEMS, 9, np.uint8)
    cpu_desc = CacheDesc(1, list(SHAPE), DataType.DT_UINT8, Placement.HOST)
    cpu = Cache.create_cpu_cache(cpu_desc, [host.ctypes.data])
    cpu_desc.update_dim(1, 2 * ELEMS)
    await face.cm.swap_blocks(cpu, blocks, {1: ROWS - 1})
    (b_view,) = blocks.as_numpy()
    assert bool((b_view[ROWS - 1] == 9).all())
    assert holds(guard, 0x5A)
    for cache in (src, dst, guard):
        await face.cm.deallocate_cache(cache)
    await face.cm.deallocate_blocks_cache(blocks)


def test_random_update_dims_never_move_a_cache() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(make_options(device_pool=pool_cfg(), host_pool=pool_cfg()))
    try:
        cm = dd.cache_manager
        desc = CacheDesc(2, list(SHAPE), DataType.DT_UINT8, Placement.HOST)
        cache = cm.allocate_cache(desc)
        blocks = cm.allocate_blocks_cache(CacheDesc(2, list(SHAPE), DataType.DT_UINT8))
        guard = cm.allocate_cache(CacheDesc(1, list(SHAPE), DataType.DT_UINT8, Placement.HOST))
        fill(guard, 0x5A)
        addrs = cache.tensor_addrs

        @settings(max_examples=150, deadline=None)
        @given(st.integers(0, len(SHAPE) - 1), INT64, st.integers(0, 255))
        def check(dim: int, value: int, byte: int) -> None:
            for target in (cache, blocks):
                for d in (desc, target.cache_desc):
                    d.update_dim(dim, value)
            assert cache.cache_desc.shape == list(SHAPE)
            assert cache.cache_desc.size == ROWS * ELEMS
            assert cache.tensor_addrs == addrs
            views = cache.as_numpy()
            assert [v.shape for v in views] == [SHAPE, SHAPE]  # before any write
            for v in views:
                v[...] = byte
            cm.copy_cache(cache, cache, dst_batch_index=ROWS - 1, src_batch_index=0)
            cm.copy_blocks(blocks, {0: [ROWS - 1]})
            assert [v.shape for v in blocks.as_numpy()] == [SHAPE, SHAPE]
            assert holds(cache, byte)
            assert holds(guard, 0x5A)

        check()
        cm.deallocate_cache(cache)
        cm.deallocate_blocks_cache(blocks)
        cm.deallocate_cache(guard)
    finally:
        dd.finalize()


# -- a huge dimension: run where a crash is a failed test, not a dead test run -------------
_HUGE = textwrap.dedent(
    """
    import asyncio, json
    import numpy as np
    from aio_datadist import (AsyncLLMDataDist, Cache, CacheDesc, CacheKey, DataType,
                              LLMClusterInfo, LLMConfig, LLMRole, LLMStatusCode, Placement)

    HUGE, ROWS, ELEMS = 1 << 36, 4, 16384
    SHAPE = (ROWS, ELEMS)

    def options(listen=None):
        cfg = LLMConfig()
        cfg.device_id = 0
        cfg.enable_cache_manager = True
        cfg.transport = "loopback"
        cfg.mem_pool_cfg = cfg.host_mem_pool_cfg = json.dumps({"memory_size": 16 << 20})
        if listen:
            cfg.listen_ip_info = listen
        return dict(cfg.generate_options())

    def desc():
        return CacheDesc(1, list(SHAPE), DataType.DT_UINT8)

    def grow(*caches):
        for cache in caches:
            cache.cache_desc.update_dim(0, HUGE)

    async def main():
        prompt = AsyncLLMDataDist(LLMRole.PROMPT, 1)
        await prompt.init(options("127.0.0.1:39123"))
        decoder = AsyncLLMDataDist(LLMRole.DECODER, 2)
        await decoder.init(options())
        pcm, dcm = prompt.cache_manager, decoder.cache_manager
        key = CacheKey(1, req_id=5)
        src_desc = desc()
        src = await pcm.allocate_cache(src_desc, [key])
        src.as_numpy()[0][...] = 3
        dst_desc = desc()
        dst = await dcm.allocate_cache(dst_desc)
        guard = await dcm.allocate_cache(desc())
        guard.as_numpy()[0][...] = 0x5A
        for d in (src_desc, dst_desc):
            d.update_dim(0, HUGE)
        grow(src, dst)

        (view,) = dst.as_numpy()
        view[...] = 1  # the attack: before the fix, this wrote 1 << 36 rows
        assert view.shape == SHAPE, view.shape
        assert (guard.as_numpy()[0] == 0x5A).all()

        await dcm.copy_cache(guard, dst, dst_batch_index=0, src_batch_index=ROWS - 1)
        guard.as_numpy()[0][0] = 0x5A

        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", 39123)
        ret, rets = await decoder.link_clusters([info], 5000)
        assert rets == [LLMStatusCode.LLM_SUCCESS], rets
        await dcm.pull_cache(key, dst, batch_index=ROWS - 1)
        (view,) = dst.as_numpy()
        assert (view[ROWS - 1] == 3).all() and (view[: ROWS - 1] == 1).all()
        assert (guard.as_numpy()[0] == 0x5A).all()

        host = np.full(ROWS * ELEMS, 9, np.uint8)
        cpu_desc = CacheDesc(1, list(SHAPE), DataType.DT_UINT8, Placement.HOST)
        cpu = Cache.create_cpu_cache(cpu_desc, [host.ctypes.data])
        blocks = await dcm.allocate_blocks_cache(desc())
        cpu_desc.update_dim(0, HUGE)
        grow(blocks)
        await dcm.swap_blocks(cpu, blocks, {0: ROWS - 1})
        await dcm.copy_blocks(blocks, {ROWS - 1: [0]})
        assert (blocks.as_numpy()[0][0] == 9).all()
        assert (guard.as_numpy()[0] == 0x5A).all()

        await decoder.finalize()
        await prompt.finalize()
        print("survived")

    asyncio.run(main())
    """
)


def test_a_huge_dimension_neither_crashes_nor_reaches_out() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1")
    done = subprocess.run(
        [sys.executable, "-c", _HUGE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"exit status {done.returncode}\n{done.stderr[-3000:]}"
    assert done.stdout.strip() == "survived"


# -- a pull into a cache whose descriptor changed -----------------------------------------
async def test_a_pull_lands_inside_the_allocated_rows(make_face) -> None:
    prompt = AsyncLLMDataDist(LLMRole.PROMPT, 1)
    await prompt.init(
        make_options(device_pool=pool_cfg(), host_pool=pool_cfg(), listen="127.0.0.1:39125")
    )
    try:
        decoder: Face = make_face(LLMRole.DECODER, 2)
        await decoder.init(make_options(device_pool=pool_cfg(), host_pool=pool_cfg()))
        key = CacheKey(1, req_id=9)
        src_desc = CacheDesc(1, list(SHAPE), DataType.DT_UINT8)
        src = await prompt.cache_manager.allocate_cache(src_desc, [key])
        fill(src, 3)
        dst_desc = CacheDesc(1, list(SHAPE), DataType.DT_UINT8)
        dst = await decoder.cm.allocate_cache(dst_desc)
        guard = await decoder.cm.allocate_cache(CacheDesc(1, list(SHAPE), DataType.DT_UINT8))
        fill(guard, 0x5A)
        for d in (src_desc, dst_desc, src.cache_desc, dst.cache_desc):
            d.update_dim(0, 2 * ROWS)
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", 39125)
        _, rets = await decoder.call(decoder.dd.link_clusters, [info], 5000)
        assert rets == [LLMStatusCode.LLM_SUCCESS]
        with pytest.raises(LLMException) as exc:
            await decoder.cm.pull_cache(key, dst, batch_index=ROWS)
        assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        await decoder.cm.pull_cache(key, dst, batch_index=ROWS - 1)
        (view,) = dst.as_numpy()
        assert view.shape == SHAPE and bool((view[ROWS - 1] == 3).all())
        assert holds(guard, 0x5A)
        await decoder.cm.deallocate_cache(dst)
        await decoder.cm.deallocate_cache(guard)
        await decoder.finalize()
        await prompt.cache_manager.deallocate_cache(src)
    finally:
        await prompt.finalize()
