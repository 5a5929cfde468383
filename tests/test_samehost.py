"""Same-host one-sided access: the region board, the handshake record, and the fallback."""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import os
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist import CacheDesc, DataType, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from aio_datadist._engine.regions import (
    BOARD_BYTES,
    BoardArena,
    BoardEntry,
    RegionBoard,
    RegionView,
    RemoteRegions,
    encode_entries,
)
from aio_datadist._memory.staging import Staging
from aio_datadist._options import engine_options
from aio_datadist._routes.samehost import memory as onesided
from aio_datadist._runtime import HostRuntime
from aio_datadist._runtime import host as host_runtime
from aio_datadist._transport._wire import WireError
from aio_datadist._transport.samehost import (
    HostPresence,
    decode_extensions,
    encode_extensions,
    local_host_key,
)

ENTRY = BoardEntry(7, 3, 4096, 8, 32768, (0x10000, 0x90000))


def test_board_round_trip_through_a_second_mapping() -> None:
    board = RegionBoard()
    try:
        view = RegionView(board.fd)
        first = view.regions()
        assert first is not None and first.by_id == {}
        board.publish([ENTRY, BoardEntry(8, -1, 64, 2, 128, (0x200000,))])
        regions = view.regions()
        assert regions is not None and regions.seq > first.seq
        assert regions.by_id[7] == ENTRY and regions.by_model == {3: ENTRY}
        assert regions.holder(0x90000 + 32768 - 16, 16) == ENTRY
        assert regions.holder(0x90000 + 32768 - 16, 17) is None  # runs past the tensor
        assert regions.holder(0x100, 1) is None
        assert view.regions() is regions  # unchanged board: the cached snapshot
        board.publish([])
        assert view.regions().by_id == {}  # type: ignore[union-attr]
        view.close()
        assert view.regions() is None and view.seq() == -1
    finally:
        board.close()


def test_a_torn_or_foreign_board_is_never_used() -> None:
    board = RegionBoard()
    try:
        board.publish([ENTRY])
        view = RegionView(board.fd)
        # the writer is mid-update (odd sequence number): no snapshot
        seq = view.seq()
        struct.pack_into("<Q", board._map, 8, seq + 1)
        assert view.regions() is None
        struct.pack_into("<Q", board._map, 8, seq + 2)  # even, but the CRC no longer matches
        board._map[40] ^= 0xFF
        assert view.regions() is None
        board.publish([ENTRY])
        assert view.regions() is not None
        view.close()
    finally:
        board.close()


