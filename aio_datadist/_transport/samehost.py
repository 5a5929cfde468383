"""Same-host identity: how two ends of a link learn that they share one host and kernel.

Each side's handshake may carry a :class:`HostPresence`: the kernel's boot id and the inode
of its pid namespace (together: the same running kernel and the same process-id space), its
process id, and the descriptor of its region board (``_engine.regions``). Two ends whose
boot id and pid namespace match can address each other's processes by pid; whether the
kernel lets them read each other's memory is found out on first use.

On the wire the presence is one extension record of the HELLO body's extension blob:
``u16 type (1), u16 length (32), 16 bytes boot id, u64 pid-namespace inode, u32 pid,
u32 board fd``. Unknown record types are skipped, so later extensions can be added.
"""

from __future__ import annotations

import functools
import os
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from aio_datadist._transport._wire import (
    HelloExtension,
    WireError,
    decode_extension_records,
    encode_extension_record,
)

__all__ = (
    "HostPresence",
    "decode_extensions",
    "encode_extensions",
    "local_host_key",
    "presence_from_records",
)

_PRESENCE = struct.Struct("<16sQII")


@dataclass(frozen=True, slots=True)
class HostPresence:
    """One process on one host, and where its region board is."""

    boot_id: bytes
    pid_ns: int
    pid: int
    board_fd: int

    @property
    def host_key(self) -> tuple[bytes, int]:
        """Equal for two processes that share a kernel and a pid namespace."""
        return (self.boot_id, self.pid_ns)


@functools.cache
def local_host_key() -> tuple[bytes, int] | None:
    """This process's ``(boot id, pid-namespace inode)``; None where Linux does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = uuid.UUID(f.read().strip()).bytes
        return boot, os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError):
        return None


def encode_extensions(presence: HostPresence | None) -> bytes:
    """The HELLO extension blob carrying ``presence`` (empty without one)."""
    if presence is None:
        return b""
    body = _PRESENCE.pack(presence.boot_id, presence.pid_ns, presence.pid, presence.board_fd)
    return encode_extension_record(HelloExtension.HOST_PRESENCE, body)


def decode_extensions(blob: bytes | bytearray | memoryview) -> HostPresence | None:
    """The presence in a HELLO extension blob, if any.

    :raises WireError: a truncated record, or a presence record of the wrong size.
    """
    return presence_from_records(decode_extension_records(blob))


def presence_from_records(records: Mapping[int, bytes]) -> HostPresence | None:
    """The presence among decoded extension records, if any.

    :raises WireError: a presence record of the wrong size.
    """
    body = records.get(HelloExtension.HOST_PRESENCE)
    if body is None:
        return None
    if len(body) != _PRESENCE.size:
        raise WireError(f"host presence record of {len(body)} bytes, not {_PRESENCE.size}")
    boot, pid_ns, pid, fd = _PRESENCE.unpack(body)
    return HostPresence(bytes(boot), pid_ns, pid, fd)
