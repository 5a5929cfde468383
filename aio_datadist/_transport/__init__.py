"""Transports: how two endpoints exchange control frames and bulk KV bytes."""

from __future__ import annotations

from aio_datadist._transport._wire import MAX_PAYLOAD, WireError
from aio_datadist._transport.auth import LinkSecret
from aio_datadist._transport.base import Transport
from aio_datadist._transport.deadlines import after_s

__all__ = (
    "DEFAULT_BUSY_POLL_US",
    "DEFAULT_TRANSPORT",
    "MAX_PAYLOAD",
    "WireError",
    "after_s",
    "make_transport",
)

#: The transport used when the ``aio.Transport`` option is not set.
DEFAULT_TRANSPORT = "tcp"
#: Microseconds a TCP link busy-polls for a frame it expects (``aio.BusyPollUs`` unset).
DEFAULT_BUSY_POLL_US = 200


def make_transport(
    name: str | None, secret: LinkSecret | None = None, *, busy_poll_us: int = DEFAULT_BUSY_POLL_US
) -> Transport:
    """A new transport of the registered ``name`` (``"tcp"`` when None).

    With ``secret`` its links are authenticated (both ends must hold the same secret).
    ``busy_poll_us`` sets how long TCP links busy-poll.

    :raises ValueError: unknown name (options are validated before this is called).
    """
    name = name or DEFAULT_TRANSPORT
    if name == "loopback":
        from aio_datadist._transport.loopback import LoopbackTransport

        return LoopbackTransport(secret=secret)
    if name == "tcp":
        from aio_datadist._transport.tcp_connect import TcpTransport

        return TcpTransport(secret=secret, busy_poll_us=busy_poll_us)
    raise ValueError(f"unknown transport {name!r}")
