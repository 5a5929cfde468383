"""The wire format: a fixed frame header, bounded body codecs, and their limits. Pure functions.

Every frame is a little-endian header (:data:`HEADER`), then ``body_len`` bytes of control
body, then ``payload_len`` bytes of bulk payload (KV bytes, streamed straight to or from
registered memory, never through Python objects). The header's fields, in order: magic
(:data:`MAGIC`), version (:data:`PROTOCOL_VERSION`), kind (:class:`FrameKind`), request_id
(pairs a response with its request; 0: none), status (int64 LLMStatusCode of a response; 0 in
requests), body_len (<= :data:`MAX_BODY`), flags (per-kind bits), payload_len
(<= :data:`MAX_PAYLOAD`).

Every offset, size, kind and limit comes from ``_native/wire.h`` (through
``aio_datadist._native.wire``), which the native serving and answer paths include too.

Decoders never read past what they were given and reject malformed, truncated or oversized
input with :class:`WireError`, so one bad frame costs one error, never a crash or a hang.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from aio_datadist._native import wire
from aio_datadist.status import LLMStatusCode

__all__ = (
    "HEADER",
    "HEADER_KIND",
    "MAGIC",
    "MAX_BODY",
    "MAX_ERROR_TEXT",
    "MAX_HELLO_BODY",
    "MAX_PAYLOAD",
    "PROTOCOL_VERSION",
    "PULL_NBYTES",
    "BodyReader",
    "BodyWriter",
    "FrameHeader",
    "FrameKind",
    "HelloBody",
    "HelloExtension",
    "WireError",
    "decode_error_text",
    "decode_extension_records",
    "decode_header",
    "decode_hello",
    "encode_error_text",
    "encode_extension_record",
    "encode_header",
    "encode_hello",
    "status_from_wire",
    "pack_header",
)

MAGIC = wire.MAGIC
PROTOCOL_VERSION = wire.VERSION
HEADER = wire.HEADER
#: Where a header's kind field lies (bytes of :data:`HEADER`).
HEADER_KIND = wire.HEADER_KIND
#: A PULL body's prefix: the payload bytes the requester expects; the access follows.
PULL_NBYTES = wire.PULL_NBYTES
#: Largest control body: block lists of a large batch fit many times over.
MAX_BODY = wire.MAX_BODY
#: Largest bulk payload of one frame (1 TiB); each request bounds it further.
MAX_PAYLOAD = wire.MAX_PAYLOAD
#: Largest array or string count a body may announce.
MAX_ITEMS = MAX_BODY // 8


class WireError(ValueError):
    """A frame or body is malformed, truncated, oversized or of an unknown version."""


class FrameKind(IntEnum):
    """What a frame carries."""

    HELLO = wire.FRAME_KINDS["HELLO"]
    HELLO_ACK = wire.FRAME_KINDS["HELLO_ACK"]
    BYE = wire.FRAME_KINDS["BYE"]
    BYE_ACK = wire.FRAME_KINDS["BYE_ACK"]
    PING = wire.FRAME_KINDS["PING"]
    PONG = wire.FRAME_KINDS["PONG"]
    AUTH = wire.FRAME_KINDS["AUTH"]
    PULL = wire.FRAME_KINDS["PULL"]
    PULL_DATA = wire.FRAME_KINDS["PULL_DATA"]
    PULL_DONE = wire.FRAME_KINDS["PULL_DONE"]
    PUSH = wire.FRAME_KINDS["PUSH"]
    PUSH_ACK = wire.FRAME_KINDS["PUSH_ACK"]
    ERROR = wire.FRAME_KINDS["ERROR"]


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A decoded frame header."""

    kind: FrameKind
    request_id: int = 0
    status: int = 0
    body_len: int = 0
    flags: int = 0
    payload_len: int = 0
    version: int = PROTOCOL_VERSION


