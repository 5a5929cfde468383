"""A listener's resources under connections that never finish their handshake.

Idle connections cost no thread (one selector thread waits for every handshake's bytes),
their number is capped, the listener survives errors in its own thread, and a process out
of threads still links an honest peer: checked against a real prompt process whose thread
budget is limited (``RLIMIT_NPROC``), and against listeners in this process.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator

import numpy as np
import pytest

from aio_datadist import AsyncLLMDataDist, BlocksCacheKey, LLMRole, LLMStatusCode
from aio_datadist._transport.base import LinkRefused
from aio_datadist._transport.handshakes import Handshakes
from aio_datadist._transport.tcp import TcpChannel
from aio_datadist._transport.tcp_connect import TcpListener, TcpTransport
from tests.conftest import Cleanup, make_options, pool_cfg
from tests.peer_prompt import pattern
from tests.test_cross_process import Peer, blocks_desc
from tests.test_transport_tcp import CLIENT_HELLO, FakeAcceptor

WAIT = 10.0


def threads_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@contextlib.contextmanager
def idle_connections(port: int, n: int) -> Iterator[list[socket.socket]]:
    """``n`` connections to ``port`` that never send a byte."""
    conns: list[socket.socket] = []
    try:
        for _ in range(n):
            conns.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT))
        yield conns
    finally:
        for conn in conns:
            conn.close()


def closed_by_server(conn: socket.socket, timeout: float) -> bool:
    conn.settimeout(timeout)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.mark.skipif(not hasattr(os, "setuid"), reason="needs RLIMIT_NPROC")
async def test_idle_connections_cost_no_thread_and_an_honest_peer_still_links() -> None:
    # The prompt process may start 7 more threads: the handshake workers and one link's
    # reader and sender. 60 idle connections would need 60 with a thread per handshake.
    peer = Peer(8, 4096, env={"AIO_TEST_THREAD_BUDGET": "7"})
    dd = AsyncLLMDataDist(LLMRole.DECODER, 2)
    try:
        before = threads_of(peer.proc.pid)
        with idle_connections(peer.port, 60):
            time.sleep(0.3)
            assert threads_of(peer.proc.pid) <= before + 4
            await dd.init(
                make_options(device_pool=pool_cfg(), transport="tcp", sync_kv_timeout=5000)
            )
            status, statuses = await dd.link_clusters([peer.info()], 5000)
            assert (status, statuses) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
            cache = await dd.cache_manager.allocate_blocks_cache(blocks_desc(8, 4096))
            await dd.cache_manager.pull_blocks(BlocksCacheKey(1, 0), cache, [7, 0], [0, 1])
            for t, view in enumerate(cache.as_numpy()):
                np.testing.assert_array_equal(view[[0, 1]], pattern(t, 8, 4096)[[7, 0]])
            await dd.cache_manager.deallocate_blocks_cache(cache)
        assert peer.proc.poll() is None
    finally:
        await dd.finalize()
        peer.close()


def test_pending_handshakes_are_capped(cleanup: Cleanup) -> None:
    transport = TcpTransport(handshake_timeout=WAIT, max_pending_handshakes=8)
    acceptor = FakeAcceptor()
    listener = transport.listen("127.0.0.1", 0, acceptor)
    cleanup(listener.close)
    assert isinstance(listener, TcpListener)
    port = listener.address[1]
    with idle_connections(port, 20) as conns:
        deadline = time.monotonic() + WAIT
        while listener.pending_handshakes < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert listener.pending_handshakes <= 8
        # the oldest still waiting were dropped to make room, 8 still wait
        closed = [closed_by_server(c, 0.2) for c in conns]
        assert closed.count(True) == 12
        assert not any(closed[-4:])
        # an honest client still links: the oldest idle one makes room for it
        channel = transport.connect("127.0.0.1", port, CLIENT_HELLO, acceptor.handler, WAIT)
        cleanup(lambda: channel.close(notify_peer=False))
        assert isinstance(channel, TcpChannel)
    assert len(acceptor.accepted) == 1


def test_the_listener_survives_an_error_in_its_own_thread(
    cleanup: Cleanup, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    transport = TcpTransport(handshake_timeout=WAIT)
    acceptor = FakeAcceptor()
    failures = [MemoryError("no memory for this one")]
    admit = Handshakes._admit

    def failing_admit(self: Handshakes, conn: socket.socket, *args: object) -> None:
        if failures:
            conn.close()
            raise failures.pop()
        admit(self, conn, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Handshakes, "_admit", failing_admit)
    listener = transport.listen("127.0.0.1", 0, acceptor)
    cleanup(listener.close)
    port = listener.address[1]
    with socket.create_connection(("127.0.0.1", port)) as first:
        assert closed_by_server(first, WAIT)
    channel = transport.connect("127.0.0.1", port, CLIENT_HELLO, acceptor.handler, WAIT)
    cleanup(lambda: channel.close(notify_peer=False))
    assert not failures
    assert "tcp.handshakes_failed" in caplog.text
    assert len(acceptor.accepted) == 1


def test_a_refused_client_is_answered_while_idle_ones_wait(cleanup: Cleanup) -> None:
    transport = TcpTransport(handshake_timeout=WAIT)
    acceptor = FakeAcceptor(refuse=LinkRefused(LLMStatusCode.LLM_ALREADY_LINK, "taken"))
    listener = transport.listen("127.0.0.1", 0, acceptor)
    cleanup(listener.close)
    port = listener.address[1]
    with idle_connections(port, 30):
        start = time.monotonic()
        with pytest.raises(LinkRefused) as info:
            transport.connect("127.0.0.1", port, CLIENT_HELLO, acceptor.handler, WAIT)
        assert time.monotonic() - start < WAIT / 2
        assert info.value.status == LLMStatusCode.LLM_ALREADY_LINK
