"""The TCP transport: handshakes, pulls and pushes over 127.0.0.1, deadlines, broken links,
malformed peers (raw sockets speaking the wire format by hand) and a second process."""

from __future__ import annotations

import asyncio
import itertools
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pytest

from aio_datadist._transport._wire import (
    HEADER,
    MAGIC,
    MAX_ERROR_TEXT,
    MAX_HELLO_BODY,
    BodyReader,
    BodyWriter,
    FrameHeader,
    FrameKind,
    HelloBody,
    WireError,
    decode_error_text,
    decode_header,
    decode_hello,
    encode_error_text,
    encode_header,
    encode_hello,
)
from aio_datadist._transport.base import (
    Channel,
    Hello,
    Iov,
    LinkRefused,
    RequestKind,
    Served,
)
from aio_datadist._transport.deadlines import Reaper, after_s, now_ns
from aio_datadist._transport.pending import Request
from aio_datadist._transport.tcp import TcpChannel
from aio_datadist._transport.tcp_connect import TcpTransport
from aio_datadist.enums import LLMRole
from aio_datadist.status import LLMException, LLMStatusCode
from tests.conftest import Cleanup

U8 = npt.NDArray[np.uint8]
KiB = 1 << 10
MiB = 1 << 20
HOST = "127.0.0.1"
WAIT = 10.0  # bound of every wait that should end at once
CLIENT_HELLO = Hello(1, LLMRole.DECODER, to_cluster_id=2)
SERVER_HELLO = Hello(2, LLMRole.PROMPT)

# Request modes understood by MemoryHandler (first body byte).
NORMAL, WRONG_SIZE, HOLD, CRASH = range(4)


def random_bytes(n: int, seed: int) -> U8:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def rows(arr: U8, segments: list[tuple[int, int]]) -> Iov:
    base = int(arr.ctypes.data)
    return np.array([(base + off, n) for off, n in segments], dtype=np.uint64).reshape(-1, 2)


def gather(arr: U8, segments: list[tuple[int, int]]) -> U8:
    if not segments:
        return np.empty(0, np.uint8)
    return np.concatenate([arr[off : off + n] for off, n in segments])


def request(segments: list[tuple[int, int]], mode: int = NORMAL) -> bytes:
    return bytes(BodyWriter().u8(mode).u64_array([x for seg in segments for x in seg]))


def deadline(seconds: float = WAIT) -> int:
    return after_s(seconds)


class MemoryHandler:
    """Serves requests from a numpy array; the body names ``(offset, len)`` rows of it."""

    serve_table = None

    def __init__(self, size: int = MiB, seed: int = 0) -> None:
        self.mem = random_bytes(size, seed) if seed else np.zeros(size, np.uint8)
        self.events: list[tuple[str, int, bool]] = []  # ("done"|"commit", key, ok)
        self.cond = threading.Condition()
        self.keys = itertools.count(1)
        self.hold = threading.Event()
        self.entered = threading.Event()

    def serve(
        self, peer: Hello, kind: RequestKind, body: bytes, nbytes: int, *, stream: bool = False
    ) -> Served:
        reader = BodyReader(body)
        mode = reader.u8()
        flat = reader.u64_array()
        reader.end()
        segments = list(zip(flat[::2], flat[1::2], strict=True))
        for off, n in segments:
            if off + n > len(self.mem):
                raise LLMException(
                    f"rows [{off}, {off + n}) outside {len(self.mem)} bytes",
                    status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                )
        total = sum(n for _, n in segments)
        if total != nbytes:
            raise LLMException("size mismatch", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if mode == CRASH:
            raise RuntimeError("handler bug")
        if mode == HOLD:
            self.entered.set()
            assert self.hold.wait(WAIT)
        key = next(self.keys)

        def done(ok: bool) -> None:
            self._record("done", key, ok)

        def commit() -> None:
            self._record("commit", key, True)

        served_size = total - 1 if mode == WRONG_SIZE else total
        return Served(rows(self.mem, segments), served_size, done, commit)

    def _record(self, what: str, key: int, ok: bool) -> None:
        with self.cond:
            self.events.append((what, key, ok))
            self.cond.notify_all()

    def wait_events(self, count: int) -> list[tuple[str, int, bool]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.events) >= count, WAIT), self.events
            return list(self.events)

    def dones(self) -> list[tuple[int, bool]]:
        with self.cond:
            return [(key, ok) for what, key, ok in self.events if what == "done"]


class FakeAcceptor:
    """Accepts (or refuses) every handshake and records the channels and their closing."""

    def __init__(
        self,
        hello: Hello = SERVER_HELLO,
        handler: MemoryHandler | None = None,
        refuse: LinkRefused | None = None,
        on_accept: Callable[[Channel], None] | None = None,
    ) -> None:
        self.hello = hello
        self._handler = handler or MemoryHandler(seed=11)
        self.refuse = refuse
        self.on_accept = on_accept
        self.accepted: list[tuple[Hello, Channel]] = []
        self.closed: list[Channel] = []
        self.cond = threading.Condition()

    @property
    def handler(self) -> MemoryHandler:
        return self._handler

    def accept(self, peer: Hello, channel: Channel) -> Hello:
        if self.refuse is not None:
            raise self.refuse
        channel.on_close(self._closed)
        if self.on_accept is not None:
            self.on_accept(channel)
        with self.cond:
            self.accepted.append((peer, channel))
            self.cond.notify_all()
        return self.hello

    def _closed(self, channel: Channel) -> None:
        with self.cond:
            self.closed.append(channel)
            self.cond.notify_all()

    def wait_accepted(self, count: int = 1) -> list[tuple[Hello, Channel]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.accepted) >= count, WAIT)
            return list(self.accepted)

    def wait_closed(self, count: int = 1) -> list[Channel]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.closed) >= count, WAIT)
            return list(self.closed)


class CloseLog:
    """An on_close callback that records its calls."""

    def __init__(self) -> None:
        self.calls: list[Channel] = []
        self.event = threading.Event()

    def __call__(self, channel: Channel) -> None:
        self.calls.append(channel)
        self.event.set()


@dataclass
class Link:
    client: Channel
    server: Channel
    client_handler: MemoryHandler
    acceptor: FakeAcceptor
    port: int

    @property
    def server_handler(self) -> MemoryHandler:
        return self.acceptor.handler


@pytest.fixture
def transport() -> TcpTransport:
    return TcpTransport(handshake_timeout=2.0, stall_timeout=2.0)


@pytest.fixture
def link(transport: TcpTransport, cleanup: Cleanup) -> Link:
    return open_link(transport, cleanup)


def open_link(transport: TcpTransport, cleanup: Cleanup) -> Link:
    """A linked pair of channels over ``transport``, serving seeded memory on both ends."""
    acceptor = FakeAcceptor(handler=MemoryHandler(seed=11))
    listener = transport.listen(HOST, 0, acceptor)
    cleanup(listener.close)
    client_handler = MemoryHandler(seed=22)
    client = transport.connect(HOST, listener.address[1], CLIENT_HELLO, client_handler, WAIT)
    cleanup(lambda: client.close(notify_peer=False))
    server = acceptor.wait_accepted()[0][1]
    cleanup(lambda: server.close(notify_peer=False))
    return Link(client, server, client_handler, acceptor, listener.address[1])


