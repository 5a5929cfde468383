#!/usr/bin/env python3
"""What handing a received frame to its waiter costs: the caller reading its own answer
beside one "pump" thread per link that reads every frame and wakes the waiter.

Run: python benchmarks/bench_handover.py [--sizes 64,65536] [--iterations 5000] [--rounds 3]
                                         [--no-pin]

A peer process (a C serve loop) answers each 40-byte request on a loopback TCP connection
(TCP_NODELAY) with a 40-byte header and an N-byte payload. With two CPUs or more, this
process (and every thread it starts) is pinned to the first, the peer to the second, where
it busy-polls. One request at a time; a round trip ends once header and payload are in a
preallocated buffer and the waiter runs again. The C part is built at start with cffi (API
mode: every call releases the GIL). The blocking waiter is a plain Python thread:

* ``floor``: send and blocking recv in one C loop, no Python per call; ``floor-spin``: the
  same busy-polling the socket (MSG_DONTWAIT).
* ``caller-reads``: the caller reads its own answer in C (recv, poll() when nothing is
  there); ``-spin``: it busy-polls for ``--caller-spin-us`` first (the link's default).
* ``native-pump-futex``: a C pthread reads every frame into the registered buffer, sets a
  completion word and wakes the caller (FUTEX_WAKE), which waits on the word (FUTEX_WAIT);
  ``-spin``: the caller first checks the word with sched_yield for ``--spin-us``;
  ``-pumppoll``: the pump busy-polls the socket for ``--pump-poll-us`` after each frame.
* ``python-pump``: a threading.Thread reads with recv_into and sets a threading.Event.

The awaiting waiter is one asyncio event loop awaiting one request at a time:

* ``loop-reads``: loop.add_reader on the socket; the callback recv_into's, ends the future.
* ``native-pump-eventfd``: the C pump ends a frame by writing an eventfd the loop watches;
  the callback reads it and ends the future (``-pumppoll`` as above).
* ``python-pump-threadsafe``: the Python reader thread ends the future through
  loop.call_soon_threadsafe(fut.set_result, ...).

The variants take turns (``--rounds``, the order rotated each round; a fresh connection and
``--warmup`` calls each turn) and their samples are merged. Prints per payload size and
variant the p50/p99/mean latency, the p50 over the floor's, and this process's CPU time per
call (all its threads, spinning included; the peer's not).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import multiprocessing
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt
from cffi import FFI

HEADER = 40
STOP = (1 << 64) - 1
PATTERN = 0xA5

CDEF = """
typedef struct hb_pump hb_pump;
int hb_send_request(int fd, uint64_t len, uint64_t seq);
int64_t hb_recv_answer(int fd, uint8_t *dst, uint64_t len, int block, int64_t spin_ns);
int hb_floor(int fd, uint8_t *dst, uint64_t len, int64_t n, int64_t spin_ns, int64_t *ns);
int hb_serve(int fd, uint64_t cap, int spin);
int hb_eventfd(void);
hb_pump *hb_pump_start(int fd, int efd, uint8_t *dst, uint64_t cap, int64_t poll_ns, int *err);
int hb_pump_send(hb_pump *p, uint64_t len, uint64_t seq);
int64_t hb_pump_wait(hb_pump *p, int64_t spin_ns);
int64_t hb_pump_result(hb_pump *p);
int hb_pump_stop(hb_pump *p);
"""

C_SOURCE = r"""
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#define HB_HDR 40

