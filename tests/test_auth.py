"""Link authentication: the shared secret, its proofs, and the handshakes that use them.

Transport tests drive the TCP handshake with real transports and with raw sockets speaking
the wire format by hand (stalling, replaying, reflecting, recording every byte); engine
tests run both faces over TCP and loopback; one test links to a second process whose
secret comes from the environment.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMException,
    LLMRole,
    Placement,
)
from aio_datadist import LLMStatusCode as S
from aio_datadist._routes.samehost import provider as samehost_provider
from aio_datadist._transport._wire import (
    FrameKind,
    HelloExtension,
    WireError,
    decode_extension_records,
    decode_hello,
)
from aio_datadist._transport.auth import (
    NONCE_BYTES,
    PROOF_BYTES,
    SECRET_ENV,
    LinkSecret,
    Side,
    Transcript,
    decode_secret_option,
    encode_secret_option,
    refusal_reason,
)
from aio_datadist._transport.base import LinkRefused
from aio_datadist._transport.handshake import hello_from_wire, hello_to_wire
from aio_datadist._transport.samehost import decode_extensions
from aio_datadist._transport.tcp_connect import TcpTransport
from tests.conftest import Cleanup, Face, make_options, pool_cfg
from tests.peer_prompt import TENSORS, pattern
from tests.test_cross_process import Peer
from tests.test_transport_tcp import (
    CLIENT_HELLO,
    HOST,
    SERVER_HELLO,
    WAIT,
    FakeAcceptor,
    MemoryHandler,
    RawServer,
    frame,
    gather,
    read_frame,
    read_until_eof,
    request,
    rows,
)

SECRET = "correct horse battery staple"
OTHER = "a different secret"


@pytest.fixture(autouse=True)
def _no_secret_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)


def tcp(secret: str | None, handshake_timeout: float = 2.0) -> TcpTransport:
    return TcpTransport(
        handshake_timeout=handshake_timeout,
        stall_timeout=2.0,
        secret=None if secret is None else LinkSecret(secret),
    )


def auth_failed(exc: BaseException) -> bool:
    return "authentication failed" in str(exc)


def log_lines(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(event)]


# -- the secret and its proofs -------------------------------------------------------------------


def test_proofs_are_bound_to_side_transcript_and_secret() -> None:
    secret = LinkSecret(SECRET)
    transcript = Transcript(b"hello", b"c" * NONCE_BYTES, b"s" * NONCE_BYTES)
    proof = secret.prove(Side.CLIENT, transcript)
    assert len(proof) == PROOF_BYTES
    assert secret.verify(Side.CLIENT, transcript, proof)
    assert LinkSecret(SECRET.encode()).verify(Side.CLIENT, transcript, proof)  # str is UTF-8
    # reflected: a client proof is no server proof, and the other way round
    assert not secret.verify(Side.SERVER, transcript, proof)
    assert not secret.verify(Side.CLIENT, transcript, secret.prove(Side.SERVER, transcript))
    # replayed: another server nonce, another hello or a server body needs another proof
    for other in (
        Transcript(b"hello", b"c" * NONCE_BYTES, b"t" * NONCE_BYTES),
        Transcript(b"hellO", b"c" * NONCE_BYTES, b"s" * NONCE_BYTES),
        Transcript(b"hello", b"c" * NONCE_BYTES, b"s" * NONCE_BYTES, b"ack"),
    ):
        assert not secret.verify(Side.CLIENT, other, proof)
    # the length prefixes keep parts from sliding into each other
    shifted = Transcript(b"hell", b"o" + b"c" * (NONCE_BYTES - 1), b"s" * NONCE_BYTES)
    assert secret.prove(Side.CLIENT, shifted) != proof
    assert not LinkSecret(OTHER).verify(Side.CLIENT, transcript, proof)
    assert SECRET not in repr(secret) and repr(secret) == "LinkSecret(<hidden>)"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (None, TypeError),
        (7, TypeError),
        (bytearray(b"x"), TypeError),
        ("", ValueError),
        (b"", ValueError),
    ],
)
def test_secret_type_and_emptiness_are_checked(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        LinkSecret(value)


@pytest.mark.parametrize("value", ["plain", "hex:looks like hex", b"\x00\xffraw", "ünïcode"])
def test_option_spelling_round_trips(value: str | bytes) -> None:
    text = encode_secret_option(value)
    key = value.encode() if isinstance(value, str) else value
    transcript = Transcript(b"h", b"n", b"m")
    proof = LinkSecret(key).prove(Side.CLIENT, transcript)
    assert decode_secret_option(text).verify(Side.CLIENT, transcript, proof)


@pytest.mark.parametrize("text", ["", "hex:", "hex:zz", "hex:abc"])
def test_bad_option_spellings_raise_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        decode_secret_option(text)


def test_refusal_reason_names_the_missing_side() -> None:
    assert refusal_reason(client_secret=True, server_secret=True) is None
    assert refusal_reason(client_secret=False, server_secret=False) is None
    assert "client has none" in str(refusal_reason(client_secret=False, server_secret=True))
    assert "listener has none" in str(refusal_reason(client_secret=True, server_secret=False))


def test_hello_carries_the_nonce_beside_the_presence() -> None:
    nonce = bytes(range(NONCE_BYTES))
    assert hello_from_wire(hello_to_wire(CLIENT_HELLO, auth_nonce=nonce)) == (CLIENT_HELLO, nonce)
    assert hello_from_wire(hello_to_wire(CLIENT_HELLO)) == (CLIENT_HELLO, None)


# -- configuration -------------------------------------------------------------------------------


def test_config_link_secret_option() -> None:
    cfg = LLMConfig()
    assert cfg.link_secret is None
    cfg.link_secret = SECRET
    assert cfg.generate_options()["aio.LinkSecret"] == SECRET
    assert SECRET not in repr(cfg) and "link_secret=<hidden>" in repr(cfg)
    assert SECRET not in str(cfg)
    cfg.link_secret = b"\x01\x02"
    assert cfg.generate_options()["aio.LinkSecret"] == "hex:0102"
    cfg.link_secret = None
    assert cfg.link_secret is None and repr(cfg) == "LLMConfig()"
    for bad in (5, 1.5, ["x"], bytearray(b"x"), True):
        with pytest.raises(TypeError):
            cfg.link_secret = bad
    for empty in ("", b""):
        with pytest.raises(ValueError):
            cfg.link_secret = empty


@pytest.mark.parametrize("where", ["option", "environment"])
async def test_invalid_secret_fails_init(
    where: str, monkeypatch: pytest.MonkeyPatch, make_face: Callable[..., Face]
) -> None:
    options = make_options()
    if where == "option":
        options["aio.LinkSecret"] = "hex:not hex"
    else:
        monkeypatch.setenv(SECRET_ENV, "hex:")
    face = make_face()
    with pytest.raises(LLMException) as info:
        await face.init(options)
    assert info.value.status_code == S.LLM_PARAM_INVALID
    assert "not hex" not in str(info.value)


# -- TCP handshakes ------------------------------------------------------------------------------


def listen(transport: TcpTransport, cleanup: Cleanup, acceptor: FakeAcceptor | None = None) -> Any:
    acceptor = acceptor or FakeAcceptor(handler=MemoryHandler(seed=11))
    listener = transport.listen(HOST, 0, acceptor)
    cleanup(listener.close)
    return listener, acceptor


def connect(transport: TcpTransport, port: int, cleanup: Cleanup) -> Any:
    channel = transport.connect(HOST, port, CLIENT_HELLO, MemoryHandler(seed=22), WAIT)
    cleanup(lambda: channel.close(notify_peer=False))
    return channel


def test_matching_secrets_link_and_transfer(cleanup: Cleanup) -> None:
    listener, acceptor = listen(tcp(SECRET), cleanup)
    client = connect(tcp(SECRET), listener.address[1], cleanup)
    server = acceptor.wait_accepted()[0][1]
    assert client.authenticated and server.authenticated
    assert client.peer == SERVER_HELLO and acceptor.accepted[0][0] == CLIENT_HELLO
    segments = [(100, 4096), (9000, 17)]
    dst = np.zeros(4113, np.uint8)
    client.pull(request(segments), rows(dst, [(0, 4113)]), 4113, 0).result(WAIT)
    np.testing.assert_array_equal(dst, gather(acceptor.handler.mem, segments))


def test_no_secrets_keep_the_two_frame_handshake(cleanup: Cleanup) -> None:
    listener, acceptor = listen(tcp(None), cleanup)
    conn = socket.create_connection((HOST, listener.address[1]), timeout=WAIT)
    cleanup(conn.close)
    conn.sendall(frame(FrameKind.HELLO, body=hello_to_wire(CLIENT_HELLO)))
    header, body = read_frame(conn)
    assert header.kind is FrameKind.HELLO_ACK and hello_from_wire(body)[1] is None
    _, server = acceptor.wait_accepted()[0]
    assert not server.authenticated


@pytest.mark.parametrize(
    ("client", "server"), [(SECRET, OTHER), (None, SECRET), (SECRET, None)], ids=str
)
def test_mismatch_refuses_and_the_listener_keeps_serving(
    client: str | None, server: str | None, cleanup: Cleanup, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="aio_datadist")
    listener, acceptor = listen(tcp(server), cleanup)
    with pytest.raises(LinkRefused) as info:
        tcp(client).connect(HOST, listener.address[1], CLIENT_HELLO, MemoryHandler(), WAIT)
    assert info.value.status == S.LLM_LINK_FAILED and auth_failed(info.value)
    for text in (SECRET, OTHER):
        assert text not in str(info.value) and text not in caplog.text
    assert not acceptor.accepted
    warnings = log_lines(caplog, "link.auth_failed")
    assert warnings and all(r.levelno == logging.WARNING for r in warnings)
    # the listener goes on accepting a client with the right secret
    good = connect(tcp(server), listener.address[1], cleanup)
    assert good.peer == SERVER_HELLO and good.authenticated == (server is not None)


class Recorder:
    """A TCP relay between a client and a listener that keeps every byte either way."""

    def __init__(self, target_port: int) -> None:
        self.sock = socket.create_server((HOST, 0))
        self.port = int(self.sock.getsockname()[1])
        self.target = target_port
        self.seen = bytearray()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                with self.lock:
                    self.seen += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        client, _ = self.sock.accept()
        server = socket.create_connection((HOST, self.target), timeout=WAIT)
        server.settimeout(None)
        self.conns = (client, server)
        back = threading.Thread(target=self._pump, args=(server, client), daemon=True)
        back.start()
        self._pump(client, server)
        back.join(WAIT)

    def close(self) -> None:
        self.sock.close()
        for conn in getattr(self, "conns", ()):
            conn.close()
        self.thread.join(WAIT)


@pytest.mark.parametrize("secret", [SECRET, "ünïcode sécret ✓ 0123456789"])
def test_the_secret_never_travels(secret: str, cleanup: Cleanup) -> None:
    listener, acceptor = listen(tcp(secret), cleanup)
    relay = Recorder(listener.address[1])
    cleanup(relay.close)
    client = connect(tcp(secret), relay.port, cleanup)
    assert client.authenticated
    server = acceptor.wait_accepted()[0][1]
    client.close(notify_peer=True, timeout=WAIT)  # the BYE exchange ends both pumps
    server.close(notify_peer=False)
    relay.thread.join(WAIT)
    seen = bytes(relay.seen)
    assert seen.count(b"AIDD") >= 6  # HELLO, AUTH, AUTH, HELLO_ACK, AUTH, BYE...
    key = secret.encode()
    assert key not in seen and key.hex().encode() not in seen


def stalled_client(port: int, *, answer_challenge: bool) -> socket.socket:
    """A client that stops after reading the challenge, or in the middle of its HELLO."""
    conn = socket.create_connection((HOST, port), timeout=WAIT)
    nonce = os.urandom(NONCE_BYTES)
    hello = frame(FrameKind.HELLO, body=hello_to_wire(CLIENT_HELLO, auth_nonce=nonce))
    if not answer_challenge:
        conn.sendall(hello[:-1])
        return conn
    conn.sendall(hello)
    header, body = read_frame(conn)
    assert header.kind is FrameKind.AUTH and len(body) == NONCE_BYTES
    return conn


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("answer_challenge", [True, False], ids=["after-challenge", "mid-hello"])
def test_a_client_that_never_proves_is_dropped(answer_challenge: bool, cleanup: Cleanup) -> None:
    transport = tcp(SECRET, handshake_timeout=0.5)
    listener, acceptor = listen(transport, cleanup)
    before = open_fds()
    start = time.monotonic()
    conn = stalled_client(listener.address[1], answer_challenge=answer_challenge)
    cleanup(conn.close)
    # meanwhile an honest client links
    assert connect(tcp(SECRET), listener.address[1], cleanup).authenticated
    assert read_until_eof(conn) == b""  # dropped, never answered
    assert time.monotonic() - start < 0.5 + 3.0
    assert len(acceptor.accepted) == 1
    conn.close()
    deadline = time.monotonic() + WAIT
    while listener.pending_handshakes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not listener.pending_handshakes
    # the honest link's two ends (each a socket and its pump's wake-up) are the only
    # descriptors left over
    assert open_fds() <= before + 4


def handshake_by_hand(
    port: int, secret: LinkSecret, *, proof_for: Callable[[Transcript], bytes] | None = None
) -> tuple[socket.socket, bytes, FrameKind, bytes]:
    """Run the client side by hand; returns the socket, the proof sent, and the answer."""
    conn = socket.create_connection((HOST, port), timeout=WAIT)
    nonce = os.urandom(NONCE_BYTES)
    hello = hello_to_wire(CLIENT_HELLO, auth_nonce=nonce)
    conn.sendall(frame(FrameKind.HELLO, body=hello))
    header, server_nonce = read_frame(conn)
    assert header.kind is FrameKind.AUTH
    transcript = Transcript(hello, nonce, server_nonce)
    proof = proof_for(transcript) if proof_for else secret.prove(Side.CLIENT, transcript)
    conn.sendall(frame(FrameKind.AUTH, body=proof))
    header, body = read_frame(conn)
    return conn, proof, header.kind, body


def test_a_replayed_client_proof_is_refused(cleanup: Cleanup) -> None:
    listener, acceptor = listen(tcp(SECRET), cleanup)
    secret = LinkSecret(SECRET)
    conn, recorded, kind, _ = handshake_by_hand(listener.address[1], secret)
    cleanup(conn.close)
    assert kind is FrameKind.HELLO_ACK
    # a second connection repeats the recorded proof: the listener's fresh nonce refuses it
    replay, _, kind, body = handshake_by_hand(
        listener.address[1], secret, proof_for=lambda _: recorded
    )
    cleanup(replay.close)
    assert kind is FrameKind.ERROR and auth_failed(body.decode())
    assert len(acceptor.accepted) == 1


def test_a_reflected_proof_is_refused(cleanup: Cleanup) -> None:
    """Proofs made for the other side, by either end, never pass."""
    listener, acceptor = listen(tcp(SECRET), cleanup)
    secret = LinkSecret(SECRET)
    conn, _, kind, body = handshake_by_hand(
        listener.address[1], secret, proof_for=lambda t: secret.prove(Side.SERVER, t)
    )
    cleanup(conn.close)
    assert kind is FrameKind.ERROR and auth_failed(body.decode())
    assert not acceptor.accepted
    # an impostor listener that sends the client's own proof back as its proof
    impostor = RawServer()
    cleanup(impostor.close)

    def reflect() -> None:
        conn, _ = impostor.sock.accept()
        cleanup(conn.close)
        conn.settimeout(WAIT)
        read_frame(conn)
        conn.sendall(frame(FrameKind.AUTH, body=os.urandom(NONCE_BYTES)))
        _, proof = read_frame(conn)
        ack = frame(FrameKind.HELLO_ACK, body=hello_to_wire(SERVER_HELLO))
        conn.sendall(ack + frame(FrameKind.AUTH, body=proof))
        header, text = read_frame(conn)
        assert header.kind is FrameKind.ERROR and auth_failed(text.decode())

    done = impostor.pool.submit(reflect)
    with pytest.raises(LinkRefused) as info:
        tcp(SECRET).connect(HOST, impostor.port, CLIENT_HELLO, MemoryHandler(), WAIT)
    assert info.value.status == S.LLM_LINK_FAILED and auth_failed(info.value)
    done.result(WAIT)


def test_a_listener_that_skips_authentication_is_refused() -> None:
    """An older listener ignores the nonce and acknowledges at once: the client refuses."""
    server = RawServer()
    try:
        pending = server.serve_hello()
        with pytest.raises(LinkRefused) as info:
            tcp(SECRET).connect(HOST, server.port, CLIENT_HELLO, MemoryHandler(), WAIT)
        assert info.value.status == S.LLM_LINK_FAILED and auth_failed(info.value)
        conn = pending.result(WAIT)
        header, _ = read_frame(conn)  # told why, then closed
        assert header.kind is FrameKind.ERROR
        conn.close()
    finally:
        server.close()


def test_listener_logs_unauthenticated_on_a_public_address(
    caplog: pytest.LogCaptureFixture, cleanup: Cleanup
) -> None:
    caplog.set_level(logging.INFO, logger="aio_datadist")
    for host, secret in (("127.0.0.1", None), ("0.0.0.0", SECRET)):
        listener = tcp(secret).listen(host, 0, FakeAcceptor())
        cleanup(listener.close)
    assert not log_lines(caplog, "link.unauthenticated")
    listener = tcp(None).listen("0.0.0.0", 0, FakeAcceptor())
    cleanup(listener.close)
    (record,) = log_lines(caplog, "link.unauthenticated")
    assert record.levelno == logging.WARNING and "0.0.0.0" in record.getMessage()


def test_the_nonce_is_an_extension_record_older_peers_skip() -> None:
    nonce = b"n" * NONCE_BYTES
    body = decode_hello(hello_to_wire(CLIENT_HELLO, auth_nonce=nonce))
    assert decode_extension_records(body.extensions) == {HelloExtension.AUTH_NONCE: nonce}
    assert decode_extensions(body.extensions) is None  # the same-host reader ignores it
    with pytest.raises(WireError):
        hello_from_wire(hello_to_wire(CLIENT_HELLO, auth_nonce=b"short"))


# -- engines over both transports ----------------------------------------------------------------

BLOCKS, BLOCK_BYTES = 8, 4096
_loopback_ports = itertools.count(47000)


def blocks_desc() -> CacheDesc:
    return CacheDesc(2, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.DEVICE)


def expected_blocks(t: int) -> np.ndarray:
    return np.arange(BLOCKS * BLOCK_BYTES, dtype=np.uint8).reshape(BLOCKS, -1) + t


def engine_options(transport: str, secret: str | None, listen: str | None = None) -> dict[str, str]:
    return make_options(
        device_pool=pool_cfg(),
        remote_accessible=True,
        transport=transport,
        listen=listen,
        link_secret=secret,
    )


class Engines:
    """An async prompt serving a known blocks cache, and decoders of the tested face."""

    def __init__(self, face_kind: str, transport: str) -> None:
        self.face_kind = face_kind
        self.transport = transport
        self.made: list[Face] = []
        self.info = LLMClusterInfo()

    async def prompt(self, secret: str | None) -> Face:
        port = 0 if self.transport == "tcp" else next(_loopback_ports)
        prompt = Face("async", LLMRole.PROMPT, 1)
        self.made.append(prompt)
        await prompt.init(engine_options(self.transport, secret, f"127.0.0.1:{port}"))
        address = prompt.dd._engine.link_table().listen_address
        self.info.remote_cluster_id = 1
        self.info.append_local_ip_info("127.0.0.1", 0)
        self.info.append_remote_ip_info("127.0.0.1", address[1])
        cache = await prompt.cm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
        for t, view in enumerate(cache.as_numpy()):
            view[...] = expected_blocks(t)
        return prompt

    async def decoder(self, cluster_id: int, secret: str | None) -> Face:
        """A decoder; finalize the previous one first (one blocking engine per process)."""
        face = Face(self.face_kind, LLMRole.DECODER, cluster_id)
        self.made.append(face)
        await face.init(engine_options(self.transport, secret))
        return face

    async def link(self, face: Face) -> S:
        ret, rets = await face.call(face.dd.link_clusters, [self.info], 5000)
        assert rets == [ret]
        return S(ret)

    async def close(self) -> None:
        for face in reversed(self.made):
            await face.finalize()


@pytest.fixture(params=["tcp", "loopback"])
async def engines(request: pytest.FixtureRequest, face_kind: str) -> AsyncIterator[Engines]:
    made = Engines(face_kind, str(request.param))
    yield made
    await made.close()


async def pull_check(decoder: Face) -> None:
    cache = await decoder.cm.allocate_blocks_cache(blocks_desc())
    try:
        await decoder.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [3, 5], [0, 1])
        for t, view in enumerate(cache.as_numpy()):
            np.testing.assert_array_equal(view[[0, 1]], expected_blocks(t)[[3, 5]])
    finally:
        await decoder.cm.deallocate_blocks_cache(cache)


def link_of(face: Face, cluster_id: int) -> Any:
    return face.dd._engine.links.get(cluster_id)


async def test_engines_with_one_secret_link_and_transfer(
    engines: Engines, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aio_datadist")
    prompt = await engines.prompt(SECRET)
    decoder = await engines.decoder(2, SECRET)
    assert await engines.link(decoder) == S.LLM_SUCCESS
    await pull_check(decoder)
    assert link_of(decoder, 1).channel.authenticated
    assert link_of(prompt, 2).channel.authenticated
    assert not log_lines(caplog, "link.unauthenticated")
    assert SECRET not in caplog.text


@pytest.mark.parametrize(
    ("client", "server"), [(SECRET, OTHER), (None, SECRET), (SECRET, None)], ids=str
)
async def test_engines_with_different_secrets_do_not_link(
    client: str | None,
    server: str | None,
    engines: Engines,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aio_datadist")
    opened: list[object] = []
    real_open = samehost_provider.open_peer_memory

    def spy(*args: Any) -> Any:
        opened.append(args)
        return real_open(*args)

    monkeypatch.setattr(samehost_provider, "open_peer_memory", spy)
    prompt = await engines.prompt(server)
    decoder = await engines.decoder(2, client)
    assert await engines.link(decoder) == S.LLM_LINK_FAILED
    assert not opened  # no peer's region board was opened on either side
    assert len(prompt.dd._engine.links) == 0 and len(decoder.dd._engine.links) == 0
    failures = log_lines(caplog, "link.failed")  # the client's side
    assert failures and all(auth_failed(r.getMessage()) for r in failures)
    assert log_lines(caplog, "link.auth_failed")  # the listener's side
    assert SECRET not in caplog.text and OTHER not in caplog.text
    with pytest.raises(LLMException) as info:
        await pull_check(decoder)
    assert info.value.status_code == S.LLM_NOT_YET_LINK
    await decoder.finalize()
    # the listener still links a decoder with its secret
    good = await engines.decoder(3, server)
    assert await engines.link(good) == S.LLM_SUCCESS
    await pull_check(good)


async def test_secret_from_the_environment_and_the_option_wins(
    engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    await engines.prompt(None)
    from_env = await engines.decoder(2, None)
    assert await engines.link(from_env) == S.LLM_SUCCESS
    assert link_of(from_env, 1).channel.authenticated
    await from_env.finalize()
    overridden = await engines.decoder(3, OTHER)
    assert await engines.link(overridden) == S.LLM_LINK_FAILED


async def test_unauthenticated_links_say_so(
    engines: Engines, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aio_datadist")
    await engines.prompt(None)
    decoder = await engines.decoder(2, None)
    assert await engines.link(decoder) == S.LLM_SUCCESS
    notes = [r.getMessage() for r in log_lines(caplog, "link.unauthenticated")]
    assert any("remote_cluster_id=1" in m for m in notes)  # the decoder's side
    assert any("remote_cluster_id=2" in m for m in notes)  # the prompt's side
    established = [r.getMessage() for r in log_lines(caplog, "link.established")]
    assert established and "authenticated=False" in established[0]


# -- a second process ----------------------------------------------------------------------------


@pytest.fixture
def secret_peer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Peer]:
    """The prompt process of ``test_cross_process``, its secret from the environment."""
    monkeypatch.setenv(SECRET_ENV, SECRET)
    peer = Peer(16, 64 * 1024)
    monkeypatch.delenv(SECRET_ENV)
    yield peer
    peer.close()


async def test_a_second_process_with_the_secret(
    secret_peer: Peer, make_face: Callable[..., Face]
) -> None:
    async def decoder(cluster_id: int, secret: str | None) -> Face:
        face = make_face(LLMRole.DECODER, cluster_id)
        options = make_options(device_pool=pool_cfg(), transport="tcp", remote_accessible=True)
        if secret is not None:
            options["aio.LinkSecret"] = secret
        await face.init(options)
        return face

    for wrong in (OTHER, None):
        face = await decoder(2, wrong)
        ret, _ = await face.call(face.dd.link_clusters, [secret_peer.info()], 5000)
        assert ret == S.LLM_LINK_FAILED
        await face.finalize()
    face = await decoder(3, SECRET)
    assert (await face.call(face.dd.link_clusters, [secret_peer.info()], 5000))[0] == (
        S.LLM_SUCCESS
    )
    assert face.dd._engine.links.get(1).channel.authenticated
    desc = CacheDesc(TENSORS, [16, 64 * 1024], DataType.DT_UINT8, Placement.DEVICE)
    cache = await face.cm.allocate_blocks_cache(desc)
    await face.cm.pull_blocks(BlocksCacheKey(1, 0), cache, [3, 15], [0, 1])
    for t, view in enumerate(cache.as_numpy()):
        np.testing.assert_array_equal(view[[0, 1]], pattern(t, 16, 64 * 1024)[[3, 15]])
    await face.cm.deallocate_blocks_cache(cache)
