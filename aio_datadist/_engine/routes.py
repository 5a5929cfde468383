"""Routes: the ways a :class:`~aio_datadist._engine.request.Transfer` reaches its peer.

Each link holds a list of routes in :attr:`Route.rank` order; the first route that
:meth:`~Route.accepts` a transfer starts it and returns a
:class:`~aio_datadist._engine.request.Completion`. A route only moves bytes or sends a
request: sizes, offloading and how to wait are the face's (it waits on the completion,
which drives its own :class:`~aio_datadist._engine.request.Pump`).

A new link starts with the link's own routes (:func:`link_routes`); the route providers
(``aio_datadist._routes``) and a rank-table domain place theirs beside them
(:func:`placed`) when their part with the peer is ready. The ranks, lowest first:

====  =========================  ===========================================================
10    ``same-host``              host rows, one-sided against the peer's region board
                                 (``_routes.samehost``)
20    ``communicator``           device rows between members of a rank-table domain whose
                                 runtime has a collective library (HCCL one-sided calls)
30    ``device-ipc``             device rows, one-sided: the peer's shared device memory
                                 mapped here (CUDA IPC), or staged around ``process_vm``
40    ``ucx``                    host rows (and device rows where UCX reaches the runtime's
                                 memory), by UCP RMA against the peer's table
                                 (``_routes.ucx``)
45    ``staged-ucx``             device rows UCX cannot reach, through pinned host buffers
50    :class:`LinkRoute`         host rows over the link (always accepts them)
55    ``staged-link``            device rows over the link, through pinned host buffers (the
                                 one staging wrapper, :class:`Staged`)
====  =========================  ===========================================================

A one-sided or UCX route may still decline a transfer it accepted (the board or table does
not show the cache, the kernel refused access, the UCX endpoint failed), and the next route
takes it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future

from aio_datadist._engine.access import encode_access, encode_blocks_access
from aio_datadist._engine.request import Completion, Pump, Transfer, completed
from aio_datadist._memory.staging import Staged as StagedRows
from aio_datadist._memory.staging import Staging
from aio_datadist._transport.base import Channel, Payload, RequestKind
from aio_datadist.status import LLMException

__all__ = (
    "Carrier",
    "LinkRoute",
    "Route",
    "Staged",
    "link_routes",
    "placed",
    "send_request",
    "start_on",
)


class Route(ABC):
    """One way to move a transfer's bytes to or from its peer."""

    #: Short name, for logs and docs.
    name: str
    #: Its place in a link's list: a transfer goes to the first route (lowest rank) that
    #: takes it, so a route that moves bytes itself ranks before the link's.
    rank: int

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
    def start(self, transfer: Transfer, deadline_ns: int) -> Completion | None:
        """Move ``transfer``'s bytes, or send its request; None when this route declines it
        after all (nothing moved: the next route takes it). Who waits for it, and how, is
        the face's: the completion's pump helps whoever waits.

        :raises LLMException: the transfer failed in the calling thread.
        """


def _body(transfer: Transfer) -> bytes:
    """The request body naming the transfer's memory on the peer."""
    remote = transfer.remote
    if remote is not None:
        return encode_blocks_access(
            remote.model_id, remote.start, remote.count, remote.seg, remote.blocks
        )
    return encode_access(transfer.access)


def send_request(
    channel: Channel,
    transfer: Transfer,
    body: bytes,
    local: Payload,
    nbytes: int,
    deadline_ns: int,
) -> Future[None]:
    """Send ``transfer``'s request over ``channel`` with ``body`` naming the peer's memory:
    a pull into ``local`` or a push from it; its future."""
    if transfer.kind is RequestKind.PULL:
        return channel.pull(body, local, nbytes, deadline_ns, commit=transfer.commit)
    return channel.push(body, local, nbytes, deadline_ns)


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
    rank = 50

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

    def start(self, transfer: Transfer, deadline_ns: int) -> Completion | None:
        future = send_request(
            self.channel, transfer, _body(transfer), transfer.rows, transfer.nbytes, deadline_ns
        )
        return completed(future, deadline_ns, self.channel)

    def send(self, transfer: Transfer, local: Payload, deadline_ns: int) -> Future[None]:
        """Send ``transfer``'s request with its payload from or into ``local`` (host rows,
        or segments where the channel streams)."""
        body = _body(transfer)
        return send_request(self.channel, transfer, body, local, transfer.nbytes, deadline_ns)


class Staged(Route):
    """Device rows over a route that reaches only host memory (the link, or UCX where it
    cannot reach the runtime's memory), through pinned host buffers of the runtime:
    streamed in bounded chunks where the route streams, else staged whole (read out before
    bytes leave; written to the device once every byte arrived)."""

    def __init__(self, inner: Carrier, staging: Staging) -> None:
        self.inner = inner
        self.staging = staging
        self.name = f"staged-{inner.name}"
        #: Just after the route it stages for.
        self.rank = inner.rank + 5

    def link(self) -> Pump | None:
        return self.inner.link()

    def accepts(self, transfer: Transfer) -> bool:
        return transfer.device and self.inner.takes(transfer)

    def start(self, transfer: Transfer, deadline_ns: int) -> Completion | None:
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


def placed(
    routes: Sequence[Route], added: Sequence[Route], drop: type | tuple[type, ...] = ()
) -> list[Route]:
    """``routes`` less those of a type in ``drop`` (with the :class:`Staged` wrappers around
    them), plus ``added``, in :attr:`Route.rank` order (routes of one rank keep their order).
    A route list is never changed in place: a link swaps it whole."""

    def dropped(route: Route) -> bool:
        return isinstance(route, drop) or (
            isinstance(route, Staged) and isinstance(route.inner, drop)
        )

    return sorted([*(r for r in routes if not dropped(r)), *added], key=lambda r: r.rank)


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
    accepting: Route | None = None,
) -> tuple[Route, Completion]:
    """Start ``transfer`` on the first route that accepts it and does not decline: that
    route and the transfer's completion. A failure in the calling thread becomes a failed
    completion (so every transfer of a call starts, and the call reports the first
    failure). ``accepting``: the first route that accepts it, when already asked."""
    for route in routes:
        if route is accepting or route.accepts(transfer):
            try:
                completion = route.start(transfer, deadline_ns)
            except LLMException as exc:
                future: Future[None] = Future()
                future.set_exception(exc)
                return route, Completion(future, deadline_ns)
            if completion is not None:
                return route, completion
    raise AssertionError("a link's routes accept every transfer")  # pragma: no cover