def test_an_oversized_table_empties_the_board() -> None:
    board = RegionBoard()
    try:
        many = BoardEntry(1, -1, 8, 1, 8, tuple(range(8, 8 * (BOARD_BYTES // 8), 8)))
        board.publish([many])
        assert board.overflowed
        regions = RegionView(board.fd).regions()
        assert regions is not None and regions.by_id == {}
    finally:
        board.close()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_hostile_tables_fail_cleanly(table: bytes) -> None:
    try:
        regions = RemoteRegions.decode(2, table)
    except (ValueError, struct.error):
        return
    # whatever parsed is exactly what the bytes said
    assert sum(len(e.addrs) for e in regions.by_id.values()) <= len(table) // 8


def test_presence_record_round_trip_and_limits() -> None:
    presence = HostPresence(b"\x01" * 16, 4026531836, b"\x02" * 16, b"\x03" * 16, board_fd=9)
    blob = encode_extensions(presence)
    assert decode_extensions(blob) == presence  # (the board descriptor never travels)
    assert decode_extensions(blob).board_fd == -1
    assert decode_extensions(b"") is None and encode_extensions(None) == b""
    # unknown records are skipped (the retired type 1 among them); broken ones refused
    assert decode_extensions(struct.pack("<HH", 9, 3) + b"abc" + blob) == presence
    old = struct.pack("<HH", 1, 32) + bytes(16) + struct.pack("<QII", 1, os.getpid(), 3)
    assert decode_extensions(old) is None
    with pytest.raises(WireError):
        decode_extensions(blob[:-1])
    with pytest.raises(WireError):
        decode_extensions(struct.pack("<HH", 4, 4) + b"abcd")
    assert local_host_key() is not None  # Linux says which kernel and pid namespace


def test_denied_access_falls_back_to_the_link_once(monkeypatch: pytest.MonkeyPatch) -> None:
    board = RegionBoard()
    try:
        src = np.arange(4 * 4096, dtype=np.uint8).reshape(4, 4096)
        board.publish([BoardEntry(1, 5, 4096, 4, src.nbytes, (int(src.ctypes.data),))])
        logged: list[str] = []

        class Log:
            def info(self, event: str, **_: object) -> None:
                logged.append(event)

            warning = info

        view = RegionView(board.fd)
        staging = Staging(HostRuntime(0))
        peer = onesided.PeerMemory(os.getpid(), view, staging, Log())  # type: ignore[arg-type]
        access = _blocks_access(4096, [2])
        dst = np.zeros(4096, dtype=np.uint8)
        rows = np.array([[dst.ctypes.data, 4096]], dtype=np.uint64)
        assert peer.transfer(onesided.RequestKind.PULL, access, rows, 0)
        np.testing.assert_array_equal(dst, src[2])

        def refuse(*_: object, **__: object) -> None:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(onesided.api, "vm_copy_batch", refuse)
        assert not peer.transfer(onesided.RequestKind.PULL, access, rows, 0)
        assert not peer.enabled and logged.count("samehost.denied") == 1
        assert not peer.transfer(onesided.RequestKind.PULL, access, rows, 0)  # no retry, no log
        assert logged.count("samehost.denied") == 1
        peer.close()
    finally:
        board.close()


def test_a_copy_from_memory_a_finalized_peer_unmapped_is_a_failed_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The peer withdraws its board before its memory goes (finalize): a copy that then finds
    # the memory gone (EFAULT: the transfer was resolved against the board before) fails
    # as its link, not as an unknown failure.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)  # fmt: skip
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    nbytes = 4 * 4096
    addr = libc.mmap(None, nbytes, 3, 0x22, -1, 0)  # read|write, private|anonymous
    assert addr not in (None, ctypes.c_void_p(-1).value)
    mapped = True
    board = RegionBoard()
    view = RegionView(board.fd)
    board.publish([BoardEntry(1, 5, 4096, 4, nbytes, (addr,))])
    peer = onesided.PeerMemory(os.getpid(), view, Staging(HostRuntime(0)), _QuietLog())
    try:
        access = _blocks_access(4096, [2])
        dst = np.ones(4096, dtype=np.uint8)
        rows = np.array([[dst.ctypes.data, 4096]], dtype=np.uint64)
        assert peer.transfer(onesided.RequestKind.PULL, access, rows, 0)
        assert not dst.any()
        vm_copy_batch = onesided.api.vm_copy_batch

        def finalized_meanwhile(*args: Any, **kwargs: Any) -> Any:
            nonlocal mapped
            board.close()  # withdrawn, then the memory goes
            assert libc.munmap(addr, nbytes) == 0
            mapped = False
            return vm_copy_batch(*args, **kwargs)

        monkeypatch.setattr(onesided.api, "vm_copy_batch", finalized_meanwhile)
        with pytest.raises(LLMException, match="closed during the transfer") as info:
            peer.transfer(onesided.RequestKind.PULL, access, rows, 0)
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        assert view.withdrawn()
    finally:
        peer.close()
        board.close()
        if mapped:
            libc.munmap(addr, nbytes)


async def test_an_event_loops_large_copies_end_on_the_loop() -> None:
    # Once a copy went through, a copy of 1 MiB or more an event loop waits for runs on the
    # native copy workers: start returns at once, and the loop completes it, checking the
    # board after the bytes moved (a cache released meanwhile fails the transfer).
    board = RegionBoard()
    try:
        rows, row_bytes = 4, 1 << 20
        src = np.random.default_rng(3).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
        entry = BoardEntry(1, 5, row_bytes, rows, src.nbytes, (int(src.ctypes.data),))
        board.publish([entry])
        staging = Staging(HostRuntime(0))
        peer = onesided.PeerMemory(os.getpid(), RegionView(board.fd), staging, _QuietLog())
        access = _blocks_access(row_bytes, [3, 1])
        dst = np.zeros((2, row_bytes), dtype=np.uint8)
        local = np.array([[dst[0].ctypes.data, row_bytes], [dst[1].ctypes.data, row_bytes]])
        local = local.astype(np.uint64)
        kind = onesided.RequestKind.PULL
        first = peer.transfer(kind, access, local, 0)
        assert first is not None and first.done() and peer.proven  # in the caller
        dst[...] = 0
        started = peer.transfer(kind, access, local, 0)
        assert started is not None and not started.done()  # the loop completes it
        await asyncio.wait_for(asyncio.wrap_future(started.future), 10)
        np.testing.assert_array_equal(dst, src[[3, 1]])
        # small copies never leave the caller
        small = np.array([[dst[0].ctypes.data, 4096]], dtype=np.uint64)
        tiny = _blocks_access(4096, [0])
        done = peer.transfer(kind, tiny, small, 0)
        assert done is not None and done.done()
        # the cache released while the copy ran: the transfer fails as such
        started = peer.transfer(kind, access, local, 0)
        assert started is not None
        board.publish([])
        with pytest.raises(onesided.KvCacheNotExistError):
            await asyncio.wait_for(asyncio.wrap_future(started.future), 10)
        peer.close()
    finally:
        board.close()


async def test_a_blocking_wait_in_the_loops_thread_completes_its_copy_itself() -> None:
    # A blocking call made inside a loop's callback holds the loop, which cannot complete
    # the copy it started in the background: the blocking wait does, in the loop's thread.
    board = RegionBoard()
    try:
        rows, row_bytes = 2, 1 << 20
        src = np.random.default_rng(4).integers(0, 256, (rows, row_bytes), dtype=np.uint8)
        board.publish([BoardEntry(1, 5, row_bytes, rows, src.nbytes, (int(src.ctypes.data),))])
        staging = Staging(HostRuntime(0))
        peer = onesided.PeerMemory(os.getpid(), RegionView(board.fd), staging, _QuietLog())
        peer.proven = True  # as after a first copy went through
        dst = np.zeros((2, row_bytes), dtype=np.uint8)
        local = np.array([[dst[0].ctypes.data, row_bytes], [dst[1].ctypes.data, row_bytes]])
        fds = len(os.listdir("/proc/self/fd"))
        started = peer.transfer(
            onesided.RequestKind.PULL, _blocks_access(row_bytes, [1, 0]), local.astype(np.uint64), 0
        )
        assert started is not None and not started.done()  # on the copy workers
        assert len(os.listdir("/proc/self/fd")) == fds + 1  # the loop's signal
        started.wait()  # the loop is held here: no await
        np.testing.assert_array_equal(dst, src[[1, 0]])
        assert len(os.listdir("/proc/self/fd")) == fds  # the signal given up
        await asyncio.sleep(0)  # the loop, let go, has nothing left to complete
        peer.close()
    finally:
        board.close()


async def test_a_loop_that_cannot_watch_a_descriptor_copies_in_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    board = RegionBoard()
    try:
        src = np.arange(2 << 20, dtype=np.uint32).view(np.uint8)[: 2 << 20].reshape(2, 1 << 20)
        board.publish([BoardEntry(1, 5, 1 << 20, 2, src.nbytes, (int(src.ctypes.data),))])
        staging = Staging(HostRuntime(0))
        peer = onesided.PeerMemory(os.getpid(), RegionView(board.fd), staging, _QuietLog())
        peer.proven = True  # as after a first copy went through

        def cannot(*_: object) -> None:
            raise NotImplementedError

        monkeypatch.setattr(asyncio.get_running_loop(), "add_reader", cannot)
        dst = np.zeros((2, 1 << 20), dtype=np.uint8)
        local = np.array([[dst[0].ctypes.data, 1 << 20], [dst[1].ctypes.data, 1 << 20]])
        for _ in range(2):  # the second call knows the loop already
            dst[...] = 0
            done = peer.transfer(
                onesided.RequestKind.PULL,
                _blocks_access(1 << 20, [1, 0]),
                local.astype(np.uint64),
                0,
            )
            assert done is not None and done.done()
            np.testing.assert_array_equal(dst, src[[1, 0]])
        peer.close()
    finally:
        board.close()


def _blocks_access(seg: int, blocks: list[int]) -> onesided.Access:
    """An access to ``seg`` bytes of ``blocks`` of the one tensor of blocks cache 5."""
    return onesided.Access(
        onesided.Target.BLOCKS_KEY,
        ident=5,
        tensor_count=1,
        seg_bytes=seg,
        blocks=np.array(blocks, dtype=np.uint64),
    )


class _QuietLog:
    def info(self, event: str, **_: object) -> None:
        pass

    warning = info


def test_a_board_cannot_shrink_under_its_readers() -> None:
    board = RegionBoard()
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(board.fd, 0)  # a reader's mapping would fault (SIGBUS)
    finally:
        board.close()


def test_an_unsealed_file_is_not_mapped() -> None:
    fd = os.memfd_create("not-a-board")
    try:
        os.ftruncate(fd, BOARD_BYTES)
        with pytest.raises(OSError, match="not a region board"):
            RegionView(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "entry",
    [
        BoardEntry(1, -1, 4096, 9, 32768, (0x10000,)),  # rows past the tensor
        BoardEntry(1, -1, 64, 1, 128, (2**64 - 64,)),  # a tensor wrapping the address space
    ],
    ids=["rows", "wrap"],
)
def test_entries_outside_their_tensors_are_refused(entry: BoardEntry) -> None:
    with pytest.raises(ValueError, match="board entry"):
        RemoteRegions.decode(2, encode_entries([entry]))


def test_a_tensor_count_past_the_table_is_refused() -> None:
    table = bytearray(encode_entries([ENTRY]))
    table[40:44] = (2**32 - 1).to_bytes(4, "little")
    with pytest.raises(ValueError, match="past the end"):
        RemoteRegions.decode(2, bytes(table))


def test_two_entries_over_the_same_memory_parse() -> None:
    # Found by tools/fuzz.py: equal spans made the sort compare entries (TypeError).
    twins = [BoardEntry(1, -1, 64, 2, 128, (0x1000,)), BoardEntry(2, -1, 64, 2, 128, (0x1000,))]
    regions = RemoteRegions.decode(2, encode_entries(twins))
    assert regions.holder(0x1000, 128) in twins


# -- caches in shared memory: mapped here, copied with memcpy --------------------------------
def _arena_maps() -> int:
    """How many mappings of shared arenas this process holds."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return sum("aio-datadist-arena" in line for line in maps)


class _Shared:
    """A blocks cache of ``rows`` rows of ``row_bytes`` in a host runtime's shared memory,
    published on a board, and a peer reading it (this process, as a same-host peer would)."""

    def __init__(self, rows: int, row_bytes: int) -> None:
        self.runtime = HostRuntime(0)
        self.runtime.share_host_memory = True
        self.nbytes = rows * row_bytes
        self.addr = self.runtime.alloc_device(self.nbytes)
        share = self.runtime.host_share(self.addr, self.nbytes)
        assert share is not None  # Linux has memory files
        self.arena = BoardArena(share.fd, share.ino, share.base, share.nbytes)
        self.src = np.ctypeslib.as_array(
            (ctypes.c_uint8 * self.nbytes).from_address(self.addr)
        ).reshape(rows, row_bytes)
        self.src[...] = np.random.default_rng(rows).integers(0, 256, self.src.shape, np.uint8)
        self.entry = BoardEntry(1, 5, row_bytes, rows, self.nbytes, (self.addr,), b"", self.arena)
        self.board = RegionBoard()
        self.board.publish([self.entry])
        self.logged: list[str] = []
        log = type("Log", (), {"info": self._log, "warning": self._log})()
        self.peer = onesided.PeerMemory(
            os.getpid(), RegionView(self.board.fd), Staging(self.runtime), log
        )

    def _log(self, event: str, **_: object) -> None:
        self.logged.append(event)

    def close(self) -> None:
        self.peer.close()
        self.board.close()
        self.runtime.free_device(self.addr, self.nbytes)


def test_a_cache_in_shared_memory_is_mapped_once_and_copied_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The kernel copy is refused for the peer's pid: only the mapping can move the bytes.
    vm_copy_batch, vm_copy_blocks = onesided.api.vm_copy_batch, onesided.api.vm_copy_blocks

    def only_here(copy: Any) -> Any:
        def guarded(pid: int, *args: Any, **kwargs: Any) -> Any:
            if pid:
                raise PermissionError(1, "Operation not permitted")
            return copy(pid, *args, **kwargs)

        return guarded

    monkeypatch.setattr(onesided.api, "vm_copy_batch", only_here(vm_copy_batch))
    monkeypatch.setattr(onesided.api, "vm_copy_blocks", only_here(vm_copy_blocks))
    before = _arena_maps()
    shared = _Shared(4, 4096)
    try:
        assert _arena_maps() == before + 1  # the owner's own mapping
        dst = np.zeros((2, 4096), dtype=np.uint8)
        rows = np.array([[dst[0].ctypes.data, 4096], [dst[1].ctypes.data, 4096]], np.uint64)
        kind = onesided.RequestKind.PULL
        for _ in range(2):
            assert shared.peer.transfer(kind, _blocks_access(4096, [3, 1]), rows, 0)
            np.testing.assert_array_equal(dst, shared.src[[3, 1]])
        assert _arena_maps() == before + 2  # mapped once, on the first copy
        # a push writes the peer's memory through the same mapping
        dst[0] = 7
        push = onesided.RequestKind.PUSH
        assert shared.peer.transfer(push, _blocks_access(4096, [2]), rows[:1], 0)
        assert (shared.src[2] == 7).all()
        # blocks to blocks, in one native call
        local = np.zeros((4, 4096), dtype=np.uint8)
        layout = onesided.api.BlockLayout((int(local.ctypes.data),), 4096, 4)
        remote = onesided.RemoteBlocks(5, 0, 1, [0, 3], 4096)
        mine = onesided.Blocks(layout, 0, 1, [1, 2], 4096)
        assert shared.peer.transfer_blocks(kind, remote, mine, 0)
        np.testing.assert_array_equal(local[[1, 2]], shared.src[[0, 3]])
        assert shared.peer.enabled and shared.logged == []
        # the board no longer names the arena: its mapping goes with the next copy's look
        shared.board.publish([])
        assert not shared.peer.transfer(kind, _blocks_access(4096, [1]), rows[:1], 0)
        assert _arena_maps() == before + 1
    finally:
        shared.close()
    assert _arena_maps() == before


async def test_a_mapped_arena_outlives_the_board_until_its_copy_ended() -> None:
    # An awaited copy of 1 MiB or more with mapped memory runs on the copy workers from the
    # first (mapping the peer's memory proved the kernel allows access); the board dropping
    # the cache meanwhile fails the transfer, and the mapping goes only once the copy ended.
    before = _arena_maps()
    shared = _Shared(4, 1 << 20)
    try:
        dst = np.zeros((2, 1 << 20), dtype=np.uint8)
        local = np.array([[dst[0].ctypes.data, 1 << 20], [dst[1].ctypes.data, 1 << 20]])
        access = _blocks_access(1 << 20, [3, 0])
        kind = onesided.RequestKind.PULL
        started = shared.peer.transfer(kind, access, local.astype(np.uint64), 0)
        assert started is not None and not started.done() and shared.peer.proven
        await asyncio.wait_for(asyncio.wrap_future(started.future), 10)
        np.testing.assert_array_equal(dst, shared.src[[3, 0]])
        started = shared.peer.transfer(kind, access, local.astype(np.uint64), 0)
        assert started is not None and not started.done()
        shared.board.publish([])
        shared.peer.transfer(kind, access, local.astype(np.uint64), 0)  # sweeps the board
        assert _arena_maps() == before + 2  # still in use
        with pytest.raises(onesided.KvCacheNotExistError):
            await asyncio.wait_for(asyncio.wrap_future(started.future), 10)
        assert _arena_maps() == before + 1
    finally:
        shared.close()


def test_an_arena_that_cannot_be_mapped_is_copied_through_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shared = _Shared(2, 4096)
    try:
        dst = np.zeros(4096, dtype=np.uint8)
        rows = np.array([[dst.ctypes.data, 4096]], dtype=np.uint64)
        kind, access = onesided.RequestKind.PULL, _blocks_access(4096, [1])
        # a descriptor number the peer reused for another file: not mapped, not given up
        wrong = dataclasses.replace(shared.arena, ino=shared.arena.ino + 1)
        shared.board.publish([dataclasses.replace(shared.entry, arena=wrong)])
        assert shared.peer.transfer(kind, access, rows, 0)
        np.testing.assert_array_equal(dst, shared.src[1])
        assert shared.peer.mapping and shared.logged == []

        def refuse(*_: object) -> int:
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(onesided.api, "host_map_peer", refuse)
        shared.board.publish([shared.entry])
        dst[...] = 0
        assert shared.peer.transfer(kind, access, rows, 0)  # through the kernel, for good
        np.testing.assert_array_equal(dst, shared.src[1])
        assert not shared.peer.mapping and shared.logged == ["samehost.unmapped"]
        assert shared.peer.transfer(kind, access, rows, 0)
        assert shared.logged == ["samehost.unmapped"]
    finally:
        shared.close()


def test_a_host_without_memory_files_allocates_private_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_memfd(_: int) -> tuple[int, int]:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(host_runtime.api, "host_alloc_shared", no_memfd)
    runtime = HostRuntime(0)
    runtime.share_host_memory = True
    addr = runtime.alloc_host(8192)
    try:
        assert runtime.host_share(addr, 8192) is None
        np.ctypeslib.as_array((ctypes.c_uint8 * 8192).from_address(addr))[:] = 1
    finally:
        runtime.free_host(addr, 8192)


@pytest.mark.parametrize(
    "arena",
    [
        BoardArena(3, 1, 0x10000, 0x1000),  # the entry runs past its arena
        BoardArena(3, 1, 0x20000, 0x10000),  # the entry starts before it
        BoardArena(3, 1, 2**64 - 4096, 8192),  # the arena wraps the address space
    ],
    ids=["past", "before", "wrap"],
)
def test_entries_outside_their_arena_are_refused(arena: BoardArena) -> None:
    entry = BoardEntry(1, -1, 4096, 2, 8192, (0x10000,), b"", arena)
    with pytest.raises(ValueError, match="malformed arena"):
        RemoteRegions.decode(2, encode_entries([entry]))
    inside = dataclasses.replace(entry, arena=BoardArena(3, 1, 0x10000, 8192))
    assert RemoteRegions.decode(2, encode_entries([inside])).by_id[1] == inside


def test_rows_over_two_arenas_are_each_moved_into_their_mapping() -> None:
    # Raw addresses may name caches in two arenas in one request: each row is translated
    # into its own arena's mapping.
    first, second = _Shared(2, 4096), _Shared(2, 4096)
    try:
        first.board.publish([first.entry, dataclasses.replace(second.entry, cache_id=2)])
        dst = np.zeros((2, 4096), dtype=np.uint8)
        local = np.array([[dst[0].ctypes.data, 4096], [dst[1].ctypes.data, 4096]], np.uint64)
        remote = np.array([[second.addr + 4096, 4096], [first.addr, 4096]], np.uint64)
        access = onesided.Access(onesided.Target.ADDRESSES, rows=remote)
        before = _arena_maps()
        assert first.peer.transfer(onesided.RequestKind.PULL, access, local, 0)
        assert _arena_maps() == before + 2
        np.testing.assert_array_equal(dst[0], second.src[1])
        np.testing.assert_array_equal(dst[1], first.src[0])
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(
    ("extra", "shared"),
    [
        ({}, True),  # the default: same-host transfers on, over TCP
        ({"aio.SharedPools": "0"}, False),
        ({"aio.SameHost": "0"}, False),  # no same-host peer could map them
        ({"aio.Transport": "loopback"}, False),
    ],
    ids=["default", "off", "no-same-host", "loopback"],
)
def test_pools_are_shared_only_where_a_same_host_peer_can_map_them(
    extra: dict[str, str], shared: bool
) -> None:
    options = engine_options(transport="tcp", pool_bytes=8 << 20, timeout_ms=5000)
    options.update(extra)
    gc.collect()  # (the pools of earlier engines no one holds any more are not counted)
    before = _arena_maps()
    dd = LLMDataDist(LLMRole.DECODER, 7)
    dd.init(options)
    try:
        assert _arena_maps() == before + shared
        cache = dd.cache_manager.allocate_cache(CacheDesc(1, [4, 4096], DataType.DT_UINT8))
        cache.as_numpy()[0][...] = 3  # private or shared, a cache is ordinary memory here
        assert int(cache.as_numpy()[0].sum()) == 3 * 4 * 4096
        dd.cache_manager.deallocate_cache(cache)
        del cache
    finally:
        dd.finalize()
    gc.collect()  # (views of a cache keep its pool's memory until they are gone)
    assert _arena_maps() == before


def test_a_shared_pools_switch_other_than_1_or_0_is_refused() -> None:
    options = engine_options(transport="tcp", pool_bytes=8 << 20, timeout_ms=5000)
    options["aio.SharedPools"] = "yes"
    dd = LLMDataDist(LLMRole.DECODER, 7)
    with pytest.raises(LLMException) as info:
        dd.init(options)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert "aio.SharedPools" in str(info.value)
