"""Backpressure: a peer that pipelines requests and reads the answers slowly, or not at all,
holds a bounded share of the serving side's memory.

Over its limits (``ServeLimits``: bytes held by queued frames, the peer's requests not yet
fully answered) a link's reader leaves the peer's next request on the socket until the
sender drained to half of them; answers to this side's own requests are still read, other
links are not concerned, and every request is answered once the peer reads again. The
process tests run the engine of the bounds tests in a process of its own
(``tests/peer_serving.py``) and measure its resident memory while a raw peer floods it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aio_datadist._transport import tcp
from aio_datadist._transport._wire import HEADER, PULL_NBYTES, FrameKind, decode_header
from aio_datadist._transport.base import Channel, ServeLimits
from aio_datadist._transport.deadlines import after_s
from aio_datadist._transport.loopback import LoopbackTransport
from aio_datadist._transport.tcp import TcpChannel
from aio_datadist._transport.tcp_connect import TcpTransport
from tests.conftest import Cleanup
from tests.test_transport_tcp import (
    CLIENT_HELLO,
    HOLD,
    HOST,
    FakeAcceptor,
    MemoryHandler,
    frame,
    hello_frame,
    recv_exact,
    request,
    rows,
)
from tests.wirefuzz import (
    BLOCK_BYTES,
    BLOCKS,
    TENSORS,
    Flood,
    RawPeer,
    ServingProcess,
    blocks_access,
    blocks_bytes,
    pull_frame,
    settle,
)

KiB, MiB = 1 << 10, 1 << 20
WAIT = 10.0

# -- the serving process under a flood ---------------------------------------------------------

#: The serving process's limits.
QUEUED, REQUESTS = 16 * MiB, 256
#: What one queued answer costs the server besides its row table (its Python objects), at most.
ANSWER_OVERHEAD = 4 * KiB
#: What the allocator keeps after frees, the request being read and decoded, and noise.
SLACK = 48 * MiB
#: How long the flooding peer reads nothing: well within the server's stall timeout (30 s),
#: after which a link whose peer takes no byte breaks.
ATTACK_S = 5.0


def rss_bound(table_bytes: int) -> int:
    """The most the server may grow while one peer floods it with pulls whose answers hold
    ``table_bytes`` of row table each: what the limits let queue (twice: the allocator keeps
    what it freed), one request past them, and slack."""
    return 2 * QUEUED + REQUESTS * ANSWER_OVERHEAD + 2 * table_bytes + SLACK


@pytest.fixture
def server() -> Iterator[ServingProcess]:
    server = ServingProcess(QUEUED, REQUESTS)
    try:
        yield server
    finally:
        server.close()


def attack(server: ServingProcess, flood: Flood, good: RawPeer) -> int:
    """While ``flood`` runs unread for :data:`ATTACK_S`, the ``good`` peer pulls and checks
    its bytes; the server's largest growth in resident memory meanwhile."""
    good_blocks = np.array([1, 6, 3])
    good_access, expected = (
        blocks_access(good_blocks, BLOCK_BYTES),
        blocks_bytes(good_blocks, BLOCK_BYTES),
    )
    base = server.rss()
    peak = base
    end = time.monotonic() + ATTACK_S
    pulls = 0
    while time.monotonic() < end:
        start = time.monotonic()
        answer = good.pull(good_access, len(expected))
        assert answer is not None and answer.kind is FrameKind.PULL_DATA, answer
        assert answer.data == expected
        assert time.monotonic() - start < 2.0, "the other link waited on the flood"
        pulls += 1
        peak = max(peak, server.rss())
        time.sleep(0.05)
    assert pulls >= 10
    assert flood.error is None, flood.error
    return peak - base


def drained(server: ServingProcess, cluster_id: int) -> dict[str, Any]:
    """The link's stats once it holds nothing of the peer's work."""
    last: dict[str, Any] = {}

    def idle() -> bool:
        last.update(server.stats(cluster_id))
        return last["requests"] == 0 and last["queued_bytes"] == 0 and not last["paused"]

    assert settle(idle), last
    return last


