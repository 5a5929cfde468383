"""The transport contract: listeners, connections (channels) and the handshake they carry.

A transport connects two engines. The engine decides everything (which links exist, what may
be read); a transport establishes channels, carries the handshake, moves request payloads
between memory described by ``(addr, len)`` rows, and reports a channel that closed.
Implementations: ``loopback`` (in-process, no sockets) and ``tcp``.

Requests on a channel: the requesting side calls :meth:`Channel.pull` or :meth:`Channel.push`
with an opaque request body (the engine's encoding of which remote memory it means) and the
local memory rows; the serving side's :class:`RequestHandler` turns the body into its own
memory rows (checking every bound) and the transport moves the bytes. Both ends of a channel
serve and request.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

import numpy as np
import numpy.typing as npt

from aio_datadist._native.serve import ServeTable
from aio_datadist._transport.auth import LinkSecret
from aio_datadist._transport.samehost import HostPresence, SameHostProof
from aio_datadist.enums import LLMRole
from aio_datadist.status import LLMStatusCode

__all__ = (
    "Acceptor",
    "Channel",
    "ChannelStats",
    "Hello",
    "Iov",
    "LinkRefused",
    "Payload",
    "Segments",
    "Listener",
    "RequestHandler",
    "RequestKind",
    "ServeLimits",
    "Served",
    "Transport",
)

#: Memory rows ``(addr, len)``: a C-contiguous ``(n, 2)`` uint64 array, in payload order.
Iov = npt.NDArray[np.uint64]


class Segments(Protocol):
    """A payload handed out as host rows one piece at a time, in payload order.

    A stream-based transport reads (or fills) each piece before taking the next; device
    memory streams through pinned chunks this way (``_memory.staging.Streamed``). Taking the
    next piece may commit the previous one, so a transport takes every piece on success and
    closes the iterator early on failure.
    """

    #: The payload's size in bytes.
    nbytes: int

    def segments(self) -> Generator[Iov, None, None]:
        """The pieces (close the generator when stopping early)."""
        ...


#: The local side of a payload: memory rows, or (on channels that ``stream``) segments.
Payload = Iov | Segments


@dataclass(frozen=True, slots=True)
class Hello:
    """What each side of a new link tells the other."""

    cluster_id: int
    role: LLMRole
    #: The cluster the sender means to reach (set by the connecting side), so a server at
    #: the wrong address refuses before it registers anything.
    to_cluster_id: int | None = None
    #: The sender's same-host offer (``samehost``), when it offers one-sided access.
    presence: HostPresence | None = None
    #: The communication domain a connecting side links for (rank-table ``link``): a rank
    #: endpoint that several domains share hands the link to that domain's member.
    comm: str | None = None
    #: The route providers' offers (``aio_datadist._routes``): extension records the
    #: transport carries without reading them, as ``(record type, body)`` by type.
    offers: tuple[tuple[int, bytes], ...] = ()

    def offered(self, kind: int) -> bytes | None:
        """The body of the sender's offer of record type ``kind`` (None: it made none)."""
        for offer_kind, body in self.offers:
            if offer_kind == kind:
                return body
        return None

    def offering(self, kind: int, body: bytes) -> Hello:
        """This handshake with the offer ``kind`` set to ``body``."""
        kept = [(k, b) for k, b in self.offers if k != kind]
        return replace(self, offers=tuple(sorted([*kept, (kind, body)])))


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """How much of the peer's work one link may hold before it stops reading the peer's
    requests (a stream transport; TCP). Reading goes on once the link's sender has drained
    to half of both; while this side awaits answers of its own on the link, both limits
    count twice (those answers may wait behind the peer's requests)."""

    #: Bytes of queued frames held in memory: each frame's control bytes plus 16 bytes for
    #: every row of its payload's row table (the payload itself is read from the cache as it
    #: goes out, and costs nothing while it waits).
    queued_bytes: int = 64 << 20
    #: The peer's requests whose answers are not yet fully sent.
    requests: int = 4096

    def __post_init__(self) -> None:
        if self.queued_bytes < 1 or self.requests < 1:
            raise ValueError(f"serve limits must be positive: {self}")


