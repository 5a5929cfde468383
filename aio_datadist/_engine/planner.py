"""Plan: every transfer call of both faces checked into one :class:`~aio_datadist._engine.
request.Plan` of :class:`~aio_datadist._engine.request.Transfer` values. Pure: no I/O.

The planner validates the arguments as documented (``TypeError``/``ValueError``/
``LLMException``), resolves and pins the local cache, and describes each request: the kind,
the peer, the access naming the peer's memory (``_engine.access``) and this side's rows.
Blocks of a blocks cache stay compact (:class:`~aio_datadist._engine.request.Blocks`, the
block list as given), so a small call builds no arrays. Which route moves a transfer, and
who waits, is decided later (``_engine.routes``, ``_engine.driver``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from aio_datadist._engine.access import Access, Target
from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.plan import (
    COPY_KINDS,
    CopyPlan,
    Ops,
    block_ops,
    copy_map,
    row_ops,
    staged,
    swap_map,
)
from aio_datadist._engine.registry import CacheEntry
from aio_datadist._engine.request import Blocks, Plan, RemoteBlocks, Transfer
from aio_datadist._log import get_logger
from aio_datadist._runtime.base import CopyKind
from aio_datadist._transport.base import Iov, RequestKind
from aio_datadist._transport.deadlines import now_ns
from aio_datadist._validate import INVALID_ID, check_int, check_int_list, check_type
from aio_datadist.cache import Cache
from aio_datadist.enums import Placement
from aio_datadist.status import (
    FeatureNotEnabledError,
    KvCacheNotExistError,
    LLMStatusCode,
    ParamInvalidError,
)
from aio_datadist.synchronizer import LayerSynchronizer, is_async_synchronizer
from aio_datadist.types import (
    BlocksCacheKey,
    CacheKey,
    CacheKeyByIdAndIndex,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_blocks_key_range,
)

__all__ = (
    "LayerConfig",
    "LayerPlan",
    "Planner",
    "check_blocks",
    "local_blocks",
    "local_rows",
    "tensor_span",
)

_PULL_KWARGS = frozenset({"src_layer_range", "dst_layer_range", "tensor_num_per_layer"})
#: The layer keywords of a pull that names none: every layer, two tensors per layer.
_NO_KWARGS: tuple[None, None, int] = (None, None, 2)


def _invalid(message: str) -> ParamInvalidError:
    return ParamInvalidError(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _not_exist(message: str) -> KvCacheNotExistError:
    return KvCacheNotExistError(message, status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


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
    if type(layers) is not range:
        check_type(name, layers, range)
    first, stop = layers.start, layers.stop
    if layers.step != 1 or not 0 <= first < stop <= 2**32:
        if layers.step == 1 and first >= 0 and stop <= first:
            return None  # empty
        raise _invalid(f"{name} must have step 1 and 0 <= start < stop, but got {layers}")
    start, count = first * per_layer, (stop - first) * per_layer
    if local and start + count > num_tensors:
        raise _invalid(
            f"{name} {layers} with {per_layer} tensors per layer needs tensors up to "
            f"{start + count}, but the cache has {num_tensors}"
        )
    return start, count


def _ranges(src_layers: Any, dst_layers: Any) -> bool:
    """Whether both layer ranges are a ``range`` or None (the values a layer-span cache
    takes: anything else gets the uncached call, which names what is wrong)."""
    return (src_layers is None or type(src_layers) is range) and (
        dst_layers is None or type(dst_layers) is range
    )


#: The layer spans of the calls seen lately: a loop of calls over the same layers checks
#: and computes them once (only what passed the checks is kept).
_SPANS_CACHED = 256


@functools.lru_cache(maxsize=_SPANS_CACHED)
def _layer_spans(
    src_layers: range | None, dst_layers: range | None, per_layer: int, num: int, local_is_dst: bool
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(remote, local) tensor spans of a pull (``local_is_dst``) or push of a cache of
    ``num`` tensors; None ranges mean all tensors."""
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
        raise _invalid(f"{remote_name} names {remote[1]} tensors but {local_name} names {local[1]}")
    return remote, local


