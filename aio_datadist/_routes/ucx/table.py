"""The UCX table: what an engine offers a linked peer over UCX, as it crosses the link.

A table names the sender's UCX worker (its address), its host (boot id and pid-namespace
inode, so that a peer on the same host may let UCX use shared memory), its registrations
(``ucp_mem_map`` spans with their packed remote keys) and the caches it publishes, in the
region board's entry layout (``_engine.regions``): the requester resolves and bounds-checks
every access against those entries exactly as the same-host route does, then reaches the
bytes through the registration that holds them. Its sequence number grows with every change
(``_routes.ucx.board``). The byte layout and its limits are ``_native/wire.h``'s.

A table comes from another process, so its decoder trusts nothing: every count and length
is bounded, entries are checked as a board's are, and every published tensor must lie
inside one registration.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from aio_datadist._engine.regions import BoardEntry, RemoteRegions, encode_entries
from aio_datadist._native import wire
from aio_datadist._native.api import ucx_find
from aio_datadist._transport._wire import BodyReader, BodyWriter, WireError

__all__ = ("KeySpans", "UcxKey", "UcxTable", "decode_table", "encode_table", "host_identity")

#: Memory types of a registration by wire value, and back.
_MEMORY_BY_VALUE = {value: name.lower() for name, value in wire.UCX_MEMORY.items()}
_MEMORY_VALUE = {name: value for value, name in _MEMORY_BY_VALUE.items()}
_ADDR_LIMIT = 1 << 64


@dataclass(frozen=True, slots=True)
class UcxKey:
    """One registration of the sender: ``nbytes`` at ``addr``, reached with ``rkey``."""

    addr: int
    nbytes: int
    #: Where the memory lives: ``"host"`` or ``"cuda"``.
    memory: str
    #: The packed remote key (``ucp_rkey_pack``).
    rkey: bytes

    @property
    def end(self) -> int:
        """The first address past the registration."""
        return self.addr + self.nbytes


@dataclass(frozen=True, slots=True)
class UcxTable:
    """A decoded table."""

    seq: int
    #: The sender's UCX worker address.
    address: bytes
    #: The sender's host identity (:func:`host_identity`); empty when it has none.
    host: bytes
    keys: tuple[UcxKey, ...]
    #: The published caches, with the lookups the requester resolves accesses with.
    regions: RemoteRegions


def host_identity(key: tuple[bytes, int] | None) -> bytes:
    """The table's host field for ``samehost.local_host_key()`` (empty for None)."""
    if key is None:
        return b""
    boot, pid_ns = key
    return boot + struct.pack("<Q", pid_ns)


def encode_table(
    seq: int,
    address: bytes,
    host: bytes,
    keys: Sequence[UcxKey],
    entries: Iterable[BoardEntry],
) -> bytes:
    """The payload of a table push.

    :raises WireError: a field is over its limit.
    """
    if len(keys) > wire.UCX_MAX_KEYS:
        raise WireError(f"{len(keys)} UCX registrations exceed {wire.UCX_MAX_KEYS}")
    writer = BodyWriter().u32(wire.UCX_VERSION).u64(seq).blob(address).blob(host)
    writer.u32(len(keys))
    for key in keys:
        writer.u64(key.addr).u64(key.nbytes).u32(_MEMORY_VALUE[key.memory]).blob(key.rkey)
    writer.blob(encode_entries(entries))
    if len(writer) > wire.UCX_MAX_TABLE:
        raise WireError(f"a UCX table of {len(writer)} bytes exceeds {wire.UCX_MAX_TABLE}")
    return bytes(writer)


def decode_table(data: bytes | bytearray | memoryview) -> UcxTable:
    """Decode a table, refusing anything malformed or out of bounds.

    :raises WireError: truncated, oversized, of another version, a registration that wraps
        around or is empty, a memory type this side does not know, a malformed entry, or a
        published tensor that no registration holds.
    """
    if len(data) > wire.UCX_MAX_TABLE:
        raise WireError(f"a UCX table of {len(data)} bytes exceeds {wire.UCX_MAX_TABLE}")
    reader = BodyReader(data)
    version = reader.u32()
    if version != wire.UCX_VERSION:
        raise WireError(f"UCX table version {version}; this side speaks {wire.UCX_VERSION}")
    seq = reader.u64()
    address = reader.blob(wire.UCX_MAX_ADDRESS)
    if not address:
        raise WireError("a UCX table without a worker address")
    host = reader.blob(wire.UCX_HOST_SIZE)
    if host and len(host) != wire.UCX_HOST_SIZE:
        raise WireError(f"a UCX host identity of {len(host)} bytes")
    count = reader.u32()
    if count > wire.UCX_MAX_KEYS:
        raise WireError(f"{count} UCX registrations exceed {wire.UCX_MAX_KEYS}")
    keys = []
    for _ in range(count):
        addr, nbytes, memory = reader.u64(), reader.u64(), reader.u32()
        rkey = reader.blob(wire.UCX_MAX_RKEY)
        if not addr or not nbytes or addr + nbytes >= _ADDR_LIMIT or not rkey:
            raise WireError(f"a malformed UCX registration at 0x{addr:x} (+{nbytes})")
        name = _MEMORY_BY_VALUE.get(memory)
        if name is None:
            raise WireError(f"a UCX registration of unknown memory type {memory}")
        keys.append(UcxKey(addr, nbytes, name, rkey))
    table = reader.blob(wire.UCX_MAX_TABLE)
    reader.end()
    try:
        regions = RemoteRegions.decode(seq, table)
    except (ValueError, struct.error) as exc:
        raise WireError(f"malformed UCX table entries: {exc}") from None
    ordered = tuple(sorted(keys, key=lambda k: k.addr))
    spans = KeySpans(ordered)
    for entry in regions.by_id.values():
        addrs = np.asarray(entry.addrs, dtype=np.uint64)
        lens = np.full(len(addrs), entry.tensor_bytes, dtype=np.uint64)
        if spans.index(addrs, lens) is None:
            raise WireError(
                f"cache {entry.cache_id}: a tensor of {entry.tensor_bytes} bytes lies in no "
                "UCX registration of the table"
            )
    return UcxTable(seq, bytes(address), bytes(host), ordered, regions)


class KeySpans:
    """The registrations of a table (sorted by address), as lookups of the one that holds
    a span (registrations may overlap, as two registrations of one buffer do: the nearest
    one starting at or below a span is tried first, then up to 16 before it)."""

    def __init__(self, keys: Sequence[UcxKey]) -> None:
        self.keys = keys
        self._bounds = np.array([(k.addr, k.end) for k in keys], dtype=np.uint64).reshape(-1, 2)

    def index(
        self, addrs: npt.NDArray[np.uint64], lens: npt.NDArray[np.uint64]
    ) -> npt.NDArray[np.intp] | None:
        """For each span ``[addrs[i], +lens[i])``, the index of a registration that holds it
        whole; None when one is held by none."""
        spans = np.stack([np.asarray(addrs, np.uint64), np.asarray(lens, np.uint64)], axis=1)
        return ucx_find(self._bounds, spans)