@dataclass(frozen=True, slots=True)
class ChannelStats:
    """A snapshot of how a channel serves its peer: the work it holds and the pauses of its
    reading (all zero on a transport with no queue)."""

    #: Bytes held by frames waiting for the sender or being sent (see :class:`ServeLimits`).
    queued_bytes: int = 0
    #: The most :attr:`queued_bytes` ever held.
    queued_bytes_max: int = 0
    #: The peer's requests taken and not yet fully answered.
    requests: int = 0
    #: The most :attr:`requests` ever in flight.
    requests_max: int = 0
    #: Times reading the peer's requests paused over a limit.
    pauses: int = 0
    #: Seconds spent paused, a pause under way included.
    paused_s: float = 0.0
    #: True while reading is paused.
    paused: bool = False


class LinkRefused(Exception):
    """A link could not be made; ``status`` is the documented code to report for it."""

    def __init__(self, status: LLMStatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status


class RequestKind(Enum):
    """What a request asks of the serving side's memory."""

    # Members are singletons compared by identity: hash them so too (``Enum.__hash__`` is
    # Python code, and members are dictionary keys and set members on every transfer).
    __hash__ = object.__hash__

    PULL = "pull"  # read: the serving side sends the bytes of its rows
    PUSH = "push"  # write: the serving side receives the bytes into its rows


@dataclass(eq=False)
class Served:
    """The serving side's answer to a request: which of its memory rows move.

    ``done(ok)`` is called exactly once, when the transport no longer touches ``iov``
    (``ok``: every byte moved); when it raises after a push, the push failed and the
    requester is answered with the error instead of success. ``commit`` (pulls only) is
    called at most once, after the requester confirmed that every byte landed; a pull that
    drops the remote key uses it.
    """

    iov: Iov
    nbytes: int
    done: Callable[[bool], None]
    commit: Callable[[], None] | None = field(default=None)
    #: Set when the handler was asked to ``stream``: the payload as segments; ``iov`` is
    #: then not to be used.
    stream: Segments | None = field(default=None)


class RequestHandler(Protocol):
    """The engine's serving side, handed to the transport with every channel."""

    @property
    def serve_table(self) -> ServeTable | None:
        """The small blocks requests the transport may answer in native code without
        asking :meth:`serve` (``_native.serve``); None when the handler offers none."""
        ...

    def serve(
        self, peer: Hello, kind: RequestKind, body: bytes, nbytes: int, *, stream: bool = False
    ) -> Served:
        """Resolve a request ``body`` from ``peer`` into this side's memory rows.

        ``peer`` is the requesting channel's own :attr:`Channel.peer` (the same object for
        every request of one channel), so a handler may tell links apart by it.

        ``nbytes`` is the payload size the requester expects; the rows must add up to it.
        With ``stream`` (a stream-based transport asking) memory that needs staging may come
        back as ``Served.stream``.

        :raises LLMException: the request is refused; its ``status_code`` is answered to the
            requester (``LLM_KV_CACHE_NOT_EXIST``, ``LLM_PARAM_INVALID``, ...).
        """
        ...


class Channel(ABC):
    """One established connection between two engines, usable in both directions."""

    #: The peer's handshake.
    peer: Hello
    #: The peer's address as this side sees it, for messages ("" when there is none).
    remote: str = ""
    #: True when both ends proved that they hold the same link secret (``auth``).
    authenticated: bool = False
    #: The peer's process on this host once the kernel proved it (``samehost``); None when
    #: neither end offers same-host access over this channel.
    same_host: SameHostProof | None = None
    #: True when :meth:`pull` moves the payload in the calling thread before it returns
    #: (so an event loop should call it from a worker thread for large payloads).
    pull_in_caller: bool = False
    #: The same for :meth:`push`.
    push_in_caller: bool = False
    #: True when :meth:`pull` and :meth:`push` also take :class:`Segments` as the local side.
    streams: bool = False
    #: True when a loop that awaits a request watches the channel from before it goes out
    #: (:meth:`watch` does something).
    watched: bool = False

    @property
    def close_reason(self) -> str | None:
        """Why the channel closed, in words that name who closed it (None while open)."""
        return None

    @property
    def unlinked_by_peer(self) -> bool:
        """True once the peer closed it on purpose to remove the link at both ends (a
        graceful unlink), as opposed to finalizing, failing or dropping only its end."""
        return False

    @abstractmethod
    def pull(
        self, body: bytes, dst: Payload, nbytes: int, deadline_ns: int, *, commit: bool = False
    ) -> Future[None]:
        """Ask the peer for the memory ``body`` names and land its bytes in the rows ``dst``
        (rows, or segments where the channel ``streams``).

        ``nbytes`` is the sum of ``dst``'s lengths; ``deadline_ns`` an absolute
        ``monotonic_ns()`` time. With ``commit`` the peer's ``Served.commit`` runs once every
        byte landed here. The future completes only when the transport no longer touches
        ``dst``: with None on success, else with an ``LLMException`` carrying the peer's
        refusal code, ``LLM_TIMEOUT`` (deadline), or ``LLM_LINK_FAILED`` (channel broke).
        """

    @abstractmethod
    def push(self, body: bytes, src: Payload, nbytes: int, deadline_ns: int) -> Future[None]:
        """Write the bytes of the rows ``src`` (or segments where the channel ``streams``)
        into the peer memory ``body`` names.

        The future completes with None once the peer confirmed that every byte is in its
        memory, or with an ``LLMException`` as for :meth:`pull`. ``src`` is no longer read
        once the future completed.
        """

    def watch(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        """Let ``loop`` (running in the calling thread) help complete the requests it awaits
        until the returned call ends the watch; None when the transport does not.

        A transport that can read its own answers (TCP) lets the loop take small answers
        itself while watched, saving the reader thread's wake-up and the hand-over.
        """
        return None

    def read_for(self, future: Future[None], deadline_ns: int) -> None:
        """Help ``future`` (a request of this channel) complete in the calling thread, which
        would otherwise just wait for it; return when it completed or the helping stopped.

        A transport that can read its own answers (TCP) busy-polls the connection for a
        short while and handles what arrives here, saving the hand-over from its reader
        thread. The default does nothing: the caller then waits as usual.
        """
        return

    def spin(self, future: Future[None], deadline_ns: int) -> None:
        """Help ``future`` (a request of this channel) complete in the calling thread, an
        event loop with nothing else to run that watches this channel (:meth:`watch`), for
        at most the busy-poll time; what is still to come then arrives on the loop.

        A transport that can read its own answers (TCP) busy-polls the connection; the
        default does nothing.
        """
        return

    @abstractmethod
    def close(
        self, *, notify_peer: bool, timeout: float | None = None, finalizing: bool = False
    ) -> bool:
        """Close this end. With ``notify_peer`` tell the peer to drop its end too: as an
        unlink (its end goes, :attr:`unlinked_by_peer`), or with ``finalizing`` as an engine
        that goes away (its end fails).

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

    def stats(self) -> ChannelStats:
        """How this end serves its peer now (:class:`ChannelStats`)."""
        return ChannelStats()


class Acceptor(Protocol):
    """The serving engine's side of a handshake, and the handler of its channels' requests."""

    @property
    def handler(self) -> RequestHandler:
        """Serves requests arriving on accepted channels."""
        ...

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

    #: The link secret peers must prove (None: links are not authenticated). Both ends of
    #: a link must have the same secret, or both none; otherwise the link is refused with
    #: ``LLM_LINK_FAILED``.
    secret: LinkSecret | None = None

    @abstractmethod
    def listen(self, host: str, port: int, acceptor: Acceptor) -> Listener:
        """Listen on ``host:port`` and hand every handshake to ``acceptor``.

        A client that fails authentication is refused before ``acceptor`` sees it.

        :raises OSError: the address cannot be used (in use, not local).
        """

    @abstractmethod
    def listen_shared(
        self, host: str, port: int, route: tuple[str, int], acceptor: Acceptor, timeout: float
    ) -> Listener:
        """Listen on a rank endpoint that the communication domains of this host share.

        Links whose HELLO names ``route`` (domain name, this side's cluster id) reach
        ``acceptor``; the others reach the domain they name, in this process or another
        (``rendezvous``). Closing the listener removes the route; the endpoint goes with
        its last one. ``timeout`` bounds waiting for another process to hand it over.

        :raises LinkRefused: ``LLM_LINK_FAILED``: the address is taken by something else,
            or the route is taken.
        """

    @abstractmethod
    def connect(
        self, host: str, port: int, hello: Hello, handler: RequestHandler, timeout: float
    ) -> Channel:
        """Connect to the listener at ``host:port`` and exchange handshakes.

        ``handler`` serves the requests the peer sends on the new channel.

        :raises LinkRefused: with ``LLM_LINK_FAILED`` (nobody listens, authentication
            failed, handshake refused or broken) or ``LLM_TIMEOUT`` (no answer within
            ``timeout`` seconds), or the code the acceptor refused with.
        """
