"""Remote access requests: which bytes of a peer's memory a pull reads or a push writes.

An :class:`Access` names a cache on the serving side (by key, by cache id and batch index, by
blocks key, or by raw addresses) and the segments of it to move, in payload order. The
requester builds it; the serving side decodes it and checks every bound against what it
allocated or registered before touching memory. Pure encoding and decoding, no I/O.

Segment layout, in payload order:

* raw addresses (``ADDRESSES``): the explicit rows of ``rows``;
* with ``blocks``: for each tensor of ``[tensor_start, tensor_start + tensor_count)``, for each
  block ``b``, ``seg_bytes`` at block ``b`` (the last block of each tensor ``tail_bytes``);
* otherwise one segment per tensor: ``seg_bytes`` at ``row * row_bytes + offset``.

Between members of a rank-table domain with a device communicator, an access may carry the
requester's own rows (``deliver``): the serving side then moves the bytes to or from them
through the communicator itself, and no payload crosses the link.

The body's layout, flags and targets are ``_native/wire.h``'s (through
``aio_datadist._native.wire``), which the native serving path reads too.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import numpy.typing as npt

from aio_datadist._native import api, wire
from aio_datadist._transport import MAX_PAYLOAD, WireError
from aio_datadist._transport.base import Iov
from aio_datadist.status import LLMStatusCode, ParamInvalidError

__all__ = (
    "NO_ROWS",
    "Access",
    "Target",
    "access_rows",
    "decode_access",
    "encode_access",
    "encode_blocks_access",
)

U64s = npt.NDArray[np.uint64]
_EMPTY: U64s = np.empty(0, dtype=np.uint64)
_EMPTY_ROWS: U64s = np.empty((0, 2), dtype=np.uint64)
#: No ``(addr, len)`` rows (never written to): what an access without raw rows holds.
NO_ROWS = _EMPTY_ROWS

#: Most blocks or address rows one request may name.
MAX_ROWS = wire.ACCESS_MAX_ROWS


class Target(IntEnum):
    """How an access names the serving side's cache."""

    #: CacheKey by req_id: ident = req_id.
    REQ_KEY = wire.TARGETS["REQ_KEY"]
    #: CacheKey by prefix_id: ident = prefix_id.
    PREFIX_KEY = wire.TARGETS["PREFIX_KEY"]
    #: CacheKeyByIdAndIndex: ident = cache_id, row = batch_index.
    CACHE_INDEX = wire.TARGETS["CACHE_INDEX"]
    #: BlocksCacheKey: ident = model_id.
    BLOCKS_KEY = wire.TARGETS["BLOCKS_KEY"]
    #: Raw addresses of registered or allocated memory (TransferConfig).
    ADDRESSES = wire.TARGETS["ADDRESSES"]
    #: The UCX route's control plane: a push of the sender's UCX table (ident = its
    #: sequence; ``_routes.ucx.table``).
    UCX_TABLE = wire.TARGETS["UCX_TABLE"]
    #: The UCX route's control plane: the sender applied the receiver's table ``ident``.
    UCX_ACK = wire.TARGETS["UCX_ACK"]


@dataclass(slots=True, eq=False)
class Access:
    """One request's view of the serving side's memory (see the module docstring).

    Treated as immutable once built (not frozen: a frozen dataclass costs a small request
    microseconds to construct)."""

    target: Target
    ident: int = 0
    model_id: int = 0
    row: int = 0
    tensor_start: int = 0
    tensor_count: int = 0
    offset: int = 0
    seg_bytes: int = 0
    tail_bytes: int = 0
    #: Drop the named key once the requester confirmed every byte landed (pull by req key).
    drop_key: bool = False
    blocks: U64s = field(default_factory=lambda: _EMPTY)
    rows: U64s = field(default_factory=lambda: _EMPTY_ROWS)
    #: The requester's ``(addr, len)`` rows the serving side fills (pull) or reads (push)
    #: through the domain's communicator; empty when the payload crosses the link.
    deliver: U64s = field(default_factory=lambda: _EMPTY_ROWS)

    @property
    def nbytes(self) -> int:
        """Payload bytes this access moves."""
        if self.target is Target.ADDRESSES:
            return int(self.rows[:, 1].sum()) if len(self.rows) else 0
        if len(self.blocks):
            per_tensor = (len(self.blocks) - 1) * self.seg_bytes + self.last_bytes
            return self.tensor_count * per_tensor
        return self.tensor_count * self.seg_bytes

    @property
    def last_bytes(self) -> int:
        """Bytes of the last block of each tensor."""
        return self.tail_bytes or self.seg_bytes


