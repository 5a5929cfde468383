"""Connections in their handshake, served without a thread each.

A listener hands every accepted connection to its :class:`Handshakes`. One selector thread
accepts connections and waits for each one's next bytes (non-blocking reads into a
buffer); a small pool of worker threads runs the steps between the waits (route,
authenticate, register the link, answer), which may block for a moment. A handshake is a
generator of :data:`Steps`: it yields :class:`Read` (exactly ``n`` bytes, sent back once
they arrived) or :data:`LINGER` (after a refusal was sent: wait until the client closes,
at most :data:`LINGER_S`), and returns whether its socket was handed over (to a channel or
another process); otherwise the socket is closed.

Everything is bounded: at most ``max_pending`` handshakes at once (a connection beyond
them evicts the oldest one: an honest client sends its HELLO at once), each within its
deadline, and at most ``workers`` threads. No error ends the selector thread: it logs,
backs off and goes on; while the process is out of descriptors it stops accepting for a
moment instead of spinning.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from aio_datadist._log import get_logger
from aio_datadist._native.api import NetTimeout, PeerClosed
from aio_datadist._transport.deadlines import after_s, now_ns

__all__ = (
    "HANDSHAKE_WORKERS",
    "LINGER",
    "LINGER_S",
    "MAX_PENDING_HANDSHAKES",
    "Handshakes",
    "Read",
    "Steps",
    "Wait",
)

#: Handshakes a listener keeps in progress at once.
MAX_PENDING_HANDSHAKES = 256
#: Threads that run handshake steps (started when needed, gone after a few idle seconds).
HANDSHAKE_WORKERS = 4
#: Seconds a refused client has to close before its connection is dropped.
LINGER_S = 1.0
#: Seconds accepting stops while the process is out of descriptors or memory.
_ACCEPT_BACKOFF_S = 0.1
#: Seconds an idle worker thread waits for more work before it ends.
_WORKER_IDLE_S = 5.0
#: Connections taken off the listening socket per readiness (the rest on the next turn).
_ACCEPT_BURST = 64
_SCRATCH = 4096


@dataclass(frozen=True, slots=True)
class Read:
    """Wait for exactly ``n`` more bytes of the client."""

    n: int


class _Linger:
    """Wait for the client to close (it was refused and told why)."""


class _Drop:
    """(Queued for the selector thread.) End this handshake."""


_DROP = _Drop()


#: Yielded after a refusal: the connection stays until the client closes, or LINGER_S.
LINGER = _Linger()

#: What a handshake waits for.
Wait = Read | _Linger
#: A handshake: yields what it waits for, gets the bytes read, returns "handed over".
Steps = Generator[Wait, bytes, bool]
#: Makes a connection's handshake: ``(conn, remote, hello or None, deadline_ns)``.
StartHandshake = Callable[[socket.socket, str, bytes | None, int], Steps]

_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(eq=False)
class _Shake:
    """One connection in its handshake."""

    conn: socket.socket
    remote: str
    steps: Steps
    deadline: int  # monotonic ns
    buf: bytearray = field(default_factory=bytearray)
    got: int = 0
    lingering: bool = False
    #: In the selector (waiting for the client), not in a worker.
    waiting: bool = False


class _Workers:
    """At most ``size`` threads running submitted calls in order, started when needed."""

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = max(1, size)
        self._jobs: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._threads = 0
        self._idle = 0
        self._stopping = False
        self._log = get_logger("tcp", workers=name)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on a worker. Where no worker runs and none can start (the process
        is out of threads), it runs here and now, so it still ends."""
        with self._cond:
            self._jobs.append(job)
            if self._idle:
                self._cond.notify()
                return
            if self._threads >= self._size:
                return
            self._threads += 1
        try:
            threading.Thread(target=self._work, name=self._name, daemon=True).start()
        except RuntimeError as exc:
            with self._cond:
                self._threads -= 1
                alone = self._threads == 0
            self._log.warning("tcp.worker_not_started", reason=str(exc))
            if alone:
                self._run_queued()

    def _run_queued(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            job()

    def stop(self) -> None:
        """Let idle workers end now (queued jobs still run)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    if self._stopping:
                        self._threads -= 1
                        return
                    self._idle += 1
                    woke = self._cond.wait(_WORKER_IDLE_S)
                    self._idle -= 1
                    if not woke and not self._jobs:
                        self._threads -= 1
                        return
                job = self._jobs.popleft()
            job()
            del job  # an idle worker keeps nothing of its last job alive


class Handshakes:
    """The handshakes of one listener: one selector thread, a few workers.

    ``sock``: the listening socket whose connections to accept (None: only connections
    handed over by :meth:`take`). ``start`` makes each connection's :data:`Steps`.
    """

    def __init__(
        self,
        name: str,
        sock: socket.socket | None,
        start: StartHandshake,
        *,
        timeout: float,
        max_pending: int = MAX_PENDING_HANDSHAKES,
        workers: int = HANDSHAKE_WORKERS,
    ) -> None:
        self._sock = sock
        self._start = start
        self._timeout = timeout
        self._max_pending = max(1, max_pending)
        self._workers = _Workers(f"{name}-step", workers)
        self._log = get_logger("tcp", listen=name)
        self._lock = threading.Lock()
        self._shakes: dict[socket.socket, _Shake] = {}  # in admission order
        self._queued: collections.deque[tuple[_Shake, Wait | _Drop]] = collections.deque()
        self._closed = False
        self._evicted = 0
        self._evicted_logged = -1.0
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._accept_paused_until = 0
        try:
            self._selector.register(self._wake_r, selectors.EVENT_READ, None)
            if sock is not None:
                sock.setblocking(False)
                self._selector.register(sock, selectors.EVENT_READ, sock)
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()
        except BaseException:
            self._selector.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise

    @property
    def pending(self) -> int:
        """Handshakes in progress."""
        with self._lock:
            return len(self._shakes)

    def take(self, conn: socket.socket, remote: str, hello: bytes | None) -> None:
        """Handshake ``conn`` (from any thread); ``hello``: its HELLO body, when another
        process read it already."""
        self._admit(conn, remote, hello)

    def detach(self, conn: socket.socket) -> bool:
        """(From ``conn``'s own steps, before its socket is handed over.) Take ``conn`` out
        of the handshakes that closing aborts or the pending count shows; False when closing
        began already (the handshake must then refuse)."""
        with self._lock:
            if self._closed:
                return False
            self._shakes.pop(conn, None)
            return True

    def close(self) -> None:
        """Stop accepting and abort every handshake in progress; returns once the selector
        thread ended (within a few seconds)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for conn in self._shakes:  # a worker's blocking step fails at once
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self._wake()
        self._workers.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(5.0)

    # -- admission and steps (any thread) -------------------------------------------------
    def _admit(self, conn: socket.socket, remote: str, hello: bytes | None) -> None:
        evicted: _Shake | None = None
        evicted_waiting = False
        with self._lock:
            if self._closed:
                conn.close()
                return
            if len(self._shakes) >= self._max_pending:  # the oldest makes room
                evicted = next(iter(self._shakes.values()))
                del self._shakes[evicted.conn]
                self._evicted += 1
                evicted_waiting = evicted.waiting
                if not evicted_waiting:  # a worker's step fails at once, and ends it
                    with contextlib.suppress(OSError):
                        evicted.conn.shutdown(socket.SHUT_RDWR)
            deadline = after_s(self._timeout)
            shake = _Shake(conn, remote, self._start(conn, remote, hello, deadline), deadline)
            self._shakes[conn] = shake
        if evicted is not None:
            if evicted_waiting:
                self._queue_drop(evicted)
            self._note_evicted()
        self._workers.submit(functools.partial(self._step, shake, None))

    def _note_evicted(self) -> None:
        now = time.monotonic()
        if now - self._evicted_logged < 1.0:
            return  # at most one line a second, with the count so far
        self._evicted_logged = now
        self._log.warning(
            "tcp.handshake_evicted",
            pending=self._max_pending,
            evicted=self._evicted,
            note="more connections in their handshake than the listener keeps",
        )

    def _step(self, shake: _Shake, data: bytes | None) -> None:
        """Run ``shake``'s steps up to its next wait (on a worker); ``data``: the bytes it
        waited for (None: its first step)."""
        try:
            wait = next(shake.steps) if data is None else shake.steps.send(data)
        except StopIteration as stop:
            self._finish(shake, handed_over=bool(stop.value))
            return
        except (OSError, NetTimeout, PeerClosed) as exc:
            self._log.info("tcp.handshake_failed", remote=shake.remote, reason=str(exc))
        except Exception:
            self._log.warning("tcp.handshake_failed", remote=shake.remote, exc_info=True)
        else:
            with self._lock:
                queued = not self._closed
                if queued:
                    self._queued.append((shake, wait))
            if queued:
                self._wake()
                return
        self._finish(shake, handed_over=False)

    def _finish(self, shake: _Shake, *, handed_over: bool) -> None:
        with self._lock:
            self._shakes.pop(shake.conn, None)
        shake.steps.close()
        if not handed_over:
            shake.conn.close()

    def _queue_drop(self, shake: _Shake) -> None:
        """Have the selector thread drop ``shake`` (it may be registered there)."""
        with self._lock:
            self._queued.append((shake, _DROP))
        self._wake()

    def _wake(self) -> None:
        with self._lock:  # never a write to a descriptor closed (and reused) meanwhile
            if self._wake_w >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"\0")

    # -- the selector thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                try:
                    if self._turn():
                        return
                except Exception:  # never the end of the listener: log, back off, go on
                    self._log.warning("tcp.handshakes_failed", exc_info=True)
                    time.sleep(_ACCEPT_BACKOFF_S)
        finally:
            self._shut_down()

    def _turn(self) -> bool:
        """One wait and what it found; True once closed."""
        for key, _ in self._selector.select(self._wait_s()):
            if key.data is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif isinstance(key.data, _Shake):
                self._on_readable(key.data)
            else:
                self._accept()
        if self._closed:
            return True
        self._take_queued()
        self._expire()
        self._resume_accepting()
        return False

    def _wait_s(self) -> float:
        soonest = self._accept_paused_until
        with self._lock:
            for shake in self._shakes.values():
                if shake.waiting and (not soonest or shake.deadline < soonest):
                    soonest = shake.deadline
        if not soonest:
            return 1.0
        return min(1.0, max(0.0, (soonest - now_ns()) / 1e9))

    def _accept(self) -> None:
        assert self._sock is not None
        for _ in range(_ACCEPT_BURST):
            try:
                conn, addr = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                self._log.warning("tcp.accept_failed", reason=str(exc))
                if exc.errno in _OUT_OF_RESOURCES:  # let some go before accepting more
                    self._selector.unregister(self._sock)
                    self._accept_paused_until = after_s(_ACCEPT_BACKOFF_S)
                return
            conn.setblocking(True)
            self._admit(conn, f"{addr[0]}:{addr[1]}", None)

    def _resume_accepting(self) -> None:
        if self._accept_paused_until and now_ns() >= self._accept_paused_until:
            assert self._sock is not None
            self._accept_paused_until = 0
            self._selector.register(self._sock, selectors.EVENT_READ, self._sock)

    def _take_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queued:
                    return
                shake, wait = self._queued.popleft()
            if isinstance(wait, _Drop):
                self._drop(shake)
            elif isinstance(wait, Read) and wait.n == 0:
                self._workers.submit(functools.partial(self._step, shake, b""))
            else:
                self._wait_for(shake, wait)

    def _wait_for(self, shake: _Shake, wait: Wait) -> None:
        with self._lock:
            if shake.conn not in self._shakes:  # evicted meanwhile
                shake.conn.close()
                return
            shake.waiting = True
        shake.lingering = isinstance(wait, _Linger)
        if shake.lingering:
            shake.buf, shake.got = bytearray(_SCRATCH), 0
            shake.deadline = min(shake.deadline, after_s(LINGER_S))
        else:
            assert isinstance(wait, Read)
            shake.buf, shake.got = bytearray(wait.n), 0
        self._selector.register(shake.conn, selectors.EVENT_READ, shake)

    def _on_readable(self, shake: _Shake) -> None:
        view = memoryview(shake.buf)[0 if shake.lingering else shake.got :]
        try:
            n = shake.conn.recv_into(view, len(view), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            if not shake.lingering:
                self._log.info("tcp.handshake_failed", remote=shake.remote, reason=str(exc))
            self._drop(shake)
            return
        if n == 0:
            if not shake.lingering:
                reason = "the client closed the connection during the handshake"
                self._log.info("tcp.handshake_failed", remote=shake.remote, reason=reason)
            self._drop(shake)
            return
        if shake.lingering:
            return
        shake.got += n
        if shake.got < len(shake.buf):
            return
        self._selector.unregister(shake.conn)
        with self._lock:
            if shake.conn not in self._shakes:
                shake.conn.close()
                return
            shake.waiting = False
        self._workers.submit(functools.partial(self._step, shake, bytes(shake.buf)))

    def _drop(self, shake: _Shake) -> None:
        """End ``shake`` here: out of the selector, its connection closed."""
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(shake.conn)
        with self._lock:
            if self._shakes.get(shake.conn) is shake:
                del self._shakes[shake.conn]
            shake.waiting = False
        shake.steps.close()
        shake.conn.close()

    def _expire(self) -> None:
        now = now_ns()
        with self._lock:
            due = [s for s in self._shakes.values() if s.waiting and s.deadline <= now]
        for shake in due:
            if not shake.lingering:
                self._log.info(
                    "tcp.handshake_failed",
                    remote=shake.remote,
                    reason=f"no handshake within {self._timeout} s",
                )
            self._drop(shake)

    def _shut_down(self) -> None:
        with self._lock:
            waiting = [s for s in self._shakes.values() if s.waiting]
            queued = [s for s, _ in self._queued]
            self._queued.clear()
        for shake in (*waiting, *queued):
            self._drop(shake)
        self._selector.close()
        with self._lock:
            wake_r, wake_w, self._wake_r, self._wake_w = self._wake_r, self._wake_w, -1, -1
        os.close(wake_r)
        os.close(wake_w)
