"""The CUDA runtime over a fake libcudart: selection, pools, copies, staging, errors, IPC.

The fake (tests/fakelibs/fake_cudart.c) keeps "device" memory scrambled and runs queued
work only when the caller synchronises, so reading device memory without the runtime, or
forgetting a wait, shows up as wrong bytes here.
"""

from __future__ import annotations

import ctypes
import gc
import shutil
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    BlocksCacheKey,
    Cache,
    CacheDesc,
    CacheKey,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist._memory.views import numpy_dtype
from aio_datadist._native import cuda as native_cuda
from aio_datadist._runtime import HostRuntime, select_runtime
from aio_datadist._runtime.base import CopyKind, RuntimeUnavailable
from aio_datadist._runtime.cuda import IPC_TOKEN_BYTES, CudaRuntime, open_runtime
from aio_datadist.config import OPTION_ZERO_ON_ALLOC
from tests.conftest import Face, make_options, pool_cfg
from tests.fakelibs import build

ROOT = Path(__file__).resolve().parent.parent
U64 = np.uint64


@dataclass
class Fake:
    """One build of the fake library and its call log."""

    path: Path
    lib: Any

    def count(self, name: str) -> int:
        return int(self.lib.fake_cuda_count(name.encode()))

    def reset(self) -> None:
        self.lib.fake_cuda_reset()


def _fake(defines: tuple[str, ...] = ()) -> Fake:
    suffix = "-".join(d.replace("=", "") for d in defines) or "default"
    path = build("fake_cudart.c", f"libfakecudart-{suffix}.so", defines)
    lib = ctypes.CDLL(str(path))
    lib.fake_cuda_count.restype = ctypes.c_long
    lib.fake_cuda_count.argtypes = [ctypes.c_char_p]
    return Fake(path, lib)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Fake:
    """The default fake (CUDA 12.8 ABI, kernels), two devices, selected by name."""
    f = _fake()
    monkeypatch.setenv("AIO_DATADIST_CUDART", str(f.path))
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "cuda")
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "2")
    for knob in ("FAKE_CUDA_FAIL_MALLOC_OVER", "FAKE_CUDA_FAIL_HOSTALLOC_OVER"):
        monkeypatch.delenv(knob, raising=False)
    monkeypatch.delenv("FAKE_CUDA_KERNEL_BROKEN", raising=False)
    f.reset()
    return f


@pytest.fixture
def rt(fake: Fake) -> Iterator[CudaRuntime]:
    runtime = open_runtime(0)
    yield runtime
    runtime.close()


def small_ring(fake: Fake, chunk: int = 4096, slots: int = 3) -> CudaRuntime:
    return CudaRuntime(
        0, native_cuda.load(str(fake.path)), stage_chunk_bytes=chunk, stage_slots=slots
    )


def rng_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def runtime_of(face: Face) -> CudaRuntime:
    runtime = face.dd._engine.caches.runtime
    assert isinstance(runtime, CudaRuntime)
    return runtime


def read(runtime: CudaRuntime, cache: Cache) -> list[np.ndarray[Any, Any]]:
    """The tensors of a device cache, copied to the host through the runtime."""
    desc = cache.cache_desc
    return [
        np.frombuffer(runtime.download(a, desc.size), numpy_dtype(desc.data_type)).reshape(
            desc.shape
        )
        for a in cache.tensor_addrs
    ]


def fill(runtime: CudaRuntime, cache: Cache, seed: int) -> list[np.ndarray[Any, Any]]:
    """Write random bytes to every tensor of a device cache; returns what was written."""
    desc = cache.cache_desc
    out = []
    for i, a in enumerate(cache.tensor_addrs):
        data = rng_bytes(desc.size, seed * 100 + i)
        runtime.upload(a, data)
        out.append(np.frombuffer(data, numpy_dtype(desc.data_type)).reshape(desc.shape))
    return out


@pytest.fixture
async def cuda_face(fake: Fake, face_kind: str) -> AsyncIterator[Face]:
    f = Face(face_kind)
    await f.init(make_options(device_pool=pool_cfg(), host_pool=pool_cfg()))
    try:
        yield f
        leaked = {str(k): v for k, v in f.pool_used().items() if v}
        assert not leaked, f"pool memory leaked: {leaked}"
    finally:
        await f.finalize()


# -- selection ---------------------------------------------------------------------------


def test_selected_by_name(fake: Fake) -> None:
    runtime = select_runtime(1)
    try:
        assert isinstance(runtime, CudaRuntime)
        assert runtime.name == "cuda" and runtime.device_id == 1
        assert not runtime.device_memory_is_host
        assert runtime.features == {"memcpy_batch", "copy_kernel", "memset", "pointer_attributes"}
    finally:
        runtime.close()


