"""The table of requests a link end awaits answers to (``_transport.pending``).

Each request ends exactly once, whoever ends it: its answer, the peer's error, its deadline
(one reaper timer per link) or the link's failure; a request whose payload is still being
sent is completed by its sender.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from aio_datadist._transport.base import RequestKind
from aio_datadist._transport.deadlines import after_s
from aio_datadist._transport.pending import PendingRequests, Request
from aio_datadist.status import LLMException, LLMStatusCode

WAIT = 5.0


class Link:
    """The state a table shares with its link: a lock and whether it takes requests."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = True
        self.table = PendingRequests(self.lock, lambda: self.open, self.failure)

    @staticmethod
    def failure() -> LLMException:
        return LLMException("the link is closed", status_code=LLMStatusCode.LLM_LINK_FAILED)


def pull(rid: int, deadline_ns: int = 0, nbytes: int = 8) -> Request:
    return Request(rid, RequestKind.PULL, np.zeros(nbytes, np.uint8), nbytes, deadline_ns)


def status(req: Request) -> LLMStatusCode:
    exc = req.future.exception(WAIT)
    assert isinstance(exc, LLMException)
    return exc.status_code


def test_a_request_ends_once_whoever_ends_it() -> None:
    link = Link()
    a, b = pull(1), pull(2)
    assert link.table.add(a) and link.table.add(b) and len(link.table) == 2
    assert link.table.settle(1, None)
    assert not link.table.settle(1, Link.failure())  # ended already: nothing happens
    assert a.future.result(0) is None
    assert link.table.claim(2, RequestKind.PUSH) is None  # not that kind: it stays
    assert link.table.claim(2, RequestKind.PULL) is b and len(link.table) == 0
    assert not link.table.settle(2, None)  # claimed: the claimer ends it
    assert not b.future.done()


def test_a_claim_that_does_not_fit_leaves_the_request() -> None:
    link = Link()
    req = pull(1, nbytes=8)
    link.table.add(req)
    assert link.table.claim(1, RequestKind.PULL, lambda r: r.nbytes == 16) is None
    assert link.table.claim(1, RequestKind.PULL, lambda r: r.nbytes == 8) is req


def test_a_busy_request_is_completed_by_its_sender() -> None:
    link = Link()
    req = Request(1, RequestKind.PUSH, None, 8, 0, busy=True)
    link.table.add(req)
    assert link.table.claim(1, RequestKind.PUSH) is None  # busy: nobody moves its payload
    failure = LLMException("refused", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    assert link.table.settle(1, failure)  # the peer answered before the payload was out
    assert not req.future.done()
    link.table.sent(req, None)
    assert status(req) is LLMStatusCode.LLM_KV_CACHE_NOT_EXIST


def test_a_send_that_failed_ends_the_request_with_its_failure() -> None:
    link = Link()
    req = Request(1, RequestKind.PUSH, None, 8, 0, busy=True)
    link.table.add(req)
    link.table.sent(req, LLMException("cut", status_code=LLMStatusCode.LLM_TIMEOUT))
    assert status(req) is LLMStatusCode.LLM_TIMEOUT and len(link.table) == 0


def test_requests_are_refused_once_the_link_takes_none_or_the_deadline_passed() -> None:
    link = Link()
    past = pull(1, deadline_ns=1)
    assert not link.table.add(past)
    assert status(past) is LLMStatusCode.LLM_TIMEOUT
    link.open = False
    closed = pull(2)
    assert not link.table.add(closed)
    assert status(closed) is LLMStatusCode.LLM_LINK_FAILED and len(link.table) == 0


def test_overdue_requests_fail_at_their_own_deadlines() -> None:
    link = Link()
    late, soon, sooner = pull(1, after_s(30.0)), pull(2, after_s(0.2)), pull(3, after_s(0.1))
    started = time.monotonic()
    for req in (late, soon, sooner):  # the later first: the one timer comes forward
        link.table.add(req)
    assert status(sooner) is LLMStatusCode.LLM_TIMEOUT
    assert status(soon) is LLMStatusCode.LLM_TIMEOUT
    assert time.monotonic() - started < 2.0
    assert not late.future.done() and len(link.table) == 1
    link.table.fail_all()


def test_answered_requests_leave_few_deadlines_behind() -> None:
    link = Link()
    for rid in range(1, 5001):
        link.table.add(pull(rid, after_s(600.0)))
        assert link.table.settle(rid, None)
    assert len(link.table._deadlines) <= 1100
    link.table.fail_all()


def test_failing_with_the_link_ends_every_request_and_takes_no_more() -> None:
    link = Link()
    plain, busy = pull(1, after_s(600.0)), Request(2, RequestKind.PUSH, None, 8, 0, busy=True)
    link.table.add(plain)
    link.table.add(busy)
    assert link.table.fail_all() == 2
    assert status(plain) is LLMStatusCode.LLM_LINK_FAILED
    assert not busy.future.done()  # its sender still holds its payload
    link.table.sent(busy, None)
    assert status(busy) is LLMStatusCode.LLM_LINK_FAILED
    later = pull(3)
    assert not link.table.add(later)  # even though the link's own flag says open
    assert status(later) is LLMStatusCode.LLM_LINK_FAILED


@pytest.mark.parametrize("enders", [2, 4])
def test_concurrent_enders_end_each_request_once(enders: int) -> None:
    link = Link()
    reqs = [pull(rid) for rid in range(1, 2001)]
    for req in reqs:
        link.table.add(req)
    wins: list[int] = []

    def end() -> None:
        won = 0
        for req in reqs:
            if link.table.settle(req.rid, None):
                won += 1
        wins.append(won)

    threads = [threading.Thread(target=end) for _ in range(enders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert sum(wins) == len(reqs) and len(link.table) == 0
    assert all(req.future.result(0) is None for req in reqs)