_FIXED = wire.ACCESS_FIELDS
_COUNTS = wire.ACCESS_COUNTS
_COUNT = wire.ACCESS_NDELIVER
#: Flag bits of an access.
_DROP_KEY, _DELIVER = wire.ACCESS_DROP_KEY, wire.ACCESS_DELIVER
#: Bytes of a block id and of an ``(addr, len)`` row.
_BLOCK, _PAIR = wire.ACCESS_BLOCK_SIZE, wire.ACCESS_PAIR_SIZE
#: Up to this many blocks, ``struct`` packs a block list faster than numpy.
_PACKED_BLOCKS = 64


def encode_access(access: Access) -> bytes:
    """The request body of ``access``."""
    if (
        access.target is Target.BLOCKS_KEY
        and len(access.blocks) <= _PACKED_BLOCKS
        and not (access.model_id or access.row or access.offset or access.tail_bytes)
        and not (access.drop_key or len(access.rows) or len(access.deliver))
    ):  # a small request of whole blocks, the most frequent: packed without numpy
        return encode_blocks_access(
            access.ident,
            access.tensor_start,
            access.tensor_count,
            access.seg_bytes,
            access.blocks.tolist(),
        )
    blocks = np.ascontiguousarray(access.blocks, dtype="<u8")
    rows = np.ascontiguousarray(access.rows, dtype="<u8").reshape(-1)
    deliver = len(access.deliver)
    fixed = _FIXED.pack(
        access.target,
        (_DROP_KEY if access.drop_key else 0) | (_DELIVER if deliver else 0),
        access.ident,
        access.model_id,
        access.row,
        access.tensor_start,
        access.tensor_count,
        access.offset,
        access.seg_bytes,
        access.tail_bytes,
    )
    counts = _COUNTS.pack(len(blocks), len(rows) // 2)
    parts = [fixed, counts, blocks.tobytes(), rows.tobytes()]
    if deliver:
        parts.append(_COUNT.pack(deliver))
        parts.append(np.ascontiguousarray(access.deliver, dtype="<u8").tobytes())
    return b"".join(parts)


def encode_blocks_access(
    model_id: int, tensor_start: int, tensor_count: int, seg_bytes: int, blocks: Sequence[int]
) -> bytes:
    """The request body of an access of ``blocks`` (whole blocks of ``seg_bytes``) of the
    blocks cache ``model_id``: :func:`encode_access` of that access, built without one."""
    n = len(blocks)
    listed = (
        struct.pack(f"<{n}Q", *blocks)
        if n <= _PACKED_BLOCKS
        else np.asarray(blocks, dtype="<u8").tobytes()
    )
    fixed = _FIXED.pack(
        Target.BLOCKS_KEY, 0, model_id, 0, 0, tensor_start, tensor_count, 0, seg_bytes, 0
    )
    return b"".join((fixed, _COUNTS.pack(n, 0), listed))


def decode_access(body: bytes | bytearray | memoryview) -> Access:
    """Decode a request body, rejecting anything malformed.

    :raises WireError: truncated, oversized, trailing bytes or an unknown target.
    """
    view = memoryview(body).cast("B")
    head = wire.ACCESS_FIXED_SIZE
    if len(view) < head:
        raise WireError(f"access body of {len(view)} bytes is shorter than {head}")
    fields = _FIXED.unpack_from(view)
    n_blocks, n_rows = _COUNTS.unpack_from(view, _FIXED.size)
    if n_blocks > MAX_ROWS or n_rows > MAX_ROWS:
        raise WireError(f"access names {n_blocks} blocks and {n_rows} rows (limit {MAX_ROWS})")
    if fields[1] > _DROP_KEY | _DELIVER:
        raise WireError(f"bad access flags {fields[1]}")
    expected = head + _BLOCK * n_blocks + _PAIR * n_rows
    n_deliver = 0
    if fields[1] & _DELIVER:
        if len(view) < expected + _COUNT.size:
            raise WireError(f"access body of {len(view)} bytes lacks its delivery count")
        (n_deliver,) = _COUNT.unpack_from(view, expected)
        if not 0 < n_deliver <= MAX_ROWS:
            raise WireError(f"access names {n_deliver} delivery rows (1 to {MAX_ROWS})")
        expected += _COUNT.size + _PAIR * n_deliver
    if len(view) != expected:
        raise WireError(f"access body has {len(view)} bytes, its counts need {expected}")
    try:
        target = Target(fields[0])
    except ValueError:
        raise WireError(f"unknown access target {fields[0]}") from None
    if fields[8] > MAX_PAYLOAD or fields[9] > MAX_PAYLOAD:
        raise WireError(f"access segments of {fields[8]}/{fields[9]} bytes exceed {MAX_PAYLOAD}")
    blocks = np.frombuffer(view, dtype="<u8", count=n_blocks, offset=head).astype(np.uint64)
    rows = _rows(view, n_rows, head + _BLOCK * n_blocks)
    deliver = _EMPTY_ROWS
    if n_deliver:
        deliver = _rows(view, n_deliver, head + _BLOCK * n_blocks + _PAIR * n_rows + _COUNT.size)
    return Access(
        target,
        ident=fields[2],
        model_id=fields[3],
        row=fields[4],
        tensor_start=fields[5],
        tensor_count=fields[6],
        offset=fields[7],
        seg_bytes=fields[8],
        tail_bytes=fields[9],
        drop_key=bool(fields[1] & _DROP_KEY),
        blocks=blocks,
        rows=rows,
        deliver=deliver,
    )


def _rows(view: memoryview, n: int, offset: int) -> U64s:
    """``n`` ``(addr, len)`` rows at ``offset``, each no longer than a payload and none
    wrapping around the address space (which keeps every sum over them exact in uint64:
    2**20 rows of 2**40 bytes at most).

    :raises WireError: a row breaks those bounds.
    """
    rows = np.frombuffer(view, dtype="<u8", count=2 * n, offset=offset).astype(np.uint64)
    rows = rows.reshape(n, 2)
    if n and (
        bool((rows[:, 1] > MAX_PAYLOAD).any()) or bool((rows[:, 0] + rows[:, 1] < rows[:, 0]).any())
    ):
        raise WireError("an access row is longer than a payload or wraps around the address space")
    return rows


def access_rows(
    addrs: tuple[int, ...] | list[int],
    block_bytes: int,
    num_blocks: int,
    access: Access,
    row: int,
) -> Iov:
    """The ``(addr, len)`` rows of ``access`` over a cache whose tensors start at ``addrs``.

    ``block_bytes`` is the size of one batch row or block of a tensor and ``num_blocks`` their
    count; ``row`` is the batch row of a row access.

    :raises LLMException: ``LLM_PARAM_INVALID`` when a segment is outside the cache.
    """
    start, count = access.tensor_start, access.tensor_count
    if len(access.blocks):
        # The one check of a blocks access, shared with the native serving path.
        return api.blocks_access_rows(
            addrs,
            block_bytes,
            num_blocks,
            start,
            count,
            access.blocks,
            access.seg_bytes,
            access.last_bytes,
        )
    if count < 1 or start + count > len(addrs):
        raise _rows_invalid(
            f"tensors [{start}, {start + count}) are outside the cache's {len(addrs)} tensors"
        )
    if row >= num_blocks:
        raise _rows_invalid(f"batch index {row} is outside [0, {num_blocks})")
    if access.seg_bytes < 1 or access.offset + access.seg_bytes > block_bytes:
        raise _rows_invalid(
            f"{access.seg_bytes} bytes at offset {access.offset} do not fit a row of "
            f"{block_bytes} bytes"
        )
    bases = np.asarray(addrs[start : start + count], dtype=np.uint64)
    rows = np.empty((count, 2), dtype=np.uint64)
    rows[:, 0] = bases + np.uint64(row * block_bytes + access.offset)
    rows[:, 1] = access.seg_bytes
    return rows


def _rows_invalid(message: str) -> ParamInvalidError:
    return ParamInvalidError(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)