@pytest.mark.parametrize(
    ("env", "device_id", "reason"),
    [
        ({"AIO_DATADIST_CUDART": "/nonexistent/libcudart.so.12"}, 0, "cannot be loaded"),
        ({"FAKE_CUDA_DEVICES": "0"}, 0, "cudaErrorNoDevice"),
        ({}, 2, "device_id 2 is out of range"),
    ],
)
def test_unavailable_reasons(
    fake: Fake,
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    device_id: int,
    reason: str,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeUnavailable, match=reason):
        open_runtime(device_id)
    with pytest.raises(LLMException, match=reason) as info:
        select_runtime(device_id)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "auto")
    assert isinstance(select_runtime(device_id), HostRuntime)


def test_auto_prefers_cuda(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "auto")
    runtime = select_runtime(0)
    try:
        assert isinstance(runtime, CudaRuntime)
    finally:
        runtime.close()


def test_engine_init_by_name_fails_clearly(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "0")
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException, match="no CUDA device") as info:
        dd.init(make_options(device_pool=pool_cfg()))
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


# -- pools and views -----------------------------------------------------------------------


async def test_pools_are_carved_from_one_arena_each(fake: Fake, cuda_face: Face) -> None:
    assert fake.count("cudaMalloc") == 1 and fake.count("cudaHostAlloc") == 1
    runtime = runtime_of(cuda_face)
    caches = [
        await cuda_face.cm.allocate_cache(CacheDesc(2, [4, 4096], DataType.DT_FLOAT16))
        for _ in range(3)
    ]
    blocks = await cuda_face.cm.allocate_blocks_cache(CacheDesc(2, [8, 1024], DataType.DT_INT8))
    assert fake.count("cudaMalloc") == 1  # no allocation per cache
    arena = runtime._device.items()
    assert len(arena) == 1
    base, size = arena[0]
    for c in [*caches, blocks]:
        assert all(base <= a < base + size for a in c.tensor_addrs)
    with pytest.raises(LLMException, match="accelerator memory") as info:
        caches[0].as_numpy()
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    host = await cuda_face.cm.allocate_cache(
        CacheDesc(1, [4, 64], DataType.DT_INT8, Placement.HOST)
    )
    assert host.as_numpy()[0].shape == (4, 64)
    for c in caches:
        await cuda_face.cm.deallocate_cache(c)
    await cuda_face.cm.deallocate_cache(host)
    await cuda_face.cm.deallocate_blocks_cache(blocks)


def test_finalize_frees_the_arenas(fake: Fake) -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(make_options(device_pool=pool_cfg(), host_pool=pool_cfg()))
    dd.finalize()
    gc.collect()
    assert fake.count("cudaFree") >= 1 and fake.count("cudaFreeHost") >= 1


# -- copies through the cache manager ----------------------------------------------------


async def test_copy_blocks_on_device(fake: Fake, cuda_face: Face) -> None:
    runtime = runtime_of(cuda_face)
    cache = await cuda_face.cm.allocate_blocks_cache(CacheDesc(3, [8, 512], DataType.DT_INT16))
    before = fill(runtime, cache, 4)
    await cuda_face.cm.copy_blocks(cache, {0: [5, 6], 2: [7]})
    for b, v in zip(before, read(runtime, cache), strict=True):
        assert np.array_equal(v[5], b[0]) and np.array_equal(v[6], b[0])
        assert np.array_equal(v[7], b[2]) and np.array_equal(v[:5], b[:5])
    assert fake.count("kernel_rows") >= 9  # the kernel moved them
    assert fake.count("pageable_async") == 0
    await cuda_face.cm.deallocate_blocks_cache(cache)


async def test_copy_blocks_rotation_stages_on_device(fake: Fake, cuda_face: Face) -> None:
    runtime = runtime_of(cuda_face)
    cache = await cuda_face.cm.allocate_blocks_cache(CacheDesc(2, [6, 4096], DataType.DT_UINT8))
    before = fill(runtime, cache, 5)
    await cuda_face.cm.copy_blocks(cache, {5: [5]})  # loads and tests the kernel
    mallocs = fake.count("cudaMalloc")
    await cuda_face.cm.copy_blocks(cache, {0: [1], 1: [2], 2: [0, 3]})
    for b, v in zip(before, read(runtime, cache), strict=True):
        assert np.array_equal(v[1], b[0]) and np.array_equal(v[2], b[1])
        assert np.array_equal(v[0], b[2]) and np.array_equal(v[3], b[2])
        assert np.array_equal(v[4:], b[4:])
    assert fake.count("cudaMalloc") == mallocs + 1  # scratch on the device
    await cuda_face.cm.deallocate_blocks_cache(cache)


