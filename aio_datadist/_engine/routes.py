"""Routes: the ways a :class:`~aio_datadist._engine.request.Transfer` reaches its peer.

Each link holds an ordered list of routes, fixed when the link is made (a rank-table
domain adds its communicator's route when the domain forms); the first route that
:meth:`~Route.accepts` a transfer starts it and returns a
:class:`~aio_datadist._engine.request.Completion`. A route only moves bytes or sends a
request: sizes, offloading and who waits are the face's (its :class:`Waiting`).

For a link to cluster ``c`` the list is, in order:

=========================  ==============================================================
:class:`SameHostRoute`     host rows, one-sided against the peer's region board
                           (``process_vm_readv``/``writev``; ``_engine.onesided``)
:class:`CommunicatorRoute` device rows between members of a rank-table domain whose
                           runtime has a collective library (HCCL one-sided calls)
:class:`DeviceIpcRoute`    device rows, one-sided: the peer's shared device memory mapped
                           here (CUDA IPC), or staged around ``process_vm``
``UcxRoute``               host rows (and device rows where UCX reaches the runtime's
                           memory), one-sided by UCP RMA against the peer's UCX table
                           (``_routes.ucx.route``)
:class:`Staged` (UCX)      device rows UCX cannot reach directly, through pinned host
                           buffers around ``UcxRoute``
:class:`LinkRoute`         host rows over the link (always accepts them)
:class:`Staged` (link)     device rows over the link, through pinned host buffers (the one
                           staging wrapper, around :class:`LinkRoute`)
=========================  ==============================================================

The one-sided routes are present only when both ends share a host; the UCX routes only when
both ends enabled UCX (``aio.Ucx``) and the peer's table arrived over the link after its
handshake. A one-sided or UCX route may still decline a transfer it accepted (the board or
table does not show the cache, the kernel refused access, the UCX endpoint failed), and the
next route takes it. ``aio.SameHost = "0"`` leaves the same-host routes out, so that two
processes of one host use UCX (tests and benchmarks do).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from enum import Enum

from aio_datadist._engine.access import encode_access, encode_blocks_access
from aio_datadist._engine.domain import NO_ROWS, CommRoute
from aio_datadist._engine.onesided import PeerMemory
from aio_datadist._engine.request import Blocks, Completion, Pump, Transfer, completed
from aio_datadist._memory.staging import Staged as StagedRows
from aio_datadist._memory.staging import Staging
from aio_datadist._transport.base import Channel, Payload, RequestKind
from aio_datadist.status import LLMException

__all__ = (
    "Carrier",
    "CommunicatorRoute",
    "DeviceIpcRoute",
    "LinkRoute",
    "Route",
    "SameHostRoute",
    "Staged",
    "Waiting",
    "link_routes",
    "start_on",
    "with_carrier",
    "with_communicator",
    "without_communicator",
)


class Waiting(Enum):
    """How the face waits for a call's requests, chosen once per call.

    ``EXCHANGE``: a blocking caller with one request runs its whole round trip in its own
    thread where the link can (``Channel.exchange``). ``CALLER``: a blocking caller sends,
    then reads answers itself while it waits (``Channel.read_for``). ``LOOP_EXCHANGE``: an
    event loop with one small request and nothing else ready to run does as ``EXCHANGE``,
    busy-polling at most the link's busy-poll time (a payload still arriving then arrives
    on the loop). ``LOOP``: an event loop awaits, and may read the small answers of a link
    it watches (``Channel.watch``).
    """

    # Members are singletons compared by identity: hash them so too (``Enum.__hash__`` is
    # Python code, and members are dictionary keys and set members on every transfer).
    __hash__ = object.__hash__

    EXCHANGE = "exchange"
    CALLER = "caller"
    LOOP_EXCHANGE = "loop-exchange"
    LOOP = "loop"


class Route(ABC):
    """One way to move a transfer's bytes to or from its peer."""

    #: Short name, for logs and docs.
    name: str

    def link(self) -> Pump | None:
        """What a waiter may drive for its requests (watch, or read for): the link they
        cross, or the UCX worker that moves them; None for routes that move bytes in the
        caller."""
        return None

    @abstractmethod
    def accepts(self, transfer: Transfer) -> bool:
        """True when this route may take ``transfer`` (cheap; no I/O)."""

    def in_caller(self, transfer: Transfer) -> bool:
        """True when :meth:`start` moves the payload in the calling thread (an event loop
        then runs large ones on a worker thread)."""
        return True

    @abstractmethod
    def start(self, transfer: Transfer, deadline_ns: int, waiting: Waiting) -> Completion | None:
        """Move ``transfer``'s bytes, or send its request; None when this route declines it
        after all (nothing moved: the next route takes it).

        :raises LLMException: the transfer failed in the calling thread.
        """


