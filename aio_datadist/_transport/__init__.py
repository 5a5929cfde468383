"""Transports: how two endpoints exchange control frames and bulk KV bytes."""

from __future__ import annotations

from aio_datadist._transport.base import Transport

__all__ = ("DEFAULT_TRANSPORT", "make_transport")

#: The transport used when the ``aio.Transport`` option is not set.
DEFAULT_TRANSPORT = "tcp"


def make_transport(name: str | None) -> Transport:
    """A new transport of the registered ``name`` (``"tcp"`` when None).

    :raises ValueError: unknown name (options are validated before this is called).
    """
    name = name or DEFAULT_TRANSPORT
    if name == "loopback":
        from aio_datadist._transport.loopback import LoopbackTransport

        return LoopbackTransport()
    if name == "tcp":
        from aio_datadist._transport.tcp import TcpTransport

        return TcpTransport()
    raise ValueError(f"unknown transport {name!r}")