@pytest.mark.parametrize("host_kind", ["pool", "pageable", "registered"])
async def test_swap_blocks_both_ways(fake: Fake, cuda_face: Face, host_kind: str) -> None:
    runtime = runtime_of(cuda_face)
    shape = [16, 2048]
    dev = await cuda_face.cm.allocate_blocks_cache(CacheDesc(2, shape, DataType.DT_UINT8))
    buffers: list[np.ndarray[Any, Any]] = []
    if host_kind == "pool":
        host = await cuda_face.cm.allocate_blocks_cache(
            CacheDesc(2, shape, DataType.DT_UINT8, Placement.HOST)
        )
        host_views = host.as_numpy()
    else:
        buffers = [np.zeros(shape, np.uint8) for _ in range(2)]
        if host_kind == "registered":
            for b in buffers:
                runtime.register_host(b.ctypes.data, b.nbytes)
        host = Cache.create_cpu_cache(
            CacheDesc(2, shape, DataType.DT_UINT8, Placement.HOST), [b.ctypes.data for b in buffers]
        )
        host_views = buffers
    rng = np.random.default_rng(7)
    for v in host_views:
        v[:] = rng.integers(0, 256, shape, dtype=np.uint8)
    staged = []
    fake.reset()
    mapping = {0: 3, 1: 4, 2: 5, 9: 0, 15: 15}
    await cuda_face.cm.swap_blocks(host, dev, mapping)
    staged.append(fake.count("cudaEventRecord") > 0)  # only the staging ring records events
    on_device = read(runtime, dev)
    for h, d in zip(host_views, on_device, strict=True):
        for s, t in mapping.items():
            assert np.array_equal(d[t], h[s])
    back = {3: 8, 0: 10, 15: 11}
    fake.reset()
    await cuda_face.cm.swap_blocks(dev, host, back)
    staged.append(fake.count("cudaEventRecord") > 0)
    for h, d in zip(host_views, on_device, strict=True):
        for s, t in back.items():
            assert np.array_equal(h[t], d[s])
    assert fake.count("pageable_async") == 0
    assert staged == [host_kind == "pageable"] * 2
    if host_kind == "pool":
        await cuda_face.cm.deallocate_blocks_cache(host)
    elif host_kind == "registered":
        for b in buffers:
            runtime.unregister_host(b.ctypes.data)
    await cuda_face.cm.deallocate_blocks_cache(dev)


async def test_copy_cache_between_placements(fake: Fake, cuda_face: Face) -> None:
    runtime = runtime_of(cuda_face)
    desc = CacheDesc(2, [3, 1000], DataType.DT_INT8)
    a = await cuda_face.cm.allocate_cache(desc, [CacheKey(1, 1)])
    b = await cuda_face.cm.allocate_cache(desc)
    h = await cuda_face.cm.allocate_cache(CacheDesc(2, [3, 1000], DataType.DT_INT8, Placement.HOST))
    src = fill(runtime, a, 1)
    await cuda_face.cm.copy_cache(b, a, 2, 0, 10, 500)  # device to device, part of a row
    for s, d in zip(src, read(runtime, b), strict=True):
        assert np.array_equal(d[2, 10:510], s[0, 10:510])
    await cuda_face.cm.copy_cache(h, a, 1, 2)  # device to host
    for s, d in zip(src, h.as_numpy(), strict=True):
        assert np.array_equal(d[1], s[2])
    for d in h.as_numpy():
        d[0] = 42
    await cuda_face.cm.copy_cache(a, h, 1, 0)  # host to device
    for d in read(runtime, a):
        assert (d[1] == 42).all()
    await cuda_face.cm.remove_cache_key(CacheKey(1, 1))
    for c in (a, b, h):
        await cuda_face.cm.deallocate_cache(c)


async def test_device_out_of_memory(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_FAIL_MALLOC_OVER", str(1 << 20))
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException, match="cudaErrorMemoryAllocation") as info:
        dd.init(make_options(device_pool=pool_cfg()))
    assert info.value.status_code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    monkeypatch.setenv("FAKE_CUDA_FAIL_HOSTALLOC_OVER", str(1 << 20))
    with pytest.raises(LLMException, match="cudaHostAlloc") as info:
        dd.init(make_options(host_pool=pool_cfg()))
    assert info.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY


async def test_blocks_key_and_pool_free_after_finalize(fake: Fake, cuda_face: Face) -> None:
    cache = await cuda_face.cm.allocate_blocks_cache(
        CacheDesc(1, [4, 64], DataType.DT_INT8), BlocksCacheKey(1, 0)
    )
    await cuda_face.cm.deallocate_blocks_cache(cache)


