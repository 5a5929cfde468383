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
import errno
import ipaddress
import socket
import threading
import time
from collections.abc import Callable
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
from aio_datadist._transport.deadlines import after_s
from aio_datadist._transport.handshake import hello_from_wire, hello_to_wire
from aio_datadist._transport.rendezvous import Handoff, RouteKey, share
from aio_datadist._transport.tcp import IO_ERRORS, STALL_TIMEOUT, TcpChannel
from aio_datadist.status import LLMStatusCode

__all__ = ("HANDSHAKE_TIMEOUT", "TcpListener", "TcpTransport")

#: Seconds a new connection has to complete its handshake.
HANDSHAKE_TIMEOUT = 5.0
#: Seconds a refused handshake waits for the client to close before dropping it.
_LINGER_S = 1.0


def _recv_exact(fd: int, n: int, deadline_ns: int) -> bytearray:
    """``n`` bytes from ``fd`` by the absolute deadline."""
    buf = bytearray(n)
    if n:
        sock_recv_into(fd, buf, deadline_ns)
    return buf


def _recv_handshake_frame(fd: int, deadline_ns: int) -> tuple[FrameHeader, bytearray]:
    """One handshake frame (no payload, a bounded body) and its body, by the deadline."""
    h = decode_header(_recv_exact(fd, HEADER.size, deadline_ns))
    if h.payload_len or h.body_len > MAX_HELLO_BODY:
        raise WireError(f"oversized {h.kind.name} frame in the handshake")
    return h, _recv_exact(fd, h.body_len, deadline_ns)


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
    """A listening TCP socket; every accepted connection is handshaken on its own thread
    with the engine its HELLO is routed to.

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
    ) -> None:
        host, port = address
        self.address = (host, int(sock.getsockname()[1]) if sock is not None else port)
        self._sock = sock
        self._router = router
        self._handshake_timeout = handshake_timeout
        self._lock = threading.Lock()
        self._closed = False
        self._handshaking: set[socket.socket] = set()
        self._log = get_logger("tcp", listen=f"{host}:{self.address[1]}")
        self._thread: threading.Thread | None = None
        if sock is not None:
            self._thread = threading.Thread(
                target=self._accept_loop,
                name=f"aio-dd-tcp-accept-{self.address[1]}",
                daemon=True,
            )
            self._thread.start()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for conn in self._handshaking:  # abort handshakes in progress
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
            if self._thread is not None and threading.current_thread() is not self._thread:
                self._thread.join(5.0)
            self._sock.close()
        self._log.info("tcp.listen_closed")

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                self._log.warning("tcp.accept_failed", reason=str(exc))
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.1)  # out of descriptors or memory: let some go first
                continue
            self.take(conn, f"{addr[0]}:{addr[1]}", None)

    def take(self, conn: socket.socket, remote: str, hello: bytes | None) -> None:
        """Handshake ``conn`` on a thread of its own; ``hello``: its HELLO body, when another
        process read it already."""
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._handshaking.add(conn)
        try:
            threading.Thread(
                target=self._handshake,
                args=(conn, remote, hello),
                name=f"aio-dd-tcp-hello-{remote}",
                daemon=True,
            ).start()
        except RuntimeError as exc:  # no thread to be had: this connection goes
            self._log.warning("tcp.handshake_failed", remote=remote, reason=str(exc))
            with self._lock:
                self._handshaking.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket, remote: str, hello: bytes | None) -> None:
        handed_over = False
        try:
            handed_over = self._run_handshake(conn, remote, hello)
        except IO_ERRORS as exc:
            self._log.info("tcp.handshake_failed", remote=remote, reason=str(exc))
        except Exception:
            self._log.warning("tcp.handshake_failed", remote=remote, exc_info=True)
        finally:
            with self._lock:
                self._handshaking.discard(conn)
                if not handed_over:
                    conn.close()

    def _refuse(self, conn: socket.socket, status: LLMStatusCode, message: str) -> None:
        """Answer ERROR, then wait briefly for the client to close (so it reads the answer)."""
        fd = conn.fileno()
        deadline = after_s(_LINGER_S)
        with contextlib.suppress(*IO_ERRORS):
            sock_send_bytes(fd, _error_frame(message, status), deadline)
            conn.shutdown(socket.SHUT_WR)
            scratch = bytearray(4096)
            while True:
                sock_recv_into(fd, scratch, deadline)

    def _authenticate(
        self,
        transport: TcpTransport,
        conn: socket.socket,
        remote: str,
        hello: bytes,
        nonce: bytes | None,
        deadline: int,
    ) -> Transcript | None:
        """Run the listener's half of authentication before the acceptor sees the client.

        Returns the transcript the server's proof is bound to, or None when neither end
        has a secret. Raises :class:`_ClientRefused` when the client was refused.
        """
        secret = transport.secret
        reason = refusal_reason(client_secret=nonce is not None, server_secret=secret is not None)
        if reason is None and secret is not None and nonce is not None:
            fd = conn.fileno()
            server_nonce = new_nonce()
            sock_send_bytes(fd, _auth_frame(server_nonce), deadline)
            try:
                proof = _auth_body(*_recv_handshake_frame(fd, deadline), PROOF_BYTES)
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
        self._refuse(conn, LLMStatusCode.LLM_LINK_FAILED, reason)
        raise _ClientRefused

    def _read_hello(self, conn: socket.socket, remote: str, deadline: int) -> bytes | None:
        """The client's HELLO body; None after refusing a connection that sent no HELLO."""
        fd = conn.fileno()
        raw = _recv_exact(fd, HEADER.size, deadline)
        try:
            h = decode_header(raw)
            if h.kind is not FrameKind.HELLO or h.payload_len or h.body_len > MAX_HELLO_BODY:
                raise WireError(f"expected a HELLO frame, got {h.kind.name}")
        except WireError as exc:
            self._log.warning("tcp.handshake_rejected", remote=remote, reason=str(exc))
            if raw[:4] == MAGIC:  # one of ours, of another version: tell it why
                self._refuse(conn, LLMStatusCode.LLM_LINK_FAILED, f"handshake refused: {exc}")
            return None
        return bytes(_recv_exact(fd, h.body_len, deadline))

    def _run_handshake(self, conn: socket.socket, remote: str, hello: bytes | None) -> bool:
        """Handshake one connection; True when a channel (or another process) took the
        socket over."""
        deadline = after_s(self._handshake_timeout)
        if hello is None:
            hello = self._read_hello(conn, remote, deadline)
            if hello is None:
                return False
        try:
            peer, nonce = hello_from_wire(hello)
        except WireError as exc:
            self._log.warning("tcp.handshake_rejected", remote=remote, reason=str(exc))
            self._refuse(conn, LLMStatusCode.LLM_LINK_FAILED, f"handshake refused: {exc}")
            return False
        target = self._router(peer)
        if target is None:
            reason = (
                f"nothing here links cluster {peer.to_cluster_id} for domain {peer.comm!r}"
                if peer.comm is not None
                else "this address is a rank endpoint: link_clusters cannot link here"
            )
            self._log.info("tcp.link_refused", remote=remote, reason=reason)
            self._refuse(conn, LLMStatusCode.LLM_LINK_FAILED, reason)
            return False
        if isinstance(target, Handoff):
            try:
                target(conn, remote, hello)
            except OSError as exc:
                self._log.info("tcp.handoff_failed", remote=remote, reason=str(exc))
                self._refuse(conn, LLMStatusCode.LLM_LINK_FAILED, "the domain's member is gone")
            return False  # the other process holds its own copy of the socket
        transport, acceptor = target
        return self._serve_handshake(
            transport, acceptor, conn, remote, hello, peer, nonce, deadline
        )

    def _serve_handshake(
        self,
        transport: TcpTransport,
        acceptor: Acceptor,
        conn: socket.socket,
        remote: str,
        hello: bytes,
        peer: Hello,
        nonce: bytes | None,
        deadline: int,
    ) -> bool:
        """Authenticate, register with ``acceptor`` and answer HELLO_ACK; True when the new
        channel took the socket over."""
        _tune(conn, transport.sndbuf, transport.rcvbuf)
        fd = conn.fileno()
        try:
            transcript = self._authenticate(transport, conn, remote, hello, nonce, deadline)
        except _ClientRefused:
            return False
        channel = TcpChannel(
            conn,
            peer,
            acceptor.handler,
            remote=remote,
            stall_timeout=transport.stall_timeout,
            busy_poll_us=transport.busy_poll_us,
        )
        channel.authenticated = transcript is not None
        # Hold the channel's sends from registration to HELLO_ACK: a request the server side
        # sends on the new channel meanwhile goes out after the acknowledgement.
        with channel.sends_held():
            with self._lock:
                if self._closed:
                    refusal: LinkRefused | None = LinkRefused(
                        LLMStatusCode.LLM_LINK_FAILED, "the listener is closing"
                    )
                else:
                    refusal = None
                    self._handshaking.discard(conn)
            if refusal is None:
                try:
                    local = acceptor.accept(peer, channel)
                except LinkRefused as exc:
                    refusal = exc
                except Exception as exc:
                    self._log.warning("tcp.accept_failed", remote=remote, exc_info=True)
                    refusal = LinkRefused(LLMStatusCode.LLM_FAILED, f"accept failed: {exc!r}")
            if refusal is not None:
                self._log.info(
                    "tcp.link_refused",
                    remote=remote,
                    status=str(refusal.status),
                    reason=str(refusal),
                )
                self._refuse(conn, refusal.status, str(refusal))
                return False
            try:
                channel.start()
            except LinkRefused as exc:  # the channel broke (its link is a broken link now)
                self._log.warning("tcp.accept_failed", remote=remote, reason=str(exc))
                self._refuse(conn, exc.status, str(exc))
                return False
            try:
                body = hello_to_wire(local)
                answer = pack_header(FrameKind.HELLO_ACK, body_len=len(body)) + body
                if transcript is not None and transport.secret is not None:
                    bound = replace(transcript, server_hello=body)
                    answer += _auth_frame(transport.secret.prove(Side.SERVER, bound))
                sock_send_bytes(fd, answer, deadline)
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
        return True


class TcpTransport(Transport):
    """Links over TCP: one connection per link, payloads by scatter-gather native calls.

    ``sndbuf``/``rcvbuf`` (bytes, 0: the kernel's auto-tuning) size the socket buffers;
    ``handshake_timeout`` bounds a server-side handshake (authentication included),
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
    ) -> None:
        if busy_poll_us < 0:
            raise ValueError(f"busy_poll_us must be >= 0, got {busy_poll_us}")
        self.secret = secret
        self.busy_poll_us = busy_poll_us
        self.handshake_timeout = handshake_timeout
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
            return TcpListener(sock, (host, port), router, handshake_timeout=self.handshake_timeout)

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