def expect_error(future: Future[None], status: LLMStatusCode) -> LLMException:
    exc = future.exception(WAIT)
    assert isinstance(exc, LLMException), exc
    assert exc.status_code == status, exc
    return exc


# -- raw peers ---------------------------------------------------------------------------------


def recv_exact(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise EOFError(f"EOF after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def read_frame(conn: socket.socket) -> tuple[FrameHeader, bytes]:
    header = decode_header(recv_exact(conn, HEADER.size))
    return header, recv_exact(conn, header.body_len)


def frame(kind: FrameKind, rid: int = 0, body: bytes = b"", **fields: int) -> bytes:
    return encode_header(FrameHeader(kind, rid, body_len=len(body), **fields)) + body


def hello_frame(hello: Hello, kind: FrameKind = FrameKind.HELLO) -> bytes:
    body = encode_hello(HelloBody(hello.cluster_id, int(hello.role), hello.to_cluster_id))
    return frame(kind, body=body)


def read_until_eof(conn: socket.socket) -> bytes:
    """What arrives before the peer closes (a reset, for unread data there, counts as closed)."""
    data = bytearray()
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)


class RawServer:
    """A listening socket whose peer side a test drives by hand."""

    def __init__(self) -> None:
        self.sock = socket.create_server((HOST, 0))
        self.port = int(self.sock.getsockname()[1])
        self.pool = ThreadPoolExecutor(1)

    def serve_hello(self, answer: bytes | None = None) -> Future[socket.socket]:
        """Accept one connection, read its HELLO, answer ``answer`` (a HELLO_ACK by default)."""

        def run() -> socket.socket:
            conn, _ = self.sock.accept()
            conn.settimeout(WAIT)
            header, body = read_frame(conn)
            assert header.kind is FrameKind.HELLO
            assert decode_hello(body).cluster_id == CLIENT_HELLO.cluster_id
            conn.sendall(
                hello_frame(SERVER_HELLO, FrameKind.HELLO_ACK) if answer is None else answer
            )
            return conn

        return self.pool.submit(run)

    def close(self) -> None:
        self.pool.shutdown()
        self.sock.close()


@pytest.fixture
def raw_server(cleanup: Cleanup) -> RawServer:
    server = RawServer()
    cleanup(server.close)
    return server


def raw_link(
    transport: TcpTransport, raw_server: RawServer, cleanup: Cleanup
) -> tuple[Channel, socket.socket]:
    pending = raw_server.serve_hello()
    channel = transport.connect(HOST, raw_server.port, CLIENT_HELLO, MemoryHandler(), WAIT)
    cleanup(lambda: channel.close(notify_peer=False))
    conn = pending.result(WAIT)
    cleanup(conn.close)
    return channel, conn


def raw_client(port: int) -> socket.socket:
    conn = socket.create_connection((HOST, port), timeout=WAIT)
    conn.sendall(hello_frame(CLIENT_HELLO))
    header, body = read_frame(conn)
    assert header.kind is FrameKind.HELLO_ACK
    assert decode_hello(body).cluster_id == SERVER_HELLO.cluster_id
    return conn


# -- handshake ---------------------------------------------------------------------------------


def test_handshake_exchanges_hellos(link: Link, transport: TcpTransport, cleanup: Cleanup) -> None:
    assert link.client.peer == SERVER_HELLO
    peer, server = link.acceptor.accepted[0]
    assert peer == CLIENT_HELLO and server.peer == CLIENT_HELLO
    assert not link.client.closed and not link.server.closed
    # A hello without a target cluster round-trips as such.
    other = Hello(7, LLMRole.MIX)
    channel = transport.connect(HOST, link.port, other, MemoryHandler(), WAIT)
    cleanup(lambda: channel.close(notify_peer=False))
    assert link.acceptor.wait_accepted(2)[1][0] == other
    assert channel.peer == SERVER_HELLO


def test_refusal_status_passes_through(transport: TcpTransport, cleanup: Cleanup) -> None:
    refusal = LinkRefused(LLMStatusCode.LLM_ALREADY_LINK, "cluster 1 is already linked")
    acceptor = FakeAcceptor(refuse=refusal)
    listener = transport.listen(HOST, 0, acceptor)
    cleanup(listener.close)
    with pytest.raises(LinkRefused) as info:
        transport.connect(HOST, listener.address[1], CLIENT_HELLO, MemoryHandler(), WAIT)
    assert info.value.status == LLMStatusCode.LLM_ALREADY_LINK
    assert "already linked" in str(info.value)
    assert not acceptor.accepted


def test_nobody_listening_is_link_failed(transport: TcpTransport) -> None:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]  # bound, never listening
        with pytest.raises(LinkRefused) as info:
            transport.connect(HOST, port, CLIENT_HELLO, MemoryHandler(), WAIT)
    assert info.value.status == LLMStatusCode.LLM_LINK_FAILED


def test_silent_listener_times_out(transport: TcpTransport, raw_server: RawServer) -> None:
    start = time.monotonic()
    with pytest.raises(LinkRefused) as info:  # the kernel accepts; nobody ever answers
        transport.connect(HOST, raw_server.port, CLIENT_HELLO, MemoryHandler(), 0.3)
    assert info.value.status == LLMStatusCode.LLM_TIMEOUT
    assert time.monotonic() - start < 0.3 + 2.0


def test_silent_client_does_not_block_accepts(cleanup: Cleanup) -> None:
    transport = TcpTransport(handshake_timeout=0.5)
    acceptor = FakeAcceptor()
    listener = transport.listen(HOST, 0, acceptor)
    cleanup(listener.close)
    silent = socket.create_connection((HOST, listener.address[1]), timeout=WAIT)
    cleanup(silent.close)
    channel = transport.connect(HOST, listener.address[1], CLIENT_HELLO, MemoryHandler(), WAIT)
    cleanup(lambda: channel.close(notify_peer=False))
    assert channel.peer == SERVER_HELLO
    assert read_until_eof(silent) == b""  # dropped after the handshake timeout
    assert len(acceptor.accepted) == 1


def test_other_protocol_version_is_refused(link: Link, transport: TcpTransport) -> None:
    body = encode_hello(HelloBody(5, int(LLMRole.PROMPT)))
    newer = HEADER.pack(MAGIC, 2, FrameKind.HELLO, 0, 0, len(body), 0, 0) + body
    with socket.create_connection((HOST, link.port), timeout=WAIT) as conn:
        conn.sendall(newer)
        header, message = read_frame(conn)
        assert header.kind is FrameKind.ERROR
        assert header.status == LLMStatusCode.LLM_LINK_FAILED
        assert b"version 2" in message
        assert read_until_eof(conn) == b""
    with socket.create_connection((HOST, link.port), timeout=WAIT) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\n".ljust(HEADER.size, b"\0"))
        assert read_until_eof(conn) == b""  # not one of ours: dropped without a word
    assert len(link.acceptor.accepted) == 1
    # The listener still works.
    channel = transport.connect(HOST, link.port, Hello(9, LLMRole.MIX), MemoryHandler(), WAIT)
    assert channel.peer == SERVER_HELLO
    channel.close(notify_peer=True, timeout=WAIT)