# -- the runtime's copy paths -------------------------------------------------------------


@pytest.mark.parametrize(
    ("defines", "batched"),
    [((), True), (("FAKE_CUDA_BATCH_ABI=13",), True), (("FAKE_CUDA_BATCH_ABI=0",), False)],
)
def test_batched_or_looped_copies(
    monkeypatch: pytest.MonkeyPatch, defines: tuple[str, ...], batched: bool
) -> None:
    f = _fake(defines)
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "1")
    runtime = CudaRuntime(0, native_cuda.load(str(f.path)))
    try:
        assert ("memcpy_batch" in runtime.features) == batched
        dev = runtime.alloc_device(1 << 16)
        host = runtime.alloc_host(1 << 16)
        data = rng_bytes(1 << 16, 3)
        ctypes.memmove(host, data, len(data))
        rows = [(dev + i * 4096, host + (15 - i) * 4096, 4096) for i in range(0, 16, 2)]
        ops = np.array(rows, dtype=U64)
        f.reset()
        runtime.copy_batch(ops, CopyKind.HOST_TO_DEVICE)
        assert f.count("cudaMemcpyBatchAsync") == (1 if batched else 0)
        assert f.count("cudaMemcpyAsync") == (0 if batched else len(rows))
        got = runtime.download(dev, 1 << 16)
        for d, s, n in rows:
            assert got[d - dev : d - dev + n] == data[s - host : s - host + n]
        runtime.set_feature("memcpy_batch", False)
        f.reset()
        runtime.copy_batch(ops, CopyKind.HOST_TO_DEVICE)
        assert f.count("cudaMemcpyBatchAsync") == 0 and f.count("cudaMemcpyAsync") == len(rows)
        runtime.free_host(host, 1 << 16)
        runtime.free_device(dev, 1 << 16)
    finally:
        runtime.close()


def test_adjacent_rows_merge(rt: CudaRuntime, fake: Fake) -> None:
    dev = rt.alloc_device(8192)
    host = rt.alloc_host(8192)
    fake.reset()
    ops = np.array([(dev + i * 1024, host + i * 1024, 1024) for i in range(8)], dtype=U64)
    rt.copy_batch(ops, CopyKind.HOST_TO_DEVICE)
    assert fake.count("cudaMemcpyAsync") == 1 and fake.count("cudaMemcpyBatchAsync") == 0


def test_many_scattered_host_rows_go_to_one_kernel(rt: CudaRuntime, fake: Fake) -> None:
    """Host-device batches of many rows whose host side is cudaHostAlloc memory run as one
    kernel (it reaches that memory mapped); registered host memory, a few rows, or the kernel
    switched off go to the copy engines. The bytes are the same every way."""
    n, row = 32, 2048
    dev = rt.alloc_device(n * row)
    host = rt.alloc_host(n * row)
    mine = np.zeros(n * row, np.uint8)  # pinned by registration: not mapped for a kernel
    rt.register_host(mine.ctypes.data, mine.nbytes)
    data = rng_bytes(n * row, 21)
    order = np.random.default_rng(5).permutation(n)
    try:
        ctypes.memmove(host, data, len(data))
        to_dev = np.array(
            [(dev + i * row, host + int(j) * row, row) for i, j in enumerate(order)], U64
        )
        rt.copy_batch(to_dev, CopyKind.HOST_TO_DEVICE)  # (the kernel's one-time self-test)
        fake.reset()
        rt.copy_batch(to_dev, CopyKind.HOST_TO_DEVICE)
        assert 16 <= fake.count("kernel_rows") <= n  # (neighbours in both orders merge)
        assert fake.count("cudaMemcpyBatchAsync") == 0
        got = rt.download(dev, n * row)
        for i, j in enumerate(order):
            assert got[i * row : (i + 1) * row] == data[int(j) * row : (int(j) + 1) * row]

        back = np.array([(host + i * row, dev + i * row, row) for i in range(n)[::-2]], U64)
        ctypes.memset(host, 0, n * row)
        fake.reset()
        rt.copy_batch(back, CopyKind.DEVICE_TO_HOST)
        assert fake.count("kernel_rows") == len(back)
        now = ctypes.string_at(host, n * row)
        for i in range(n)[::-2]:
            assert now[i * row : (i + 1) * row] == got[i * row : (i + 1) * row]

        for ops, what in (
            (to_dev[:8], "few rows"),
            (
                np.array([(d, mine.ctypes.data + int(s) - host, k) for d, s, k in to_dev], U64),
                "registered",
            ),
        ):
            fake.reset()
            rt.copy_batch(ops, CopyKind.HOST_TO_DEVICE)
            assert fake.count("kernel_rows") == 0, what
        rt.set_feature("copy_kernel", False)
        ctypes.memmove(host, data, len(data))
        fake.reset()
        rt.copy_batch(to_dev, CopyKind.HOST_TO_DEVICE)
        assert fake.count("kernel_rows") == 0 and fake.count("cudaMemcpyBatchAsync") == 1
        assert rt.download(dev, n * row) == got
    finally:
        rt.unregister_host(mine.ctypes.data)
        rt.free_host(host, n * row)
        rt.free_device(dev, n * row)


