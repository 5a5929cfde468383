"""Making TCP links: the listener (accept loop, server side of the handshake) and the
transport (listen, connect and the client side of the handshake).

The handshake, before a :class:`~aio_datadist._transport.tcp.TcpChannel` takes the socket
over: the client sends HELLO; the server answers HELLO_ACK, or ERROR (rid 0) with the
refusal's status and text. With a link secret on both ends, AUTH frames carry the server's
nonce, the client's proof and the server's proof (``auth``). Rank-table endpoints shared
by several engines or processes hand links over through ``rendezvous``. Every step is
bounded by ``handshake_timeout``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
from collections.abc import Callable, Generator
from dataclasses import replace

from aio_datadist._log import get_logger
from aio_datadist._native.api import (
    NetTimeout,
    PeerClosed,
    sock_recv_into,
    sock_send_bytes,
    sock_tune,
)
from aio_datadist._transport import DEFAULT_BUSY_POLL_US
from aio_datadist._transport._wire import (
    HEADER,
    MAGIC,
    MAX_HELLO_BODY,
    FrameHeader,
    FrameKind,
    WireError,
    decode_error_text,
    decode_header,
    encode_error_text,
    pack_header,
    status_from_wire,
)
from aio_datadist._transport.auth import (
    NONCE_BYTES,
    PROOF_BYTES,
    WRONG_CLIENT_PROOF,
    WRONG_SERVER_PROOF,
    LinkSecret,
    Side,
    Transcript,
    new_nonce,
    refusal_reason,
)
from aio_datadist._transport.base import (
    Acceptor,
    Channel,
    Hello,
    LinkRefused,
    Listener,
    RequestHandler,
    Transport,
)
from aio_datadist._transport.deadlines import after_s, now_ns
from aio_datadist._transport.handshake import hello_from_wire, hello_to_wire
from aio_datadist._transport.handshakes import (
    LINGER,
    LINGER_S,
    MAX_PENDING_HANDSHAKES,
    Handshakes,
    Read,
    Steps,
    Wait,
)
from aio_datadist._transport.rendezvous import Handoff, RouteKey, share
from aio_datadist._transport.samehost import (
    HostPresence,
    SameHostProof,
    local_host_key,
    prove,
    verifier,
)
from aio_datadist._transport.tcp import STALL_TIMEOUT, TcpChannel
from aio_datadist._transport.tcp_io import IO_ERRORS
from aio_datadist.status import LLMStatusCode

__all__ = ("HANDSHAKE_TIMEOUT", "TcpListener", "TcpTransport")

#: Seconds a new connection has to complete its handshake.
HANDSHAKE_TIMEOUT = 5.0


def _recv_handshake_frame(fd: int, deadline_ns: int) -> tuple[FrameHeader, bytearray]:
    """(The client.) One handshake frame read as the listener reads it
    (:func:`_handshake_frame`), each of its reads blocking until the deadline."""
    steps = _handshake_frame()
    wait = next(steps)
    while True:
        assert isinstance(wait, Read)
        buf = bytearray(wait.n)
        if wait.n:
            sock_recv_into(fd, buf, deadline_ns)
        try:
            wait = steps.send(bytes(buf))
        except StopIteration as done:
            frame: tuple[FrameHeader, bytearray] = done.value
            return frame


def _recv_answer(fd: int, where: str, deadline_ns: int) -> tuple[FrameHeader, bytearray]:
    """The server's next handshake frame; LinkRefused when it is an ERROR."""
    h, body = _recv_handshake_frame(fd, deadline_ns)
    if h.kind is FrameKind.ERROR:
        raise LinkRefused(
            status_from_wire(h.status), f"{where} refused the link: {decode_error_text(body)}"
        )
    return h, body


def _auth_body(h: FrameHeader, body: bytearray, size: int) -> bytes:
    """The body of an AUTH frame of ``size`` bytes; WireError for anything else."""
    if h.kind is not FrameKind.AUTH or len(body) != size:
        raise WireError(f"expected an AUTH frame of {size} bytes, got {h.kind.name}")
    return bytes(body)


def _auth_frame(body: bytes) -> bytes:
    return pack_header(FrameKind.AUTH, body_len=len(body)) + body


def _error_frame(message: str, status: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED) -> bytes:
    body = encode_error_text(message)
    return pack_header(FrameKind.ERROR, status=int(status), body_len=len(body)) + body


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _tune(sock: socket.socket, sndbuf: int, rcvbuf: int) -> None:
    sock_tune(sock.fileno(), nodelay=True, sndbuf=sndbuf, rcvbuf=rcvbuf)
    # A vanished host (no FIN, no RST) is noticed within about a minute.
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


