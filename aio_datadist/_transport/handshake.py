"""Handshake bodies: a :class:`Hello` and its extension records as HELLO / HELLO_ACK bytes.

Both transports use the same bytes: TCP sends them, and both bind authentication proofs to
them (``auth.Transcript``).
"""

from __future__ import annotations

from aio_datadist._transport._wire import (
    HelloBody,
    HelloExtension,
    WireError,
    decode_extension_records,
    decode_hello,
    encode_extension_record,
    encode_hello,
)
from aio_datadist._transport.auth import NONCE_BYTES
from aio_datadist._transport.base import Hello
from aio_datadist._transport.samehost import encode_extensions, presence_from_records
from aio_datadist.enums import LLMRole

__all__ = ("hello_from_wire", "hello_to_wire")

#: The records the transport reads itself; every other one is a route provider's offer.
_TRANSPORT_RECORDS = frozenset(
    {HelloExtension.AUTH_NONCE, HelloExtension.COMM_NAME, HelloExtension.HOST_PRESENCE}
)


def hello_to_wire(hello: Hello, *, auth_nonce: bytes | None = None) -> bytes:
    """The HELLO / HELLO_ACK body of ``hello``; with ``auth_nonce`` it asks to authenticate.

    :raises WireError: a field does not fit.
    """
    extensions = encode_extensions(hello.presence)
    if hello.comm is not None:
        extensions += encode_extension_record(HelloExtension.COMM_NAME, hello.comm.encode())
    if auth_nonce is not None:
        extensions += encode_extension_record(HelloExtension.AUTH_NONCE, auth_nonce)
    for kind, body in hello.offers:
        extensions += encode_extension_record(kind, body)
    return encode_hello(
        HelloBody(hello.cluster_id, int(hello.role), hello.to_cluster_id, extensions)
    )


def hello_from_wire(data: bytes | bytearray) -> tuple[Hello, bytes | None]:
    """The peer's :class:`Hello` and its authentication nonce (None when it sent none).

    :raises WireError: a malformed body, an unknown role, or a nonce of the wrong size.
    """
    body = decode_hello(data)
    try:
        role = LLMRole(body.role)
    except ValueError:
        raise WireError(f"unknown role {body.role} in hello") from None
    records = decode_extension_records(body.extensions)
    nonce = records.get(HelloExtension.AUTH_NONCE)
    if nonce is not None and len(nonce) != NONCE_BYTES:
        raise WireError(f"authentication nonce of {len(nonce)} bytes, not {NONCE_BYTES}")
    comm = records.get(HelloExtension.COMM_NAME)
    try:
        comm_name = None if comm is None else comm.decode()
    except UnicodeDecodeError:
        raise WireError("communication domain name in hello is not UTF-8") from None
    presence = presence_from_records(records)
    offers = tuple(sorted((k, v) for k, v in records.items() if k not in _TRANSPORT_RECORDS))
    hello = Hello(body.cluster_id, role, body.to_cluster_id, presence, comm_name, offers)
    return hello, nonce