def test_kernel_self_test_failure_falls_back(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_KERNEL_BROKEN", "1")
    runtime = small_ring(fake)
    try:
        dev = runtime.alloc_device(1 << 16)
        data = rng_bytes(1 << 15, 9)
        runtime.upload(dev, data)
        ops = np.array(
            [(dev + (1 << 15) + i * 512, dev + i * 512, 512) for i in range(0, 64, 2)], U64
        )
        runtime.copy_batch(ops, CopyKind.DEVICE_TO_DEVICE)
        assert "self-test" in runtime.kernel_note
        got = runtime.download(dev + (1 << 15), 1 << 15)
        for i in range(0, 64, 2):
            assert got[i * 512 : i * 512 + 512] == data[i * 512 : i * 512 + 512]
        runtime.free_device(dev, 1 << 16)
    finally:
        runtime.close()


def test_runtime_without_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    f = _fake(("FAKE_CUDA_BATCH_ABI=0", "FAKE_CUDA_NO_KERNELS"))
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "1")
    runtime = CudaRuntime(0, native_cuda.load(str(f.path)))
    try:
        assert runtime.library.version == 11080
        assert "copy_kernel" not in runtime.features
        dev = runtime.alloc_device(4096)
        runtime.upload(dev, b"x" * 100)
        runtime.copy_batch(np.array([(dev + 1000, dev, 100)], U64), CopyKind.DEVICE_TO_DEVICE)
        assert runtime.download(dev + 1000, 100) == b"x" * 100
        assert f.count("cudaLaunchKernel") == 0
        runtime.free_device(dev, 4096)
    finally:
        runtime.close()


def test_d2d_outside_own_memory_uses_copy_engines(rt: CudaRuntime, fake: Fake) -> None:
    dev = rt.alloc_device(1 << 14)
    ops = np.array([(dev + 8192, dev, 4096), (dev + 4096, dev + 12288, 4096)], U64)
    rt.copy_batch(ops, CopyKind.DEVICE_TO_DEVICE)  # the first use also runs the self-test
    fake.reset()
    rt.copy_batch(ops, CopyKind.DEVICE_TO_DEVICE)
    assert fake.count("cudaLaunchKernel") == 1
    rt._device.remove(dev)  # as if the memory were the caller's
    fake.reset()
    rt.copy_batch(ops, CopyKind.DEVICE_TO_DEVICE)
    assert fake.count("cudaLaunchKernel") == 0 and fake.count("cudaMemcpyBatchAsync") == 1
    rt._device.add(dev, 1 << 14)
    rt.free_device(dev, 1 << 14)


@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("kind", [CopyKind.HOST_TO_DEVICE, CopyKind.DEVICE_TO_HOST])
def test_staging_ring_odd_sizes(fake: Fake, slots: int, kind: CopyKind) -> None:
    runtime = small_ring(fake, chunk=4096, slots=slots)
    lengths = [1, 0, 4095, 4096, 4097, 12289, 7, 3 * 4096 + 5, 0, 33]
    total = sum(lengths) + 64 * len(lengths)
    dev = runtime.alloc_device(total)
    host = np.zeros(total, np.uint8)
    src = np.frombuffer(rng_bytes(total, 11), np.uint8)
    rows = []
    d_off, h_off = 0, total
    for n in lengths:  # host rows in reverse order of the device rows, odd offsets
        h_off -= n + 64
        rows.append((d_off + 3, h_off + 5, n))
        d_off += n + 64
    try:
        if kind is CopyKind.HOST_TO_DEVICE:
            host[:] = src
            ops = np.array([(dev + d, host.ctypes.data + h, n) for d, h, n in rows], U64)
        else:
            runtime.upload(dev, src.tobytes())
            ops = np.array([(host.ctypes.data + h, dev + d, n) for d, h, n in rows], U64)
        fake.reset()
        runtime.copy_batch(ops, kind)
        assert fake.count("pageable_async") == 0
        assert fake.count("cudaEventSynchronize") >= 1
        device_now = np.frombuffer(runtime.download(dev, total), np.uint8)
        for d, h, n in rows:
            if kind is CopyKind.HOST_TO_DEVICE:
                assert np.array_equal(device_now[d : d + n], src[h : h + n])
            else:
                assert np.array_equal(host[h : h + n], src[d : d + n])
    finally:
        runtime.free_device(dev, total)
        runtime.close()


