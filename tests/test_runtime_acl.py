"""The ACL runtime against a fake libascendcl: selection, call sequence, error mapping and data.

The fake (``fakelibs/fake_ascendcl.c``) keeps device memory out of the host's reach, checks
what ACL checks and logs every call, so these tests prove the calls made, not only results.
Nothing here has run on Ascend hardware.
"""

from __future__ import annotations

import gc
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import aio_datadist._runtime as runtimes
from aio_datadist import (
    Cache,
    CacheDesc,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist._native import acl
from aio_datadist._runtime import RuntimeUnavailable, select_runtime
from aio_datadist._runtime.acl import AclRuntime, open_runtime
from aio_datadist._runtime.base import ZERO_CHUNK_BYTES, CopyKind, DeviceRuntime
from aio_datadist.config import OPTION_DEVICE_ID, OPTION_SESSION_DEVICE_ID, OPTION_ZERO_ON_ALLOC
from tests.acl_fake import FAKE_VARS, FakeAcl, read_device, run_script, write_device
from tests.conftest import Face, make_options, pool_cfg
from tests.fakelibs import build

MiB = 1 << 20


@pytest.fixture(scope="session")
def fake_path() -> Path:
    return build("fake_ascendcl.c", "libascendcl.so")


@pytest.fixture
def fake(fake_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAcl]:
    """The fake selected by name, logging to a fresh file; every device released afterwards."""
    for var in FAKE_VARS:
        monkeypatch.delenv(var, raising=False)
    log = tmp_path / "acl.log"
    monkeypatch.setenv("AIO_DATADIST_ASCENDCL", str(fake_path))
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "acl")
    monkeypatch.setenv("AIO_DATADIST_HCCL", str(tmp_path / "absent-libhccl.so"))
    monkeypatch.setenv("FAKE_ACL_LOG", str(log))
    f = FakeAcl(fake_path, log)
    yield f
    f.assert_released()


def runtime_of(face: Face) -> DeviceRuntime:
    caches = face.dd._engine.caches
    assert caches is not None
    runtime: DeviceRuntime = caches.runtime
    return runtime


def init_error(options: dict[str, str]) -> LLMException:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as exc:
        dd.init(options)
    assert not dd._engine.initialized
    return exc.value


def pooled(device: bool = True, host: bool = True) -> dict[str, str]:
    return make_options(
        device_pool=pool_cfg() if device else None, host_pool=pool_cfg() if host else None
    )


