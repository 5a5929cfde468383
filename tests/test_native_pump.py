"""Tests of the link's frame pump (``_native/pump.c``): the one reader of a socket, the
requests it completes in C, the frames it hands back, and the waiters it wakes."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._native import api
from aio_datadist._native.pump import BROKEN, LATE, OK, FramePump, Outcome, PumpEvent
from aio_datadist._transport._wire import FrameKind, decode_header
from aio_datadist.status import ParamInvalidError

U8 = npt.NDArray[np.uint8]
KiB = 1 << 10
SEC = 1_000_000_000
PULL_DATA, PUSH_ACK = int(FrameKind.PULL_DATA), int(FrameKind.PUSH_ACK)


def header(kind: int, rid: int, payload: int = 0, *, status: int = 0, body: int = 0) -> bytes:
    return struct.pack("<4sHHQqIIQ", b"AIDD", 1, kind, rid, status, body, 0, payload)


def rows_of(buf: U8, spans: list[tuple[int, int]]) -> npt.NDArray[np.uint64]:
    base = int(buf.ctypes.data)
    return np.array([(base + off, n) for off, n in spans], dtype=np.uint64).reshape(-1, 2)


def deadline(s: float = 10.0) -> int:
    return api.monotonic_ns() + int(s * SEC)


def entered_pull(pump: FramePump, rid: int, n: int, seed: int) -> tuple[U8, U8]:
    """A pull of ``n`` bytes entered in ``pump``: its rows, and the payload its answer brings."""
    dst = np.zeros(n, np.uint8)
    payload = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    assert pump.enter(rid, PULL_DATA, rows_of(dst, [(0, n)]), n, deadline())
    return dst, payload


@pytest.fixture
def link() -> Iterator[tuple[socket.socket, socket.socket, FramePump]]:
    """A TCP pair: the peer's end, this end, and this end's pump (stall time 1 s)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        peer = socket.create_connection(srv.getsockname())
        mine, _ = srv.accept()
    with peer, mine:
        pump = FramePump(mine.fileno(), 1.0)
        yield peer, mine, pump
        pump.close()


def run(pump: FramePump, idle_s: float = 5.0) -> tuple[PumpEvent, bytes]:
    return pump.run(0, False, int(idle_s * SEC))