def test_mixed_pinned_and_pageable_rows(rt: CudaRuntime, fake: Fake) -> None:
    dev = rt.alloc_device(1 << 16)
    pinned = rt.alloc_host(1 << 15)
    pageable = np.frombuffer(bytearray(rng_bytes(1 << 15, 2)), np.uint8)
    ctypes.memmove(pinned, rng_bytes(1 << 15, 3), 1 << 15)
    ops = np.array([(dev, pinned, 1 << 15), (dev + (1 << 15), pageable.ctypes.data, 1 << 15)], U64)
    rt.copy_batch(ops, CopyKind.HOST_TO_DEVICE)
    got = rt.download(dev, 1 << 16)
    assert got[: 1 << 15] == rng_bytes(1 << 15, 3)
    assert got[1 << 15 :] == pageable.tobytes()
    assert fake.count("pageable_async") == 0
    rt.free_host(pinned, 1 << 15)
    rt.free_device(dev, 1 << 16)


def test_stage_out_and_in_stream_device_bytes(fake: Fake) -> None:
    runtime = small_ring(fake, chunk=8192, slots=2)
    try:
        dev = runtime.alloc_device(1 << 16)
        data = rng_bytes(1 << 16, 5)
        runtime.upload(dev, data)
        iov = np.array([(dev + 100, 30000), (dev + 40000, 0), (dev + 50000, 9999)], U64)
        with runtime.stage_out(iov) as chunks:
            got = b"".join(ctypes.string_at(a, n) for a, n in chunks)
        assert got == data[100:30100] + data[50000:59999]
        payload = rng_bytes(len(got), 6)
        with runtime.stage_in(iov) as chunks:
            pos = 0
            for a, n in chunks:
                ctypes.memmove(a, payload[pos : pos + n], n)
                pos += n
        now = runtime.download(dev, 1 << 16)
        assert now[100:30100] + now[50000:59999] == payload
        with pytest.raises(RuntimeError, match="peer gone"), runtime.stage_in(iov) as chunks:
            for a, n in chunks:
                ctypes.memset(a, 0, n)
                raise RuntimeError("peer gone")
        assert runtime.download(dev + 100, 8192) != bytes(8192)  # the chunk was dropped
        runtime.free_device(dev, 1 << 16)
    finally:
        runtime.close()


def test_concurrent_callers_use_their_own_streams(rt: CudaRuntime, fake: Fake) -> None:
    size = 1 << 16
    dev = rt.alloc_device(8 * size)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            data = rng_bytes(size, 20 + i)
            for _ in range(20):
                rt.upload(dev + i * size, data)
                assert rt.download(dev + i * size, size) == data
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fake.count("cudaStreamCreateWithFlags") <= 8
    rt.free_device(dev, 8 * size)


# -- errors --------------------------------------------------------------------------------