class _ClientRefused(Exception):
    """The listener refused a client during authentication (and told it why)."""


#: Where a listener sends a link, by its HELLO: to an engine of this process (its transport
#: and acceptor), to another process (a shared endpoint's ``Handoff``), or nowhere (None).
_Target = tuple["TcpTransport", Acceptor]
_Router = Callable[[Hello], "_Target | Handoff | None"]


class TcpListener(Listener):
    """A listening TCP socket; accepted connections are handshaken (``handshakes``: one
    selector thread and a few workers, never a thread per connection) with the engine
    their HELLO is routed to.

    Without a socket it only finishes the handshakes of connections handed to it
    (:meth:`take`), as a shared endpoint's member process does.
    """

    def __init__(
        self,
        sock: socket.socket | None,
        address: tuple[str, int],
        router: _Router,
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        host, port = address
        self.address = (host, int(sock.getsockname()[1]) if sock is not None else port)
        self._sock = sock
        self._router = router
        self._lock = threading.Lock()
        self._closed = False
        self._log = get_logger("tcp", listen=f"{host}:{self.address[1]}")
        self._handshakes = Handshakes(
            f"aio-dd-tcp-accept-{self.address[1]}",
            sock,
            self._steps,
            timeout=handshake_timeout,
            max_pending=max_pending,
        )

    @property
    def pending_handshakes(self) -> int:
        """Connections in their handshake now."""
        return self._handshakes.pending

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._handshakes.close()
        if self._sock is not None:
            self._sock.close()
        self._log.info("tcp.listen_closed")

    def take(self, conn: socket.socket, remote: str, hello: bytes | None) -> None:
        """Handshake ``conn``; ``hello``: its HELLO body, when another process read it
        already."""
        self._handshakes.take(conn, remote, hello)

    def _refusal(self, conn: socket.socket, status: LLMStatusCode, message: str) -> Steps:
        """Answer ERROR, then let the client close (so it reads the answer) for a moment."""
        with contextlib.suppress(*IO_ERRORS):
            sock_send_bytes(conn.fileno(), _error_frame(message, status), after_s(LINGER_S))
            conn.shutdown(socket.SHUT_WR)
            yield LINGER
        return False

    def _authenticate(
        self,
        transport: TcpTransport,
        conn: socket.socket,
        remote: str,
        hello: bytes,
        nonce: bytes | None,
        deadline: int,
    ) -> Generator[Wait, bytes, Transcript | None]:
        """Run the listener's half of authentication before the acceptor sees the client.

        Returns the transcript the server's proof is bound to, or None when neither end
        has a secret. Raises :class:`_ClientRefused` when the client was refused (after
        telling it why).
        """
        secret = transport.secret
        reason = refusal_reason(client_secret=nonce is not None, server_secret=secret is not None)
        if reason is None and secret is not None and nonce is not None:
            server_nonce = new_nonce()
            sock_send_bytes(conn.fileno(), _auth_frame(server_nonce), deadline)
            try:
                proof = _auth_body(*(yield from _handshake_frame()), PROOF_BYTES)
            except WireError as exc:
                self._log.warning("tcp.handshake_rejected", remote=remote, reason=str(exc))
                raise _ClientRefused from None
            transcript = Transcript(hello, nonce, server_nonce)
            if secret.verify(Side.CLIENT, transcript, proof):
                return transcript
            reason = WRONG_CLIENT_PROOF
        if reason is None:
            return None
        self._log.warning("link.auth_failed", remote=remote, reason=reason)
        yield from self._refusal(conn, LLMStatusCode.LLM_LINK_FAILED, reason)
        raise _ClientRefused

    def _read_hello(self, conn: socket.socket, remote: str) -> Generator[Wait, bytes, bytes | None]:
        """The client's HELLO body; None after refusing a connection that sent no HELLO."""
        raw = yield Read(HEADER.size)
        try:
            h = decode_header(raw)
            if h.kind is not FrameKind.HELLO or h.payload_len or h.body_len > MAX_HELLO_BODY:
                raise WireError(f"expected a HELLO frame, got {h.kind.name}")
        except WireError as exc:
            self._log.warning("tcp.handshake_rejected", remote=remote, reason=str(exc))
            if raw[:4] == MAGIC:  # one of ours, of another version: tell it why
                yield from self._refusal(
                    conn, LLMStatusCode.LLM_LINK_FAILED, f"handshake refused: {exc}"
                )
            return None
        return bytes((yield Read(h.body_len)))

    def _steps(self, conn: socket.socket, remote: str, hello: bytes | None, deadline: int) -> Steps:
        """Handshake one connection; True when a channel (or another process) took the
        socket over."""
        if hello is None:
            hello = yield from self._read_hello(conn, remote)
            if hello is None:
                return False
        try:
            peer, nonce = hello_from_wire(hello)
        except WireError as exc:
            self._log.warning("tcp.handshake_rejected", remote=remote, reason=str(exc))
            return (
                yield from self._refusal(
                    conn, LLMStatusCode.LLM_LINK_FAILED, f"handshake refused: {exc}"
                )
            )
        target = self._router(peer)
        if target is None:
            reason = (
                f"nothing here links cluster {peer.to_cluster_id} for domain {peer.comm!r}"
                if peer.comm is not None
                else "this address is a rank endpoint: link_clusters cannot link here"
            )
            self._log.info("tcp.link_refused", remote=remote, reason=reason)
            return (yield from self._refusal(conn, LLMStatusCode.LLM_LINK_FAILED, reason))
        if isinstance(target, Handoff):
            if not self._handshakes.detach(conn):  # (a shutdown would reach the other copy)
                return False
            try:
                target(conn, remote, hello)
            except OSError as exc:
                self._log.info("tcp.handoff_failed", remote=remote, reason=str(exc))
                yield from self._refusal(
                    conn, LLMStatusCode.LLM_LINK_FAILED, "the domain's member is gone"
                )
            return False  # the other process holds its own copy of the socket
        transport, acceptor = target
        _tune(conn, transport.sndbuf, transport.rcvbuf)
        try:
            transcript = yield from self._authenticate(
                transport, conn, remote, hello, nonce, deadline
            )
        except _ClientRefused:
            return False
        refusal = self._serve(transport, acceptor, conn, remote, hello, peer, transcript, deadline)
        if refusal is None:
            return True
        return (yield from self._refusal(conn, refusal.status, str(refusal)))

    def _offer_proof(
        self, conn: socket.socket, channel: TcpChannel, local: Hello, remote: str
    ) -> Hello:
        """``local`` with the verifier and token the client proves itself with, when both
        ends offer same-host access (``samehost``); else as it is."""
        proof = channel.same_host
        if proof is None:
            return local
        if local.presence is None or local.presence.board_fd < 0:
            proof.close()
            return local
        found = verifier()
        if isinstance(found, str):
            self._log.info("samehost.unavailable", remote=remote, reason=found)
            proof.close()
            return replace(local, presence=None)
        token = found.expect(conn, local.presence.board_fd, proof)
        return replace(local, presence=replace(local.presence, verifier=found.id, token=token))

    def _serve(
        self,
        transport: TcpTransport,
        acceptor: Acceptor,
        conn: socket.socket,
        remote: str,
        hello: bytes,
        peer: Hello,
        transcript: Transcript | None,
        deadline: int,
    ) -> LinkRefused | None:
        """Register the link with ``acceptor`` and answer HELLO_ACK; None when the new
        channel took the socket over, else the refusal to answer."""
        channel = TcpChannel(
            conn,
            peer,
            acceptor.handler,
            remote=remote,
            stall_timeout=transport.stall_timeout,
            busy_poll_us=transport.busy_poll_us,
        )
        channel.authenticated = transcript is not None
        if _same_host_offered(peer.presence):
            channel.same_host = SameHostProof()
        # Hold the channel's sends from registration to HELLO_ACK: a request the server side
        # sends on the new channel meanwhile goes out after the acknowledgement.
        with channel.sends_held():
            if not self._handshakes.detach(conn):
                return LinkRefused(LLMStatusCode.LLM_LINK_FAILED, "the listener is closing")
            try:
                local = acceptor.accept(peer, channel)
            except LinkRefused as exc:
                self._log.info(
                    "tcp.link_refused", remote=remote, status=str(exc.status), reason=str(exc)
                )
                return exc
            except Exception as exc:
                self._log.warning("tcp.accept_failed", remote=remote, exc_info=True)
                return LinkRefused(LLMStatusCode.LLM_FAILED, f"accept failed: {exc!r}")
            try:
                channel.start()
            except LinkRefused as exc:  # the channel broke (its link is a broken link now)
                self._log.warning("tcp.accept_failed", remote=remote, reason=str(exc))
                return exc
            local = self._offer_proof(conn, channel, local, remote)
            try:
                body = hello_to_wire(local)
                answer = pack_header(FrameKind.HELLO_ACK, body_len=len(body)) + body
                if transcript is not None and transport.secret is not None:
                    bound = replace(transcript, server_hello=body)
                    answer += _auth_frame(transport.secret.prove(Side.SERVER, bound))
                sock_send_bytes(conn.fileno(), answer, deadline)
            except (*IO_ERRORS, WireError) as exc:
                failure: str | None = f"handshake answer failed: {exc}"
            else:
                failure = None
        if failure is not None:
            channel.abort(failure)
        else:
            self._log.info(
                "tcp.accepted",
                remote=remote,
                remote_cluster_id=peer.cluster_id,
                authenticated=channel.authenticated,
            )
        return None


def _same_host_offered(presence: HostPresence | None) -> bool:
    """Whether a peer's presence says it runs on this host (and so may prove it)."""
    return presence is not None and presence.host_key == local_host_key()


def _handshake_frame() -> Generator[Wait, bytes, tuple[FrameHeader, bytearray]]:
    """The listener's read of one handshake frame (no payload, a bounded body)."""
    h = decode_header((yield Read(HEADER.size)))
    if h.payload_len or h.body_len > MAX_HELLO_BODY:
        raise WireError(f"oversized {h.kind.name} frame in the handshake")
    body = bytearray((yield Read(h.body_len))) if h.body_len else bytearray()
    return h, body


def _prove(
    sock: socket.socket, hello: Hello, peer: Hello, where: str, deadline: int
) -> SameHostProof | None:
    """(The client, after the handshake.) The server's process, proven by the kernel, when
    both ends offer same-host access and the proof succeeds; else None, with a log line."""
    mine, theirs = hello.presence, peer.presence
    if mine is None or mine.board_fd < 0 or theirs is None or not _same_host_offered(theirs):
        return None
    found = prove(sock, theirs, mine.board_fd, max(0.001, (deadline - now_ns()) / 1e9))
    if isinstance(found, str):
        get_logger("samehost").info("samehost.unavailable", remote=where, reason=found)
        return None
    proof = SameHostProof()
    proof.prove(found)
    return proof


class TcpTransport(Transport):
    """Links over TCP: one connection per link, payloads by scatter-gather native calls.

    ``sndbuf``/``rcvbuf`` (bytes, 0: the kernel's auto-tuning) size the socket buffers;
    ``handshake_timeout`` bounds a server-side handshake (authentication included) and
    ``max_pending_handshakes`` how many a listener keeps at once (``handshakes``),
    ``stall_timeout`` a frame that stops moving. With ``secret`` every link is authenticated
    (``auth``); without one, a listener on an address other than loopback logs the warning
    ``link.unauthenticated``.
    """

    name = "tcp"

    def __init__(
        self,
        *,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        stall_timeout: float = STALL_TIMEOUT,
        sndbuf: int = 0,
        rcvbuf: int = 0,
        secret: LinkSecret | None = None,
        busy_poll_us: int = DEFAULT_BUSY_POLL_US,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        if busy_poll_us < 0:
            raise ValueError(f"busy_poll_us must be >= 0, got {busy_poll_us}")
        self.secret = secret
        self.busy_poll_us = busy_poll_us
        self.handshake_timeout = handshake_timeout
        self.max_pending_handshakes = max_pending_handshakes
        self.stall_timeout = stall_timeout
        self.sndbuf = sndbuf
        self.rcvbuf = rcvbuf

    def _bind(self, host: str, port: int) -> socket.socket:
        """A socket listening on ``host:port`` (``SO_REUSEADDR``).

        :raises OSError: the address cannot be used.
        """
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, sockaddr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        log = get_logger("tcp", address=f"{host}:{sock.getsockname()[1]}")
        log.info("tcp.listening", authenticated=self.secret is not None)
        if self.secret is None and not _is_loopback(str(sock.getsockname()[0])):
            log.warning(
                "link.unauthenticated",
                note="no link secret: any host that reaches this address can link",
            )
        return sock

    def listen(self, host: str, port: int, acceptor: Acceptor) -> Listener:
        target: _Target = (self, acceptor)
        return TcpListener(
            self._bind(host, port),
            (host, port),
            lambda _: target,
            handshake_timeout=self.handshake_timeout,
            max_pending=self.max_pending_handshakes,
        )

    def listen_shared(
        self, host: str, port: int, route: RouteKey, acceptor: Acceptor, timeout: float
    ) -> Listener:
        try:
            ip = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as exc:
            raise LinkRefused(
                LLMStatusCode.LLM_LINK_FAILED, f"cannot resolve {host}: {exc}"
            ) from exc
        target: _Target = (self, acceptor)

        def make_listener(sock: socket.socket | None, router: _Router) -> TcpListener:
            return TcpListener(
                sock,
                (host, port),
                router,
                handshake_timeout=self.handshake_timeout,
                max_pending=self.max_pending_handshakes,
            )

        return share(
            (str(ip), port),
            route,
            target,
            bind=lambda: self._bind(host, port),
            make_listener=make_listener,
            timeout=timeout,
        )

    def connect(
        self, host: str, port: int, hello: Hello, handler: RequestHandler, timeout: float
    ) -> Channel:
        where = f"{host}:{port}"
        timeout = max(float(timeout), 0.001)
        deadline = after_s(timeout)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError:
            raise LinkRefused(
                LLMStatusCode.LLM_TIMEOUT, f"no answer from {where} within {timeout} s"
            ) from None
        except OSError as exc:
            raise LinkRefused(
                LLMStatusCode.LLM_LINK_FAILED, f"cannot connect to {where}: {exc.strerror or exc}"
            ) from None
        handed_over = False
        proof: SameHostProof | None = None
        try:
            sock.settimeout(None)
            _tune(sock, self.sndbuf, self.rcvbuf)
            peer, authenticated = self._client_handshake(sock.fileno(), where, hello, deadline)
            channel = TcpChannel(
                sock,
                peer,
                handler,
                remote=where,
                stall_timeout=self.stall_timeout,
                busy_poll_us=self.busy_poll_us,
            )
            channel.authenticated = authenticated
            channel.same_host = proof = _prove(sock, hello, peer, where, deadline)
            channel.start()
            handed_over = True
        except NetTimeout:
            raise LinkRefused(
                LLMStatusCode.LLM_TIMEOUT,
                f"{where} did not answer the handshake within {timeout} s",
            ) from None
        except PeerClosed:
            raise LinkRefused(
                LLMStatusCode.LLM_LINK_FAILED, f"{where} closed the connection during the handshake"
            ) from None
        except WireError as exc:
            raise LinkRefused(
                LLMStatusCode.LLM_LINK_FAILED, f"{where} does not speak this protocol: {exc}"
            ) from None
        except OSError as exc:
            raise LinkRefused(
                LLMStatusCode.LLM_LINK_FAILED, f"handshake with {where} failed: {exc}"
            ) from None
        finally:
            if not handed_over:
                sock.close()
                if proof is not None:  # the peer's board descriptor goes with the channel
                    proof.close()
        get_logger("tcp").info(
            "tcp.connected",
            remote=where,
            remote_cluster_id=peer.cluster_id,
            authenticated=channel.authenticated,
        )
        return channel

    def _client_handshake(
        self, fd: int, where: str, hello: Hello, deadline: int
    ) -> tuple[Hello, bool]:
        """The client's half of the handshake: the server's hello, and whether both proved
        the link secret. The listener registers the link before its proof is checked here,
        so a refusal here is also sent to it (ERROR), and the caller closes the socket.

        :raises LinkRefused: the server refused, or authentication failed here.
        """
        secret = self.secret
        nonce = None if secret is None else new_nonce()
        body = hello_to_wire(hello, auth_nonce=nonce)
        sock_send_bytes(fd, pack_header(FrameKind.HELLO, body_len=len(body)) + body, deadline)
        h, answer = _recv_answer(fd, where, deadline)
        transcript = None
        if h.kind is FrameKind.AUTH:
            if secret is None or nonce is None:
                reason = refusal_reason(client_secret=False, server_secret=True)
                raise LinkRefused(LLMStatusCode.LLM_LINK_FAILED, f"link to {where}: {reason}")
            transcript = Transcript(body, nonce, _auth_body(h, answer, NONCE_BYTES))
            sock_send_bytes(fd, _auth_frame(secret.prove(Side.CLIENT, transcript)), deadline)
            h, answer = _recv_answer(fd, where, deadline)
        if h.kind is not FrameKind.HELLO_ACK:
            raise WireError(f"expected HELLO_ACK, got {h.kind.name}")
        if secret is not None:
            if transcript is None:
                reason = refusal_reason(client_secret=True, server_secret=False)
            else:
                proof = _auth_body(*_recv_handshake_frame(fd, deadline), PROOF_BYTES)
                bound = replace(transcript, server_hello=bytes(answer))
                reason = None if secret.verify(Side.SERVER, bound, proof) else WRONG_SERVER_PROOF
            if reason is not None:
                with contextlib.suppress(*IO_ERRORS):
                    sock_send_bytes(fd, _error_frame(reason), deadline)
                raise LinkRefused(LLMStatusCode.LLM_LINK_FAILED, f"link to {where}: {reason}")
        peer, _ = hello_from_wire(answer)
        return peer, transcript is not None
