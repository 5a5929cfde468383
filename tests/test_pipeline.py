"""The transfer pipeline's pieces: a link's route list, the first route that takes a
transfer, and what a call does (every request starts, the first failure is raised once
all ended, the pins go only when the last request completed)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from aio_datadist._engine.access import Access, Target
from aio_datadist._engine.driver import Start, Wait, run_call
from aio_datadist._engine.request import DONE, Completion, Plan, Transfer
from aio_datadist._engine.routes import (
    LinkRoute,
    Route,
    Staged,
    link_routes,
    placed,
    start_on,
)
from aio_datadist._routes.hccl.domain import CommRoute
from aio_datadist._routes.hccl.route import CommunicatorRoute
from aio_datadist._routes.samehost.route import DeviceIpcRoute, SameHostRoute
from aio_datadist._transport.base import RequestKind
from aio_datadist.aio import _advance, _Overdue, _wait
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.sync import drive

S = LLMStatusCode


def transfer(cluster_id: int = 1, *, device: bool = False) -> Transfer:
    rows = np.array([[0x1000, 64]], dtype=np.uint64)
    access = Access(Target.BLOCKS_KEY, tensor_count=1, seg_bytes=64, blocks=np.zeros(1, np.uint64))
    return Transfer(
        RequestKind.PULL,
        cluster_id,
        access,
        rows,
        entry=None,
        device=device,
        nbytes=64,  # type: ignore[arg-type]
    )


class FakePump:
    """A pump the loop may watch (and that counts the watches); a waiter that drives it
    (blocking, or a loop's busy-poll) reads the answer of the request it waits for."""

    watched = True

    def __init__(self) -> None:
        self.watching = 0
        self.read: list[Future[None]] = []
        self.spun: list[Future[None]] = []

    def read_for(self, future: Future[None], deadline_ns: int) -> None:
        self.read.append(future)
        future.set_result(None)

    def spin(self, future: Future[None], deadline_ns: int) -> None:
        self.spun.append(future)
        future.set_result(None)

    def watch(self, loop: asyncio.AbstractEventLoop) -> Any:
        self.watching += 1

        def end() -> None:
            self.watching -= 1

        return end


class Recorded(Route):
    """A route that records what it started and answers as told (``"pending"``: a new
    future each time, in :attr:`futures`); with ``pump``, one whose requests cross a link
    the loop may watch."""

    def __init__(
        self, name: str, *, takes: bool = True, outcome: Any = "done", pump: bool = False
    ) -> None:
        self.name = name
        self.takes = takes
        self.outcome = outcome
        self.pump = FakePump() if pump else None
        self.started: list[Transfer] = []
        self.futures: list[Future[None]] = []

    def link(self) -> Any:
        return self.pump

    def accepts(self, t: Transfer) -> bool:
        return self.takes

    def start(self, t: Transfer, deadline_ns: int) -> Completion | None:
        self.started.append(t)
        if self.outcome == "decline":
            return None
        if isinstance(self.outcome, LLMException):
            raise self.outcome
        if isinstance(self.outcome, Future):
            return Completion(self.outcome, deadline_ns)
        if self.outcome == "pending":
            self.futures.append(Future())
            return Completion(self.futures[-1], deadline_ns, self.pump)
        return DONE


class Links:
    """A link table stand-in: the routes of every cluster."""

    metrics = None

    def __init__(self, routes: list[Route]) -> None:
        self.routes = routes

    def route(self, cluster_id: int) -> Links:
        if cluster_id == 404:
            raise LLMException("not linked", status_code=S.LLM_NOT_YET_LINK)
        return self


class FakeChannel:
    streams = False
    pull_in_caller = False
    push_in_caller = True


def test_a_new_link_lists_its_routes_in_order() -> None:
    channel: Any = FakeChannel()
    peer: Any = object()
    staging: Any = object()
    one_sided = (SameHostRoute, DeviceIpcRoute)

    def with_peer(routes: list[Route]) -> list[Route]:
        return placed(routes, (SameHostRoute(peer), DeviceIpcRoute(peer)), one_sided)

    def with_domain(routes: list[Route], route: CommunicatorRoute) -> list[Route]:
        return placed(routes, (route,), CommunicatorRoute)

    assert [type(r) for r in link_routes(channel, staging)] == [LinkRoute, Staged]
    routes = with_peer(link_routes(channel, staging))
    assert [type(r) for r in routes] == [SameHostRoute, DeviceIpcRoute, LinkRoute, Staged]
    member = CommRoute(communicator=object(), peer_rank=1)  # type: ignore[arg-type]
    joined = with_domain(routes, CommunicatorRoute(channel, member))
    assert [type(r) for r in joined] == [
        SameHostRoute,
        CommunicatorRoute,
        DeviceIpcRoute,
        LinkRoute,
        Staged,
    ]
    assert [type(r) for r in placed(joined, (), CommunicatorRoute)] == [
        SameHostRoute,
        DeviceIpcRoute,
        LinkRoute,
        Staged,
    ]
    # A peer proven after a domain's route went in: the communicator route keeps its place.
    late = with_peer(with_domain(link_routes(channel, staging), CommunicatorRoute(channel, member)))
    assert [type(r) for r in late] == [type(r) for r in joined]
    # Placed again, a provider's routes replace its earlier ones.
    assert [type(r) for r in with_peer(late)] == [type(r) for r in joined]
    # Without a runtime to stage through, the link takes host rows only.
    assert [type(r) for r in link_routes(channel, None)] == [LinkRoute]


def test_the_first_route_that_takes_a_transfer_moves_it_and_a_decline_falls_through() -> None:
    skip = Recorded("skip", takes=False)
    decline = Recorded("decline", outcome="decline")
    take = Recorded("take")
    after = Recorded("after")
    t = transfer()
    assert start_on([skip, decline, take, after], t, 0) == (take, DONE)
    assert (skip.started, decline.started, take.started, after.started) == ([], [t], [t], [])


def test_a_call_starts_every_request_and_raises_the_first_failure_once_all_ended() -> None:
    pending: Future[None] = Future()
    refused = LLMException("no such cache", status_code=S.LLM_KV_CACHE_NOT_EXIST)
    released: list[bool] = []
    routes: list[Route] = [Recorded("a", outcome=pending, pump=True)]
    plan = Plan([transfer(), transfer(404), transfer()], 10**18, lambda _: released.append(True))
    # The async face's view: a start crossing a pump is yielded (the loop watches it); the
    # missing link's has nothing for the loop to do, so the call starts it itself.
    call = run_call(plan, Links(routes))  # type: ignore[arg-type]
    ops = []
    op = next(call)
    while isinstance(op, Start):
        ops.append(op)
        op = call.send(op.begin())
    assert len(ops) == 2 and isinstance(op, Wait)
    assert not released  # two requests run: the pins stay
    pending.set_exception(refused)
    with pytest.raises(LLMException) as info:
        while True:
            op = call.throw(refused) if op.completion.future is pending else call.send(None)
    # The missing link of the second request started (and failed) like the others; the
    # first failure in request order is what the call raises.
    assert info.value is refused
    assert released == [True]


def test_the_blocking_face_drives_a_call_to_its_end() -> None:
    released: list[bool] = []
    route = Recorded("a")
    plan = Plan([transfer(), transfer()], 10**18, lambda _: released.append(True))
    drive(run_call(plan, Links([route])))  # type: ignore[arg-type]
    assert len(route.started) == 2 and released == [True]
    refused = Recorded("b", outcome=LLMException("x", status_code=S.LLM_PARAM_INVALID))
    plan = Plan([transfer()], 10**18, lambda _: released.append(True))
    with pytest.raises(LLMException) as info:
        drive(run_call(plan, Links([refused])))  # type: ignore[arg-type]
    assert info.value.status_code == S.LLM_PARAM_INVALID and released == [True, True]


def test_a_blocking_caller_drives_the_pump_of_each_request_it_waits_for() -> None:
    route = Recorded("a", outcome="pending", pump=True)
    assert route.pump is not None
    for n in (1, 3):
        plan = Plan([transfer() for _ in range(n)], 10**18, lambda _: None)
        drive(run_call(plan, Links([route])))  # type: ignore[arg-type]
        assert route.pump.read == route.futures[-n:]  # each answer read in the caller
        route.pump.read.clear()
    assert route.pump.spun == []  # a blocking caller never busy-polls for a loop


async def test_the_loop_busy_polls_only_for_a_lone_request_with_nothing_else_ready() -> None:
    route = Recorded("a", outcome="pending", pump=True)
    pump = route.pump
    assert pump is not None

    async def call(n: int) -> None:
        plan = Plan([transfer() for _ in range(n)], 10**18, lambda _: None)
        overdue = _Overdue(asyncio.get_running_loop())
        driver = _advance(run_call(plan, Links([route])), plan, overdue)  # type: ignore[arg-type]
        for future in route.futures[-n:]:  # what no busy-poll read arrives later
            if not future.done():
                future.set_result(None)
        if driver is not None:
            await driver.finish()

    await call(1)
    assert pump.spun == route.futures[-1:]  # read in the busy-poll: the call ended inline
    await call(2)
    assert len(pump.spun) == 1  # two requests: the loop never busy-polls
    # Another task ready to run: this one never holds the loop to busy-poll.
    other = asyncio.get_running_loop().create_task(asyncio.sleep(0))
    await call(1)
    await other
    assert len(pump.spun) == 1 and pump.read == []
    assert pump.watching == 0  # every watch ended
    # A route with nothing for the loop to watch is started by the call itself.
    plain = Recorded("b")
    plan = Plan([transfer()], 10**18, lambda _: None)
    overdue = _Overdue(asyncio.get_running_loop())
    assert _advance(run_call(plan, Links([plain])), plan, overdue) is None  # type: ignore[arg-type]
    assert len(plain.started) == 1


async def test_an_awaited_request_the_transport_never_ends_times_out_and_waits_share_a_timer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aio_datadist._engine.request as request

    monkeypatch.setattr(request, "GRACE_S", 0.0)  # the net gives up at the deadline
    loop = asyncio.get_running_loop()
    overdue = _Overdue(loop)
    deadline = request.now_ns() + 50_000_000
    lost = [Completion(Future(), deadline) for _ in range(3)]  # never completed
    answered: Future[None] = Future()
    scheduled = len(loop._scheduled)  # type: ignore[attr-defined]
    waits = [asyncio.ensure_future(_wait(c, overdue)) for c in lost]
    later = deadline + 60 * 10**9  # (its net stays armed through the test)
    kept = asyncio.ensure_future(_wait(Completion(answered, later), overdue))
    await asyncio.sleep(0)
    assert len(loop._scheduled) <= scheduled + 3  # type: ignore[attr-defined]
    answered.set_result(None)  # (as a transport completes a request in another thread)
    await kept
    for wait in waits:
        with pytest.raises(LLMException) as err:
            await asyncio.wait_for(wait, 5)
        assert err.value.status_code == LLMStatusCode.LLM_TIMEOUT
    # Nothing of a wait outlives it: the net holds no waiter once every one has ended.
    assert not any(overdue._slots.values())