@pytest.mark.parametrize(
    "answer",
    [
        HEADER.pack(MAGIC, 2, FrameKind.HELLO_ACK, 0, 0, 0, 0, 0),
        b"SSH-2.0-OpenSSH_9.6\r\n" + bytes(40),
        frame(FrameKind.PONG),
    ],
    ids=["version", "magic", "kind"],
)
def test_client_refuses_a_foreign_server(
    transport: TcpTransport, raw_server: RawServer, answer: bytes
) -> None:
    pending = raw_server.serve_hello(answer)
    with pytest.raises(LinkRefused) as info:
        transport.connect(HOST, raw_server.port, CLIENT_HELLO, MemoryHandler(), WAIT)
    pending.result(WAIT).close()
    assert info.value.status == LLMStatusCode.LLM_LINK_FAILED
    assert "protocol" in str(info.value)


def test_server_request_waits_for_hello_ack(transport: TcpTransport, cleanup: Cleanup) -> None:
    results: queue.SimpleQueue[Future[None]] = queue.SimpleQueue()
    about_to_pull = threading.Event()
    client_handler = MemoryHandler(seed=5)
    segments = [(100, 3000), (9000, 77)]
    dst = np.zeros(3077, np.uint8)

    def pull_at_once(channel: Channel) -> None:
        def run() -> None:
            about_to_pull.set()
            results.put(channel.pull(request(segments), rows(dst, [(0, 3077)]), 3077, deadline()))

        threading.Thread(target=run, daemon=True).start()
        assert about_to_pull.wait(WAIT)

    acceptor = FakeAcceptor(on_accept=pull_at_once)
    listener = transport.listen(HOST, 0, acceptor)
    cleanup(listener.close)
    client = transport.connect(HOST, listener.address[1], CLIENT_HELLO, client_handler, WAIT)
    cleanup(lambda: client.close(notify_peer=False))
    assert client.peer == SERVER_HELLO
    server = acceptor.wait_accepted()[0][1]
    cleanup(lambda: server.close(notify_peer=False))
    assert results.get(timeout=WAIT).result(WAIT) is None
    np.testing.assert_array_equal(dst, gather(client_handler.mem, segments))


# -- pulls and pushes --------------------------------------------------------------------------


def random_segments(
    rng: np.random.Generator, total: int, pieces: int, space: int
) -> list[tuple[int, int]]:
    """``pieces`` disjoint rows adding up to ``total``, shuffled over ``space`` bytes."""
    cuts = np.sort(rng.choice(np.arange(1, total), pieces - 1, replace=False))
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).tolist()
    gaps = rng.integers(0, (space - total) // pieces, pieces).tolist()
    order = rng.permutation(pieces)
    slots, pos = [], 0
    for i in order:
        pos += gaps[i]
        slots.append((int(i), pos, sizes[i]))
        pos += sizes[i]
    slots.sort()
    return [(off, n) for _, off, n in slots]


@pytest.mark.parametrize("direction", ["client_pulls", "server_pulls"])
def test_pull_scattered_rows(link: Link, direction: str) -> None:
    rng = np.random.default_rng(42)
    requester, serving = (
        (link.client, link.server_handler)
        if direction == "client_pulls"
        else (link.server, link.client_handler)
    )
    total = 300_001
    src = random_segments(rng, total, 53, len(serving.mem))
    dst_mem = np.zeros(2 * MiB, np.uint8)
    dst = random_segments(rng, total, 37, len(dst_mem))
    future = requester.pull(request(src), rows(dst_mem, dst), total, deadline())
    assert future.result(WAIT) is None
    np.testing.assert_array_equal(gather(dst_mem, dst), gather(serving.mem, src))
    assert serving.wait_events(1) == [("done", 1, True)]


def test_concurrent_pulls_on_one_channel(link: Link) -> None:
    rng = np.random.default_rng(7)
    dst_mem = np.zeros(64 * 16 * KiB, np.uint8)
    jobs = []
    for i in range(64):
        n = int(rng.integers(1, 16 * KiB))
        off = int(rng.integers(0, MiB - n))
        jobs.append(([(off, n)], [(i * 16 * KiB, n)]))

    def run(batch: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]]) -> list[Future[None]]:
        return [
            link.client.pull(request(src), rows(dst_mem, dst), dst[0][1], deadline())
            for src, dst in batch
        ]

    with ThreadPoolExecutor(8) as pool:
        futures = [f for fs in pool.map(run, [jobs[i::8] for i in range(8)]) for f in fs]
    for f in futures:
        assert f.result(WAIT) is None
    for src, dst in jobs:
        np.testing.assert_array_equal(gather(dst_mem, dst), gather(link.server_handler.mem, src))
    assert len(link.server_handler.wait_events(64)) == 64
    assert all(ok for _, ok in link.server_handler.dones())


def test_push_is_in_memory_when_acked(link: Link) -> None:
    rng = np.random.default_rng(3)
    total = 512 * KiB + 13
    src_mem = random_bytes(2 * MiB, 99)
    src = random_segments(rng, total, 41, len(src_mem))
    dst = random_segments(rng, total, 29, len(link.server_handler.mem))
    for _ in range(3):
        future = link.client.push(request(dst), rows(src_mem, src), total, deadline())
        assert future.result(WAIT) is None
        # PUSH_ACK comes after the bytes landed: they are there the moment the future is done.
        np.testing.assert_array_equal(gather(link.server_handler.mem, dst), gather(src_mem, src))
        src_mem = random_bytes(2 * MiB, int(rng.integers(1000)))
    assert link.server_handler.dones() == [(1, True), (2, True), (3, True)]


