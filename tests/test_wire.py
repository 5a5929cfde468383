"""The wire codec: round trips, and arbitrary or mutated input never escapes as anything but
WireError (hypothesis; the bounded slice that CI runs)."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._transport._wire import (
    HEADER,
    MAX_BODY,
    MAX_PAYLOAD,
    BodyReader,
    BodyWriter,
    FrameHeader,
    FrameKind,
    WireError,
    decode_header,
    encode_header,
)

u64 = st.integers(0, 2**64 - 1)
headers = st.builds(
    FrameHeader,
    kind=st.sampled_from(FrameKind),
    request_id=u64,
    status=st.integers(-(2**63), 2**63 - 1),
    body_len=st.integers(0, MAX_BODY),
    flags=st.integers(0, 2**32 - 1),
    payload_len=st.integers(0, MAX_PAYLOAD),
)


@given(headers)
def test_header_round_trip(header: FrameHeader) -> None:
    data = encode_header(header)
    assert len(data) == HEADER.size == 40
    assert decode_header(data) == header


@settings(max_examples=500)
@given(st.binary(min_size=0, max_size=64))
def test_arbitrary_header_bytes_only_raise_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode_header(data)


@settings(max_examples=500)
@given(headers, st.integers(0, 39), st.integers(0, 255))
def test_mutated_headers_decode_or_raise_wire_error(
    header: FrameHeader, pos: int, byte: int
) -> None:
    data = bytearray(encode_header(header))
    data[pos] = byte
    try:
        decoded = decode_header(bytes(data))
    except WireError:
        return
    assert decoded.body_len <= MAX_BODY and decoded.payload_len <= MAX_PAYLOAD


def test_header_rejections() -> None:
    good = encode_header(FrameHeader(FrameKind.PING, request_id=7))
    with pytest.raises(WireError, match="magic"):
        decode_header(b"XXXX" + good[4:])
    with pytest.raises(WireError, match="version"):
        decode_header(good[:4] + struct.pack("<H", 2) + good[6:])
    with pytest.raises(WireError, match="kind"):
        decode_header(good[:6] + struct.pack("<H", 999) + good[8:])
    with pytest.raises(WireError, match="40 bytes"):
        decode_header(good[:-1])
    too_big = HEADER.pack(b"AIDD", 1, FrameKind.PULL, 1, 0, MAX_BODY + 1, 0, 0)
    with pytest.raises(WireError, match="body"):
        decode_header(too_big)
    too_big = HEADER.pack(b"AIDD", 1, FrameKind.PULL, 1, 0, 0, 0, MAX_PAYLOAD + 1)
    with pytest.raises(WireError, match="payload"):
        decode_header(too_big)
    with pytest.raises(WireError):
        encode_header(FrameHeader(FrameKind.PULL, request_id=-1))
    with pytest.raises(WireError):
        encode_header(FrameHeader(FrameKind.PULL, body_len=MAX_BODY + 1))


fields = st.lists(
    st.one_of(
        st.tuples(st.just("u8"), st.integers(0, 255)),
        st.tuples(st.just("u32"), st.integers(0, 2**32 - 1)),
        st.tuples(st.just("u64"), u64),
        st.tuples(st.just("i64"), st.integers(-(2**63), 2**63 - 1)),
        st.tuples(st.just("u64_array"), st.lists(u64, max_size=20)),
        st.tuples(st.just("blob"), st.binary(max_size=40)),
        st.tuples(st.just("text"), st.text(max_size=20)),
    ),
    max_size=12,
)


@given(fields)
def test_body_round_trip(items: list[tuple[str, object]]) -> None:
    writer = BodyWriter()
    for name, value in items:
        getattr(writer, name)(value)
    body = bytes(writer)
    assert len(body) == len(writer)
    reader = BodyReader(body)
    for name, value in items:
        assert getattr(reader, name)() == value
    reader.end()


@settings(max_examples=300)
@given(fields, st.data())
def test_truncated_or_mutated_bodies_raise_wire_error(items, data) -> None:
    writer = BodyWriter()
    for name, value in items:
        getattr(writer, name)(value)
    body = bytearray(bytes(writer))
    if body and data.draw(st.booleans()):
        del body[data.draw(st.integers(0, len(body) - 1)) :]
    elif body:
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    reader = BodyReader(bytes(body))
    try:
        for name, _ in items:
            getattr(reader, name)()
        reader.end()
    except WireError:
        pass


def test_body_limits() -> None:
    with pytest.raises(WireError, match="limit"):
        BodyReader(BodyWriter().u64_array([1, 2, 3]).__bytes__()).u64_array(max_items=2)
    with pytest.raises(WireError, match="truncated"):
        BodyReader(struct.pack("<I", 1000)).u64_array()
    reader = BodyReader(b"\x00\x00")
    assert reader.u8() == 0
    with pytest.raises(WireError, match="trailing"):
        reader.end()
    with pytest.raises(WireError, match="UTF-8"):
        BodyReader(BodyWriter().blob(b"\xff\xfe").__bytes__()).text()
    with pytest.raises(WireError):
        BodyWriter().u8(256)
    with pytest.raises(WireError):
        BodyWriter().u64_array([-1])
