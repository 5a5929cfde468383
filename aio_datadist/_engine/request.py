"""The request model of the transfer pipeline: one :class:`Transfer` per request, a
:class:`Plan` per call, and the :class:`Completion` every route returns.

Every pull and push, of caches or blocks, by key, id or address, layer-wise or not, from
either face, is planned (``_engine.planner``) into :class:`Transfer` values: the kind, the
peer, the :class:`~aio_datadist._engine.access.Access` naming the peer's memory, this side's
rows and the local cache that holds them. A :class:`Plan` holds a call's transfers, its
deadline and the pins on its local caches until every started request completed. A route
(``_engine.routes``) starts a transfer and returns a :class:`Completion`; the faces only
wait for completions.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import numpy as np

from aio_datadist._engine.access import NO_ROWS, Access, Target
from aio_datadist._engine.registry import CacheEntry
from aio_datadist._native import api
from aio_datadist._native.api import BlockLayout
from aio_datadist._transport.base import Iov, RequestKind
from aio_datadist._transport.deadlines import now_ns
from aio_datadist.status import LLMStatusCode, LLMTimeoutError

__all__ = (
    "DONE",
    "DONE_FUTURE",
    "GRACE_S",
    "Blocks",
    "Completion",
    "Plan",
    "Pump",
    "RemoteBlocks",
    "Transfer",
)

#: Extra time a waiter gives a transport past the deadline before reporting a timeout itself.
GRACE_S = 5.0


class Blocks:
    """Local rows named compactly: ``seg`` bytes of each listed block of ``count`` tensors
    from ``start`` of a blocks cache's layout, in payload order (tensor-major)."""

    __slots__ = ("blocks", "count", "layout", "seg", "start")

    def __init__(
        self, layout: BlockLayout, start: int, count: int, blocks: Sequence[int], seg: int
    ) -> None:
        self.layout = layout
        self.start = start
        self.count = count
        self.blocks = blocks
        self.seg = seg


class RemoteBlocks:
    """The peer's memory named compactly: ``seg`` bytes (whole blocks) of each listed block
    of ``count`` tensors from ``start`` of its blocks cache ``model_id``. A transfer holding
    one builds its :class:`Access` only when a route needs it."""

    __slots__ = ("blocks", "count", "model_id", "seg", "start")

    def __init__(
        self, model_id: int, start: int, count: int, blocks: Sequence[int], seg: int
    ) -> None:
        self.model_id = model_id
        self.start = start
        self.count = count
        self.blocks = blocks
        self.seg = seg

    def access(self) -> Access:
        """The :class:`Access` naming the same memory."""
        return Access(
            Target.BLOCKS_KEY,
            ident=self.model_id,
            tensor_start=self.start,
            tensor_count=self.count,
            seg_bytes=self.seg,
            blocks=np.asarray(self.blocks, dtype=np.uint64),
            rows=NO_ROWS,
            deliver=NO_ROWS,
        )


class Transfer:
    """One request: which local rows move to or from which memory of which peer.

    ``local`` is explicit ``(addr, len)`` rows, or :class:`Blocks` whose rows are built on
    demand (:attr:`rows`); the peer's memory is an :class:`Access`, or
    :class:`RemoteBlocks` whose access is built on demand (:attr:`access`): a route moving
    blocks natively builds neither.
    """

    __slots__ = (
        "_access",
        "_rows",
        "cluster_id",
        "commit",
        "device",
        "entry",
        "kind",
        "local",
        "nbytes",
        "remote",
    )

    def __init__(
        self,
        kind: RequestKind,
        cluster_id: int,
        access: Access | RemoteBlocks,
        local: Iov | Blocks,
        entry: CacheEntry,
        device: bool = False,
        commit: bool = False,
        nbytes: int = 0,
    ) -> None:
        self.kind = kind
        self.cluster_id = cluster_id
        #: The peer's memory in compact form, when it was named so (else None).
        self.remote: RemoteBlocks | None = access if access.__class__ is RemoteBlocks else None
        self._access: Access | None = None if self.remote is not None else access  # type: ignore[assignment]
        self.local = local
        #: The local cache holding the rows (pinned by the plan).
        self.entry = entry
        #: True when ``local`` is device memory of this engine's runtime.
        self.device = device
        #: The peer commits (drops the key it was asked by) once every byte landed here.
        self.commit = commit
        self.nbytes = nbytes
        self._rows: Iov | None = None

    @property
    def access(self) -> Access:
        """The :class:`Access` naming the peer's memory."""
        if self._access is None:
            assert self.remote is not None
            self._access = self.remote.access()
        return self._access

    @property
    def target(self) -> Target:
        """How the access names the peer's cache."""
        return Target.BLOCKS_KEY if self.remote is not None else self.access.target

    @property
    def rows(self) -> Iov:
        """The local ``(addr, len)`` rows, in payload order."""
        if self._rows is None:
            local = self.local
            if isinstance(local, Blocks):
                self._rows = api.block_rows(
                    local.layout, local.start, local.count, local.blocks, local.seg
                )
            else:
                self._rows = local
        return self._rows


def _completed() -> Future[None]:
    done: Future[None] = Future()
    done.set_result(None)
    return done


#: The future of every request that completed in the calling thread (one, shared: never
#: complete it again).
DONE_FUTURE: Future[None] = _completed()


