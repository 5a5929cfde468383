"""Region boards: an engine's caches published to same-host peers for one-sided access.

An engine on a host with same-host peers publishes the layout of every host-readable cache
it holds (cache id, blocks key, tensor addresses, block size and count) on a *board*: a
small memory file (``memfd``) it rewrites after every registry change. A peer on the same
host receives the board's descriptor when it proves itself (``_transport.samehost``), maps
it read-only and resolves its requests against it locally,
then moves the bytes with ``process_vm_readv``/``process_vm_writev``, or, for a cache in
shared host memory (a sealed memory file, ``DeviceRuntime.host_share``), maps that memory once
and copies with memcpy: the serving engine takes no part in the transfer, and a peer never
touches an address outside the board.

Board layout (little endian): ``u32 magic, u32 layout, u64 seq, u64 nbytes, u32 crc32``,
then ``nbytes`` of table. The writer makes ``seq`` odd, writes the table, then makes it
even again; a reader takes a snapshot only when ``seq`` is even and unchanged across the
read and the CRC matches, so it never uses a torn table. Table entries:
``u64 cache_id, i64 blocks_model_id (-1: none), u64 row_bytes, u64 num_rows,
u64 tensor_bytes, u32 num_tensors, u32 token_len, i64 arena_fd, u64 arena_ino,
u64 arena_base, u64 arena_bytes``, then the tensor addresses (``u64`` each), then
``token_len`` bytes of the device runtime's sharing token: empty for host memory (read with
``process_vm_readv``); for device memory, what the peer's runtime maps with ``open_shared``
to reach the span from the lowest tensor address to the end of the highest tensor (device
caches the runtime cannot share are not published). ``arena_fd`` is -1, or, for host memory
in a shared arena, the descriptor number under which the writer holds the arena's memory
file open, with the file's inode and where and how big the arena is in the writer: the
entry's span lies inside it.

A board comes from another process, so a reader trusts nothing in it: it maps only a memfd
sealed against shrinking (a file shrunk under a mapping kills its reader with ``SIGBUS``),
and refuses a table whose entries run past its end or whose rows do not fit their tensors.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import mmap
import os
import stat
import struct
import threading
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from aio_datadist._engine.access import Access, Target, access_rows
from aio_datadist._memory.rows import pair_rows
from aio_datadist._native.api import BlockLayout
from aio_datadist._runtime.base import HostShare
from aio_datadist._transport.base import Iov, RequestKind
from aio_datadist.status import LLMStatusCode, ParamInvalidError

__all__ = (
    "BOARD_BYTES",
    "ONE_SIDED_TARGETS",
    "BoardArena",
    "BoardEntry",
    "RegionBoard",
    "RegionView",
    "RemoteRegions",
    "paired",
    "resolve",
)

#: Targets a peer's board can resolve without the peer.
ONE_SIDED_TARGETS = frozenset({Target.BLOCKS_KEY, Target.CACHE_INDEX, Target.ADDRESSES})

#: Size of a board file (sparse: only the pages a table uses are ever committed).
BOARD_BYTES = 16 << 20
_MAGIC = 0x41494F52  # "AIOR"
#: The magic of a board its writer withdrew (the engine finalized: its memory goes next).
_WITHDRAWN = 0x41494F57  # "AIOW"
_LAYOUT = 3
_HEAD = struct.Struct("<IIQQI")
_SEQ = struct.Struct("<Q")
_SEQ_AT = 8
_ENTRY = struct.Struct("<QqQQQIIqQQQ")
#: Largest sharing token a table may carry.
MAX_TOKEN = 256
_READ_TRIES = 8
_ADDR_LIMIT = 1 << 64
_FD_MAX = (1 << 31) - 1
#: Seals a board carries, so no one can shrink it under a reader's mapping (SIGBUS).
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


#: An arena on a board: the writer's :class:`HostShare` (its descriptor number of the
#: memory file, the file's inode, and the arena's start and size in the writer).
BoardArena = HostShare
_NO_ARENA = BoardArena(-1, 0, 0, 0)


@dataclass(frozen=True, slots=True)
class BoardEntry:
    """One published cache."""

    cache_id: int
    blocks_model_id: int  # -1 when the cache has no blocks key
    row_bytes: int
    num_rows: int
    tensor_bytes: int
    addrs: tuple[int, ...]
    #: The device runtime's sharing token; empty for host memory.
    token: bytes = b""
    #: The shared host arena holding the entry's memory; None when it is private.
    arena: BoardArena | None = None

    @property
    def span(self) -> tuple[int, int]:
        """``(start, nbytes)`` from the lowest tensor to the end of the highest."""
        low = min(self.addrs)
        return low, max(self.addrs) + self.tensor_bytes - low


def encode_entries(entries: Iterable[BoardEntry]) -> bytes:
    """The table bytes of ``entries``."""
    parts: list[bytes] = []
    for e in entries:
        arena = e.arena or _NO_ARENA
        parts.append(
            _ENTRY.pack(
                e.cache_id,
                e.blocks_model_id,
                e.row_bytes,
                e.num_rows,
                e.tensor_bytes,
                len(e.addrs),
                len(e.token),
                arena.fd,
                arena.ino,
                arena.base,
                arena.nbytes,
            )
        )
        parts.append(struct.pack(f"<{len(e.addrs)}Q", *e.addrs))
        parts.append(e.token)
    return b"".join(parts)


def _check_entry(entry: BoardEntry) -> None:
    """Refuse an entry whose rows would not lie inside its own tensors."""
    if entry.row_bytes * entry.num_rows > entry.tensor_bytes:
        raise ValueError(
            f"board entry of cache {entry.cache_id}: {entry.num_rows} rows of "
            f"{entry.row_bytes} bytes exceed tensors of {entry.tensor_bytes} bytes"
        )
    if any(addr + entry.tensor_bytes > _ADDR_LIMIT for addr in entry.addrs):
        raise ValueError(f"board entry of cache {entry.cache_id} wraps around the address space")
    arena = entry.arena
    if arena is not None:
        low, nbytes = entry.span if entry.addrs else (arena.base, 0)
        if (
            entry.token
            or arena.fd > _FD_MAX
            or arena.base + arena.nbytes > _ADDR_LIMIT
            or not arena.base <= low <= low + nbytes <= arena.base + arena.nbytes
        ):
            raise ValueError(f"board entry of cache {entry.cache_id} has a malformed arena")


class RemoteRegions:
    """A decoded board: lookups by cache id, blocks key and address."""

    def __init__(self, seq: int, entries: list[BoardEntry]) -> None:
        self.seq = seq
        self.by_id = {e.cache_id: e for e in entries}
        self.by_model = {e.blocks_model_id: e for e in entries if e.blocks_model_id >= 0}
        # Sorted by bounds only: entries never compare (two may name the same memory).
        spans = sorted(
            ((a, a + e.tensor_bytes, e) for e in entries for a in e.addrs), key=lambda s: s[:2]
        )
        self._starts = [s for s, _, _ in spans]
        self._spans = spans
        self._layouts: dict[tuple[int, int], BlockLayout] = {}

    def layout(self, entry: BoardEntry, shift: int = 0) -> BlockLayout:
        """The blocks of ``entry`` (one of this board's) for native code; ``shift``: what
        to add to its addresses (where the peer's memory is mapped here)."""
        key = (entry.cache_id, shift)
        layout = self._layouts.get(key)
        if layout is None:
            addrs = tuple(a + shift for a in entry.addrs) if shift else entry.addrs
            layout = BlockLayout(addrs, entry.row_bytes, entry.num_rows)
            self._layouts[key] = layout
        return layout

    @classmethod
    def decode(cls, seq: int, table: bytes) -> RemoteRegions:
        """Parse a table; raises ``ValueError`` (or ``struct.error``) when malformed."""
        entries: list[BoardEntry] = []
        at = 0
        while at < len(table):
            (
                cache_id,
                model_id,
                row_bytes,
                num_rows,
                tensor_bytes,
                n,
                token_len,
                arena_fd,
                *arena_rest,
            ) = _ENTRY.unpack_from(table, at)
            at += _ENTRY.size
            if at + 8 * n > len(table):
                raise ValueError(f"board entry of cache {cache_id} names {n} tensors past the end")
            addrs = struct.unpack_from(f"<{n}Q", table, at)
            at += 8 * n
            if token_len > MAX_TOKEN or at + token_len > len(table) or (token_len and not n):
                raise ValueError(f"board entry of cache {cache_id} has a malformed sharing token")
            token = bytes(table[at : at + token_len])
            at += token_len
            arena = BoardArena(arena_fd, *arena_rest) if arena_fd >= 0 else None
            entry = BoardEntry(
                cache_id, model_id, row_bytes, num_rows, tensor_bytes, addrs, token, arena
            )
            _check_entry(entry)
            entries.append(entry)
        return cls(seq, entries)

    def holder(self, addr: int, nbytes: int) -> BoardEntry | None:
        """The entry one of whose tensors holds ``[addr, addr + nbytes)``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        start, end, entry = self._spans[i]
        return entry if start <= addr and addr + nbytes <= end else None


class RegionBoard:
    """The writer: this engine's board, rewritten by :meth:`publish`."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("aio-datadist-regions", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, BOARD_BYTES)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)
            self._map = mmap.mmap(self.fd, BOARD_BYTES)
        except BaseException:
            os.close(self.fd)
            raise
        self._lock = threading.Lock()
        self._seq = 0
        self.overflowed = False
        self._write(b"")

    def publish(self, entries: Iterable[BoardEntry]) -> None:
        """Replace the table with ``entries``; a table too big for the board leaves it empty
        (peers then use the two-sided path) and sets :attr:`overflowed`."""
        table = encode_entries(entries)
        with self._lock:
            if self._map.closed:
                return
            self.overflowed = _HEAD.size + len(table) > BOARD_BYTES
            self._write(b"" if self.overflowed else table)

    def _write(self, table: bytes, magic: int = _MAGIC) -> None:
        m = self._map
        struct.pack_into("<Q", m, _SEQ_AT, self._seq + 1)  # odd: being written
        m[_HEAD.size : _HEAD.size + len(table)] = table
        self._seq += 2
        _HEAD.pack_into(m, 0, magic, _LAYOUT, self._seq, len(table), zlib.crc32(table))

    def close(self) -> None:
        """Withdraw the table and close the board: peers' mappings stay valid until they drop
        them, and show the board withdrawn (:meth:`RegionView.withdrawn`). Close it before the
        memory it showed goes, so that a peer's copy that finds that memory gone learns why."""
        with self._lock:
            if not self._map.closed:
                self._write(b"", magic=_WITHDRAWN)
                self._map.close()
                os.close(self.fd)


def _seals(fd: int) -> int:
    try:
        return int(fcntl.fcntl(fd, fcntl.F_GET_SEALS))
    except OSError:  # not a memfd (or a file system without seals)
        return 0


class RegionView:
    """The reader: a same-host peer's board, mapped read-only from the descriptor the peer
    passed (``samehost``: never a path a peer names); the descriptor stays the caller's.

    :raises OSError: it is not a sealed region board.
    """

    def __init__(self, fd: int) -> None:
        # Only a sealed memfd is safe to map: reading a page a shrunken file no longer has
        # would kill this process with SIGBUS (and a pipe or socket is no board at all).
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < _HEAD.size:
            raise OSError("the peer's descriptor is not a region board")
        if _seals(fd) & _SEALS != _SEALS:
            raise OSError("the peer's descriptor is not a region board sealed against shrinking")
        self._map = mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ)
        self._lock = threading.Lock()
        self._regions: RemoteRegions | None = None

    def seq(self) -> int:
        """The board's current sequence number (odd while the writer is busy); -1 once closed.
        One read of the counter, without the lock."""
        try:
            seq: int = _SEQ.unpack_from(self._map, _SEQ_AT)[0]
        except ValueError:  # closed (by another thread meanwhile)
            return -1
        return seq

    def withdrawn(self) -> bool:
        """Whether the writer withdrew the board (its engine finalized), or this view closed."""
        try:
            magic: int = _HEAD.unpack_from(self._map, 0)[0]
        except ValueError:  # closed
            return True
        return magic == _WITHDRAWN

    def regions(self) -> RemoteRegions | None:
        """The current table, or None when no consistent snapshot could be read (or closed)."""
        cached = self._regions  # the usual case: the board did not change since last read
        if cached is not None and cached.seq == self.seq():
            return cached
        with self._lock:
            if self._map.closed:
                return None
            cached = self._regions
            if cached is not None and cached.seq == self.seq():
                return cached
            for _ in range(_READ_TRIES):
                magic, layout, seq, nbytes, crc = _HEAD.unpack_from(self._map, 0)
                if magic != _MAGIC or layout != _LAYOUT:
                    return None
                if seq & 1 or _HEAD.size + nbytes > len(self._map):
                    continue
                table = self._map[_HEAD.size : _HEAD.size + nbytes]
                if self.seq() != seq or zlib.crc32(table) != crc:
                    continue
                try:
                    self._regions = RemoteRegions.decode(seq, table)
                except (ValueError, struct.error):
                    return None
                return self._regions
            return None

    def close(self) -> None:
        """Drop the mapping."""
        with self._lock, contextlib.suppress(BufferError):
            self._map.close()


def resolve(regions: RemoteRegions, access: Access) -> tuple[list[BoardEntry], Iov] | None:
    """(the peer's entries used, its rows) for ``access`` against a peer's published
    ``regions``, checked as its serving side checks a request; None when they do not show
    the memory (the peer then answers the request itself, with its documented refusal).

    :raises LLMException: ``LLM_PARAM_INVALID`` when a segment is outside the cache.
    """
    if access.target is Target.ADDRESSES:
        rows = access.rows
        if not len(rows):
            return None
        used: dict[int, BoardEntry] = {}
        for addr, nbytes in rows.tolist():
            holder = regions.holder(addr, nbytes)
            if holder is None:
                return None  # the peer answers with the documented refusal
            used[holder.cache_id] = holder
        return list(used.values()), np.ascontiguousarray(rows, dtype=np.uint64)
    if access.target is Target.BLOCKS_KEY:
        entry, row = regions.by_model.get(access.ident), 0
    elif access.target is Target.CACHE_INDEX:
        entry, row = regions.by_id.get(access.ident), access.row
    else:
        return None
    if entry is None:
        return None
    return [entry], access_rows(entry.addrs, entry.row_bytes, entry.num_rows, access, row)


def paired(kind: RequestKind, local: Iov, remote: Iov) -> np.ndarray:
    """Copy ops from ``remote`` into ``local`` (pull) or back (push).

    :raises LLMException: ``LLM_PARAM_INVALID`` when the two sides differ in size.
    """
    try:
        return pair_rows(local, remote) if kind is RequestKind.PULL else pair_rows(remote, local)
    except ValueError as exc:
        raise ParamInvalidError(
            f"the request does not match the peer's cache: {exc}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from None