#: The ways of waiting in which an event loop waits.
_ON_LOOP = frozenset({Waiting.LOOP, Waiting.LOOP_EXCHANGE})


class SameHostRoute(Route):
    """Host rows moved one-sided with a process on this host (its region board): in the
    caller, or, when an event loop waits, large ones on the native copy workers."""

    name = "same-host"

    def __init__(self, peer: PeerMemory) -> None:
        self.peer = peer

    def accepts(self, transfer: Transfer) -> bool:
        return not transfer.device and not transfer.commit and self.peer.serves(transfer.target)

    def in_caller(self, transfer: Transfer) -> bool:
        # Once the kernel let a copy through, an event loop's large copies run on the
        # native copy workers (``PeerMemory.transfer``); until then, in the caller.
        return not self.peer.proven

    def start(self, transfer: Transfer, deadline_ns: int, waiting: Waiting) -> Completion | None:
        remote, local = transfer.remote, transfer.local
        on_loop = waiting in _ON_LOOP
        if remote is not None and local.__class__ is Blocks and remote.seg == local.seg:
            return self.peer.transfer_blocks(
                transfer.kind,
                remote,
                local,
                deadline_ns,
                on_loop=on_loop,
            )
        return self.peer.transfer(
            transfer.kind, transfer.access, transfer.rows, deadline_ns, on_loop=on_loop
        )


class DeviceIpcRoute(Route):
    """Device rows moved one-sided with a process on this host: device to device through
    the peer's shared device memory, or staged around ``process_vm`` for its host memory."""

    name = "device-ipc"

    def __init__(self, peer: PeerMemory) -> None:
        self.peer = peer

    def accepts(self, transfer: Transfer) -> bool:
        return transfer.device and not transfer.commit and self.peer.serves(transfer.target)

    def start(self, transfer: Transfer, deadline_ns: int, waiting: Waiting) -> Completion | None:
        return self.peer.transfer(
            transfer.kind, transfer.access, transfer.rows, deadline_ns, local_on_device=True
        )


def _body(transfer: Transfer) -> bytes:
    """The request body naming the transfer's memory on the peer."""
    remote = transfer.remote
    if remote is not None:
        return encode_blocks_access(
            remote.model_id, remote.start, remote.count, remote.seg, remote.blocks
        )
    return encode_access(transfer.access)


def _request(
    channel: Channel,
    transfer: Transfer,
    body: bytes,
    local: Payload,
    nbytes: int,
    deadline_ns: int,
) -> Future[None]:
    if transfer.kind is RequestKind.PULL:
        return channel.pull(body, local, nbytes, deadline_ns, commit=transfer.commit)
    return channel.push(body, local, nbytes, deadline_ns)


class CommunicatorRoute(Route):
    """Device rows between members of a rank-table domain: the request names them and the
    serving side moves the bytes through the domain's communicator; the link carries only
    the request and its answer."""

    name = "communicator"

    def __init__(self, channel: Channel, member: CommRoute) -> None:
        self.channel = channel
        self.member = member

    def link(self) -> Channel | None:
        return self.channel

    def accepts(self, transfer: Transfer) -> bool:
        return transfer.device and self.member.takes(transfer.rows)

    def in_caller(self, transfer: Transfer) -> bool:
        return False

    def start(self, transfer: Transfer, deadline_ns: int, waiting: Waiting) -> Completion | None:
        body = encode_access(dataclasses.replace(transfer.access, deliver=transfer.rows))
        future = _request(self.channel, transfer, body, NO_ROWS, 0, deadline_ns)
        return completed(future, deadline_ns, self.channel)


