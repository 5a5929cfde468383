"""Every local CacheManager call through both faces, checked on data and documented errors."""

from __future__ import annotations

import numpy as np
import pytest

from aio_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    LLMException,
    LLMStatusCode,
    MemInfo,
    Memtype,
    Placement,
)
from tests.conftest import POOL_BYTES, Face, fresh_ticks, make_options, pool_cfg

PAGE = 1 << 16
PLACEHOLDER = 2**64 - 1


def code_of(exc: pytest.ExceptionInfo[LLMException]) -> LLMStatusCode:
    return exc.value.status_code


def fill(cache: Cache, seed: int) -> list[np.ndarray]:
    views = cache.as_numpy()
    rng = np.random.default_rng(seed)
    for v in views:
        v.view(np.uint8)[...] = rng.integers(0, 256, v.nbytes, dtype=np.uint8).reshape(
            v.view(np.uint8).shape
        )
    return [v.copy() for v in views]


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte-for-byte equality (random fills hold NaN bit patterns)."""
    return a.shape == b.shape and bool((a.view(np.uint8) == b.view(np.uint8)).all())


# -- allocate / deallocate ---------------------------------------------------------------
async def test_allocate_cache_layout_and_page_rounding(face: Face) -> None:
    desc = CacheDesc(3, [2, 100], DataType.DT_FLOAT16)  # 400 bytes per tensor
    cache = await face.cm.allocate_cache(desc)
    assert cache.cache_id == 1 and not cache.is_blocks_cache
    # The cache describes itself with its own copy of the descriptor it was made from.
    assert cache.cache_desc is not desc and repr(cache.cache_desc) == repr(desc)
    addrs = cache.tensor_addrs
    assert len(addrs) == 3 and all(a % PAGE == 0 for a in addrs)
    assert len(set(addrs)) == 3 and addrs == sorted(addrs)
    assert face.pool_used()[Placement.DEVICE] == 3 * PAGE  # each tensor rounded to a page
    views = cache.as_numpy()
    assert [v.shape for v in views] == [(2, 100)] * 3 and views[0].dtype == np.float16
    for i, v in enumerate(views):
        v[...] = i + 1
    assert [float(v.sum()) for v in cache.as_numpy()] == [200.0, 400.0, 600.0]
    await face.cm.deallocate_cache(cache)
    assert cache.tensor_addrs == []
    with pytest.raises(LLMException) as exc:
        cache.as_numpy()
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID


async def test_cache_ids_increase_across_allocate_and_register(face: Face) -> None:
    desc = CacheDesc(1, [1, 64], DataType.DT_UINT8)
    buf = np.zeros(64, np.uint8)
    a = await face.cm.allocate_cache(desc)
    b = await face.cm.register_cache(desc, [buf.ctypes.data])
    c = await face.cm.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_UINT8))
    assert [a.cache_id, b.cache_id, c.cache_id] == [1, 2, 3]
    assert c.is_blocks_cache
    await face.cm.deallocate_cache(a)
    await face.cm.unregister_cache(b.cache_id)
    await face.cm.deallocate_blocks_cache(c)


async def test_host_placement_uses_host_pool(face: Face) -> None:
    cache = await face.cm.allocate_cache(
        CacheDesc(2, [1, 70000], DataType.DT_UINT8, Placement.HOST)
    )
    used = face.pool_used()
    assert used[Placement.HOST] == 2 * 2 * PAGE and used[Placement.DEVICE] == 0
    await face.cm.deallocate_cache(cache)


async def test_placement_without_matching_pool(make_face) -> None:
    f: Face = make_face()
    await f.init(make_options(device_pool=pool_cfg()))
    with pytest.raises(LLMException, match="host_mem_pool_cfg") as exc:
        await f.cm.allocate_cache(CacheDesc(1, [1, 8], DataType.DT_INT8, Placement.HOST))
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    g: Face = make_face(cluster_id=2)
    await f.finalize()
    await g.init(make_options())
    with pytest.raises(LLMException, match="mem_pool_cfg") as exc:
        await g.cm.allocate_blocks_cache(CacheDesc(1, [1, 8], DataType.DT_INT8))
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID


async def test_allocate_argument_types(face: Face) -> None:
    desc = CacheDesc(1, [2, 8], DataType.DT_INT8)
    with pytest.raises(TypeError):
        await face.cm.allocate_cache("desc")
    with pytest.raises(TypeError):
        await face.cm.allocate_cache(desc, CacheKey(1, 1))
    with pytest.raises(TypeError):
        await face.cm.allocate_cache(desc, [1, 2])
    with pytest.raises(TypeError):
        await face.cm.allocate_blocks_cache(desc, CacheKey(1, 1))
    with pytest.raises(TypeError):
        await face.cm.deallocate_cache(None)
    with pytest.raises(TypeError):
        await face.cm.remove_cache_key(BlocksCacheKey(1))
    assert face.pool_used()[Placement.DEVICE] == 0


async def test_zero_sized_cache_is_refused(face: Face) -> None:
    with pytest.raises(LLMException) as exc:
        await face.cm.allocate_cache(CacheDesc(1, [0, 8], DataType.DT_INT8))
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as exc:
        await face.cm.allocate_cache(CacheDesc(0, [1, 8], DataType.DT_INT8))
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID


async def test_pool_exhaustion_leaves_pool_usable(face: Face) -> None:
    big = CacheDesc(1, [1, POOL_BYTES // 2], DataType.DT_UINT8)
    a = await face.cm.allocate_cache(big)
    key = CacheKey(1, req_id=5)
    with pytest.raises(LLMException) as exc:
        await face.cm.allocate_cache(CacheDesc(2, [1, POOL_BYTES // 2], DataType.DT_UINT8), [key])
    assert code_of(exc) == LLMStatusCode.LLM_OUT_OF_MEMORY
    assert face.pool_used()[Placement.DEVICE] == POOL_BYTES // 2  # nothing kept
    b = await face.cm.allocate_cache(big, [key])  # the refused key was never bound
    with pytest.raises(LLMException) as exc:
        await face.cm.allocate_cache(CacheDesc(1, [1, 1], DataType.DT_UINT8))
    assert code_of(exc) == LLMStatusCode.LLM_OUT_OF_MEMORY
    await face.cm.deallocate_cache(a)
    await face.cm.deallocate_cache(b)
    await face.cm.remove_cache_key(key)


async def test_fragmentation_is_coalesced(face: Face) -> None:
    quarter = CacheDesc(1, [1, POOL_BYTES // 4], DataType.DT_UINT8)
    parts = [await face.cm.allocate_cache(quarter) for _ in range(4)]
    hole = parts[1].tensor_addrs[0]
    await face.cm.deallocate_cache(parts[1])
    await face.cm.deallocate_cache(parts[2])
    # The two freed neighbours merged into one run that holds half the pool.
    half = await face.cm.allocate_cache(CacheDesc(1, [1, POOL_BYTES // 2], DataType.DT_UINT8))
    assert half.tensor_addrs[0] == hole
    for c in (parts[0], parts[3], half):
        await face.cm.deallocate_cache(c)
    stats = face.dd.cache_manager.pool_stats(Placement.DEVICE)
    assert stats.largest_free == stats.capacity


# -- keys and references -----------------------------------------------------------------
async def test_key_rules(face: Face) -> None:
    desc = CacheDesc(1, [3, 16], DataType.DT_INT8)
    k = [CacheKey(1, req_id=i) for i in range(4)]
    with pytest.raises(LLMException) as exc:  # more keys than rows
        await face.cm.allocate_cache(desc, k)
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as exc:  # the same key twice
        await face.cm.allocate_cache(desc, [k[0], CacheKey(9, req_id=0)])
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    # Placeholders fill unused rows, any number of them; trailing ones may be left out.
    ph = CacheKey(1, req_id=PLACEHOLDER)
    a = await face.cm.allocate_cache(desc, [ph, k[1], ph])
    b = await face.cm.allocate_cache(desc, [k[2]])
    with pytest.raises(LLMException) as exc:  # already bound to a live cache
        await face.cm.allocate_cache(desc, [k[1]])
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    # model_id is part of the identity, cluster id is not.
    c = await face.cm.allocate_cache(desc, [CacheKey(1, req_id=1, model_id=1)])
    # prefix keys have their own identity.
    d = await face.cm.allocate_cache(desc, [CacheKey(1, req_id=PLACEHOLDER, prefix_id=1)])
    assert face.pool_used()[Placement.DEVICE] == 4 * PAGE
    for cache, key in (
        (a, k[1]),
        (b, k[2]),
        (c, CacheKey(1, req_id=1, model_id=1)),
        (d, CacheKey(1, req_id=PLACEHOLDER, prefix_id=1)),
    ):
        await face.cm.deallocate_cache(cache)
        await face.cm.remove_cache_key(key)


async def test_release_waits_for_every_key(face: Face) -> None:
    desc = CacheDesc(2, [2, 4096], DataType.DT_INT8)
    keys = [CacheKey(1, req_id=10), CacheKey(1, req_id=11)]
    cache = await face.cm.allocate_cache(desc, keys)
    await face.cm.deallocate_cache(cache)
    assert cache.tensor_addrs == []
    assert face.pool_used()[Placement.DEVICE] == 2 * PAGE  # keys still hold it
    await face.cm.deallocate_cache(cache)  # already released: no-op
    await face.cm.remove_cache_key(keys[0])
    await face.cm.remove_cache_key(keys[0])  # already removed: no-op
    await face.cm.remove_cache_key(CacheKey(1, req_id=999))  # unknown: no-op
    assert face.pool_used()[Placement.DEVICE] == 2 * PAGE
    # The deferred memory is not available to other allocations meanwhile.
    with pytest.raises(LLMException) as exc:
        await face.cm.allocate_cache(CacheDesc(1, [1, POOL_BYTES - PAGE], DataType.DT_UINT8))
    assert code_of(exc) == LLMStatusCode.LLM_OUT_OF_MEMORY
    await face.cm.remove_cache_key(keys[1])
    assert face.pool_used()[Placement.DEVICE] == 0
    # Copies on a released cache find nothing.
    other = await face.cm.allocate_cache(desc)
    with pytest.raises(LLMException) as exc2:
        await face.cm.copy_cache(other, cache)
    assert code_of(exc2) == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    await face.cm.deallocate_cache(other)


async def test_removing_keys_first_frees_on_deallocate(face: Face) -> None:
    key = CacheKey(prompt_cluster_id=1, req_id=3, model_id=0)
    cache = await face.cm.allocate_cache(CacheDesc(1, [1, 10], DataType.DT_INT8), [key])
    await face.cm.remove_cache_key(key)
    assert face.pool_used()[Placement.DEVICE] == PAGE  # the id reference remains
    await face.cm.deallocate_cache(cache)
    assert face.pool_used()[Placement.DEVICE] == 0


async def test_deallocate_kind_mismatch_and_unknown(face: Face) -> None:
    blocks = await face.cm.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
    batch = await face.cm.allocate_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
    with pytest.raises(LLMException) as exc:
        await face.cm.deallocate_cache(blocks)
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as exc:
        await face.cm.deallocate_blocks_cache(batch)
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    foreign = Cache(99, CacheDesc(1, [4, 64], DataType.DT_INT8), [4096])
    await face.cm.deallocate_cache(foreign)  # unknown: no-op
    await face.cm.deallocate_blocks_cache(blocks)
    await face.cm.deallocate_blocks_cache(blocks)  # twice: no-op
    await face.cm.deallocate_cache(batch)


async def test_blocks_cache_key_rules(face: Face) -> None:
    desc = CacheDesc(2, [8, 128], DataType.DT_INT8)
    a = await face.cm.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    with pytest.raises(LLMException) as exc:
        await face.cm.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    b = await face.cm.allocate_blocks_cache(desc, BlocksCacheKey(cluster_id=1, model_id=1))
    await face.cm.deallocate_blocks_cache(a)
    c = await face.cm.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))  # free again
    await face.cm.deallocate_blocks_cache(b)
    await face.cm.deallocate_blocks_cache(c)


async def test_a_blocks_cache_key_outside_uint64_is_refused_first(face: Face) -> None:
    desc = CacheDesc(2, [8, 128], DataType.DT_INT8)
    buf = [np.zeros(8 * 128, np.int8) for _ in range(2)]
    addrs = [int(b.ctypes.data) for b in buf]
    for key, field in (
        (BlocksCacheKey(-1, 0), "cluster_id -1"),
        (BlocksCacheKey(1, -2), "model_id -2"),
    ):
        with pytest.raises(ValueError) as exc:
            await face.cm.allocate_blocks_cache(desc, key)
        assert f"blocks_cache_key {key!r}: BlocksCacheKey {field} is outside uint64" in str(
            exc.value
        )
        with pytest.raises(ValueError) as exc:
            await face.cm.register_blocks_cache(desc, addrs, key)
        assert f"BlocksCacheKey {field} is outside uint64" in str(exc.value)
    assert not any(face.pool_used().values())  # refused before anything was allocated


async def test_a_negative_dimension_is_refused_by_allocate_and_register(face: Face) -> None:
    desc = CacheDesc(2, [8, -1], DataType.DT_INT8)  # accepted until its size is needed
    blocks = CacheDesc(2, [-4, 128], DataType.DT_INT8)
    calls = [
        (face.cm.allocate_cache, (desc,), "dimension 1 is -1"),
        (face.cm.allocate_blocks_cache, (blocks,), "dimension 0 is -4"),
        (face.cm.register_cache, (desc, [4096, 8192]), "dimension 1 is -1"),
        (face.cm.register_blocks_cache, (blocks, [4096, 8192]), "dimension 0 is -4"),
    ]
    for call, args, named in calls:
        with pytest.raises(LLMException) as exc:
            await call(*args)
        assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
        assert named in str(exc.value), call


# -- copy_cache --------------------------------------------------------------------------
async def test_copy_cache_rows_byte_for_byte(face: Face) -> None:
    src = await face.cm.allocate_cache(CacheDesc(2, [3, 1000], DataType.DT_FLOAT))
    dst = await face.cm.allocate_cache(CacheDesc(2, [2, 1000], DataType.DT_FLOAT))
    before_src, before_dst = fill(src, 1), fill(dst, 2)
    await face.cm.copy_cache(dst, src, dst_batch_index=1, src_batch_index=2)
    for s, d0, d in zip(before_src, before_dst, dst.as_numpy(), strict=True):
        assert same(d[1], s[2])  # one whole row (size=-1)
        assert same(d[0], d0[0])  # the other row untouched
    # offset and size are bytes within one row.
    await face.cm.copy_cache(dst, src, 0, 0, offset=400, size=800)
    for s, d0, d in zip(before_src, before_dst, dst.as_numpy(), strict=True):
        assert same(d[0, 100:300], s[0, 100:300])
        assert same(d[0, :100], d0[0, :100])
        assert same(d[0, 300:], d0[0, 300:])
    # size=-1 with an offset copies the rest of ONE row.
    await face.cm.copy_cache(dst, src, 0, 1, offset=3600)
    for s, d in zip(before_src, dst.as_numpy(), strict=True):
        assert same(d[0, 900:], s[1, 900:])
        assert same(d[1], s[2])
    await face.cm.copy_cache(src, src, 0, 0)  # same row onto itself: harmless
    await face.cm.deallocate_cache(src)
    await face.cm.deallocate_cache(dst)


async def test_copy_cache_errors(face: Face) -> None:
    a = await face.cm.allocate_cache(CacheDesc(2, [2, 64], DataType.DT_INT8))
    b = await face.cm.allocate_cache(CacheDesc(2, [2, 32], DataType.DT_INT8))
    three = await face.cm.allocate_cache(CacheDesc(3, [2, 64], DataType.DT_INT8))
    blocks = await face.cm.allocate_blocks_cache(CacheDesc(2, [2, 64], DataType.DT_INT8))
    invalid = [
        dict(dst=a, src=a, dst_batch_index=2),
        dict(dst=a, src=a, src_batch_index=2),
        dict(dst=a, src=a, offset=64),
        dict(dst=b, src=a, offset=40),  # inside the src row, not the dst row
        dict(dst=a, src=a, offset=10, size=60),
        dict(dst=b, src=a),  # a whole 64-byte src row does not fit a 32-byte dst row
        dict(dst=a, src=a, size=0),
        dict(dst=a, src=a, size=-2),
        dict(dst=three, src=a),
        dict(dst=blocks, src=a),
        dict(dst=a, src=blocks),
    ]
    for kwargs in invalid:
        with pytest.raises(LLMException) as exc:
            await face.cm.copy_cache(**kwargs)
        assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID, kwargs
    for kwargs, err in [
        (dict(dst=a, src="a"), TypeError),
        (dict(dst=a, src=a, dst_batch_index=-1), ValueError),
        (dict(dst=a, src=a, offset=-1), ValueError),
        (dict(dst=a, src=a, size=1.5), TypeError),
        (dict(dst=a, src=a, req_id=-1), ValueError),
    ]:
        with pytest.raises(err):
            await face.cm.copy_cache(**kwargs)
    await face.cm.copy_cache(a, b, size=32, req_id=7)  # smaller src row into a larger one
    for c in (a, b, three):
        await face.cm.deallocate_cache(c)
    await face.cm.deallocate_blocks_cache(blocks)


async def test_large_copy_keeps_the_loop_responsive(face: Face, loop_lag: list[float]) -> None:
    desc = CacheDesc(2, [1, 8 << 20], DataType.DT_UINT8)  # 16 MiB per copy
    src, dst = await face.cm.allocate_cache(desc), await face.cm.allocate_cache(desc)
    expect = fill(src, 3)
    since = await fresh_ticks(loop_lag)  # filling held the loop; only the copies count
    for _ in range(4):
        await face.cm.copy_cache(dst, src)
    copying = loop_lag[since:]
    assert all(same(d, e) for d, e in zip(dst.as_numpy(), expect, strict=True))
    await face.cm.deallocate_cache(src)
    await face.cm.deallocate_cache(dst)
    if face.kind == "async":
        assert copying and max(copying) < 0.5  # generous: the real figure is a benchmark


# -- copy_blocks -------------------------------------------------------------------------
async def test_copy_blocks(face: Face) -> None:
    cache = await face.cm.allocate_blocks_cache(CacheDesc(3, [8, 512], DataType.DT_INT16))
    before = fill(cache, 4)
    await face.cm.copy_blocks(cache, {0: [5, 6], 2: [7]})
    for b, v in zip(before, cache.as_numpy(), strict=True):
        assert same(v[5], b[0]) and same(v[6], b[0])
        assert same(v[7], b[2])
        assert same(v[:5], b[:5])
    await face.cm.copy_blocks(cache, {})
    await face.cm.deallocate_blocks_cache(cache)


async def test_copy_blocks_reads_every_source_before_writing(face: Face) -> None:
    cache = await face.cm.allocate_blocks_cache(CacheDesc(2, [6, 4096], DataType.DT_UINT8))
    before = fill(cache, 5)
    await face.cm.copy_blocks(cache, {0: [1], 1: [2], 2: [0, 3]})  # a rotation and a chain
    for b, v in zip(before, cache.as_numpy(), strict=True):
        assert same(v[1], b[0])
        assert same(v[2], b[1])
        assert same(v[0], b[2]) and same(v[3], b[2])
        assert same(v[4:], b[4:])
    await face.cm.deallocate_blocks_cache(cache)


async def test_copy_blocks_errors(face: Face) -> None:
    cache = await face.cm.allocate_blocks_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
    batch = await face.cm.allocate_cache(CacheDesc(1, [4, 64], DataType.DT_INT8))
    for info in ({0: [4]}, {4: [0]}):
        with pytest.raises(LLMException) as exc:
            await face.cm.copy_blocks(cache, info)
        assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as exc:
        await face.cm.copy_blocks(batch, {0: [1]})
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        await face.cm.copy_blocks(cache, [(0, 1)])
    with pytest.raises(TypeError):
        await face.cm.copy_blocks(cache, {0: 1})
    with pytest.raises(ValueError):
        await face.cm.copy_blocks(cache, {-1: [1]})
    await face.cm.deallocate_blocks_cache(cache)
    await face.cm.deallocate_cache(batch)


# -- swap_blocks -------------------------------------------------------------------------
async def test_swap_blocks_out_and_in(face: Face) -> None:
    blocks, block_elems = 8, 1024
    dev = await face.cm.allocate_blocks_cache(
        CacheDesc(2, [blocks, block_elems], DataType.DT_FLOAT)
    )
    host_bufs = [np.zeros((blocks, block_elems), np.float32) for _ in range(2)]
    host = Cache.create_cpu_cache(
        CacheDesc(2, [blocks, block_elems], DataType.DT_FLOAT, Placement.HOST),
        [b.ctypes.data for b in host_bufs],
    )
    assert host.cache_id == -1 and host.is_blocks_cache
    dev_data = fill(dev, 6)
    await face.cm.swap_blocks(dev, host, {0: 3, 5: 1})  # swap out
    for d, h in zip(dev_data, host_bufs, strict=True):
        assert same(h[3], d[0]) and same(h[1], d[5])
        assert not h[0].any()
    for h in host_bufs:
        h[6] = 42.0
    await face.cm.swap_blocks(host, dev, {6: 7, 3: 2})  # swap in
    for d, v in zip(dev_data, dev.as_numpy(), strict=True):
        assert (v[7] == 42.0).all() and same(v[2], d[0])
        assert same(v[:2], d[:2])
    await face.cm.deallocate_blocks_cache(dev)


async def test_swap_blocks_with_pool_host_cache(face: Face) -> None:
    dev = await face.cm.allocate_blocks_cache(CacheDesc(1, [4, 256], DataType.DT_INT32))
    host = await face.cm.allocate_blocks_cache(
        CacheDesc(1, [6, 256], DataType.DT_INT32, Placement.HOST)
    )
    data = fill(dev, 7)
    await face.cm.swap_blocks(dev, host, {1: 5})
    assert same(host.as_numpy()[0][5], data[0][1])
    await face.cm.deallocate_blocks_cache(dev)
    await face.cm.deallocate_blocks_cache(host)


async def test_swap_blocks_errors(face: Face) -> None:
    dev = await face.cm.allocate_blocks_cache(CacheDesc(2, [4, 256], DataType.DT_INT8))
    dev2 = await face.cm.allocate_blocks_cache(CacheDesc(2, [4, 256], DataType.DT_INT8))
    buf = np.zeros((4, 256), np.int8)
    host = Cache.create_cpu_cache(
        CacheDesc(2, [4, 256], DataType.DT_INT8, Placement.HOST), [buf.ctypes.data] * 2
    )
    wrong_size = Cache.create_cpu_cache(
        CacheDesc(2, [4, 128], DataType.DT_INT8, Placement.HOST), [buf.ctypes.data] * 2
    )
    wrong_count = Cache.create_cpu_cache(
        CacheDesc(1, [4, 256], DataType.DT_INT8, Placement.HOST), [buf.ctypes.data]
    )
    batch = await face.cm.allocate_cache(CacheDesc(2, [4, 256], DataType.DT_INT8))
    for args in (
        (dev, dev2, {0: 0}),  # DEVICE -> DEVICE
        (host, host, {0: 0}),  # HOST -> HOST
        (dev, wrong_size, {0: 0}),
        (dev, wrong_count, {0: 0}),
        (dev, host, {4: 0}),
        (dev, host, {0: 4}),
        (batch, host, {0: 0}),
    ):
        with pytest.raises(LLMException) as exc:
            await face.cm.swap_blocks(*args)
        assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID, args
    with pytest.raises(TypeError):
        await face.cm.swap_blocks(dev, host, [(0, 0)])
    with pytest.raises(TypeError):
        await face.cm.swap_blocks(dev, None, {0: 0})
    await face.cm.deallocate_blocks_cache(dev)
    await face.cm.deallocate_blocks_cache(dev2)
    await face.cm.deallocate_cache(batch)


def test_create_cpu_cache_rules() -> None:
    with pytest.raises(LLMException) as exc:
        Cache.create_cpu_cache(CacheDesc(1, [2, 2], DataType.DT_INT8), [4096])
    assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        Cache.create_cpu_cache(CacheDesc(2, [2, 2], DataType.DT_INT8, Placement.HOST), [4096])
    with pytest.raises(TypeError):
        Cache.create_cpu_cache(CacheDesc(1, [2, 2], DataType.DT_INT8, Placement.HOST), (4096,))
    c = Cache.create_cpu_cache(CacheDesc(1, [2, 2], DataType.DT_INT8, Placement.HOST), [4096])
    assert str(c) == "Cache(cache_id = -1, device_tensor_addrs = 1, is_blocks_cache = True)"


# -- register / unregister ---------------------------------------------------------------
async def test_register_and_copy_user_memory(face: Face) -> None:
    bufs = [np.arange(4 * 64, dtype=np.int32).reshape(4, 64) + i for i in range(2)]
    desc = CacheDesc(2, [4, 64], DataType.DT_INT32)
    key = CacheKey(1, req_id=77)
    reg = await face.cm.register_cache(desc, [b.ctypes.data for b in bufs], [key])
    assert reg.tensor_addrs == [b.ctypes.data for b in bufs]
    with pytest.raises(LLMException) as exc:  # its key is bound
        await face.cm.allocate_cache(desc, [key])
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    pool = await face.cm.allocate_cache(desc)
    await face.cm.copy_cache(pool, reg, 1, 3)
    assert all(same(v[1], b[3]) for v, b in zip(pool.as_numpy(), bufs, strict=True))
    assert np.shares_memory(reg.as_numpy()[0], bufs[0])
    with pytest.raises(LLMException) as exc:
        await face.cm.deallocate_cache(reg)
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    await face.cm.unregister_cache(reg.cache_id)
    assert reg.tensor_addrs == []
    await face.cm.unregister_cache(reg.cache_id)  # again: no-op
    await face.cm.unregister_cache(12345)  # unknown: no-op
    again = await face.cm.allocate_cache(desc, [key])  # the key went with the registration
    for c in (pool, again):
        await face.cm.deallocate_cache(c)
    await face.cm.remove_cache_key(key)


async def test_register_blocks_cache_and_swap(face: Face) -> None:
    dev_bufs = [np.full((4, 32), i, np.int64) for i in range(2)]
    reg = await face.cm.register_blocks_cache(
        CacheDesc(2, [4, 32], DataType.DT_INT64),
        [b.ctypes.data for b in dev_bufs],
        BlocksCacheKey(1, 0),
    )
    assert reg.is_blocks_cache
    await face.cm.copy_blocks(reg, {0: [3]})
    dev_bufs[1][0] = 9
    await face.cm.copy_blocks(reg, {0: [2]})
    assert (dev_bufs[1][2] == 9).all() and (dev_bufs[1][3] == 1).all()
    with pytest.raises(LLMException) as exc:  # the blocks key is taken
        await face.cm.allocate_blocks_cache(
            CacheDesc(1, [1, 8], DataType.DT_INT8), BlocksCacheKey(1, 0)
        )
    assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    await face.cm.unregister_cache(reg.cache_id)


async def test_register_errors(face: Face) -> None:
    buf = np.zeros((2, 8), np.int8)
    desc = CacheDesc(2, [2, 8], DataType.DT_INT8)
    a = buf.ctypes.data
    with pytest.raises(TypeError):
        await face.cm.register_cache(desc, (a, a))
    with pytest.raises(TypeError):
        await face.cm.register_cache(desc, [a, "x"])
    with pytest.raises(ValueError):
        await face.cm.register_cache(desc, [a, -1])
    with pytest.raises(TypeError):
        await face.cm.register_cache(desc, [a, a], remote_accessible=1)
    for addrs in ([], [a], [a, a, a], [a, 0]):
        with pytest.raises(LLMException) as exc:
            await face.cm.register_cache(desc, addrs)
        assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID, addrs
        with pytest.raises(LLMException) as exc:
            await face.cm.register_blocks_cache(desc, addrs)
        assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID, addrs
    with pytest.raises(ValueError):
        await face.cm.unregister_cache(2**63)
    with pytest.raises(TypeError):
        await face.cm.unregister_cache("1")


async def test_remap_registered_memory_is_reserved(face: Face) -> None:
    with pytest.raises(TypeError):
        await face.cm.remap_registered_memory((MemInfo(Memtype.MEM_TYPE_DEVICE, 1, 1),))
    for info in (MemInfo(Memtype.MEM_TYPE_HOST, 1, 1), MemInfo(Memtype.MEM_TYPE_DEVICE, 0, 1)):
        with pytest.raises(LLMException) as exc:
            await face.cm.remap_registered_memory(info)
        assert code_of(exc) == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException, match="not supported") as exc:
        await face.cm.remap_registered_memory([MemInfo(Memtype.MEM_TYPE_DEVICE, 4096, 1024)])
    assert code_of(exc) == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
