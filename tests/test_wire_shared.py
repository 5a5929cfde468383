"""One wire definition: the Python codecs and the C readers agree on every field.

``_native/wire.h`` defines the format; Python reads its numbers through
``aio_datadist._native.wire``. These tests fail when either side is edited alone: a Python
constant that no longer matches the header, a C reader that no longer reads what Python
packs (or the other way round), a layout whose offsets and field codes part ways.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aio_datadist._engine import access as access_mod
from aio_datadist._engine.access import Access, Target, encode_access, encode_blocks_access
from aio_datadist._native import wire
from aio_datadist._native._ffi import ffi, lib
from aio_datadist._transport import _wire
from aio_datadist._transport._wire import (
    HEADER,
    FrameHeader,
    FrameKind,
    HelloExtension,
    decode_header,
    encode_header,
)

NATIVE = Path(wire.__file__).parent
u8 = st.integers(0, 2**8 - 1)
u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)


def c_constants(prefix: str) -> dict[str, int]:
    """Every constant of the extension named ``{prefix}NAME``, by ``NAME``."""
    return {n[len(prefix) :]: getattr(lib, n) for n in dir(lib) if n.startswith(prefix)}


def test_enums_are_the_c_enums_member_by_member() -> None:
    assert {k.name: k.value for k in FrameKind} == c_constants("DD_FRAME_")
    assert {t.name: t.value for t in Target} == c_constants("DD_TARGET_")
    assert {e.name: e.value for e in HelloExtension} == c_constants("DD_HELLO_EXT_")


def test_limits_and_identity_are_the_c_constants() -> None:
    assert _wire.MAGIC == struct.pack("<I", lib.DD_WIRE_MAGIC) == b"AIDD"
    assert _wire.PROTOCOL_VERSION == lib.DD_WIRE_VERSION
    assert _wire.HEADER.size == lib.DD_HDR_SIZE
    assert _wire.MAX_BODY == lib.DD_WIRE_MAX_BODY
    assert _wire.MAX_PAYLOAD == lib.DD_WIRE_MAX_PAYLOAD
    assert _wire.MAX_HELLO_BODY == lib.DD_WIRE_MAX_HELLO_BODY
    assert _wire.MAX_ERROR_TEXT == lib.DD_WIRE_MAX_ERROR_TEXT
    assert _wire.PULL_NBYTES.size == lib.DD_PULL_NBYTES_SIZE
    assert access_mod.MAX_ROWS == lib.DD_ACCESS_MAX_ROWS
    assert (access_mod._DROP_KEY, access_mod._DELIVER) == (
        lib.DD_ACCESS_DROP_KEY,
        lib.DD_ACCESS_DELIVER,
    )
    assert access_mod._FIXED.size + access_mod._COUNTS.size == lib.DD_ACCESS_FIXED_SIZE
    assert access_mod._COUNT.size == lib.DD_ACCESS_NDELIVER_SIZE


def test_a_layout_that_disagrees_with_the_header_is_refused() -> None:
    with pytest.raises(ImportError, match="DD_HDR_KIND"):  # a field left out
        wire._layout("DD_HDR", [("MAGIC", "4s"), ("KIND", "H")], 0, lib.DD_HDR_SIZE)
    with pytest.raises(ImportError, match="DD_HDR_VERSION"):  # a field of another width
        wire._layout("DD_HDR", [("MAGIC", "4s"), ("VERSION", "I")], 0, lib.DD_HDR_SIZE)
    with pytest.raises(ImportError, match="ends at"):  # fields missing at the end
        wire._layout("DD_HDR", [("MAGIC", "4s")], 0, lib.DD_HDR_SIZE)


def test_native_sources_take_their_numbers_from_the_header() -> None:
    for name in ("net.c", "serve.c"):
        text = (NATIVE / name).read_text(encoding="utf-8")
        assert '#include "wire.h"' in text, name
        for copied in ('"AIDD"', "'A', 'I', 'D', 'D'", "HDR_SIZE 40", "KIND_PULL", "h + 6"):
            assert copied not in text, (name, copied)


headers = st.builds(
    FrameHeader,
    kind=st.sampled_from(FrameKind),
    request_id=u64,
    status=i64,
    body_len=st.integers(0, _wire.MAX_BODY),
    flags=u32,
    payload_len=st.integers(0, _wire.MAX_PAYLOAD),
)


@given(headers)
def test_c_reads_every_field_of_a_python_header(header: FrameHeader) -> None:
    data = encode_header(header)
    out = ffi.new("dd_frame_header *")
    lib.dd_frame_header_read(ffi.from_buffer("uint8_t[]", data), out)
    assert struct.pack("<I", out.magic) == _wire.MAGIC
    assert out.version == header.version
    assert out.kind == header.kind
    assert out.request_id == header.request_id
    assert out.status == header.status
    assert out.body_len == header.body_len
    assert out.flags == header.flags
    assert out.payload_len == header.payload_len


@given(u32, u16, u16, u64, i64, u32, u32, u64)
def test_python_reads_every_field_of_a_c_header(
    magic: int,
    version: int,
    kind: int,
    rid: int,
    status: int,
    body_len: int,
    flags: int,
    payload_len: int,
) -> None:
    h = ffi.new(
        "dd_frame_header *",
        {
            "magic": magic,
            "version": version,
            "kind": kind,
            "request_id": rid,
            "status": status,
            "body_len": body_len,
            "flags": flags,
            "payload_len": payload_len,
        },
    )
    buf = ffi.new("uint8_t[]", lib.DD_HDR_SIZE)
    lib.dd_frame_header_write(buf, h)
    data = bytes(ffi.buffer(buf))
    assert HEADER.unpack(data) == (
        struct.pack("<I", magic),
        version,
        kind,
        rid,
        status,
        body_len,
        flags,
        payload_len,
    )
    if (
        magic == lib.DD_WIRE_MAGIC
        and version == lib.DD_WIRE_VERSION
        and kind in FrameKind._value2member_map_
        and body_len <= _wire.MAX_BODY
        and payload_len <= _wire.MAX_PAYLOAD
    ):
        decoded = decode_header(data)
        assert (decoded.kind, decoded.request_id, decoded.status) == (kind, rid, status)


pairs = st.lists(st.tuples(u64, st.integers(0, _wire.MAX_PAYLOAD)), max_size=4)
accesses = st.builds(
    Access,
    target=st.sampled_from(Target),
    ident=u64,
    model_id=u64,
    row=u64,
    tensor_start=u32,
    tensor_count=u32,
    offset=u64,
    seg_bytes=u64,
    tail_bytes=u64,
    drop_key=st.booleans(),
    blocks=st.lists(u64, max_size=8).map(lambda b: np.array(b, dtype=np.uint64)),
    rows=pairs.map(lambda r: np.array(r, dtype=np.uint64).reshape(-1, 2)),
    deliver=pairs.map(lambda r: np.array(r, dtype=np.uint64).reshape(-1, 2)),
)


def c_access(body: bytes) -> dict[str, int]:
    """The fields of ``body``'s fixed part, as the C reader sees them."""
    out = ffi.new("dd_access_head *")
    lib.dd_access_head_read(ffi.from_buffer("uint8_t[]", body), out)
    return {name: getattr(out, name) for name, _ in ffi.typeof("dd_access_head").fields}


