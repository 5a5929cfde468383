"""Bounds on every remote access: hostile requests from a raw peer, one field at a time.

A real engine serves over TCP; the peer made a real handshake and then sends requests built
by hand. Every refusal carries the documented code, leaves the serving memory untouched, and
the same link serves a good request right after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from aio_datadist._engine.access import Access, Target, encode_access
from aio_datadist._transport._wire import MAX_PAYLOAD, FrameKind
from aio_datadist.status import LLMStatusCode
from tests.wirefuzz import (
    BATCH_ID,
    BLOCK_BYTES,
    BLOCKS,
    MODEL_ID,
    PREFIX_ID,
    REQ_ID,
    ROW_BYTES,
    ROWS,
    TENSORS,
    Answer,
    RawPeer,
    ServingEngine,
    frame,
    good_client_works,
    settle,
)

INVALID = LLMStatusCode.LLM_PARAM_INVALID
NOT_EXIST = LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
U64_MAX = 2**64 - 1
BLOCKS_ID = BATCH_ID + 1
REGISTERED_ID = BATCH_ID + 2


@pytest.fixture
def engine() -> Iterator[ServingEngine]:
    e = ServingEngine()
    try:
        yield e
    finally:
        e.close()


@pytest.fixture
def peer(engine: ServingEngine) -> Iterator[RawPeer]:
    with RawPeer(engine.port) as p:
        yield p


def row_access(**fields: int) -> Access:
    base = dict(ident=BATCH_ID, tensor_count=TENSORS, seg_bytes=ROW_BYTES)
    return Access(Target.CACHE_INDEX, **(base | fields))


def block_access(blocks: list[int], **fields: int) -> Access:
    base = dict(ident=MODEL_ID, tensor_count=TENSORS, seg_bytes=BLOCK_BYTES)
    return Access(Target.BLOCKS_KEY, blocks=np.array(blocks, dtype=np.uint64), **(base | fields))


def addr_access(rows: list[tuple[int, int]]) -> Access:
    return Access(Target.ADDRESSES, rows=np.array(rows, dtype=np.uint64).reshape(-1, 2))


def batch_addr(engine: ServingEngine, t: int = 0) -> int:
    return int(engine.batch.tensor_addrs[t])


def user_addr(engine: ServingEngine, t: int = 0) -> int:
    return int(engine.user[t].ctypes.data)


Case = Callable[[ServingEngine], tuple[Access, int]]

#: (name, request, its size in bytes, the answer's code), each of which the server refuses.
REFUSED: list[tuple[str, Case, LLMStatusCode]] = [
    ("unknown cache id", lambda e: (row_access(ident=999), 512), NOT_EXIST),
    (
        "unknown req key",
        lambda e: (Access(Target.REQ_KEY, ident=99, tensor_count=1, seg_bytes=8), 8),
        NOT_EXIST,
    ),
    (
        "req key of another model",
        lambda e: (
            Access(Target.REQ_KEY, ident=REQ_ID, model_id=3, tensor_count=1, seg_bytes=8),
            8,
        ),
        NOT_EXIST,
    ),
    (
        "unknown prefix key",
        lambda e: (Access(Target.PREFIX_KEY, ident=99, tensor_count=1, seg_bytes=8), 8),
        NOT_EXIST,
    ),
    ("unknown blocks key", lambda e: (block_access([0], ident=99), 2 * BLOCK_BYTES), NOT_EXIST),
    ("batch index past the end", lambda e: (row_access(row=ROWS), 512), INVALID),
    ("batch index u64 max", lambda e: (row_access(row=U64_MAX), 512), INVALID),
    ("tensor range past the end", lambda e: (row_access(tensor_start=1), 512), INVALID),
    (
        "tensor start u32 max",
        lambda e: (row_access(tensor_start=2**32 - 1, tensor_count=1), 256),
        INVALID,
    ),
    ("no tensors", lambda e: (row_access(tensor_count=0), 0), INVALID),
    ("offset at the row end", lambda e: (row_access(offset=ROW_BYTES, seg_bytes=1), 2), INVALID),
    ("segment past the row end", lambda e: (row_access(offset=200, seg_bytes=100), 200), INVALID),
    ("offset u64 max", lambda e: (row_access(offset=U64_MAX, seg_bytes=2), 4), INVALID),
    ("empty segment", lambda e: (row_access(seg_bytes=0), 0), INVALID),
    ("segment longer than a row", lambda e: (row_access(seg_bytes=ROW_BYTES + 1), 514), INVALID),
    ("segment u64 max", lambda e: (row_access(seg_bytes=U64_MAX), U64_MAX), INVALID),
    ("segment wrapping u64 times tensors", lambda e: (row_access(seg_bytes=2**63), 0), INVALID),
    ("block index past the end", lambda e: (block_access([1, BLOCKS]), 4 * BLOCK_BYTES), INVALID),
    ("block index u64 max", lambda e: (block_access([U64_MAX]), 2 * BLOCK_BYTES), INVALID),
    (
        "block segment too long",
        lambda e: (block_access([0], seg_bytes=BLOCK_BYTES + 1), 2 * BLOCK_BYTES + 2),
        INVALID,
    ),
    (
        "block tail too long",
        lambda e: (block_access([0, 1], tail_bytes=BLOCK_BYTES + 1), 4 * BLOCK_BYTES + 2),
        INVALID,
    ),
    ("size one byte short", lambda e: (row_access(), 511), INVALID),
    ("size one byte over", lambda e: (row_access(), 513), INVALID),
    ("blocks size mismatch", lambda e: (block_access([0, 1]), 2 * BLOCK_BYTES), INVALID),
    ("address outside every cache", lambda e: (addr_access([(0x1000, 16)]), 16), INVALID),
    (
        "address running past its tensor",
        lambda e: (addr_access([(batch_addr(e) + 1000, 100)]), 100),
        INVALID,
    ),
    (
        "address crossing into the next tensor",
        lambda e: (addr_access([(user_addr(e) + 1000, 48)]), 48),
        INVALID,
    ),
    (
        "address wrapping u64",
        lambda e: (addr_access([(batch_addr(e), 2**64 - batch_addr(e) + 16)]), 16),
        INVALID,
    ),
    ("address at the top of u64", lambda e: (addr_access([(U64_MAX - 7, 16)]), 16), INVALID),
    (
        "address length over a payload",
        lambda e: (addr_access([(batch_addr(e), MAX_PAYLOAD + 1)]), MAX_PAYLOAD + 1),
        INVALID,
    ),
    (
        "one good row, one bad row",
        lambda e: (addr_access([(batch_addr(e), 16), (0x1000, 16)]), 32),
        INVALID,
    ),
    ("no address rows", lambda e: (addr_access([]), 0), INVALID),
    ("address size mismatch", lambda e: (addr_access([(batch_addr(e), 16)]), 17), INVALID),
    (
        "drop flag on a pull by prefix key",
        lambda e: (
            Access(Target.PREFIX_KEY, ident=PREFIX_ID, tensor_count=1, seg_bytes=8, drop_key=True),
            8,
        ),
        INVALID,
    ),
    ("drop flag on a pull by index", lambda e: (row_access(drop_key=True), 512), INVALID),
    (
        "own rows named outside any communication domain",
        lambda e: (row_access(deliver=np.array([[0x1000, TENSORS * ROW_BYTES]], np.uint64)), 0),
        INVALID,
    ),
    (
        "own rows named with a payload too",
        lambda e: (row_access(deliver=np.array([[0x1000, 16]], np.uint64)), 16),
        INVALID,
    ),
]


def expect(answer: Answer | None, status: LLMStatusCode) -> None:
    assert answer is not None, "the server closed the link"
    assert answer.kind is FrameKind.ERROR, answer
    assert answer.status == status, (LLMStatusCode(answer.status), answer.data)


def assert_link_serves(engine: ServingEngine, peer: RawPeer) -> None:
    """The same link still serves a good pull, with the right bytes."""
    answer = peer.pull(row_access(row=3, tensor_start=1, tensor_count=1), ROW_BYTES)
    assert answer is not None and answer.kind is FrameKind.PULL_DATA, answer
    assert answer.data == engine.tensor(0, 1)[3 * ROW_BYTES :].tobytes()


def snapshot(engine: ServingEngine) -> list[bytes]:
    return [engine.tensor(c, t).tobytes() for c in range(3) for t in range(TENSORS)]


@pytest.mark.parametrize(("case", "status"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_hostile_pull_is_refused_and_the_link_stays(
    engine: ServingEngine, peer: RawPeer, case: Case, status: LLMStatusCode
) -> None:
    access, nbytes = case(engine)
    expect(peer.pull(access, nbytes), status)
    assert_link_serves(engine, peer)


@pytest.mark.parametrize(("case", "status"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_hostile_push_is_refused_without_writing(
    engine: ServingEngine, peer: RawPeer, case: Case, status: LLMStatusCode
) -> None:
    access, nbytes = case(engine)
    before = snapshot(engine)
    payload = b"\xee" * min(nbytes, 1 << 16)  # the frame carries what it announces
    expect(peer.push(access, payload), status)
    assert snapshot(engine) == before
    assert_link_serves(engine, peer)
    assert settle(lambda: engine.pins() == 0)  # the server unpins once its send returned


def test_drop_flag_only_drops_on_a_pull_by_req_key(engine: ServingEngine, peer: RawPeer) -> None:
    # Row 0 holds req key 7 and row 1 prefix key 7: a pull by prefix key that asks to drop
    # must not drop the req key of the same number.
    by_prefix = Access(
        Target.PREFIX_KEY, ident=PREFIX_ID, tensor_count=1, seg_bytes=8, drop_key=True
    )
    expect(peer.pull(by_prefix, 8), INVALID)
    peer.pull_done(1)
    by_push = Access(Target.REQ_KEY, ident=REQ_ID, tensor_count=1, seg_bytes=8, drop_key=True)
    expect(peer.push(by_push, bytes(8)), INVALID)
    by_req = Access(Target.REQ_KEY, ident=REQ_ID, tensor_count=1, seg_bytes=8, drop_key=True)
    answer = peer.pull(by_req, 8)
    assert answer is not None and answer.kind is FrameKind.PULL_DATA
    assert answer.data == engine.tensor(0, 0)[:8].tobytes()
    peer.pull_done(answer.rid)
    expect(peer.pull(by_req, 8), NOT_EXIST)  # now the key is gone, and only now
    assert_link_serves(engine, peer)


def test_released_caches_are_not_served(engine: ServingEngine, peer: RawPeer) -> None:
    blocks_addr = int(engine.blocks.tensor_addrs[0])
    registered_addr = user_addr(engine)
    cm = engine.dd.cache_manager
    cm.deallocate_blocks_cache(engine.blocks)
    cm.unregister_cache(REGISTERED_ID)
    expect(peer.pull(block_access([0]), 2 * BLOCK_BYTES), NOT_EXIST)
    expect(peer.pull(row_access(ident=BLOCKS_ID, seg_bytes=BLOCK_BYTES), 256), NOT_EXIST)
    expect(peer.pull(row_access(ident=REGISTERED_ID), 512), NOT_EXIST)
    expect(peer.pull(addr_access([(blocks_addr, 64)]), 64), INVALID)
    expect(peer.push(addr_access([(registered_addr, 64)]), bytes(64)), INVALID)
    assert_link_serves(engine, peer)


def test_overlapping_rows_are_served_as_asked(engine: ServingEngine, peer: RawPeer) -> None:
    # Overlaps inside one cache touch nothing outside it: a pull reads the bytes twice.
    base = batch_addr(engine)
    answer = peer.pull(addr_access([(base + 10, 20), (base, 30), (base + 10, 20)]), 70)
    assert answer is not None and answer.kind is FrameKind.PULL_DATA
    t0 = engine.tensor(0, 0).tobytes()
    assert answer.data == t0[10:30] + t0[:30] + t0[10:30]
    blocks = block_access([2, 2, 5])
    answer = peer.pull(blocks, 6 * BLOCK_BYTES)
    assert answer is not None and answer.kind is FrameKind.PULL_DATA
    assert answer.data[:BLOCK_BYTES] == answer.data[BLOCK_BYTES : 2 * BLOCK_BYTES]


def test_oversized_and_malformed_bodies_keep_the_link(engine: ServingEngine, peer: RawPeer) -> None:
    body = (MAX_PAYLOAD + 1).to_bytes(8, "little") + encode_access(row_access())
    expect(peer.request(frame(FrameKind.PULL, 50, body), 50), INVALID)
    whole = encode_access(row_access())
    for rid, broken in enumerate([whole[:-1], whole + b"\0", b"\xff" * len(whole)], 51):
        pull = frame(FrameKind.PULL, rid, (512).to_bytes(8, "little") + broken)
        expect(peer.request(pull, rid), INVALID)
        push = frame(FrameKind.PUSH, rid + 10, broken, bytes(512))
        expect(peer.request(push, rid + 10), INVALID)
    assert_link_serves(engine, peer)


def test_a_push_of_the_wrong_size_is_drained(engine: ServingEngine, peer: RawPeer) -> None:
    before = snapshot(engine)
    push = frame(FrameKind.PUSH, 70, encode_access(row_access()), b"\x55" * 100_000)
    expect(peer.request(push, 70), INVALID)
    assert snapshot(engine) == before
    good = peer.push(row_access(row=0, tensor_count=1), b"\x42" * ROW_BYTES)
    assert good is not None and good.kind is FrameKind.PUSH_ACK
    assert engine.tensor(0, 0)[:ROW_BYTES].tobytes() == b"\x42" * ROW_BYTES
    assert good_client_works(engine)