def test_refused_requests_keep_the_channel(link: Link) -> None:
    big = [(MiB - 10, 20)]
    buf = np.zeros(64 * KiB, np.uint8)
    pulled = link.client.pull(request(big), rows(buf, [(0, 20)]), 20, deadline())
    exc = expect_error(pulled, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    assert "outside" in str(exc)
    pushed = link.client.push(request(big), rows(buf, [(0, 20)]), 20, deadline())
    expect_error(pushed, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)  # its payload was drained
    crashed = link.client.pull(request([(0, 5)], CRASH), rows(buf, [(0, 5)]), 5, deadline())
    expect_error(crashed, LLMStatusCode.LLM_FAILED)
    assert not link.client.closed
    ok = link.client.pull(request([(10, 30000)]), rows(buf, [(0, 30000)]), 30000, deadline())
    assert ok.result(WAIT) is None
    np.testing.assert_array_equal(buf[:30000], link.server_handler.mem[10:30010])
    assert link.server_handler.wait_events(1) == [("done", 1, True)]


def test_done_is_called_once_in_every_path(link: Link) -> None:
    handler = link.server_handler
    buf = np.zeros(64 * KiB, np.uint8)
    wrong = link.client.pull(
        request([(0, 100)], WRONG_SIZE), rows(buf, [(0, 100)]), 100, deadline()
    )
    expect_error(wrong, LLMStatusCode.LLM_PARAM_INVALID)
    wrong_push = link.client.push(
        request([(0, 100)], WRONG_SIZE), rows(buf, [(0, 100)]), 100, deadline()
    )
    expect_error(wrong_push, LLMStatusCode.LLM_PARAM_INVALID)
    assert (
        link.client.pull(request([(0, 100)]), rows(buf, [(0, 100)]), 100, deadline()).result(WAIT)
        is None
    )
    assert (
        link.client.push(request([(0, 100)]), rows(buf, [(0, 100)]), 100, deadline()).result(WAIT)
        is None
    )
    assert sorted(handler.wait_events(4)) == [
        ("done", 1, False),
        ("done", 2, False),
        ("done", 3, True),
        ("done", 4, True),
    ]


def test_commit_runs_after_pull_done(link: Link) -> None:
    handler = link.server_handler
    buf = np.zeros(256 * KiB, np.uint8)
    plain = link.client.pull(request([(0, 1000)]), rows(buf, [(0, 1000)]), 1000, deadline())
    assert plain.result(WAIT) is None
    committed = link.client.pull(
        request([(0, 200 * KiB)]), rows(buf, [(0, 200 * KiB)]), 200 * KiB, deadline(), commit=True
    )
    assert committed.result(WAIT) is None
    events = handler.wait_events(3)
    assert [e for e in events if e[1] == 1] == [("done", 1, True)]
    assert [e for e in events if e[1] == 2] == [("done", 2, True), ("commit", 2, True)]


def test_bad_request_arguments_fail_the_future(link: Link) -> None:
    buf = np.zeros(100, np.uint8)
    short = link.client.pull(request([(0, 100)]), rows(buf, [(0, 50)]), 100, deadline())
    expect_error(short, LLMStatusCode.LLM_PARAM_INVALID)
    late = link.client.pull(request([(0, 100)]), rows(buf, [(0, 100)]), 100, now_ns() - 1)
    expect_error(late, LLMStatusCode.LLM_TIMEOUT)
    null = np.array([[0, 100]], dtype=np.uint64)  # rows the native layer refuses
    expect_error(
        link.client.push(request([(0, 100)]), null, 100, deadline()),
        LLMStatusCode.LLM_PARAM_INVALID,
    )
    expect_error(
        link.client.pull(request([(0, 100)]), null, 100, deadline()),
        LLMStatusCode.LLM_PARAM_INVALID,
    )
    ok = link.client.pull(request([(0, 100)]), rows(buf, [(0, 100)]), 100, deadline())
    assert ok.result(WAIT) is None
    assert not link.client.closed


# -- deadlines and broken links ----------------------------------------------------------------


def test_pull_deadline_against_a_silent_peer(
    transport: TcpTransport, raw_server: RawServer, cleanup: Cleanup
) -> None:
    channel, conn = raw_link(transport, raw_server, cleanup)
    buf = np.zeros(1000, np.uint8)
    start = time.monotonic()
    future = channel.pull(request([(0, 1000)]), rows(buf, [(0, 1000)]), 1000, deadline(0.3))
    expect_error(future, LLMStatusCode.LLM_TIMEOUT)
    assert time.monotonic() - start < 0.3 + 1.5
    header, _ = read_frame(conn)
    assert header.kind is FrameKind.PULL
    # The late answer is drained; the stream stays in sync and the link usable.
    conn.sendall(frame(FrameKind.PULL_DATA, header.request_id, payload_len=1000) + b"\xab" * 1000)
    conn.sendall(frame(FrameKind.PING, 77))
    pong, _ = read_frame(conn)
    assert (pong.kind, pong.request_id) == (FrameKind.PONG, 77)
    assert not channel.closed and not buf.any()


@pytest.mark.parametrize("how", ["bye", "eof", "garbage"])
def test_peer_going_away_fails_pending_requests(
    transport: TcpTransport, raw_server: RawServer, cleanup: Cleanup, how: str
) -> None:
    channel, conn = raw_link(transport, raw_server, cleanup)
    closed = CloseLog()
    channel.on_close(closed)
    buf = np.zeros(1000, np.uint8)
    future = channel.pull(request([(0, 1000)]), rows(buf, [(0, 1000)]), 1000, deadline())
    assert read_frame(conn)[0].kind is FrameKind.PULL
    if how == "bye":
        conn.sendall(frame(FrameKind.BYE))
        assert read_frame(conn)[0].kind is FrameKind.BYE_ACK
    elif how == "eof":
        conn.shutdown(socket.SHUT_WR)
    else:
        conn.sendall(b"\x00" * 40)
    expect_error(future, LLMStatusCode.LLM_LINK_FAILED)
    assert closed.event.wait(WAIT) and closed.calls == [channel]
    assert channel.closed
    assert read_until_eof(conn) == b""
    later = CloseLog()
    channel.on_close(later)  # registered after the close: runs at once
    assert later.calls == [channel] and closed.calls == [channel]
    expect_error(
        channel.pull(request([(0, 1)]), rows(buf, [(0, 1)]), 1, deadline()),
        LLMStatusCode.LLM_LINK_FAILED,
    )


def test_close_with_notice(link: Link) -> None:
    mine = CloseLog()
    link.client.on_close(mine)
    assert link.client.close(notify_peer=True, timeout=WAIT) is True
    assert link.acceptor.wait_closed() == [link.server]
    assert link.client.closed and link.server.closed
    assert mine.calls == []  # closing this end is not news to this end
    assert link.client.close(notify_peer=True, timeout=WAIT) is True


def test_both_ends_closing_at_once(link: Link) -> None:
    with ThreadPoolExecutor(2) as pool:
        start = time.monotonic()
        told = list(
            pool.map(
                lambda ch: ch.close(notify_peer=True, timeout=WAIT), [link.client, link.server]
            )
        )
    assert told == [True, True]
    assert time.monotonic() - start < WAIT / 2


def test_close_notice_unanswered(
    transport: TcpTransport, raw_server: RawServer, cleanup: Cleanup
) -> None:
    channel, conn = raw_link(transport, raw_server, cleanup)
    assert channel.close(notify_peer=True, timeout=0.2) is False
    assert read_frame(conn)[0].kind is FrameKind.BYE
    assert read_until_eof(conn) == b""
    assert channel.closed


def test_close_without_notice_fails_both_sides(link: Link) -> None:
    handler = link.server_handler
    buf = np.zeros(1000, np.uint8)
    held = link.client.pull(request([(0, 1000)], HOLD), rows(buf, [(0, 1000)]), 1000, deadline())
    assert handler.entered.wait(WAIT)
    link.client.close(notify_peer=False)
    expect_error(held, LLMStatusCode.LLM_LINK_FAILED)
    handler.hold.set()
    assert link.acceptor.wait_closed() == [link.server]
    # Whether the kernel still took the answer is a race; done runs once either way.
    assert [e[:2] for e in handler.wait_events(1)] == [("done", 1)]


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff" * 40,
        HEADER.pack(MAGIC, 1, 99, 0, 0, 0, 0, 0),
        HEADER.pack(MAGIC, 1, FrameKind.PULL, 1, 0, (1 << 24) + 1, 0, 0),
        frame(FrameKind.PUSH_ACK, 1, payload_len=10),
        frame(FrameKind.HELLO, body=b"again"),
        frame(FrameKind.PULL, 1, body=b"\x01"),
    ],
    ids=["magic", "kind", "oversized", "payload", "hello", "short"],
)
def test_malformed_frame_breaks_only_that_channel(link: Link, garbage: bytes) -> None:
    conn = raw_client(link.port)
    try:
        bad = link.acceptor.wait_accepted(2)[1][1]
        conn.sendall(garbage)
        assert link.acceptor.wait_closed() == [bad]
        assert read_until_eof(conn) == b""
    finally:
        conn.close()
    buf = np.zeros(5000, np.uint8)
    ok = link.client.pull(request([(0, 5000)]), rows(buf, [(0, 5000)]), 5000, deadline())
    assert ok.result(WAIT) is None
    assert not link.client.closed and not link.server.closed


