"""Same-host identity is proven by the kernel, never taken from a peer's claim.

A hostile peer on this host sends what the handshake used to trust (a process id and the
number of a descriptor it holds): naming a FIFO no longer blocks the listener, and naming
another engine's process no longer sends this side's bytes there. The proof itself (token,
connection, ``SO_PEERCRED``) refuses a wrong token, another connection's token and a
second use of one; honest engines get the one-sided route on both ends.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    LLMClusterInfo,
    LLMException,
    LLMRole,
    LLMStatusCode,
)
from aio_datadist._engine.regions import RegionBoard
from aio_datadist._transport._wire import FrameKind, HelloBody, encode_hello
from aio_datadist._transport.samehost import (
    HostPresence,
    SameHostProof,
    local_host_key,
    prove,
    verifier,
)
from tests.conftest import make_options, pool_cfg
from tests.peer_prompt import TENSORS, pattern
from tests.providers import peer_memory
from tests.test_cross_process import Peer, blocks_desc
from tests.test_transport_tcp import frame, read_frame

WAIT = 10.0
HOST_KEY = local_host_key()
pytestmark = pytest.mark.skipif(HOST_KEY is None, reason="Linux does not say which host this is")


def retired_presence(pid: int, fd: int) -> bytes:
    """The presence record the handshake used to trust: ``pid`` and a descriptor number."""
    assert HOST_KEY is not None
    body = struct.pack("<16sQII", HOST_KEY[0], HOST_KEY[1], pid, fd)
    return struct.pack("<HH", 1, len(body)) + body


def raw_hello(port: int, cluster_id: int, to_cluster_id: int, extensions: bytes) -> socket.socket:
    """A hand-made client: connects and sends HELLO (a decoder of ``cluster_id``)."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    body = encode_hello(HelloBody(cluster_id, int(LLMRole.DECODER), to_cluster_id, extensions))
    conn.sendall(frame(FrameKind.HELLO, body=body))
    return conn


async def engine(role: LLMRole, cluster_id: int, port: int | None = None) -> AsyncLLMDataDist:
    dd = AsyncLLMDataDist(role, cluster_id)
    await dd.init(
        make_options(
            device_pool=pool_cfg(),
            remote_accessible=True,
            transport="tcp",
            listen=None if port is None else f"127.0.0.1:{port}",
            sync_kv_timeout=1000,
            same_host=True,
        )
    )
    return dd


def bound_port(dd: AsyncLLMDataDist) -> int:
    """The port ``dd`` listens on (it was given port 0: the system picked one free)."""
    address = dd.listen_address
    assert address is not None
    return address[1]


@pytest.fixture
async def engines() -> AsyncIterator[list[AsyncLLMDataDist]]:
    made: list[AsyncLLMDataDist] = []
    yield made
    for dd in made:
        await dd.finalize()


