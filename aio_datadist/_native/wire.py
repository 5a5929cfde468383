"""The wire format's numbers, read from ``wire.h``: the one door to them for Python.

``wire.h`` defines every offset, size, kind, flag and limit of the format; this module reads
them from the extension and builds the ``struct`` layouts the transport and the engine pack
and unpack with. Only the field order and each field's ``struct`` code (which says what C
cannot: signed or not, bytes or integer) are written here, and every one is checked against
``wire.h`` at import, so the two can never disagree silently.

Raises:
    ImportError: a layout here disagrees with ``wire.h`` (the extension is stale or one side
        was edited alone).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ._ffi import lib

__all__ = (
    "ACCESS_BLOCK_SIZE",
    "ACCESS_COUNTS",
    "ACCESS_DELIVER",
    "ACCESS_DROP_KEY",
    "ACCESS_FIELDS",
    "ACCESS_FIXED_SIZE",
    "ACCESS_MAX_ROWS",
    "ACCESS_NDELIVER",
    "ACCESS_PAIR_SIZE",
    "FRAME_KINDS",
    "HEADER",
    "HEADER_KIND",
    "HELLO_EXTENSIONS",
    "MAGIC",
    "MAX_BODY",
    "MAX_ERROR_TEXT",
    "MAX_HELLO_BODY",
    "MAX_PAYLOAD",
    "PULL_NBYTES",
    "TARGETS",
    "UCX_HOST_SIZE",
    "UCX_MAX_ADDRESS",
    "UCX_MAX_KEYS",
    "UCX_MAX_RKEY",
    "UCX_MAX_TABLE",
    "UCX_MEMORY",
    "UCX_VERSION",
    "VERSION",
)


def _layout(prefix: str, fields: Sequence[tuple[str, str]], start: int, end: int) -> struct.Struct:
    """The little-endian struct of ``fields`` (name, ``struct`` code) that fills
    ``[start, end)``, each field at the ``{prefix}_{name}_OFF`` and of the ``_SIZE`` that
    ``wire.h`` gives it."""
    fmt, at = "<", start
    for name, code in fields:
        offset, size = getattr(lib, f"{prefix}_{name}_OFF"), getattr(lib, f"{prefix}_{name}_SIZE")
        if offset != at or struct.calcsize("<" + code) != size:
            raise ImportError(
                f"wire.h puts {prefix}_{name} at {offset} ({size} bytes); "
                f"this module expects {at} ({code!r})"
            )
        fmt, at = fmt + code, at + size
    if at != end:
        raise ImportError(f"wire.h's {prefix} layout ends at {end}, its fields at {at}")
    return struct.Struct(fmt)


def _members(prefix: str) -> dict[str, int]:
    """The enum constants of ``wire.h`` named ``{prefix}NAME``, by ``NAME``, in value order."""
    found = {n[len(prefix) :]: int(getattr(lib, n)) for n in dir(lib) if n.startswith(prefix)}
    return dict(sorted(found.items(), key=lambda item: item[1]))


MAGIC: bytes = int(lib.DD_WIRE_MAGIC).to_bytes(lib.DD_HDR_MAGIC_SIZE, "little")
#: Protocol version this side speaks.
VERSION: int = lib.DD_WIRE_VERSION
#: The frame header: magic, version, kind, request_id, status, body_len, flags, payload_len.
HEADER = _layout(
    "DD_HDR",
    (
        ("MAGIC", "4s"),
        ("VERSION", "H"),
        ("KIND", "H"),
        ("REQUEST_ID", "Q"),
        ("STATUS", "q"),
        ("BODY_LEN", "I"),
        ("FLAGS", "I"),
        ("PAYLOAD_LEN", "Q"),
    ),
    0,
    lib.DD_HDR_SIZE,
)
#: Where a header's kind field lies.
HEADER_KIND = slice(lib.DD_HDR_KIND_OFF, lib.DD_HDR_KIND_OFF + lib.DD_HDR_KIND_SIZE)
#: Frame kinds by name (``HELLO``: 1, ...).
FRAME_KINDS: dict[str, int] = _members("DD_FRAME_")

#: Largest control body, in bytes.
MAX_BODY: int = lib.DD_WIRE_MAX_BODY
#: Largest bulk payload of one frame, in bytes.
MAX_PAYLOAD: int = lib.DD_WIRE_MAX_PAYLOAD
#: Largest HELLO or HELLO_ACK body, in bytes.
MAX_HELLO_BODY: int = lib.DD_WIRE_MAX_HELLO_BODY
#: Longest ERROR message a sender puts on the wire, in bytes.
MAX_ERROR_TEXT: int = lib.DD_WIRE_MAX_ERROR_TEXT
#: HELLO extension record types by name.
HELLO_EXTENSIONS: dict[str, int] = _members("DD_HELLO_EXT_")

#: A PULL body's prefix: the payload bytes the requester expects.
PULL_NBYTES = _layout("DD_PULL", (("NBYTES", "Q"),), 0, lib.DD_PULL_NBYTES_SIZE)

#: An access body's fields before its counts: target, flags, ident, model_id, row,
#: tensor_start, tensor_count, offset, seg_bytes, tail_bytes.
ACCESS_FIELDS = _layout(
    "DD_ACCESS",
    (
        ("TARGET", "B"),
        ("FLAGS", "B"),
        ("IDENT", "Q"),
        ("MODEL_ID", "Q"),
        ("ROW", "Q"),
        ("TENSOR_START", "I"),
        ("TENSOR_COUNT", "I"),
        ("OFFSET", "Q"),
        ("SEG_BYTES", "Q"),
        ("TAIL_BYTES", "Q"),
    ),
    0,
    lib.DD_ACCESS_NBLOCKS_OFF,
)
#: An access body's counts: blocks, then (addr, len) rows.
ACCESS_COUNTS = _layout(
    "DD_ACCESS",
    (("NBLOCKS", "I"), ("NROWS", "I")),
    lib.DD_ACCESS_NBLOCKS_OFF,
    lib.DD_ACCESS_FIXED_SIZE,
)
#: Bytes of an access body before its block ids.
ACCESS_FIXED_SIZE: int = lib.DD_ACCESS_FIXED_SIZE
#: Bytes of one block id, and of one ``(addr, len)`` row.
ACCESS_BLOCK_SIZE: int = lib.DD_ACCESS_BLOCK_SIZE
ACCESS_PAIR_SIZE: int = lib.DD_ACCESS_PAIR_SIZE
#: The count of delivery rows that follows the rows of an access flagged ``ACCESS_DELIVER``.
ACCESS_NDELIVER = struct.Struct("<I")
#: Most blocks, rows or delivery rows one access names.
ACCESS_MAX_ROWS: int = lib.DD_ACCESS_MAX_ROWS
#: Flag bits of an access.
ACCESS_DROP_KEY: int = lib.DD_ACCESS_DROP_KEY
ACCESS_DELIVER: int = lib.DD_ACCESS_DELIVER
#: Access targets by name (``REQ_KEY``: 1, ...).
TARGETS: dict[str, int] = _members("DD_TARGET_")

#: The UCX table's version, and the limits its decoder enforces (bytes, or counts).
UCX_VERSION: int = lib.DD_UCX_VERSION
UCX_HOST_SIZE: int = lib.DD_UCX_HOST_SIZE
UCX_MAX_ADDRESS: int = lib.DD_UCX_MAX_ADDRESS
UCX_MAX_RKEY: int = lib.DD_UCX_MAX_RKEY
UCX_MAX_KEYS: int = lib.DD_UCX_MAX_KEYS
UCX_MAX_TABLE: int = lib.DD_UCX_MAX_TABLE
#: Memory types of a UCX registration by name (``HOST``: 0, ``CUDA``: 1).
UCX_MEMORY: dict[str, int] = _members("DD_UCX_MEMORY_")

if ACCESS_NDELIVER.size != lib.DD_ACCESS_NDELIVER_SIZE:
    raise ImportError(f"wire.h's delivery count has {lib.DD_ACCESS_NDELIVER_SIZE} bytes")
if (struct.calcsize("<Q"), struct.calcsize("<QQ")) != (ACCESS_BLOCK_SIZE, ACCESS_PAIR_SIZE):
    # Both sides read block ids and rows as arrays of little-endian u64.
    raise ImportError("wire.h's block ids and rows are not u64 and (u64, u64)")
