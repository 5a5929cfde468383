"""Same-host one-sided access: the region board, the handshake record, and the fallback."""

from __future__ import annotations

import asyncio
import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._engine import onesided
from aio_datadist._engine.regions import (
    BOARD_BYTES,
    BoardEntry,
    RegionBoard,
    RegionView,
    RemoteRegions,
    encode_entries,
)
from aio_datadist._memory.staging import Staging
from aio_datadist._runtime import HostRuntime
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
        first = peer.transfer(kind, access, local, 0, on_loop=True)
        assert first is not None and first.done() and peer.proven  # in the caller
        dst[...] = 0
        started = peer.transfer(kind, access, local, 0, on_loop=True)
        assert started is not None and not started.done()  # the loop completes it
        await asyncio.wait_for(asyncio.wrap_future(started.future), 10)
        np.testing.assert_array_equal(dst, src[[3, 1]])
        # small copies never leave the caller
        small = np.array([[dst[0].ctypes.data, 4096]], dtype=np.uint64)
        tiny = _blocks_access(4096, [0])
        done = peer.transfer(kind, tiny, small, 0, on_loop=True)
        assert done is not None and done.done()
        # the cache released while the copy ran: the transfer fails as such
        started = peer.transfer(kind, access, local, 0, on_loop=True)
        assert started is not None
        board.publish([])
        with pytest.raises(onesided.KvCacheNotExistError):
            await asyncio.wait_for(asyncio.wrap_future(started.future), 10)
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
                on_loop=True,
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