def test_requester_vanishing_mid_payload(link: Link, transport: TcpTransport) -> None:
    handler = MemoryHandler(size=32 * MiB)
    link.acceptor._handler = handler
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.settimeout(WAIT)
    conn.connect((HOST, link.port))
    conn.sendall(hello_frame(CLIENT_HELLO))
    assert read_frame(conn)[0].kind is FrameKind.HELLO_ACK
    server = link.acceptor.wait_accepted(2)[1][1]
    body = (32 * MiB).to_bytes(8, "little") + request([(0, 32 * MiB)])
    conn.sendall(frame(FrameKind.PULL, 1, body))
    conn.close()  # with the answer still pouring in
    assert link.acceptor.wait_closed() == [server]
    assert handler.wait_events(1) == [("done", 1, False)]


def test_listener_close_frees_the_port(transport: TcpTransport, cleanup: Cleanup) -> None:
    acceptor = FakeAcceptor()
    listener = transport.listen(HOST, 0, acceptor)
    port = listener.address[1]
    channel = transport.connect(HOST, port, CLIENT_HELLO, MemoryHandler(), WAIT)
    cleanup(lambda: channel.close(notify_peer=False))
    server = acceptor.wait_accepted()[0][1]
    cleanup(lambda: server.close(notify_peer=False))
    with pytest.raises(OSError):
        transport.listen(HOST, port, FakeAcceptor())
    listener.close()
    listener.close()
    with pytest.raises(LinkRefused) as info:
        transport.connect(HOST, port, CLIENT_HELLO, MemoryHandler(), WAIT)
    assert info.value.status == LLMStatusCode.LLM_LINK_FAILED
    again = transport.listen(HOST, port, FakeAcceptor())  # at once
    cleanup(again.close)
    assert again.address == (HOST, port)
    # The channel made through the closed listener still works.
    buf = np.zeros(100, np.uint8)
    ok = channel.pull(request([(0, 100)]), rows(buf, [(0, 100)]), 100, deadline())
    assert ok.result(WAIT) is None
    np.testing.assert_array_equal(buf, acceptor.handler.mem[:100])


# -- the pump: the link's one reader, and the callers waiting on it ------------------------------


class FrameReaders:
    """Records which thread read each frame the pump handed to Python on a test's channels."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[str] = []
        self.channels: list[TcpChannel] = []
        read_frame = TcpChannel._read_frame

        def spy(channel: TcpChannel, header: bytes | None) -> str | None:
            self.threads.append(threading.current_thread().name)
            self.channels.append(channel)
            return read_frame(channel, header)

        monkeypatch.setattr(TcpChannel, "_read_frame", spy)

    def by(self, name: str) -> int:
        return sum(1 for thread in self.threads if thread == name)

    def of(self, channel: Channel) -> int:
        """Frames of ``channel`` that came to Python."""
        return sum(1 for seen in self.channels if seen is channel)


class Completers:
    """Records which thread completed each request of a test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[str] = []
        complete = Request.complete

        def spy(req: Request) -> None:
            self.threads.append(threading.current_thread().name)
            complete(req)

        monkeypatch.setattr(Request, "complete", spy)


def eager_link(cleanup: Cleanup, busy_poll_us: int, buffers: int = 0) -> Link:
    transport = TcpTransport(
        handshake_timeout=2.0,
        stall_timeout=2.0,
        busy_poll_us=busy_poll_us,
        sndbuf=buffers,
        rcvbuf=buffers,
    )
    return open_link(transport, cleanup)


def eager_raw_link(
    raw_server: RawServer, cleanup: Cleanup, busy_poll_us: int
) -> tuple[TcpChannel, socket.socket]:
    """A channel busy-polling for ``busy_poll_us``, linked to a raw socket the test drives."""
    transport = TcpTransport(handshake_timeout=2.0, stall_timeout=2.0, busy_poll_us=busy_poll_us)
    channel, conn = raw_link(transport, raw_server, cleanup)
    assert isinstance(channel, TcpChannel)
    return channel, conn


def waited(channel: Channel, future: Future[None]) -> None:
    """Wait for a request as the blocking face does: in the pump, then on the future."""
    channel.read_for(future, deadline())
    future.result(WAIT)


@pytest.mark.parametrize("busy_poll_us", [0, 2_000_000], ids=["sleeps", "busy-polls"])
def test_a_waiting_caller_takes_its_answer_from_the_pump(
    cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch, busy_poll_us: int
) -> None:
    readers = FrameReaders(monkeypatch)
    completers = Completers(monkeypatch)
    link = eager_link(cleanup, busy_poll_us=busy_poll_us)
    client = link.client
    me = threading.current_thread().name
    n = 4 * KiB
    for i in range(20):
        buf = np.zeros(n, np.uint8)
        future = client.pull(request([(i * KiB, n)]), rows(buf, [(0, n)]), n, deadline())
        waited(client, future)
        np.testing.assert_array_equal(buf, link.server_handler.mem[i * KiB : i * KiB + n])
        data = random_bytes(n, i)
        waited(client, client.push(request([(i * KiB, n)]), rows(data, [(0, n)]), n, deadline()))
        np.testing.assert_array_equal(link.server_handler.mem[i * KiB : i * KiB + n], data)
    # The pump took every answer (none of the client's frames came to Python), and the
    # caller completed its own requests, woken by the pump: no hand-over to another thread.
    assert readers.of(client) == 0 and readers.by(me) == 0
    assert len(completers.threads) == 40 and completers.threads.count(me) >= 30, completers.threads
    assert not client._pending


def pull_from_raw_peer(
    channel: Channel, conn: socket.socket, deadline_ns: int | None = None
) -> tuple[U8, Future[None], FrameHeader]:
    """A 100-byte pull into a fresh buffer, and its request as the raw peer read it."""
    buf = np.zeros(100, np.uint8)
    when = deadline() if deadline_ns is None else deadline_ns
    future = channel.pull(request([(0, 100)]), rows(buf, [(0, 100)]), 100, when)
    header, _ = read_frame(conn)
    assert header.kind is FrameKind.PULL
    return buf, future, header


def test_a_caller_that_stops_waiting_leaves_the_answer_to_the_reader(
    raw_server: RawServer, cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    completers = Completers(monkeypatch)
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=1000)
    buf, future, header = pull_from_raw_peer(channel, conn)
    channel.read_for(future, after_s(0.05))  # the caller's own limit: nothing came by then
    assert not future.done()
    conn.sendall(frame(FrameKind.PULL_DATA, header.request_id, payload_len=100) + b"\x07" * 100)
    assert future.result(WAIT) is None
    assert (buf == 7).all()
    assert len(completers.threads) == 1 and completers.threads[0].startswith("aio-dd-tcp-read-")