class Carrier(Route):
    """A route that carries host rows and that :class:`Staged` may wrap for device rows."""

    #: True when :meth:`send` also takes :class:`~aio_datadist._transport.base.Segments`.
    streams: bool = False

    def takes(self, transfer: Transfer) -> bool:
        """True when the route may take ``transfer``'s request, wherever its rows live."""
        return True

    @abstractmethod
    def send(self, transfer: Transfer, local: Payload, deadline_ns: int) -> Future[None] | None:
        """Start ``transfer`` with its payload from or into the host rows ``local`` (or
        segments where the route ``streams``): its future, or None when the route declines
        it after all (nothing moved).

        :raises LLMException: the transfer failed in the calling thread.
        """


class LinkRoute(Carrier):
    """Host rows over the link: the request, and its payload streamed to or from them."""

    name = "link"

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    @property
    def streams(self) -> bool:  # type: ignore[override]
        """True where the link's channel streams segments."""
        return self.channel.streams

    def link(self) -> Pump | None:
        return self.channel

    def accepts(self, transfer: Transfer) -> bool:
        return not transfer.device

    def in_caller(self, transfer: Transfer) -> bool:
        channel = self.channel
        return (
            channel.pull_in_caller if transfer.kind is RequestKind.PULL else channel.push_in_caller
        )

    def start(self, transfer: Transfer, deadline_ns: int, waiting: Waiting) -> Completion | None:
        body = _body(transfer)
        if (
            waiting is Waiting.EXCHANGE or waiting is Waiting.LOOP_EXCHANGE
        ) and not transfer.commit:
            future = self.channel.exchange(
                transfer.kind,
                body,
                transfer.rows,
                transfer.nbytes,
                deadline_ns,
                on_loop=waiting is Waiting.LOOP_EXCHANGE,
            )
        else:
            future = _request(
                self.channel, transfer, body, transfer.rows, transfer.nbytes, deadline_ns
            )
        return completed(future, deadline_ns, self.channel)

    def send(self, transfer: Transfer, local: Payload, deadline_ns: int) -> Future[None]:
        """Send ``transfer``'s request with its payload from or into ``local`` (host rows,
        or segments where the channel streams)."""
        body = _body(transfer)
        return _request(self.channel, transfer, body, local, transfer.nbytes, deadline_ns)


class Staged(Route):
    """Device rows over a route that reaches only host memory (the link, or UCX where it
    cannot reach the runtime's memory), through pinned host buffers of the runtime:
    streamed in bounded chunks where the route streams, else staged whole (read out before
    bytes leave; written to the device once every byte arrived)."""

    def __init__(self, inner: Carrier, staging: Staging) -> None:
        self.inner = inner
        self.staging = staging
        self.name = f"staged-{inner.name}"

    def link(self) -> Pump | None:
        return self.inner.link()

    def accepts(self, transfer: Transfer) -> bool:
        return transfer.device and self.inner.takes(transfer)

    def start(self, transfer: Transfer, deadline_ns: int, waiting: Waiting) -> Completion | None:
        inner, pull = self.inner, transfer.kind is RequestKind.PULL
        if inner.streams:  # device copies overlap the socket, in bounded memory
            stream = self.staging.stream(transfer.rows, outbound=not pull)
            return completed(inner.send(transfer, stream, deadline_ns), deadline_ns, inner.link())
        staged = (
            self.staging.inbound(transfer.rows) if pull else self.staging.outbound(transfer.rows)
        )
        try:
            moved = inner.send(transfer, staged.iov, deadline_ns)
        except BaseException:
            staged.finish(False)
            raise
        if moved is None:  # declined after all: the next route takes it
            staged.finish(False)
            return None
        return completed(_finished_after(moved, staged), deadline_ns, inner.link())


def _finished_after(moved: Future[None], staged: StagedRows) -> Future[None]:
    """A future that completes once ``moved`` did and ``staged`` was finished accordingly."""
    result: Future[None] = Future()

    def finish(future: Future[None]) -> None:
        error = None if future.cancelled() else future.exception()
        ok = not future.cancelled() and error is None
        try:
            staged.finish(ok)
        except Exception as exc:
            error = error or exc
        if future.cancelled():
            result.cancel()
        elif error is not None:
            result.set_exception(error)
        else:
            result.set_result(None)

    moved.add_done_callback(finish)
    return result


