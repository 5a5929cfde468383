"""Rank endpoints shared by every communication domain of a host.

A rank table names each member's endpoint (``host:port``). On a host without accelerators
every "device ip" is the host's, and callers number the ranks of every domain from 0, so
the domains of one host ask for the same few endpoints, often at the same moment. One
listener per endpoint serves them all and hands each link to the member its HELLO names
(communication domain and cluster id, a *route*):

* In one process, every engine linking a domain through an endpoint adds its route to the
  endpoint's :class:`SharedEndpoint`.
* Across processes, the first to claim an endpoint owns it: it holds the TCP listener and
  a *hub*, a Unix-domain socket named after the endpoint in Linux's abstract namespace.
  The others connect to the hub and register their routes there; the owner passes each
  link meant for them over the hub as a file descriptor (``SCM_RIGHTS``) with the HELLO it
  already read, and they finish the handshake (authentication included) as if they had
  accepted it themselves. Both ends of the hub check (``SO_PEERCRED``) that the other runs
  as the same user.
* The owner keeps the endpoint while it has routes or members. When it goes (its process
  ended), the members claim the endpoint again: one becomes the owner and the others
  register with it. A link that arrives meanwhile is refused, and the connecting side
  retries until its deadline (``link`` does).

Hub messages are JSON datagrams (``SOCK_SEQPACKET``): a member sends ``{"op": "add" |
"remove", "seq", "comm", "cluster"}`` and the owner answers ``add`` with ``{"op": "reply",
"seq", "error"}``; the owner hands a link over as ``{"op": "link", "remote", "hello"}``
(HELLO bytes in hex) with the socket's descriptor attached.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from aio_datadist._log import get_logger
from aio_datadist._transport.base import Hello, LinkRefused, Listener
from aio_datadist.status import LLMStatusCode

__all__ = ("Handoff", "RouteKey", "SharedEndpoint", "share")

#: A link's route at a shared endpoint: (communication domain name, the cluster it reaches).
RouteKey = tuple[str, int]
T = TypeVar("T")

#: Longest hub message.
_MAX_MESSAGE = 1 << 16
#: Pause between attempts to claim an endpoint whose owner is coming or going.
_CLAIM_PAUSE_S = 0.005
#: Seconds a member waits for the owner's answer to a registration.
_REPLY_TIMEOUT_S = 5.0
#: Seconds members have to take an endpoint over once its owner went.
_RECLAIM_S = 10.0
#: The answer a registration gets when the owner went before answering.
_OWNER_LOST = "the owner went"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

_log = get_logger("rendezvous")


class Taker(Protocol):
    """A listener that also finishes handshakes of connections handed to it."""

    def take(self, conn: socket.socket, remote: str, hello: bytes | None) -> None:
        """Run the server's handshake of ``conn`` (its HELLO already read when given)."""
        ...

    def close(self) -> None:
        """Stop listening and abort handshakes in progress."""
        ...


#: Makes the endpoint's listener: over a bound, listening TCP socket (the owner), or over
#: none (a member: it only takes what the owner hands over), routing each HELLO.
ListenerFactory = Callable[[socket.socket | None, Callable[[Hello], Any]], Taker]


class Handoff:
    """A route served by another process: the owner passes the connection over the hub."""

    def __init__(self, member: _Member) -> None:
        self._member = member

    def __call__(self, conn: socket.socket, remote: str, hello: bytes) -> None:
        """Pass ``conn`` and its HELLO to the member; the caller then closes its copy.

        :raises OSError: the member is gone.
        """
        message = json.dumps({"op": "link", "remote": remote, "hello": hello.hex()}).encode()
        with self._member.send_lock:
            socket.send_fds(self._member.sock, [message], [conn.fileno()])