def encode_header(header: FrameHeader) -> bytes:
    """The :data:`HEADER` bytes of ``header``.

    :raises WireError: a field is outside its range or a length over its limit.
    """
    return pack_header(
        header.kind,
        header.request_id,
        status=header.status,
        body_len=header.body_len,
        payload_len=header.payload_len,
        flags=header.flags,
        version=header.version,
    )


def status_from_wire(value: int) -> LLMStatusCode:
    """The code of a received status field; unknown or success values (a refusal or failure
    must not read as success) read as ``LLM_FAILED``."""
    try:
        code = LLMStatusCode(value)
    except ValueError:
        return LLMStatusCode.LLM_FAILED
    return LLMStatusCode.LLM_FAILED if code is LLMStatusCode.LLM_SUCCESS else code


def pack_header(
    kind: FrameKind,
    request_id: int = 0,
    *,
    status: int = 0,
    body_len: int = 0,
    payload_len: int = 0,
    flags: int = 0,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """The :data:`HEADER` bytes of a frame, from its fields (no :class:`FrameHeader` needed).

    :raises WireError: a field is outside its range or a length over its limit.
    """
    if not 0 <= body_len <= MAX_BODY:
        raise WireError(f"body of {body_len} bytes exceeds {MAX_BODY}")
    if not 0 <= payload_len <= MAX_PAYLOAD:
        raise WireError(f"payload of {payload_len} bytes exceeds {MAX_PAYLOAD}")
    try:
        return HEADER.pack(MAGIC, version, kind, request_id, status, body_len, flags, payload_len)
    except struct.error as exc:
        raise WireError(f"header field out of range: {exc}") from None


def decode_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Decode exactly :data:`HEADER.size <HEADER>` bytes into a :class:`FrameHeader`.

    :raises WireError: wrong size, bad magic, unknown version or kind, oversized lengths.
    """
    if len(data) != HEADER.size:
        raise WireError(f"frame header needs {HEADER.size} bytes, got {len(data)}")
    magic, version, kind, request_id, status, body_len, flags, payload_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not an aio_datadist peer")
    if version != PROTOCOL_VERSION:
        raise WireError(
            f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise WireError(f"unknown frame kind {kind}") from None
    if body_len > MAX_BODY:
        raise WireError(f"body of {body_len} bytes exceeds {MAX_BODY}")
    if payload_len > MAX_PAYLOAD:
        raise WireError(f"payload of {payload_len} bytes exceeds {MAX_PAYLOAD}")
    return FrameHeader(frame_kind, request_id, status, body_len, flags, payload_len, version)


_U8, _U32, _U64, _I64 = (
    struct.Struct("<B"),
    struct.Struct("<I"),
    struct.Struct("<Q"),
    struct.Struct("<q"),
)


class BodyWriter:
    """Builds a control body from typed fields; ``bytes()`` gives the encoded body."""

    __slots__ = ("_parts", "_size")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0

    def _add(self, data: bytes) -> BodyWriter:
        self._size += len(data)
        if self._size > MAX_BODY:
            raise WireError(f"body exceeds {MAX_BODY} bytes")
        self._parts.append(data)
        return self

    def u8(self, value: int) -> BodyWriter:
        """Append an unsigned 8-bit integer."""
        return self._pack(_U8, value)

    def u32(self, value: int) -> BodyWriter:
        """Append an unsigned 32-bit integer."""
        return self._pack(_U32, value)

    def u64(self, value: int) -> BodyWriter:
        """Append an unsigned 64-bit integer."""
        return self._pack(_U64, value)

    def i64(self, value: int) -> BodyWriter:
        """Append a signed 64-bit integer."""
        return self._pack(_I64, value)

    def _pack(self, fmt: struct.Struct, value: int) -> BodyWriter:
        try:
            return self._add(fmt.pack(value))
        except struct.error as exc:
            raise WireError(f"value {value!r} does not fit: {exc}") from None

    def u64_array(self, values: list[int] | tuple[int, ...]) -> BodyWriter:
        """Append a count (u32) and that many unsigned 64-bit integers."""
        if len(values) > MAX_ITEMS:
            raise WireError(f"array of {len(values)} items exceeds {MAX_ITEMS}")
        self.u32(len(values))
        try:
            return self._add(struct.pack(f"<{len(values)}Q", *values))
        except struct.error as exc:
            raise WireError(f"array item does not fit in u64: {exc}") from None

    def blob(self, data: bytes) -> BodyWriter:
        """Append a length (u32) and the bytes."""
        self.u32(len(data))
        return self._add(bytes(data))

    def text(self, value: str) -> BodyWriter:
        """Append a UTF-8 string as a blob."""
        return self.blob(value.encode("utf-8"))

    def __bytes__(self) -> bytes:
        return b"".join(self._parts)

    def __len__(self) -> int:
        return self._size


class BodyReader:
    """Reads typed fields from a control body, never past its end.

    Call :meth:`end` after the last field: trailing bytes are a malformed body.
    """

    __slots__ = ("_data", "_pos")

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._data = memoryview(data).cast("B")
        self._pos = 0

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._data):
            raise WireError(
                f"body truncated: needed {n} bytes at offset {self._pos} of {len(self._data)}"
            )
        view = self._data[self._pos : end]
        self._pos = end
        return view

    def u8(self) -> int:
        """Read an unsigned 8-bit integer."""
        return int(_U8.unpack(self._take(1))[0])

    def u32(self) -> int:
        """Read an unsigned 32-bit integer."""
        return int(_U32.unpack(self._take(4))[0])

    def u64(self) -> int:
        """Read an unsigned 64-bit integer."""
        return int(_U64.unpack(self._take(8))[0])

    def i64(self) -> int:
        """Read a signed 64-bit integer."""
        return int(_I64.unpack(self._take(8))[0])

    def u64_array(self, max_items: int = MAX_ITEMS) -> list[int]:
        """Read a counted array of unsigned 64-bit integers (at most ``max_items``)."""
        count = self.u32()
        if count > max_items:
            raise WireError(f"array of {count} items exceeds the limit of {max_items}")
        return list(struct.unpack(f"<{count}Q", self._take(8 * count)))

    def blob(self, max_len: int = MAX_BODY) -> bytes:
        """Read a counted byte string (at most ``max_len`` bytes)."""
        size = self.u32()
        if size > max_len:
            raise WireError(f"blob of {size} bytes exceeds the limit of {max_len}")
        return bytes(self._take(size))

    def text(self, max_len: int = 4096) -> str:
        """Read a counted UTF-8 string."""
        try:
            return self.blob(max_len).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WireError(f"string is not UTF-8: {exc}") from None

    def end(self) -> None:
        """Check that the whole body was read."""
        if self._pos != len(self._data):
            raise WireError(f"{len(self._data) - self._pos} unexpected trailing body bytes")


#: Largest HELLO/HELLO_ACK body a peer may send.
MAX_HELLO_BODY = wire.MAX_HELLO_BODY


@dataclass(frozen=True, slots=True)
class HelloBody:
    """The body of a HELLO or HELLO_ACK frame.

    Layout: ``u64 cluster_id, u32 role, u8 has_to, u64 to_cluster_id`` (0 unless ``has_to``),
    then a blob of extensions (``u32`` length and bytes): a sequence of records, each
    ``u16 type, u16 length`` and that many bytes (:class:`HelloExtension`). This decoder
    accepts any content in it; :func:`decode_extension_records` splits it.
    """

    cluster_id: int
    role: int
    to_cluster_id: int | None = None
    extensions: bytes = b""


def encode_hello(hello: HelloBody) -> bytes:
    """The body bytes of ``hello``.

    :raises WireError: a field does not fit or the body exceeds :data:`MAX_HELLO_BODY`.
    """
    writer = BodyWriter().u64(hello.cluster_id).u32(hello.role)
    if hello.to_cluster_id is None:
        writer.u8(0).u64(0)
    else:
        writer.u8(1).u64(hello.to_cluster_id)
    writer.blob(hello.extensions)
    if len(writer) > MAX_HELLO_BODY:
        raise WireError(f"hello body of {len(writer)} bytes exceeds {MAX_HELLO_BODY}")
    return bytes(writer)


def decode_hello(data: bytes | bytearray | memoryview) -> HelloBody:
    """Decode a HELLO or HELLO_ACK body.

    :raises WireError: truncated, oversized, trailing bytes, or ``has_to`` not 0 or 1.
    """
    if len(data) > MAX_HELLO_BODY:
        raise WireError(f"hello body of {len(data)} bytes exceeds {MAX_HELLO_BODY}")
    reader = BodyReader(data)
    cluster_id = reader.u64()
    role = reader.u32()
    has_to = reader.u8()
    to_cluster_id = reader.u64()
    extensions = reader.blob(MAX_HELLO_BODY)
    reader.end()
    if has_to not in (0, 1):
        raise WireError(f"hello has_to flag is {has_to}, expected 0 or 1")
    return HelloBody(cluster_id, role, to_cluster_id if has_to else None, extensions)


class HelloExtension(IntEnum):
    """Record types of the HELLO extension blob; readers skip types they do not know."""

    #: Same-host identity and where to prove it (``samehost.HostPresence``).
    HOST_PRESENCE = wire.HELLO_EXTENSIONS["HOST_PRESENCE"]
    #: The client's nonce: it has a link secret and starts authentication (``auth``).
    AUTH_NONCE = wire.HELLO_EXTENSIONS["AUTH_NONCE"]
    #: The communication domain a client links for (UTF-8 name): a shared rank endpoint
    #: routes the link by it (``rendezvous``).
    COMM_NAME = wire.HELLO_EXTENSIONS["COMM_NAME"]
    #: The sender offers the UCX route (one byte: the UCX table version it speaks).
    UCX = wire.HELLO_EXTENSIONS["UCX"]


_RECORD = struct.Struct("<HH")


def encode_extension_record(kind: int, body: bytes) -> bytes:
    """One extension record: its type, its length and ``body``.

    :raises WireError: ``body`` is longer than a record can say.
    """
    if not 0 <= kind <= 0xFFFF:
        raise WireError(f"hello extension record type {kind} is outside [0, 65535]")
    if len(body) > 0xFFFF:
        raise WireError(f"hello extension record of {len(body)} bytes is too long")
    return _RECORD.pack(kind, len(body)) + body


def decode_extension_records(blob: bytes | bytearray | memoryview) -> dict[int, bytes]:
    """The records of a HELLO extension blob by type (the last one of a repeated type wins).

    :raises WireError: a record is truncated or runs past the blob.
    """
    view = memoryview(blob).cast("B")
    at, records = 0, {}
    while at < len(view):
        if at + _RECORD.size > len(view):
            raise WireError("truncated hello extension record")
        kind, size = _RECORD.unpack_from(view, at)
        at += _RECORD.size
        if at + size > len(view):
            raise WireError("hello extension record runs past the body")
        records[kind] = bytes(view[at : at + size])
        at += size
    return records


#: Longest ERROR message a sender puts on the wire, in bytes.
MAX_ERROR_TEXT = wire.MAX_ERROR_TEXT


def encode_error_text(message: str) -> bytes:
    """The body of an ERROR frame: the message as UTF-8, cut to :data:`MAX_ERROR_TEXT` bytes."""
    data = message.encode("utf-8", "replace")
    if len(data) > MAX_ERROR_TEXT:
        data = data[:MAX_ERROR_TEXT].decode("utf-8", "ignore").encode("utf-8")
    return data


def decode_error_text(data: bytes | bytearray | memoryview) -> str:
    """The message of an ERROR body; never raises (invalid UTF-8 is replaced)."""
    return bytes(data[:MAX_ERROR_TEXT]).decode("utf-8", "replace")
