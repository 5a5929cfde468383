"""Link authentication: the shared link secret and the proofs of its knowledge. Pure functions.

When engines share a secret (``LLMConfig.link_secret`` or ``AIO_DATADIST_LINK_SECRET``), a
new link is a mutual challenge-response and the secret never travels:

1. the client's HELLO carries a fresh client nonce (extension record ``AUTH_NONCE``);
2. the server answers with an ``AUTH`` frame holding a fresh server nonce;
3. the client answers with an ``AUTH`` frame holding its proof;
4. the server checks the proof, registers the link and sends ``HELLO_ACK`` followed by an
   ``AUTH`` frame holding its own proof, which the client checks before using the link.

A proof is ``HMAC-SHA256(secret, label || version || client HELLO body || client nonce ||
server nonce || server HELLO_ACK body)`` (each part length-prefixed; the client's proof has
an empty server body). Client and server proofs carry different labels, so neither can be
reflected as the other, and fresh nonces on both sides keep an old proof from being
replayed. Proofs are compared in constant time. Engines without a secret skip all of this
and keep the two-frame handshake; one side with a secret and the other without refuses.

Authentication only decides who may link: the link itself is not encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from dataclasses import dataclass
from enum import Enum

from aio_datadist._transport._wire import PROTOCOL_VERSION

__all__ = (
    "NONCE_BYTES",
    "PROOF_BYTES",
    "SECRET_ENV",
    "WRONG_CLIENT_PROOF",
    "WRONG_SERVER_PROOF",
    "LinkSecret",
    "Side",
    "Transcript",
    "decode_secret_option",
    "encode_secret_option",
    "new_nonce",
    "refusal_reason",
    "secret_from_environment",
)

#: Environment variable holding the link secret when the options carry none.
SECRET_ENV = "AIO_DATADIST_LINK_SECRET"
#: Size of each side's nonce, in bytes.
NONCE_BYTES = 32
#: Size of a proof (an HMAC-SHA256 digest), in bytes.
PROOF_BYTES = 32
#: Prefix of an option value that spells the secret's bytes in hexadecimal.
HEX_PREFIX = "hex:"

_LENGTH = struct.Struct("<I")
_VERSION = struct.Struct("<H")


class Side(Enum):
    """Which end of the handshake a proof speaks for; each has its own HMAC label."""

    CLIENT = b"aio_datadist link auth: client proof"
    SERVER = b"aio_datadist link auth: server proof"


@dataclass(frozen=True, slots=True)
class Transcript:
    """What both proofs of one handshake are bound to."""

    client_hello: bytes
    client_nonce: bytes
    server_nonce: bytes
    #: The server's HELLO_ACK body; empty for the client's proof (sent before it exists).
    server_hello: bytes = b""


def new_nonce() -> bytes:
    """A fresh random nonce of :data:`NONCE_BYTES` bytes."""
    return secrets.token_bytes(NONCE_BYTES)


class LinkSecret:
    """The shared secret of the engines allowed to link with each other.

    It never appears in a ``repr``, a log line or on the wire; only proofs computed from it
    do.
    """

    __slots__ = ("_key",)

    def __init__(self, value: str | bytes) -> None:
        """Wrap ``value`` (a str is used as its UTF-8 bytes).

        :raises TypeError: ``value`` is neither str nor bytes.
        :raises ValueError: ``value`` is empty.
        """
        if not isinstance(value, (str, bytes)):
            raise TypeError(f"link_secret only support [str, bytes], but got {type(value)}")
        key = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        if not key:
            raise ValueError("link_secret must not be empty")
        self._key = key

    def __repr__(self) -> str:
        return "LinkSecret(<hidden>)"

    def prove(self, side: Side, transcript: Transcript) -> bytes:
        """The proof that ``side`` knows this secret, bound to ``transcript``."""
        mac = hmac.new(self._key, side.value, hashlib.sha256)
        mac.update(_VERSION.pack(PROTOCOL_VERSION))
        for part in (
            transcript.client_hello,
            transcript.client_nonce,
            transcript.server_nonce,
            transcript.server_hello,
        ):
            mac.update(_LENGTH.pack(len(part)))
            mac.update(part)
        return mac.digest()

    def verify(self, side: Side, transcript: Transcript, proof: bytes) -> bool:
        """True when ``proof`` is ``side``'s proof of this secret for ``transcript``."""
        return hmac.compare_digest(self.prove(side, transcript), proof)


def refusal_reason(*, client_secret: bool, server_secret: bool) -> str | None:
    """Why a handshake stops when only one end has a secret; None when both or neither do.

    The message reads the same whichever end found the mismatch.
    """
    if server_secret and not client_secret:
        return "authentication failed: the listener requires a link secret and the client has none"
    if client_secret and not server_secret:
        return "authentication failed: the client has a link secret and the listener has none"
    return None


#: Why the listener refuses a client whose proof does not check out.
WRONG_CLIENT_PROOF = (
    "authentication failed: the client's proof does not match the listener's link secret "
    "(the secrets differ)"
)
#: Why the client refuses a listener whose proof does not check out.
WRONG_SERVER_PROOF = (
    "authentication failed: the listener's proof does not match the client's link secret "
    "(the secrets differ)"
)


def encode_secret_option(value: str | bytes) -> str:
    """The ``aio.LinkSecret`` option value for ``value``.

    A str is written as it is; bytes, and a str that itself starts with ``hex:``, are
    written as ``hex:`` and the hexadecimal digits of their bytes.
    """
    if isinstance(value, bytes):
        return HEX_PREFIX + value.hex()
    if value.startswith(HEX_PREFIX):
        return HEX_PREFIX + value.encode("utf-8").hex()
    return value


def decode_secret_option(text: str) -> LinkSecret:
    """The secret an ``aio.LinkSecret`` value (or the environment variable) spells.

    :raises ValueError: empty, or ``hex:`` followed by no or invalid hexadecimal digits.
    """
    if text.startswith(HEX_PREFIX):
        try:
            return LinkSecret(bytes.fromhex(text[len(HEX_PREFIX) :]))
        except ValueError:
            raise ValueError("link secret after 'hex:' is not a non-empty hex string") from None
    return LinkSecret(text)


def secret_from_environment() -> LinkSecret | None:
    """The secret in :data:`SECRET_ENV`; None when it is unset or empty.

    :raises ValueError: the variable spells an invalid ``hex:`` value.
    """
    text = os.environ.get(SECRET_ENV, "")
    return decode_secret_option(text) if text else None
