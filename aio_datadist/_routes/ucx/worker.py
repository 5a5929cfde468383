"""UCX objects for one-sided transfers: context, worker, endpoint, registration, remote key.

The foundation of the UCX route. Bytes move with UCP RMA (``ucp_get_nbx``/``ucp_put_nbx``)
between memory that both sides registered with ``ucp_mem_map``; what must cross to the peer
(a worker's address, a registration's packed rkey with its base and length) is plain
``bytes`` here and travels over the link's control plane.

Completion is observed by progress: a single request (:class:`Request`) by
``ucp_request_check_status``; the requests of an :func:`rma` batch by a native completion
that counts them off (:class:`Requests`: done when the count reads 0, one load however many
requests the batch has). Waiting never busy-polls: :meth:`UcxWorker.wait` progresses the
worker, arms it (``ucp_worker_arm``; when it says busy, progress again) and sleeps in
``poll`` on the worker's event fd (``ucp_worker_get_efd``) until the deadline. An event loop
adds :meth:`UcxWorker.event_fd` to its readers and does the same steps when it fires.

Thread mode: the context shares its resources between workers (``mt_workers_shared``) and
each worker is created ``UCS_THREAD_MODE_MULTI``, because the engine starts a transfer in
the caller's thread and may wait for it on the event loop or let a serving thread progress
the same worker; UCX's per-call lock is uncontended in the usual case and costs far less
than the cffi call around it. If a libucp grants less (built without multi-thread support),
the worker serializes its calls with its own lock instead (:attr:`UcxWorker.thread_mode`).

Bounds: UCX checks that an rkey belongs to a registration, but its software and
shared-memory transports (tcp, cma) do not check that an access stays inside it. So a
:class:`RemoteKey` carries the base and length the peer registered, and :func:`get`/
:func:`put` refuse an access outside them (``LLM_PARAM_INVALID``) before UCX sees it. This
protects a well-behaved side from its own mistakes; it cannot stop a peer that bypasses
this library, which is why the route is only offered over an authenticated link.

Errors: every UCS status maps to one documented code (:func:`status_code`) and the message
carries the call, the status name and ``ucs_status_string``:

* ``LLM_LINK_FAILED``: the peer or the transport failed (unreachable, connection reset,
  I/O error, shared-memory segment gone, endpoint timeout, link and endpoint failure
  ranges, a request cancelled because its endpoint closed);
* ``LLM_TIMEOUT``: a deadline passed (ours, or UCX's ``UCS_ERR_TIMED_OUT``);
* ``LLM_PARAM_INVALID``: bad arguments (invalid parameter or address, out of range,
  buffer too small, truncated, and a closed object handed back in);
* ``LLM_OUT_OF_MEMORY``: ``UCS_ERR_NO_MEMORY``;
* ``LLM_FEATURE_NOT_ENABLED``: unsupported or not implemented by this UCX;
* ``LLM_FAILED``: anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import os
import re
import select
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from aio_datadist._native import api as _api
from aio_datadist._native import ucx as _ucx
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = (
    "MEMORY_TYPES",
    "Endpoint",
    "Registration",
    "RemoteKey",
    "Request",
    "Requests",
    "UcxContext",
    "UcxWorker",
    "available",
    "get",
    "put",
    "rma",
    "status_code",
    "ucx_info",
)

ffi = _ucx.ffi

_IDLE_WAKES_FREE = 4
_IDLE_PAUSE_MIN_S = 50e-6
_IDLE_PAUSE_MAX_S = 1e-3
#: Longest round of progress an event loop runs before it lets its other callbacks run.
_LOOP_BUDGET_NS = 500_000
#: Longest round of progress a waiting thread runs before it looks at its condition and
#: deadline again.
_ROUND_NS = 1_000_000

#: ``ucs_memory_type_t`` values by bit, as :attr:`UcxContext.memory_types` names them.
_MEMORY_TYPES = {
    0: "host",
    1: "cuda",
    2: "cuda_managed",
    3: "rocm",
    4: "rocm_managed",
    5: "rdma",
    6: "ze_host",
    7: "ze_device",
    8: "ze_managed",
}
#: Memory types a :class:`Registration` (and a local side of :func:`rma`) may name.
MEMORY_TYPES = {"host": _ucx.UCS_MEMORY_TYPE_HOST, "cuda": _ucx.UCS_MEMORY_TYPE_CUDA}

#: UCX settings a context takes unless the environment names them (``UCX_<name>``).
#: UCX turns reads through CUDA IPC off where it finds no NVLink (over PCIe, reading a peer
#: GPU is slower than writing it); an RMA read of CUDA memory then falls back to software
#: emulation through host memory, about 1 GB/s. This route's pulls are RMA reads, and a read
#: through CUDA IPC is far faster than that fallback: a device-local copy on one GPU, a
#: peer-to-peer read between two.
#:
#: UCX's tcp transport moves an RMA operation in segments of ``TCP_TX_SEG_SIZE`` bytes
#: (8 KiB by default), each a send and a receive with a header, and with RX segments of
#: 64 KiB: a 64 KiB block is nine segments. KV blocks are tens of KiB and more, and 256 KiB
#: segments double this route's W1 and W2 over tcp on one host (``docs/benchmarks.md``).
UCX_DEFAULTS = {
    "CUDA_IPC_ENABLE_GET_ZCOPY": "y",
    "TCP_TX_SEG_SIZE": "256k",
    "TCP_RX_SEG_SIZE": "256k",
}

_LINK_STATUSES = frozenset({-3, -6, -10, -13, -14, -16, -17, -23, -24, -25})
_PARAM_STATUSES = frozenset({-5, -7, -9, -11, -19})


def status_code(status: int) -> LLMStatusCode:
    """The documented code for a failed ``ucs_status_t`` (see the module's table)."""
    if status in _LINK_STATUSES or (
        _ucx.UCS_ERR_LAST_ENDPOINT_FAILURE <= status <= _ucx.UCS_ERR_FIRST_LINK_FAILURE
    ):
        return LLMStatusCode.LLM_LINK_FAILED
    if status in _PARAM_STATUSES:
        return LLMStatusCode.LLM_PARAM_INVALID
    if status == -20:
        return LLMStatusCode.LLM_TIMEOUT
    if status == -4:
        return LLMStatusCode.LLM_OUT_OF_MEMORY
    if status in (-8, -22):
        return LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    return LLMStatusCode.LLM_FAILED


def _error(call: str, status: int) -> LLMException:
    lib = _ucx.load()
    text = ffi.string(lib.ucs_status_string(status)).decode(errors="replace")
    return LLMException(
        f"{call}: {_ucx.status_name(status)}: {text}", status_code=status_code(status)
    )


def _check(call: str, status: int) -> None:
    if status != _ucx.UCS_OK:
        raise _error(call, status)


def _closed(what: str) -> LLMException:
    return LLMException(f"{what} is closed", status_code=LLMStatusCode.LLM_PARAM_INVALID)


def available() -> str | None:
    """``None`` when UCX can be used, else why not (never raises)."""
    return _ucx.load_error()


def _capture(write: Any) -> str:
    """Run ``write(FILE *)`` into an in-memory stream and return what it wrote."""
    libc = _ucx.libc
    buf = ffi.new("char **")
    size = ffi.new("size_t *")
    stream = libc.open_memstream(buf, size)
    if stream == ffi.NULL:
        return ""
    try:
        write(stream)
    finally:
        libc.fclose(stream)
    try:
        return bytes(ffi.buffer(buf[0], size[0])).decode(errors="replace")
    finally:
        libc.free(buf[0])


class UcxContext:
    """One UCP context (one per engine): RMA and wakeup features, shared by its workers."""

    def __init__(self, *, name: str = "aio_datadist") -> None:
        """Raises:
        LLMException: ``LLM_FEATURE_NOT_ENABLED`` when UCX cannot be loaded (the message
            says why), or the code of UCX's failure to initialise.
        """
        try:
            lib = self._lib = _ucx.load()
        except _ucx.UcxLoadError as exc:
            raise LLMException(
                f"UCX is not available: {exc}", status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED
            ) from None
        config = ffi.new("ucp_config_t **")
        _check("ucp_config_read", lib.ucp_config_read(ffi.NULL, ffi.NULL, config))
        for key, value in UCX_DEFAULTS.items():
            if "UCX_" + key not in os.environ:
                # a setting of a transport this UCX lacks is refused: nothing to set then
                lib.ucp_config_modify(config[0], key.encode(), value.encode())
        params = ffi.new("ucp_params_t *")
        self._name = ffi.new("char[]", name.encode()[:31])
        params.field_mask = (
            _ucx.UCP_PARAM_FIELD_FEATURES
            | _ucx.UCP_PARAM_FIELD_MT_WORKERS_SHARED
            | _ucx.UCP_PARAM_FIELD_NAME
        )
        params.features = _ucx.UCP_FEATURE_RMA | _ucx.UCP_FEATURE_WAKEUP
        params.mt_workers_shared = 1
        params.name = self._name
        handle = ffi.new("ucp_context_h *")
        try:
            _check(
                "ucp_init",
                lib.ucp_init_version(_ucx.API_MAJOR, _ucx.API_MINOR, params, config[0], handle),
            )
        finally:
            lib.ucp_config_release(config[0])
        self._handle: Any = handle[0]
        attr = ffi.new("ucp_context_attr_t *")
        attr.field_mask = _ucx.UCP_ATTR_FIELD_THREAD_MODE | _ucx.UCP_ATTR_FIELD_MEMORY_TYPES
        _check("ucp_context_query", lib.ucp_context_query(self._handle, attr))
        self.thread_mode: int = int(attr.thread_mode)
        """The ``ucs_thread_mode_t`` the context was granted."""
        self.memory_types: frozenset[str] = frozenset(
            name for bit, name in _MEMORY_TYPES.items() if int(attr.memory_types) >> bit & 1
        )
        """The memory types the context's transports reach (``"host"``, ``"cuda"``, ...)."""

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise _closed("UCX context")
        return self._handle

    def info(self) -> str:
        """UCX's own description of the context (``ucp_context_print_info``)."""
        handle = self.handle
        return _capture(lambda stream: self._lib.ucp_context_print_info(handle, stream))

    def transports(self) -> list[str]:
        """The ``tl/device`` pairs of the context's resources (what ``UCX_TLS`` let in)."""
        return _resources(self.info())

    def close(self) -> None:
        """Release the context; its workers and registrations must be closed first."""
        if self._handle is not None:
            self._lib.ucp_cleanup(self._handle)
            self._handle = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class UcxWorker:
    """A UCP worker: progresses its endpoints' operations; has an address and an event fd."""

    def __init__(self, context: UcxContext, *, name: str = "aio_datadist") -> None:
        self._lib = context._lib
        self._words = _ucx.load_words()
        self.context = context
        params = ffi.new("ucp_worker_params_t *")
        self._name = ffi.new("char[]", name.encode()[:31])
        params.field_mask = (
            _ucx.UCP_WORKER_PARAM_FIELD_THREAD_MODE
            | _ucx.UCP_WORKER_PARAM_FIELD_EVENTS
            | _ucx.UCP_WORKER_PARAM_FIELD_NAME
        )
        params.thread_mode = _ucx.UCS_THREAD_MODE_MULTI
        params.events = _ucx.UCP_WAKEUP_RMA | _ucx.UCP_WAKEUP_TX | _ucx.UCP_WAKEUP_RX
        params.name = self._name
        handle = ffi.new("ucp_worker_h *")
        _check("ucp_worker_create", self._lib.ucp_worker_create(context.handle, params, handle))
        self._handle: Any = handle[0]
        #: The worker and the UCP calls of a request batch, for the native layer.
        self._word = _ucx.word(self._handle)
        self._calls = _api.UcxCalls(_ucx.call_addresses(_api.UCX_CALLS.values()))
        attr = ffi.new("ucp_worker_attr_t *")
        attr.field_mask = _ucx.UCP_WORKER_ATTR_FIELD_THREAD_MODE
        _check("ucp_worker_query", self._lib.ucp_worker_query(self._handle, attr))
        self.thread_mode: int = int(attr.thread_mode)
        """The ``ucs_thread_mode_t`` granted; below MULTI, :attr:`lock` serializes calls."""
        self.lock: contextlib.AbstractContextManager[Any] = (
            contextlib.nullcontext()
            if self.thread_mode == _ucx.UCS_THREAD_MODE_MULTI
            else threading.RLock()
        )
        fd = ffi.new("int *")
        _check("ucp_worker_get_efd", self._lib.ucp_worker_get_efd(self._handle, fd))
        self._fd = int(fd[0])
        #: Wake-ups in a row that found nothing to do, of the thread in serve_until.
        self._serve_idle = ffi.new("int *")
        # Futures waiting for the event fd, by the loop whose selector watches it.
        self._waiters: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        #: Counts of finished batches, for the next ones (:meth:`counted`).
        self._spare: list[Counted] = []

    def counted(self, memory_type: int | None) -> Counted:
        """A completion count for a batch part started on this worker (or another one that
        shares it), its parameters naming ``memory_type`` (None: host memory): a spare one
        when a finished batch gave one back."""
        try:
            return self._spare.pop().as_memory(memory_type)
        except IndexError:
            return Counted(self).as_memory(memory_type)

    def give_back(self, counted: Counted) -> None:
        """Keep ``counted`` for a later batch, once its requests and their completions all
        finished (else it is dropped: UCX still writes into it, and it is freed when done)."""
        if len(self._spare) < _SPARE_COUNTS and counted.count.reset():
            self._spare.append(counted)

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise _closed("UCX worker")
        return self._handle

    def address(self) -> bytes:
        """This worker's address, for the peer's :class:`Endpoint`."""
        handle = self.handle
        addr = ffi.new("ucp_address_t **")
        length = ffi.new("size_t *")
        with self.lock:
            _check("ucp_worker_get_address", self._lib.ucp_worker_get_address(handle, addr, length))
            try:
                return bytes(ffi.buffer(addr[0], length[0]))
            finally:
                self._lib.ucp_worker_release_address(handle, addr[0])

    def event_fd(self) -> int:
        """The fd that becomes readable when the worker has events (after :meth:`arm`)."""
        self.handle  # noqa: B018 - raises when closed
        return self._fd

    def arm(self) -> bool:
        """Arm the event fd; ``False`` when events are pending (progress again, do not sleep)."""
        handle = self.handle
        with self.lock:
            status = self._lib.ucp_worker_arm(handle)
        if status == -15:  # UCS_ERR_BUSY
            return False
        _check("ucp_worker_arm", status)
        return True

    def drain(self, budget_ns: int = 0) -> bool | None:
        """Progress until nothing is left to do; whether anything was. With ``budget_ns``,
        stop after about that long: None when work was left. (One native call; a worker
        below ``UCS_THREAD_MODE_MULTI`` holds :attr:`lock` for all of it.)"""
        self.handle  # noqa: B018 - raises when closed
        with self.lock:
            return self._calls.drain(self._word, budget_ns)

    def signal(self) -> None:
        """Make the event fd readable, waking a thread sleeping in :meth:`wait`/:meth:`serve`."""
        handle = self.handle
        with self.lock:
            _check("ucp_worker_signal", self._lib.ucp_worker_signal(handle))

    def info(self) -> str:
        """UCX's description of the worker (``ucp_worker_print_info``): its transports."""
        handle = self.handle
        return _capture(lambda stream: self._lib.ucp_worker_print_info(handle, stream))

    def _sleep(
        self, ready: Callable[[], bool], deadline_ns: int | None, idle: list[int], wake_fd: int = -1
    ) -> bool:
        """Progress until idle (a round of at most about a millisecond); unless ``ready()``
        then holds, arm the event fd and sleep on it until an event or the deadline. ``False``
        once the deadline passed.

        ``idle[0]`` counts wake-ups after which progress found nothing to do. UCX's event fd
        can stay readable with no work to do (a tcp endpoint whose peer does not progress
        keeps it signalled); after a few such wake-ups in a row the sleep is stretched, from
        50 us doubling to 1 ms, so that a stalled peer costs no more than a timer would.
        """
        drained = self.drain(_ROUND_NS)
        if drained:
            idle[0] = 0
        if ready():
            return True
        left = None if deadline_ns is None else deadline_ns - time.monotonic_ns()
        if left is not None and left <= 0:
            return False
        if drained is None or not self.arm():
            return True  # work left, or events pending: progress again (the deadline holds)
        timeout_ms = -1 if left is None else max(1, -(-left // 1_000_000))
        pause = _idle_pause(idle[0])
        if pause:
            time.sleep(pause if timeout_ms < 0 else min(pause, timeout_ms / 1000))
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        if wake_fd >= 0:
            poller.register(wake_fd, select.POLLIN)
        if any(fd == wake_fd for fd, _ in poller.poll(timeout_ms)):
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(wake_fd)
        idle[0] += 1
        return True

    def wait_until(
        self, ready: Callable[[], bool], deadline_ns: int | None = None, *, wake_fd: int = -1
    ) -> bool:
        """Progress and sleep on the event fd until ``ready()`` holds (it is asked after every
        round of progress); ``False`` when ``deadline_ns`` (``time.monotonic_ns()``) passed
        first.

        Several threads may wait on one worker, and the one that progresses takes the events
        the others slept for: a waiter whose condition another thread may make true passes
        ``wake_fd`` (a non-blocking ``eventfd``) and has that thread write to it.
        """
        idle = [0]
        while not ready():
            if not self._sleep(ready, deadline_ns, idle, wake_fd):
                return ready()
        return True

    def wait(self, request: Request, deadline_ns: int | None = None) -> None:
        """Block until ``request`` completes, sleeping on the event fd between progress calls.

        Raises:
            LLMException: the request failed (its status's code), or ``LLM_TIMEOUT`` when
                ``deadline_ns`` (``time.monotonic_ns()``) passed first. After a timeout the
                request is still in flight and may still write its local buffer: close the
                endpoint (:meth:`Endpoint.close` with ``force``) before reusing the memory.
        """
        if not self.wait_until(request.done, deadline_ns):
            raise _timed_out(request)
        request.result()

    async def wait_until_async(
        self,
        ready: Callable[[], bool],
        deadline_ns: int | None = None,
        *,
        budget_ns: int = _LOOP_BUDGET_NS,
    ) -> bool:
        """Await until ``ready()`` holds (asked after every round of progress); ``False`` when
        ``deadline_ns`` passed first. Between rounds the worker's event fd sits in the running
        loop's selector (nothing polls), shared by every waiter of this worker on that loop.

        One round of progress runs on the loop for at most about ``budget_ns``; with work
        left, the loop runs its other callbacks before the next round, so a large transfer
        never holds the loop for long.
        """
        loop = asyncio.get_running_loop()
        idle = 0
        while True:
            drained = self.drain(budget_ns)
            if drained:
                idle = 0
            if ready():
                return True
            if drained is None or not self.arm():
                await asyncio.sleep(0)  # work left or events pending: let the loop run first
                continue
            left_s = None
            if deadline_ns is not None:
                left_s = (deadline_ns - time.monotonic_ns()) / 1e9
                if left_s <= 0:
                    return ready()
            pause = _idle_pause(idle)  # woken for nothing again: as :meth:`_sleep`
            if pause:
                await asyncio.sleep(pause if left_s is None else min(pause, left_s))
            woken = self._loop_waiter(loop)
            try:
                await asyncio.wait({woken}, timeout=left_s)  # the deadline is checked above
            finally:
                if not woken.done():  # timed out or cancelled: no longer waiting
                    self._forget_waiter(loop, woken)
            idle += 1

    async def wait_async(self, request: Request, deadline_ns: int | None = None) -> None:
        """Await ``request`` on the running event loop (:meth:`wait_until_async`). Raises as
        :meth:`wait`, and the same holds after a timeout: the request is still in flight.
        """
        if not await self.wait_until_async(request.done, deadline_ns):
            raise _timed_out(request)
        request.result()

    def _loop_waiter(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A future set when the event fd is next readable on ``loop`` (one reader per loop
        for every waiter; it leaves the selector once no one waits)."""
        waiters = self._waiters.get(loop)
        if waiters is None:
            waiters = self._waiters[loop] = []
            loop.add_reader(self._fd, self._wake_waiters, loop)
        future: asyncio.Future[None] = loop.create_future()
        waiters.append(future)
        return future

    def _forget_waiter(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
        future.cancel()
        waiters = self._waiters.get(loop)
        if waiters is not None and future in waiters:
            waiters.remove(future)
            if not waiters:
                del self._waiters[loop]
                loop.remove_reader(self._fd)

    def _wake_waiters(self, loop: asyncio.AbstractEventLoop) -> None:
        waiters = self._waiters.pop(loop, [])
        loop.remove_reader(self._fd)
        for future in waiters:
            if not future.done():
                future.set_result(None)

    def serve_until(
        self,
        turn: _api.UcxTurn,
        wake_fd: int,
        deadline_ns: int | None,
        until_work: bool,
        spin_ns: int = 0,
    ) -> bool | None:
        """One native wait of a serving thread: progress and sleep on the event fd until
        ``deadline_ns`` passed, ``wake_fd`` was written after :meth:`~_api.UcxTurn.look`, or,
        with ``until_work``, progress found work (True); standing down (no progress, asleep
        on ``wake_fd`` only) while ``turn`` counts waiters, and busy-polling for ``spin_ns``
        after work before it sleeps (:meth:`_api.UcxCalls.serve`). None where the worker is
        below ``UCS_THREAD_MODE_MULTI``: its lock may not be held for a sleep (use
        :meth:`wait_until`)."""
        if self.thread_mode != _ucx.UCS_THREAD_MODE_MULTI:
            return None
        self.handle  # noqa: B018 - raises when closed
        return self._calls.serve(
            self._word,
            self._fd,
            wake_fd,
            deadline_ns or 0,
            until_work,
            self._serve_idle,
            turn,
            spin_ns,
        )

    def serve(self, stop: threading.Event) -> None:
        """Progress this worker until ``stop`` is set (then call :meth:`signal` to wake it).

        The target of a transfer over a software transport (tcp) must progress its worker for
        the transfer to move; a serving thread runs this.
        """
        idle = [0]
        while not stop.is_set():
            self._sleep(stop.is_set, None, idle)

    def flush(self, deadline_ns: int | None = None) -> None:
        """Complete every operation this worker started (``ucp_worker_flush_nbx``)."""
        handle = self.handle
        param = ffi.new("ucp_request_param_t *")
        with self.lock:
            ptr = self._lib.ucp_worker_flush_nbx(handle, param)
        self.wait(Request(self, ptr, "ucp_worker_flush_nbx"), deadline_ns)

    def close(self) -> None:
        """Destroy the worker; its endpoints must be closed first."""
        if self._handle is not None:
            with self.lock:
                self._lib.ucp_worker_destroy(self._handle)
            self._handle = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _idle_pause(idle: int) -> float:
    """Seconds to wait before sleeping on the event fd after ``idle`` wake-ups in a row that
    found nothing to do (0 for the first few; then from 50 us doubling to 1 ms)."""
    if idle <= _IDLE_WAKES_FREE:
        return 0.0
    doublings = min(idle - _IDLE_WAKES_FREE, 32)  # past the cap long before; never overflows
    return float(min(_IDLE_PAUSE_MAX_S, _IDLE_PAUSE_MIN_S * 2**doublings))


def _timed_out(request: Request) -> LLMException:
    return LLMException(
        f"UCX {request.what} did not complete before its deadline",
        status_code=LLMStatusCode.LLM_TIMEOUT,
    )


class Request:
    """An operation in flight (or already finished when UCX completed it at once).

    :meth:`done` checks it without blocking (the worker must be progressed for it to move);
    :meth:`result` raises its failure. The UCX request is freed once it is seen complete.
    """

    __slots__ = ("_ptr", "_status", "what", "worker")

    def __init__(self, worker: UcxWorker, ptr: Any, what: str) -> None:
        self.worker = worker
        self.what = what
        word = ptr if isinstance(ptr, int) else _ucx.word(ptr)
        status = _ucx.word_status(word)
        self._status = status
        #: The request's address while it is in flight (0 once it is not).
        self._ptr = word if status == _ucx.UCS_INPROGRESS else 0

    def done(self) -> bool:
        """Whether the operation finished (successfully or not)."""
        if self._ptr:
            words = self.worker._words
            with self.worker.lock:
                status = int(words.ucp_request_check_status(self._ptr))
                if status != _ucx.UCS_INPROGRESS:
                    words.ucp_request_free(self._ptr)
                    self._ptr = 0
            self._status = status
        return self._status != _ucx.UCS_INPROGRESS

    @property
    def status(self) -> int:
        """The ``ucs_status_t`` as of the last :meth:`done` (``UCS_INPROGRESS`` until then)."""
        return self._status

    def result(self) -> None:
        """Raise the failure of a finished request; nothing for success.

        Raises:
            LLMException: the request failed, or ``LLM_PARAM_INVALID`` if it is not done.
        """
        if not self.done():
            raise LLMException(
                f"UCX {self.what} is still in flight", status_code=LLMStatusCode.LLM_PARAM_INVALID
            )
        _check(self.what, self._status)

    def abandon(self) -> None:
        """Stop tracking an unfinished request: UCX frees it when it completes."""
        if self._ptr:
            with self.worker.lock:
                self.worker._words.ucp_request_free(self._ptr)
            self._ptr = 0


class Counted:
    """A completion count for one part of an :func:`rma` batch, with the request parameters
    that name it (``dd_ucx_counted`` and the count as user data), kept by the worker that made
    it for the next batch once the requests counted in it finished (:meth:`Requests.release`)."""

    __slots__ = ("count", "memory_type", "owner", "param", "word")

    def __init__(self, owner: UcxWorker) -> None:
        #: The worker whose spares this count returns to.
        self.owner = owner
        self.count = owner._calls.count()
        self.param = ffi.new("ucp_request_param_t *")
        self.param.op_attr_mask = _COUNTED_FIELDS
        self.param.cb.send = _COUNTED
        self.param.user_data = ffi.cast("void *", self.count.address)
        #: The parameters' address, as the native batch takes it.
        self.word = _ucx.word(self.param)
        #: The local memory's type the parameters name (None: host memory, the default).
        self.memory_type: int | None = None

    def as_memory(self, memory_type: int | None) -> Counted:
        """Name the local memory's type in the parameters (None: host memory, the default)."""
        if memory_type == self.memory_type:
            return self
        self.memory_type = memory_type
        param = self.param
        if memory_type is None:
            param.op_attr_mask = _COUNTED_FIELDS
        else:
            param.op_attr_mask = _COUNTED_FIELDS | _ucx.UCP_OP_ATTR_FIELD_MEMORY_TYPE
            param.memory_type = memory_type
        return self


class Requests:
    """The requests of one :func:`rma` batch: each one's completion takes it off the batch's
    native count (and UCX frees it), so a look at the batch is one load.

    As :class:`Request` for a batch: :meth:`done` once every one finished, :meth:`result`
    raises the failure of the first that failed.
    """

    __slots__ = ("_count", "_counted", "_left", "_status", "what", "worker")

    def __init__(self, counted: Counted | None, what: str, worker: UcxWorker) -> None:
        self.what = what
        #: The worker whose progress completes the requests.
        self.worker = worker
        self._counted = counted
        self._count = None if counted is None else counted.count
        self._left, self._status = (0, 0) if self._count is None else self._count.left()

    def release(self) -> None:
        """(Every request finished: :meth:`done`.) Give the batch's count back to its worker
        for a later batch (:meth:`UcxWorker.counted`); the requests read as done from now."""
        counted = self._counted
        if counted is None or self._left:
            return
        self._counted = self._count = None
        counted.owner.give_back(counted)

    def __len__(self) -> int:
        """How many requests are still in flight (as of the last :meth:`done`)."""
        return self._left

    def notify(self, worker: UcxWorker) -> None:
        """Have the last completion signal ``worker`` (:meth:`UcxWorker.signal`) when another
        one progresses the requests: a thread asleep on ``worker``'s event fd then wakes. Call
        :meth:`done` after: either it sees them all done or the signal comes."""
        if self._count is not None and worker is not self.worker:
            self._count.notify(_ucx.word(worker.handle))

    def spin(self, spin_ns: int) -> bool:
        """Progress :attr:`worker` without sleeping until every request finished or
        ``spin_ns`` passed (a waiter's busy-poll before it sleeps): whether they all did."""
        count = self._count
        if self._left and count is not None:
            self.worker.handle  # noqa: B018 - raises when closed
            self.worker._calls.spin(self.worker._word, count, spin_ns)
        return self.done()

    def done(self) -> bool:
        """Whether every request finished (successfully or not)."""
        if self._left and self._count is not None:
            self._left, self._status = self._count.left()
        return not self._left

    def result(self) -> None:
        """Raise the failure of the first request that failed; nothing when all succeeded.

        Raises:
            LLMException: a request failed, or ``LLM_PARAM_INVALID`` if some are not done.
        """
        if not self.done():
            raise LLMException(
                f"UCX {self.what}: {self._left} requests still in flight",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        _check(self.what, self._status)


class Endpoint:
    """A connection from ``worker`` to the worker whose :meth:`UcxWorker.address` is given.

    Created in peer error-handling mode: when the peer or the transport fails, pending and
    later operations fail (``LLM_LINK_FAILED``) instead of UCX aborting the process, and
    :attr:`failure` holds the status UCX reported.
    """

    def __init__(
        self, worker: UcxWorker, remote_address: bytes, *, peer_errors: bool = True, name: str = ""
    ) -> None:
        if not isinstance(remote_address, (bytes, bytearray, memoryview)) or not remote_address:
            raise LLMException(
                "a UCX worker address must be non-empty bytes",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        self.worker = worker
        self._lib = worker._lib
        self.failure: int | None = None
        """The ``ucs_status_t`` the error handler reported, once the endpoint failed."""
        self._address = ffi.from_buffer(bytes(remote_address))
        self._on_error = ffi.callback("void(void *, ucp_ep_h, ucs_status_t)", self._failed)
        params = ffi.new("ucp_ep_params_t *")
        params.field_mask = (
            _ucx.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | _ucx.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | _ucx.UCP_EP_PARAM_FIELD_ERR_HANDLER
        )
        params.address = ffi.cast("ucp_address_t *", self._address)
        params.err_mode = (
            _ucx.UCP_ERR_HANDLING_MODE_PEER if peer_errors else _ucx.UCP_ERR_HANDLING_MODE_NONE
        )
        params.err_handler.cb = self._on_error
        params.err_handler.arg = ffi.NULL
        if name:
            self._name = ffi.new("char[]", name.encode()[:31])
            params.field_mask |= _ucx.UCP_EP_PARAM_FIELD_NAME
            params.name = self._name
        handle = ffi.new("ucp_ep_h *")
        with worker.lock:
            _check("ucp_ep_create", self._lib.ucp_ep_create(worker.handle, params, handle))
        self._handle: Any = handle[0]
        self._word = _ucx.word(self._handle)

    def _failed(self, _arg: Any, _ep: Any, status: int) -> None:
        # Runs inside ucp_worker_progress, in the thread that progresses the worker.
        self.failure = int(status)

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise _closed("UCX endpoint")
        if self.failure is not None:
            raise _error("UCX endpoint", self.failure)
        return self._handle

    @property
    def word(self) -> int:
        """:attr:`handle` as an int, for the native layer (raises as :attr:`handle` does)."""
        self.handle  # noqa: B018 - raises when closed or failed
        return self._word

    def transports(self) -> list[str]:
        """The ``tl/device`` of each of the endpoint's lanes (``ucp_ep_print_info``), in lane
        order; empty before UCX chose them."""
        handle = self.handle
        text = _capture(lambda stream: self._lib.ucp_ep_print_info(handle, stream))
        found: list[str] = []
        for match in _LANE.finditer(text):
            if match[1] not in found:
                found.append(match[1])
        return found

    def flush_request(self) -> Request:
        """Start completing every operation started on this endpoint so far (remotely, for
        puts): the request completes once they did (``ucp_ep_flush_nbx``)."""
        handle = self.handle
        param = ffi.new("ucp_request_param_t *")
        with self.worker.lock:
            ptr = self._lib.ucp_ep_flush_nbx(handle, param)
        return Request(self.worker, ptr, "ucp_ep_flush_nbx")

    def flush(self, deadline_ns: int | None = None) -> None:
        """Complete every operation started on this endpoint (``ucp_ep_flush_nbx``)."""
        handle = self.handle
        param = ffi.new("ucp_request_param_t *")
        with self.worker.lock:
            ptr = self._lib.ucp_ep_flush_nbx(handle, param)
        self.worker.wait(Request(self.worker, ptr, "ucp_ep_flush_nbx"), deadline_ns)

    def close(self, deadline_ns: int | None = None, *, force: bool = False) -> None:
        """Close the endpoint: flush it first, or with ``force`` (or after a failure) drop it,
        failing what is still in flight. A flush that misses the deadline closes by force."""
        if self._handle is None:
            return
        force = force or self.failure is not None
        param = ffi.new("ucp_request_param_t *")
        if force:
            param.op_attr_mask = _ucx.UCP_OP_ATTR_FIELD_FLAGS
            param.flags = _ucx.UCP_EP_CLOSE_FLAG_FORCE
        with self.worker.lock:
            ptr = self._lib.ucp_ep_close_nbx(self._handle, param)
        self._handle = None
        request = Request(self.worker, ptr, "ucp_ep_close_nbx")
        try:
            self.worker.wait(request, deadline_ns)
        except LLMException:
            request.abandon()
            if not force:
                raise

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(time.monotonic_ns() + 5_000_000_000, force=exc is not None)


def _check_span(addr: int, nbytes: int, what: str) -> None:
    if not isinstance(addr, int) or not isinstance(nbytes, int):
        raise TypeError(f"{what} address and length must be int")
    if addr <= 0 or nbytes <= 0 or addr + nbytes > 1 << 64:
        raise LLMException(
            f"{what}: invalid span addr=0x{addr:x} nbytes={nbytes}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )


class Registration:
    """Memory ``[addr, addr + nbytes)`` of this process registered with ``context``.

    :attr:`rkey` is the packed remote key the peer unpacks into a :class:`RemoteKey`; send it
    with :attr:`addr` and :attr:`nbytes`. The memory must outlive the registration.
    """

    def __init__(
        self,
        context: UcxContext,
        addr: int,
        nbytes: int,
        *,
        remote_write: bool = True,
        memory: str = "host",
    ) -> None:
        """``memory``: where the memory lives (a key of :data:`MEMORY_TYPES`; ``"cuda"``
        needs a context whose :attr:`~UcxContext.memory_types` has it).

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` for an empty span or an unknown memory type,
                ``LLM_FEATURE_NOT_ENABLED`` for a memory type the context cannot reach, or
                the code of UCX's failure.
        """
        _check_span(addr, nbytes, "UCX registration")
        if memory not in MEMORY_TYPES:
            raise LLMException(
                f"UCX registration: unknown memory type {memory!r}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        if memory not in context.memory_types:
            raise LLMException(
                f"UCX registration: this UCX reaches no {memory} memory "
                f"(it reaches {sorted(context.memory_types)})",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        self.context = context
        self.addr = addr
        self.nbytes = nbytes
        #: Where the memory lives (a key of :data:`MEMORY_TYPES`).
        self.memory = memory
        lib = self._lib = context._lib
        params = ffi.new("ucp_mem_map_params_t *")
        params.field_mask = (
            _ucx.UCP_MEM_MAP_PARAM_FIELD_ADDRESS
            | _ucx.UCP_MEM_MAP_PARAM_FIELD_LENGTH
            | _ucx.UCP_MEM_MAP_PARAM_FIELD_PROT
            | _ucx.UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE
        )
        params.address = ffi.cast("void *", addr)
        params.length = nbytes
        params.prot = (
            _ucx.UCP_MEM_MAP_PROT_LOCAL_READ
            | _ucx.UCP_MEM_MAP_PROT_LOCAL_WRITE
            | _ucx.UCP_MEM_MAP_PROT_REMOTE_READ
            | (_ucx.UCP_MEM_MAP_PROT_REMOTE_WRITE if remote_write else 0)
        )
        params.memory_type = MEMORY_TYPES[memory]
        memh = ffi.new("ucp_mem_h *")
        _check("ucp_mem_map", lib.ucp_mem_map(context.handle, params, memh))
        self._memh: Any = memh[0]
        packed = ffi.new("void **")
        size = ffi.new("size_t *")
        try:
            _check("ucp_rkey_pack", lib.ucp_rkey_pack(context.handle, self._memh, packed, size))
        except LLMException:
            lib.ucp_mem_unmap(context.handle, self._memh)
            raise
        try:
            self.rkey: bytes = bytes(ffi.buffer(packed[0], size[0]))
        finally:
            lib.ucp_rkey_buffer_release(packed[0])

    @property
    def closed(self) -> bool:
        return self._memh is None

    def close(self) -> None:
        """Unregister the memory; the peer's remote keys for it stop working."""
        if self._memh is not None:
            memh, self._memh = self._memh, None
            _check("ucp_mem_unmap", self._lib.ucp_mem_unmap(self.context.handle, memh))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteKey:
    """The peer's registration ``[addr, addr + nbytes)`` as reachable through ``endpoint``."""

    def __init__(self, endpoint: Endpoint, packed: bytes, addr: int, nbytes: int) -> None:
        _check_span(addr, nbytes, "UCX remote key")
        if not isinstance(packed, (bytes, bytearray)) or not packed:
            raise LLMException(
                "a packed UCX rkey must be non-empty bytes",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        self.endpoint = endpoint
        self.addr = addr
        self.nbytes = nbytes
        lib = self._lib = endpoint._lib
        rkey = ffi.new("ucp_rkey_h *")
        with endpoint.worker.lock:
            _check(
                "ucp_ep_rkey_unpack",
                lib.ucp_ep_rkey_unpack(endpoint.handle, ffi.from_buffer(bytes(packed)), rkey),
            )
        self._handle: Any = rkey[0]
        self._word = _ucx.word(self._handle)

    @property
    def handle(self) -> Any:
        if self._handle is None:
            raise _closed("UCX remote key")
        return self._handle

    @property
    def word(self) -> int:
        """:attr:`handle` as an int, for the native layer (raises as :attr:`handle` does)."""
        self.handle  # noqa: B018 - raises when closed
        return self._word

    def close(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._lib.ucp_rkey_destroy(handle)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rma(
    call: str, ep: Endpoint, local_addr: int, nbytes: int, remote_addr: int, rkey: RemoteKey
) -> Request:
    _check_span(local_addr, nbytes, call)
    _check_span(remote_addr, nbytes, call)
    if rkey.endpoint is not ep:
        raise LLMException(
            f"{call}: the remote key was unpacked on another endpoint",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    if remote_addr < rkey.addr or remote_addr + nbytes > rkey.addr + rkey.nbytes:
        raise LLMException(
            f"{call}: [0x{remote_addr:x}, +{nbytes}) is outside the peer's registration "
            f"[0x{rkey.addr:x}, +{rkey.nbytes})",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    rkey_h = rkey.handle
    ep_h = ep.handle
    param = ffi.new("ucp_request_param_t *")
    lib = ep._lib
    with ep.worker.lock:
        if call == "ucp_get_nbx":
            ptr = lib.ucp_get_nbx(
                ep_h, ffi.cast("void *", local_addr), nbytes, remote_addr, rkey_h, param
            )
        else:
            ptr = lib.ucp_put_nbx(
                ep_h, ffi.cast("void *", local_addr), nbytes, remote_addr, rkey_h, param
            )
    return Request(ep.worker, ptr, call)


def get(ep: Endpoint, local_addr: int, nbytes: int, remote_addr: int, rkey: RemoteKey) -> Request:
    """Start reading the peer's ``[remote_addr, +nbytes)`` into ``[local_addr, +nbytes)``.

    Raises:
        LLMException: ``LLM_PARAM_INVALID`` for a span outside the remote key's registration
            or a closed key; a UCX failure at start with its code.
    """
    return _rma("ucp_get_nbx", ep, local_addr, nbytes, remote_addr, rkey)


def put(ep: Endpoint, local_addr: int, nbytes: int, remote_addr: int, rkey: RemoteKey) -> Request:
    """Start writing ``[local_addr, +nbytes)`` into the peer's ``[remote_addr, +nbytes)``.

    Completion means the data left the local buffer (it may be reused); flush the endpoint
    to know it reached the peer's memory.
    """
    return _rma("ucp_put_nbx", ep, local_addr, nbytes, remote_addr, rkey)


class RemoteKeys:
    """The remote keys of one endpoint through which a transfer's ops reach the peer: sorted
    by address, with the rows the native layer looks each op's key up in."""

    __slots__ = ("_prepared", "bounds", "endpoint", "keys", "spans", "words")

    def __init__(self, endpoint: Endpoint, keys: Sequence[RemoteKey]) -> None:
        """Bundle ``keys``, all unpacked on ``endpoint``.

        Raises:
            LLMException: ``LLM_PARAM_INVALID`` for a key unpacked on another endpoint.
        """
        if any(k.endpoint is not endpoint for k in keys):
            raise LLMException(
                "UCX rma: a remote key was unpacked on another endpoint",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        self.endpoint = endpoint
        self.keys = tuple(sorted(keys, key=lambda k: k.addr))
        #: ``(address, nbytes)`` of each key, in order.
        self.spans = tuple((k.addr, k.nbytes) for k in self.keys)
        #: Rows ``(address, end)`` of the keys, for the native lookup.
        self.bounds = _api.Words(
            np.array([(a, a + n) for a, n in self.spans], dtype=np.uint64).reshape(-1, 2)
        )
        #: The keys' handles, in order.
        self.words = _api.Words([k._word for k in self.keys])
        #: The parts last prepared with these keys first (:func:`_parts`).
        self._prepared: _Parts | None = None

    def check_open(self) -> None:
        """Raises ``LLM_PARAM_INVALID`` once one of the keys closed, and as
        :attr:`Endpoint.handle` once the endpoint closed or failed."""
        endpoint = self.endpoint
        if endpoint._handle is None or endpoint.failure is not None:
            endpoint.handle  # noqa: B018 - raises
        if None in map(_HANDLE, self.keys):
            for key in self.keys:
                key.handle  # noqa: B018 - raises


class _Parts:
    """What a transfer through ``bundles`` (one part each, ``lanes[i]`` progressing part
    ``i``'s worker) needs, made once: the native parts, each part's worker, the locks of the
    workers below ``UCS_THREAD_MODE_MULTI``, and each part's count (:meth:`start`), kept for
    the next transfer unless requests counted in it are still in flight (:meth:`take`). One
    transfer at a time uses it (:attr:`busy`)."""

    __slots__ = ("bundles", "busy", "counted", "given", "lanes", "native", "serial", "workers")

    def __init__(
        self,
        bundles: tuple[RemoteKeys, ...],
        lanes: tuple[_api.UcxLaneThread | None, ...],
        given: Sequence[_api.UcxLaneThread | None] = (),
    ) -> None:
        self.bundles, self.lanes = bundles, lanes
        #: The lanes as the transfer that prepared them named them (a later transfer that
        #: names the same object and bundles takes these parts without comparing further).
        self.given = given
        self.workers = tuple(keys.endpoint.worker for keys in bundles)
        self.native = _api.UcxParts(
            bundles[0].bounds,
            [
                _api.UcxPart(keys.endpoint.word, keys.words, lane)
                for keys, lane in zip(bundles, lanes, strict=True)
            ],
        )
        self.serial = [w.lock for w in self.workers if w.thread_mode != _MULTI]
        self.busy = threading.Lock()
        self.counted: list[Counted | None] = [None] * len(bundles)

    def take(self, i: int) -> Counted:
        """Part ``i``'s count, for requests counted in it still in flight (the next transfer
        binds another one)."""
        part = self.counted[i]
        assert part is not None  # (armed)
        self.counted[i] = None
        return part

    def start(
        self,
        ops: npt.NDArray[np.uint64] | _api.BlockPairs,
        memory_type: int | None,
        *,
        write: bool,
        flush: bool,
        progress_ns: int,
        what: str,
    ) -> tuple[list[Requests], LLMException | None]:
        """(:attr:`busy` held.) Start the non-empty ``ops`` through these parts, their local
        memory of ``memory_type`` (None: host): see :func:`rma`. Every part first gets a
        count whose parameters name ``memory_type``: the one it kept, or a new one."""
        counted, workers = self.counted, self.workers
        for i, part in enumerate(counted):
            if part is None:
                part = counted[i] = workers[i].counted(memory_type)
                self.native.bind(i, part.word, part.count)
            elif part.memory_type != memory_type:
                part.as_memory(memory_type)
        serial = self.serial
        for lock in serial:
            lock.__enter__()
        try:
            held, slots = workers[0]._calls.transfer(
                ops,
                self.native,
                write=write,
                flush=flush,
                worker=workers[0]._word,
                progress_ns=progress_ns,
            )
        finally:
            for lock in reversed(serial):
                lock.__exit__(None, None, None)
        if held < len(ops):  # nothing started
            rows = ops.ops() if isinstance(ops, _api.BlockPairs) else ops
            local, remote, nbytes = (int(v) for v in rows[held])
            raise LLMException(
                f"{what}: [0x{remote:x}, +{nbytes}) from local 0x{local:x} is outside the "
                f"peer's registrations",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        requests: list[Requests] = []
        failure: LLMException | None = None
        for i, slot in enumerate(slots):
            if slot.started and not slot.done:  # (else not started, or done: count as new)
                requests.append(Requests(self.take(i), what, workers[i]))
            if failure is None and (slot.status or slot.failed):
                failure = _error(what, slot.status or slot.failed)
        return requests, failure


def _lanes(
    lanes: Sequence[_api.UcxLaneThread | None], size: int
) -> tuple[_api.UcxLaneThread | None, ...]:
    """The lanes of ``size`` parts: the first ``size`` of ``lanes``, None for the rest."""
    kept = tuple(lanes[:size])
    return kept + (None,) * (size - len(kept))


def _parts(
    bundles: Sequence[RemoteKeys], lanes: Sequence[_api.UcxLaneThread | None], what: str
) -> _Parts:
    """The parts of a transfer through ``bundles``, held for it (release :attr:`_Parts.busy`
    after it): the ones prepared last with the same first bundle when they match and no other
    transfer holds them, else new ones (kept for the next transfer).

    :raises LLMException: ``LLM_PARAM_INVALID``: the bundles' keys name different
        registrations, or one closed; as :attr:`Endpoint.handle` for a closed endpoint.
    """
    first = bundles[0]
    for keys in bundles:
        keys.check_open()
    bundles = tuple(bundles)
    prepared = first._prepared
    if prepared is not None and prepared.bundles == bundles:  # (spans checked when made)
        # the same tuple names the same lanes; else compare them as they will be used
        same = (prepared.given is lanes and type(lanes) is tuple) or prepared.lanes == _lanes(
            lanes, len(bundles)
        )
        if same and prepared.busy.acquire(blocking=False):
            return prepared
    for keys in bundles:
        if keys.spans != first.spans:
            raise LLMException(
                f"{what}: the parts' remote keys name different registrations",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
    prepared = _Parts(bundles, _lanes(lanes, len(bundles)), lanes)
    prepared.busy.acquire()
    first._prepared = prepared
    return prepared


def rma(
    ops: npt.NDArray[np.uint64] | _api.BlockPairs,
    parts: Sequence[RemoteKeys],
    *,
    write: bool,
    local_memory: str = "host",
    flush: bool = False,
    lanes: Sequence[_api.UcxLaneThread | None] = (),
    progress_ns: int = 0,
) -> tuple[list[Requests], LLMException | None]:
    """Start one get per op ``(local address, remote address, nbytes)`` of ``ops`` (one put
    with ``write``), the remote side through the key of the part's :class:`RemoteKeys` that
    holds it: one native call checks every op, cuts the bytes into one run per part (about
    equal, at 4 KiB multiples; one run below 8 KiB) and starts each run on its part's
    endpoint, neighbouring ops that continue each other merged. ``lanes[i]`` is the thread
    that progresses part ``i``'s worker (woken once its run started; the lanes' runs start
    first); a part without one is progressed by the caller.

    ``local_memory`` says where the local side lives (a key of :data:`MEMORY_TYPES`). With
    ``flush`` a flush of each part's endpoint follows its run in the same batch (puts are
    then done once they reached the peer's memory). Every part's keys must name the same
    registrations. ``ops`` may be :class:`~aio_datadist._native.api.BlockPairs` instead
    (the native call makes the ops). With ``progress_ns``, the call then progresses the
    first part's worker for at most that long, until its requests completed or a round
    finds nothing to do (a small transfer over shared memory completes in it).

    Returns the requests of each part started and still in flight (with ``progress_ns``, a
    part whose requests all completed in the call has none: its count is ready for the next
    batch, and its failure is returned), and the failure of what UCX refused to start or of
    a request completed in the call, if anything: the requests before a refusal were started
    (wait for them), the rest not.

    Raises:
        LLMException: ``LLM_PARAM_INVALID``, nothing started: an op of no bytes, outside
            every key's registration, parts whose keys differ, or a closed key.
    """
    what = "ucp_put_nbx" if write else "ucp_get_nbx"
    if not len(ops):
        return [Requests(None, what, parts[0].endpoint.worker)], None
    prepared = _parts(parts, lanes, what)
    try:
        return prepared.start(
            ops,
            MEMORY_TYPES[local_memory] if local_memory != "host" else None,
            write=write,
            flush=flush,
            progress_ns=progress_ns,
            what=what,
        )
    finally:
        prepared.busy.release()


_MULTI = _ucx.UCS_THREAD_MODE_MULTI
#: A remote key's handle (None once closed).
_HANDLE = operator.attrgetter("_handle")
#: The most finished batches' counts a worker keeps for the next ones.
_SPARE_COUNTS = 64
#: A counted batch's requests complete through the native count (``dd_ucx_counted``).
_COUNTED = ffi.cast("ucp_send_nbx_callback_t", _api.UCX_COUNTED)
_COUNTED_FIELDS = _ucx.UCP_OP_ATTR_FIELD_CALLBACK | _ucx.UCP_OP_ATTR_FIELD_USER_DATA

_LANE = re.compile(r"lane\[\d+\]:\s*\d+:(\S+?)(?:\.\d+)?\s")
_RESOURCE = re.compile(r"#\s*resource\s+\d+\s*:\s*md\s+\d+\s+dev\s+\d+\s+flags\s+\S+\s+(\S+)/(\S+)")


def _resources(text: str) -> list[str]:
    found: list[str] = []
    for line in text.splitlines():
        match = _RESOURCE.search(line)
        if match and f"{match[1]}/{match[2]}" not in found:
            found.append(f"{match[1]}/{match[2]}")
    return found


def ucx_info() -> dict[str, Any]:
    """What UCX offers here: ``available``, and when it is, ``path``, ``version``, the
    ``transports`` (``tl/device`` pairs a context selected under the current ``UCX_*``
    environment) and the ``memory_types`` they reach; ``reason`` when it is not."""
    reason = _ucx.load_error()
    if reason is not None:
        return {"available": False, "reason": reason}
    lib = _ucx.load()
    major, minor, release = (ffi.new("unsigned *") for _ in range(3))
    lib.ucp_get_version(major, minor, release)
    info: dict[str, Any] = {
        "available": True,
        "path": _ucx.loaded_path(),
        "version": f"{major[0]}.{minor[0]}.{release[0]}",
        "tls": os.environ.get("UCX_TLS", "all"),
    }
    try:
        with UcxContext(name="aio_datadist_info") as context:
            info["transports"] = _resources(context.info())
            info["thread_mode"] = context.thread_mode
            info["memory_types"] = sorted(context.memory_types)
    except LLMException as exc:
        info["transports"] = []
        info["error"] = str(exc)
    return info
