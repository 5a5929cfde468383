"""Tests of the native scatter-gather socket I/O (``sock_*``), on socketpair() and 127.0.0.1."""

from __future__ import annotations

import errno
import itertools
import math
import os
import pickle
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._native import api, features
from aio_datadist.status import LLMException, ParamInvalidError

U8 = npt.NDArray[np.uint8]
Iov = npt.NDArray[np.uint64]
KiB = 1 << 10
MiB = 1 << 20
JOIN_S = 10.0


def addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def random_bytes(n: int, seed: int) -> U8:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def make_iov(rows: list[tuple[int, int]]) -> Iov:
    return np.array(rows, dtype=np.uint64).reshape(-1, 2)


class Background:
    """Run ``fn`` on a thread; ``join()`` waits (bounded) and re-raises what it raised."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._exc: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:
            self._exc = exc

    def join(self) -> None:
        self._thread.join(JOIN_S)
        assert not self._thread.is_alive(), "background transfer did not finish"
        if self._exc is not None:
            raise self._exc


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        client = socket.create_connection(srv.getsockname())
        server, _ = srv.accept()
    return client, server


@pytest.fixture
def tcp() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = tcp_pair()
    with a, b:
        yield a, b


def no_pending_data(s: socket.socket) -> bool:
    try:
        s.recv(1, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    return False


def test_feature_and_clock() -> None:
    assert "net" in features
    # Python's monotonic clock is CLOCK_MONOTONIC on Linux: the same clock as ours.
    assert abs(api.monotonic_ns() - time.monotonic_ns()) < 1_000_000_000
    a = api.monotonic_ns()
    assert api.monotonic_ns() >= a


def test_deadline_after() -> None:
    assert api.deadline_after(None) == 0
    assert api.deadline_after(math.inf) == 0
    now = api.monotonic_ns()
    d = api.deadline_after(2.5)
    assert now + 2_400_000_000 < d < now + 3_500_000_000
    assert 0 < api.deadline_after(-1.0) <= api.monotonic_ns()
    assert api.deadline_after(-math.inf) == 1
    assert 0 < api.deadline_after(1) - now < 2_000_000_000
    with pytest.raises(ValueError):
        api.deadline_after(math.nan)
    with pytest.raises(TypeError):
        api.deadline_after("1")  # type: ignore[arg-type]


# --- byte-for-byte transfers ----------------------------------------------------------------


@st.composite
def scatter_case(draw: st.DrawFn) -> tuple[list[int], list[int], bool, int]:
    """Sizes of send rows, sizes of receive rows (another cut of the same total), the
    blocking mode and a seed."""
    send = draw(st.lists(st.integers(0, 6000), max_size=40))
    total = sum(send)
    cuts = sorted(draw(st.lists(st.integers(0, total), max_size=40)))
    bounds = [0, *cuts, total]
    recv = [hi - lo for lo, hi in itertools.pairwise(bounds)]
    return send, recv, draw(st.booleans()), draw(st.integers(0, 2**32 - 1))


def scattered_rows(base: int, sizes: list[int], rng: np.random.Generator) -> list[tuple[int, int]]:
    """Rows of ``sizes`` laid out at shuffled, gapped offsets from ``base``."""
    order = rng.permutation(len(sizes))
    offsets = [0] * len(sizes)
    pos = 0
    for k in order:
        offsets[k] = pos
        pos += sizes[k] + 7  # gaps, so a row never silently continues the one before
    return [(base + off, n) for off, n in zip(offsets, sizes, strict=True)]


def gather(buf: U8, base: int, rows: list[tuple[int, int]]) -> bytes:
    return b"".join(buf[a - base : a - base + n].tobytes() for a, n in rows)


def transfer(
    a: socket.socket, b: socket.socket, send_sizes: list[int], recv_sizes: list[int], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    src = random_bytes(sum(send_sizes) + 7 * len(send_sizes) + 1, seed)
    dst = np.zeros(sum(recv_sizes) + 7 * len(recv_sizes) + 1, np.uint8)
    send_rows = scattered_rows(addr(src), send_sizes, rng)
    recv_rows = scattered_rows(addr(dst), recv_sizes, rng)
    deadline = api.deadline_after(JOIN_S)
    sender = Background(lambda: api.sock_sendv(a.fileno(), make_iov(send_rows), deadline))
    receiver = Background(lambda: api.sock_recvv(b.fileno(), make_iov(recv_rows), deadline))
    sender.join()
    receiver.join()
    assert gather(dst, addr(dst), recv_rows) == gather(src, addr(src), send_rows)
    assert no_pending_data(b)


@settings(max_examples=50, deadline=None)
@given(scatter_case())
def test_random_scatter_lists_arrive_byte_for_byte(
    case: tuple[list[int], list[int], bool, int],
) -> None:
    send_sizes, recv_sizes, blocking, seed = case
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(blocking)
        b.setblocking(blocking)
        transfer(a, b, send_sizes, recv_sizes, seed)
        # The fds' modes are left as they were.
        assert a.getblocking() is blocking and b.getblocking() is blocking


def test_list_longer_than_iov_max(pair: tuple[socket.socket, socket.socket]) -> None:
    rng = np.random.default_rng(5)
    send = rng.integers(0, 64, 3000).tolist()
    recv = rng.permutation(send).tolist()  # the same total, cut differently
    assert len(send) > (os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
    transfer(*pair, send, recv, 6)


def test_64_mib_over_tcp_with_small_buffers_forces_partial_sends(
    tcp: tuple[socket.socket, socket.socket],
) -> None:
    a, b = tcp
    api.sock_tune(a.fileno(), sndbuf=32 * KiB)
    api.sock_tune(b.fileno(), rcvbuf=32 * KiB)
    assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < MiB
    src = random_bytes(64 * MiB, 7)
    dst = np.zeros_like(src)
    # One big row out; received into 3 unequal rows.
    cut1, cut2 = 1_000_003, 40 * MiB + 5
    rows = [(addr(dst), cut1), (addr(dst) + cut1, cut2 - cut1), (addr(dst) + cut2, 64 * MiB - cut2)]
    deadline = api.deadline_after(JOIN_S)
    sender = Background(lambda: api.sock_send(a.fileno(), addr(src), src.nbytes, deadline))
    api.sock_recvv(b.fileno(), make_iov(rows), deadline)
    sender.join()
    assert np.array_equal(dst, src)


def test_zero_length_rows_and_empty_iov(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    passed = api.deadline_after(-1.0)
    # Nothing to move: done at once, even with a deadline long gone.
    api.sock_sendv(a.fileno(), np.zeros((0, 2), np.uint64), passed)
    api.sock_recvv(b.fileno(), np.zeros((0, 2), np.uint64), passed)
    api.sock_send(a.fileno(), 0, 0, passed)
    api.sock_recv(b.fileno(), 0, 0, passed)
    api.sock_send_bytes(a.fileno(), b"", passed)
    api.sock_recv_into(b.fileno(), bytearray(), passed)
    src = random_bytes(100, 8)
    dst = np.zeros(100, np.uint8)
    # Zero-length rows, null ones included, are skipped.
    api.sock_sendv(
        a.fileno(),
        make_iov([(0, 0), (addr(src), 60), (addr(src), 0), (addr(src) + 60, 40), (0, 0)]),
    )
    api.sock_recvv(b.fileno(), make_iov([(addr(dst), 0), (addr(dst), 100), (0, 0)]), passed)
    assert np.array_equal(dst, src)
    assert no_pending_data(b)


def test_passed_deadline_still_moves_what_needs_no_wait(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(b"ready")
    buf = bytearray(5)
    api.sock_recv_into(b.fileno(), buf, api.deadline_after(0))
    assert buf == b"ready"


def test_bytes_helpers_roundtrip(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    api.sock_send_bytes(a.fileno(), b"head")
    api.sock_send_bytes(a.fileno(), bytearray(b"-mid-"))
    api.sock_send_bytes(a.fileno(), memoryview(struct.pack("<QI", 1 << 40, 7)))
    out = bytearray(4 + 5 + 12)
    view = memoryview(out)
    api.sock_recv_into(b.fileno(), view[:9])
    api.sock_recv_into(b.fileno(), view[9:])
    assert out[:9] == b"head-mid-"
    assert struct.unpack("<QI", out[9:]) == (1 << 40, 7)


def test_a_row_at_a_bytes_address_sends_those_bytes(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    head = bytes(range(7, 7 + 48))
    addr, keep = api.bytes_address(head)
    payload = np.arange(4096, dtype=np.uint8)
    iov = np.array([[addr, len(head)], [payload.ctypes.data, payload.nbytes]], dtype=np.uint64)
    del head  # the keeper holds the bytes the first row points into
    api.sock_sendv(a.fileno(), iov, api.deadline_after(5))
    out = bytearray(48 + 4096)
    api.sock_recv_into(b.fileno(), out, api.deadline_after(5))
    assert bytes(out[:48]) == bytes(range(7, 7 + 48)) and bytes(out[48:]) == payload.tobytes()
    assert keep is not None


# --- deadlines ------------------------------------------------------------------------------


def test_recv_deadline_when_peer_sends_nothing(pair: tuple[socket.socket, socket.socket]) -> None:
    _, b = pair
    dst = np.zeros(1000, np.uint8)
    timeout = 0.25
    t0 = time.monotonic()
    with pytest.raises(api.NetTimeout) as info:
        api.sock_recv(b.fileno(), addr(dst), dst.nbytes, api.deadline_after(timeout))
    elapsed = time.monotonic() - t0
    assert info.value.transferred == 0
    assert timeout * 0.95 <= elapsed < 2 * timeout
    assert isinstance(info.value, TimeoutError)
    assert not isinstance(info.value, LLMException)


@pytest.mark.parametrize("blocking", [True, False])
def test_recv_deadline_mid_transfer(
    pair: tuple[socket.socket, socket.socket], blocking: bool
) -> None:
    a, b = pair
    b.setblocking(blocking)
    src = random_bytes(64 * KiB, 9)
    half = src.nbytes // 2
    a.sendall(src[:half].tobytes())  # then stalls
    dst = np.zeros_like(src)
    rows = make_iov([(addr(dst), 1000), (addr(dst) + 1000, src.nbytes - 1000)])
    with pytest.raises(api.NetTimeout) as info:
        api.sock_recvv(b.fileno(), rows, api.deadline_after(0.2))
    assert info.value.transferred == half
    assert np.array_equal(dst[:half], src[:half])
    assert not dst[half:].any()


def test_send_deadline_when_peer_never_reads(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    src = random_bytes(16 * MiB, 10)  # far more than a socketpair buffers
    with pytest.raises(api.NetTimeout) as info:
        api.sock_send(a.fileno(), addr(src), src.nbytes, api.deadline_after(0.2))
    assert 0 < info.value.transferred < src.nbytes


# --- lost peers ---------------------------------------------------------------------------


def test_peer_closes_mid_transfer(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(b"x" * 40)
    a.close()
    dst = np.zeros(100, np.uint8)
    with pytest.raises(api.PeerClosed) as info:
        api.sock_recv(b.fileno(), addr(dst), 100, api.deadline_after(JOIN_S))
    assert info.value.transferred == 40
    assert isinstance(info.value, ConnectionError)
    assert not isinstance(info.value, LLMException)
    assert bytes(dst[:40]) == b"x" * 40


def test_peer_resets_tcp_connection_mid_transfer(tcp: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp
    a.sendall(b"y" * 10)
    time.sleep(0.05)  # let the bytes land before the reset
    # SO_LINGER with a zero timeout: close() sends RST, so the reader sees ECONNRESET.
    a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    a.close()
    buf = bytearray(1000)
    with pytest.raises(api.PeerClosed) as info:
        api.sock_recv_into(b.fileno(), buf, api.deadline_after(JOIN_S))
    assert info.value.transferred in (0, 10)  # the kernel may drop unread data on reset


def test_peer_closes_while_sender_waits(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    src = random_bytes(16 * MiB, 11)

    def read_some_then_close() -> None:
        got = 0
        while got < 100 * KiB:
            got += len(b.recv(64 * KiB))
        b.close()

    reader = Background(read_some_then_close)
    with pytest.raises(api.PeerClosed) as info:
        api.sock_send(a.fileno(), addr(src), src.nbytes, api.deadline_after(JOIN_S))
    reader.join()
    assert 100 * KiB <= info.value.transferred < src.nbytes


def test_send_to_closed_peer_raises_without_sigpipe() -> None:
    # A child with SIGPIPE's default action (Python ignores it) proves MSG_NOSIGNAL is used.
    code = textwrap.dedent(
        """
        import signal, socket
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        from aio_datadist._native import api
        a, b = socket.socketpair()
        b.close()
        for f in (lambda: api.sock_send_bytes(a.fileno(), b"x" * 100),
                  lambda: api.sock_send_bytes(a.fileno(), b"y")):
            try:
                f()
            except api.PeerClosed as exc:
                print("PeerClosed", exc.transferred)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=JOIN_S, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["PeerClosed", "0", "PeerClosed", "0"]