def link_routes(channel: Channel, staging: Staging | None) -> list[Route]:
    """The routes of a new link, in order (a same-host peer's one-sided routes go in once
    it is proven, with :func:`with_peer_memory`; a domain's communicator route with
    :func:`with_communicator`). Without ``staging`` (an engine with no runtime) the link
    takes host rows only."""
    link = LinkRoute(channel)
    routes: list[Route] = [link]
    if staging is not None:
        routes.append(Staged(link, staging))
    return routes


def with_peer_memory(routes: Sequence[Route], peer: PeerMemory) -> list[Route]:
    """``routes`` with the one-sided routes to a same-host ``peer`` first (the peer was
    proven after the link was made; a domain's communicator route stays where it was)."""
    kept = [r for r in routes if not isinstance(r, SameHostRoute | DeviceIpcRoute)]
    at = next((i for i, r in enumerate(kept) if isinstance(r, Carrier | Staged)), len(kept))
    return [SameHostRoute(peer), *kept[:at], DeviceIpcRoute(peer), *kept[at:]]


def with_communicator(routes: Sequence[Route], route: CommunicatorRoute) -> list[Route]:
    """``routes`` with a domain's ``route`` in its place: after the host one-sided route,
    before every other route that takes device rows."""
    kept = [r for r in routes if not isinstance(r, CommunicatorRoute)]
    at = next(
        (i for i, r in enumerate(kept) if isinstance(r, DeviceIpcRoute | Carrier | Staged)),
        len(kept),
    )
    return [*kept[:at], route, *kept[at:]]


def _over_link(route: Route) -> bool:
    return isinstance(route, LinkRoute) or (
        isinstance(route, Staged) and isinstance(route.inner, LinkRoute)
    )


def with_carrier(routes: Sequence[Route], route: Carrier, staging: Staging | None) -> list[Route]:
    """``routes`` with ``route`` (the UCX route), and with ``staging`` the staging wrapper
    around it, in their place: after the one-sided and communicator routes, just before
    the link's own (a carrier of the same kind that was there goes)."""
    kind = type(route)
    kept = [
        r
        for r in routes
        if not isinstance(r, kind) and not (isinstance(r, Staged) and isinstance(r.inner, kind))
    ]
    at = next((i for i, r in enumerate(kept) if _over_link(r)), len(kept))
    added: list[Route] = [route] if staging is None else [route, Staged(route, staging)]
    return [*kept[:at], *added, *kept[at:]]


def without_communicator(routes: Sequence[Route], member: CommRoute) -> list[Route]:
    """``routes`` without the route through ``member``'s communicator."""
    return [
        r
        for r in routes
        if not (isinstance(r, CommunicatorRoute) and r.member.communicator is member.communicator)
    ]


def first_accepting(routes: Sequence[Route], transfer: Transfer) -> Route:
    """The first route that accepts ``transfer`` (the link's routes accept everything)."""
    for route in routes:
        if route.accepts(transfer):
            return route
    raise AssertionError("a link's routes accept every transfer")  # pragma: no cover


def start_on(
    routes: Sequence[Route],
    transfer: Transfer,
    deadline_ns: int,
    waiting: Waiting,
    accepting: Route | None = None,
) -> tuple[Route, Completion]:
    """Start ``transfer`` on the first route that accepts it and does not decline: that
    route and the transfer's completion. A failure in the calling thread becomes a failed
    completion (so every transfer of a call starts, and the call reports the first
    failure). ``accepting``: the first route that accepts it, when already asked."""
    for route in routes:
        if route is accepting or route.accepts(transfer):
            try:
                completion = route.start(transfer, deadline_ns, waiting)
            except LLMException as exc:
                future: Future[None] = Future()
                future.set_exception(exc)
                return route, Completion(future, deadline_ns)
            if completion is not None:
                return route, completion
    raise AssertionError("a link's routes accept every transfer")  # pragma: no cover