@functools.lru_cache(maxsize=_SPANS_CACHED)
def _push_layer_spans(
    src_layers: range | None, dst_layers: range | None, per_layer: int, num: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """(remote, local) tensor spans of ``push_cache`` or ``push_blocks`` from a cache of
    ``num`` tensors (``per_layer`` an uint32); None ranges mean every layer."""
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


def local_rows(entry: CacheEntry, tensors: tuple[int, int], *, row: int, seg: int) -> Iov:
    """Rows of a local batch cache: one segment of ``seg`` bytes per tensor at batch ``row``."""
    start, count = tensors
    rows = np.empty((count, 2), dtype=np.uint64)
    rows[:, 0] = np.asarray(entry.addrs[start : start + count], dtype=np.uint64)
    rows[:, 0] += np.uint64(row * entry.row_bytes)
    rows[:, 1] = seg
    return rows


def local_blocks(
    entry: CacheEntry, tensors: tuple[int, int], blocks: Sequence[int], seg: int
) -> Blocks:
    """The listed blocks of tensors ``tensors`` of a local blocks cache, ``seg`` bytes each."""
    return Blocks(entry.layout, tensors[0], tensors[1], blocks, seg)


def check_blocks(
    name: str, blocks: Sequence[int] | npt.NDArray[np.uint64], num_blocks: int
) -> None:
    """Refuse a block index outside ``[0, num_blocks)`` with ``LLM_PARAM_INVALID``: the one
    check of a local block list (a list item by item, an array at numpy speed)."""
    if isinstance(blocks, np.ndarray):
        if len(blocks) and int(blocks.max()) >= num_blocks:
            bad = int(blocks[blocks >= num_blocks][0])
            raise _invalid(f"{name} block index {bad} is outside [0, {num_blocks})")
        return
    for b in blocks:
        if b >= num_blocks:
            raise _invalid(f"{name} block index {b} is outside [0, {num_blocks})")


@dataclass(frozen=True)
class LayerConfig:
    """One checked transfer config of a layer-wise call."""

    config: TransferConfig | TransferWithCacheKeyConfig
    #: The source layers it sends.
    src: range
    #: The peer's layer that receives the first of them.
    dst_start: int


@dataclass(frozen=True)
class LayerPlan:
    """A checked ``transfer_cache_async`` call, its source cache pinned; what
    ``_engine.layerwise.LayerJob`` runs layer by layer."""

    entry: CacheEntry
    synchronizer: LayerSynchronizer
    configs: list[LayerConfig]
    num_layers: int
    src_blocks: list[int]
    dst_blocks: list[int]
    #: Bytes of one destination block (0: a batch destination).
    dst_block_bytes: int
    plan: Plan
    #: Tensors per layer (``tensor_num_per_layer``).
    per_layer: int


class Planner:
    """Checks the transfer calls of one initialised engine into plans."""

    def __init__(
        self,
        caches: CacheService,
        *,
        timeout_ms: int,
        remote_cache_accessible: bool,
        log: structlog.stdlib.BoundLogger | None = None,
    ) -> None:
        self.caches = caches
        self.timeout_ms = timeout_ms
        self.remote_cache_accessible = remote_cache_accessible
        #: Where local copies are logged (the engine binds its cluster id and role).
        self._log = get_logger("cache") if log is None else log

    # -- common ---------------------------------------------------------------------------
    def transfer(
        self,
        cluster_id: int,
        kind: RequestKind,
        access: Access | RemoteBlocks,
        local: Iov | Blocks,
        entry: CacheEntry,
        *,
        commit: bool = False,
    ) -> Transfer:
        """One request to ``cluster_id``; ``entry`` holds the ``local`` rows."""
        if isinstance(local, Blocks):
            nbytes = local.count * len(local.blocks) * local.seg
        else:
            nbytes = int(local[:, 1].sum()) if len(local) else 0
        device = self.caches.on_device(entry)
        return Transfer(kind, cluster_id, access, local, entry, device, commit, nbytes)

    def plan(self, transfers: list[Transfer], entries: Sequence[CacheEntry]) -> Plan:
        """Pin ``entries`` (registry lock held) for a plan of ``transfers``."""
        registry = self.caches.registry
        registry.pin(entries)
        deadline_ns = now_ns() + self.timeout_ms * 1_000_000
        return Plan(transfers, deadline_ns, registry.unpin, entries)

    def _require_remote_access(self, call: str) -> None:
        if not self.remote_cache_accessible:
            raise FeatureNotEnabledError(
                f"{call} needs enable_remote_cache_accessible=True in LLMConfig",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )

    @staticmethod
    def _pull_kwargs(kwargs: dict[str, Any]) -> tuple[Any, Any, int]:
        if not kwargs:
            return _NO_KWARGS
        if not _PULL_KWARGS.issuperset(kwargs):
            raise TypeError(f"unexpected keyword arguments: {sorted(set(kwargs) - _PULL_KWARGS)}")
        per_layer = kwargs.get("tensor_num_per_layer", 2)
        if type(per_layer) is not int or not 1 <= per_layer < 2**32:
            check_int("tensor_num_per_layer", per_layer, "uint32")
        if per_layer < 1:
            raise _invalid(f"tensor_num_per_layer must be >= 1, but got {per_layer}")
        return kwargs.get("src_layer_range"), kwargs.get("dst_layer_range"), per_layer

    @staticmethod
    def _spans(
        src_layers: Any, dst_layers: Any, per_layer: int, entry: CacheEntry, *, local_is_dst: bool
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """(remote, local) tensor spans of a pull or push; None ranges mean all tensors."""
        spans = _layer_spans if _ranges(src_layers, dst_layers) else _layer_spans.__wrapped__
        return spans(src_layers, dst_layers, per_layer, len(entry.addrs), local_is_dst)

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
    def pull_cache(
        self, cache_key: Any, cache: Any, batch_index: Any, size: Any, kwargs: dict[str, Any]
    ) -> Plan:
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
            entry = self.caches.entry(cache, "cache")
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
            transfer = self.transfer(
                cache_key.cluster_id, RequestKind.PULL, access, rows, entry, commit=drop
            )
            return self.plan([transfer], [entry])

    def pull_blocks(
        self,
        src_cache_key: Any,
        dst_cache: Any,
        src_blocks: Any,
        dst_blocks: Any,
        kwargs: dict[str, Any],
    ) -> Plan:
        """Plan ``pull_blocks``: remote blocks (``BlocksCacheKey``) or one remote row (cache
        key) into local blocks."""
        by_blocks = isinstance(src_cache_key, BlocksCacheKey)
        if by_blocks:
            check_blocks_key_range("src_cache_key", src_cache_key)
        else:  # (the message names every key type the call takes)
            check_type(
                "src_cache_key", src_cache_key, CacheKey, CacheKeyByIdAndIndex, BlocksCacheKey
            )
        if type(dst_cache) is not Cache:
            check_type("dst_cache", dst_cache, Cache)
        if src_blocks is None:
            src_blocks = ()
        check_int_list("src_blocks", src_blocks, "uint64")
        check_int_list("dst_blocks", dst_blocks, "uint64")
        src_layers, dst_layers, per_layer = self._pull_kwargs(kwargs)
        if not dst_blocks:
            raise _invalid("dst_blocks must not be empty")
        if by_blocks:
            if len(src_blocks) != len(dst_blocks):
                raise _invalid(
                    f"src_blocks has {len(src_blocks)} blocks but dst_blocks has {len(dst_blocks)}"
                )
        elif src_blocks:
            raise _invalid("src_blocks must be empty when the source is a batch cache key")
        with self.caches.registry.lock:
            entry = self.caches.entry(dst_cache, "dst_cache")
            if not entry.is_blocks:
                raise _invalid("pull_blocks needs a blocks cache as dst_cache")
            check_blocks("dst_blocks", dst_blocks, entry.num_rows)
            remote, local = self._spans(src_layers, dst_layers, per_layer, entry, local_is_dst=True)
            seg = entry.row_bytes
            access: Access | RemoteBlocks
            if by_blocks:
                access = RemoteBlocks(src_cache_key.model_id, *remote, src_blocks, seg)
            else:
                access = self._key_access(
                    src_cache_key,
                    tensor_start=remote[0],
                    tensor_count=remote[1],
                    seg_bytes=seg * len(dst_blocks),
                )
            transfer = self.transfer(
                src_cache_key.cluster_id,
                RequestKind.PULL,
                access,
                Blocks(entry.layout, *local, dst_blocks, seg),
                entry,
            )
            return self.plan([transfer], [entry])

    # -- pushes ---------------------------------------------------------------------------
    def _push_spans(
        self, entry: CacheEntry, src_layers: Any, dst_layers: Any, per_layer: Any
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        if type(per_layer) is not int or not 0 <= per_layer < 2**32:
            check_int("tensor_num_per_layer", per_layer, "uint32")
        spans = (
            _push_layer_spans if _ranges(src_layers, dst_layers) else _push_layer_spans.__wrapped__
        )
        return spans(src_layers, dst_layers, per_layer, len(entry.addrs))

    def push_cache(
        self,
        dst_cache_key: Any,
        src_cache: Any,
        src_batch_index: Any,
        src_layer_range: Any,
        dst_layer_range: Any,
        size: Any,
        tensor_num_per_layer: Any,
    ) -> Plan:
        """Plan ``push_cache``: one local batch row into the remote row ``dst_cache_key`` names."""
        self._require_remote_access("push_cache")
        check_type("dst_cache_key", dst_cache_key, CacheKeyByIdAndIndex)
        check_type("src_cache", src_cache, Cache)
        check_int("src_batch_index", src_batch_index, "uint32")
        check_int("size", size, "int64")
        if size != -1:
            raise _invalid(f"push_cache supports size=-1 only, but got {size}")
        with self.caches.registry.lock:
            entry = self.caches.entry(src_cache, "src_cache")
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
            transfer = self.transfer(
                dst_cache_key.cluster_id, RequestKind.PUSH, access, rows, entry
            )
            return self.plan([transfer], [entry])

    def push_blocks(
        self,
        dst_cache_key: Any,
        src_cache: Any,
        src_blocks: Any,
        dst_blocks: Any,
        src_layer_range: Any,
        dst_layer_range: Any,
        tensor_num_per_layer: Any,
    ) -> Plan:
        """Plan ``push_blocks``: local blocks into the remote blocks cache of ``dst_cache_key``."""
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
            entry = self.caches.entry(src_cache, "src_cache")
            if not entry.is_blocks:
                raise _invalid("push_blocks needs a blocks cache as src_cache")
            check_blocks("src_blocks", src_blocks, entry.num_rows)
            remote, local = self._push_spans(
                entry, src_layer_range, dst_layer_range, tensor_num_per_layer
            )
            seg = entry.row_bytes
            transfer = self.transfer(
                dst_cache_key.cluster_id,
                RequestKind.PUSH,
                RemoteBlocks(dst_cache_key.model_id, *remote, dst_blocks, seg),
                Blocks(entry.layout, *local, src_blocks, seg),
                entry,
            )
            return self.plan([transfer], [entry])

    # -- layer-wise -----------------------------------------------------------------------
    def layer_job(
        self,
        src_cache: Any,
        layer_synchronizer: Any,
        transfer_configs: Any,
        src_block_indices: Any,
        dst_block_indices: Any,
        dst_block_memory_size: Any,
        *,
        allow_async: bool,
        tensor_num_per_layer: Any = 2,
    ) -> LayerPlan:
        """Check a ``transfer_cache_async`` call (synchronously) and pin its source.

        ``tensor_num_per_layer`` (aio_datadist's extension; the reference always takes 2, K
        and V) is how many consecutive tensors make one layer: 1 for caches that keep K and
        V of a layer in one tensor (vLLM's joined pages, MLA's latent cache).
        """
        per_layer = _layer_args(src_cache, tensor_num_per_layer)
        src_blocks = [] if src_block_indices is None else src_block_indices
        dst_blocks = [] if dst_block_indices is None else dst_block_indices
        check_int_list("src_block_indices", src_blocks, "uint64")
        check_int_list("dst_block_indices", dst_blocks, "uint64")
        check_int("dst_block_memory_size", dst_block_memory_size, "uint64", allow_none=True)
        _check_synchronizer(layer_synchronizer, allow_async=allow_async)
        self._check_layer_configs(transfer_configs)
        if src_blocks and not dst_blocks:
            raise _invalid("a PA source needs dst_block_indices (PA to non-PA is not supported)")
        if src_blocks and len(src_blocks) != len(dst_blocks):
            raise _invalid(
                f"src_block_indices has {len(src_blocks)} entries but dst_block_indices has "
                f"{len(dst_blocks)}"
            )
        with self.caches.registry.lock:
            entry = self.caches.entry(src_cache, "src_cache")
            dst_bytes = _layer_blocks(entry, src_blocks, dst_blocks, dst_block_memory_size or 0)
            layers, configs = _layer_configs(entry, transfer_configs, per_layer)
            plan = self.plan([], [entry])
        return LayerPlan(
            entry,
            layer_synchronizer,
            configs,
            layers,
            list(src_blocks),
            list(dst_blocks),
            dst_bytes,
            plan,
            per_layer,
        )

    def _check_layer_configs(self, transfer_configs: Any) -> None:
        """The configs are of the kind the engine's mode takes, their keys in range."""
        check_type("transfer_configs", transfer_configs, list, tuple)
        keyed = self.remote_cache_accessible
        wanted = TransferWithCacheKeyConfig if keyed else TransferConfig
        for i, config in enumerate(transfer_configs):
            if not isinstance(config, wanted):
                raise TypeError(
                    f"transfer_configs[{i}] must be a {wanted.__name__} "
                    f"({'with' if keyed else 'without'} enable_remote_cache_accessible)"
                )
            if isinstance(config, TransferWithCacheKeyConfig) and isinstance(
                config.cache_key, BlocksCacheKey
            ):
                check_blocks_key_range(f"transfer_configs[{i}].cache_key", config.cache_key)

    # -- local copies ---------------------------------------------------------------------------
    def _plan(self, batches: list[Ops], kind: CopyKind, entries: Sequence[CacheEntry]) -> CopyPlan:
        nbytes = int(sum(int(b[:, 2].sum()) for b in batches))
        self.caches.registry.pin(entries)
        return CopyPlan(batches, kind, nbytes, pinned=list(entries))

    def copy_cache(
        self,
        dst: Any,
        src: Any,
        dst_batch_index: Any = 0,
        src_batch_index: Any = 0,
        offset: Any = 0,
        size: Any = -1,
        req_id: Any = None,
    ) -> CopyPlan:
        """Plan ``copy_cache``: bytes ``[offset, offset+size)`` of one batch row, per tensor."""
        check_type("dst", dst, Cache)
        check_type("src", src, Cache)
        check_int("dst_batch_index", dst_batch_index, "uint32")
        check_int("src_batch_index", src_batch_index, "uint32")
        check_int("offset", offset, "uint64")
        check_int("size", size, "int64")
        check_int("req_id", req_id, "uint64", allow_none=True)
        if size != -1 and size <= 0:
            raise _invalid(f"size must be -1 or > 0, but got {size}")
        with self.caches.registry.lock:
            d, s = self.caches.entry(dst, "dst"), self.caches.entry(src, "src")
            if d.is_blocks or s.is_blocks:
                raise _invalid("copy_cache does not take blocks caches; use copy_blocks")
            if d.desc.num_tensors != s.desc.num_tensors:
                raise _invalid(
                    f"dst has {d.desc.num_tensors} tensors but src has {s.desc.num_tensors}"
                )
            if dst_batch_index >= d.desc.batch_size:
                raise _invalid(
                    f"dst_batch_index {dst_batch_index} >= dst batch size {d.desc.batch_size}"
                )
            if src_batch_index >= s.desc.batch_size:
                raise _invalid(
                    f"src_batch_index {src_batch_index} >= src batch size {s.desc.batch_size}"
                )
            d_stride, s_stride = d.row_bytes, s.row_bytes
            if offset > 0 and (offset >= s_stride or offset >= d_stride):
                raise _invalid(
                    f"offset {offset} is not inside a row (src row {s_stride} bytes, "
                    f"dst row {d_stride} bytes)"
                )
            nbytes = s_stride - offset if size == -1 else size
            if nbytes > s_stride - offset or nbytes > d_stride - offset:
                raise _invalid(
                    f"copy of {nbytes} bytes at offset {offset} does not fit in a row "
                    f"(src row {s_stride} bytes, dst row {d_stride} bytes)"
                )
            ops = row_ops(
                d.addrs,
                s.addrs,
                dst_batch_index * d_stride + offset,
                src_batch_index * s_stride + offset,
                nbytes,
            )
            if d is s and dst_batch_index == src_batch_index:
                ops = ops[:0]
            plan = self._plan([ops], COPY_KINDS[s.placement, d.placement], [d, s])
        self._log.debug(
            "cache.copy", dst=dst.cache_id, src=src.cache_id, nbytes=plan.nbytes, req_id=req_id
        )
        return plan

    def copy_blocks(self, cache: Any, copy_block_info: Any) -> CopyPlan:
        """Plan ``copy_blocks``: each source block to each of its destination blocks.

        Every source is read before any destination is written (overlapping maps copy
        through a scratch buffer); a block named as destination twice takes the last source.
        """
        check_type("cache", cache, Cache)
        check_type("copy_block_info", copy_block_info, dict)
        srcs, dsts, overlap = copy_map(copy_block_info)
        with self.caches.registry.lock:
            entry = self.caches.entry(cache)
            if not entry.is_blocks:
                raise _invalid(f"copy_blocks needs a blocks cache, cache {cache.cache_id} is not")
            num_blocks = entry.num_rows
            check_blocks("destination", dsts, num_blocks)
            check_blocks("source", srcs, num_blocks)
            ops = block_ops(entry.addrs, entry.addrs, dsts, srcs, entry.row_bytes)
            kind = COPY_KINDS[entry.placement, entry.placement]
            plan = self._plan([ops], kind, [entry])
            if overlap:
                gather, scatter, plan.stage_bytes = staged(ops)
                plan.batches = [gather, scatter]
                plan.stage_device = entry.placement is Placement.DEVICE
        return plan

    def swap_blocks(self, src_cache: Any, dst_cache: Any, src_to_dst: Any) -> CopyPlan:
        """Plan ``swap_blocks``: blocks between a host and a device blocks cache."""
        check_type("src_cache", src_cache, Cache)
        check_type("dst_cache", dst_cache, Cache)
        check_type("src_to_dst", src_to_dst, dict)
        srcs, dsts, _ = swap_map(src_to_dst)
        pair = (src_cache._layout.placement, dst_cache._layout.placement)
        if pair not in ((Placement.HOST, Placement.DEVICE), (Placement.DEVICE, Placement.HOST)):
            raise _invalid(
                f"swap_blocks moves blocks between HOST and DEVICE, but got {pair[0]!s} -> "
                f"{pair[1]!s}"
            )
        with self.caches.registry.lock:
            sides = [
                self._swap_side(src_cache, "src_cache"),
                self._swap_side(dst_cache, "dst_cache"),
            ]
            (s_addrs, s_blocks, s_bytes, s_entry), (d_addrs, d_blocks, d_bytes, d_entry) = sides
            if s_bytes != d_bytes:
                raise _invalid(f"block sizes differ: src {s_bytes} bytes, dst {d_bytes} bytes")
            if len(s_addrs) != len(d_addrs):
                raise _invalid(f"num_tensors differ: src {len(s_addrs)}, dst {len(d_addrs)}")
            check_blocks("dst_cache", dsts, d_blocks)
            check_blocks("src_cache", srcs, s_blocks)
            ops = block_ops(d_addrs, s_addrs, dsts, srcs, s_bytes)
            entries = [e for e in (s_entry, d_entry) if e is not None]
            return self._plan([ops], COPY_KINDS[pair], entries)

    def _swap_side(
        self, cache: Cache, name: str
    ) -> tuple[Sequence[int], int, int, CacheEntry | None]:
        if not cache.is_blocks_cache:
            raise _invalid(f"swap_blocks needs blocks caches, {name} is not one")
        if cache._owner is None and cache.cache_id == -1:
            layout = cache._layout
            if not cache._tensor_addrs:
                raise _not_exist(f"{name} has no tensor addresses")
            if layout.batch_size <= 0:
                raise _invalid(f"{name} has {layout.batch_size} blocks")
            block_bytes = layout.tensor_bytes // layout.batch_size
            return cache._tensor_addrs, layout.batch_size, block_bytes, None
        entry = self.caches.entry(cache, name)
        return entry.addrs, entry.num_rows, entry.row_bytes, entry


def _layer_args(src_cache: Any, tensor_num_per_layer: Any) -> int:
    """Tensors per layer, once the source is a device cache and the count valid."""
    check_type("src_cache", src_cache, Cache)
    check_int("tensor_num_per_layer", tensor_num_per_layer, "int32")
    if tensor_num_per_layer < 1:
        raise _invalid(f"tensor_num_per_layer must be >= 1, got {tensor_num_per_layer}")
    if src_cache._layout.placement is Placement.HOST:
        raise _invalid("transfer_cache_async does not take a HOST source cache")
    return int(tensor_num_per_layer)


def _check_synchronizer(synchronizer: Any, *, allow_async: bool) -> None:
    check_type("layer_synchronizer", synchronizer, LayerSynchronizer)
    if not allow_async and is_async_synchronizer(synchronizer):
        raise TypeError(
            "the blocking transfer_cache_async needs a plain synchronize_layer; an async def "
            "synchroniser needs AsyncLLMDataDist"
        )


def _layer_blocks(
    entry: CacheEntry, src_blocks: Sequence[int], dst_blocks: Sequence[int], dst_bytes: int
) -> int:
    """(Registry lock held.) Check the block lists against the source; the bytes of one
    destination block (0 for a batch destination)."""
    if src_blocks:
        if not entry.is_blocks:
            raise _invalid("src_block_indices needs a blocks (PA) source cache")
        check_blocks("src", src_blocks, entry.num_rows)
    if dst_blocks and not dst_bytes:
        if not entry.is_blocks:
            raise _invalid("dst_block_memory_size is needed when a batch source goes to dst blocks")
        dst_bytes = entry.row_bytes
    if not dst_blocks and dst_bytes:
        raise _invalid("dst_block_memory_size must be None or 0 for a non-PA destination")
    return dst_bytes


def _layer_configs(
    entry: CacheEntry, transfer_configs: Sequence[Any], per_layer: int
) -> tuple[int, list[LayerConfig]]:
    """(Registry lock held.) The source's layer count and each config checked against it."""
    num = len(entry.addrs)
    if num % per_layer:
        if per_layer == 2:
            raise _invalid(f"transfer_cache_async needs an even num_tensors, got {num}")
        raise _invalid(f"num_tensors {num} is not a multiple of tensor_num_per_layer {per_layer}")
    layers = num // per_layer
    configs: list[LayerConfig] = []
    for i, config in enumerate(transfer_configs):
        src = range(0, layers) if config.src_layer_range is None else config.src_layer_range
        if not 0 <= src.start < src.stop <= layers:
            raise _invalid(f"transfer_configs[{i}] layer range {src} is outside [0, {layers})")
        if isinstance(config, TransferConfig):
            if len(config.dst_addrs) != per_layer * len(src):
                raise _invalid(
                    f"transfer_configs[{i}] has {len(config.dst_addrs)} dst_addrs for "
                    f"{len(src)} layers ({per_layer} per layer)"
                )
            dst_start = src.start
        else:
            dst_start = config.dst_layer_range.start
        if entry.is_blocks and config.src_batch_index != 0:
            raise _invalid(f"transfer_configs[{i}].src_batch_index must be 0 for a PA source")
        if not entry.is_blocks and config.src_batch_index >= entry.num_rows:
            raise _invalid(
                f"transfer_configs[{i}].src_batch_index {config.src_batch_index} >= batch "
                f"size {entry.num_rows}"
            )
        configs.append(LayerConfig(config, src, dst_start))
    return layers, configs