def test_errors_pickle_with_transferred() -> None:
    for cls in (api.NetTimeout, api.PeerClosed):
        exc = pickle.loads(pickle.dumps(cls("msg", 123)))
        assert type(exc) is cls and exc.transferred == 123 and str(exc) == "msg"


# --- argument checks ------------------------------------------------------------------------


def test_bad_iov_arrays(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    good = np.zeros((4, 2), np.uint64)
    for fn in (api.sock_sendv, api.sock_recvv):
        with pytest.raises(TypeError):
            fn(a.fileno(), [[1, 2]])  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            fn(a.fileno(), good.astype(np.int64))
        with pytest.raises(TypeError):
            fn(a.fileno(), good.astype(">u8"))
        with pytest.raises(ValueError):
            fn(a.fileno(), np.zeros((4, 3), np.uint64))
        with pytest.raises(ValueError):
            fn(a.fileno(), np.zeros(8, np.uint64))
        with pytest.raises(ValueError):
            fn(a.fileno(), good[::2])
        with pytest.raises(ValueError):
            fn(a.fileno(), np.asfortranarray(np.zeros((4, 2), np.uint64)))
        with pytest.raises(TypeError):
            fn(a, good)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            fn(a.fileno(), good, 1.5)  # type: ignore[arg-type]


def test_null_address_and_wrapping_rows_send_nothing(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    src = random_bytes(10, 12)
    with pytest.raises(ParamInvalidError):
        api.sock_sendv(a.fileno(), make_iov([(addr(src), 10), (0, 5)]))
    with pytest.raises(ParamInvalidError):
        api.sock_sendv(a.fileno(), make_iov([(addr(src), 10), (2**64 - 4, 8)]))
    with pytest.raises(ParamInvalidError):
        api.sock_recvv(b.fileno(), make_iov([(0, 1)]))
    with pytest.raises(ParamInvalidError):
        api.sock_send(a.fileno(), 0, 5)
    with pytest.raises(ParamInvalidError):
        api.sock_recv(b.fileno(), 0, 5)
    assert no_pending_data(b)


def test_bad_fds_and_sizes(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    src = random_bytes(10, 13)
    with pytest.raises(ParamInvalidError):
        api.sock_send(-1, addr(src), 10)
    with pytest.raises(ParamInvalidError):
        api.sock_recvv(-1, np.zeros((0, 2), np.uint64))
    with pytest.raises(ParamInvalidError):
        api.sock_send(a.fileno(), addr(src), -1)
    with pytest.raises(ParamInvalidError):
        api.sock_send(a.fileno(), addr(src), 10, 1 << 63)
    with pytest.raises(TypeError):
        api.sock_recv_into(a.fileno(), bytes(4))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        api.sock_recv_into(a.fileno(), memoryview(bytearray(8))[::2])
    with pytest.raises(TypeError):
        api.sock_send_bytes(a.fileno(), "text")  # type: ignore[arg-type]


def test_system_errors_are_oserrors() -> None:
    r, w = os.pipe()
    try:
        with pytest.raises(OSError) as info:
            api.sock_send_bytes(w, b"abc")
        assert info.value.errno == errno.ENOTSOCK
        assert not isinstance(info.value, LLMException)
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(OSError) as info:
        api.sock_recv_into(r, bytearray(3))  # closed just now
    assert info.value.errno == errno.EBADF


# --- tuning ---------------------------------------------------------------------------------


def test_sock_tune_tcp(tcp: tuple[socket.socket, socket.socket]) -> None:
    a, _ = tcp
    api.sock_tune(a.fileno(), nodelay=True, sndbuf=256 * KiB, rcvbuf=128 * KiB)
    assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 256 * KiB
    assert a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= 128 * KiB
    api.sock_tune(a.fileno(), nodelay=False)
    assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0
    api.sock_tune(a.fileno(), nodelay=None)
    assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0


def test_sock_tune_unix_and_bad_arguments(pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    api.sock_tune(a.fileno(), nodelay=True, sndbuf=64 * KiB)  # no TCP there: ignored
    with pytest.raises(ParamInvalidError):
        api.sock_tune(a.fileno(), sndbuf=-1)
    with pytest.raises(ParamInvalidError):
        api.sock_tune(-1)
    with pytest.raises(TypeError):
        api.sock_tune(a.fileno(), nodelay=1)  # type: ignore[arg-type]
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError) as info:
        api.sock_tune(w)
    assert info.value.errno == errno.EBADF


# --- the GIL --------------------------------------------------------------------------------


def test_gil_is_released_while_recv_waits(pair: tuple[socket.socket, socket.socket]) -> None:
    _, b = pair
    count = 0
    waiting = threading.Event()
    stop = threading.Event()

    def counter() -> None:
        nonlocal count
        waiting.wait(JOIN_S)
        while not stop.is_set():
            count += 1

    t = threading.Thread(target=counter, daemon=True)
    t.start()
    dst = np.zeros(16, np.uint8)
    deadline = api.deadline_after(0.3)
    waiting.set()
    before = count
    with pytest.raises(api.NetTimeout):
        api.sock_recv(b.fileno(), addr(dst), dst.nbytes, deadline)
    during = count - before
    stop.set()
    t.join(JOIN_S)
    # Held for the whole wait, the GIL would allow a handful of increments at most.
    assert during > 10_000


def test_wait_readable(tcp: tuple[socket.socket, socket.socket]) -> None:
    a, b = tcp
    fd = b.fileno()
    # Nothing to read: a deadline in the past checks once; a spin alone ends at the deadline.
    assert api.sock_wait_readable(fd, 1) is False
    start = time.monotonic()
    assert api.sock_wait_readable(fd, api.deadline_after(0.05), spin_ns=10**9) is False
    assert 0.04 <= time.monotonic() - start < 2.0
    # Bytes sent while a thread sleeps in the wait, or while it busy-polls, wake it.
    for spin_ns in (0, 10**9):
        timer = threading.Timer(0.02, a.sendall, (b"x",))
        timer.start()
        assert api.sock_wait_readable(fd, api.deadline_after(5.0), spin_ns=spin_ns) is True
        assert b.recv(1) == b"x"
        timer.join()
    # A hangup counts as readable: the next receive reports it.
    a.shutdown(socket.SHUT_WR)
    assert api.sock_wait_readable(fd, api.deadline_after(5.0)) is True
    assert b.recv(1) == b""


def test_wait_readable_bad_arguments(tcp: tuple[socket.socket, socket.socket]) -> None:
    fd = tcp[1].fileno()
    with pytest.raises(TypeError):
        api.sock_wait_readable(fd, 1, spin_ns=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        api.sock_wait_readable(fd, 1, spin_ns=True)
    with pytest.raises(TypeError):
        api.sock_wait_readable("3", 1)  # type: ignore[arg-type]
    for spin_ns in (-1, 2**63):
        with pytest.raises(ParamInvalidError):
            api.sock_wait_readable(fd, 1, spin_ns=spin_ns)
    with pytest.raises(ParamInvalidError):
        api.sock_wait_readable(-1, 1)
    with pytest.raises(OSError) as exc:  # a descriptor number no process has open
        api.sock_wait_readable(2**30, 1)
    assert exc.value.errno == errno.EBADF