static int64_t hb_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}
static uint64_t hb_get(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static int hb_wait(int fd, short ev) {
    struct pollfd p = {fd, ev, 0};
    return poll(&p, 1, -1) < 0 && errno != EINTR ? -errno : 0;
}

/* len bytes into buf. block: blocking recv (MSG_WAITALL); else take what is there, busy-poll
   until spin_until (monotonic ns; 0: no spin), then sleep in poll(). 0, -EPIPE at EOF, -errno */
static int hb_recv(int fd, uint8_t *buf, size_t len, int block, int64_t spin_until) {
    for (size_t got = 0; got < len;) {
        ssize_t n = recv(fd, buf + got, len - got, block ? MSG_WAITALL : MSG_DONTWAIT);
        if (n > 0) { got += (size_t)n; continue; }
        if (n == 0) return -EPIPE;
        if (errno == EINTR || (errno == EAGAIN && spin_until && hb_now() < spin_until)) continue;
        int rc = errno == EAGAIN ? hb_wait(fd, POLLIN) : -errno;
        if (rc) return rc;
    }
    return 0;
}

static int hb_send(int fd, const uint8_t *buf, size_t len) {
    while (len) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n >= 0) { buf += n; len -= (size_t)n; continue; }
        int rc = errno == EINTR ? 0 : errno == EAGAIN ? hb_wait(fd, POLLOUT) : -errno;
        if (rc) return rc;
    }
    return 0;
}

int hb_send_request(int fd, uint64_t len, uint64_t seq) {
    uint8_t h[HB_HDR] = {0};
    memcpy(h, &len, 8);
    memcpy(h + 8, &seq, 8);
    return hb_send(fd, h, HB_HDR);
}

/* An answer's header, then its payload into dst: the answer's seq, or -errno. */
int64_t hb_recv_answer(int fd, uint8_t *dst, uint64_t len, int block, int64_t spin_ns) {
    uint8_t h[HB_HDR];
    int64_t until = spin_ns > 0 ? hb_now() + spin_ns : 0;
    int rc = hb_recv(fd, h, HB_HDR, block, until);
    if (rc == 0 && hb_get(h) != len) rc = -EPROTO;
    if (rc == 0) rc = hb_recv(fd, dst, len, block, until);
    return rc ? rc : (int64_t)hb_get(h + 8);
}

int hb_floor(int fd, uint8_t *dst, uint64_t len, int64_t n, int64_t spin_ns, int64_t *ns) {
    for (int64_t i = 0; i < n; i++) {
        int64_t t0 = hb_now(), rc = hb_send_request(fd, len, (uint64_t)i);
        if (rc == 0) rc = hb_recv_answer(fd, dst, len, spin_ns == 0, spin_ns);
        if (rc != i) return rc < 0 ? (int)rc : -EPROTO;
        ns[i] = hb_now() - t0;
    }
    return 0;
}

/* The peer: answer requests until EOF (0) or a STOP request (1); or -errno. */
int hb_serve(int fd, uint64_t cap, int spin) {
    uint8_t *buf = malloc(HB_HDR + cap);
    if (!buf) return -ENOMEM;
    memset(buf + HB_HDR, 0xA5, cap);
    int rc;
    while ((rc = hb_recv(fd, buf, HB_HDR, 0, spin ? INT64_MAX : 0)) == 0) {
        uint64_t len = hb_get(buf);
        if (len == UINT64_MAX || len > cap) { rc = len == UINT64_MAX ? 1 : -EMSGSIZE; break; }
        if ((rc = hb_send(fd, buf, HB_HDR + len))) break;
    }
    free(buf);
    return rc == -EPIPE ? 0 : rc;
}

int hb_eventfd(void) {
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    return fd < 0 ? -errno : fd;
}

typedef struct hb_pump {
    int fd, efd;                /* efd < 0: wake the waiter through the futex word */
    uint8_t *dst;
    uint64_t cap, seq;
    int64_t poll_ns;            /* busy-poll the socket this long after a frame */
    uint32_t word;              /* 0 armed, 1 done, 2 armed with a sleeper */
    int stop, err;
    pthread_t thread;
} hb_pump;

static long hb_futex(uint32_t *word, int op, uint32_t val) {
    return syscall(SYS_futex, word, op, val, NULL, NULL, 0);
}