def test_a_peer_flooding_small_pulls_holds_bounded_memory(server: ServingProcess) -> None:
    """Small pulls pipelined without reading: the server's memory stays within the limits,
    another link transfers meanwhile, and every pull is answered once the peer reads."""
    blocks = np.array([2, 7, 5])
    access, expected = blocks_access(blocks, BLOCK_BYTES), blocks_bytes(blocks, BLOCK_BYTES)
    with RawPeer(server.port, buffers=64 * KiB) as hostile, RawPeer(server.port) as good:
        hostile.sock.settimeout(60.0)
        flood = Flood(hostile, lambda rid: pull_frame(rid, access, len(expected)), batch=1000)
        growth = attack(server, flood, good)
        print(f"small pulls: RSS growth {growth / MiB:.1f} MiB, {flood.sent} pulls sent")
        assert growth < rss_bound(TENSORS * len(blocks) * 16), f"grew {growth / MiB:.0f} MiB"
        during = server.stats(hostile.cluster_id)
        if not during["paused"]:
            server.dump_threads()  # (why it never paused shows in the captured stderr)
        assert during["paused"] and during["pauses"] >= 1, (during, flood.sent)
        assert 0 < during["requests_max"] <= REQUESTS, during
        assert server.stats(good.cluster_id)["pauses"] == 0
        answered = flood.read_all(expected)
        assert answered == flood.sent > REQUESTS
        after = drained(server, hostile.cluster_id)
        assert after["paused_s"] > 0 and after["requests_max"] <= REQUESTS, after


def test_a_peer_asking_for_millions_of_rows_holds_bounded_memory(server: ServingProcess) -> None:
    """Pulls of two million one-byte rows each (a 32 MB row table per answer), pipelined
    without reading: the server holds what its limits allow and one request past them."""
    n = 1_000_000
    blocks = np.arange(n) % BLOCKS
    access, expected = blocks_access(blocks, 1), blocks_bytes(blocks, 1)
    table = TENSORS * n * 16
    with RawPeer(server.port, buffers=64 * KiB) as hostile, RawPeer(server.port) as good:
        hostile.sock.settimeout(60.0)
        flood = Flood(hostile, lambda rid: pull_frame(rid, access, len(expected)), 1, count=15)
        growth = attack(server, flood, good)
        print(f"millions of rows: RSS growth {growth / MiB:.1f} MiB, {flood.sent} pulls sent")
        assert growth < rss_bound(table), f"grew {growth / MiB:.0f} MiB"
        during = server.stats(hostile.cluster_id)
        assert during["paused"], during
        assert during["queued_bytes_max"] < QUEUED + table + KiB, during
        assert flood.read_all(expected) == 15
        drained(server, hostile.cluster_id)


# -- one channel, in this process ----------------------------------------------------------------

PIECE = 256 * KiB  # an answer several of which fill the small socket buffers below


class CountingHandler(MemoryHandler):
    """A :class:`MemoryHandler` that counts the requests it served."""

    def __init__(self) -> None:
        super().__init__(seed=11)
        self.served = 0

    def serve(self, *args: Any, **kwargs: Any) -> Any:
        served = super().serve(*args, **kwargs)
        self.served += 1
        return served