def test_a_callers_answer_behind_the_peers_push(
    raw_server: RawServer, cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    readers = FrameReaders(monkeypatch)
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=2_000_000)
    buf, future, header = pull_from_raw_peer(channel, conn)
    push = frame(FrameKind.PUSH, 77, request([(0, 1000)]), payload_len=1000) + b"\x06" * 1000
    answer = frame(FrameKind.PULL_DATA, header.request_id, payload_len=100) + b"\x04" * 100
    conn.sendall(push + answer)
    waited(channel, future)
    assert (buf == 4).all()
    ack, _ = read_frame(conn)
    assert (ack.kind, ack.request_id) == (FrameKind.PUSH_ACK, 77)
    # Only the peer's push came to Python, in the reader thread.
    assert len(readers.threads) == 1 and readers.threads[0].startswith("aio-dd-tcp-read-")


def test_garbage_where_an_answer_should_be_breaks_the_link(
    raw_server: RawServer, cleanup: Cleanup
) -> None:
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=2_000_000)
    closed = CloseLog()
    channel.on_close(closed)
    buf = np.zeros(100, np.uint8)
    future = channel.pull(request([(0, 100)]), rows(buf, [(0, 100)]), 100, deadline())
    assert read_frame(conn)[0].kind is FrameKind.PULL
    threading.Timer(0.05, conn.sendall, (b"\x00" * 40,)).start()
    channel.read_for(future, deadline())
    expect_error(future, LLMStatusCode.LLM_LINK_FAILED)
    assert closed.event.wait(WAIT) and channel.closed
    assert read_until_eof(conn) == b""


def run_callers(link: Link, callers: int, run: Callable[[int], None]) -> None:
    """Run ``run(caller)`` on that many threads at once: all end in time, the link open."""
    start = time.monotonic()
    with ThreadPoolExecutor(callers) as pool:
        for done in [pool.submit(run, w) for w in range(callers)]:
            done.result()
    assert time.monotonic() - start < WAIT
    assert not link.client.closed and not link.server.closed


def test_waiting_callers_and_requests_both_ways(cleanup: Cleanup) -> None:
    """Callers on both ends wait for their answers while the other end's requests arrive
    too: every request is answered with exact bytes, none waits for a timeout."""
    link = eager_link(cleanup, busy_poll_us=500)
    ends = [(link.client, link.server_handler), (link.server, link.client_handler)]

    def run(worker: int) -> None:
        requester, serving = ends[worker % 2]
        rng = np.random.default_rng(worker)
        for _ in range(40):
            n = int(rng.integers(1, 64 * KiB))
            off = int(rng.integers(0, MiB - n))
            buf = np.zeros(n, np.uint8)
            future = requester.pull(request([(off, n)]), rows(buf, [(0, n)]), n, deadline())
            waited(requester, future)
            np.testing.assert_array_equal(buf, serving.mem[off : off + n])

    run_callers(link, 6, run)