@given(accesses)
def test_c_reads_every_field_of_a_python_access(access: Access) -> None:
    body = encode_access(access)
    flags = (lib.DD_ACCESS_DROP_KEY if access.drop_key else 0) | (
        lib.DD_ACCESS_DELIVER if len(access.deliver) else 0
    )
    assert c_access(body) == {
        "target": access.target,
        "flags": flags,
        "ident": access.ident,
        "model_id": access.model_id,
        "row": access.row,
        "tensor_start": access.tensor_start,
        "tensor_count": access.tensor_count,
        "offset": access.offset,
        "seg_bytes": access.seg_bytes,
        "tail_bytes": access.tail_bytes,
        "nblocks": len(access.blocks),
        "nrows": len(access.rows),
    }
    ids = body[lib.DD_ACCESS_FIXED_SIZE :][: lib.DD_ACCESS_BLOCK_SIZE * len(access.blocks)]
    assert np.frombuffer(ids, dtype="<u8").tolist() == access.blocks.tolist()


@given(u64, u32, u32, u64, st.lists(u64, max_size=80))
def test_c_reads_a_compact_blocks_access(
    model_id: int, start: int, count: int, seg: int, blocks: list[int]
) -> None:
    body = encode_blocks_access(model_id, start, count, seg, blocks)
    assert c_access(body) == {
        "target": lib.DD_TARGET_BLOCKS_KEY,
        "flags": 0,
        "ident": model_id,
        "model_id": 0,
        "row": 0,
        "tensor_start": start,
        "tensor_count": count,
        "offset": 0,
        "seg_bytes": seg,
        "tail_bytes": 0,
        "nblocks": len(blocks),
        "nrows": 0,
    }
