"""The requesting side of transfers: pulls and pushes planned, started and completed.

Every transfer call is split like the local copies: ``plan_*`` validates the arguments,
resolves the local cache, checks the link, pins local memory and builds one :class:`Step`
per request (the local memory rows plus an :class:`~aio_datadist._engine.access.Access` that
names the peer's memory). :meth:`TransferService.start` hands a step to its channel; the
faces wait for the returned futures (blocking, or awaited). Pins are released once every
started request has completed, whoever waits, so a caller that gives up never frees memory
a transfer still writes.

Calls between two blocks caches by ``BlocksCacheKey`` are checked (``check_*_blocks``) into
a compact :class:`BlocksCall` instead, which runs on a direct route without building steps
(:meth:`TransferService.start_blocks`) and becomes a plan only where that route does not
take it (:meth:`TransferService.plan_blocks`).

Device rows of a request to a member of this engine's rank-table domain go through the
domain's communicator when that runtime has one (:mod:`aio_datadist._engine.domain`): the
request names them and the serving side moves the bytes; nothing is staged here.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from aio_datadist._engine.access import Access, Target, encode_access, encode_blocks_access
from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.domain import NO_ROWS, CommRoute, CommRoutes
from aio_datadist._engine.links import LinkTable
from aio_datadist._engine.onesided import PeerMemory
from aio_datadist._engine.registry import CacheEntry
from aio_datadist._memory.staging import Staged
from aio_datadist._native import api
from aio_datadist._transport.base import Channel, Iov, Payload, RequestKind
from aio_datadist._validate import INVALID_ID, check_int, check_int_list, check_type
from aio_datadist.cache import Cache
from aio_datadist.status import (
    FeatureNotEnabledError,
    LLMException,
    LLMStatusCode,
    LLMTimeoutError,
    ParamInvalidError,
)
from aio_datadist.types import (
    BlocksCacheKey,
    CacheKey,
    CacheKeyByIdAndIndex,
    check_blocks_key_range,
)

__all__ = (
    "GRACE_S",
    "Step",
    "TransferPlan",
    "TransferService",
    "local_rows",
    "tensor_span",
    "wait_blocking",
)

#: Extra time a waiter gives a transport past the deadline before reporting a timeout itself.
GRACE_S = 5.0
_PULL_KWARGS = frozenset({"src_layer_range", "dst_layer_range", "tensor_num_per_layer"})


def _invalid(message: str) -> ParamInvalidError:
    return ParamInvalidError(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def tensor_span(
    name: str, layers: Any, per_layer: int, num_tensors: int, *, local: bool
) -> tuple[int, int] | None:
    """Tensor ``(start, count)`` of a layer range; None for a None or empty range (all).

    :raises TypeError: not a range.
    :raises LLMException: ``LLM_PARAM_INVALID`` for a step other than 1, a negative start,
        or (``local``) tensors past ``num_tensors``.
    """
    if layers is None:
        return None
    check_type(name, layers, range)
    if len(layers) == 0 and layers.step == 1 and layers.start >= 0:
        return None
    if layers.step != 1 or not 0 <= layers.start < layers.stop or layers.stop > 2**32:
        raise _invalid(f"{name} must have step 1 and 0 <= start < stop, but got {layers}")
    start, count = layers.start * per_layer, len(layers) * per_layer
    if local and start + count > num_tensors:
        raise _invalid(
            f"{name} {layers} with {per_layer} tensors per layer needs tensors up to "
            f"{start + count}, but the cache has {num_tensors}"
        )
    return start, count


def local_rows(
    entry: CacheEntry, tensors: tuple[int, int], *, row: int = 0, seg: int, blocks: Any = None
) -> Iov:
    """Rows of a local cache: one segment per tensor at batch ``row``, or the listed blocks."""
    start, count = tensors
    if blocks is not None:
        return api.block_rows(entry.layout, start, count, blocks, seg)
    rows = np.empty((count, 2), dtype=np.uint64)
    rows[:, 0] = np.asarray(entry.addrs[start : start + count], dtype=np.uint64)
    rows[:, 0] += np.uint64(row * entry.row_bytes)
    rows[:, 1] = seg
    return rows


def check_blocks(name: str, blocks: Sequence[int], num_blocks: int) -> None:
    """Refuse a block index outside ``[0, num_blocks)`` with ``LLM_PARAM_INVALID``."""
    for b in blocks:
        if b >= num_blocks:
            raise _invalid(f"{name} block index {b} is outside [0, {num_blocks})")


@dataclass(eq=False)
class Step:
    """One request: local rows and the access naming the peer's memory."""

    channel: Channel
    kind: RequestKind
    access: Access
    local: Iov
    commit: bool = False
    #: The one-sided route to a same-host peer, when the step may take it.
    peer: PeerMemory | None = None
    #: True when ``local`` is device memory, staged through host buffers on every route
    #: but a domain's communicator.
    device: bool = False
    #: The domain's communicator, when it moves this request's bytes.
    route: CommRoute | None = None

    @property
    def nbytes(self) -> int:
        """Payload bytes of this request."""
        return int(self.local[:, 1].sum()) if len(self.local) else 0

    @property
    def exchangeable(self) -> bool:
        """True when a blocking caller may hand the whole request to its link
        (:meth:`Channel.exchange`): host rows over the link, nothing to confirm after."""
        return self.peer is None and not self.device and not self.commit

    @property
    def in_caller(self) -> bool:
        """True when starting the step moves its payload (or stages it) in the calling
        thread."""
        if self.route is not None:
            return False  # a request without payload: the serving side moves the bytes
        if self.peer is not None or self.device:
            return True
        return (
            self.channel.pull_in_caller
            if self.kind is RequestKind.PULL
            else self.channel.push_in_caller
        )


