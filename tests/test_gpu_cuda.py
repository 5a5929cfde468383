"""The CUDA runtime on a real GPU: the byte checks of test_runtime_cuda against a device,
and device blocks moved between two processes on one GPU over every route.

Skipped as a whole where no libcudart loads or it reports no device.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from aio_datadist._native.cuda import CudaLoadError
from aio_datadist._runtime.cuda import CudaRuntime, _load_library, open_runtime

try:
    _LIB = _load_library()
except CudaLoadError as exc:
    pytest.skip(f"no libcudart: {exc}", allow_module_level=True)
_COUNT, _REASON = _LIB.probe_devices()
if _COUNT == 0:
    pytest.skip(f"no CUDA device: {_REASON}", allow_module_level=True)

from aio_datadist import (  # noqa: E402
    BlocksCacheKey,
    Cache,
    CacheDesc,
    DataType,
    LLMRole,
    Placement,
)
from aio_datadist._routes.ucx import worker as ucx  # noqa: E402
from aio_datadist._runtime.base import CopyKind  # noqa: E402
from tests.conftest import Face, make_options, pool_cfg, push_blocks  # noqa: E402
from tests.peer_prompt import TENSORS, pattern  # noqa: E402
from tests.test_cross_process import Peer, link, peer_memory, ucx_route  # noqa: E402
from tests.test_runtime_cuda import _PEER, fill, read, rng_bytes, runtime_of  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
U64 = np.uint64


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[CudaRuntime]:
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "cuda")
    runtime = open_runtime(0)
    yield runtime
    runtime.close()


@pytest.fixture
async def gpu_face(monkeypatch: pytest.MonkeyPatch, face_kind: str) -> AsyncIterator[Face]:
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "cuda")
    f = Face(face_kind)
    await f.init(make_options(device_pool=pool_cfg(), host_pool=pool_cfg()))
    try:
        yield f
        leaked = {str(k): v for k, v in f.pool_used().items() if v}
        assert not leaked, f"pool memory leaked: {leaked}"
    finally:
        await f.finalize()


def test_round_trip_and_memset(gpu: CudaRuntime) -> None:
    dev = gpu.alloc_device(1 << 20)
    data = rng_bytes((1 << 20) - 7, 1)
    gpu.upload(dev + 7, data)
    assert gpu.download(dev + 7, len(data)) == data
    gpu.memset(dev, 0x5C, 4096)
    assert gpu.download(dev, 4096) == b"\x5c" * 4096
    gpu.free_device(dev, 1 << 20)


def test_copy_kernel_passes_its_self_test(gpu: CudaRuntime) -> None:
    dev = gpu.alloc_device(1 << 22)
    data = rng_bytes(1 << 21, 2)
    gpu.upload(dev, data)
    # Aligned, 4-byte and odd rows, plus one long row the kernel cuts into pieces.
    rows = [(1 << 21, 0, 65536), ((1 << 21) + 70000, 4, 1000), ((1 << 21) + 80001, 3, 777)]
    rows.append(((1 << 21) + (1 << 20), 1 << 20, 1 << 20))
    ops = np.array([(dev + d, dev + s, n) for d, s, n in rows], U64)
    gpu.copy_batch(ops, CopyKind.DEVICE_TO_DEVICE)
    if "copy_kernel" in gpu.library.features:
        assert gpu.kernel_note == "", gpu.kernel_note
        assert "copy_kernel" in gpu.features
    for d, s, n in rows:
        assert gpu.download(dev + d, n) == data[s : s + n]
    gpu.free_device(dev, 1 << 22)


@pytest.mark.parametrize("mode", ["kernel", "batch", "loop"])
def test_pinned_copies_by_kernel_batched_and_looped(gpu: CudaRuntime, mode: str) -> None:
    """16 scattered rows between pinned (mapped) host memory and the device, both ways: by
    the copy kernel (the default for this many rows), cudaMemcpyBatchAsync or a loop."""
    gpu.set_feature("copy_kernel", mode == "kernel")
    gpu.set_feature("memcpy_batch", mode == "batch")
    dev = gpu.alloc_device(1 << 20)
    host = gpu.alloc_host(1 << 20)
    data = rng_bytes(1 << 20, 3)
    ctypes.memmove(host, data, len(data))
    rows = [(i * 65536, (15 - i) * 65536, 65536 - 16 * i - (i % 3)) for i in range(16)]
    gpu.copy_batch(
        np.array([(dev + d, host + s, n) for d, s, n in rows], U64), CopyKind.HOST_TO_DEVICE
    )
    got = gpu.download(dev, 1 << 20)
    for d, s, n in rows:
        assert got[d : d + n] == data[s : s + n]
    ctypes.memset(host, 0, 1 << 20)
    gpu.copy_batch(
        np.array([(host + s, dev + d, n) for d, s, n in rows], U64), CopyKind.DEVICE_TO_HOST
    )
    back = ctypes.string_at(host, 1 << 20)
    for _, s, n in rows:
        assert back[s : s + n] == data[s : s + n] and not any(back[s + n : s + 65536])
    gpu.free_host(host, 1 << 20)
    gpu.free_device(dev, 1 << 20)


@pytest.mark.parametrize("kind", [CopyKind.HOST_TO_DEVICE, CopyKind.DEVICE_TO_HOST])
def test_staging_ring_odd_sizes(kind: CopyKind) -> None:
    runtime = CudaRuntime(0, _LIB, stage_chunk_bytes=4096, stage_slots=2)
    lengths = [1, 0, 4095, 4096, 4097, 12289, 7, 3 * 4096 + 5, 33]
    total = sum(lengths) + 64 * len(lengths)
    dev = runtime.alloc_device(total)
    host = np.zeros(total, np.uint8)
    src = np.frombuffer(rng_bytes(total, 11), np.uint8)
    rows, d_off, h_off = [], 0, total
    for n in lengths:
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
        runtime.copy_batch(ops, kind)
        device_now = np.frombuffer(runtime.download(dev, total), np.uint8)
        for d, h, n in rows:
            if kind is CopyKind.HOST_TO_DEVICE:
                assert np.array_equal(device_now[d : d + n], src[h : h + n])
            else:
                assert np.array_equal(host[h : h + n], src[d : d + n])
    finally:
        runtime.free_device(dev, total)
        runtime.close()


def test_stage_out_and_in(gpu: CudaRuntime) -> None:
    dev = gpu.alloc_device(1 << 24)
    data = rng_bytes(1 << 24, 4)
    gpu.upload(dev, data)
    iov = np.array([(dev + 1, 9 << 20), (dev + (10 << 20), 12345)], U64)
    with gpu.stage_out(iov) as chunks:
        got = b"".join(ctypes.string_at(a, n) for a, n in chunks)
    assert got == data[1 : 1 + (9 << 20)] + data[10 << 20 : (10 << 20) + 12345]
    payload = rng_bytes(len(got), 5)
    with gpu.stage_in(iov) as chunks:
        pos = 0
        for a, n in chunks:
            ctypes.memmove(a, payload[pos : pos + n], n)
            pos += n
    assert gpu.download(dev + 1, 9 << 20) + gpu.download(dev + (10 << 20), 12345) == payload
    gpu.free_device(dev, 1 << 24)


def test_ipc_round_trip(gpu: CudaRuntime) -> None:
    dev = gpu.alloc_device(1 << 21)
    data = rng_bytes(64, 12)
    gpu.upload(dev + 4096, data)
    token = gpu.ipc_handle(dev + 4096)
    out = subprocess.run(
        [sys.executable, "-c", _PEER, token.hex()],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert bytes.fromhex(out.stdout.strip()) == data
    assert gpu.download(dev + 4096, 13) == b"from the peer"
    gpu.free_device(dev, 1 << 21)


async def test_cache_manager_copies(gpu_face: Face) -> None:
    runtime = runtime_of(gpu_face)
    cm = gpu_face.cm
    shape = [16, 4096]
    dev = await cm.allocate_blocks_cache(CacheDesc(2, shape, DataType.DT_UINT8))
    before = fill(runtime, dev, 1)
    await cm.copy_blocks(dev, {0: [5, 6], 2: [7]})
    await cm.copy_blocks(dev, {8: [9], 9: [10], 10: [8]})  # a rotation, staged on the device
    for b, v in zip(before, read(runtime, dev), strict=True):
        assert np.array_equal(v[5], b[0]) and np.array_equal(v[7], b[2])
        assert np.array_equal(v[9], b[8]) and np.array_equal(v[10], b[9])
        assert np.array_equal(v[8], b[10])
    pool_host = await cm.allocate_blocks_cache(
        CacheDesc(2, shape, DataType.DT_UINT8, Placement.HOST)
    )
    buffers = [np.zeros(shape, np.uint8) for _ in range(2)]
    pageable = Cache.create_cpu_cache(
        CacheDesc(2, shape, DataType.DT_UINT8, Placement.HOST), [b.ctypes.data for b in buffers]
    )
    for host, views in ((pool_host, pool_host.as_numpy()), (pageable, buffers)):
        await cm.swap_blocks(dev, host, {5: 0, 7: 1, 15: 2})
        now = read(runtime, dev)
        for h, d in zip(views, now, strict=True):
            assert np.array_equal(h[0], d[5]) and np.array_equal(h[2], d[15])
        for h in views:
            h[3] = 99
        await cm.swap_blocks(host, dev, {3: 12})
        assert all((d[12] == 99).all() for d in read(runtime, dev))
    await cm.deallocate_blocks_cache(pool_host)
    await cm.deallocate_blocks_cache(dev)


# -- two processes on one GPU ------------------------------------------------------------------
DEVICE_PEER = ROOT / "tests" / "peer_device.py"
#: ``link``: staged through the socket; ``ipc``: the peer's memory mapped through CUDA IPC;
#: ``ucx``: UCP RMA on CUDA memory with UCX's own choice of transports (``cuda_ipc`` on one
#: GPU); ``ucx-tcp``: the same over UCX's tcp transport, device memory reached by ``cuda_copy``.
GPU_ROUTES = ["link", "ipc"] + (["ucx", "ucx-tcp"] if ucx.available() is None else [])


@pytest.mark.parametrize("route", GPU_ROUTES)
async def test_device_blocks_between_processes(
    route: str, face_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder pulls the peer's device blocks into device memory and pushes them back, over
    each route; the bytes arrive, and the route asked for is the one that moved them."""
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "cuda")
    over_ucx = route.startswith("ucx")
    ucx_cuda = over_ucx and "cuda" in ucx.ucx_info().get("memory_types", [])
    if route == "ucx-tcp":
        monkeypatch.setenv("UCX_TLS", "tcp,cuda_copy,self" if ucx_cuda else "tcp,self")
    blocks, block_bytes = 32, 64 << 10
    peer = Peer(
        blocks, block_bytes, script=DEVICE_PEER, env={"AIO_TEST_UCX": "1"} if over_ucx else None
    )
    face = Face(face_kind, LLMRole.DECODER, 2)
    try:
        await face.init(
            make_options(
                device_pool=pool_cfg(),
                host_pool=pool_cfg(),
                remote_accessible=True,
                transport="tcp",
                same_host=route == "ipc",
                ucx=over_ucx or None,
            )
        )
        await link(face, peer)
        found, memory = ucx_route(face), peer_memory(face)
        if over_ucx:
            assert found is not None and found.remote.usable and memory is None
            # device memory registers with UCX where it reaches CUDA memory, else is staged
            assert found.cuda == ucx_cuda
        elif route == "ipc":
            assert found is None and memory is not None and memory.device_sharing
        else:
            assert found is None and memory is None
        runtime = runtime_of(face)
        desc = CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.DEVICE)
        dev = await face.cm.allocate_blocks_cache(desc)
        src = [int(b) for b in np.random.default_rng(7).permutation(blocks)[:24]]
        await face.cm.pull_blocks(BlocksCacheKey(1, 0), dev, src, list(range(24)))
        expected = [pattern(t, blocks, block_bytes) for t in range(TENSORS)]
        for got, want in zip(read(runtime, dev), expected, strict=True):
            np.testing.assert_array_equal(got[:24], want[src])
        if route == "ipc":
            assert memory._mapped

        # device blocks out into the peer's device memory, then back into host memory
        await push_blocks(face, BlocksCacheKey(1, 0), dev, [0, 1, 2, 3], [28, 29, 30, 31])
        host_desc = CacheDesc(TENSORS, [blocks, block_bytes], DataType.DT_UINT8, Placement.HOST)
        host = await face.cm.allocate_blocks_cache(host_desc)
        await face.cm.pull_blocks(BlocksCacheKey(1, 0), host, [28, 29, 30, 31], [4, 5, 6, 7])
        for view, want in zip(host.as_numpy(), expected, strict=True):
            np.testing.assert_array_equal(view[4:8], want[src[:4]])
        await face.cm.deallocate_blocks_cache(host)
        await face.cm.deallocate_blocks_cache(dev)
        leaked = {str(k): v for k, v in face.pool_used().items() if v}
        assert not leaked, f"pool memory leaked: {leaked}"
    finally:
        await face.finalize()
        peer.close()
