"""The loopback transport: engines in one process link by address, with no sockets.

Real code, not a mock: listeners occupy addresses, handshakes run the peer's acceptor,
closing one end is seen by the other, and a vanished listener refuses links. Link secrets
are checked as over TCP (the same proofs, computed in-process). Async test suites run every
link and transfer scenario over it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import numpy.typing as npt

from aio_datadist._log import get_logger
from aio_datadist._memory.rows import pair_rows
from aio_datadist._native import api
from aio_datadist._transport.auth import (
    WRONG_CLIENT_PROOF,
    LinkSecret,
    Side,
    Transcript,
    new_nonce,
    refusal_reason,
)
from aio_datadist._transport.base import (
    Acceptor,
    Channel,
    ChannelStats,
    Hello,
    Iov,
    LinkRefused,
    Listener,
    Payload,
    RequestHandler,
    RequestKind,
    Transport,
)
from aio_datadist._transport.faults import LinkFaults
from aio_datadist._transport.future import RequestFuture
from aio_datadist._transport.handshake import hello_to_wire
from aio_datadist.status import LLMException, LLMStatusCode

#: Runs one batch of ``(dst, src, nbytes)`` copy rows.
CopyBatch = Callable[[npt.NDArray[np.uint64]], None]

__all__ = ("LoopbackChannel", "LoopbackTransport")

#: Why the other end of a closed channel closed (the same words as over TCP).
_PEER_UNLINKED = "the peer unlinked"
_PEER_FINALIZED = "the peer finalized"
_PEER_VANISHED = "the peer's end of the link closed without an unlink (it unlinked with force=True)"

_lock = threading.Lock()
_listeners: dict[tuple[str, int], LoopbackListener] = {}
#: Shared rank endpoints: their listeners by route (domain name, cluster id).
_shared: dict[tuple[str, int], dict[tuple[str, int], LoopbackListener]] = {}


def _rows(payload: Payload) -> Iov:
    """The memory rows of ``payload``: this channel does not ``stream``."""
    if not isinstance(payload, np.ndarray):
        raise TypeError("the loopback transport moves memory rows, not segments")
    return payload


class LoopbackChannel(Channel):
    """One end of an in-process channel: requests run the peer's handler and one copy.

    A request is served in the requester's thread, start to end, so nothing queues: the
    peer's work in flight here is bounded by the peer's own threads, and reading never
    pauses (:meth:`stats` counts the requests being served).
    """

    pull_in_caller = True
    push_in_caller = True

    def __init__(self, peer: Hello, handler: RequestHandler, copy: CopyBatch) -> None:
        self.peer = peer
        self.handler = handler
        self.other: LoopbackChannel | None = None
        self._copy = copy
        self._closed = False
        self._reason: str | None = None
        self._unlinked = False
        self._callbacks: list[Callable[[Channel], None]] = []
        self._lock = threading.Lock()
        self._serving = 0  # the peer's requests being served on this end (under _lock)
        self._serving_max = 0
        #: The faults injected into the requests made from this end (``aio_datadist.testing``).
        self.faults = LinkFaults(self._die)

    @property
    def closed(self) -> bool:
        return self._closed

    def _die(self) -> None:
        """Both ends close as if the peer process had died (no unlink, no notice)."""
        other = self.other
        callbacks = self._shut(_PEER_VANISHED)
        for callback in callbacks:
            callback(self)
        if other is not None:
            for callback in other._shut(_PEER_VANISHED):
                callback(other)

    @property
    def close_reason(self) -> str | None:
        return self._reason

    @property
    def unlinked_by_peer(self) -> bool:
        return self._unlinked

    def on_close(self, callback: Callable[[Channel], None]) -> None:
        with self._lock:
            if not self._closed:
                self._callbacks.append(callback)
                return
        callback(self)

    def stats(self) -> ChannelStats:
        with self._lock:
            return ChannelStats(requests=self._serving, requests_max=self._serving_max)

    def _count_serving(self, step: int) -> None:
        with self._lock:
            self._serving += step
            self._serving_max = max(self._serving_max, self._serving)

    def _shut(self, reason: str, *, unlinked: bool = False) -> list[Callable[[Channel], None]]:
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            self._reason, self._unlinked = reason, unlinked
            callbacks, self._callbacks = self._callbacks, []
        self.faults.close()
        return callbacks

    def _request(
        self,
        kind: RequestKind,
        body: bytes,
        local: Iov,
        nbytes: int,
        deadline_ns: int,
        commit: bool,
    ) -> Future[None]:
        future: Future[None] = RequestFuture()
        if not self.faults.admit(
            kind,
            deadline_ns,
            future,
            lambda: self._serve(future, kind, body, local, nbytes, commit),
        ):
            return future
        self._serve(future, kind, body, local, nbytes, commit)
        return future

    def _serve(
        self,
        future: Future[None],
        kind: RequestKind,
        body: bytes,
        local: Iov,
        nbytes: int,
        commit: bool,
    ) -> None:
        """Have the peer serve the request and copy its bytes; complete ``future``."""
        other = self.other
        try:
            if self._closed or other is None or other._closed:
                raise LLMException(
                    f"link to cluster {self.peer.cluster_id} is closed",
                    status_code=LLMStatusCode.LLM_LINK_FAILED,
                )
            other._count_serving(1)
            try:
                served = other.handler.serve(other.peer, kind, body, nbytes)
                ok = False
                try:
                    if kind is RequestKind.PULL:
                        ops = pair_rows(local, served.iov)
                    else:
                        ops = pair_rows(served.iov, local)
                    if len(ops):
                        self._copy(ops)
                    ok = True
                finally:
                    served.done(ok)
            finally:
                other._count_serving(-1)
            if commit and served.commit is not None:
                served.commit()
        except LLMException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)

    def pull(
        self, body: bytes, dst: Payload, nbytes: int, deadline_ns: int, *, commit: bool = False
    ) -> Future[None]:
        return self._request(RequestKind.PULL, body, _rows(dst), nbytes, deadline_ns, commit)

    def push(self, body: bytes, src: Payload, nbytes: int, deadline_ns: int) -> Future[None]:
        return self._request(RequestKind.PUSH, body, _rows(src), nbytes, deadline_ns, False)

    def close(
        self, *, notify_peer: bool, timeout: float | None = None, finalizing: bool = False
    ) -> bool:
        self._shut("closed by this side")
        other = self.other
        if other is None:
            return True
        # As over a socket, the other end sees the close either way; only its reason differs.
        if not notify_peer:
            callbacks = other._shut(_PEER_VANISHED)
        elif finalizing:
            callbacks = other._shut(_PEER_FINALIZED)
        else:
            callbacks = other._shut(_PEER_UNLINKED, unlinked=True)
        for callback in callbacks:
            callback(other)
        return True


class LoopbackListener(Listener):
    """An address in the process-wide loopback table."""

    def __init__(
        self, address: tuple[str, int], acceptor: Acceptor, secret: LinkSecret | None
    ) -> None:
        self.address = address
        self.acceptor = acceptor
        self.secret = secret

    def close(self) -> None:
        with _lock:
            if _listeners.get(self.address) is self:
                del _listeners[self.address]
            routes = _shared.get(self.address, {})
            for route, listener in list(routes.items()):
                if listener is self:
                    del routes[route]
            if not routes:
                _shared.pop(self.address, None)


class LoopbackTransport(Transport):
    """In-process links between engines, found by their listen address.

    ``copy`` runs the byte copies of requests (default: the native host batch copy). With
    ``secret``, links need a listener of the same secret, as over TCP.
    """

    name = "loopback"

    def __init__(self, copy: CopyBatch | None = None, secret: LinkSecret | None = None) -> None:
        self._copy: CopyBatch = copy or api.copy_batch
        self.secret = secret

    def listen(self, host: str, port: int, acceptor: Acceptor) -> Listener:
        address = (host, port)
        with _lock:
            if address in _listeners or address in _shared:
                raise OSError(f"loopback address {host}:{port} is already in use")
            listener = _listeners[address] = LoopbackListener(address, acceptor, self.secret)
        return listener

    def listen_shared(
        self, host: str, port: int, route: tuple[str, int], acceptor: Acceptor, timeout: float
    ) -> Listener:
        address = (host, port)
        with _lock:
            if address in _listeners:
                raise LinkRefused(
                    LLMStatusCode.LLM_LINK_FAILED, f"loopback address {host}:{port} is in use"
                )
            routes = _shared.setdefault(address, {})
            if route in routes:
                raise LinkRefused(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"domain {route[0]!r} already listens for cluster {route[1]} at "
                    f"loopback {host}:{port}",
                )
            listener = routes[route] = LoopbackListener(address, acceptor, self.secret)
        return listener

    def connect(
        self, host: str, port: int, hello: Hello, handler: RequestHandler, timeout: float
    ) -> Channel:
        with _lock:
            listener = _listeners.get((host, port))
            routes = _shared.get((host, port))
            if listener is None and routes is not None:
                listener = routes.get((hello.comm or "", hello.to_cluster_id or 0))
        if listener is None:
            reason = (
                f"nothing at loopback {host}:{port} links cluster {hello.to_cluster_id} for "
                f"domain {hello.comm!r}"
                if routes is not None
                else f"nobody listens on loopback {host}:{port}"
            )
            raise LinkRefused(LLMStatusCode.LLM_LINK_FAILED, reason)
        authenticated = self._authenticate(hello, listener)
        client = LoopbackChannel(hello, handler, self._copy)  # peer filled in below
        server = LoopbackChannel(hello, listener.acceptor.handler, self._copy)
        client.other, server.other = server, client
        client.remote = f"loopback {host}:{port}"
        client.authenticated = server.authenticated = authenticated
        client.peer = listener.acceptor.accept(hello, server)
        return client

    def _authenticate(self, hello: Hello, listener: LoopbackListener) -> bool:
        """Check the client's proof with the listener's secret; True when both have one.

        In one process a proof that checks out shows that both secrets are equal, so the
        listener's own proof would add nothing and is not computed.

        :raises LinkRefused: ``LLM_LINK_FAILED`` when the secrets differ or one is missing.
        """
        client_secret, server_secret = self.secret, listener.secret
        reason = refusal_reason(
            client_secret=client_secret is not None, server_secret=server_secret is not None
        )
        if reason is None and client_secret is not None and server_secret is not None:
            client_nonce = new_nonce()
            transcript = Transcript(
                hello_to_wire(hello, auth_nonce=client_nonce), client_nonce, new_nonce()
            )
            proof = client_secret.prove(Side.CLIENT, transcript)
            if server_secret.verify(Side.CLIENT, transcript, proof):
                return True
            reason = WRONG_CLIENT_PROOF
        if reason is None:
            return False
        host, port = listener.address
        get_logger("loopback", listen=f"{host}:{port}").warning("link.auth_failed", reason=reason)
        raise LinkRefused(
            LLMStatusCode.LLM_LINK_FAILED, f"loopback {host}:{port} refused the link: {reason}"
        )