@dataclass(slots=True, eq=False)
class BlocksCall:
    """A checked ``pull_blocks``/``push_blocks`` between two blocks caches by
    ``BlocksCacheKey``, before any request exists.

    It pins its local cache from the check on; whoever takes it over
    (:meth:`TransferService.run_blocks` or :meth:`TransferService.plan_blocks`) lets the pin
    go once the bytes moved.
    """

    kind: RequestKind
    cluster_id: int
    #: The peer's blocks key.
    model_id: int
    entry: CacheEntry
    #: ``(first tensor, tensors)`` here and on the peer.
    local: tuple[int, int]
    remote: tuple[int, int]
    local_blocks: Sequence[int]
    remote_blocks: Sequence[int]

    @property
    def nbytes(self) -> int:
        """Payload bytes of the call."""
        return self.local[1] * len(self.local_blocks) * self.entry.row_bytes

    def access(self) -> Access:
        """The access naming the peer's blocks."""
        return Access(
            Target.BLOCKS_KEY,
            ident=self.model_id,
            tensor_start=self.remote[0],
            tensor_count=self.remote[1],
            seg_bytes=self.entry.row_bytes,
            blocks=np.asarray(self.remote_blocks, dtype=np.uint64),
        )

    def rows(self) -> Iov:
        """The local rows, in payload order."""
        return local_rows(
            self.entry, self.local, seg=self.entry.row_bytes, blocks=self.local_blocks
        )


@dataclass(eq=False)
class TransferPlan:
    """The requests of one transfer call and the local pins they hold until all complete."""

    steps: list[Step]
    deadline_ns: int
    release: Callable[[], None]
    _pending: int = 1
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        """Payload bytes of every step."""
        return sum(step.nbytes for step in self.steps)

    def track(self, future: Future[None]) -> None:
        """Hold the pins until ``future`` completes."""
        if future is DONE:
            return
        with self._lock:
            self._pending += 1
        future.add_done_callback(self._one_done)

    def seal(self) -> None:
        """No more steps will start: release the pins once the started ones completed."""
        self._one_done(None)

    def _one_done(self, _: object) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self.release()


def _finished_after(moved: Future[None], staged: Staged) -> Future[None]:
    """A future that completes once ``moved`` did and ``staged`` was finished accordingly."""
    result: Future[None] = Future()

    def finish(future: Future[None]) -> None:
        error = None if future.cancelled() else future.exception()
        ok = not future.cancelled() and error is None
        try:
            staged.finish(ok)
        except Exception as exc:
            error = error or exc
        if future.cancelled():
            result.cancel()
        elif error is not None:
            result.set_exception(error)
        else:
            result.set_result(None)

    moved.add_done_callback(finish)
    return result


def _completed() -> Future[None]:
    done: Future[None] = Future()
    done.set_result(None)
    return done


#: The future of every step that completed in the calling thread (finished, never cancelled).
DONE: Future[None] = _completed()


