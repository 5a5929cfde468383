"""The UCX route of one engine: its UCX context and worker, and the route's control plane over
each link.

An engine made with ``aio.Ucx = "1"`` owns one UCP context and one worker
(``UCS_THREAD_MODE_MULTI``; ``_routes.ucx.route.UcxProgress`` drives it), ``aio.UcxLanes - 1``
further workers with a thread each that move parts of large transfers (``_routes.ucx.lanes``),
its table
(``_routes.ucx.board``) and, per link whose two ends offered UCX in their handshake, a
:class:`_Peer`: this side's subscription to the board and the peer's table as applied here
(``_routes.ucx.remote``).

Control plane. Nothing UCX crosses before a link's handshake is complete (and authenticated
when the engines have a link secret); then everything crosses the link as two kinds of push
(``_native/wire.h``):

* ``UCX_TABLE`` (ident = sequence, payload = the table): the side that made the link sends
  its table once the link is up; the other side answers with its own on the first one it
  gets. From then on each side sends its new table after every change of what it publishes.
  The receiver applies a table as it arrives (the push is answered once it did) and adds the
  UCX route to the link with the first one.
* ``UCX_ACK`` (ident = sequence, no payload): the receiver of table ``N`` applied it and no
  transfer it started under an older table is in flight; the sender may now free what ``N``
  withdrew (``_routes.ucx.board``).

Pushes go out on one control thread per engine (``aio-dd-ucx-control``), never from a link's
reader thread nor under the registry's lock; it also breaks the link of a peer that did not
acknowledge in time. Requests that arrive on a link whose ends did not both offer UCX are
refused with ``LLM_FEATURE_NOT_ENABLED``.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog

from aio_datadist._engine.access import NO_ROWS, Access, Target, encode_access
from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.routes import Staged, placed
from aio_datadist._log import get_logger
from aio_datadist._native import wire
from aio_datadist._routes.provider import LinkHandle, Opening, RouteProvider
from aio_datadist._routes.ucx import board as ucxboard
from aio_datadist._routes.ucx.board import Subscriber, UcxBoard
from aio_datadist._routes.ucx.lanes import CROSS_MEMORY, UcxLane
from aio_datadist._routes.ucx.remote import UcxRemote
from aio_datadist._routes.ucx.route import UcxProgress, UcxRoute
from aio_datadist._routes.ucx.table import decode_table, host_identity
from aio_datadist._routes.ucx.worker import UcxContext, UcxWorker, available
from aio_datadist._transport import WireError
from aio_datadist._transport._wire import HelloExtension
from aio_datadist._transport.base import Channel, Hello, RequestKind, Served
from aio_datadist._transport.samehost import local_host_key
from aio_datadist.config import OPTION_UCX
from aio_datadist.status import (
    FeatureNotEnabledError,
    LLMException,
    LLMFailedError,
    LLMStatusCode,
    ParamInvalidError,
)

__all__ = ("CONTROL_TIMEOUT_S", "UcxLinks", "open_ucx")

#: Seconds a control push (a table, an acknowledgement) may take.
CONTROL_TIMEOUT_S = 10.0
#: This side's UCX offer in the handshake: the table version it speaks.
_OFFER = bytes((wire.UCX_VERSION,))

_S = LLMStatusCode


def _refused(message: str) -> FeatureNotEnabledError:
    return FeatureNotEnabledError(message, status_code=_S.LLM_FEATURE_NOT_ENABLED)


def _invalid(message: str) -> ParamInvalidError:
    return ParamInvalidError(message, status_code=_S.LLM_PARAM_INVALID)


@dataclass(eq=False)
class _Peer:
    """The UCX side of one link."""

    channel: Channel
    sub: Subscriber
    remote: UcxRemote
    #: Called with the route once the peer's first table applied (adds it to the link).
    ready: Callable[[UcxRoute], None]
    #: Called with a reason to break the link (it did not acknowledge in time).
    fail: Callable[[str], None]
    subscribed: bool = False
    #: The sequence of the table sent last.
    sent: int = 0
    closed: bool = False
    #: The highest of this side's tables the peer acknowledged, not yet handed to the board.
    peer_acked: int = 0
    #: The highest of the peer's tables this side may acknowledge, not yet sent.
    to_ack: int = 0
    #: Set once the peer's first table applied (or the route failed, or closed).
    applied: threading.Event = field(default_factory=threading.Event)


class UcxLinks(RouteProvider):
    """The UCX route of one engine (see the module docstring); a blocking waiter busy-polls
    its worker for ``busy_poll_us`` before it sleeps, as a link's does (``aio.BusyPollUs``).

    :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` when UCX cannot be loaded, or the code
        of UCX's failure to start.
    """

    def __init__(
        self,
        caches: CacheService,
        log: structlog.stdlib.BoundLogger,
        *,
        name: str = "aio-dd",
        lanes: int = 1,
        busy_poll_us: int = 0,
    ) -> None:
        self._log = log
        self._staging = caches.staging
        self.context = UcxContext(name=name)
        try:
            self.worker = UcxWorker(self.context, name=name)
        except BaseException:
            self.context.close()
            raise
        try:
            cuda = "cuda" in self.context.memory_types and caches.runtime.name == "cuda"
            self.host = host_identity(local_host_key())
            #: UCX reads and writes other processes' memory here (cma, knem, xpmem).
            self.cross_memory = any(
                tl.split("/")[0] in CROSS_MEMORY for tl in self.context.transports()
            )
            self.progress = UcxProgress(self.worker, log, spin_ns=busy_poll_us * 1000)
        except BaseException:
            self.worker.close()
            self.context.close()
            raise
        #: The workers beside :attr:`worker` that move parts of large transfers.
        self.lanes: list[UcxLane] = []
        try:
            for index in range(1, lanes):
                self.lanes.append(UcxLane(self.context, index, name=name))
            self.board = UcxBoard(
                self.context, caches, self.worker.address(), self.host, log, cuda=cuda
            )
        except BaseException:
            self._close_lanes()
            self.progress.close()
            self.worker.close()
            self.context.close()
            raise
        #: UCX reaches the runtime's device memory (it offers CUDA memory, the runtime is
        #: CUDA's, and the device pool registered as such): device rows go to UCX directly.
        self.cuda = self.board.cuda
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._peers: dict[int, tuple[Hello, _Peer]] = {}  # by id() of the channel's peer
        self._jobs: collections.deque[tuple[str, _Peer]] = collections.deque()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="aio-dd-ucx-control", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            self._close_lanes()
            self.progress.close()
            self.board.close()
            self.worker.close()
            self.context.close()
            raise
        log.info(
            "ucx.ready",
            cuda=self.cuda,
            cross_memory=self.cross_memory,
            memory_types=sorted(self.context.memory_types),
            lanes=1 + len(self.lanes),
        )

    # -- links ---------------------------------------------------------------------------
    def offer(self, hello: Hello) -> Hello:
        """This side's handshake, offering the UCX route."""
        return hello.offering(HelloExtension.UCX, _OFFER)

    def attach(self, link: LinkHandle) -> None:
        """Take part in the UCX control plane of a new link whose peer offered UCX too.

        The UCX route (and its staging wrapper) goes into the link once the peer's table
        arrived; a peer that fails the protocol has the link broken. The side that made the
        link sends its table once :meth:`established` says the link is up.
        """
        channel = link.channel
        # A UCX offer of another table version is no offer: the link goes without the route.
        if (channel.peer.offered(HelloExtension.UCX) or b"")[:1] != _OFFER:
            return
        staging = self._staging

        def ready(route: UcxRoute) -> None:
            link.place(lambda routes: placed(routes, (route, Staged(route, staging)), UcxRoute))

        name = f"cluster {channel.peer.cluster_id}"
        log = self._log.bind(remote_cluster_id=channel.peer.cluster_id)
        made: list[_Peer] = []  # the peer, for the callbacks of its parts
        remote = UcxRemote(
            self.worker,
            self.host,
            lambda seq: self._ours_to_ack(made, seq),
            log,
            cross_memory=self.cross_memory,
            lanes=self.lanes,
        )
        sub = Subscriber(name, notify=lambda: self._queue("table", made))
        peer = _Peer(channel, sub, remote, ready, link.fail)
        made.append(peer)
        with self._lock:
            old = self._peers.get(id(channel.peer))
            self._peers[id(channel.peer)] = (channel.peer, peer)
        if old is not None and old[1].channel is not channel:
            self._close(old[1], "the link was replaced")

    def established(self, link: LinkHandle, timeout: float) -> None:
        """The link this side made is registered: send the table, and wait up to
        ``timeout`` seconds for the peer's (:meth:`start`)."""
        self.start(link.channel, timeout)

    def start(self, channel: Channel, timeout: float) -> bool:
        """The link this side made is up: subscribe the peer (it is sent the table), and wait
        up to ``timeout`` seconds for the peer's table; whether the route is ready (a link
        whose table comes later gets the route then)."""
        peer = self._peer(channel.peer)
        if peer is None:
            return False
        self._subscribe(peer)
        if peer.applied.wait(timeout):
            return peer.remote.usable
        self._log.info(
            "ucx.not_ready",
            remote_cluster_id=channel.peer.cluster_id,
            waited_s=round(timeout, 3),
            note="transfers use the link until the peer's UCX table comes",
        )
        return False

    def detach(self, channel: Channel) -> None:
        """The link closed (or is being closed): stop the route, release what the peer held."""
        with self._lock:
            found = self._peers.get(id(channel.peer))
            if found is None or found[1].channel is not channel:
                return
            del self._peers[id(channel.peer)]
        self._close(found[1], "the link closed")

    def _close(self, peer: _Peer, reason: str) -> None:
        peer.closed = True
        peer.applied.set()
        self.board.unsubscribe(peer.sub)
        peer.remote.close(reason)
        # Its requests in flight completed (cancelled) as the endpoint closed: no waiter may
        # be woken for that, so their batches complete here.
        self.progress.poll()

    def _peer(self, hello: Hello) -> _Peer | None:
        with self._lock:
            found = self._peers.get(id(hello))
        return None if found is None or found[0] is not hello else found[1]

    def _subscribe(self, peer: _Peer) -> None:
        with self._lock:
            if peer.subscribed or peer.closed:
                return
            peer.subscribed = True
        self.board.subscribe(peer.sub)

    def route_of(self, channel: Channel) -> UcxRemote | None:
        """The peer's table as applied on ``channel``'s link (None: no UCX there)."""
        peer = self._peer(channel.peer)
        return None if peer is None else peer.remote

    # -- the control plane, serving side -------------------------------------------------
    def serve(self, hello: Hello, kind: RequestKind, access: Access, nbytes: int) -> Served:
        """Serve a ``UCX_TABLE`` or ``UCX_ACK`` push from ``hello``'s link.

        :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` on a link without UCX,
            ``LLM_PARAM_INVALID`` for a malformed request or table.
        """
        peer = self._peer(hello)
        if peer is None:
            raise _refused(
                f"cluster {hello.cluster_id} sent a UCX {access.target.name} on a link "
                "without UCX (both ends must enable aio.Ucx)"
            )
        if kind is not RequestKind.PUSH:
            raise _invalid(f"a UCX {access.target.name} is a push, not a {kind.value}")
        if access.target is Target.UCX_ACK:
            if nbytes:
                raise _invalid("a UCX acknowledgement carries no payload")
            seq = access.ident
            return Served(NO_ROWS, 0, lambda ok: self._acked_by_peer(peer, seq) if ok else None)
        if not 0 < nbytes <= wire.UCX_MAX_TABLE:
            raise _invalid(f"a UCX table of {nbytes} bytes (1 to {wire.UCX_MAX_TABLE})")
        buf = np.empty(nbytes, dtype=np.uint8)
        iov = np.array([[buf.ctypes.data, nbytes]], dtype=np.uint64)

        def done(ok: bool) -> None:
            if ok:
                self._apply(peer, buf)

        return Served(iov, nbytes, done)

    def _apply(self, peer: _Peer, data: np.ndarray[Any, Any]) -> None:
        """Apply the peer's table (the push is answered once this returned)."""
        try:
            table = decode_table(data.tobytes())
        except WireError as exc:
            raise _invalid(f"malformed UCX table from {peer.sub.name}: {exc}") from None
        try:
            first = peer.remote.apply(table)
        except LLMException:
            peer.applied.set()  # the route is off for good: the link carries everything
            self.progress.poll()
            raise
        if first and not peer.closed:
            self._log.info(
                "ucx.route_ready",
                remote_cluster_id=peer.channel.peer.cluster_id,
                transports=",".join(peer.remote.transports()),
            )
            peer.ready(UcxRoute(peer.remote, self.progress, cuda=self.cuda))
        # The other side's first table: answer with ours (the route is in place first, so
        # that the side that linked finds it at both ends once it has this answer).
        self._subscribe(peer)
        peer.applied.set()

    def _acked_by_peer(self, peer: _Peer, seq: int) -> None:
        with self._lock:
            peer.peer_acked = max(peer.peer_acked, seq)
        self._queue("acked", [peer])

    def _ours_to_ack(self, made: list[_Peer], seq: int) -> None:
        """The peer's table ``seq`` may be acknowledged (no lock held)."""
        if made:
            with self._lock:
                made[0].to_ack = max(made[0].to_ack, seq)
            self._queue("ack", made)

    # -- the control thread --------------------------------------------------------------
    def _queue(self, job: str, made: list[_Peer]) -> None:
        if not made:
            return
        with self._lock:
            self._jobs.append((job, made[0]))
            self._wake.notify()

    def _run(self) -> None:
        while True:
            # The board's lock (the registry's) is never taken under this one: a registry
            # listener queues jobs with it held.
            deadline = self.board.next_deadline(ucxboard.ACK_TIMEOUT_S)
            with self._lock:
                if not self._jobs and not self._stop:
                    left = None if deadline is None else (deadline - time.monotonic_ns()) / 1e9
                    if left is None or left > 0:
                        self._wake.wait(left)
                if self._stop:
                    return
                jobs, self._jobs = list(self._jobs), collections.deque()
            for job, peer in jobs:
                try:
                    self._do(job, peer)
                except Exception:  # never the end of the thread: log and go on
                    self._log.warning("ucx.control_failed", job=job, exc_info=True)
            self._break_overdue()

    def _do(self, job: str, peer: _Peer) -> None:
        if job == "acked":
            with self._lock:
                seq, peer.peer_acked = peer.peer_acked, 0
            if seq:
                self.board.acked(peer.sub, seq)
        elif job == "ack":
            with self._lock:
                seq, peer.to_ack = peer.to_ack, 0
            if seq and not peer.closed:
                self._push(peer, Target.UCX_ACK, seq, b"")
        elif job == "table" and not peer.closed:
            seq, table = self.board.table()
            if seq > peer.sent:
                peer.sent = seq
                self._push(peer, Target.UCX_TABLE, seq, table)

    def _push(self, peer: _Peer, target: Target, seq: int, payload: bytes) -> None:
        """Send one control push on the peer's link (its outcome is only logged)."""
        body = encode_access(Access(target, ident=seq))
        buf = np.frombuffer(payload, dtype=np.uint8) if payload else None
        rows = (
            NO_ROWS if buf is None else np.array([[buf.ctypes.data, len(payload)]], dtype=np.uint64)
        )
        deadline = time.monotonic_ns() + int(CONTROL_TIMEOUT_S * 1e9)
        try:
            future = peer.channel.push(body, rows, len(payload), deadline)
        except LLMException as exc:
            self._log.info("ucx.push_failed", what=target.name, seq=seq, reason=str(exc))
            return

        def sent(done: Future[None], _payload: object = buf) -> None:
            # ``_payload`` keeps the bytes alive until the push ended.
            error = None if done.cancelled() else done.exception()
            if error is not None and not peer.closed:
                self._log.info("ucx.push_failed", what=target.name, seq=seq, reason=str(error))

        future.add_done_callback(sent)

    def _break_overdue(self) -> None:
        for sub in self.board.overdue(time.monotonic_ns(), ucxboard.ACK_TIMEOUT_S):
            with self._lock:
                peer = next((p for _, p in self._peers.values() if p.sub is sub), None)
            reason = (
                f"{sub.name} did not acknowledge a UCX table within "
                f"{ucxboard.ACK_TIMEOUT_S:g} s: the link is broken and the release goes on"
            )
            self._log.warning("ucx.ack_timeout", peer=sub.name, timeout_s=ucxboard.ACK_TIMEOUT_S)
            self.board.unsubscribe(sub)
            if peer is not None:
                peer.fail(reason)

    # -- closing -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the route: every peer, the threads, the registrations, the worker and the
        context (finalize, after the links closed and before the pools go)."""
        with self._lock:
            self._stop = True
            self._wake.notify()
            peers = [p for _, p in self._peers.values()]
            self._peers.clear()
        if self._thread is not threading.current_thread():
            self._thread.join(CONTROL_TIMEOUT_S)
        for peer in peers:
            self._close(peer, "the engine was finalized")
        self.progress.close()
        self._close_lanes()
        self.board.close()
        self.worker.close()
        self.context.close()

    def _close_lanes(self) -> None:
        """Stop the lanes' threads and destroy their workers (their endpoints closed)."""
        lanes, self.lanes = self.lanes, []
        for lane in lanes:
            lane.close()


def open_ucx(opening: Opening) -> UcxLinks | None:
    """The UCX route when ``aio.Ucx`` asks for it (None otherwise).

    :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` naming why UCX cannot be loaded,
        the code of UCX's failure to start, or ``LLM_FAILED`` when the system refuses a
        descriptor or thread for it.
    """
    settings = opening.settings
    if not settings.ucx:
        return None
    reason = available()
    if reason is not None:
        raise FeatureNotEnabledError(
            f"{OPTION_UCX}=1 needs UCX, which cannot be loaded: {reason}",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )
    try:
        return UcxLinks(
            opening.caches,
            get_logger("ucx", cluster_id=opening.cluster_id, role=opening.role),
            name=f"aio-dd-{opening.cluster_id}",
            lanes=settings.ucx_lanes,
            busy_poll_us=settings.busy_poll_us,
        )
    except (OSError, RuntimeError) as exc:  # no descriptor or thread to be had for it
        raise LLMFailedError(
            f"the UCX route cannot start: {exc}", status_code=LLMStatusCode.LLM_FAILED
        ) from None