class _Member:
    """A process registered at the owner's hub."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.send_lock = threading.Lock()
        self.routes: set[RouteKey] = set()


def _route_key(peer: Hello) -> RouteKey | None:
    if peer.comm is None or peer.to_cluster_id is None:
        return None
    return (peer.comm, peer.to_cluster_id)


def _check_same_user(sock: socket.socket) -> int:
    """The peer process's pid, once it is seen to run as this user.

    :raises PermissionError: it runs as another user.
    """
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    if uid != os.getuid():
        raise PermissionError(f"process {pid} runs as uid {uid}, not {os.getuid()}")
    return int(pid)


def _send(sock: socket.socket, lock: threading.Lock, message: dict[str, Any]) -> None:
    with lock:
        sock.send(json.dumps(message).encode())


class SharedEndpoint(Generic[T]):
    """One rank endpoint as this process sees it: its routes here, and either the listener
    with the hub (the owner) or a connection to the owner's hub (a member)."""

    def __init__(
        self,
        address: tuple[str, int],
        bind: Callable[[], socket.socket],
        make_listener: ListenerFactory,
    ) -> None:
        self.address = address
        self._bind = bind
        self._make_listener = make_listener
        self._lock = threading.Lock()
        self._routes: dict[RouteKey, T] = {}
        self._owner = False
        self._listener: Taker | None = None  # the owner's, over the TCP socket
        self._taker: Taker | None = None  # a member's, for links the owner hands over
        self._hub: socket.socket | None = None  # owner: listening; member: to the owner
        self._members: list[_Member] = []
        self._send_lock = threading.Lock()  # a member's messages to the hub
        self._replies: dict[int, str | None] = {}
        self._waiting: set[int] = set()
        self._reply_cond = threading.Condition(self._lock)
        self._seq = 0
        #: True once the endpoint was given up; routes are then added to a new one.
        self.closed = False
        host, port = address
        self._where = f"{host}:{port}"
        self._hub_name = f"\0aio-datadist/endpoint/{self._where}" if _HUBS else None
        self._log = _log.bind(endpoint=self._where)

    # -- routes -----------------------------------------------------------------------------
    def _taken(self, key: RouteKey) -> str:
        return f"domain {key[0]!r} already listens for cluster {key[1]} at {self._where}"

    def add(self, key: RouteKey, target: T, deadline: float) -> bool:
        """Route links for ``key`` to ``target`` here, claiming the endpoint if needed;
        False when the endpoint was given up meanwhile (add to a new one).

        :raises LinkRefused: ``LLM_LINK_FAILED``: the address cannot be listened on, the
            route is taken, or the endpoint's owner does not answer.
        """
        with self._lock:
            if self.closed:
                return False
            if key in self._routes:
                raise LinkRefused(LLMStatusCode.LLM_LINK_FAILED, self._taken(key))
            self._claim(deadline)
            if self._owner:
                if any(key in m.routes for m in self._members):
                    raise LinkRefused(
                        LLMStatusCode.LLM_LINK_FAILED, self._taken(key) + " (another process)"
                    )
                self._routes[key] = target
                return True
            self._routes[key] = target
            error = self._register(key)
            if error is _OWNER_LOST:  # claimed again meanwhile, with every route here
                error = None if key in self._routes else f"the owner of {self._where} went"
            if error is not None:
                self._routes.pop(key, None)
                raise LinkRefused(LLMStatusCode.LLM_LINK_FAILED, error)
            return True

    def remove(self, key: RouteKey) -> bool:
        """Stop routing ``key`` here; True when the endpoint is then given up."""
        with self._lock:
            if self._routes.pop(key, None) is None:
                return False
            if not self._owner and self._hub is not None:
                with contextlib.suppress(OSError):
                    self._request("remove", key)
            return self._retire_if_unused()

    def route(self, peer: Hello) -> T | Handoff | None:
        """Where a link with ``peer``'s HELLO goes: a route here, another process, nowhere."""
        key = _route_key(peer)
        if key is None:
            return None
        with self._lock:
            target = self._routes.get(key)
            if target is not None:
                return target
            for member in self._members:
                if key in member.routes:
                    return Handoff(member)
        return None

    def _route_here(self, peer: Hello) -> T | None:
        key = _route_key(peer)
        with self._lock:
            return None if key is None else self._routes.get(key)

    # -- claiming the endpoint ------------------------------------------------------------
    def _claim(self, deadline: float) -> None:
        """Become the owner, or a member of the process that owns it, unless this process
        is one already (lock held; released while waiting for an owner to come or go)."""
        while not (self._owner or self._hub is not None):
            try:
                if self._try_own() or self._try_join():
                    return
            except OSError as exc:
                raise LinkRefused(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"cannot listen on {self._where}: {exc.strerror or exc}",
                ) from exc
            if time.monotonic() >= deadline:
                raise LinkRefused(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"{self._where} is changing hands: no process took it in time",
                )
            self._lock.release()
            try:
                time.sleep(_CLAIM_PAUSE_S)
            finally:
                self._lock.acquire()

    def _try_own(self) -> bool:
        """Take the hub name and the TCP address; False when another process holds the hub.

        :raises OSError: the TCP address is taken by something else, or no hub can be made.
        """
        hub = None
        if self._hub_name is not None:
            hub = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                hub.bind(self._hub_name)
                hub.listen(64)
            except OSError as exc:
                hub.close()
                if exc.errno == errno.EADDRINUSE:
                    return False
                raise
        try:
            sock = self._bind()
        except BaseException:
            if hub is not None:
                hub.close()
            raise
        self._owner, self._hub = True, hub
        self._listener = self._make_listener(sock, self.route)
        if hub is not None:
            self._thread(self._hub_loop, hub, "hub")
        self._log.info("rendezvous.owner")
        return True

    def _try_join(self) -> bool:
        """Connect to the owner's hub and register every route here; False when no owner
        is there (lock held)."""
        assert self._hub_name is not None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self._hub_name)
            pid = _check_same_user(conn)
        except (ConnectionRefusedError, FileNotFoundError):
            conn.close()
            return False
        except PermissionError as exc:
            conn.close()
            raise PermissionError(
                errno.EACCES, f"the endpoint is held by another user's process ({exc})"
            ) from None
        except BaseException:
            conn.close()
            raise
        self._hub = conn
        if self._taker is None:
            self._taker = self._make_listener(None, self._route_here)
        self._thread(self._member_loop, conn, "member")
        self._log.info("rendezvous.member", owner_pid=pid)
        for key in list(self._routes):  # the owner changed: register them again
            error = self._register(key)
            if error is _OWNER_LOST:
                break  # that owner went too, and the routes were registered again
            if error is not None:
                self._log.warning("rendezvous.route_lost", comm=key[0], cluster_id=key[1])
                del self._routes[key]
        return True

    def _thread(
        self, target: Callable[[socket.socket], None], sock: socket.socket, what: str
    ) -> None:
        threading.Thread(
            target=target, args=(sock,), name=f"aio-dd-{what}-{self._where}", daemon=True
        ).start()

    def _request(self, op: str, key: RouteKey) -> int:
        """Send a member's message to the hub (lock held); its sequence number."""
        assert self._hub is not None
        self._seq += 1
        message = {"op": op, "seq": self._seq, "comm": key[0], "cluster": key[1]}
        _send(self._hub, self._send_lock, message)
        return self._seq

    def _register(self, key: RouteKey) -> str | None:
        """Register ``key`` with the owner and wait for its answer (lock held, released while
        waiting): None, why it refused, or :data:`_OWNER_LOST`."""
        try:
            seq = self._request("add", key)
        except OSError:
            return _OWNER_LOST
        self._waiting.add(seq)
        try:
            if not self._reply_cond.wait_for(lambda: seq in self._replies, _REPLY_TIMEOUT_S):
                return f"the owner of {self._where} did not answer"
            return self._replies.pop(seq)
        finally:
            self._waiting.discard(seq)

    # -- the owner's hub ------------------------------------------------------------------
    def _hub_loop(self, hub: socket.socket) -> None:
        while True:
            try:
                conn, _ = hub.accept()
            except OSError:
                return  # the hub closed
            try:
                pid = _check_same_user(conn)
            except OSError as exc:
                self._log.warning("rendezvous.member_refused", reason=str(exc))
                conn.close()
                continue
            member = _Member(conn, pid)
            with self._lock:
                if self.closed:
                    conn.close()
                    return
                self._members.append(member)
            threading.Thread(
                target=self._serve_member,
                args=(member,),
                name=f"aio-dd-hub-member-{self._where}",
                daemon=True,
            ).start()

    def _serve_member(self, member: _Member) -> None:
        try:
            while True:
                data = member.sock.recv(_MAX_MESSAGE)
                if not data:
                    break
                self._on_member_message(member, data)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._log.info("rendezvous.member_lost", pid=member.pid, reason=str(exc))
        with self._lock:
            if member in self._members:
                self._members.remove(member)
            member.sock.close()
            retired = self._retire_if_unused()
        if retired:
            _forget(self)

    def _on_member_message(self, member: _Member, data: bytes) -> None:
        message = json.loads(data)
        key: RouteKey = (str(message["comm"]), int(message["cluster"]))
        with self._lock:
            if message["op"] == "remove":
                member.routes.discard(key)
                return
            taken = key in self._routes or any(key in m.routes for m in self._members)
            if not taken:
                member.routes.add(key)
        reply = {"op": "reply", "seq": message["seq"], "error": self._taken(key) if taken else None}
        with contextlib.suppress(OSError):
            _send(member.sock, member.send_lock, reply)

    # -- a member's connection ------------------------------------------------------------
    def _member_loop(self, conn: socket.socket) -> None:
        try:
            while True:
                data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 4)
                if not data:
                    for fd in fds:
                        os.close(fd)
                    break
                self._on_owner_message(data, fds)
        except OSError as exc:
            self._log.info("rendezvous.owner_lost", reason=str(exc))
        retired = False
        with self._lock:
            conn.close()
            if self._hub is not conn:
                return  # this side let it go
            self._hub = None
            for seq in self._waiting:
                self._replies[seq] = _OWNER_LOST
            self._reply_cond.notify_all()
            if self.closed:
                return
            if not self._routes:
                retired = self._retire_if_unused()
            else:
                try:  # the owner went: claim the endpoint again for the routes here
                    self._claim(time.monotonic() + _RECLAIM_S)
                except LinkRefused as exc:
                    self._log.warning("rendezvous.reclaim_failed", reason=str(exc))
        if retired:
            _forget(self)

    def _on_owner_message(self, data: bytes, fds: list[int]) -> None:
        try:
            message = json.loads(data)
            op = message["op"]
        except (ValueError, KeyError, TypeError):
            op = None
        if op == "reply":
            with self._lock:
                seq = int(message["seq"])
                if seq in self._waiting:
                    self._replies[seq] = message.get("error")
                    self._reply_cond.notify_all()
        taker = self._taker
        if op != "link" or len(fds) != 1 or taker is None:
            for fd in fds:
                os.close(fd)
            return
        conn = socket.socket(fileno=fds[0])
        try:
            hello = bytes.fromhex(str(message["hello"]))
        except ValueError:
            conn.close()
            return
        taker.take(conn, str(message.get("remote", "")), hello)

    # -- giving up ------------------------------------------------------------------------
    def _retire_if_unused(self) -> bool:
        """Give the endpoint up when nothing here or elsewhere uses it (lock held)."""
        if self._routes or self._members or self.closed:
            return False
        self.closed = True
        listener, self._listener = self._listener, None
        taker, self._taker = self._taker, None
        hub, self._hub = self._hub, None
        if listener is not None:
            listener.close()  # the address first, so a new owner can take it with the hub
        if taker is not None:
            taker.close()
        if hub is not None:
            with contextlib.suppress(OSError):
                hub.shutdown(socket.SHUT_RDWR)
            hub.close()
        self._log.info("rendezvous.released")
        return True


