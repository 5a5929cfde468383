"""Pinned host buffers standing in for device rows (``aio_datadist._memory.staging``).

Runs over the CUDA runtime on the fake libcudart, whose device memory reads as scrambled
bytes from the host, so a row that skipped its device copy shows up here.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from aio_datadist import LLMException
from aio_datadist._memory.staging import Staging
from aio_datadist._runtime.cuda import CudaRuntime
from tests.acl_fake import read_device, write_device
from tests.test_runtime_cuda import Fake, fake, rng_bytes, rt  # noqa: F401 - fixtures

U64 = np.uint64


def host_bytes(iov: np.ndarray) -> bytes:
    """The bytes of host rows, in order."""
    return b"".join(ctypes.string_at(int(a), int(n)) for a, n in iov)


def test_outbound_mixes_device_and_host_rows(rt: CudaRuntime) -> None:
    staging = Staging(rt)
    dev = rt.alloc_device(1 << 16)
    host = np.frombuffer(bytearray(rng_bytes(300, 2)), np.uint8)
    write_device(rt, dev, rng_bytes(1 << 16, 1))
    iov = np.array([[dev + 100, 50], [host.ctypes.data, 300], [dev, 7]], dtype=U64)
    staged = staging.outbound(iov, np.array([True, False, True]))
    assert int(staged.iov[1, 0]) == host.ctypes.data  # host rows stay where they are
    expected = read_device(rt, dev + 100, 50) + host.tobytes() + read_device(rt, dev, 7)
    assert host_bytes(staged.iov) == expected
    staged.finish(True)
    staged.finish(True)  # idempotent
    staging.close()
    rt.free_device(dev, 1 << 16)


def test_inbound_reaches_the_device_only_when_every_byte_arrived(rt: CudaRuntime) -> None:
    staging = Staging(rt)
    dev = rt.alloc_device(4096)
    write_device(rt, dev, bytes(4096))
    iov = np.array([[dev + 1024, 512], [dev, 256]], dtype=U64)
    for ok in (False, True):
        staged = staging.inbound(iov)
        assert staged.iov.shape == (1, 2) and int(staged.iov[0, 1]) == 768
        ctypes.memset(int(staged.iov[0, 0]), 0xAB, 768)
        staged.finish(ok)
        landed = read_device(rt, dev, 4096)
        if ok:
            assert landed[1024:1536] == b"\xab" * 512 and landed[:256] == b"\xab" * 256
            assert landed[256:1024] == bytes(768)
        else:
            assert landed == bytes(4096)  # a failed transfer leaves the device untouched
    staging.close()
    rt.free_device(dev, 4096)


def test_buffers_are_reused_up_to_the_keep_limit(rt: CudaRuntime, fake: Fake) -> None:
    staging = Staging(rt, keep_bytes=2 << 20)
    first = staging.take(1000)
    assert first[1] == 1 << 20
    staging.give_back(*first)
    again = staging.take(5000)
    assert again == first  # same size class: the kept buffer
    big = staging.take(3 << 20)
    assert big[1] == 4 << 20
    allocs = fake.count("cudaHostAlloc")
    staging.give_back(*again)
    staging.give_back(*big)  # past the keep limit: freed at once
    frees = fake.count("cudaFreeHost")
    staging.close()
    assert fake.count("cudaFreeHost") == frees + 1
    assert fake.count("cudaHostAlloc") == allocs
    late = staging.take(10)
    staging.give_back(*late)  # after close: freed at once
    assert fake.count("cudaFreeHost") == frees + 2


def test_a_failed_device_copy_returns_the_buffer(rt: CudaRuntime, fake: Fake) -> None:
    staging = Staging(rt, keep_bytes=0)
    bogus = np.array([[0x10, 64]], dtype=U64)  # not device memory: the runtime refuses
    before = fake.count("cudaFreeHost")
    with pytest.raises(LLMException):
        staging.outbound(bogus)
    assert fake.count("cudaFreeHost") == before + 1
    staging.close()
