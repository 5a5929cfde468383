"""The native start of a UCX transfer (``dd_ucx_transfer``), against UCP calls of our own.

The native layer calls UCX only through the function addresses it is handed, so these tests
hand it Python functions that note every get, put and flush (each done at once, or refused
when a test says so) and check what a transfer starts: each op's key found, the bytes cut
into runs of about equal size, one per part, neighbours merged, the lanes' parts first, a
flush after each part, and nothing at all for an op that is bad or that no key holds. No
UCX is needed.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._native import api
from aio_datadist._native._ffi import ffi, lib
from aio_datadist.status import ParamInvalidError

RMA = "uint64_t(*)(uint64_t, uint64_t, size_t, uint64_t, uint64_t, uint64_t)"
#: The status word UCX returns for a refused request (UCS_ERR_NO_RESOURCE).
REFUSED = (1 << 64) - 2
EPS = [0x1000 * (p + 1) for p in range(api.lib.DD_UCX_MAX_PARTS)]


class FakeUcp:
    """UCP calls that note what they are asked to do."""

    def __init__(self, refuse_at: int = -1, *, in_flight: bool = False) -> None:
        self.calls: list[tuple[str, int, int, int, int, int]] = []
        self.refuse_at = refuse_at
        #: Requests left in flight (``in_flight``): each progress round completes one into
        #: :attr:`count`.
        self.in_flight: list[int] = []
        self.count: api.UcxCount | None = None
        self.rounds = 0
        #: The status each progress round completes a request with.
        self.status = 0
        #: ``(done, failed)`` per part of the last :meth:`transfer`.
        self.done: list[tuple[bool, int]] = []

        def rma(kind: str) -> Any:
            def call(ep: int, buffer: int, n: int, remote: int, rkey: int, param: int) -> int:
                self.calls.append((kind, ep, buffer, remote, n, rkey))
                if len(self.calls) - 1 == self.refuse_at:
                    return REFUSED
                if not in_flight:
                    return 0
                self.in_flight.append(0x5000 + len(self.calls))
                return self.in_flight[-1]

            return ffi.callback(RMA, call)

        def step(worker: int) -> int:
            self.rounds += 1
            if not self.in_flight or self.count is None:
                return 0
            request = self.in_flight.pop(0)
            lib.dd_ucx_counted(ffi.cast("void *", request), self.status, self.count._count)
            return 1

        def flush(ep: int, param: int) -> int:
            self.calls.append(("flush", ep, 0, 0, 0, 0))
            return 0

        self._keep = [
            rma("get"),
            rma("put"),
            ffi.callback("uint64_t(*)(uint64_t, uint64_t)", flush),
            ffi.callback("void(*)(uint64_t)", lambda request: None),
            ffi.callback("unsigned(*)(uint64_t)", step),
            ffi.callback("int8_t(*)(uint64_t)", lambda worker: 0),
            ffi.callback("int8_t(*)(uint64_t)", self._arm),
        ]
        #: Times the worker was armed (before a sleep on its event fd).
        self.arms = 0
        get, put, fl, free, progress, signal, arm = (
            int(ffi.cast("uintptr_t", f)) for f in self._keep
        )
        self.ucp = api.UcxCalls(
            {
                "ucp_get_nbx": get,
                "ucp_put_nbx": put,
                "ucp_request_free": free,
                "ucp_worker_progress": progress,
                "ucp_worker_signal": signal,
                "ucp_ep_flush_nbx": fl,
                "ucp_worker_arm": arm,
            }
        )

    def _arm(self, worker: int) -> int:
        self.arms += 1
        return 0

    def transfer(
        self,
        ops: Any,
        keys: Any,
        parts: int,
        *,
        write: bool = False,
        flush: bool = False,
        progress_ns: int = 0,
    ) -> tuple[int, list[tuple[bool, int]]]:
        """Start ``ops`` in ``parts`` parts: ``(held, [(started, status), ...])``."""
        rkeys = [np.arange(len(keys), dtype=np.uint64) + 100 * (p + 1) for p in range(parts)]
        native = api.UcxParts(keys, [api.UcxPart(EPS[p], rkeys[p], None) for p in range(parts)])
        for p in range(parts):
            native.bind(p, 1, self.ucp.count())
        self.count = native._counts[0]
        held, slots = self.ucp.transfer(
            ops, native, write=write, flush=flush, worker=0x77, progress_ns=progress_ns
        )
        self.done = [(bool(s.done), s.failed) for s in slots]
        return held, [(bool(s.started), s.status) for s in slots]


@st.composite
def _transfers(draw: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]:
    """Ops over a few registrations (some continuing each other), and a number of parts."""
    nkeys = draw(st.integers(1, 4))
    keys = np.array([(k << 32, (k << 32) + (64 << 20)) for k in range(1, nkeys + 1)], np.uint64)
    rows = []
    local = 1 << 40
    for _ in range(draw(st.integers(1, 24))):
        n = draw(st.integers(1, 3 << 20))
        k = draw(st.integers(0, nkeys - 1))
        go_on = rows and draw(st.booleans())  # continue the last op on both sides?
        if go_on and rows[-1][1] + rows[-1][2] + n <= int(keys[k][1]):
            last = rows[-1]
            rows.append((last[0] + last[2], last[1] + last[2], n))
            continue
        start = int(keys[k][0]) + draw(st.integers(0, (60 << 20) - n))
        rows.append((local, start, n))
        local += n + 4096
    return np.array(rows, np.uint64), keys, draw(st.integers(1, api.lib.DD_UCX_MAX_PARTS))


def _merged(rows: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """(key, local, remote, n) rows, neighbours that continue each other through one key
    merged."""
    out: list[tuple[int, int, int, int]] = []
    for key, here, there, n in rows:
        if out and out[-1][0] == key and out[-1][1] + out[-1][3] == here:
            k, start, far, size = out[-1]
            if far + size == there:
                out[-1] = (k, start, far, size + n)
                continue
        out.append((key, here, there, n))
    return out


@given(_transfers(), st.booleans())
@settings(max_examples=300, deadline=None)
def test_a_transfer_is_cut_into_parts_of_the_same_bytes(case: Any, write: bool) -> None:
    ops, keys, parts = case
    fake = FakeUcp()
    held, started = fake.transfer(ops, keys, parts, write=write, flush=True)
    assert held == len(ops)
    total = int(ops[:, 2].sum())
    kind = "put" if write else "get"
    by_part: dict[int, list[tuple[int, int, int, int]]] = {}
    order: list[int] = []  # the parts in the order they were started
    for what, ep, here, there, n, rkey in fake.calls:
        part = EPS.index(ep)
        if what == "flush":
            assert order[-1] == part  # each part's flush follows its run
            continue
        assert what == kind
        if not order or order[-1] != part:
            order.append(part)
        key = int(rkey) - 100 * (part + 1)  # the part's own key for the row that holds it
        assert int(keys[key][0]) <= there and there + n <= int(keys[key][1])
        by_part.setdefault(part, []).append((key, here, there, n))
    runs = len(order)
    assert 1 <= runs <= parts
    assert order == [*range(1, runs), 0]  # the lanes' parts first, the caller's last
    assert [s for s, _ in started] == [True] * runs + [False] * (parts - runs)
    assert sum(1 for c in fake.calls if c[0] == "flush") == runs
    for part in range(runs):  # merged as far as they go
        assert _merged(by_part[part]) == by_part[part]
    key_of = api.ucx_find(keys, ops[:, 1:])
    assert key_of is not None
    want = _merged([(int(k), *map(int, op)) for k, op in zip(key_of, ops, strict=True)])
    assert _merged([row for p in range(runs) for row in by_part[p]]) == want
    if total >= 2 * 4096:
        sizes = [sum(n for *_, n in by_part[p]) for p in range(runs)]
        assert all(size % 4096 == 0 for size in sizes[:-1])  # cut at 4 KiB multiples
        assert max(sizes) - min(sizes) <= 2 * 4096, sizes  # about equal
    else:
        assert runs == 1


def test_nothing_starts_for_a_bad_op_or_one_no_key_holds() -> None:
    keys = np.array([(1 << 32, (1 << 32) + (1 << 20))], np.uint64)
    good = [1 << 40, 1 << 32, 4096]
    fake = FakeUcp()
    for bad, index in (
        ([1 << 40, 1 << 32, 0], 1),  # empty
        ([0, 1 << 32, 4096], 1),  # no local address
        ([(1 << 64) - 4096, 1 << 32, 8192], 1),  # wraps
    ):
        with pytest.raises(ParamInvalidError, match=f"op {index} is empty"):
            fake.transfer(np.array([good, bad], np.uint64), keys, 2)
    outside = [1 << 40, (1 << 32) + (1 << 20) - 4095, 4096]  # one byte past the key
    held, started = fake.transfer(np.array([good, good, outside], np.uint64), keys, 2)
    assert held == 2 and started == [(False, 0), (False, 0)]
    assert fake.calls == []


def test_a_refusal_stops_the_parts_not_yet_started() -> None:
    keys = np.array([(1 << 32, (1 << 32) + (64 << 20))], np.uint64)
    ops = np.array(
        [[(1 << 40) + i * (2 << 20), (1 << 32) + i * (4 << 20), 1 << 20] for i in range(8)],
        np.uint64,
    )
    fake = FakeUcp(refuse_at=1)  # the second request of the first part started (part 1)
    held, started = fake.transfer(ops, keys, 2, flush=True)
    assert held == len(ops)
    assert started == [(False, 0), (True, -2)]  # part 1 refused, part 0 never started
    assert [c[0] for c in fake.calls] == ["get", "get"]  # no flush after a refusal


def test_find_tries_the_registrations_below_a_span() -> None:
    keys = np.array([(0x1000, 0x9000), (0x2000, 0x3000), (0x4000, 0x5000)], np.uint64)
    spans = np.array([(0x2000, 0x800), (0x4800, 0x1000), (0x1000, 0x8000)], np.uint64)
    found = api.ucx_find(keys, spans)
    assert found is not None and found.tolist() == [1, 0, 0]
    assert api.ucx_find(keys, np.array([(0x8000, 0x1001)], np.uint64)) is None
    assert api.ucx_find(keys[:0], np.array([(0x1000, 1)], np.uint64)) is None
    assert api.ucx_find(keys, np.zeros((0, 2), np.uint64)).tolist() == []  # type: ignore[union-attr]


def _layout(base: int, tensors: int, block_bytes: int, num_blocks: int) -> api.BlockLayout:
    return api.BlockLayout(
        [base + t * block_bytes * num_blocks for t in range(tensors)], block_bytes, num_blocks
    )


def _pairs(
    local: tuple[api.BlockLayout, int, list[int]],
    remote: tuple[api.BlockLayout, int, list[int]],
    count: int,
    seg: int,
) -> api.BlockPairs:
    """Block pairs of two ``(layout, first tensor, blocks)`` sides."""
    layouts = api.PairedLayouts((local[0], local[1]), (remote[0], remote[1]), count, seg)
    return api.BlockPairs(layouts, local[2], remote[2])


@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 15), st.integers(0, 15)), min_size=1, max_size=12),
    st.integers(1, 4096),
    st.integers(1, api.lib.DD_UCX_MAX_PARTS),
    st.booleans(),
)
@settings(max_examples=100, deadline=None)
def test_block_pairs_start_the_ops_blocks_ops_makes(
    tensors: int, blocks: list[tuple[int, int]], seg: int, parts: int, write: bool
) -> None:
    local = (_layout(1 << 40, tensors + 1, 4096, 16), 1, [b for b, _ in blocks])
    remote = (_layout(1 << 32, tensors, 4096, 16), 0, [b for _, b in blocks])
    keys = np.array([(1 << 32, (1 << 32) + tensors * 4096 * 16)], np.uint64)
    pairs = _pairs(local, remote, tensors, seg)
    ops = api.blocks_ops(local, remote, tensors, seg)
    assert len(pairs) == len(ops) and (pairs.ops() == ops).all()
    by_pairs, by_ops = FakeUcp(), FakeUcp()
    assert by_pairs.transfer(pairs, keys, parts, write=write) == by_ops.transfer(
        ops, keys, parts, write=write
    )
    assert by_pairs.calls == by_ops.calls and by_pairs.calls


def test_block_pairs_a_layout_refuses_start_nothing() -> None:
    keys = np.array([(1 << 32, (1 << 33))], np.uint64)
    local = (_layout(1 << 40, 2, 4096, 16), 0, [0, 1])
    fake = FakeUcp()
    for remote, seg in (
        ((_layout(1 << 32, 2, 4096, 16), 0, [0, 16]), 4096),  # a block past the layout
        ((_layout(1 << 32, 2, 4096, 16), 0, [0, 1]), 4097),  # a segment over a block
    ):
        with pytest.raises(api.PairsRefused):
            fake.transfer(_pairs(local, remote, 2, seg), keys, 2)
    with pytest.raises(ParamInvalidError):  # tensors outside a layout: refused as it is made
        _pairs(local, (_layout(1 << 32, 1, 4096, 16), 0, [0, 1]), 2, 4096)
    assert fake.calls == []


def test_a_transfer_progresses_its_worker_until_its_requests_completed() -> None:
    keys = np.array([(1 << 32, (1 << 32) + (64 << 20))], np.uint64)
    ops = np.array(
        [[(1 << 40) + i * 8192, (1 << 32) + i * 16384, 4096] for i in range(3)], np.uint64
    )
    fake = FakeUcp(in_flight=True)
    fake.transfer(ops, keys, 1)  # no progress asked for: the requests stay in flight
    assert fake.rounds == 0 and fake.count is not None and fake.count.left() == (3, 0)
    while fake.in_flight:
        lib.dd_ucx_counted(ffi.cast("void *", fake.in_flight.pop()), 0, fake.count._count)
    assert fake.done == [(False, 0)]
    fake = FakeUcp(in_flight=True)
    fake.transfer(ops, keys, 1, progress_ns=10**9)
    assert fake.count is not None and fake.count.left() == (0, 0)
    assert fake.rounds == 3  # one request a round, and no round once the count read 0
    assert fake.done == [(True, 0)]  # done in the call


def test_a_part_done_in_the_call_reports_its_first_failure_and_its_count_is_new() -> None:
    keys = np.array([(1 << 32, (1 << 32) + (64 << 20))], np.uint64)
    ops = np.array([[1 << 40, 1 << 32, 4096]], np.uint64)
    fake = FakeUcp(in_flight=True)
    fake.status = -3  # UCS_ERR_NO_MESSAGE: each request fails
    fake.transfer(ops, keys, 1, progress_ns=10**9)
    assert fake.done == [(True, -3)]
    assert fake.count is not None and fake.count.left() == (0, 0)  # made as new


def test_a_transfer_stops_progressing_when_a_round_finds_nothing_to_do() -> None:
    keys = np.array([(1 << 32, (1 << 32) + (64 << 20))], np.uint64)
    ops = np.array([[1 << 40, 1 << 32, 4096]], np.uint64)
    fake = FakeUcp(in_flight=True)
    fake.count = None  # progress completes nothing (a get over tcp waits for the peer)
    rkeys = np.arange(1, dtype=np.uint64) + 100
    count = fake.ucp.count()
    parts = api.UcxParts(keys, [api.UcxPart(EPS[0], rkeys, None)])
    parts.bind(0, 1, count)
    _, slots = fake.ucp.transfer(ops, parts, write=False, worker=0x77, progress_ns=10**9)
    started = [(bool(s.started), s.status, bool(s.done), s.failed) for s in slots]
    assert fake.rounds == 1 and count.left() == (1, 0)  # it did not spin for a second
    assert started == [(True, 0, False, 0)]  # not done: the request is still in flight
    lib.dd_ucx_counted(ffi.cast("void *", fake.in_flight.pop()), 0, count._count)


def test_a_spin_progresses_without_sleeping_until_the_count_reads_0_or_its_time_passed() -> None:
    keys = np.array([(1 << 32, (1 << 32) + (64 << 20))], np.uint64)
    ops = np.array(
        [[(1 << 40) + i * 8192, (1 << 32) + i * 16384, 4096] for i in range(3)], np.uint64
    )
    fake = FakeUcp(in_flight=True)
    fake.transfer(ops, keys, 1)
    assert fake.count is not None
    assert fake.ucp.spin(0x77, fake.count, 10**9)  # one request a round
    assert fake.rounds == 3 and fake.count.left() == (0, 0)
    fake = FakeUcp(in_flight=True)
    fake.transfer(ops, keys, 1)
    count, fake.count = fake.count, None  # progress completes nothing (the peer is slow)
    assert count is not None
    start = time.monotonic_ns()
    assert not fake.ucp.spin(0x77, count, 2_000_000)
    assert time.monotonic_ns() - start >= 2_000_000
    assert fake.rounds > 2 and fake.arms == 0  # it polled, never armed to sleep
    while fake.in_flight:
        lib.dd_ucx_counted(ffi.cast("void *", fake.in_flight.pop()), 0, count._count)


def test_a_serving_wait_polls_a_while_after_work_before_it_sleeps() -> None:
    """After a round that found work (a peer's request served), the serving wait keeps
    progressing for the spin time before it arms the worker and sleeps."""
    keys = np.array([(1 << 32, (1 << 32) + (64 << 20))], np.uint64)
    ops = np.array([[1 << 40, 1 << 32, 4096]], np.uint64)
    efd, wake = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
    try:
        for spin_ns, polled in ((0, lambda n: n <= 5), (20_000_000, lambda n: n > 50)):
            fake = FakeUcp(in_flight=True)
            fake.transfer(ops, keys, 1)  # one request: the first round of progress finds it
            idle = ffi.new("int *")
            deadline = time.monotonic_ns() + 60_000_000
            fake.ucp.serve(0x77, efd, wake, deadline, False, idle, api.UcxTurn(), spin_ns)
            assert polled(fake.rounds), (spin_ns, fake.rounds)
            assert fake.arms >= 1  # then it slept until the deadline
    finally:
        os.close(efd)
        os.close(wake)
