"""Same-host identity: how two ends of a link learn, from the kernel, that they share a host.

Each side's handshake may carry a :class:`HostPresence`: the kernel's boot id and the inode
of its pid namespace (together: the same running kernel and the same process-id space).
That is only an offer. The proof is made over a Unix-domain socket in the abstract
namespace, after the TCP handshake: the server's HELLO_ACK names its process's
:class:`Verifier` and a random token for this link; the client connects to that verifier
and sends the token, its own view of the TCP connection (local and peer address) and the
descriptor of its region board (``SCM_RIGHTS``); the verifier answers with the server's
board descriptor when the token is the one it gave and the connection is the one it
accepted (seen from the other end). Each side then knows the other's process from the
kernel (``SO_PEERCRED`` of the Unix socket), not from a claim, and holds the other's
board by descriptor: nothing a peer names is ever opened, and no claim of a peer chooses
which process this side's bytes go to.

The token travels in the HELLO_ACK, so only the holder of this TCP connection knows it (a
client that knows another link's addresses cannot take that link's place), and the
connection's addresses must match (a server that relays a third process's token to a
client gets nothing: that process accepted another connection). With a link secret the
HELLO_ACK, token included, is covered by the server's proof.

On the wire the presence is one extension record of the HELLO body's extension blob:
``u16 type (4), u16 length (56), 16 bytes boot id, u64 pid-namespace inode, 16 bytes
verifier id, 16 bytes token`` (a client sends zeros for the last two). Unknown record types
are skipped, so later extensions can be added.
"""

from __future__ import annotations

import array
import contextlib
import functools
import os
import selectors
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from aio_datadist._log import get_logger
from aio_datadist._transport._wire import (
    HelloExtension,
    WireError,
    decode_extension_records,
    encode_extension_record,
)

__all__ = (
    "HostPresence",
    "SameHostPeer",
    "SameHostProof",
    "Verifier",
    "decode_extensions",
    "encode_extensions",
    "local_host_key",
    "presence_from_records",
    "prove",
    "verifier",
)

_PRESENCE = struct.Struct("<16sQ16s16s")
_NO_ID = bytes(16)
#: Seconds a verifier waits for a connected client's message.
_CLIENT_S = 2.0
#: Seconds a link's token stays valid when its client never comes to prove.
TOKEN_TTL_S = 60.0
#: Clients a verifier serves at once (more are refused).
_MAX_CLIENTS = 64
_MAGIC = b"AIOS"
_MAX_MESSAGE = 512
_CRED = struct.Struct("3i")
#: Address tuple of one end of a TCP connection, as both ends see it.
Endpoint = tuple[str, int]


@dataclass(frozen=True, slots=True)
class HostPresence:
    """One process's same-host offer: which host it runs on, and (from a server) where and
    with which token the client proves itself.

    ``board_fd`` is this process's own region board; it never travels on the wire.
    """

    boot_id: bytes
    pid_ns: int
    verifier: bytes = _NO_ID
    token: bytes = _NO_ID
    board_fd: int = field(default=-1, compare=False)

    @property
    def host_key(self) -> tuple[bytes, int]:
        """Equal for two processes that share a kernel and a pid namespace."""
        return (self.boot_id, self.pid_ns)


@dataclass(frozen=True, slots=True)
class SameHostPeer:
    """The peer process as the kernel named it, and its region board's descriptor (held
    by the :class:`SameHostProof` that carries it)."""

    pid: int
    board_fd: int


class SameHostProof:
    """A link's same-host peer, once proven; callbacks run when it is (at once if it is)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peer: SameHostPeer | None = None
        self._callbacks: list[Callable[[SameHostPeer], None]] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once the link went (its token, if any, is withdrawn)."""
        return self._closed

    @property
    def peer(self) -> SameHostPeer | None:
        """The proven peer, or None (not yet, or never)."""
        return self._peer

    def then(self, callback: Callable[[SameHostPeer], None]) -> None:
        """Call ``callback(peer)`` once the peer is proven (now, if it is)."""
        with self._lock:
            peer = self._peer
            if peer is None:
                if not self._closed:
                    self._callbacks.append(callback)
                return
        _run_callback(callback, peer)

    def prove(self, peer: SameHostPeer) -> bool:
        """Record the proven ``peer`` (its board descriptor is this proof's from now on)
        and run the callbacks; False (the descriptor closed) once closed or proven."""
        with self._lock:
            if self._closed or self._peer is not None:
                os.close(peer.board_fd)
                return False
            self._peer = peer
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            _run_callback(callback, peer)
        return True

    def close(self) -> None:
        """The link is gone: drop the callbacks and the peer's board descriptor."""
        with self._lock:
            self._closed = True
            self._callbacks.clear()
            peer, self._peer = self._peer, None
        if peer is not None:
            os.close(peer.board_fd)