class Peer:
    """A raw client of a channel whose serve limits a test sets, with small socket buffers on
    both ends, so that answers queue after a few."""

    def __init__(
        self,
        cleanup: Cleanup,
        monkeypatch: pytest.MonkeyPatch,
        requests: int = 1 << 20,
        queued_bytes: int = 1 << 40,
    ) -> None:
        limits = ServeLimits(queued_bytes=queued_bytes, requests=requests)
        monkeypatch.setattr(tcp, "SERVE_LIMITS", limits)
        self.handler = CountingHandler()
        acceptor = FakeAcceptor(handler=self.handler)
        transport = TcpTransport(handshake_timeout=2.0, stall_timeout=WAIT, sndbuf=64 * KiB)
        listener = transport.listen(HOST, 0, acceptor)
        cleanup(listener.close)
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * KiB)
        conn.settimeout(WAIT)
        conn.connect((HOST, listener.address[1]))
        cleanup(conn.close)
        conn.sendall(hello_frame(CLIENT_HELLO))
        header = decode_header(recv_exact(conn, HEADER.size))
        assert header.kind is FrameKind.HELLO_ACK
        recv_exact(conn, header.body_len)
        self.conn = conn
        channel = acceptor.wait_accepted()[0][1]
        assert isinstance(channel, TcpChannel)
        cleanup(lambda: channel.close(notify_peer=False))
        self.channel = channel

    def pull_frame(self, rid: int, rows: int = 1) -> bytes:
        """A pull of the first :data:`PIECE` bytes of the handler's memory, in ``rows`` rows."""
        step = PIECE // rows
        body = request([(i * step, step) for i in range(rows)])
        return frame(FrameKind.PULL, rid, PULL_NBYTES.pack(PIECE) + body)

    def read_answers(self, first: int, count: int) -> None:
        """Read ``count`` answers, the first to request ``first``, each exact."""
        expected = self.handler.mem[:PIECE].tobytes()
        for rid in range(first, first + count):
            header = decode_header(recv_exact(self.conn, HEADER.size))
            assert (header.kind, header.request_id) == (FrameKind.PULL_DATA, rid), header
            assert recv_exact(self.conn, header.payload_len) == expected

    def paused(self) -> bool:
        return settle(lambda: self.channel.stats().paused, WAIT)

    def fill(self, requests: int) -> int:
        """Send pulls one at a time, each read by the channel before the next goes, until the
        channel holds ``requests`` of them; how many were sent."""
        sent = 0
        while self.channel.stats().requests < requests:
            sent += 1
            assert sent < 100, self.channel.stats()
            self.conn.sendall(self.pull_frame(sent))
            assert settle(lambda n=sent: self.handler.served == n)
        return sent

    def reader_cpu_s(self) -> float:
        """CPU seconds the channel's reader thread used so far."""
        reader = self.channel._reader
        assert reader is not None and reader.native_id is not None
        fields = Path(f"/proc/self/task/{reader.native_id}/stat").read_text().rsplit(")", 1)[1]
        utime, stime = (int(x) for x in fields.split()[11:13])
        return (utime + stime) / os.sysconf("SC_CLK_TCK")


