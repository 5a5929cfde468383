"""Tests of the native request server (``_native.serve``) on socketpair(): the pulls and
pushes it answers move byte for byte what the Python serving path moves, and everything else
stays on the socket."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._engine.access import Access, Target, access_rows, encode_access
from aio_datadist._native.api import PeerClosed, monotonic_ns
from aio_datadist._native.serve import ROWS_MAX, ServeTable
from aio_datadist._transport._wire import HEADER, FrameKind, decode_header, pack_header
from aio_datadist.status import LLMException, ParamInvalidError

BLOCK = 4096
BLOCKS = 16
TENSORS = 3
IDENT = 7
MAX = 1 << 40


@pytest.fixture
def memory() -> npt.NDArray[np.uint8]:
    """TENSORS tensors of BLOCKS blocks, every byte telling where it is."""
    rng = np.random.default_rng(5)
    return rng.integers(0, 256, (TENSORS, BLOCKS * BLOCK), dtype=np.uint8)


def tensor_addrs(memory: npt.NDArray[np.uint8]) -> list[int]:
    return [int(memory[t].ctypes.data) for t in range(TENSORS)]


@pytest.fixture
def table(memory: npt.NDArray[np.uint8]) -> ServeTable:
    table = ServeTable()
    assert table.set([(IDENT, tensor_addrs(memory), BLOCK, BLOCKS)])
    return table


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(5)
    yield a, b
    a.close()
    b.close()


def blocks_access(blocks: list[int], *, start: int = 0, count: int = 1, **fields: int) -> Access:
    return Access(
        Target.BLOCKS_KEY,
        ident=fields.pop("ident", IDENT),
        tensor_start=start,
        tensor_count=count,
        seg_bytes=fields.pop("seg", BLOCK),
        tail_bytes=fields.pop("tail", 0),
        blocks=np.asarray(blocks, dtype=np.uint64),
        **fields,  # type: ignore[arg-type]
    )


def pull_frame(access: Access, rid: int, nbytes: int | None = None, **header: int) -> bytes:
    body = struct.pack("<Q", access.nbytes if nbytes is None else nbytes) + encode_access(access)
    return pack_header(FrameKind.PULL, rid, body_len=len(body), **header) + body


def push_frame(access: Access, rid: int, payload: bytes, **header: int) -> bytes:
    body = encode_access(access)
    head = pack_header(FrameKind.PUSH, rid, body_len=len(body), payload_len=len(payload), **header)
    return head + body + payload


def python_rows(memory: npt.NDArray[np.uint8], access: Access) -> list[tuple[int, int]]:
    """The (offset into ``memory``, length) rows the Python serving path moves."""
    rows = access_rows(tensor_addrs(memory), BLOCK, BLOCKS, access, 0)
    base = int(memory.ctypes.data)
    return [(int(a) - base, int(n)) for a, n in rows.tolist()]


def expected(memory: npt.NDArray[np.uint8], access: Access) -> bytes:
    """The payload the Python serving path sends for ``access``."""
    flat = memory.reshape(-1)
    return b"".join(flat[o : o + n].tobytes() for o, n in python_rows(memory, access))


def pushed(memory: npt.NDArray[np.uint8], access: Access, payload: bytes) -> npt.NDArray[np.uint8]:
    """``memory`` as the Python serving path leaves it after pushing ``payload``."""
    want = memory.copy().reshape(-1)
    at = 0
    for o, n in python_rows(memory, access):
        want[o : o + n] = np.frombuffer(payload[at : at + n], dtype=np.uint8)
        at += n
    return want.reshape(memory.shape)


def read_ack(sock: socket.socket) -> int:
    h = decode_header(recv_exact(sock, HEADER.size))
    assert h.kind is FrameKind.PUSH_ACK and (h.status, h.body_len, h.payload_len) == (0, 0, 0)
    return h.request_id


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "peer closed early"
        out += chunk
    return bytes(out)


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
    h = decode_header(recv_exact(sock, HEADER.size))
    assert h.kind is FrameKind.PULL_DATA and h.status == 0 and h.body_len == 0
    return h.request_id, recv_exact(sock, h.payload_len)


def waiting(sock: socket.socket) -> bytes:
    try:
        return sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


# -- the table ----------------------------------------------------------------------------


def test_the_table_lists_and_replaces_caches(memory: npt.NDArray[np.uint8]) -> None:
    table = ServeTable()
    assert table.stats().caches == 0
    assert table.set([(1, tensor_addrs(memory), BLOCK, BLOCKS), (2, [1 << 20], 64, 2)])
    assert table.stats().caches == 2
    assert table.set([])
    assert table.stats() == table.stats().__class__(0, 0, 0, 0)


@pytest.mark.parametrize(
    "cache",
    [
        (1, [], BLOCK, BLOCKS),  # no tensors
        (1, [0], BLOCK, BLOCKS),  # a null address
        (1, [4096], 0, BLOCKS),  # empty blocks
        (1, [4096], BLOCK, 0),  # no blocks
        (1, [(1 << 64) - 4096], BLOCK, 2),  # wraps around the address space
    ],
)
def test_the_table_refuses_impossible_caches(table: ServeTable, cache: tuple) -> None:
    with pytest.raises(ParamInvalidError):
        table.set([cache])
    assert table.stats().caches == 1  # unchanged


def test_the_table_checks_types(table: ServeTable) -> None:
    with pytest.raises(TypeError):
        table.set([("7", [4096], BLOCK, BLOCKS)])  # type: ignore[list-item]
    with pytest.raises(ParamInvalidError):
        table.set([(-1, [4096], BLOCK, BLOCKS)])


# -- serving ------------------------------------------------------------------------------


def test_a_pull_is_answered_with_the_bytes_python_would_send(
    table: ServeTable, memory: npt.NDArray[np.uint8], pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    access = blocks_access([3, 0, 15], start=1, count=2, tail=100)
    a.sendall(pull_frame(access, 41))
    result = table.worker().serve(b.fileno(), MAX)
    assert (result.served, result.pending, result.partial) == (1, False, None)
    assert read_answer(a) == (41, expected(memory, access))
    assert waiting(b) == b""
    assert table.stats().served == 1


def test_a_run_of_pulls_is_answered_in_one_call_up_to_the_first_other_frame(
    table: ServeTable, memory: npt.NDArray[np.uint8], pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    accesses = [blocks_access([i, 15 - i]) for i in range(5)]
    ping = pack_header(FrameKind.PING, 99)
    a.sendall(b"".join(pull_frame(x, 10 + i) for i, x in enumerate(accesses)) + ping)
    result = table.worker().serve(b.fileno(), MAX)
    assert (result.served, result.pending) == (5, True)
    for i, access in enumerate(accesses):
        assert read_answer(a) == (10 + i, expected(memory, access))
    assert waiting(b) == ping  # left whole for the general reader


def refused_cases() -> list[tuple[str, bytes]]:
    ok = blocks_access([1, 2])
    return [
        ("unknown cache", pull_frame(replace(ok, ident=IDENT + 1), 1)),
        ("block out of range", pull_frame(blocks_access([BLOCKS]), 1)),
        ("tensors out of range", pull_frame(blocks_access([0], start=2, count=2), 1)),
        ("no tensors", pull_frame(blocks_access([0], count=0), 1, nbytes=BLOCK)),
        ("segment over a block", pull_frame(blocks_access([0], seg=BLOCK + 1), 1)),
        ("tail over a block", pull_frame(blocks_access([0, 1], tail=BLOCK + 1), 1)),
        ("empty segment", pull_frame(blocks_access([0], seg=0), 1, nbytes=BLOCK)),
        ("size mismatch", pull_frame(ok, 1, nbytes=ok.nbytes + 1)),
        ("drop flag", pull_frame(replace(ok, drop_key=True), 1)),
        ("by cache index", pull_frame(replace(ok, target=Target.CACHE_INDEX), 1)),
        ("no blocks", pull_frame(blocks_access([]), 1, nbytes=BLOCK)),
        ("a status", pull_frame(ok, 1, status=3)),
        ("a payload", pull_frame(ok, 1, payload_len=8)),
        ("another version", pull_frame(ok, 1, version=2)),
        ("not a pull", pack_header(FrameKind.PUSH_ACK, 1)),
        ("a header only", pull_frame(ok, 1)[: HEADER.size + 3]),
        ("garbage", b"\x00" * 64),
    ]


@pytest.mark.parametrize(("why", "frame"), refused_cases(), ids=[c[0] for c in refused_cases()])
def test_anything_else_is_left_on_the_socket(
    table: ServeTable, pair: tuple[socket.socket, socket.socket], why: str, frame: bytes
) -> None:
    a, b = pair
    a.sendall(frame)
    result = table.worker().serve(b.fileno(), MAX)
    assert (result.served, result.pending, result.partial) == (0, True, None), why
    assert waiting(b) == frame
    assert table.stats().pinned == 0


def test_requests_over_the_size_limit_or_row_limit_are_left(
    table: ServeTable, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    frame = pull_frame(blocks_access([0, 1]), 1)
    a.sendall(frame)
    assert table.worker().serve(b.fileno(), 2 * BLOCK - 1).pending
    assert waiting(b) == frame
    recv_exact(b, len(frame))
    push = push_frame(blocks_access([0, 1]), 1, b"\x01" * 2 * BLOCK)
    a.sendall(push)
    assert table.worker().serve(b.fileno(), 2 * BLOCK - 1).pending
    assert waiting(b) == push
    recv_exact(b, len(push))
    many = pull_frame(blocks_access(list(range(BLOCKS)) * 22, count=3), 2)  # 1056 rows
    assert ROWS_MAX < 3 * 16 * 22
    a.sendall(many)
    assert table.worker().serve(b.fileno(), MAX).pending
    assert waiting(b) == many


def test_nothing_waiting_returns_at_once(
    table: ServeTable, pair: tuple[socket.socket, socket.socket]
) -> None:
    _, b = pair
    result = table.worker().serve(b.fileno(), MAX)
    assert (result.served, result.pending, result.partial) == (0, False, None)


def test_a_closed_peer_is_left_to_the_general_reader(
    table: ServeTable, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    a.close()
    assert table.worker().serve(b.fileno(), MAX).pending  # EOF: the reader reports it


def test_a_peer_gone_after_its_request_fails_the_answer(table: ServeTable) -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(pull_frame(blocks_access([1]), 5))
        a.close()
        with pytest.raises(PeerClosed):
            table.worker().serve(b.fileno(), MAX)
        assert table.stats().pinned == 0
    finally:
        b.close()


def test_bad_arguments(table: ServeTable) -> None:
    worker = table.worker()
    with pytest.raises(LLMException):
        worker.serve(-1, MAX)
    with pytest.raises(TypeError):
        worker.serve(3, "big")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        worker.serve(3, MAX, spin_ns=0.5)  # type: ignore[arg-type]
    for spin_ns in (-1, 1 << 63):
        with pytest.raises(ParamInvalidError):
            worker.serve(3, MAX, spin_ns=spin_ns)


# -- partial answers and pins ---------------------------------------------------------------


def test_a_partial_answer_pins_its_cache_until_released(
    memory: npt.NDArray[np.uint8], pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    big = np.random.default_rng(1).integers(0, 256, (2, 64 * 65536), dtype=np.uint8)
    table = ServeTable()
    addrs = [int(big[0].ctypes.data), int(big[1].ctypes.data)]
    assert table.set([(IDENT, addrs, 65536, 64)])
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    access = Access(
        Target.BLOCKS_KEY,
        ident=IDENT,
        tensor_count=2,
        seg_bytes=65536,
        blocks=np.arange(64, dtype=np.uint64),
    )
    a.sendall(pull_frame(access, 77))
    result = table.worker().serve(b.fileno(), MAX)
    partial = result.partial
    assert partial is not None and result.served == 0
    assert partial.request_id == 77 and partial.nbytes == access.nbytes
    assert 0 <= partial.sent < HEADER.size + access.nbytes
    want = b"".join(big[t].tobytes() for t in range(2))
    got = b"".join(
        big.reshape(-1)[int(x) - int(big.ctypes.data) :][: int(n)].tobytes()
        for x, n in partial.rows.tolist()
    )
    assert got == want  # the rows name the answer's payload, in order
    assert table.stats().pinned == 1
    # a cache that left the list is waited out while the answer is in flight
    assert not table.set([], monotonic_ns() + 50_000_000)
    assert table.stats().pinned == 1
    partial.release()
    assert table.stats().pinned == 0
    assert table.set([])


def test_set_keeps_pins_of_caches_that_stay(
    memory: npt.NDArray[np.uint8], pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    big = np.zeros((1, 64 * 65536), dtype=np.uint8)
    table = ServeTable()
    entry = (IDENT, [int(big[0].ctypes.data)], 65536, 64)
    assert table.set([entry])
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    a.sendall(pull_frame(blocks_access(list(range(64)), seg=65536), 3))
    partial = table.worker().serve(b.fileno(), MAX).partial
    assert partial is not None
    other = (IDENT + 1, tensor_addrs(memory), BLOCK, BLOCKS)
    assert table.set([entry, other], monotonic_ns() + 50_000_000)  # no wait: it stays
    assert table.stats().pinned == 1
    partial.release()
    assert table.stats().pinned == 0


# -- pushes -------------------------------------------------------------------------------


def test_a_push_lands_where_python_would_put_it_and_is_acknowledged(
    table: ServeTable, memory: npt.NDArray[np.uint8], pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    access = blocks_access([5, 2, 9], start=0, count=3, tail=77)
    payload = np.random.default_rng(3).integers(0, 256, access.nbytes, np.uint8).tobytes()
    want = pushed(memory, access, payload)
    ping = pack_header(FrameKind.PING, 8)
    a.sendall(push_frame(access, 31, payload) + push_frame(access, 32, payload) + ping)
    result = table.worker().serve(b.fileno(), MAX)
    assert (result.served, result.pending, result.partial) == (2, True, None)
    assert (read_ack(a), read_ack(a)) == (31, 32)
    np.testing.assert_array_equal(memory, want)
    assert waiting(b) == ping
    assert table.stats().pinned == 0


def test_a_push_still_arriving_is_left_untouched(
    table: ServeTable, memory: npt.NDArray[np.uint8], pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    before = memory.copy()
    access = blocks_access([1, 2])
    frame = push_frame(access, 4, b"\x01" * access.nbytes)
    a.sendall(frame[:-1])
    result = table.worker().serve(b.fileno(), MAX)
    assert (result.served, result.pending) == (0, True)
    np.testing.assert_array_equal(memory, before)
    assert waiting(b) == frame[:-1]


def test_the_rest_of_a_push_in_flight_is_busy_polled_for(
    table: ServeTable, memory: npt.NDArray[np.uint8], pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    access = blocks_access([4, 5])
    payload = b"\x03" * access.nbytes
    frame = push_frame(access, 6, payload)
    a.sendall(frame[:-100])
    threading.Timer(0.005, a.sendall, (frame[-100:],)).start()
    result = table.worker().serve(b.fileno(), MAX, spin_ns=2_000_000_000)
    assert (result.served, result.pending) == (1, False)
    assert read_ack(a) == 6
    np.testing.assert_array_equal(memory, pushed(memory, access, payload))


def refused_pushes() -> list[tuple[str, bytes]]:
    ok = blocks_access([1, 2])
    data = b"\x01" * ok.nbytes
    return [
        ("unknown cache", push_frame(replace(ok, ident=IDENT + 1), 1, data)),
        ("block out of range", push_frame(blocks_access([BLOCKS]), 1, b"\x01" * BLOCK)),
        ("size mismatch", push_frame(ok, 1, data + b"\x01")),
        ("drop flag", push_frame(replace(ok, drop_key=True), 1, data)),
        ("no payload", push_frame(ok, 1, b"")),
        ("a status", push_frame(ok, 1, data, status=2)),
    ]


@pytest.mark.parametrize(("why", "frame"), refused_pushes(), ids=[c[0] for c in refused_pushes()])
def test_pushes_it_cannot_serve_are_left_and_write_nothing(
    table: ServeTable,
    memory: npt.NDArray[np.uint8],
    pair: tuple[socket.socket, socket.socket],
    why: str,
    frame: bytes,
) -> None:
    a, b = pair
    before = memory.copy()
    a.sendall(frame)
    result = table.worker().serve(b.fileno(), 1 << 20)
    assert (result.served, result.pending, result.partial) == (0, True, None), why
    np.testing.assert_array_equal(memory, before)
    assert waiting(b) == frame


def test_an_acknowledgement_without_room_goes_to_the_caller(
    table: ServeTable, memory: npt.NDArray[np.uint8], pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    b.setblocking(False)
    with pytest.raises(BlockingIOError):  # fill b's way to a: nothing more fits
        while True:
            b.send(b"\x00" * 65536)
    access = blocks_access([3])
    payload = b"\x07" * access.nbytes
    a.sendall(push_frame(access, 12, payload))
    result = table.worker().serve(b.fileno(), MAX)
    partial = result.partial
    assert partial is not None and result.served == 0
    assert (partial.request_id, partial.kind, partial.nbytes) == (12, FrameKind.PUSH_ACK, 0)
    assert partial.sent == 0 and partial.rows.shape == (0, 2)
    assert table.stats().pinned == 0  # the bytes are in place: nothing pins the cache
    np.testing.assert_array_equal(memory, pushed(memory, access, payload))
    partial.release()


# -- equivalence with the Python path, over inputs from the wire ------------------------------


def access_fields(max_blocks: int) -> dict[str, st.SearchStrategy[Any]]:
    """Access fields around every bound of the test cache, and a byte-count skew."""
    return {
        "start": st.integers(0, TENSORS),
        "count": st.integers(0, TENSORS + 1),
        "blocks": st.lists(st.integers(0, BLOCKS + 1), min_size=0, max_size=max_blocks),
        "seg": st.integers(0, BLOCK + 2),
        "tail": st.integers(0, BLOCK + 2),
        "skew": st.sampled_from([0, 0, 0, 1, -1]),
    }


@settings(max_examples=300, deadline=None)
@given(**access_fields(max_blocks=40))
def test_native_answers_match_python_serving(
    start: int, count: int, blocks: list[int], seg: int, tail: int, skew: int
) -> None:
    memory = np.random.default_rng(9).integers(0, 256, (TENSORS, BLOCKS * BLOCK), np.uint8)
    table = ServeTable()
    assert table.set([(IDENT, tensor_addrs(memory), BLOCK, BLOCKS)])
    access = blocks_access(blocks, start=start, count=count, seg=seg, tail=tail)
    nbytes = access.nbytes + skew
    # What the Python path serves (ServeTable refusals and ineligible requests go there).
    try:
        if nbytes != access.nbytes or not blocks:
            raise ParamInvalidError("size or shape")
        payload = expected(memory, access)
    except LLMException:
        payload = None
    a, b = socket.socketpair()
    try:
        frame = pull_frame(access, 9, nbytes=max(nbytes, 0))
        a.sendall(frame)
        result = table.worker().serve(b.fileno(), MAX)
        if payload is None or nbytes <= 0:
            assert (result.served, result.pending) == (0, True)
            assert waiting(b) == frame
        else:
            assert result.served == 1
            a.settimeout(5)
            assert read_answer(a) == (9, payload)
    finally:
        a.close()
        b.close()


# At most 8 blocks: the whole push frame must fit in the socket pair's buffer (about
# 200 KiB), or sendall below would wait for a reader that only comes after it.
@settings(max_examples=200, deadline=None)
@given(**access_fields(max_blocks=8))
def test_native_pushes_match_python_serving(
    start: int, count: int, blocks: list[int], seg: int, tail: int, skew: int
) -> None:
    memory = np.zeros((TENSORS, BLOCKS * BLOCK), np.uint8)
    table = ServeTable()
    assert table.set([(IDENT, tensor_addrs(memory), BLOCK, BLOCKS)])
    access = blocks_access(blocks, start=start, count=count, seg=seg, tail=tail)
    size = max(access.nbytes + skew, 0)
    payload = np.random.default_rng(size).integers(1, 256, size, np.uint8).tobytes()
    try:
        if size != access.nbytes or not blocks or not size:
            raise ParamInvalidError("size or shape")
        want = pushed(memory, access, payload)
    except LLMException:
        want = None
    a, b = socket.socketpair()
    try:
        frame = push_frame(access, 9, payload)
        a.sendall(frame)
        result = table.worker().serve(b.fileno(), MAX)
        if want is None:
            assert (result.served, result.pending) == (0, True)
            assert not memory.any()
        else:
            assert result.served == 1
            a.settimeout(5)
            assert read_ack(a) == 9
            np.testing.assert_array_equal(memory, want)
    finally:
        a.close()
        b.close()