def test_error_mapping(rt: CudaRuntime, fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_FAIL_MALLOC_OVER", "100")
    with pytest.raises(LLMException, match="cudaMalloc: cudaErrorMemoryAllocation") as info:
        rt.alloc_device(4096)
    assert info.value.status_code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    monkeypatch.setenv("FAKE_CUDA_FAIL_HOSTALLOC_OVER", "100")
    with pytest.raises(LLMException) as info:
        rt.alloc_host(4096)
    assert info.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
    monkeypatch.delenv("FAKE_CUDA_FAIL_MALLOC_OVER")
    dev = rt.alloc_device(4096)
    host = np.zeros(4096, np.uint8)
    # The device side of an H2D copy is host memory: CUDA refuses, nothing is written.
    bad = np.array([(host.ctypes.data, host.ctypes.data + 1, 10)], U64)
    with pytest.raises(LLMException, match="cudaErrorInvalidValue") as info:
        rt._ctx.copy(bad, CopyKind.HOST_TO_DEVICE, native_cuda.CopyMode.ENGINE)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as info:
        rt.copy_batch(np.array([(0, dev, 10)], U64), CopyKind.DEVICE_TO_HOST)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(TypeError):
        rt.copy_batch(np.zeros((1, 3), np.int64), CopyKind.DEVICE_TO_DEVICE)  # type: ignore[arg-type]
    # Device memory named as the host side is refused, not read by the CPU through staging.
    other = rt.alloc_device(4096)
    swapped = np.array([(dev, other, 10)], U64)
    with pytest.raises(LLMException, match="host side") as info:
        rt.copy_batch(swapped, CopyKind.HOST_TO_DEVICE)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    rt._device.remove(other)  # memory this runtime does not know: CUDA says what it is
    with pytest.raises(LLMException, match="host side"):
        rt.copy_batch(swapped, CopyKind.HOST_TO_DEVICE)
    rt._device.add(other, 4096)
    rt.free_device(other, 4096)
    rt.free_device(dev, 4096)
    rt.close()
    with pytest.raises(LLMException, match="closed") as info:
        rt.memset(dev, 0, 1)
    assert info.value.status_code == LLMStatusCode.LLM_FAILED


def test_memset(rt: CudaRuntime) -> None:
    dev = rt.alloc_device(4096)
    rt.memset(dev, 0xAB, 4096)
    assert rt.download(dev + 10, 5) == b"\xab" * 5
    rt.free_device(dev, 4096)


async def test_zero_on_alloc_uses_cuda_memset(fake: Fake, face_kind: str) -> None:
    face = Face(face_kind)
    options = make_options(device_pool=pool_cfg(), host_pool=pool_cfg())
    options[OPTION_ZERO_ON_ALLOC] = "1"
    await face.init(options)
    try:
        runtime = runtime_of(face)
        desc = {p: CacheDesc(2, [4, 4096], DataType.DT_UINT8, p) for p in Placement}
        old = await face.cm.allocate_cache(desc[Placement.DEVICE])
        fill(runtime, old, 3)
        old_host = await face.cm.allocate_cache(desc[Placement.HOST])
        for view in old_host.as_numpy():
            view[...] = 0xAB
        await face.cm.deallocate_cache(old)
        await face.cm.deallocate_cache(old_host)
        before = fake.count("cudaMemsetAsync")
        new = await face.cm.allocate_cache(desc[Placement.DEVICE])
        new_host = await face.cm.allocate_cache(desc[Placement.HOST])
        assert fake.count("cudaMemsetAsync") == before + 1  # the device cache only
        assert all(not t.any() for t in read(runtime, new))
        assert all(not v.any() for v in new_host.as_numpy())
        await face.cm.deallocate_cache(new)
        await face.cm.deallocate_cache(new_host)
    finally:
        await face.finalize()


# -- IPC -------------------------------------------------------------------------------------

_PEER = """
import sys
from aio_datadist._runtime.cuda import open_runtime
rt = open_runtime(0)
addr = rt.open_ipc(bytes.fromhex(sys.argv[1]))
again = rt.open_ipc(bytes.fromhex(sys.argv[1]))
assert again == addr
print(rt.download(addr, 64).hex())
rt.upload(addr, b"from the peer")
rt.close_ipc(again)
rt.close_ipc(addr)
rt.close()
"""


def test_ipc_round_trip_across_processes(rt: CudaRuntime) -> None:
    dev = rt.alloc_device(1 << 16)
    data = rng_bytes(64, 12)
    rt.upload(dev + 1000, data)
    token = rt.ipc_handle(dev + 1000)
    assert len(token) == IPC_TOKEN_BYTES
    out = subprocess.run(
        [sys.executable, "-c", _PEER, token.hex()],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout.strip()) == data
    assert rt.download(dev + 1000, 13) == b"from the peer"
    with pytest.raises(LLMException, match="cudaIpcOpenMemHandle") as info:
        rt.open_ipc(token)  # CUDA refuses a handle in its own process
    assert info.value.status_code == LLMStatusCode.LLM_FAILED
    with pytest.raises(LLMException) as info:
        rt.ipc_handle(np.zeros(8, np.uint8).ctypes.data)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException):
        rt.close_ipc(dev)
    with pytest.raises(TypeError):
        rt.open_ipc(b"short")
    rt.free_device(dev, 1 << 16)


# -- the shipped PTX ---------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_ptx_header_is_current() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_cuda_ptx.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr


