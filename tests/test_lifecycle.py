"""Engine lifecycle through both faces: init, finalize, preconditions, one-per-process rule."""

from __future__ import annotations

import asyncio
import threading

import pytest

import aio_datadist as llm_datadist
from aio_datadist import (
    AsyncLLMDataDist,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from tests.conftest import Face, make_options, pool_cfg

DESC = CacheDesc(2, [4, 256], DataType.DT_FLOAT16, Placement.DEVICE)


async def test_cache_manager_before_init_and_after_finalize(make_face) -> None:
    f: Face = make_face()
    with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
        _ = f.dd.cache_manager
    await f.init(make_options(device_pool=pool_cfg()))
    cm = f.cm
    cache = await cm.allocate_cache(DESC)
    await cm.deallocate_cache(cache)
    await f.finalize()
    with pytest.raises(RuntimeError, match="llm datadist is not initialized"):
        _ = f.dd.cache_manager
    # A cache manager kept past finalize refuses with LLM_FAILED.
    with pytest.raises(LLMException) as exc:
        await cm.allocate_cache(DESC)
    assert exc.value.status_code == LLMStatusCode.LLM_FAILED
    await f.finalize()  # second finalize: no-op


async def test_init_twice_is_a_noop_and_ids_restart(make_face) -> None:
    f: Face = make_face()
    opts = make_options(device_pool=pool_cfg())
    await f.init(opts)
    await f.init(opts)
    first = await f.cm.allocate_cache(DESC)
    second = await f.cm.allocate_cache(DESC)
    assert (first.cache_id, second.cache_id) == (1, 2)
    await f.finalize()
    assert first.tensor_addrs == [] and second.tensor_addrs == []
    await f.init(opts)
    again = await f.cm.allocate_cache(DESC)
    assert again.cache_id == 1
    # A Cache from the previous init is not mistaken for the new cache with the same id.
    with pytest.raises(LLMException) as exc:
        await f.cm.copy_cache(again, first)
    assert exc.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    await f.cm.deallocate_cache(again)


async def test_outside_cache_manager_mode(make_face) -> None:
    f: Face = make_face()
    await f.init(make_options(cache_manager=False))
    with pytest.raises(LLMException) as exc:
        _ = f.dd.cache_manager
    assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


async def test_bad_constructor_and_options(make_face) -> None:
    kind = make_face().kind
    cls = LLMDataDist if kind == "sync" else AsyncLLMDataDist
    with pytest.raises(TypeError):
        cls("PROMPT", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cls(LLMRole.PROMPT, -1)
    with pytest.raises(ValueError):
        cls(LLMRole.PROMPT, 2**64)
    f: Face = make_face()
    with pytest.raises(TypeError):
        await f.init([("ge.exec.deviceId", "0")])  # type: ignore[arg-type]
    with pytest.raises(LLMException) as exc:
        await f.init({"llm.EnableCacheManager": "1"})
    assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert f.dd.cluster_id == 1


@pytest.mark.parametrize(
    ("device_pool", "host_pool"),
    [
        (pool_cfg(page_shift=9), None),
        (pool_cfg(page_shift=31), None),
        ('{"memory_size": 0}', None),
        ("not json", None),
        (None, pool_cfg(memory_size=20 * 2**30 + 1)),
    ],
)
async def test_invalid_pool_configs_refuse_init(make_face, device_pool, host_pool) -> None:
    f: Face = make_face()
    with pytest.raises(LLMException) as exc:
        await f.init(make_options(device_pool=device_pool, host_pool=host_pool))
    assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(RuntimeError, match="not initialized"):
        _ = f.dd.cache_manager


def test_blocking_one_per_process() -> None:
    first, second = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    opts = make_options(device_pool=pool_cfg())
    first.init(opts)
    try:
        with pytest.raises(LLMException) as exc:
            second.init(opts)
        assert exc.value.status_code == LLMStatusCode.LLM_FAILED
        assert "Cannot init multiple LLMDataDists" in str(exc.value)
    finally:
        first.finalize()
    second.init(opts)
    second.finalize()


def test_blocking_api_from_another_thread() -> None:
    """vllm-ascend drives the cache manager from a worker thread."""
    dd = LLMDataDist(LLMRole.DECODER, 7)
    dd.init(make_options(device_pool=pool_cfg()))
    try:
        errors: list[BaseException] = []

        def work() -> None:
            try:
                cache = dd.cache_manager.allocate_blocks_cache(
                    CacheDesc(2, [8, 1024], DataType.DT_INT8)
                )
                dd.cache_manager.deallocate_blocks_cache(cache)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert errors == []
    finally:
        dd.finalize()


async def test_async_engines_side_by_side_and_context_manager() -> None:
    opts = make_options(device_pool=pool_cfg())
    async with (
        AsyncLLMDataDist(LLMRole.PROMPT, 1) as prompt,
        AsyncLLMDataDist(LLMRole.DECODER, 2) as decoder,
    ):
        await prompt.init(opts)
        await decoder.init(opts)
        a = await prompt.cache_manager.allocate_cache(DESC)
        b = await decoder.cache_manager.allocate_cache(DESC)
        assert a.cache_id == b.cache_id == 1
        # A cache belongs to its own engine.
        with pytest.raises(LLMException) as exc:
            await decoder.cache_manager.copy_cache(b, a)
        assert exc.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    assert a.tensor_addrs == [] and b.tensor_addrs == []
    with pytest.raises(RuntimeError):
        _ = prompt.cache_manager


async def test_async_engine_refuses_other_loops() -> None:
    dd = AsyncLLMDataDist(LLMRole.PROMPT, 1)
    await dd.init(make_options(device_pool=pool_cfg()))
    try:
        cm = dd.cache_manager

        def other_loop() -> BaseException | None:
            try:
                asyncio.run(cm.allocate_cache(DESC))
            except RuntimeError as exc:
                return exc
            return None

        err = await asyncio.to_thread(other_loop)
        assert isinstance(err, RuntimeError) and "event loop" in str(err)
    finally:
        await dd.finalize()


def test_root_exports_documented_names() -> None:
    for name in llm_datadist.v2_list:
        assert getattr(llm_datadist, name) is not None
    assert llm_datadist.LlmConfig is llm_datadist.LLMConfig
    assert llm_datadist.MemType is llm_datadist.Memtype
    for name in ("TensorDesc", "Tensor", "KvCacheManager"):
        with pytest.raises(ImportError, match="v1"):
            getattr(llm_datadist, name)
    with pytest.raises(AttributeError):
        _ = llm_datadist.NoSuchName  # type: ignore[attr-defined]
    namespace: dict[str, object] = {}
    exec("from aio_datadist import *", namespace)
    assert "LLMDataDist" in namespace and "AsyncLLMDataDist" in namespace
    assert "runtime:host" in llm_datadist.features