class Pump(Protocol):
    """What a waiter may drive so that its requests complete sooner: the frame pump of the
    link they crossed (a :class:`~aio_datadist._transport.base.Channel`), or the progress of
    the UCX worker that moves them (``_routes.ucx.route.UcxProgress``)."""

    #: True when a loop that awaits a request watches the pump from before the request
    #: starts (:meth:`watch`): the call then yields its start to the face.
    watched: bool

    def read_for(self, future: Future[None], deadline_ns: int) -> None:
        """Help ``future`` complete in the calling thread, which would otherwise just wait;
        return once it completed or the helping stopped."""
        ...

    def spin(self, future: Future[None], deadline_ns: int) -> None:
        """Help ``future`` complete in the calling thread, an event loop with nothing else
        to run, for at most the busy-poll time (never longer: what is still to come then
        arrives through :meth:`watch`)."""
        ...

    def watch(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        """Let ``loop`` (running in the calling thread) help complete the requests it awaits
        until the returned call ends the watch; None when it does not."""
        ...


class Completion:
    """A started request: done already, or a future completed by another thread.

    One type for every route. ``pump`` is set when a waiter may drive the request itself:
    read its answer from the link it crossed, or progress the UCX worker that moves it (the
    waiting policy of the face).
    """

    __slots__ = ("deadline_ns", "future", "pump")

    def __init__(self, future: Future[None], deadline_ns: int, pump: Pump | None = None) -> None:
        self.future = future
        self.deadline_ns = deadline_ns
        self.pump = pump

    def done(self) -> bool:
        """True once the request completed (successfully or not)."""
        return self.future is DONE_FUTURE or self.future.done()

    def exception(self) -> BaseException | None:
        """The failure of a completed request (None on success)."""
        return None if self.future is DONE_FUTURE else self.future.exception()

    def raise_failure(self) -> None:
        """Raise the failure of a completed request (nothing on success)."""
        if self.future is not DONE_FUTURE:
            error = self.future.exception()
            if error is not None:
                raise error

    def add_done_callback(self, fn: Callable[[Future[None]], object]) -> None:
        """Call ``fn(future)`` once the request completed (at once when it has)."""
        self.future.add_done_callback(fn)

    def timeout_s(self) -> float:
        """Seconds a waiter gives the request: until its deadline, plus :data:`GRACE_S`
        for the transport to report a timeout itself."""
        return max(0.0, (self.deadline_ns - now_ns()) / 1e9) + GRACE_S

    def spin(self) -> None:
        """Drive the request for at most its pump's busy-poll time in this thread (an event
        loop with nothing else to run, whose call has no other request); it may still be
        running after."""
        if self.pump is not None and not self.future.done():
            self.pump.spin(self.future, self.deadline_ns)

    def wait(self) -> None:
        """Wait in this thread (the blocking face): drive the request here where its pump
        can (read the link's answer, progress the UCX worker), then sleep on the future
        until the deadline (plus :data:`GRACE_S`).

        :raises LLMException: the request failed, or ``LLM_TIMEOUT``.
        """
        future = self.future
        if future is DONE_FUTURE:
            return
        if self.pump is not None and not future.done():
            self.pump.read_for(future, self.deadline_ns)
        try:
            future.result(timeout=self.timeout_s())
        except FutureTimeout:
            raise LLMTimeoutError(
                "transfer did not complete within sync_kv_timeout",
                status_code=LLMStatusCode.LLM_TIMEOUT,
            ) from None


#: The completion of every request that completed in the calling thread.
DONE = Completion(DONE_FUTURE, 0)


def completed(future: Future[None] | None, deadline_ns: int, pump: Pump | None) -> Completion:
    """The completion of a request whose future is ``future`` (None: completed already)."""
    if future is None or future is DONE_FUTURE:
        return DONE
    return Completion(future, deadline_ns, pump)


#: Guards the pending counts of every plan (held for one decrement: no plan needs its own).
_COUNTS = threading.Lock()


class Plan:
    """The transfers of one call, its deadline, and the local pins they hold until every
    started request completed (whoever waits, so a caller that gives up never frees
    memory a request still writes)."""

    __slots__ = ("_inflight", "_pending", "_pins", "_unpin", "deadline_ns", "transfers")

    def __init__(
        self,
        transfers: list[Transfer],
        deadline_ns: int,
        unpin: Callable[[Sequence[CacheEntry]], object],
        pins: Sequence[CacheEntry] = (),
    ) -> None:
        self.transfers = transfers
        self.deadline_ns = deadline_ns
        #: Called with ``pins`` once (the local caches the call holds).
        self._unpin = unpin
        self._pins = pins
        self._pending = 1
        #: The requests that did not complete in the caller (None: none so far).
        self._inflight: list[Completion] | None = None

    @property
    def nbytes(self) -> int:
        """Payload bytes of every transfer."""
        return sum(t.nbytes for t in self.transfers)

    def track(self, completion: Completion) -> None:
        """Hold the pins until ``completion`` completes (called by the starting thread)."""
        if completion is DONE or completion.done():
            return
        if self._inflight is None:
            self._inflight = [completion]
        else:
            self._inflight.append(completion)
        with _COUNTS:
            self._pending += 1
        completion.add_done_callback(self._one_done)

    def seal(self) -> None:
        """No more transfers will start: release the pins once the started ones completed."""
        if self._inflight is None:  # every request completed in the caller
            self.release()
            return
        self._one_done(None)

    def release(self) -> None:
        """Let the local caches go (every started request completed)."""
        self._unpin(self._pins)

    def inflight(self) -> list[Completion]:
        """The requests started that had not completed in the caller (whoever gives up
        waiting for the call waits for these first)."""
        return self._inflight or []

    def _one_done(self, _: object) -> None:
        with _COUNTS:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self.release()
