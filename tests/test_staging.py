"""Pinned host buffers standing in for device rows (``aio_datadist._memory.staging``).

Runs over the CUDA runtime on the fake libcudart, whose device memory reads as scrambled
bytes from the host, so a row that skipped its device copy shows up here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest

from aio_datadist import LLMException
from aio_datadist._memory.staging import Staging
from aio_datadist._runtime.cuda import CudaRuntime
from tests.acl_fake import read_device, write_device
from tests.test_runtime_cuda import Fake, fake, rng_bytes, rt, small_ring  # noqa: F401 - fixtures

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


@pytest.fixture(params=["native ring", "chunk by chunk"])
def streaming(request: pytest.FixtureRequest, fake: Fake) -> Iterator[Staging]:
    """Staging that streams through the runtime's native ring, or chunk by chunk (the path
    of runtimes without one); 4 KiB chunks either way."""
    runtime = small_ring(fake, chunk=4096, slots=2)
    if request.param == "chunk by chunk":
        runtime.stage_ring = lambda iov, kind: None  # type: ignore[method-assign,assignment,return-value]
    staging = Staging(runtime, chunk_bytes=4096)
    yield staging
    staging.close()
    runtime.close()


def _mixed_rows(staging: Staging) -> tuple[int, np.ndarray, np.ndarray, np.ndarray]:
    """A device range, a host buffer, rows over both (device rows spanning several chunks)
    and their device mask."""
    rt = staging.runtime
    dev = rt.alloc_device(1 << 16)
    host = np.frombuffer(bytearray(rng_bytes(5000, 8)), np.uint8)
    h = host.ctypes.data
    iov = np.array(
        [[dev + 3, 9000], [dev + 20000, 0], [h, 5000], [dev + 30000, 1], [dev + 40000, 7777]],
        dtype=U64,
    )
    return dev, host, iov, np.array([True, True, False, True, True])


def test_stream_out_reads_every_row_in_order(streaming: Staging) -> None:
    rt = streaming.runtime
    dev, host, iov, mask = _mixed_rows(streaming)
    data = rng_bytes(1 << 16, 9)
    write_device(rt, dev, data)
    stream = streaming.stream(iov, mask, outbound=True)
    assert stream.nbytes == 9000 + 5000 + 1 + 7777
    got, sizes, host_rows = [], [], 0
    for piece in stream.segments():  # a piece is valid until the next is taken
        got.append(host_bytes(piece))
        if int(piece[0, 0]) == host.ctypes.data:
            host_rows += 1  # host rows stay where they are
        else:
            sizes.append(int(piece[:, 1].sum()))
    assert host_rows == 1 and max(sizes) <= 4096
    expected = data[3:9003] + host.tobytes() + data[30000:30001] + data[40000:47777]
    assert b"".join(got) == expected
    rt.free_device(dev, 1 << 16)


def test_stream_in_writes_every_row_in_order(streaming: Staging) -> None:
    rt = streaming.runtime
    dev, host, iov, mask = _mixed_rows(streaming)
    write_device(rt, dev, bytes(1 << 16))
    payload = rng_bytes(9000 + 5000 + 1 + 7777, 10)
    pos = 0
    for piece in streaming.stream(iov, mask, outbound=False).segments():
        for addr, n in piece:
            ctypes.memmove(int(addr), payload[pos : pos + int(n)], int(n))
            pos += int(n)
    assert pos == len(payload)
    now = read_device(rt, dev, 1 << 16)
    assert now[3:9003] == payload[:9000]
    assert host.tobytes() == payload[9000:14000]
    assert now[30000:30001] + now[40000:47777] == payload[14000:]
    assert now[9003:30000] == bytes(30000 - 9003)


def test_stream_in_stopped_early_drops_the_piece_in_hand(streaming: Staging) -> None:
    rt = streaming.runtime
    dev = rt.alloc_device(1 << 16)
    write_device(rt, dev, bytes(1 << 16))
    pieces = streaming.stream(np.array([[dev, 3 * 4096]], U64), outbound=False).segments()
    for _ in range(2):  # taking the second piece sends the first to the device
        ((addr, n),) = next(pieces)
        ctypes.memset(int(addr), 0xEE, int(n))
    pieces.close()
    now = read_device(rt, dev, 3 * 4096)
    assert now[:4096] == b"\xee" * 4096
    assert now[4096:] == bytes(2 * 4096)
    rt.free_device(dev, 1 << 16)


def test_streaming_needs_only_a_chunk_of_pinned_memory(fake: Fake) -> None:
    runtime = small_ring(fake)
    runtime.stage_ring = lambda iov, kind: None  # type: ignore[method-assign,assignment,return-value]
    staging = Staging(runtime, chunk_bytes=1 << 20)
    dev = runtime.alloc_device(16 << 20)
    taken: list[int] = []
    take = staging.take

    def recorded(nbytes: int) -> tuple[int, int]:
        taken.append(nbytes)
        return take(nbytes)

    staging.take = recorded  # type: ignore[method-assign]
    for _ in staging.stream(np.array([[dev, 16 << 20]], U64), outbound=True).segments():
        pass
    assert taken == [1 << 20]
    staging.close()
    runtime.free_device(dev, 16 << 20)
    runtime.close()


def test_close_frees_a_buffer_given_back_just_after_it_was_called() -> None:
    """A transfer that ended gives its buffer back moments after its caller learned so:
    close waits for it, so every pinned buffer is freed when close returns (and the runtime
    can release its device then, not whenever the last buffer comes back)."""
    import threading
    import time

    from aio_datadist._runtime import HostRuntime

    class Counting(HostRuntime):
        live = 0

        def alloc_host(self, nbytes: int) -> int:
            Counting.live += 1
            return super().alloc_host(nbytes)

        def free_host(self, addr: int, nbytes: int) -> None:
            Counting.live -= 1
            super().free_host(addr, nbytes)

    staging = Staging(Counting(0))
    kept = staging.take(1 << 20)
    staging.give_back(*kept)  # kept for reuse
    out = staging.take(3 << 20)
    assert Counting.live == 2
    closing = threading.Thread(target=staging.close)
    closing.start()
    while closing.is_alive() and not staging._closed:  # close began and waits for `out`
        time.sleep(0.001)
    assert closing.is_alive() and Counting.live == 2
    staging.give_back(*out)
    closing.join(10)
    assert not closing.is_alive() and Counting.live == 0