def _run_callback(callback: Callable[[SameHostPeer], None], peer: SameHostPeer) -> None:
    try:
        callback(peer)
    except Exception:  # a broken callback must not leave the proof half done
        get_logger("samehost").warning("samehost.callback_failed", exc_info=True)


@functools.cache
def local_host_key() -> tuple[bytes, int] | None:
    """This process's ``(boot id, pid-namespace inode)``; None where Linux does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = uuid.UUID(f.read().strip()).bytes
        return boot, os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError):
        return None


def encode_extensions(presence: HostPresence | None) -> bytes:
    """The HELLO extension blob carrying ``presence`` (empty without one)."""
    if presence is None:
        return b""
    body = _PRESENCE.pack(presence.boot_id, presence.pid_ns, presence.verifier, presence.token)
    return encode_extension_record(HelloExtension.HOST_PRESENCE, body)


def decode_extensions(blob: bytes | bytearray | memoryview) -> HostPresence | None:
    """The presence in a HELLO extension blob, if any.

    :raises WireError: a truncated record, or a presence record of the wrong size.
    """
    return presence_from_records(decode_extension_records(blob))


def presence_from_records(records: Mapping[int, bytes]) -> HostPresence | None:
    """The presence among decoded extension records, if any.

    :raises WireError: a presence record of the wrong size.
    """
    body = records.get(HelloExtension.HOST_PRESENCE)
    if body is None:
        return None
    if len(body) != _PRESENCE.size:
        raise WireError(f"host presence record of {len(body)} bytes, not {_PRESENCE.size}")
    boot, pid_ns, verifier_id, token = _PRESENCE.unpack(body)
    return HostPresence(bytes(boot), pid_ns, bytes(verifier_id), bytes(token))


def _address(verifier_id: bytes) -> bytes:
    return b"\0aio-datadist-samehost-" + verifier_id.hex().encode()


def _endpoints(sock: socket.socket) -> tuple[Endpoint, Endpoint]:
    """``(local, peer)`` addresses of a connected TCP socket."""
    local, peer = sock.getsockname(), sock.getpeername()
    return (str(local[0]), int(local[1])), (str(peer[0]), int(peer[1]))


def _encode_claim(token: bytes, local: Endpoint, peer: Endpoint) -> bytes:
    text = f"{local[0]}|{local[1]}|{peer[0]}|{peer[1]}".encode()
    return _MAGIC + token + text


def _decode_claim(data: bytes) -> tuple[bytes, Endpoint, Endpoint] | None:
    if len(data) < 20 or not data.startswith(_MAGIC):
        return None
    try:
        host_a, port_a, host_b, port_b = data[20:].decode("ascii").split("|")
        return data[4:20], (host_a, int(port_a)), (host_b, int(port_b))
    except ValueError:
        return None


def _peer_pid(sock: socket.socket) -> int:
    pid, _, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return int(pid)


def _recv_with_fds(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it (any beyond one are closed)."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(
        _MAX_MESSAGE, socket.CMSG_SPACE(4 * fds.itemsize), socket.MSG_CMSG_CLOEXEC
    )
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % fds.itemsize
            fds.frombytes(payload[:usable])
    received = list(fds)
    if flags & socket.MSG_CTRUNC:  # more than we take: close what came
        for fd in received:
            os.close(fd)
        return data, []
    return data, received


def prove(
    tcp: socket.socket, server: HostPresence, board_fd: int, timeout: float
) -> SameHostPeer | str:
    """(The client.) Prove this process to the verifier ``server`` names, for the TCP
    connection ``tcp``, sending this side's board ``board_fd``; the server's process and
    board, or why not."""
    if server.verifier == _NO_ID or server.token == _NO_ID:
        return "the peer offers no same-host proof"
    local, peer = _endpoints(tcp)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(max(0.001, timeout))
        try:
            sock.connect(_address(server.verifier))
            sock.sendmsg(
                [_encode_claim(server.token, local, peer)],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [board_fd]))],
            )
            data, fds = _recv_with_fds(sock)
            pid = _peer_pid(sock)
        except OSError as exc:
            return f"no proof from the peer's verifier: {exc}"
    if data != b"OK" or len(fds) != 1 or pid <= 0:
        for fd in fds:
            os.close(fd)
        return "the peer's verifier refused" if data != b"OK" else "a malformed proof"
    return SameHostPeer(pid, fds[0])


@dataclass(eq=False)
class _Expected:
    """A link whose client may prove itself: the connection as the client must see it."""

    client: Endpoint
    server: Endpoint
    board_fd: int
    proof: SameHostProof
    until: float


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    until: float


class Verifier:
    """This process's end of same-host proofs: an abstract Unix socket served by one thread
    (non-blocking: a client that never sends costs a slot for :data:`_CLIENT_S`)."""

    def __init__(self) -> None:
        self.id = os.urandom(16)
        self._log = get_logger("samehost")
        self._lock = threading.Lock()
        self._expected: dict[bytes, _Expected] = {}
        self._listen = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._listen.bind(_address(self.id))
            self._listen.listen(_MAX_CLIENTS)
            self._listen.setblocking(False)
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._listen, selectors.EVENT_READ, None)
            self._clients: dict[socket.socket, _Client] = {}
            threading.Thread(target=self._run, name="aio-dd-samehost", daemon=True).start()
        except BaseException:
            self._listen.close()
            raise

    def expect(self, tcp: socket.socket, board_fd: int, proof: SameHostProof) -> bytes:
        """A token the client of ``tcp`` proves itself with (it then gets ``board_fd``, and
        ``proof`` the client); it is withdrawn once ``proof`` closes, or after
        :data:`TOKEN_TTL_S`."""
        server, client = _endpoints(tcp)
        token = os.urandom(16)
        board = os.dup(board_fd)  # the engine may close its own meanwhile
        with self._lock:
            self._expected[token] = _Expected(
                client, server, board, proof, time.monotonic() + TOKEN_TTL_S
            )
        return token

    def _run(self) -> None:
        while True:
            try:
                self._turn()
            except Exception:  # never the end of the verifier: log and go on
                self._log.warning("samehost.verifier_failed", exc_info=True)
                time.sleep(0.05)

    def _turn(self) -> None:
        for key, _ in self._selector.select(1.0):
            if key.data is None:
                self._accept()
            else:
                self._serve(key.data)
        now = time.monotonic()
        for client in [c for c in self._clients.values() if c.until <= now]:
            self._drop(client)
        with self._lock:
            stale = [t for t, e in self._expected.items() if e.until <= now or e.proof.closed]
            boards = [self._expected.pop(t).board_fd for t in stale]
        for fd in boards:
            os.close(fd)

    def _accept(self) -> None:
        try:
            sock, _ = self._listen.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._log.info("samehost.accept_failed", reason=str(exc))
            time.sleep(0.01)
            return
        if len(self._clients) >= _MAX_CLIENTS:
            sock.close()
            return
        sock.setblocking(False)
        client = _Client(sock, time.monotonic() + _CLIENT_S)
        self._clients[sock] = client
        self._selector.register(sock, selectors.EVENT_READ, client)

    def _drop(self, client: _Client) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(client.sock)
        self._clients.pop(client.sock, None)
        client.sock.close()

    def _serve(self, client: _Client) -> None:
        try:
            data, fds = _recv_with_fds(client.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(client)
            return
        try:
            board = self._verify(client.sock, data, fds)
        except _Refused as exc:
            self._log.warning("samehost.proof_refused", reason=str(exc))
            board = -1
        try:
            with contextlib.suppress(OSError):
                if board < 0:
                    client.sock.send(b"NO")
                else:
                    client.sock.sendmsg(
                        [b"OK"],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [board]))],
                    )
        finally:
            if board >= 0:
                os.close(board)
            self._drop(client)

    def _verify(self, sock: socket.socket, data: bytes, fds: list[int]) -> int:
        """This side's board descriptor (a duplicate, the caller's to close) for a valid
        claim, whose claimant is then its link's proven peer; raises :class:`_Refused`
        otherwise. Takes ``fds`` over: each is closed or held by the proof."""
        taken = False
        try:
            claim = _decode_claim(data)
            if claim is None or len(fds) != 1:
                raise _Refused("a malformed claim")
            token, client_local, client_peer = claim
            pid = _peer_pid(sock)
            if pid <= 0:
                raise _Refused("the claimant's process is not visible here")
            with self._lock:
                expected = self._expected.get(token)
                if expected is None:
                    raise _Refused(f"process {pid} sent an unknown token")
                if (client_local, client_peer) != (expected.client, expected.server):
                    raise _Refused(f"process {pid} does not hold the connection of its token")
                del self._expected[token]
            taken = True  # the proof holds (or closes) the claimant's board from here
            if not expected.proof.prove(SameHostPeer(pid, fds[0])):
                os.close(expected.board_fd)
                raise _Refused("the link closed before its proof came")
            return expected.board_fd
        finally:
            for fd in fds[1:] if taken else fds:
                os.close(fd)


class _Refused(Exception):
    """A claim the verifier does not accept."""


_verifier_lock = threading.Lock()
_verifier: Verifier | None = None


def _forget_in_child() -> None:
    global _verifier
    _verifier = None  # the parent's thread serves the inherited socket, not this process


os.register_at_fork(after_in_child=_forget_in_child)


def verifier() -> Verifier | str:
    """This process's verifier (made on first use), or why there is none."""
    global _verifier
    with _verifier_lock:
        if _verifier is None:
            try:
                _verifier = Verifier()
            except (OSError, RuntimeError) as exc:
                return f"no same-host verifier: {exc}"
        return _verifier