def cluster(cluster_id: int, port: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    return info


def board_fd_of(pid: int) -> int:
    """The descriptor number of ``pid``'s region board (as a hostile peer would find it)."""
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if "aio-datadist-regions" in os.readlink(entry):
                return int(entry.name)
        except OSError:
            continue
    raise AssertionError(f"process {pid} has no region board")


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[int]:
    """The read end of a FIFO that nobody writes (opening it to read would block)."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    yield fd
    # Release a listener of the old kind stuck opening it, then close.
    writer = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    os.close(writer)
    os.close(fd)


async def test_a_peer_naming_a_fifo_is_answered_and_nothing_is_opened(
    engines: list[AsyncLLMDataDist], fifo: int
) -> None:
    engines.append(await engine(LLMRole.PROMPT, 1, 0))
    port = bound_port(engines[-1])
    conn = raw_hello(port, 3, 1, retired_presence(os.getpid(), fifo))
    try:
        header, _ = await asyncio.to_thread(read_frame, conn)
        assert header.kind is FrameKind.HELLO_ACK
    finally:
        conn.close()


async def test_a_claim_of_another_process_moves_no_byte_into_it(
    engines: list[AsyncLLMDataDist],
) -> None:
    third = Peer(4, 4096)  # an engine process that never links with the hostile peer
    try:
        server = await engine(LLMRole.DECODER, 2, 0)
        engines.append(server)
        port = bound_port(server)
        conn = raw_hello(port, 3, 2, retired_presence(third.proc.pid, board_fd_of(third.proc.pid)))
        try:
            header, _ = await asyncio.to_thread(read_frame, conn)
            assert header.kind is FrameKind.HELLO_ACK
            cm = server.cache_manager
            cache = await cm.allocate_blocks_cache(blocks_desc(4, 4096))
            for view in cache.as_numpy():
                view[...] = 0xAB
            # The hostile peer never answers: the push fails; it must not land anywhere.
            with pytest.raises(LLMException) as info:
                await cm.push_blocks(BlocksCacheKey(3, 0), cache, [0, 1], [0, 1])
            assert info.value.status_code in (
                LLMStatusCode.LLM_TIMEOUT,
                LLMStatusCode.LLM_LINK_FAILED,
            )
        finally:
            conn.close()
        # The third process's cache holds what it always held.
        status, _ = await server.link_clusters([cluster(1, third.port)], 5000)
        assert status == LLMStatusCode.LLM_SUCCESS
        await cm.pull_blocks(BlocksCacheKey(1, 0), cache, [0, 1], [0, 1])
        for t, view in enumerate(cache.as_numpy()):
            np.testing.assert_array_equal(view[[0, 1]], pattern(t, 4, 4096)[[0, 1]])
        assert len(cache.as_numpy()) == TENSORS
        await cm.deallocate_blocks_cache(cache)
    finally:
        third.close()


async def test_linked_engines_on_this_host_prove_each_other_both_ways(
    engines: list[AsyncLLMDataDist],
) -> None:
    prompt = await engine(LLMRole.PROMPT, 1, 0)
    engines.append(prompt)
    port = bound_port(prompt)
    decoder = await engine(LLMRole.DECODER, 2)
    engines.append(decoder)
    status, _ = await decoder.link_clusters([cluster(1, port)], 5000)
    assert status == LLMStatusCode.LLM_SUCCESS
    client = peer_memory(decoder._engine, 1)
    assert client is not None and client.pid == os.getpid()
    deadline = time.monotonic() + WAIT  # the server side learns it once the client proved
    server = peer_memory(prompt._engine, 2)
    while server is None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        server = peer_memory(prompt._engine, 2)
    assert server is not None and server.pid == os.getpid()


# -- the proof itself ----------------------------------------------------------------------------
class Connection:
    """A loopback TCP connection: the server's and the client's socket."""

    def __init__(self) -> None:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            self.client = socket.create_connection(listener.getsockname())
            self.server, _ = listener.accept()

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def board() -> Iterator[RegionBoard]:
    made = RegionBoard()
    yield made
    made.close()


def offer(verifier_id: bytes, token: bytes) -> HostPresence:
    assert HOST_KEY is not None
    return HostPresence(HOST_KEY[0], HOST_KEY[1], verifier_id, token)


def test_the_right_client_is_proven_and_gets_the_board(board: RegionBoard) -> None:
    found = verifier()
    assert not isinstance(found, str)
    link = Connection()
    try:
        proof = SameHostProof()
        seen: list[Any] = []
        proof.then(seen.append)
        token = found.expect(link.server, board.fd, proof)
        peer = prove(link.client, offer(found.id, token), board.fd, WAIT)
        assert not isinstance(peer, str), peer
        assert peer.pid == os.getpid()  # from the kernel, not from any message
        assert os.fstat(peer.board_fd).st_ino == os.fstat(board.fd).st_ino
        os.close(peer.board_fd)
        assert seen and seen[0].pid == os.getpid()
        # a token is good once
        again = prove(link.client, offer(found.id, token), board.fd, WAIT)
        assert again == "the peer's verifier refused"
        proof.close()
    finally:
        link.close()


@pytest.mark.parametrize("wrong", ["token", "connection", "verifier"])
def test_a_wrong_claim_is_refused(board: RegionBoard, wrong: str) -> None:
    found = verifier()
    assert not isinstance(found, str)
    link, other = Connection(), Connection()
    try:
        proof = SameHostProof()
        token = found.expect(link.server, board.fd, proof)
        claimant = other.client if wrong == "connection" else link.client
        presence = offer(
            os.urandom(16) if wrong == "verifier" else found.id,
            os.urandom(16) if wrong == "token" else token,
        )
        answer = prove(claimant, presence, board.fd, 2.0)
        assert isinstance(answer, str)
        assert proof.peer is None  # nobody was taken for the link's peer
        # the right client still proves itself afterwards (a wrong connection's claim did
        # not use the token up)
        if wrong != "token":
            peer = prove(link.client, offer(found.id, token), board.fd, WAIT)
            assert not isinstance(peer, str) and peer.pid == os.getpid()
            os.close(peer.board_fd)
        proof.close()
    finally:
        link.close()
        other.close()