_ABI_CHECK = r"""
#include <cuda_runtime_api.h>
#include <stddef.h>
#include "cuda_abi.h"
#define SAME_SIZE(a, b) _Static_assert(sizeof(a) == sizeof(b), #a)
#define SAME_OFFSET(a, fa, b, fb) _Static_assert(offsetof(a, fa) == offsetof(b, fb), #fa)
SAME_SIZE(cuerr, cudaError_t);
SAME_SIZE(custream, cudaStream_t);
SAME_SIZE(cuevent, cudaEvent_t);
SAME_SIZE(cu_dim3, dim3);
SAME_SIZE(cu_ipc_handle, cudaIpcMemHandle_t);
SAME_SIZE(cu_mem_location, struct cudaMemLocation);
SAME_SIZE(cu_memcpy_attrs, struct cudaMemcpyAttributes);
SAME_OFFSET(cu_memcpy_attrs, src_hint, struct cudaMemcpyAttributes, srcLocHint);
SAME_OFFSET(cu_memcpy_attrs, dst_hint, struct cudaMemcpyAttributes, dstLocHint);
SAME_OFFSET(cu_memcpy_attrs, flags, struct cudaMemcpyAttributes, flags);
_Static_assert(sizeof(cu_pointer_attrs) >= sizeof(struct cudaPointerAttributes), "attrs");
SAME_OFFSET(cu_pointer_attrs, device, struct cudaPointerAttributes, device);
SAME_OFFSET(cu_pointer_attrs, device_pointer, struct cudaPointerAttributes, devicePointer);
SAME_OFFSET(cu_pointer_attrs, host_pointer, struct cudaPointerAttributes, hostPointer);
_Static_assert((int)CU_ERR_INVALID_VALUE == (int)cudaErrorInvalidValue, "");
_Static_assert((int)CU_ERR_MEMORY_ALLOCATION == (int)cudaErrorMemoryAllocation, "");
_Static_assert((int)CU_ERR_INVALID_MEMCPY_DIRECTION == (int)cudaErrorInvalidMemcpyDirection, "");
_Static_assert((int)CU_ERR_INVALID_DEVICE == (int)cudaErrorInvalidDevice, "");
_Static_assert((int)CU_STREAM_NON_BLOCKING == (int)cudaStreamNonBlocking, "");
_Static_assert((int)CU_EVENT_DISABLE_TIMING == (int)cudaEventDisableTiming, "");
_Static_assert((int)CU_HOST_ALLOC_PORTABLE == (int)cudaHostAllocPortable, "");
_Static_assert((int)CU_HOST_ALLOC_MAPPED == (int)cudaHostAllocMapped, "");
_Static_assert((int)CU_HOST_REGISTER_PORTABLE == (int)cudaHostRegisterPortable, "");
_Static_assert((int)CU_IPC_LAZY_PEER_ACCESS == (int)cudaIpcMemLazyEnablePeerAccess, "");
_Static_assert(CU_IPC_HANDLE_BYTES == CUDA_IPC_HANDLE_SIZE, "");
_Static_assert(cudaMemcpyHostToDevice == 1 && cudaMemcpyDeviceToHost == 2, "");
_Static_assert(cudaMemcpyDeviceToDevice == 3 && cudaMemcpyDefault == 4, "");
_Static_assert(cudaMemoryTypeHost == 1 && cudaMemoryTypeDevice == 2, "");
#if CUDART_VERSION >= 12080
_Static_assert((int)CU_SRC_ACCESS_ORDER_STREAM == (int)cudaMemcpySrcAccessOrderStream, "");
#endif
/* The argument order cuda_rt.c calls with, in the header's own types. */
#if CUDART_VERSION >= 13000 && CUDART_VERSION < 14000
cudaError_t (*batch)(void *const *, const void *const *, const size_t *, size_t,
                     struct cudaMemcpyAttributes *, size_t *, size_t, cudaStream_t)
    = cudaMemcpyBatchAsync;
#elif CUDART_VERSION >= 12080
cudaError_t (*batch)(void **, void **, size_t *, size_t, struct cudaMemcpyAttributes *,
                     size_t *, size_t, size_t *, cudaStream_t) = cudaMemcpyBatchAsync;
#endif
cudaError_t (*launch)(const void *, dim3, dim3, void **, size_t, cudaStream_t) = cudaLaunchKernel;
cudaError_t (*ipc_open)(void **, cudaIpcMemHandle_t, unsigned) = cudaIpcOpenMemHandle;
cudaError_t (*host_alloc)(void **, size_t, unsigned) = cudaHostAlloc;
cudaError_t (*host_register)(void *, size_t, unsigned) = cudaHostRegister;
cudaError_t (*copy)(void *, const void *, size_t, enum cudaMemcpyKind, cudaStream_t)
    = cudaMemcpyAsync;
"""

_CUDA_INCLUDE = Path("/usr/local/cuda/include")


@pytest.mark.skipif(
    not (_CUDA_INCLUDE / "cuda_runtime_api.h").exists() or shutil.which("cc") is None,
    reason="needs the CUDA headers and a C compiler",
)
def test_abi_matches_the_cuda_headers(tmp_path: Path) -> None:
    src = tmp_path / "abi.c"
    src.write_text(_ABI_CHECK)
    out = subprocess.run(
        [
            "cc",
            "-std=c11",
            "-Wall",
            "-Werror",
            "-c",
            "-o",
            str(tmp_path / "abi.o"),
            str(src),
            f"-I{_CUDA_INCLUDE}",
            f"-I{ROOT / 'aio_datadist' / '_native'}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