def test_the_pump_completes_the_answers_its_table_holds(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    peer, _, pump = link
    dst = np.zeros(300, np.uint8)
    payload = np.random.default_rng(3).integers(0, 256, 200, dtype=np.uint8)
    assert pump.enter(5, PULL_DATA, rows_of(dst, [(200, 100), (0, 100)]), 200, deadline())
    assert pump.enter(9, PUSH_ACK, None, 0, deadline())
    peer.sendall(header(PULL_DATA, 5, 200) + payload.tobytes() + header(PUSH_ACK, 9))
    outcomes: list[Outcome] = []
    while len(outcomes) < 2:
        event, _ = run(pump)
        assert event is PumpEvent.DONE
        outcomes += pump.take_done()
    assert sorted(outcomes) == [Outcome(5, OK, 200), Outcome(9, OK, 0)]
    # The payload went over the rows in order.
    np.testing.assert_array_equal(dst[200:], payload[:100])
    np.testing.assert_array_equal(dst[:100], payload[100:])
    assert pump.forget(5)  # (gone: nothing holds it)


@pytest.mark.parametrize(
    "other",
    [
        header(PULL_DATA, 6, 200),  # another request's answer
        header(PUSH_ACK, 5),  # another kind
        header(PULL_DATA, 5, 199),  # another size
        header(PULL_DATA, 5, 200, status=3),  # a status
        header(int(FrameKind.ERROR), 5, body=4),  # a refusal
        b"AIDX" + header(PULL_DATA, 5, 200)[4:],  # not a frame of this wire
    ],
)
def test_anything_else_comes_back_with_its_rest_unread(
    link: tuple[socket.socket, socket.socket, FramePump], other: bytes
) -> None:
    peer, mine, pump = link
    dst = np.zeros(200, np.uint8)
    assert pump.enter(5, PULL_DATA, rows_of(dst, [(0, 200)]), 200, deadline())
    peer.sendall(other + b"rest")
    event, got = run(pump)
    assert event is PumpEvent.FRAME and got == other
    assert mine.recv(4) == b"rest"
    assert not dst.any()
    assert pump.forget(5)  # still waiting: Python ends it now


@pytest.mark.parametrize("kind", [FrameKind.PULL, FrameKind.PUSH, FrameKind.PING])
def test_the_peers_requests_are_left_on_the_socket(
    link: tuple[socket.socket, socket.socket, FramePump], kind: FrameKind
) -> None:
    peer, mine, pump = link
    frame = header(int(kind), 3)
    peer.sendall(frame)
    assert run(pump) == (PumpEvent.PEER, b"")
    assert mine.recv(64) == frame


def test_a_blocking_waiter_takes_its_own_outcome(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    peer, _, pump = link
    dst = np.zeros(KiB, np.uint8)
    assert pump.enter(1, PULL_DATA, rows_of(dst, [(0, KiB)]), KiB, deadline())
    assert pump.wait(1, 0, api.monotonic_ns() + SEC // 100) is True  # not yet
    got: list[Outcome | bool] = []
    waiter = threading.Thread(target=lambda: got.append(pump.wait(1, 10_000, deadline())))
    waiter.start()
    peer.sendall(header(PULL_DATA, 1, KiB) + b"\x07" * KiB)
    reader = threading.Thread(target=run, args=(pump, 0.5))  # returns once idle
    reader.start()
    waiter.join(10)
    reader.join(10)
    assert got == [Outcome(1, OK, KiB)] and (dst == 7).all()
    assert pump.take_done() == []  # the waiter took it: nothing listed
    assert pump.wait(1, 0, deadline()) is False  # gone


def test_a_payload_arriving_in_pieces_lands_whole(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    peer, _, pump = link
    n = 64 * KiB
    dst, payload = entered_pull(pump, 4, n, 7)

    def send_in_pieces() -> None:
        peer.sendall(header(PULL_DATA, 4, n) + payload[:1000].tobytes())
        time.sleep(0.01)
        peer.sendall(payload[1000:40000].tobytes())
        time.sleep(0.01)
        peer.sendall(payload[40000:].tobytes())

    sender = threading.Thread(target=send_in_pieces)
    sender.start()
    assert run(pump)[0] is PumpEvent.DONE
    sender.join()
    assert pump.take_done() == [Outcome(4, OK, n)]
    np.testing.assert_array_equal(dst, payload)


def test_a_deadline_mid_payload_ends_the_request_and_the_rest_is_discarded(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    peer, _, pump = link
    dst = np.zeros(1000, np.uint8)
    assert pump.enter(1, PULL_DATA, rows_of(dst, [(0, 1000)]), 1000, deadline(0.05))
    peer.sendall(header(PULL_DATA, 1, 1000) + b"\x02" * 300)
    assert run(pump)[0] is PumpEvent.DONE
    assert pump.take_done() == [Outcome(1, LATE, 300)]
    peer.sendall(b"\xff" * 700 + header(int(FrameKind.PONG), 8))
    assert run(pump) == (PumpEvent.FRAME, header(int(FrameKind.PONG), 8))
    assert (dst[:300] == 2).all() and not dst[300:].any()


def test_a_forgotten_request_is_not_touched(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    peer, mine, pump = link
    dst = np.zeros(100, np.uint8)
    assert pump.enter(2, PULL_DATA, rows_of(dst, [(0, 100)]), 100, deadline())
    assert pump.forget(2)
    peer.sendall(header(PULL_DATA, 2, 100) + b"\x01" * 100)
    assert run(pump) == (PumpEvent.FRAME, header(PULL_DATA, 2, 100))
    assert len(mine.recv(200)) == 100 and not dst.any()  # the payload is Python's to drain


def test_closing_fails_what_the_table_holds_and_refuses_more(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    _, _, pump = link
    dst = np.zeros(10, np.uint8)
    assert pump.enter(1, PULL_DATA, rows_of(dst, [(0, 10)]), 10, deadline())
    assert pump.enter(2, PUSH_ACK, None, 0, 0)
    pump.close()
    assert sorted(pump.take_done()) == [Outcome(1, BROKEN, 0), Outcome(2, BROKEN, 0)]
    assert not pump.enter(3, PUSH_ACK, None, 0, 0)


@pytest.mark.parametrize("cut", [3, 20])
def test_a_peer_that_stalls_mid_header_is_found(
    link: tuple[socket.socket, socket.socket, FramePump], cut: int
) -> None:
    peer, _, pump = link
    peer.sendall(header(PUSH_ACK, 1)[:cut])
    started = time.monotonic()
    assert run(pump)[0] is PumpEvent.STALLED
    assert 0.9 < time.monotonic() - started < 5.0


def test_a_hangup_is_reported(link: tuple[socket.socket, socket.socket, FramePump]) -> None:
    peer, _, pump = link
    peer.shutdown(socket.SHUT_WR)
    assert run(pump)[0] is PumpEvent.CLOSED


def test_an_idle_socket_returns_after_the_idle_time(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    _, _, pump = link
    assert run(pump, 0.05)[0] is PumpEvent.IDLE


def test_bad_entries_are_refused(link: tuple[socket.socket, socket.socket, FramePump]) -> None:
    _, _, pump = link
    dst = np.zeros(10, np.uint8)
    with pytest.raises(ParamInvalidError):  # rows that do not add up
        pump.enter(1, PULL_DATA, rows_of(dst, [(0, 10)]), 11, 0)
    with pytest.raises(ParamInvalidError):  # a null row
        pump.enter(1, PULL_DATA, np.array([[0, 10]], np.uint64), 10, 0)
    with pytest.raises(ParamInvalidError):  # a kind that answers nothing
        pump.enter(1, int(FrameKind.PULL), rows_of(dst, [(0, 10)]), 10, 0)
    with pytest.raises(ParamInvalidError):  # id 0 means "none" on the wire
        pump.enter(0, PUSH_ACK, None, 0, 0)
    assert pump.enter(1, PUSH_ACK, None, 0, 0)
    assert not pump.enter(1 + (1 << 16), PUSH_ACK, None, 0, 0)  # its slot is taken


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=8),
    others=st.lists(st.booleans(), min_size=8, max_size=8),
    cuts=st.lists(st.integers(1, 50), min_size=1, max_size=6),
)
def test_answers_and_other_frames_in_any_order_and_pieces(
    sizes: list[int], others: list[bool], cuts: list[int]
) -> None:
    """A stream of answers (each entered), with other frames between them, sent in
    arbitrary pieces: every answer lands whole in its rows, and the other frames come back
    in order with nothing of them consumed past their headers."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        peer = socket.create_connection(srv.getsockname())
        mine, _ = srv.accept()
    with peer, mine:
        pump = FramePump(mine.fileno(), 5.0)
        rng = np.random.default_rng(len(sizes))
        bufs, wire, expected = [], b"", []
        for i, n in enumerate(sizes):
            rid = 100 + i
            buf = np.zeros(n, np.uint8)
            bufs.append(buf)
            assert pump.enter(rid, PULL_DATA, rows_of(buf, [(0, n)]) if n else None, n, 0)
            payload = rng.integers(0, 256, n, dtype=np.uint8)
            expected.append(payload)
            if others[i]:
                wire += header(int(FrameKind.PONG), 900 + i)
            wire += header(PULL_DATA, rid, n) + payload.tobytes()

        def send() -> None:
            data, k = wire, 0
            for cut in cuts:
                peer.sendall(data[k : k + cut])
                k += cut
                time.sleep(0.001)
            peer.sendall(data[k:])

        sender = threading.Thread(target=send)
        sender.start()
        done: list[Outcome] = []
        pongs: list[int] = []
        while len(done) < len(sizes):
            event, got = pump.run(0, False, 5 * SEC)
            if event is PumpEvent.DONE:
                done += pump.take_done()
            else:
                assert event is PumpEvent.FRAME
                pongs.append(decode_header(got).request_id)
        sender.join(10)
        pump.close()
    assert sorted(done) == [Outcome(100 + i, OK, n) for i, n in enumerate(sizes)]
    assert pongs == [900 + i for i in range(len(sizes)) if others[i]]
    for buf, payload in zip(bufs, expected, strict=True):
        np.testing.assert_array_equal(buf, payload)


# -- whoever waits reads: blocking waiters and event loops drive the pump ---------------------


def test_a_waiter_reads_its_own_answer_without_the_reader_thread(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    peer, _, pump = link
    dst = np.zeros(KiB, np.uint8)
    assert pump.enter(1, PULL_DATA, rows_of(dst, [(0, KiB)]), KiB, deadline())
    threading.Timer(0.01, peer.sendall, (header(PULL_DATA, 1, KiB) + b"\x03" * KiB,)).start()
    # Nobody runs the reader here: the waiter reads while it spins.
    assert pump.wait(1, 5 * SEC, deadline()) == Outcome(1, OK, KiB)
    assert (dst == 3).all()


def test_a_payload_a_waiter_began_is_finished_by_the_reader_thread(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    peer, _, pump = link
    n = 64 * KiB
    dst, payload = entered_pull(pump, 1, n, 5)
    peer.sendall(header(PULL_DATA, 1, n) + payload[:1000].tobytes())
    # The waiter's time ends mid-payload: the pump keeps where the frame is.
    assert pump.wait(1, SEC // 20, api.monotonic_ns() + SEC // 20) is True
    peer.sendall(payload[1000:].tobytes())
    assert run(pump)[0] is PumpEvent.DONE
    assert pump.take_done() == [Outcome(1, OK, n)]
    np.testing.assert_array_equal(dst, payload)


def test_a_loop_reads_without_waiting_and_resumes_mid_payload(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    peer, mine, pump = link
    n = 48 * KiB
    dst, payload = entered_pull(pump, 2, n, 6)
    wire = header(PULL_DATA, 2, n) + payload.tobytes()
    for cut in (3, 30, 20000, len(wire)):  # a header in pieces, then the payload in two
        peer.sendall(wire[:cut])
        wire = wire[cut:]
        deadline_s = time.monotonic() + 10
        while api.sock_wait_readable(mine.fileno(), 1) and time.monotonic() < deadline_s:
            assert pump.poll()  # never waits; nothing for the reader thread
            if not wire:
                break
        if not wire:
            break
    outcomes: list[Outcome] = []
    limit = time.monotonic() + 10
    while not outcomes and time.monotonic() < limit:
        pump.poll()
        outcomes = pump.take_done()
    assert outcomes == [Outcome(2, OK, n)]
    np.testing.assert_array_equal(dst, payload)


@pytest.mark.parametrize("driver", ["waiter", "loop"])
def test_a_frame_for_python_goes_to_the_reader_thread(
    link: tuple[socket.socket, socket.socket, FramePump], driver: str
) -> None:
    peer, mine, pump = link
    dst = np.zeros(10, np.uint8)
    assert pump.enter(1, PULL_DATA, rows_of(dst, [(0, 10)]), 10, deadline())
    refusal = header(int(FrameKind.ERROR), 1, body=5)
    peer.sendall(refusal + b"nope!")
    if driver == "waiter":
        assert pump.wait(1, SEC // 10, api.monotonic_ns() + SEC // 10) is True
    else:
        limit = time.monotonic() + 10
        while pump.poll() and time.monotonic() < limit:
            pass  # (until it met the refusal)
    # The refusal's header is parked for the reader thread, its body still on the socket.
    assert run(pump) == (PumpEvent.FRAME, refusal)
    assert mine.recv(16) == b"nope!"


def test_once_closed_nobody_reads_the_socket(
    link: tuple[socket.socket, socket.socket, FramePump],
) -> None:
    """Closing takes the driver role for good (the socket may go next, and its number be
    reused): a loop stops watching, a spinning waiter gets its request failed, and bytes
    that arrive are read by nobody."""
    peer, mine, pump = link
    dst = np.zeros(KiB, np.uint8)
    assert pump.enter(1, PULL_DATA, rows_of(dst, [(0, KiB)]), KiB, deadline())
    got: list[Outcome | bool] = []
    waiter = threading.Thread(target=lambda: got.append(pump.wait(1, 2 * SEC, deadline())))
    waiter.start()
    pump.close()
    waiter.join(10)
    assert got == [Outcome(1, BROKEN, 0)]
    peer.sendall(header(PULL_DATA, 1, KiB) + b"\x01" * KiB)
    assert not pump.poll()  # the loop stops watching
    assert len(mine.recv(64)) > 0 and not dst.any()  # nothing of it was read