def test_a_refused_request_fails_with_the_peer_status(cleanup: Cleanup) -> None:
    link = eager_link(cleanup, busy_poll_us=2_000_000)
    buf = np.zeros(KiB, np.uint8)
    body = request([(MiB, KiB)])  # outside the peer's memory
    future = link.client.pull(body, rows(buf, [(0, KiB)]), KiB, deadline())
    link.client.read_for(future, deadline())
    expect_error(future, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    future = link.client.pull(request([(0, KiB)]), rows(buf, [(0, KiB)]), KiB, deadline())
    waited(link.client, future)
    np.testing.assert_array_equal(buf, link.server_handler.mem[:KiB])


async def assert_in_step(channel: TcpChannel, conn: socket.socket, byte: int) -> None:
    """The stream is still in step: the next answer lands whole and the link stays up."""
    buf = np.zeros(KiB, np.uint8)
    future = channel.pull(request([(0, KiB)]), rows(buf, [(0, KiB)]), KiB, deadline())
    header, _ = await asyncio.to_thread(read_frame, conn)
    answer = frame(FrameKind.PULL_DATA, header.request_id, payload_len=KiB)
    conn.sendall(answer + bytes([byte]) * KiB)
    await asyncio.wait_for(asyncio.wrap_future(future), WAIT)
    assert (buf == byte).all() and not channel.closed


@pytest.mark.parametrize("waiter", ["caller", "loop"])
async def test_a_deadline_mid_payload_fails_the_pull_and_the_link_goes_on(
    raw_server: RawServer, cleanup: Cleanup, waiter: str
) -> None:
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=2_000_000)
    n = 32 * KiB
    buf = np.zeros(n, np.uint8)
    # (a second: half the payload must arrive before it, even on a loaded machine)
    future = channel.pull(request([(0, n)]), rows(buf, [(0, n)]), n, after_s(1.0))
    header, _ = await asyncio.to_thread(read_frame, conn)
    conn.sendall(frame(FrameKind.PULL_DATA, header.request_id, payload_len=n) + bytes(n // 2))
    started = time.monotonic()
    with pytest.raises(LLMException) as info:  # half came; the peer dawdles past the deadline
        if waiter == "caller":
            await asyncio.to_thread(waited, channel, future)
        else:
            await asyncio.wait_for(asyncio.wrap_future(future), WAIT)
    assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
    assert "16384 bytes" in str(info.value) and time.monotonic() - started < 1.5
    before = buf.copy()
    conn.sendall(b"\xff" * (n // 2))  # the rest arrives late: discarded, never written
    await assert_in_step(channel, conn, 1)
    np.testing.assert_array_equal(buf, before)


def test_a_push_the_socket_takes_in_part_completes(raw_server: RawServer, cleanup: Cleanup) -> None:
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=2_000_000)
    channel._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    n = 512 * KiB
    data = random_bytes(n, 5)
    got: list[bytes] = []

    def peer() -> None:  # reads the push as it goes, then acknowledges
        header, _ = read_frame(conn)
        got.append(recv_exact(conn, header.payload_len))
        conn.sendall(frame(FrameKind.PUSH_ACK, header.request_id))

    reader = threading.Thread(target=peer, daemon=True)
    reader.start()
    waited(channel, channel.push(request([(0, n)]), rows(data, [(0, n)]), n, deadline()))
    reader.join(WAIT)
    assert got == [data.tobytes()]


def test_both_ends_moving_large_requests_keep_reading(cleanup: Cleanup) -> None:
    """Callers on both ends push and pull payloads larger than the socket buffers at once:
    the pump reads while callers send, so none stalls."""
    link = eager_link(cleanup, busy_poll_us=500, buffers=16 * KiB)
    ends = [(link.client, link.server_handler), (link.server, link.client_handler)]
    n = 256 * KiB

    def run(worker: int) -> None:  # two callers per end
        channel, serving = ends[worker % 2]
        for i in range(10):
            off = (worker // 2) * 2 * n + i * KiB  # each caller has its own span
            data = random_bytes(n, worker * 100 + i)
            waited(channel, channel.push(request([(off, n)]), rows(data, [(0, n)]), n, deadline()))
            back = np.zeros(n, np.uint8)
            waited(channel, channel.pull(request([(off, n)]), rows(back, [(0, n)]), n, deadline()))
            assert back.tobytes() == serving.mem[off : off + n].tobytes()

    run_callers(link, 4, run)


# -- another process ---------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, threading, time
    import numpy as np
    from aio_datadist._transport.base import Hello, Served
    from aio_datadist._transport._wire import BodyReader
    from aio_datadist._transport.tcp import TcpChannel
    from aio_datadist._transport.tcp_connect import TcpTransport
    from aio_datadist.enums import LLMRole

    mem = np.random.default_rng(1234).integers(0, 256, 1 << 20, dtype=np.uint8)

    class Handler:
        serve_table = None

        def serve(self, peer, kind, body, nbytes, *, stream=False):
            reader = BodyReader(body)
            mode = reader.u8()
            flat = reader.u64_array()
            if mode == 2:
                print("held", flush=True)
                time.sleep(600)
            iov = np.array(
                [(mem.ctypes.data + o, n) for o, n in zip(flat[::2], flat[1::2])], np.uint64
            ).reshape(-1, 2)
            assert int(iov[:, 1].sum()) == nbytes and max(flat[::2]) < len(mem)
            return Served(iov, nbytes, lambda ok: None)

    class Acceptor:
        handler = Handler()
        def accept(self, peer, channel):
            return Hello(2, LLMRole.PROMPT)

    listener = TcpTransport().listen("127.0.0.1", 0, Acceptor())
    print(listener.address[1], flush=True)
    sys.stdin.read()
    listener.close()
    """
)


# -- an event loop awaiting the link's requests ----------------------------------------------------


async def awaited(channel: Channel, future: Future[None]) -> None:
    """Await a request the way the async face does."""
    del channel
    await asyncio.wait_for(asyncio.wrap_future(future), WAIT)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_an_awaiting_loop_never_reads_the_socket(
    cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    readers = FrameReaders(monkeypatch)
    link = eager_link(cleanup, busy_poll_us=200)
    client = link.client
    me, mem = threading.current_thread().name, link.server_handler.mem
    n = 16 * KiB
    for i in range(20):
        buf = np.zeros(n, np.uint8)
        await awaited(
            client, client.pull(request([(i * KiB, n)]), rows(buf, [(0, n)]), n, deadline())
        )
        np.testing.assert_array_equal(buf, mem[i * KiB : i * KiB + n])
        src = random_bytes(n, 100 + i)
        await awaited(
            client, client.push(request([(i * n, n)]), rows(src, [(0, n)]), n, deadline())
        )
        np.testing.assert_array_equal(mem[i * n : (i + 1) * n], src)
        # The peer pulls from this end meanwhile: its request is served too.
        theirs = np.zeros(KiB, np.uint8)
        served = link.server.pull(request([(0, KiB)]), rows(theirs, [(0, KiB)]), KiB, deadline())
        assert served.result(WAIT) is None
        np.testing.assert_array_equal(theirs, link.client_handler.mem[:KiB])
    assert readers.by(me) == 0


async def test_an_awaited_link_that_breaks_fails_the_await_and_leaves_no_descriptor(
    raw_server: RawServer, cleanup: Cleanup
) -> None:
    before = open_fds()
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=200)
    _, future, _ = pull_from_raw_peer(channel, conn)
    conn.close()  # the peer vanishes
    with pytest.raises(LLMException) as info:
        await asyncio.wait_for(asyncio.wrap_future(future), WAIT)
    assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    channel.close(notify_peer=False)
    assert open_fds() <= before


def test_loops_on_several_threads_await_one_link(cleanup: Cleanup) -> None:
    link = eager_link(cleanup, busy_poll_us=200)
    client, mem = link.client, link.server_handler.mem

    def one_loop(seed: int) -> None:
        async def run() -> None:
            rng = np.random.default_rng(seed)
            for _ in range(30):
                n = int(rng.integers(1, 32 * KiB))
                off = int(rng.integers(0, MiB - n))
                buf = np.zeros(n, np.uint8)
                await awaited(
                    client, client.pull(request([(off, n)]), rows(buf, [(0, n)]), n, deadline())
                )
                np.testing.assert_array_equal(buf, mem[off : off + n])

        asyncio.run(run())

    with ThreadPoolExecutor(3) as pool:
        for done in [pool.submit(one_loop, seed) for seed in range(3)]:
            done.result(WAIT)


@pytest.fixture
def child(cleanup: Cleanup) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def stop() -> None:
        if proc.poll() is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    cleanup(stop)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_two_processes_pull_and_push(
    transport: TcpTransport, child: tuple[subprocess.Popen[str], int], cleanup: Cleanup
) -> None:
    _, port = child
    channel = transport.connect(HOST, port, CLIENT_HELLO, MemoryHandler(), WAIT)
    cleanup(lambda: channel.close(notify_peer=True, timeout=WAIT))
    assert channel.peer == SERVER_HELLO
    expected = random_bytes(MiB, 1234)
    src = [(5, 70_000), (600_000, 123_457), (80_000, 1)]
    total = sum(n for _, n in src)
    got = np.zeros(total, np.uint8)
    assert (
        channel.pull(request(src), rows(got, [(0, total)]), total, deadline()).result(WAIT) is None
    )
    np.testing.assert_array_equal(got, gather(expected, src))
    data = random_bytes(total, 77)
    assert (
        channel.push(request(src), rows(data, [(0, total)]), total, deadline()).result(WAIT) is None
    )
    back = np.zeros(total, np.uint8)
    assert (
        channel.pull(request(src), rows(back, [(0, total)]), total, deadline()).result(WAIT) is None
    )
    np.testing.assert_array_equal(back, data)


def test_killed_peer_fails_pending_requests(
    transport: TcpTransport, child: tuple[subprocess.Popen[str], int], cleanup: Cleanup
) -> None:
    proc, port = child
    channel = transport.connect(HOST, port, CLIENT_HELLO, MemoryHandler(), WAIT)
    cleanup(lambda: channel.close(notify_peer=False))
    closed = CloseLog()
    channel.on_close(closed)
    buf = np.zeros(100, np.uint8)
    held = channel.pull(request([(0, 100)], HOLD), rows(buf, [(0, 100)]), 100, deadline(60))
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    start = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(WAIT)
    expect_error(held, LLMStatusCode.LLM_LINK_FAILED)
    assert time.monotonic() - start < 5.0
    assert closed.event.wait(WAIT)


# -- codecs and the deadline reaper ------------------------------------------------------------


@pytest.mark.parametrize("to", [None, 0, 2**64 - 1])
@pytest.mark.parametrize("extensions", [b"", b"\x00\xffanything", bytes(1000)])
def test_hello_body_round_trip(to: int | None, extensions: bytes) -> None:
    hello = HelloBody(2**64 - 1, 3, to, extensions)
    assert decode_hello(encode_hello(hello)) == hello


@pytest.mark.parametrize(
    "body",
    [
        b"",
        encode_hello(HelloBody(1, 1))[:-1],
        encode_hello(HelloBody(1, 1)) + b"x",
        BodyWriter().u64(1).u32(1).u8(2).u64(0).blob(b"").__bytes__(),
        bytes(MAX_HELLO_BODY + 1),
    ],
    ids=["empty", "truncated", "trailing", "has_to", "oversized"],
)
def test_bad_hello_bodies_raise_wire_error(body: bytes) -> None:
    with pytest.raises(WireError):
        decode_hello(body)
    with pytest.raises(WireError):
        encode_hello(HelloBody(1, 1, None, bytes(MAX_HELLO_BODY)))


def test_error_text_is_bounded_and_never_fails() -> None:
    long = "é" * MAX_ERROR_TEXT
    data = encode_error_text(long)
    assert len(data) <= MAX_ERROR_TEXT
    assert decode_error_text(data) == "é" * (len(data) // 2)
    assert decode_error_text(b"\xff\xfeok") == "\ufffd\ufffdok"


def test_reaper_runs_due_callbacks_in_order_and_skips_cancelled() -> None:
    reaper = Reaper("test-reaper")
    fired: list[int] = []
    done = threading.Event()
    base = now_ns() + 50_000_000
    timers = {
        i: reaper.schedule(base + i * 1_000_000, lambda i=i: fired.append(i)) for i in (3, 1, 2)
    }
    timers[2].cancel()
    # Many cancelled entries make the heap compact itself; the live ones still run.
    for _ in range(3000):
        reaper.schedule(base + 10**12, lambda: None).cancel()
    reaper.schedule(base + 5_000_000, done.set)
    assert done.wait(WAIT)
    assert fired == [1, 3]
    assert len(reaper) < 3000


async def test_a_payload_arriving_in_pieces_never_holds_the_loop(
    raw_server: RawServer, cleanup: Cleanup
) -> None:
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=0)
    n = 48 * KiB
    payload = random_bytes(n, 7)
    buf = np.zeros(n, np.uint8)
    future = channel.pull(request([(0, n)]), rows(buf, [(0, n)]), n, deadline())
    header, _ = await asyncio.to_thread(read_frame, conn)
    conn.sendall(frame(FrameKind.PULL_DATA, header.request_id, payload_len=n))
    for k in range(0, n, 16 * KiB):  # three pieces; this coroutine runs between them
        assert not future.done()  # the rest has not been sent: the loop never waited on it
        conn.sendall(payload[k : k + 16 * KiB].tobytes())
        await asyncio.sleep(0.02)
    await asyncio.wait_for(asyncio.wrap_future(future), WAIT)
    np.testing.assert_array_equal(buf, payload)
    await assert_in_step(channel, conn, 2)


def test_a_committing_pull_confirms_before_it_completes(
    raw_server: RawServer, cleanup: Cleanup
) -> None:
    # The caller's next request must follow PULL_DONE on the link, so that the peer drops
    # the pulled key before it sees that request: PULL_DONE is out when the pull completes.
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=0)
    buf = np.zeros(KiB, np.uint8)
    future = channel.pull(request([(0, KiB)]), rows(buf, [(0, KiB)]), KiB, deadline(), commit=True)
    seen: list[bytes] = []
    looked = threading.Event()

    def on_done(_: Future[None]) -> None:  # what the peer can read at that moment
        try:
            seen.append(conn.recv(HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            seen.append(b"")
        looked.set()

    header, _ = read_frame(conn)
    assert header.kind is FrameKind.PULL
    future.add_done_callback(on_done)
    conn.sendall(frame(FrameKind.PULL_DATA, header.request_id, payload_len=KiB) + bytes(KiB))
    assert future.result(WAIT) is None
    assert looked.wait(WAIT)  # (the callback runs in the completing thread)
    assert len(seen) == 1 and len(seen[0]) == HEADER.size
    done = decode_header(seen[0])
    assert (done.kind, done.request_id) == (FrameKind.PULL_DONE, header.request_id)


@pytest.mark.parametrize("part", ["header", "error-body"])
async def test_the_start_of_a_frame_waits_for_its_rest(
    raw_server: RawServer, cleanup: Cleanup, part: str
) -> None:
    # The start of an answer sits on the socket: the pump waits for the rest (a header
    # too short to tell its kind, or an ERROR whose body has not all arrived) and takes the
    # frame once it is whole, the stream still in step.
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=0)
    n = KiB
    buf = np.zeros(n, np.uint8)
    future = channel.pull(request([(0, n)]), rows(buf, [(0, n)]), n, deadline())
    header, _ = await asyncio.to_thread(read_frame, conn)
    rid = header.request_id
    if part == "header":
        whole = frame(FrameKind.PULL_DATA, rid, payload_len=n) + b"\x05" * n
        cut = 5
    else:  # a refusal whose body has not all arrived
        text = b"no such cache " * 20
        whole = frame(FrameKind.ERROR, rid, text, status=int(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST))
        cut = len(whole) - 10
    conn.sendall(whole[:cut])
    await asyncio.sleep(0.1)  # the peer dawdles (well within the stall timeout)
    assert not future.done()
    conn.sendall(whole[cut:])
    if part == "header":
        await asyncio.wait_for(asyncio.wrap_future(future), WAIT)
        assert (buf == 5).all()
    else:
        with pytest.raises(LLMException) as info:
            await asyncio.wait_for(asyncio.wrap_future(future), WAIT)
        assert info.value.status_code is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
    await assert_in_step(channel, conn, 6)


def test_unanswered_requests_time_out_at_their_own_deadlines(
    raw_server: RawServer, cleanup: Cleanup
) -> None:
    channel, _conn = eager_raw_link(raw_server, cleanup, busy_poll_us=0)
    n = KiB
    bufs = [np.zeros(n, np.uint8) for _ in range(3)]
    late = channel.pull(request([(0, n)]), rows(bufs[0], [(0, n)]), n, after_s(30.0))
    started = time.monotonic()
    # Registered after a later one, due first: the link's one timer comes forward for it.
    soon = channel.pull(request([(0, n)]), rows(bufs[1], [(0, n)]), n, after_s(0.2))
    sooner = channel.pull(request([(0, n)]), rows(bufs[2], [(0, n)]), n, after_s(0.1))
    for future in (sooner, soon):
        with pytest.raises(LLMException) as info:
            future.result(WAIT)
        assert info.value.status_code is LLMStatusCode.LLM_TIMEOUT
    assert time.monotonic() - started < 2.0
    assert not late.done() and not channel.closed


def test_answered_requests_leave_no_deadlines_behind(
    raw_server: RawServer, cleanup: Cleanup
) -> None:
    # 5,000 requests with a long deadline, answered one by one: the link keeps the
    # deadlines of about the requests still pending, not of every request it ever sent.
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=0)
    buf = np.zeros(64, np.uint8)
    for _ in range(5000):
        future = channel.pull(request([(0, 64)]), rows(buf, [(0, 64)]), 64, after_s(600.0))
        header, _ = read_frame(conn)
        conn.sendall(frame(FrameKind.PULL_DATA, header.request_id, payload_len=64) + bytes(64))
        future.result(WAIT)
    assert len(channel._pending._deadlines) <= 1100


@pytest.mark.parametrize("split", [0, 4, 16], ids=["whole", "kind-unknown", "in-two"])
async def test_a_peer_frame_is_served_at_once(
    raw_server: RawServer, cleanup: Cleanup, split: int
) -> None:
    # The peer's own frame (here a PING) may come in two pieces; the reader serves it as
    # soon as it is whole, whatever it saw of it first.
    channel, conn = eager_raw_link(raw_server, cleanup, busy_poll_us=0)
    ping = frame(FrameKind.PING, 77)
    if split:
        conn.sendall(ping[:split])
        await asyncio.sleep(0.05)
        conn.sendall(ping[split:])
    else:
        conn.sendall(ping)
    started = time.monotonic()
    header, _ = await asyncio.to_thread(read_frame, conn)
    assert header.kind is FrameKind.PONG and header.request_id == 77
    assert time.monotonic() - started < 1.0  # not at the stall timeout (2 s here)
    assert not channel.closed
    await assert_in_step(channel, conn, 7)