def test_reading_pauses_over_the_limit_and_resumes_as_the_sender_drains(
    cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer = Peer(cleanup, monkeypatch, requests=4)
    peer.conn.sendall(b"".join(peer.pull_frame(rid) for rid in range(1, 65)))
    assert peer.paused()
    stats = peer.channel.stats()
    assert stats.requests == stats.requests_max == 4 and stats.pauses == 1, stats
    # Each queued answer holds its header and its row table (the frame's row and the
    # payload's); the payload is read from memory as it goes and counts nothing.
    assert stats.queued_bytes == 4 * (HEADER.size + 2 * 16), stats
    served, cpu = peer.handler.served, peer.reader_cpu_s()
    time.sleep(0.5)
    assert peer.handler.served == served < 64  # nothing more is read while paused
    assert peer.reader_cpu_s() - cpu < 0.1  # and the reader sleeps
    peer.read_answers(1, 64)
    assert settle(lambda: peer.channel.stats().requests == 0)
    stats = peer.channel.stats()
    assert not stats.paused and stats.queued_bytes == 0 and stats.requests_max == 4, stats
    assert stats.pauses >= 1 and stats.paused_s > 0.2, stats


def test_queued_bytes_count_the_row_tables_answers_hold(
    cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    nrows = 4096  # a queued answer holds its header and 4097 rows: 65,592 bytes
    held = HEADER.size + (nrows + 1) * 16
    peer = Peer(cleanup, monkeypatch, queued_bytes=100_000)
    peer.conn.sendall(b"".join(peer.pull_frame(rid, nrows) for rid in range(1, 41)))
    assert peer.paused()
    stats = peer.channel.stats()
    assert (stats.queued_bytes, stats.requests) == (2 * held, 2), stats
    peer.read_answers(1, 40)
    assert settle(lambda: peer.channel.stats().queued_bytes == 0)
    assert peer.channel.stats().queued_bytes_max == 2 * held


def take_request(conn: socket.socket) -> int:
    """Read the channel's next frame, a request; its id."""
    header = decode_header(recv_exact(conn, HEADER.size))
    assert header.kind is FrameKind.PULL, header
    recv_exact(conn, header.body_len)
    return header.request_id


def test_limits_count_twice_while_this_side_awaits_answers(
    cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answers this side awaits may wait behind the peer's requests: two ends that each
    waited for the other to read would stall, so the limits count twice meanwhile."""
    peer = Peer(cleanup, monkeypatch, requests=2)
    back = np.zeros(64, np.uint8)
    future = peer.channel.pull(request([(0, 64)]), rows(back, [(0, 64)]), 64, after_s(WAIT))
    rid = take_request(peer.conn)
    peer.conn.sendall(b"".join(peer.pull_frame(r) for r in range(1, 41)))
    assert peer.paused()
    assert peer.channel.stats().requests == 4
    peer.read_answers(1, 40)
    data = np.arange(64, dtype=np.uint8)
    peer.conn.sendall(frame(FrameKind.PULL_DATA, rid, payload_len=64) + data.tobytes())
    assert future.result(WAIT) is None and back.tobytes() == data.tobytes()


def test_a_reader_over_the_limit_still_reads_the_answers_it_awaits(
    cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    peer = Peer(cleanup, monkeypatch, requests=2)
    back = np.zeros(64, np.uint8)
    future = peer.channel.pull(request([(0, 64)]), rows(back, [(0, 64)]), 64, after_s(WAIT))
    rid = take_request(peer.conn)
    sent = peer.fill(4)  # the limit, counted twice while the channel awaits its answer
    # Over the limit now; the answer comes first, then another request.
    data = np.arange(64, dtype=np.uint8)
    answer = frame(FrameKind.PULL_DATA, rid, payload_len=64) + data.tobytes()
    peer.conn.sendall(answer + peer.pull_frame(sent + 1))
    assert future.result(WAIT) is None and back.tobytes() == data.tobytes()
    assert peer.paused()  # at the request after it
    assert peer.handler.served == sent
    peer.read_answers(1, sent + 1)


def test_a_request_whose_header_comes_in_pieces_waits_too(
    cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over the limit, the first bytes of a header are taken (too few to tell its kind) and
    the reader waits for the rest without spinning; then the request waits its turn."""
    peer = Peer(cleanup, monkeypatch, requests=2)
    sent = peer.fill(2)
    request_frame = peer.pull_frame(sent + 1)
    peer.conn.sendall(request_frame[:3])
    time.sleep(0.05)
    cpu = peer.reader_cpu_s()
    time.sleep(0.5)
    assert peer.reader_cpu_s() - cpu < 0.1
    assert not peer.channel.stats().paused and peer.handler.served == sent
    peer.conn.sendall(request_frame[3:])
    assert peer.paused()
    assert peer.handler.served == sent
    peer.read_answers(1, sent + 1)


@pytest.mark.parametrize("notify_peer", [False, True])
def test_closing_a_paused_link_never_waits_for_the_peer(
    cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch, notify_peer: bool
) -> None:
    peer = Peer(cleanup, monkeypatch, requests=2)
    peer.conn.sendall(b"".join(peer.pull_frame(rid) for rid in range(1, 41)))
    assert peer.paused()
    start = time.monotonic()
    told = peer.channel.close(notify_peer=notify_peer, timeout=1.0)
    assert time.monotonic() - start < 3.0
    assert peer.channel.closed and told is not notify_peer
    # (A BYE waits behind the answer the sender is stuck in mid-frame, for the whole
    # timeout: the threads then end just after close returns.)
    for thread in (peer.channel._reader, peer.channel._sender):
        assert thread is not None
        thread.join(2.0)
        assert not thread.is_alive()
    assert peer.channel.stats().queued_bytes == 0


def test_loopback_counts_the_requests_it_serves(cleanup: Cleanup) -> None:
    """The loopback transport serves each request in the requester's thread: nothing
    queues, reading never pauses, and its stats count the requests being served."""
    transport = LoopbackTransport()
    acceptor = FakeAcceptor()
    listener = transport.listen("loop", 7, acceptor)
    cleanup(listener.close)
    client = transport.connect("loop", 7, CLIENT_HELLO, MemoryHandler(), WAIT)
    cleanup(lambda: client.close(notify_peer=False))
    server: Channel = acceptor.wait_accepted()[0][1]
    back = np.zeros(64, np.uint8)
    with ThreadPoolExecutor(1) as pool:
        pending: Future[Future[None]] = pool.submit(
            client.pull, request([(0, 64)], HOLD), rows(back, [(0, 64)]), 64, 0
        )
        assert acceptor.handler.entered.wait(WAIT)
        assert server.stats().requests == 1
        acceptor.handler.hold.set()
        assert pending.result(WAIT).result(WAIT) is None
    stats = server.stats()
    assert (stats.requests, stats.requests_max, stats.pauses, stats.paused) == (0, 1, 0, False)
    assert client.stats().requests_max == 0