#: Cross-process hubs need Linux (abstract Unix socket names, ``SO_PEERCRED``); elsewhere
#: an endpoint is shared by the engines of one process only.
_HUBS = sys.platform.startswith("linux")

_registry_lock = threading.Lock()
_registry: dict[tuple[str, int], SharedEndpoint[Any]] = {}


def _forget(endpoint: SharedEndpoint[Any]) -> None:
    with _registry_lock:
        if _registry.get(endpoint.address) is endpoint:
            del _registry[endpoint.address]


class SharedRoute(Listener):
    """One route at a shared endpoint; closing it removes the route."""

    def __init__(self, endpoint: SharedEndpoint[Any], key: RouteKey) -> None:
        self.address = endpoint.address
        self._endpoint = endpoint
        self._key = key
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._endpoint.remove(self._key):
            _forget(self._endpoint)


def share(
    address: tuple[str, int],
    key: RouteKey,
    target: T,
    *,
    bind: Callable[[], socket.socket],
    make_listener: ListenerFactory,
    timeout: float,
) -> Listener:
    """Route the links for ``key`` at the endpoint ``address`` to ``target``.

    ``bind`` makes the listening TCP socket when this process becomes the owner;
    ``make_listener`` the listener over it (or over none, for a member).

    :raises LinkRefused: ``LLM_LINK_FAILED`` (see :meth:`SharedEndpoint.add`).
    """
    deadline = time.monotonic() + timeout
    while True:
        with _registry_lock:
            endpoint = _registry.get(address)
            if endpoint is None or endpoint.closed:
                endpoint = _registry[address] = SharedEndpoint(address, bind, make_listener)
        if endpoint.add(key, target, deadline):
            return SharedRoute(endpoint, key)