# -- selection -----------------------------------------------------------------------------
def test_missing_library_asked_by_name_is_param_invalid(
    fake: FakeAcl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "nowhere" / "libascendcl.so"
    monkeypatch.setenv("AIO_DATADIST_ASCENDCL", str(missing))
    err = init_error(pooled())
    assert err.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "libascendcl cannot be used" in str(err) and str(missing) in str(err)


def test_library_without_acl_symbols_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    other = build("fake_hccl.c", "libhccl.so")
    monkeypatch.setenv("AIO_DATADIST_ASCENDCL", str(other))
    with pytest.raises(RuntimeUnavailable, match="has no symbol aclInit"):
        open_runtime(0)


@pytest.mark.parametrize(
    "env",
    [{"FAKE_ACL_DEVICES": "0"}, {"FAKE_ACL_FAIL": "aclrtGetDeviceCount:207004"}],
    ids=["count-zero", "no-device-error"],
)
def test_no_device_is_param_invalid_by_name(
    fake: FakeAcl, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    err = init_error(pooled())
    assert err.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "reports no Ascend device" in str(err)
    assert "aclrtSetDevice" not in fake.calls()


def test_device_id_out_of_range(fake: FakeAcl, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ACL_DEVICES", "2")
    options = pooled()
    options[OPTION_DEVICE_ID] = options[OPTION_SESSION_DEVICE_ID] = "2"
    err = init_error(options)
    assert err.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "device_id 2 is out of range: ACL reports 2 Ascend device(s)" in str(err)
    rt = open_runtime(1)
    try:
        assert rt.device_id == 1 and "aclrtSetDevice device=1 -> 0" in fake.lines()
    finally:
        rt.close()


def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``auto`` see no CUDA, whatever this machine has."""
    real = runtimes._opener

    def opener(name: str) -> Callable[[int], DeviceRuntime] | None:
        if name == "cuda":

            def unavailable(device_id: int) -> DeviceRuntime:
                raise RuntimeUnavailable("no CUDA in this test")

            return unavailable
        return real(name)

    monkeypatch.setattr(runtimes, "_opener", opener)


def test_auto_falls_back_to_host_without_cuda_and_acl(
    fake: FakeAcl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_cuda(monkeypatch)
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "auto")
    monkeypatch.setenv("AIO_DATADIST_ASCENDCL", str(tmp_path / "libascendcl.so"))
    rt = select_runtime(0)
    assert rt.name == "host" and rt.device_memory_is_host
    rt.close()


def test_auto_picks_acl_when_present(fake: FakeAcl, monkeypatch: pytest.MonkeyPatch) -> None:
    _no_cuda(monkeypatch)
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "auto")
    rt = select_runtime(0)
    try:
        assert isinstance(rt, AclRuntime) and not rt.device_memory_is_host
        assert rt.features == {"acl"} and not rt.hccl.available
    finally:
        rt.close()


def test_auto_falls_back_when_acl_has_no_device(
    fake: FakeAcl, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_cuda(monkeypatch)
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "auto")
    monkeypatch.setenv("FAKE_ACL_DEVICES", "0")
    rt = select_runtime(0)
    assert rt.name == "host"
    rt.close()


# -- call sequence ---------------------------------------------------------------------------
_SEQUENCE_SCRIPT = """
import gc
from aio_datadist import CacheDesc, DataType, LLMDataDist, LLMRole, Placement
from tests.conftest import make_options, pool_cfg

for cluster in (1, 2):
    dd = LLMDataDist(LLMRole.PROMPT, cluster)
    dd.init(make_options(device_pool=pool_cfg(), host_pool=pool_cfg()))
    cm = dd.cache_manager
    host = cm.allocate_blocks_cache(CacheDesc(1, [4, 1024], DataType.DT_UINT8, Placement.HOST))
    dev = cm.allocate_blocks_cache(CacheDesc(1, [4, 1024], DataType.DT_UINT8, Placement.DEVICE))
    cm.swap_blocks(host, dev, {0: 1})
    cm.deallocate_blocks_cache(host)
    cm.deallocate_blocks_cache(dev)
    dd.finalize()
    del host, dev, cm, dd
    gc.collect()
print("done")
"""


def test_call_sequence_in_a_fresh_process(fake_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "acl.log"
    env = {
        "AIO_DATADIST_ASCENDCL": str(fake_path),
        "AIO_DATADIST_RUNTIME": "acl",
        "AIO_DATADIST_HCCL": str(tmp_path / "absent.so"),
        "FAKE_ACL_LOG": str(log),
    }
    assert run_script(_SEQUENCE_SCRIPT, env).strip() == "done"
    seen = FakeAcl.__new__(FakeAcl)
    seen.log = log
    one_engine = [
        "aclrtGetDeviceCount",
        "aclrtSetDevice",
        "aclrtMalloc",  # the device pool's arena
        "aclrtMallocHost",  # the host pool's arena
        "aclrtCreateStream",  # on the first queued copy
        "aclrtMemcpyAsync",
        "aclrtSynchronizeStream",
        "aclrtDestroyStream",  # finalize
        "aclrtFree",  # the arenas go once nothing refers to them, in either order
        "aclrtFreeHost",
        "aclrtResetDevice",
    ]

    def arenas_in_order(calls: list[str]) -> list[str]:
        frees = [i for i, name in enumerate(calls) if name in ("aclrtFree", "aclrtFreeHost")]
        for a, b in zip(frees[::2], frees[1::2], strict=True):
            if b == a + 1:
                calls[a : b + 1] = sorted(calls[a : b + 1])
        return calls

    # aclInit once per process; ACL stays initialised, aclFinalize is never called.
    assert arenas_in_order(seen.calls()) == ["aclInit", *one_engine, *one_engine]
    lines = seen.lines()
    sizes = [line for line in lines if line.startswith(("aclrtMalloc ", "aclrtMallocHost "))]
    assert all(f"size={64 * MiB} " in line for line in sizes)
    assert "aclrtMalloc size=67108864 policy=0 -> 0" in lines  # ACL_MEM_MALLOC_HUGE_FIRST
    assert all(line.endswith("-> 0") for line in lines)
    assert lines.count("aclrtResetDevice device=0 leaked=0 -> 0") == 2
    # Every device call ran with the runtime's context bound first.
    names = seen.calls(bind=True)
    for i, name in enumerate(names):
        if name in ("aclrtMalloc", "aclrtMallocHost", "aclrtFree", "aclrtFreeHost"):
            assert names[i - 1] == "aclrtSetCurrentContext", (i, names)


def test_application_initialised_acl_is_reused(fake_path: Path, tmp_path: Path) -> None:
    log = tmp_path / "acl.log"
    code = (
        "import ctypes, os\n"
        "ctypes.CDLL(os.environ['AIO_DATADIST_ASCENDCL']).aclInit(None)\n"
        "from aio_datadist._native import acl\n"
        "acl.load(os.environ['AIO_DATADIST_ASCENDCL'])\n"
        "print(acl.device_count())\n"
        "acl.finalize()\n"  # not ours to finalize: nothing is called
    )
    env = {"AIO_DATADIST_ASCENDCL": str(fake_path), "FAKE_ACL_LOG": str(log)}
    assert run_script(code, env).strip() == "1"
    assert [line.split()[0] for line in log.read_text().splitlines()] == [
        "aclInit",  # the application's
        "aclInit",  # ours: ACL_ERROR_REPEAT_INITIALIZE, taken as initialised
        "aclrtGetDeviceCount",
    ]


def test_aclinit_failure_makes_the_runtime_unavailable(fake_path: Path, tmp_path: Path) -> None:
    code = (
        "from aio_datadist._runtime.acl import open_runtime\n"
        "from aio_datadist._runtime.base import RuntimeUnavailable\n"
        "try:\n"
        "    open_runtime(0)\n"
        "except RuntimeUnavailable as exc:\n"
        "    print(exc)\n"
    )
    env = {"AIO_DATADIST_ASCENDCL": str(fake_path), "FAKE_ACL_FAIL": "aclInit:500001"}
    out = run_script(code, env)
    assert "libascendcl cannot be used: aclInit returned ACL error 500001" in out
    assert "fake aclInit failed with 500001" in out  # aclGetRecentErrMsg's text


def test_finalize_only_when_no_device_is_open(fake_path: Path, tmp_path: Path) -> None:
    code = (
        "import os\n"
        "from aio_datadist import LLMException\n"
        "from aio_datadist._native import acl\n"
        "acl.load(os.environ['AIO_DATADIST_ASCENDCL'])\n"
        "dev = acl.AclDevice(0)\n"
        "try:\n"
        "    acl.finalize()\n"
        "except LLMException as exc:\n"
        "    print('busy', exc.status_code.name)\n"
        "dev.close()\n"
        "acl.finalize()\n"
        "try:\n"
        "    acl.AclDevice(0)\n"
        "except acl.AclUnavailable as exc:\n"
        "    print('after:', exc)\n"
    )
    log = tmp_path / "acl.log"
    env = {"AIO_DATADIST_ASCENDCL": str(fake_path), "FAKE_ACL_LOG": str(log)}
    out = run_script(code, env).splitlines()
    assert out == ["busy LLM_FAILED", "after: ACL was finalized in this process"]
    names = [line.split()[0] for line in log.read_text().splitlines()]
    assert names[-2:] == ["aclrtResetDevice", "aclFinalize"]


_PULL_SCRIPT = """
import asyncio
from aio_datadist import (
    AsyncLLMDataDist, BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMRole, Placement,
)
from tests.conftest import make_options, pool_cfg

async def main():
    opts = dict(device_pool=pool_cfg(), transport="loopback", sync_kv_timeout=5000)
    prompt = AsyncLLMDataDist(LLMRole.PROMPT, 1)
    await prompt.init(make_options(**opts, listen="127.0.0.1:31999"))
    decoder = AsyncLLMDataDist(LLMRole.DECODER, 2)
    await decoder.init(make_options(**opts))
    desc = CacheDesc(1, [4, 4096], DataType.DT_UINT8, Placement.DEVICE)
    await prompt.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(1, 0))
    dst = await decoder.cache_manager.allocate_blocks_cache(desc, BlocksCacheKey(2, 0))
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", 31999)
    await decoder.link_clusters([info], 5000)
    await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [1])
    print("pulled")

asyncio.run(main())
"""


def test_pull_between_device_caches_on_acl(fake_path: Path, tmp_path: Path) -> None:
    env = {
        "AIO_DATADIST_ASCENDCL": str(fake_path),
        "AIO_DATADIST_RUNTIME": "acl",
        "AIO_DATADIST_HCCL": str(tmp_path / "absent.so"),
    }
    assert run_script(_PULL_SCRIPT, env).strip() == "pulled"


# -- error mapping -------------------------------------------------------------------------
def test_device_pool_that_cannot_be_carved_is_device_oom(
    fake: FakeAcl, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ACL_FAIL_MALLOC_OVER", str(MiB))
    err = init_error(pooled())
    assert err.status_code == LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
    assert "aclrtMalloc of 67108864 bytes on device 0" in str(err)
    assert "ACL error 207001" in str(err)
    assert fake.calls()[-2:] == ["aclrtMalloc", "aclrtResetDevice"]


def test_host_pool_that_cannot_be_carved_is_host_oom(
    fake: FakeAcl, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_ACL_FAIL_MALLOC_HOST_OVER", str(MiB))
    err = init_error(pooled())
    assert err.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
    assert "aclrtMallocHost of 67108864 bytes" in str(err) and "207001" in str(err)
    del err  # its traceback holds the device pool; its arena is freed, then the device reset
    fake.assert_released()
    assert fake.calls()[-3:] == ["aclrtMallocHost", "aclrtFree", "aclrtResetDevice"]


def test_set_device_failure_is_llm_failed(fake: FakeAcl, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_ACL_FAIL", "aclrtSetDevice:507033")
    err = init_error(pooled())
    assert err.status_code == LLMStatusCode.LLM_FAILED
    assert "aclrtSetDevice returned ACL error 507033" in str(err)


def test_failed_copy_is_llm_failed_with_acl_code_and_message(
    fake: FakeAcl, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt = open_runtime(0)
    try:
        host, dev = rt.alloc_host(4096), rt.alloc_device(4096)
        ops = np.array([[dev, host, 4096]], np.uint64)
        monkeypatch.setenv("FAKE_ACL_FAIL", "aclrtSynchronizeStream:507000")
        with pytest.raises(LLMException) as exc:
            rt.copy_batch(ops, CopyKind.HOST_TO_DEVICE)
        assert exc.value.status_code == LLMStatusCode.LLM_FAILED
        message = str(exc.value)
        assert "aclrtSynchronizeStream returned ACL error 507000" in message
        assert "fake aclrtSynchronizeStream failed with 507000" in message
        assert acl.last_error()[0] == 507000
        monkeypatch.delenv("FAKE_ACL_FAIL")
        rt.copy_batch(ops, CopyKind.HOST_TO_DEVICE)  # the runtime stays usable
        assert acl.last_error() == (0, "")
        rt.free_host(host, 4096)
        rt.free_device(dev, 4096)
    finally:
        rt.close()


def test_bad_arguments_are_param_invalid(fake: FakeAcl) -> None:
    rt = open_runtime(0)
    try:
        dev = rt.alloc_device(4096)
        buf = np.zeros(8192, np.uint8)
        fake.clear_log()
        for row in ([0, buf.ctypes.data, 16], [dev, 0, 16], [2**64 - 8, buf.ctypes.data, 16]):
            with pytest.raises(LLMException) as exc:  # refused before ACL is called
                rt.copy_batch(np.array([row], np.uint64), CopyKind.HOST_TO_DEVICE)
            assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert fake.calls() == []
        with pytest.raises(LLMException) as exc:  # ACL refuses: past the end of the allocation
            rt.copy_batch(np.array([[dev, buf.ctypes.data, 8192]], np.uint64), 1)  # type: ignore[arg-type]
        assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        assert "aclrtMemcpy returned ACL error 107000" in str(exc.value)
        with pytest.raises(LLMException) as exc:
            rt.free_device(dev + 64, 4096)
        assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(LLMException) as exc:
            rt.alloc_device(0)
        assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        rt.free_device(dev, 4096)
    finally:
        rt.close()


# -- the device, directly ----------------------------------------------------------------------
def test_only_aligned_page_locked_rows_are_queued(fake: FakeAcl) -> None:
    rt = open_runtime(0)
    device = rt._device
    try:
        dev = device.malloc(1 << 16)
        pinned = device.malloc_host(1 << 16)
        pageable = np.random.default_rng(2).integers(0, 256, 1 << 16, dtype=np.uint8)
        original = pageable.copy()
        page = pageable.ctypes.data
        src = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
        device.copy_batch(np.array([[pinned, src.ctypes.data, 1 << 16]], np.uint64), 0)
        cases = [
            ([[dev, pinned, 4096]], 1, 1),  # aligned, page locked: queued
            ([[dev + 4096, page + 64, 4096]], 1, 0),  # pageable host memory: synchronous
            ([[dev + 8193, pinned + 8193, 100]], 1, 0),  # not 64-byte aligned: synchronous
            ([[dev + 16384, dev, 4096]], 3, 1),  # device to device
            ([[page, dev, 4096]], 2, 0),
            ([[pinned + 32768, dev, 4096]], 2, 1),
        ]
        for ops, kind, queued in cases:
            assert device.copy_batch(np.array(ops, np.uint64), kind) == queued, ops
        assert fake.read(dev, 4096) == src[:4096].tobytes()
        assert fake.read(dev + 16384, 4096) == src[:4096].tobytes()
        assert fake.read(dev + 8193, 100) == src[8193:8293].tobytes()
        assert pageable[:4096].tobytes() == src[:4096].tobytes()
        assert fake.read(dev + 4096, 4096) == original[64:4160].tobytes()
        assert read_device(rt, dev, 4096) == src[:4096].tobytes()
        device.free_host(pinned)
        device.free(dev)
    finally:
        rt.close()


def test_rows_continuing_each_other_become_one_call(fake: FakeAcl) -> None:
    rt = open_runtime(0)
    try:
        dev = rt.alloc_device(1 << 16)
        host = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[: 1 << 16].copy()
        base = host.ctypes.data
        rows = [[dev + i * 1024, base + i * 1024, 1024] for i in range(8)]
        rows.insert(3, [dev, base, 0])  # zero-length rows are skipped
        fake.clear_log()
        rt.copy_batch(np.array(rows, np.uint64), CopyKind.HOST_TO_DEVICE)
        assert fake.calls() == ["aclrtMemcpy"]
        assert "aclrtMemcpy kind=1 count=8192 destMax=8192 -> 0" in fake.lines()
        assert fake.read(dev, 8192) == host[:8192].tobytes()
        rt.free_device(dev, 1 << 16)
    finally:
        rt.close()


def test_host_to_host_copies_never_reach_acl(fake: FakeAcl) -> None:
    rt = open_runtime(0)
    try:
        a, b = np.arange(4096, dtype=np.uint8), np.zeros(4096, np.uint8)
        fake.clear_log()
        rt.copy_batch(np.array([[b.ctypes.data, a.ctypes.data, 4096]], np.uint64), 0)  # type: ignore[arg-type]
        assert fake.calls() == [] and bytes(a) == bytes(b)
    finally:
        rt.close()


def test_worker_threads_bind_the_device_context(fake: FakeAcl) -> None:
    rt = open_runtime(0)  # aclrtSetDevice made the context current on this thread only
    try:
        dev = rt.alloc_device(4096)
        data = bytes(range(256)) * 16
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                write_device(rt, dev, data)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        fake.clear_log()
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert not errors
        assert fake.calls(bind=True) == ["aclrtSetCurrentContext", "aclrtMemcpy"]
        assert fake.read(dev, 4096) == data
        rt.free_device(dev, 4096)
    finally:
        rt.close()


def test_concurrent_batches_from_many_threads(fake: FakeAcl) -> None:
    rt = open_runtime(0)
    try:
        nthreads, size = 8, 1 << 16
        dev = rt.alloc_device(nthreads * size)
        pinned = rt.alloc_host(nthreads * size)
        back = np.zeros(nthreads * size, np.uint8)
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                blob = pattern(size, 100 + i)
                for _ in range(20):
                    write_device(rt, dev + i * size, blob)  # pageable: synchronous rows
                    ops = np.array([[pinned + i * size, dev + i * size, size]], np.uint64)
                    rt.copy_batch(ops, CopyKind.DEVICE_TO_HOST)  # page locked: on the stream
                    ops = np.array(
                        [[back.ctypes.data + i * size, pinned + i * size, size]], np.uint64
                    )
                    rt.copy_batch(ops, CopyKind.HOST_TO_HOST)
                    assert back[i * size : (i + 1) * size].tobytes() == blob
                    scratch = rt.alloc_device(4096)
                    rt.free_device(scratch, 4096)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(nthreads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        rt.free_host(pinned, nthreads * size)
        rt.free_device(dev, nthreads * size)
    finally:
        rt.close()


def test_close_resets_the_device_after_the_last_free(fake: FakeAcl) -> None:
    rt = open_runtime(0)
    dev, host = rt.alloc_device(4096), rt.alloc_host(4096)
    rt.copy_batch(np.array([[dev, host, 4096]], np.uint64), CopyKind.HOST_TO_DEVICE)
    rt.close()
    rt.close()  # idempotent
    assert fake.calls()[-1] == "aclrtDestroyStream" and fake.count("refs:0") == 1
    for call in (
        lambda: rt.alloc_device(4096),
        lambda: rt.copy_batch(np.array([[dev, host, 64]], np.uint64), CopyKind.HOST_TO_DEVICE),
        lambda: rt.copy_batch(np.array([[host, host + 64, 64]], np.uint64), CopyKind.HOST_TO_HOST),
    ):
        with pytest.raises(LLMException) as exc:
            call()
        assert exc.value.status_code == LLMStatusCode.LLM_FAILED
        assert "closed" in str(exc.value)
    rt.free_device(dev, 4096)
    assert fake.count("refs:0") == 1
    rt.free_host(host, 4096)
    assert fake.calls()[-2:] == ["aclrtFreeHost", "aclrtResetDevice"]
    assert fake.count("refs:0") == 0


def test_another_library_is_refused_while_a_device_is_open(fake: FakeAcl) -> None:
    other = build("fake_hccl.c", "libhccl.so")
    rt = open_runtime(0)
    try:
        with pytest.raises(acl.AclUnavailable, match="in use by 1 open runtime"):
            acl.load(str(other))
    finally:
        rt.close()
    with pytest.raises(acl.AclUnavailable, match="has no symbol aclInit"):
        acl.load(str(other))
    acl.load(str(fake.path))  # the table was kept
    assert acl.device_count() == 1


# -- data through the cache manager, both faces ---------------------------------------------
@pytest.fixture
async def face(fake: FakeAcl, face_kind: str) -> AsyncIterator[Face]:
    """An engine on the fake ACL runtime with 64 MiB device and host pools."""
    f = Face(face_kind)
    await f.init(pooled())
    try:
        assert runtime_of(f).name == "acl"
        yield f
        leaked = {str(k): v for k, v in f.pool_used().items() if v}
        assert not leaked, f"pool memory leaked: {leaked}"
    finally:
        await f.finalize()


def pattern(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def fill_device(face: Face, cache: Cache, seed: int) -> list[bytes]:
    """Write random bytes to every tensor of a device cache through the runtime."""
    rt, size = runtime_of(face), cache.cache_desc.size
    data = [pattern(size, seed + i) for i in range(len(cache.tensor_addrs))]
    for addr, blob in zip(cache.tensor_addrs, data, strict=True):
        write_device(rt, addr, blob)
    return data


def device_bytes(face: Face, cache: Cache) -> list[bytes]:
    rt, size = runtime_of(face), cache.cache_desc.size
    return [read_device(rt, addr, size) for addr in cache.tensor_addrs]


def host_bytes(cache: Cache) -> list[bytes]:
    return [v.tobytes() for v in cache.as_numpy()]


async def test_device_caches_have_no_host_views(face: Face) -> None:
    cache = await face.cm.allocate_cache(CacheDesc(1, [2, 64], DataType.DT_FLOAT16))
    with pytest.raises(LLMException) as exc:
        cache.as_numpy()
    assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "accelerator memory" in str(exc.value)
    await face.cm.deallocate_cache(cache)


async def test_copy_cache_between_host_and_device(face: Face, fake: FakeAcl) -> None:
    desc = {p: CacheDesc(2, [4, 512], DataType.DT_FLOAT, p) for p in Placement}
    src = await face.cm.allocate_cache(desc[Placement.HOST])
    d1 = await face.cm.allocate_cache(desc[Placement.DEVICE])
    d2 = await face.cm.allocate_cache(desc[Placement.DEVICE])
    back = await face.cm.allocate_cache(desc[Placement.HOST])
    for i, view in enumerate(src.as_numpy()):
        view.view(np.uint8)[...] = np.frombuffer(pattern(view.nbytes, i), np.uint8).reshape(
            view.view(np.uint8).shape
        )
    expected = host_bytes(src)
    row = 512 * 4  # bytes per batch row
    for b in range(4):
        await face.call(face.cm.copy_cache, d1, src, b, b)  # host -> device
    assert device_bytes(face, d1) == expected
    assert [
        fake.read(a, len(e)) for a, e in zip(d1.tensor_addrs, expected, strict=True)
    ] == expected
    await face.call(face.cm.copy_cache, d2, d1, 1, 2)  # device -> device, one row
    await face.call(face.cm.copy_cache, back, d2, 3, 1)  # device -> host
    for got, exp in zip(host_bytes(back), expected, strict=True):
        assert got[3 * row : 4 * row] == exp[2 * row : 3 * row]
    # An unaligned slice of a row goes through the synchronous aclrtMemcpy.
    fake.clear_log()
    await face.call(face.cm.copy_cache, back, d1, 0, 0, 1, 7)
    assert "aclrtMemcpy" in fake.calls() and "aclrtMemcpyAsync" not in fake.calls()
    for got, exp in zip(host_bytes(back), expected, strict=True):
        assert got[1:8] == exp[1:8]
    for cache in (src, d1, d2, back):
        await face.cm.deallocate_cache(cache)


async def test_copy_blocks_on_device_including_overlapping_maps(face: Face) -> None:
    desc = CacheDesc(2, [6, 2048], DataType.DT_UINT8, Placement.DEVICE)
    cache = await face.cm.allocate_blocks_cache(desc)
    before = fill_device(face, cache, 10)
    block = 2048
    # 0 -> 1 and 1 -> 2 overlap: every source is read before any destination is written.
    await face.call(face.cm.copy_blocks, cache, {0: [1, 5], 1: [2]})
    for got, old in zip(device_bytes(face, cache), before, strict=True):
        blocks = [old[i * block : (i + 1) * block] for i in range(6)]
        want = [blocks[0], blocks[0], blocks[1], blocks[3], blocks[4], blocks[0]]
        assert got == b"".join(want)
    await face.cm.deallocate_blocks_cache(cache)


@pytest.mark.parametrize("host_kind", ["host-pool", "cpu-cache"])
async def test_swap_blocks_both_ways(face: Face, fake: FakeAcl, host_kind: str) -> None:
    block, nblocks = 4096, 4
    dev = await face.cm.allocate_blocks_cache(
        CacheDesc(2, [nblocks, block], DataType.DT_UINT8, Placement.DEVICE)
    )
    host_desc = CacheDesc(2, [nblocks, block], DataType.DT_UINT8, Placement.HOST)
    if host_kind == "host-pool":  # aclrtMallocHost memory: page locked
        host = await face.cm.allocate_blocks_cache(host_desc)
        views = [v.reshape(-1) for v in host.as_numpy()]
    else:  # the caller's own pageable memory
        views = [np.zeros(nblocks * block, np.uint8) for _ in range(2)]
        host = Cache.create_cpu_cache(host_desc, [v.ctypes.data for v in views])
    data = [pattern(nblocks * block, 20 + i) for i in range(2)]
    for view, blob in zip(views, data, strict=True):
        view[...] = np.frombuffer(blob, np.uint8)
    fake.clear_log()
    await face.call(face.cm.swap_blocks, host, dev, {0: 2, 3: 0})  # host -> device
    assert ("aclrtMemcpyAsync" in fake.calls()) == (host_kind == "host-pool")
    for got, blob in zip(device_bytes(face, dev), data, strict=True):
        assert got[2 * block : 3 * block] == blob[:block]
        assert got[:block] == blob[3 * block :]
    await face.call(face.cm.swap_blocks, dev, host, {2: 1})  # device -> host
    for view, blob in zip(views, data, strict=True):
        assert view[block : 2 * block].tobytes() == blob[:block]
    del views
    await face.cm.deallocate_blocks_cache(dev)
    if host_kind == "host-pool":
        await face.cm.deallocate_blocks_cache(host)


async def test_large_copies_from_worker_threads(face: Face, fake: FakeAcl) -> None:
    """Batches over 1 MiB run on a worker thread of the async face: the context follows."""
    desc = CacheDesc(1, [4, 2 << 20], DataType.DT_UINT8, Placement.DEVICE)
    a = await face.cm.allocate_cache(desc)
    b = await face.cm.allocate_cache(desc)
    data = fill_device(face, a, 30)
    for row in range(4):
        await face.call(face.cm.copy_cache, b, a, row, row)
    assert device_bytes(face, b) == data
    await face.cm.deallocate_cache(a)
    await face.cm.deallocate_cache(b)


def test_pool_config_json_reaches_acl(fake: FakeAcl) -> None:
    dd = LLMDataDist(LLMRole.DECODER, 7)
    options = make_options(device_pool=json.dumps({"memory_size": 8 * MiB}))
    dd.init(options)
    try:
        assert f"aclrtMalloc size={8 * MiB} policy=0 -> 0" in fake.lines()
        assert "aclrtMallocHost" not in fake.calls()  # no host pool configured
    finally:
        dd.finalize()


# -- zero_on_alloc ---------------------------------------------------------------------------
async def test_zero_on_alloc_sets_device_memory_with_acl_memset(
    fake: FakeAcl, face_kind: str
) -> None:
    face = Face(face_kind)
    options = pooled()
    options[OPTION_ZERO_ON_ALLOC] = "1"
    await face.init(options)
    try:
        desc = {p: CacheDesc(2, [4, 4096], DataType.DT_UINT8, p) for p in Placement}
        old = await face.cm.allocate_cache(desc[Placement.DEVICE])
        fill_device(face, old, 7)
        old_host = await face.cm.allocate_cache(desc[Placement.HOST])
        for view in old_host.as_numpy():
            view[...] = 0xAB
        await face.cm.deallocate_cache(old)
        await face.cm.deallocate_cache(old_host)
        fake.clear_log()
        new = await face.cm.allocate_cache(desc[Placement.DEVICE])
        new_host = await face.cm.allocate_cache(desc[Placement.HOST])
        assert device_bytes(face, new) == [bytes(4 * 4096)] * 2
        assert host_bytes(new_host) == [bytes(4 * 4096)] * 2
        # One aclrtMemset for the device cache; host pool memory is set by the CPU.
        assert fake.calls().count("aclrtMemset") == 1
        await face.cm.deallocate_cache(new)
        await face.cm.deallocate_cache(new_host)
    finally:
        await face.finalize()


def test_zero_device_without_acl_memset_copies_zeros(
    fake: FakeAcl, monkeypatch: pytest.MonkeyPatch
) -> None:
    variant = build("fake_ascendcl.c", "libascendcl.so", ["FAKE_ACL_NO_MEMSET"])
    monkeypatch.setenv("AIO_DATADIST_ASCENDCL", str(variant))
    no_memset = FakeAcl(variant, fake.log)
    rt = open_runtime(0)
    try:
        nbytes = ZERO_CHUNK_BYTES + 4096  # two chunks through the pinned buffer
        dev = rt.alloc_device(nbytes)
        no_memset.write(dev, b"\xab" * nbytes)
        no_memset.clear_log()
        rt.zero_device(dev + 1, nbytes - 2)
        assert no_memset.read(dev, nbytes) == b"\xab" + bytes(nbytes - 2) + b"\xab"
        calls = no_memset.calls()
        assert "aclrtMemset" not in calls and "aclrtMallocHost" in calls
        rt.free_device(dev, nbytes)
    finally:
        rt.close()
    no_memset.assert_released()


def test_finalize_frees_the_pools_memory_while_the_engines_objects_live_on(fake: FakeAcl) -> None:
    """The engine's own objects may outlive ``finalize`` in reference cycles (a closed link
    and the server it served for, say) until the collector runs; the pools' memory must not
    wait for that: it is freed in ``finalize``, and the device then reset."""
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    dd.init(pooled())
    cm = dd.cache_manager
    cache = cm.allocate_cache(CacheDesc(2, [4, 256], DataType.DT_FLOAT16, Placement.DEVICE))
    cm.deallocate_cache(cache)
    del cache
    cycle: list[object] = [cm]
    cycle.append(cycle)  # the cache manager, and through it the engine's caches, in a cycle
    gc.disable()
    try:
        dd.finalize()
        assert (fake.count("device"), fake.count("host")) == (0, 0)
        assert fake.count("refs:0") == 0
    finally:
        gc.enable()
    del cycle
