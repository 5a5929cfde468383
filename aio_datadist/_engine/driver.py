"""What a transfer call does, written once as generators that both faces drive.

A call's generator yields what it needs from its face and gets the answer back:

* :class:`Start`: run ``begin()`` (it starts one transfer on its link's routes and returns
  its :class:`~aio_datadist._engine.request.Completion`), asked only when a face may have
  something to do: an event loop watches the pump the request will cross (then begins
  inline), or runs a large payload moved in the caller on a worker thread; a blocking
  face begins it at once. Every other start the call makes itself.
* :class:`Wait`: wait for a completion; a failure is thrown back into the generator.
* :class:`Synchronize`: ask the layer synchroniser whether layer ``n`` may go (what it
  returned); its exception is thrown back, or :class:`TaskCancelled` when the task was
  cancelled while it waited.

So the order of things, the results, cancellation at layer edges and settling a
``CacheTask`` live here; the faces differ only in how they wait (``sync.py``: in the
calling thread; ``aio.py``: on the event loop), as psycopg's generators and waiting
functions do.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from aio_datadist._engine.layerwise import LayerJob
from aio_datadist._engine.links import LinkTable
from aio_datadist._engine.metrics import TransferMetrics
from aio_datadist._engine.offload import INLINE_BYTES
from aio_datadist._engine.request import DONE, Completion, Plan, Transfer
from aio_datadist._engine.routes import Route, first_accepting, start_on
from aio_datadist._transport.deadlines import now_ns
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.task import CacheTask

__all__ = (
    "Call",
    "Start",
    "Synchronize",
    "TaskCancelled",
    "Wait",
    "run_call",
    "run_layers",
    "settle",
)


class Start:
    """Start one transfer of ``nbytes``: call :meth:`begin` (inline, or on a worker thread
    when :meth:`offloaded`)."""

    __slots__ = ("deadline_ns", "metrics", "nbytes", "route", "routes", "transfer")

    def __init__(
        self,
        routes: Sequence[Route],
        transfer: Transfer,
        deadline_ns: int,
        metrics: TransferMetrics | None,
        route: Route,
    ) -> None:
        self.routes = routes
        self.transfer = transfer
        self.deadline_ns = deadline_ns
        self.metrics = metrics
        self.nbytes = transfer.nbytes
        #: The first of ``routes`` that accepts the transfer.
        self.route = route

    def offloaded(self) -> bool:
        """True when an event loop runs :meth:`begin` on a worker thread (see
        :func:`_offloaded`)."""
        return _offloaded(self.route, self.transfer)

    def watch(self) -> tuple[object, Callable[[], None]] | None:
        """Let the running event loop drive the request's pump (the first route that accepts
        the transfer says) from before it starts: read the answers of the link it will cross
        (``Channel.watch``). That pump, and the call that ends the watch; None when the pump
        wants no watch (the request moves in the caller, or its pump is put to work by the
        start itself: the UCX worker) or declines."""
        pump = self.route.link()
        if pump is None or not pump.watched:
            return None
        end = pump.watch(asyncio.get_running_loop())
        return None if end is None else (pump, end)

    def begin(self) -> Completion:
        """Start the transfer on the first route that takes it (see :func:`_begin`)."""
        return _begin(self.routes, self.transfer, self.deadline_ns, self.metrics, self.route)


class Wait:
    """Wait for ``completion``; its failure is thrown back into the generator."""

    __slots__ = ("completion",)

    def __init__(self, completion: Completion) -> None:
        self.completion = completion


@dataclass(frozen=True, slots=True)
class Synchronize:
    """Ask the synchroniser whether ``layer`` may go."""

    layer: int


class TaskCancelled(Exception):
    """Thrown into a layer job by a face whose wait for the synchroniser the task's
    ``cancel()`` cut short."""


#: A call's generator: it yields what it needs and returns when the call is over.
Call = Generator[Start | Wait | Synchronize, Any, None]


def _begin(
    routes: Sequence[Route],
    transfer: Transfer,
    deadline_ns: int,
    metrics: TransferMetrics | None,
    accepting: Route | None = None,
) -> Completion:
    """Start ``transfer`` on the first of ``routes`` that takes it (``routes.start_on``;
    ``accepting``: the first that accepts it, when known); the one place where every
    transfer is recorded in ``metrics`` as it ends."""
    if metrics is None:
        return start_on(routes, transfer, deadline_ns, accepting)[1]
    started = now_ns()
    route, completion = start_on(routes, transfer, deadline_ns, accepting)
    if completion is DONE:
        metrics.record(route.name, transfer, started, None)
    elif completion.done():
        metrics.record(route.name, transfer, started, completion.exception())
    else:
        completion.add_done_callback(partial(_record, metrics, route.name, transfer, started))
    return completion


def _record(
    metrics: TransferMetrics, route: str, transfer: Transfer, started: int, future: Future[None]
) -> None:
    """Record a transfer whose request ended in another thread (or on the loop)."""
    metrics.record(route, transfer, started, future.exception())


def _routes(links: LinkTable, cluster_id: int) -> Sequence[Route]:
    """The routes of the link to ``cluster_id`` (none: one that fails every transfer)."""
    try:
        return links.route(cluster_id).routes
    except LLMException as exc:
        return (_Refused(exc),)


def _start(links: LinkTable, transfer: Transfer, deadline_ns: int) -> Start:
    """The start of ``transfer`` on the routes of its link."""
    routes = _routes(links, transfer.cluster_id)
    route = first_accepting(routes, transfer)
    return Start(routes, transfer, deadline_ns, links.metrics, route)


def _offloaded(route: Route, transfer: Transfer) -> bool:
    """True when starting ``transfer`` on ``route`` moves more than ``INLINE_BYTES`` in the
    calling thread, which an event loop leaves to a worker thread."""
    return transfer.nbytes > INLINE_BYTES and route.in_caller(transfer)


def _plain(route: Route, transfer: Transfer) -> bool:
    """True when starting ``transfer`` on ``route`` needs nothing of an event loop, so the
    call starts it inline: the route has no pump for the loop to watch from before the
    start (``Pump.watched``), and the start is not :func:`_offloaded`."""
    pump = route.link()
    return (pump is None or not pump.watched) and not _offloaded(route, transfer)


class _Refused(Route):
    """Where a transfer to a cluster with no usable link goes: it fails with why."""

    name = "refused"

    def __init__(self, error: LLMException) -> None:
        self.error = error

    def accepts(self, transfer: Transfer) -> bool:
        return True

    def in_caller(self, transfer: Transfer) -> bool:
        return False

    def start(self, transfer: Transfer, deadline_ns: int) -> Completion | None:
        raise self.error


def run_call(plan: Plan, links: LinkTable, *, inline: bool = False) -> Call:
    """A pull or push call: start every transfer of ``plan``, then wait for each; raise
    the first failure once all ended. The call yields a :class:`Start` only where a face
    may have something to do for it (:func:`_plain`: a pump to watch, or a large payload
    moved in the caller) and starts the others itself; all of them with ``inline`` (a face
    that begins every :class:`Start` where it runs, at once: the blocking one)."""
    started: list[Completion] = []
    try:
        for transfer in plan.transfers:
            routes = _routes(links, transfer.cluster_id)
            route = first_accepting(routes, transfer)
            if inline or _plain(route, transfer):
                completion = _begin(routes, transfer, plan.deadline_ns, links.metrics, route)
            else:
                completion = yield Start(routes, transfer, plan.deadline_ns, links.metrics, route)
            if completion is not DONE:  # (DONE: completed in the caller, a one-sided copy)
                plan.track(completion)
                started.append(completion)
    finally:
        plan.seal()
    first: LLMException | None = None
    for completion in started:
        try:
            if completion.done():  # nothing to wait for
                completion.raise_failure()
            else:
                yield Wait(completion)
        except LLMException as exc:
            first = first or exc
    if first is not None:
        raise first


def settle(call: Call, task: CacheTask) -> Call:
    """``call`` whose outcome becomes the one result of ``task`` (``push_blocks`` of the
    async face): the task finishes with success or the call's exception, never raising."""
    try:
        yield from call
    except LLMException as exc:
        task._set_result(0, exc.status_code, exc)
    else:
        task._set_result(0, LLMStatusCode.LLM_SUCCESS)
    finally:
        task._finish()


def run_layers(job: LayerJob, task: CacheTask, links: LinkTable) -> Call:
    """``transfer_cache_async``: for each layer, once the synchroniser lets it go, start its
    requests without waiting for them (layer k moves while the model finishes layer k+1);
    then wait for every request and fill the task's results. ``task.cancel()`` and failures
    stop the job at a layer edge; a request already started completes."""
    try:
        for layer in range(job.num_layers):
            indices = job.targets(layer)
            if not indices:
                continue
            if task._cancelled or job.stopped:
                break
            try:
                ready = yield Synchronize(layer)
            except TaskCancelled:
                break  # cancelled while the model computed the layer
            except Exception as exc:  # the user's synchroniser raised: kept, logged once
                job.synchronizer_failed(layer, indices, exc)
                break
            if task._cancelled:
                break
            if not ready:
                job.synchronizer_refused(layer, indices, ready)
                break
            for i, transfer in job.transfers(layer, indices):
                completion = yield _start(links, transfer, job.plan.deadline_ns)
                job.track(task, i, layer, completion)
        for completion in job.completions:
            with contextlib.suppress(LLMException):  # recorded by the job when it completed
                yield Wait(completion)
    finally:
        job.finish(task)