static void hb_complete(hb_pump *p) {
    if (p->efd >= 0) {
        __atomic_store_n(&p->word, 1, __ATOMIC_RELEASE);
        uint64_t one = 1;
        ssize_t n;
        do n = write(p->efd, &one, 8); while (n < 0 && errno == EINTR);
        if (n != 8) { perror("bench_handover pump: eventfd write"); abort(); }
    } else if (__atomic_exchange_n(&p->word, 1, __ATOMIC_ACQ_REL) == 2 &&
               hb_futex(&p->word, FUTEX_WAKE_PRIVATE, 1) < 0) {
        perror("bench_handover pump: FUTEX_WAKE");
        abort();
    }
}

static void *hb_pump_main(void *arg) {
    hb_pump *p = arg;
    uint8_t h[HB_HDR];
    for (int64_t until = 0;; until = p->poll_ns > 0 ? hb_now() + p->poll_ns : 0) {
        int rc = hb_recv(p->fd, h, HB_HDR, 0, until);
        if (rc == 0 && hb_get(h) > p->cap) rc = -EPROTO;
        if (rc == 0) rc = hb_recv(p->fd, p->dst, hb_get(h), 0, 0);
        if (rc == 0) p->seq = hb_get(h + 8);
        else if (__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) return NULL;
        else __atomic_store_n(&p->err, rc, __ATOMIC_RELEASE);
        hb_complete(p);
        if (rc) return NULL;
    }
}

hb_pump *hb_pump_start(int fd, int efd, uint8_t *dst, uint64_t cap, int64_t poll_ns, int *err) {
    hb_pump *p = calloc(1, sizeof *p);
    if (!p) { *err = -ENOMEM; return NULL; }
    p->fd = fd, p->efd = efd, p->dst = dst, p->cap = cap, p->poll_ns = poll_ns, p->word = 1;
    sigset_t all, old; /* the pump takes no signals: they stay with Python's threads */
    sigfillset(&all);
    int rc = pthread_sigmask(SIG_SETMASK, &all, &old);
    if (rc == 0) {
        rc = pthread_create(&p->thread, NULL, hb_pump_main, p);
        if (pthread_sigmask(SIG_SETMASK, &old, NULL)) abort();
    }
    if (rc) { free(p); *err = -rc; return NULL; }
    return p;
}

int hb_pump_send(hb_pump *p, uint64_t len, uint64_t seq) {
    __atomic_exchange_n(&p->word, 0, __ATOMIC_ACQ_REL);
    int err = __atomic_load_n(&p->err, __ATOMIC_ACQUIRE);
    return err ? err : hb_send_request(p->fd, len, seq);
}

int64_t hb_pump_result(hb_pump *p) {
    if (__atomic_load_n(&p->word, __ATOMIC_ACQUIRE) != 1) return -EAGAIN;
    return p->err ? p->err : (int64_t)p->seq;
}

