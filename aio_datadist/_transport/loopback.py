"""The loopback transport: engines in one process link by address, with no sockets.

Real code, not a mock: listeners occupy addresses, handshakes run the peer's acceptor,
closing one end is seen by the other, and a vanished listener refuses links. Async test
suites run every link and transfer scenario over it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from aio_datadist._transport.base import Acceptor, Channel, Hello, LinkRefused, Listener, Transport
from aio_datadist.status import LLMStatusCode

__all__ = ("LoopbackChannel", "LoopbackTransport")

_lock = threading.Lock()
_listeners: dict[tuple[str, int], LoopbackListener] = {}


class LoopbackChannel(Channel):
    """One end of an in-process channel."""

    def __init__(self, peer: Hello) -> None:
        self.peer = peer
        self.other: LoopbackChannel | None = None
        self._closed = False
        self._callbacks: list[Callable[[Channel], None]] = []
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    def on_close(self, callback: Callable[[Channel], None]) -> None:
        with self._lock:
            if not self._closed:
                self._callbacks.append(callback)
                return
        callback(self)

    def _shut(self) -> list[Callable[[Channel], None]]:
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def close(self, *, notify_peer: bool, timeout: float | None = None) -> bool:
        self._shut()
        other = self.other
        if not notify_peer or other is None:
            return True
        for callback in other._shut():
            callback(other)
        return True


class LoopbackListener(Listener):
    """An address in the process-wide loopback table."""

    def __init__(self, address: tuple[str, int], acceptor: Acceptor) -> None:
        self.address = address
        self.acceptor = acceptor

    def close(self) -> None:
        with _lock:
            if _listeners.get(self.address) is self:
                del _listeners[self.address]


class LoopbackTransport(Transport):
    """In-process links between engines, found by their listen address."""

    name = "loopback"

    def listen(self, host: str, port: int, acceptor: Acceptor) -> Listener:
        address = (host, port)
        with _lock:
            if address in _listeners:
                raise OSError(f"loopback address {host}:{port} is already in use")
            listener = _listeners[address] = LoopbackListener(address, acceptor)
        return listener

    def connect(self, host: str, port: int, hello: Hello, timeout: float) -> Channel:
        with _lock:
            listener = _listeners.get((host, port))
        if listener is None:
            raise LinkRefused(
                LLMStatusCode.LLM_LINK_FAILED, f"nobody listens on loopback {host}:{port}"
            )
        client = LoopbackChannel(peer=hello)  # peer filled in below
        server = LoopbackChannel(peer=hello)
        client.other, server.other = server, client
        client.peer = listener.acceptor.accept(hello, server)
        return client