def _tracked(plan: TransferPlan, begin: Callable[[], Future[None] | None]) -> Future[None]:
    """Start a request with ``begin`` (None: it completed at once) and let ``plan`` hold its
    pins until it completes; a refusal in the caller becomes a failed future."""
    future: Future[None] | None
    try:
        future = begin()
    except LLMException as exc:
        future = Future()
        future.set_exception(exc)
    if future is None:
        return DONE
    plan.track(future)
    return future


def wait_blocking(future: Future[None], deadline_ns: int) -> None:
    """Wait for a request's future in this thread; raise its ``LLMException``."""
    if future is DONE:
        return
    remaining = max(0.0, (deadline_ns - api.monotonic_ns()) / 1e9) + GRACE_S
    try:
        future.result(timeout=remaining)
    except FutureTimeout:
        raise LLMTimeoutError(
            "transfer did not complete within sync_kv_timeout",
            status_code=LLMStatusCode.LLM_TIMEOUT,
        ) from None


class TransferService:
    """Plans and starts the transfer calls of one initialised engine."""

    def __init__(
        self,
        caches: CacheService,
        links: LinkTable,
        *,
        timeout_ms: int,
        remote_cache_accessible: bool,
        routes: CommRoutes | None = None,
    ) -> None:
        self.caches = caches
        self.links = links
        #: Routes through rank-table domains' communicators, by member cluster id.
        self.routes: CommRoutes = {} if routes is None else routes
        self.timeout_ms = timeout_ms
        self.remote_cache_accessible = remote_cache_accessible

    # -- common ---------------------------------------------------------------------------
    def step(
        self,
        cluster_id: int,
        kind: RequestKind,
        access: Access,
        local: Iov,
        *,
        commit: bool = False,
        entry: CacheEntry | None = None,
    ) -> Step:
        """A request to ``cluster_id`` over its live link; ``entry`` holds the ``local`` rows.

        :raises LLMException: ``LLM_NOT_YET_LINK`` when there is no link, ``LLM_LINK_FAILED``
            when it closed without this side asking (see ``LinkTable.route``).
        """
        link = self.links.route(cluster_id)
        peer = link.peer_memory
        if peer is not None and not peer.serves(access.target):
            peer = None
        device = entry is not None and self.caches.on_device(entry)
        route = self.routes.get(cluster_id) if device and self.routes else None
        if route is not None and route.takes(local):
            peer = None
        else:
            route = None
        return Step(
            link.channel, kind, access, local, commit=commit, peer=peer, device=device, route=route
        )

    def _plan(self, steps: list[Step], entries: list[CacheEntry]) -> TransferPlan:
        """Pin ``entries`` (registry lock held) for a plan of ``steps``."""
        registry = self.caches.registry
        registry.pin(entries)
        return TransferPlan(
            steps,
            api.monotonic_ns() + self.timeout_ms * 1_000_000,
            lambda: registry.unpin(entries),
        )

    def start(self, plan: TransferPlan, step: Step) -> Future[None]:
        """Start one step (one-sided, or its request on the link); the plan holds its pins
        until the returned future completes."""
        return _tracked(plan, functools.partial(self._submit, plan, step))

    def _submit(self, plan: TransferPlan, step: Step) -> Future[None]:
        if step.peer is not None and step.peer.transfer(
            step.kind, step.access, step.local, local_on_device=step.device
        ):
            return DONE
        if step.route is not None:
            return self._send_delivered(plan, step)
        if not step.device:
            return self._send(plan, step, step.local)
        staging = self.caches.staging
        pull = step.kind is RequestKind.PULL
        if step.channel.streams:  # device copies overlap the socket, in bounded memory
            return self._send(plan, step, staging.stream(step.local, outbound=not pull))
        staged = staging.inbound(step.local) if pull else staging.outbound(step.local)
        try:
            moved = self._send(plan, step, staged.iov)
        except BaseException:
            staged.finish(False)
            raise
        return _finished_after(moved, staged)

    @staticmethod
    def _send(plan: TransferPlan, step: Step, local: Payload) -> Future[None]:
        """Send ``step``'s request over its link, moving the payload to or from the host
        rows (or segments) ``local``."""
        body = encode_access(step.access)
        if step.kind is RequestKind.PULL:
            return step.channel.pull(body, local, step.nbytes, plan.deadline_ns, commit=step.commit)
        return step.channel.push(body, local, step.nbytes, plan.deadline_ns)

    @staticmethod
    def _send_delivered(plan: TransferPlan, step: Step) -> Future[None]:
        """Send ``step``'s request naming its own rows: the serving side moves the bytes
        through the domain's communicator, and the answer carries none."""
        body = encode_access(dataclasses.replace(step.access, deliver=step.local))
        if step.kind is RequestKind.PULL:
            return step.channel.pull(body, NO_ROWS, 0, plan.deadline_ns, commit=step.commit)
        return step.channel.push(body, NO_ROWS, 0, plan.deadline_ns)

    def run(self, plan: TransferPlan) -> None:
        """Run every step in this thread and wait for all (the blocking face)."""
        futures: list[Future[None]] = []
        try:
            if len(plan.steps) == 1 and plan.steps[0].exchangeable:
                futures.append(self._exchange(plan, plan.steps[0]))
            else:
                for step in plan.steps:
                    futures.append(self.start(plan, step))
        finally:
            plan.seal()
        first: LLMException | None = None
        for step, future in zip(plan.steps, futures, strict=False):
            try:
                if future is not DONE:
                    step.channel.read_for(future, plan.deadline_ns)
                wait_blocking(future, plan.deadline_ns)
            except LLMException as exc:
                first = first or exc
        if first is not None:
            raise first

    @staticmethod
    def _exchange(plan: TransferPlan, step: Step) -> Future[None]:
        """Start (or run to completion, where the link can) the one request of a blocking
        call; the plan holds its pins until it completes."""
        return _tracked(
            plan,
            lambda: step.channel.exchange(
                step.kind, encode_access(step.access), step.local, step.nbytes, plan.deadline_ns
            ),
        )

    def _local(self, cache: Any, name: str) -> CacheEntry:
        return self.caches.entry(cache, name)

    def _require_remote_access(self, call: str) -> None:
        if not self.remote_cache_accessible:
            raise FeatureNotEnabledError(
                f"{call} needs enable_remote_cache_accessible=True in LLMConfig",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )

    @staticmethod
    def _pull_kwargs(kwargs: dict[str, Any]) -> tuple[Any, Any, int]:
        if not kwargs:
            return None, None, 2
        if not _PULL_KWARGS.issuperset(kwargs):
            raise TypeError(f"unexpected keyword arguments: {sorted(set(kwargs) - _PULL_KWARGS)}")
        per_layer = kwargs.get("tensor_num_per_layer", 2)
        check_int("tensor_num_per_layer", per_layer, "uint32")
        if per_layer < 1:
            raise _invalid(f"tensor_num_per_layer must be >= 1, but got {per_layer}")
        return kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"), per_layer

    @staticmethod
    def _spans(
        src_layers: Any, dst_layers: Any, per_layer: int, entry: CacheEntry, *, local_is_dst: bool
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """(remote, local) tensor spans of a pull or push; None ranges mean all tensors."""
        num = len(entry.addrs)
        if src_layers is None and dst_layers is None:
            return (0, num), (0, num)
        local_layers, remote_layers = (
            (dst_layers, src_layers) if local_is_dst else (src_layers, dst_layers)
        )
        local_name, remote_name = (
            ("dst_layer_range", "src_layer_range")
            if local_is_dst
            else ("src_layer_range", "dst_layer_range")
        )
        local = tensor_span(local_name, local_layers, per_layer, num, local=True) or (0, num)
        remote = tensor_span(remote_name, remote_layers, per_layer, 0, local=False)
        if remote is None:
            remote = local if remote_layers is None and local_layers is not None else (0, local[1])
        if remote[1] != local[1]:
            raise _invalid(
                f"{remote_name} names {remote[1]} tensors but {local_name} names {local[1]}"
            )
        return remote, local

    @staticmethod
    def _key_access(key: CacheKey | CacheKeyByIdAndIndex, **fields: Any) -> Access:
        if isinstance(key, CacheKeyByIdAndIndex):
            return Access(Target.CACHE_INDEX, ident=key.cache_id, row=key.batch_index, **fields)
        has_req, has_prefix = key.req_id != INVALID_ID, key.prefix_id != INVALID_ID
        if has_req == has_prefix:
            raise _invalid(f"cache key {key} needs exactly one valid id of req_id and prefix_id")
        if has_req:
            return Access(Target.REQ_KEY, ident=key.req_id, model_id=key.model_id, **fields)
        return Access(Target.PREFIX_KEY, ident=key.prefix_id, model_id=key.model_id, **fields)

    # -- pulls ----------------------------------------------------------------------------
    def plan_pull_cache(
        self, cache_key: Any, cache: Any, batch_index: Any, size: Any, kwargs: dict[str, Any]
    ) -> TransferPlan:
        """Plan ``pull_cache``: one remote batch row into row ``batch_index`` of ``cache``."""
        check_type("cache_key", cache_key, CacheKey, CacheKeyByIdAndIndex)
        if self.remote_cache_accessible and not isinstance(cache_key, CacheKeyByIdAndIndex):
            raise TypeError(
                "with enable_remote_cache_accessible, pull_cache takes a CacheKeyByIdAndIndex"
            )
        check_type("cache", cache, Cache)
        check_int("batch_index", batch_index, "uint32")
        check_int("size", size, "int64")
        if size != -1 and size <= 0:
            raise _invalid(f"size must be -1 or > 0, but got {size}")
        src_layers, dst_layers, per_layer = self._pull_kwargs(kwargs)
        with self.caches.registry.lock:
            entry = self._local(cache, "cache")
            if entry.is_blocks:
                raise _invalid("pull_cache does not take a blocks cache; use pull_blocks")
            if batch_index >= entry.num_rows:
                raise _invalid(f"batch_index {batch_index} >= batch size {entry.num_rows}")
            seg = entry.row_bytes if size == -1 else size
            if seg > entry.row_bytes:
                raise _invalid(f"size {size} exceeds a row of {entry.row_bytes} bytes")
            remote, local = self._spans(src_layers, dst_layers, per_layer, entry, local_is_dst=True)
            access = self._key_access(
                cache_key, tensor_start=remote[0], tensor_count=remote[1], seg_bytes=seg
            )
            drop = access.target is Target.REQ_KEY
            if drop:
                access = Access(
                    access.target,
                    ident=access.ident,
                    model_id=access.model_id,
                    tensor_start=access.tensor_start,
                    tensor_count=access.tensor_count,
                    seg_bytes=seg,
                    drop_key=True,
                )
            rows = local_rows(entry, local, row=batch_index, seg=seg)
            step = self.step(
                cache_key.cluster_id, RequestKind.PULL, access, rows, commit=drop, entry=entry
            )
            return self._plan([step], [entry])

    def check_pull_blocks(
        self,
        src_cache_key: Any,
        dst_cache: Any,
        src_blocks: Any,
        dst_blocks: Any,
        kwargs: dict[str, Any],
    ) -> BlocksCall | TransferPlan:
        """Check ``pull_blocks``: a :class:`BlocksCall` between blocks caches, else the plan
        of a remote row pulled into local blocks."""
        check_type("src_cache_key", src_cache_key, CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey)
        if isinstance(src_cache_key, BlocksCacheKey):
            check_blocks_key_range("src_cache_key", src_cache_key)
        check_type("dst_cache", dst_cache, Cache)
        src_blocks = () if src_blocks is None else src_blocks
        check_int_list("src_blocks", src_blocks, "uint64")
        check_int_list("dst_blocks", dst_blocks, "uint64")
        src_layers, dst_layers, per_layer = self._pull_kwargs(kwargs)
        if not dst_blocks:
            raise _invalid("dst_blocks must not be empty")
        by_blocks = isinstance(src_cache_key, BlocksCacheKey)
        if by_blocks and len(src_blocks) != len(dst_blocks):
            raise _invalid(
                f"src_blocks has {len(src_blocks)} blocks but dst_blocks has {len(dst_blocks)}"
            )
        if not by_blocks and src_blocks:
            raise _invalid("src_blocks must be empty when the source is a batch cache key")
        with self.caches.registry.lock:
            entry = self._local(dst_cache, "dst_cache")
            if not entry.is_blocks:
                raise _invalid("pull_blocks needs a blocks cache as dst_cache")
            check_blocks("dst_blocks", dst_blocks, entry.num_rows)
            remote, local = self._spans(src_layers, dst_layers, per_layer, entry, local_is_dst=True)
            if by_blocks:
                return self._blocks_call(
                    RequestKind.PULL, src_cache_key, entry, local, remote, dst_blocks, src_blocks
                )
            access = self._key_access(
                src_cache_key,
                tensor_start=remote[0],
                tensor_count=remote[1],
                seg_bytes=entry.row_bytes * len(dst_blocks),
            )
            rows = local_rows(entry, local, seg=entry.row_bytes, blocks=dst_blocks)
            step = self.step(src_cache_key.cluster_id, RequestKind.PULL, access, rows, entry=entry)
            return self._plan([step], [entry])

    # -- pushes ---------------------------------------------------------------------------
    def _push_spans(
        self, entry: CacheEntry, src_layers: Any, dst_layers: Any, per_layer: Any
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        check_int("tensor_num_per_layer", per_layer, "uint32")
        num = len(entry.addrs)
        if not 1 <= per_layer <= num:
            raise _invalid(f"tensor_num_per_layer must be in [1, {num}], but got {per_layer}")
        if (src_layers is not None or dst_layers is not None) and num % per_layer:
            raise _invalid(
                f"tensor_num_per_layer {per_layer} does not divide the {num} tensors of the cache"
            )
        every = range(0, num // per_layer)
        src = every if src_layers is None else src_layers
        dst = every if dst_layers is None else dst_layers
        local = tensor_span("src_layer_range", src, per_layer, num, local=True) or (0, num)
        remote = tensor_span("dst_layer_range", dst, per_layer, 0, local=False) or (0, num)
        if len(src) != len(dst):
            raise _invalid(f"src_layer_range {src} and dst_layer_range {dst} differ in length")
        return remote, local

    def plan_push_cache(
        self,
        dst_cache_key: Any,
        src_cache: Any,
        src_batch_index: Any,
        src_layer_range: Any,
        dst_layer_range: Any,
        size: Any,
        tensor_num_per_layer: Any,
    ) -> TransferPlan:
        """Plan ``push_cache``: one local batch row into the remote row ``dst_cache_key`` names."""
        self._require_remote_access("push_cache")
        check_type("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        check_type("src_cache", src_cache, Cache)
        check_int("src_batch_index", src_batch_index, "uint32")
        check_int("size", size, "int64")
        if size != -1:
            raise _invalid(f"push_cache supports size=-1 only, but got {size}")
        with self.caches.registry.lock:
            entry = self._local(src_cache, "src_cache")
            if entry.is_blocks:
                raise _invalid("push_cache does not take a blocks cache; use push_blocks")
            if src_batch_index >= entry.num_rows:
                raise _invalid(f"src_batch_index {src_batch_index} >= batch size {entry.num_rows}")
            remote, local = self._push_spans(
                entry, src_layer_range, dst_layer_range, tensor_num_per_layer
            )
            seg = entry.row_bytes
            access = self._key_access(
                dst_cache_key, tensor_start=remote[0], tensor_count=remote[1], seg_bytes=seg
            )
            rows = local_rows(entry, local, row=src_batch_index, seg=seg)
            step = self.step(dst_cache_key.cluster_id, RequestKind.PUSH, access, rows, entry=entry)
            return self._plan([step], [entry])

    def check_push_blocks(
        self,
        dst_cache_key: Any,
        src_cache: Any,
        src_blocks: Any,
        dst_blocks: Any,
        src_layer_range: Any,
        dst_layer_range: Any,
        tensor_num_per_layer: Any,
    ) -> BlocksCall:
        """Check ``push_blocks``: local blocks into the remote blocks cache of
        ``dst_cache_key``."""
        if isinstance(dst_cache_key, BlocksCacheKey):  # refused before anything else
            check_blocks_key_range("dst_cache_key", dst_cache_key)
        self._require_remote_access("push_blocks")
        check_type("dst_cache_key", dst_cache_key, BlocksCacheKey)
        check_type("src_cache", src_cache, Cache)
        src_blocks = () if src_blocks is None else src_blocks
        check_int_list("src_blocks", src_blocks, "uint64")
        check_int_list("dst_blocks", dst_blocks, "uint64")
        if not dst_blocks:
            raise _invalid("dst_blocks must not be empty")
        if len(src_blocks) != len(dst_blocks):
            raise _invalid(
                f"src_blocks has {len(src_blocks)} blocks but dst_blocks has {len(dst_blocks)}"
            )
        with self.caches.registry.lock:
            entry = self._local(src_cache, "src_cache")
            if not entry.is_blocks:
                raise _invalid("push_blocks needs a blocks cache as src_cache")
            check_blocks("src_blocks", src_blocks, entry.num_rows)
            remote, local = self._push_spans(
                entry, src_layer_range, dst_layer_range, tensor_num_per_layer
            )
            return self._blocks_call(
                RequestKind.PUSH, dst_cache_key, entry, local, remote, src_blocks, dst_blocks
            )

    # -- blocks calls ---------------------------------------------------------------------
    def _blocks_call(
        self,
        kind: RequestKind,
        key: BlocksCacheKey,
        entry: CacheEntry,
        local: tuple[int, int],
        remote: tuple[int, int],
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
    ) -> BlocksCall:
        """A :class:`BlocksCall` pinning ``entry`` (registry lock held)."""
        self.caches.registry.pin((entry,))
        return BlocksCall(
            kind, key.cluster_id, key.model_id, entry, local, remote, local_blocks, remote_blocks
        )

    def _unpin(self, call: BlocksCall) -> Callable[[], None]:
        registry, entries = self.caches.registry, (call.entry,)
        return lambda: registry.unpin(entries)

    def run_checked(self, checked: BlocksCall | TransferPlan) -> None:
        """Run a checked call or a plan in this thread (the blocking face)."""
        if isinstance(checked, TransferPlan):
            self.run(checked)
        else:
            self.run_blocks(checked)

    def plan_blocks(self, call: BlocksCall) -> TransferPlan:
        """The general plan of ``call`` (one request); it takes over the call's pin."""
        try:
            step = self.step(
                call.cluster_id, call.kind, call.access(), call.rows(), entry=call.entry
            )
        except BaseException:
            self._unpin(call)()
            raise
        return TransferPlan(
            [step], api.monotonic_ns() + self.timeout_ms * 1_000_000, self._unpin(call)
        )

    def run_blocks(self, call: BlocksCall) -> None:
        """Run ``call`` in this thread (the blocking face): on its direct route (see
        :meth:`start_blocks`), its request exchanged in the caller; else the general plan."""
        started = self.start_blocks(call, exchange=True)
        if started is None:
            return self.run(self.plan_blocks(call))
        channel, future, deadline_ns = started
        if future is not None:
            channel.read_for(future, deadline_ns)
            wait_blocking(future, deadline_ns)
        return None

    def start_blocks(
        self, call: BlocksCall, *, exchange: bool
    ) -> tuple[Channel, Future[None] | None, int] | None:
        """Start ``call`` on its direct route, host memory on this side: one-sided to a
        same-host peer with one native call, or its request over the link with the body
        and rows built straight from the call (run to completion in the caller where
        ``exchange``, the blocking face). Returns ``(channel, the request's future or None
        once done, deadline)``; the pin goes once the request completed.

        None, with the pin still held, when only the general plan takes the call: no link,
        device memory, or what the peer's board does not show (the general route names
        each refusal as the serving side would).
        """
        link = self.links.get(call.cluster_id)
        if link is None or self.caches.on_device(call.entry):
            return None
        registry, entries, channel = self.caches.registry, (call.entry,), link.channel
        peer = link.peer_memory
        deadline_ns = api.monotonic_ns() + self.timeout_ms * 1_000_000
        future: Future[None] | None
        try:
            if peer is not None and peer.serves(Target.BLOCKS_KEY):
                if not peer.transfer_blocks(
                    call.kind,
                    call.model_id,
                    call.remote,
                    call.remote_blocks,
                    (call.entry.layout, call.local[0], call.local_blocks),
                    call.local[1],
                    call.entry.row_bytes,
                ):
                    return None
                future = None
            else:
                body = encode_blocks_access(
                    call.model_id, *call.remote, call.entry.row_bytes, call.remote_blocks
                )
                rows, nbytes = call.rows(), call.nbytes
                if exchange:
                    future = channel.exchange(call.kind, body, rows, nbytes, deadline_ns)
                elif call.kind is RequestKind.PULL:
                    future = channel.pull(body, rows, nbytes, deadline_ns)
                else:
                    future = channel.push(body, rows, nbytes, deadline_ns)
        except BaseException:
            registry.unpin(entries)
            raise
        if future is None:
            registry.unpin(entries)
        else:
            future.add_done_callback(lambda _: registry.unpin(entries))
        return channel, future, deadline_ns