int64_t hb_pump_wait(hb_pump *p, int64_t spin_ns) {
    for (int64_t until = hb_now() + spin_ns; spin_ns > 0 && hb_now() < until; sched_yield())
        if (__atomic_load_n(&p->word, __ATOMIC_ACQUIRE) == 1) break;
    for (;;) {
        uint32_t w = 0;
        if (__atomic_compare_exchange_n(&p->word, &w, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            w = 2;
        if (w == 1) return hb_pump_result(p);
        if (hb_futex(&p->word, FUTEX_WAIT_PRIVATE, 2) < 0 && errno != EAGAIN && errno != EINTR)
            return -errno;
    }
}

int hb_pump_stop(hb_pump *p) {
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);
    if (shutdown(p->fd, SHUT_RDWR) < 0 && errno != ENOTCONN) return -errno; /* p leaks */
    int rc = pthread_join(p->thread, NULL);
    rc = rc ? -rc : p->err;
    free(p);
    return rc;
}
"""

Run = Callable[[int], list[int]]  # calls -> their latencies in ns


@dataclass
class Bench:
    """What every turn uses: the native module, the loop, the destination, the peer's port."""

    ffi: Any
    lib: Any
    loop: asyncio.AbstractEventLoop
    dst: npt.NDArray[np.uint8]
    dst_c: Any
    port: int


Setup = Callable[[Bench, socket.socket, int], AbstractContextManager[Run]]


def build_native() -> Any:
    """Compile the C part in a temporary directory and import it."""
    name, ffi = f"_bench_handover_{os.getpid()}", FFI()
    ffi.cdef(CDEF)
    ffi.set_source(name, C_SOURCE, extra_compile_args=["-O2"], libraries=["pthread"])
    with tempfile.TemporaryDirectory() as tmp:
        ffi.compile(tmpdir=tmp)
        sys.path.insert(0, tmp)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(tmp)


def _ok(rc: int, what: str) -> int:
    """``rc`` unless it is a negative errno, which raises."""
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    return rc


def _answered(got: int, seq: int, what: str) -> None:
    if _ok(got, what) != seq:
        raise RuntimeError(f"{what}: answer {got} came for request {seq}")


def _time_calls(call: Callable[[int], int], count: int) -> list[int]:
    """Latencies of ``count`` blocking round trips ``call(seq)`` (-> the answer's seq)."""
    lat, clock = [0] * count, time.perf_counter_ns
    for i in range(count):
        t0 = clock()
        got = call(i)
        lat[i] = clock() - t0
        if got != i:
            _answered(got, i, "round trip")
    return lat


class LoopWaiter:
    """The future of the one request in flight, ended on the loop's thread."""

    def __init__(self) -> None:
        self.fut: asyncio.Future[int] | None = None
        self.error: BaseException | None = None
        self.got = 0  # bytes of the answer received (loop-reads)

    def complete(self, result: int | BaseException) -> None:
        fut, self.fut = self.fut, None
        if isinstance(result, BaseException):
            self.error = result
            if fut is not None:
                fut.set_exception(result)
        elif fut is not None:
            fut.set_result(result)

    async def _drive(self, send: Callable[[int], int], count: int) -> list[int]:
        loop, lat, clock = asyncio.get_running_loop(), [0] * count, time.perf_counter_ns
        for i in range(count):
            t0 = clock()
            if self.error is not None:
                raise self.error
            self.fut = fut = loop.create_future()
            self.got = 0
            if (rc := send(i)) < 0:
                _ok(rc, "send")
            got = await fut
            lat[i] = clock() - t0
            if got != i:
                _answered(got, i, "round trip")
        return lat

    def runner(self, b: Bench, send: Callable[[int], int]) -> Run:
        """Latencies of awaited round trips: a future, ``send(seq)``, await the future."""
        return lambda count: b.loop.run_until_complete(self._drive(send, count))


class LoopReader(LoopWaiter):
    """The loop reads its own answer: a reader callback receives into the destination."""

    def __init__(self, conn: socket.socket, dst: npt.NDArray[np.uint8], size: int) -> None:
        super().__init__()
        self.conn, self.body, self.header = conn, dst.data[:size], memoryview(bytearray(HEADER))

    def readable(self) -> None:
        try:
            while (at := self.got) < HEADER + len(self.body):
                view = self.header[at:] if at < HEADER else self.body[at - HEADER :]
                if (n := self.conn.recv_into(view)) == 0:
                    raise ConnectionError("the peer closed the connection")
                self.got += n
        except BlockingIOError:
            return
        except OSError as exc:
            self.complete(exc)
            return
        if int.from_bytes(self.header[:8], "little") != len(self.body):
            self.complete(ValueError("an answer of the wrong size"))
        else:
            self.complete(int.from_bytes(self.header[8:16], "little"))


class PyPump:
    """A Python thread that reads every frame into the destination and delivers its seq."""

    def __init__(
        self, conn: socket.socket, dst: npt.NDArray[np.uint8], deliver: Callable[[Any], None]
    ) -> None:
        self.conn, self.dst, self.deliver, self.stopping = conn, dst.data, deliver, False
        self.thread = threading.Thread(target=self._run, name="py-pump", daemon=True)
        self.thread.start()

    def _recv(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            if (n := self.conn.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)) == 0:
                raise ConnectionError("the peer closed the connection")
            got += n

    def _run(self) -> None:
        header = memoryview(bytearray(HEADER))
        try:
            while True:
                self._recv(header)
                if (size := int.from_bytes(header[:8], "little")) > len(self.dst):
                    raise ValueError(f"an answer of {size} bytes")
                self._recv(self.dst[:size])
                self.deliver(int.from_bytes(header[8:16], "little"))
        except (OSError, ValueError) as exc:
            if not self.stopping:
                self.deliver(exc)

    def stop(self) -> None:
        self.stopping = True
        self.conn.shutdown(socket.SHUT_RDWR)
        self.thread.join()


@contextmanager
def floor(b: Bench, conn: socket.socket, size: int, spin_ns: int) -> Iterator[Run]:
    def run(count: int) -> list[int]:
        ns = np.empty(count, np.int64)
        out = b.ffi.from_buffer("int64_t[]", ns)
        _ok(b.lib.hb_floor(conn.fileno(), b.dst_c, size, count, spin_ns, out), "floor")
        return list(ns.tolist())

    yield run


@contextmanager
def caller_reads(b: Bench, conn: socket.socket, size: int, spin_ns: int) -> Iterator[Run]:
    lib, fd, dst = b.lib, conn.fileno(), b.dst_c

    def call(seq: int) -> int:
        rc: int = lib.hb_send_request(fd, size, seq)
        return rc if rc < 0 else lib.hb_recv_answer(fd, dst, size, 0, spin_ns)

    yield partial(_time_calls, call)


@contextmanager
def native_pump(b: Bench, conn: socket.socket, efd: int, poll_ns: int) -> Iterator[Any]:
    """A C pump thread on ``conn`` for the time of the block; stopped and joined after."""
    err = b.ffi.new("int *")
    pump = b.lib.hb_pump_start(conn.fileno(), efd, b.dst_c, b.dst.size, poll_ns, err)
    if pump == b.ffi.NULL:
        _ok(err[0], "pthread_create")
    try:
        yield pump
    finally:
        _ok(b.lib.hb_pump_stop(pump), "pump")


@contextmanager
def native_pump_futex(
    b: Bench, conn: socket.socket, size: int, spin_ns: int, poll_ns: int
) -> Iterator[Run]:
    with native_pump(b, conn, -1, poll_ns) as pump:
        lib = b.lib

        def call(seq: int) -> int:
            rc: int = lib.hb_pump_send(pump, size, seq)
            return rc if rc < 0 else lib.hb_pump_wait(pump, spin_ns)

        yield partial(_time_calls, call)


@contextmanager
def python_pump(b: Bench, conn: socket.socket, size: int) -> Iterator[Run]:
    lib, fd, event = b.lib, conn.fileno(), threading.Event()
    box: list[Any] = [0, None]  # the last seq, the pump's failure

    def deliver(result: int | BaseException) -> None:
        box[isinstance(result, BaseException)] = result
        event.set()

    def call(seq: int) -> int:
        event.clear()
        if box[1] is None and (rc := lib.hb_send_request(fd, size, seq)) < 0:
            return int(rc)
        event.wait()
        if box[1] is not None:
            raise box[1]
        return int(box[0])

    pump = PyPump(conn, b.dst, deliver)
    try:
        yield partial(_time_calls, call)
    finally:
        pump.stop()


@contextmanager
def loop_reads(b: Bench, conn: socket.socket, size: int) -> Iterator[Run]:
    conn.setblocking(False)
    reader = LoopReader(conn, b.dst, size)
    b.loop.add_reader(conn.fileno(), reader.readable)
    try:
        yield reader.runner(b, partial(b.lib.hb_send_request, conn.fileno(), size))
    finally:
        b.loop.remove_reader(conn.fileno())


@contextmanager
def native_pump_eventfd(b: Bench, conn: socket.socket, size: int, poll_ns: int) -> Iterator[Run]:
    efd, waiter = _ok(b.lib.hb_eventfd(), "eventfd"), LoopWaiter()
    try:
        with native_pump(b, conn, efd, poll_ns) as pump:

            def ready() -> None:
                try:
                    os.read(efd, 8)
                except BlockingIOError:
                    return
                rc: int = b.lib.hb_pump_result(pump)
                waiter.complete(OSError(-rc, os.strerror(-rc)) if rc < 0 else rc)

            b.loop.add_reader(efd, ready)
            try:
                yield waiter.runner(b, partial(b.lib.hb_pump_send, pump, size))
            finally:
                b.loop.remove_reader(efd)
    finally:
        os.close(efd)


@contextmanager
def python_pump_threadsafe(b: Bench, conn: socket.socket, size: int) -> Iterator[Run]:
    loop, waiter = b.loop, LoopWaiter()

    def deliver(result: int | BaseException) -> None:
        if isinstance(result, BaseException) or (fut := waiter.fut) is None:
            loop.call_soon_threadsafe(waiter.complete, result)
        else:
            loop.call_soon_threadsafe(fut.set_result, result)

    pump = PyPump(conn, b.dst, deliver)
    try:
        yield waiter.runner(b, partial(b.lib.hb_send_request, conn.fileno(), size))
    finally:
        pump.stop()


def variants(args: argparse.Namespace) -> list[tuple[str, str, Setup]]:
    """(face, name, setup) of every variant, the floor first."""
    spin, poll, caller = args.spin_us, args.pump_poll_us, args.caller_spin_us
    futex, evfd = native_pump_futex, native_pump_eventfd
    return [
        ("block", "floor (C loop)", partial(floor, spin_ns=0)),
        ("block", "floor-spin (C loop)", partial(floor, spin_ns=1 << 62)),
        ("block", "caller-reads", partial(caller_reads, spin_ns=0)),
        ("block", f"caller-reads-spin{caller}", partial(caller_reads, spin_ns=caller * 1000)),
        ("block", "native-pump-futex", partial(futex, spin_ns=0, poll_ns=0)),
        ("block", f"native-pump-futex-spin{spin}", partial(futex, spin_ns=spin * 1000, poll_ns=0)),
        (
            "block",
            f"native-pump-futex-pumppoll{poll}",
            partial(futex, spin_ns=0, poll_ns=poll * 1000),
        ),
        ("block", "python-pump", python_pump),
        ("await", "loop-reads", loop_reads),
        ("await", "native-pump-eventfd", partial(evfd, poll_ns=0)),
        ("await", f"native-pump-eventfd-pumppoll{poll}", partial(evfd, poll_ns=poll * 1000)),
        ("await", "python-pump-threadsafe", python_pump_threadsafe),
    ]


def turn(b: Bench, setup: Setup, size: int, warmup: int, count: int) -> tuple[list[int], float]:
    """One variant's turn on a fresh connection: latencies in ns and the CPU seconds."""
    b.dst[:size] = 0
    with socket.create_connection(("127.0.0.1", b.port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with setup(b, conn, size) as run:
            run(warmup)
            cpu = time.process_time()
            lat = run(count)
            cpu = time.process_time() - cpu
    if not (b.dst[:size] == PATTERN).all():
        raise RuntimeError("the destination does not hold the peer's payload")
    return lat, cpu


def peer_main(lib: Any, listener: socket.socket, cpu: int | None, cap: int) -> None:
    """The peer process: serve one connection after another until a STOP request."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    parent = os.getppid()
    listener.settimeout(1.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:
                return
            continue
        with conn:
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if _ok(lib.hb_serve(conn.fileno(), cap, int(cpu is not None)), "peer") == 1:
                return


def stop_peer(lib: Any, proc: multiprocessing.process.BaseProcess, port: int) -> None:
    if proc.is_alive():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                _ok(lib.hb_send_request(conn.fileno(), STOP, 0), "stop the peer")
        except OSError as exc:
            print(f"could not stop the peer: {exc}", file=sys.stderr)
        proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (list)") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return values


def _int(text: str) -> int:
    if len(values := _ints(text)) != 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not one integer")
    return values[0]


def report(table: dict[tuple[int, str], tuple[list[int], float]], faces: dict[str, str]) -> None:
    size, floor_p50 = -1, 0.0
    for (at, name), (lat, cpu) in table.items():
        us = np.array(lat) / 1e3
        p50, p99, mean = float(np.percentile(us, 50)), float(np.percentile(us, 99)), us.mean()
        if at != size:
            size, floor_p50 = at, p50
            print(f"\npayload {size} B (us; +p50: over the floor's p50; cpu: this process)")
            print(f"{'face':6}{'variant':34}{'p50':>8}{'p99':>8}{'mean':>8}{'+p50':>8}{'cpu':>8}")
        print(
            f"{faces[name]:6}{name:34}{p50:8.1f}{p99:8.1f}{mean:8.1f}"
            f"{p50 - floor_p50:8.1f}{cpu / len(lat) * 1e6:8.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=_ints, default=[64, 65536], help="payload bytes: a,b")
    parser.add_argument("--iterations", type=_int, default=5000, help="calls per turn")
    parser.add_argument("--rounds", type=_int, default=3)
    parser.add_argument("--warmup", type=_int, default=200, help="calls before each turn")
    parser.add_argument("--spin-us", type=_int, default=50, help="futex waiter's spin")
    parser.add_argument("--pump-poll-us", type=_int, default=50, help="pumppoll variants")
    parser.add_argument("--caller-spin-us", type=_int, default=200, help="caller-reads-spin")
    parser.add_argument("--no-pin", action="store_true", help="leave both processes unpinned")
    args = parser.parse_args()
    if args.iterations < 1 or args.rounds < 1:
        parser.error("--iterations and --rounds must be at least 1")
    native = build_native()
    cpus = sorted(os.sched_getaffinity(0))
    mine, peers = (None, None) if args.no_pin or len(cpus) < 2 else (cpus[0], cpus[1])
    cap = max(max(args.sizes), 1)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = int(listener.getsockname()[1])
        proc = multiprocessing.get_context("fork").Process(
            target=peer_main, args=(native.lib, listener, peers, cap), daemon=True
        )
        proc.start()
    if mine is not None:
        os.sched_setaffinity(0, {mine})
    loop, dst = asyncio.new_event_loop(), np.zeros(cap, np.uint8)
    bench = Bench(native.ffi, native.lib, loop, dst, native.ffi.from_buffer("uint8_t[]", dst), port)
    todo = variants(args)
    table: dict[tuple[int, str], tuple[list[int], float]] = {}
    start = time.perf_counter()
    try:
        for r in range(args.rounds):
            for size in args.sizes:
                for _, name, setup in todo[r % len(todo) :] + todo[: r % len(todo)]:
                    try:
                        lat, cpu = turn(bench, setup, size, args.warmup, args.iterations)
                    except Exception as exc:
                        exc.add_note(f"in the turn of {name} with {size}-byte payloads")
                        raise
                    merged, total = table.get((size, name), ([], 0.0))
                    table[size, name] = (merged + lat, total + cpu)
    finally:
        loop.close()
        stop_peer(native.lib, proc, port)
    if proc.exitcode != 0:
        raise RuntimeError(f"the peer exited with {proc.exitcode}")
    print(f"{platform.node()}: Linux {platform.release()}, Python {platform.python_version()}")
    if mine is not None:
        print(
            f"pinning: this process and its threads on CPU {mine}, the busy-polling peer on {peers}"
        )
    else:
        print(f"pinning: none ({len(cpus)} CPUs usable; the peer sleeps in poll)")
    print(
        f"{args.iterations} calls x {args.rounds} rounds per variant and size "
        f"({args.warmup} warm-up calls per turn), {time.perf_counter() - start:.0f} s"
    )
    order = [(size, name) for size in args.sizes for _, name, _ in todo]
    report({key: table[key] for key in order}, {name: face for face, name, _ in todo})


if __name__ == "__main__":
    main()
