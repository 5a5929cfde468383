"""The transport contract: listeners, connections (channels) and the handshake they carry.

A transport connects two engines. The engine decides everything (which links exist, what may
be read); a transport only establishes channels, carries the handshake, and reports a channel
that closed. Implementations: ``loopback`` (in-process, no sockets) and ``tcp``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from aio_datadist.enums import LLMRole
from aio_datadist.status import LLMStatusCode

__all__ = ("Acceptor", "Channel", "Hello", "LinkRefused", "Listener", "Transport")


@dataclass(frozen=True, slots=True)
class Hello:
    """What each side of a new link tells the other."""

    cluster_id: int
    role: LLMRole
    #: The cluster the sender means to reach (set by the connecting side), so a server at
    #: the wrong address refuses before it registers anything.
    to_cluster_id: int | None = None


class LinkRefused(Exception):
    """A link could not be made; ``status`` is the documented code to report for it."""

    def __init__(self, status: LLMStatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status


class Channel(ABC):
    """One established connection between two engines, usable in both directions."""

    #: The peer's handshake.
    peer: Hello

    @abstractmethod
    def close(self, *, notify_peer: bool, timeout: float | None = None) -> bool:
        """Close this end. With ``notify_peer`` tell the peer to drop its end too.

        Returns False when the peer could not be told (it is gone or did not answer within
        ``timeout`` seconds); this end is closed either way. Idempotent.
        """

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once either end closed the channel."""

    @abstractmethod
    def on_close(self, callback: Callable[[Channel], None]) -> None:
        """Call ``callback(channel)`` once when the peer closes its end or the channel breaks."""


class Acceptor(Protocol):
    """The serving engine's side of a handshake."""

    def accept(self, peer: Hello, channel: Channel) -> Hello:
        """Register ``channel`` as a link to ``peer`` and return this side's handshake.

        :raises LinkRefused: the link is refused (e.g. ``LLM_ALREADY_LINK``).
        """
        ...


class Listener(ABC):
    """A listening endpoint; closing it stops new links, existing ones stay."""

    #: ``(host, port)`` actually listened on.
    address: tuple[str, int]

    @abstractmethod
    def close(self) -> None:
        """Stop listening and free the address at once. Idempotent."""


class Transport(ABC):
    """Makes listeners and channels of one kind."""

    #: Registered name, the value of the ``aio.Transport`` option.
    name: str

    @abstractmethod
    def listen(self, host: str, port: int, acceptor: Acceptor) -> Listener:
        """Listen on ``host:port`` and hand every handshake to ``acceptor``.

        :raises OSError: the address cannot be used (in use, not local).
        """

    @abstractmethod
    def connect(self, host: str, port: int, hello: Hello, timeout: float) -> Channel:
        """Connect to the listener at ``host:port`` and exchange handshakes.

        :raises LinkRefused: with ``LLM_LINK_FAILED`` (nobody listens, handshake refused or
            broken) or ``LLM_TIMEOUT`` (no answer within ``timeout`` seconds), or the code
            the acceptor refused with.
        """
