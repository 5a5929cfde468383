"""The documented value types: cache descriptors, cache keys, transfer configs, MemInfo, KvCache.

These are plain data holders that validate their arguments the way the reference does
(``TypeError`` for wrong types, ``ValueError`` for ints outside their C range,
``LLMException(LLM_PARAM_INVALID)`` for other invalid values). ``Cache``, ``CacheTask`` and
``LayerSynchronizer`` live elsewhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from aio_datadist._validate import (
    INVALID_ID,
    check_int,
    check_int_list,
    check_layer_range,
    check_type,
    param_invalid,
)
from aio_datadist.data_type import DataType, element_size
from aio_datadist.enums import Memtype, Placement

__all__ = (
    "MAX_DIMS",
    "BlocksCacheKey",
    "CacheDesc",
    "CacheLayout",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "KvCache",
    "MemInfo",
    "TransferConfig",
    "TransferWithCacheKeyConfig",
    "check_blocks_key_range",
    "is_valid_id",
    "tensor_size",
)

MAX_DIMS = 32
"""Most dimensions a cache tensor may have (the native side's limit)."""

_INT64_MAX = 2**63 - 1


def is_valid_id(value: int) -> bool:
    """True unless ``value`` is an invalid req_id/prefix_id: negative or ``2**64 - 1``."""
    return 0 <= value != INVALID_ID


def _check_kwargs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    positional: tuple[str, ...],
    valid: tuple[str, ...],
) -> dict[str, Any]:
    """Merge positional ``args`` into ``kwargs`` by name for the *args/**kwargs key classes."""
    if len(args) + len(kwargs) > len(positional):
        param_invalid(f"Param num is over limit, at most {len(positional)} params are supported")
    for key in kwargs:
        if key not in valid:
            param_invalid(f"Unsupported param:{key}")
    merged = dict(kwargs)
    for name, value in zip(positional, args, strict=False):
        # The reference silently let the positional value win; a value given twice is a bug.
        if name in merged:
            param_invalid(f"Param {name} is given both by position and by keyword")
        merged[name] = value
    if "cluster_id" in merged and "prompt_cluster_id" in merged:
        param_invalid("Param cluster_id and prompt_cluster_id can not both be given")
    if "cluster_id" not in merged and "prompt_cluster_id" not in merged:
        param_invalid("Param prompt_cluster_id or cluster_id is required")
    return merged


class _KeyValue:
    """Equality and hashing by ``_key()``, among instances of the same class."""

    __slots__ = ()

    def _key(self) -> tuple[int, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((type(self).__name__, *self._key()))


class CacheDesc:
    """Description of a cache: ``num_tensors`` tensors of one ``shape`` and ``data_type``.

    Raises ``TypeError`` / ``ValueError`` for argument types and C ranges (``num_tensors``
    uint32, ``shape`` int64 entries, ``seq_len_dim_index`` int32) and
    ``LLMException(LLM_PARAM_INVALID)`` when ``batch_dim_index`` is not in ``[0, len(shape))``,
    ``seq_len_dim_index`` is neither -1 nor in that range, or the shape has more than 32
    dimensions (checked here, at construction, rather than later when the size is needed).
    A negative dimension is accepted here, as the reference accepts it; ``size`` (and so
    every allocate/register call) refuses it, naming the dimension. The shape is copied into
    a list, and ``shape`` hands out a copy of it.

    A cache takes its layout from the descriptor when it is allocated or registered (a
    :class:`CacheLayout`); changing the descriptor afterwards (``update_dim``) changes
    nothing about that cache.
    """

    __slots__ = (
        "_batch_dim",
        "_batch_size",
        "_data_type",
        "_is_blocks",
        "_kv_tensor_format",
        "_num_tensors",
        "_placement",
        "_seq_len_dim_index",
        "_shape",
    )

    def __init__(
        self,
        num_tensors: int,
        shape: tuple[int, ...] | list[int],
        data_type: DataType,
        placement: Placement = Placement.DEVICE,
        batch_dim_index: int = 0,
        seq_len_dim_index: int = -1,
        kv_tensor_format: str | None = None,
    ) -> None:
        check_int("num_tensors", num_tensors, "uint32")
        check_type("shape", shape, tuple, list)
        for i, dim in enumerate(shape):
            check_type(f"shape[{i}]", dim, int)
        check_type("data_type", data_type, DataType)
        check_type("placement", placement, Placement)
        check_type("batch_dim_index", batch_dim_index, int)
        check_int("seq_len_dim_index", seq_len_dim_index, "int32")
        check_type("kv_tensor_format", kv_tensor_format, str, allow_none=True)
        if not 0 <= batch_dim_index < len(shape):
            param_invalid(f"batch_dim_index {batch_dim_index} out of range, [0, {len(shape)})")
        if not (seq_len_dim_index == -1 or 0 <= seq_len_dim_index < len(shape)):
            param_invalid(
                f"seq_len_dim_index {seq_len_dim_index} is invalid, "
                f"should be -1 or in range [0, {len(shape)})"
            )
        for i, dim in enumerate(shape):
            check_int(f"shape[{i}]", dim, "int64")
        if len(shape) > MAX_DIMS:
            param_invalid(f"shape has {len(shape)} dimensions, at most {MAX_DIMS} are supported")
        self._num_tensors = num_tensors
        self._shape: list[int] = list(shape)
        self._data_type = data_type
        self._placement = placement
        self._batch_dim = batch_dim_index
        self._batch_size = self._shape[batch_dim_index]
        self._seq_len_dim_index = seq_len_dim_index
        self._kv_tensor_format = kv_tensor_format
        # Set by the blocks APIs (allocate/register_blocks_cache) on the descriptor they take.
        self._is_blocks = False

    def __repr__(self) -> str:
        # The missing space before kv_tensor_format is the reference's exact format.
        return (
            f"CacheDesc(num_tensors={self._num_tensors}, "
            f"shape={self._shape}, "
            f"data_type={self._data_type}, "
            f"placement={self._placement}, "
            f"batch_dim_index={self._batch_dim}, "
            f"seq_len_dim_index={self._seq_len_dim_index},"
            f"kv_tensor_format={self._kv_tensor_format})"
        )

    @property
    def num_tensors(self) -> int:
        """Number of tensors in the cache (uint32)."""
        return self._num_tensors

    @property
    def shape(self) -> list[int]:
        """Shape of every tensor, as a new list each time (change it with ``update_dim``)."""
        return list(self._shape)

    @property
    def data_type(self) -> DataType:
        """Element type of every tensor."""
        return self._data_type

    @property
    def placement(self) -> Placement:
        """Where the memory lives: ``Placement.DEVICE`` (default) or ``Placement.HOST``."""
        return self._placement

    @property
    def batch_dim(self) -> int:
        """Index of the batch dimension (``batch_dim_index``)."""
        return self._batch_dim

    @property
    def batch_size(self) -> int:
        """``shape[batch_dim]`` at construction: batch rows, or blocks for a blocks cache."""
        return self._batch_size

    @property
    def seq_len_dim_index(self) -> int:
        """Index of the sequence-length dimension, or -1 when not given."""
        return self._seq_len_dim_index

    @property
    def kv_tensor_format(self) -> str | None:
        """Tensor format string, or None."""
        return self._kv_tensor_format

    @property
    def size(self) -> int:
        """Bytes of ONE tensor: product(shape) x element size.

        Computed from the current shape on every access. Raises
        ``LLMException(LLM_PARAM_INVALID)`` when a dimension is negative (unresolved; the
        message names the first such dimension and its index) or the size does not fit in
        int64.
        """
        return tensor_size(self._shape, self._data_type)

    def update_dim(self, dim_index: int, dim_value: int) -> None:
        """Set ``shape[dim_index] = dim_value`` in place; ``size`` follows, ``batch_size`` does not.

        Raises ``TypeError`` for non-ints, ``ValueError`` for a value outside int64 and
        ``LLMException(LLM_PARAM_INVALID)`` for an index outside ``[0, len(shape))``.
        """
        check_type("dim_index", dim_index, int)
        check_int("dim_value", dim_value, "int64")
        if not 0 <= dim_index < len(self._shape):
            param_invalid(f"dim_index {dim_index} out of range, [0, {len(self._shape)})")
        self._shape[dim_index] = dim_value


def tensor_size(shape: tuple[int, ...] | list[int], data_type: DataType) -> int:
    """Bytes of one tensor of ``shape`` and ``data_type``: product(shape) x element size.

    :raises LLMException: ``LLM_PARAM_INVALID`` when a dimension is negative (the message
        names the first one) or the size does not fit in int64.
    """
    for i, dim in enumerate(shape):
        if dim < 0:
            param_invalid(
                f"Failed to calc tensor size, shape = {list(shape)}, "
                f"data_type = {data_type}: dimension {i} is {dim}, and a cache "
                "dimension must not be negative"
            )
    size = math.prod(shape) * element_size(data_type)
    if size > _INT64_MAX:
        param_invalid(
            f"Failed to calc tensor size, shape = {list(shape)}, "
            f"data_type = {data_type}: {size} bytes overflows int64"
        )
    return size


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The layout of a cache, fixed when it was allocated, registered or wrapped.

    An immutable copy of the :class:`CacheDesc` the cache was made from: views, copies,
    transfers and the bounds that serve remote peers read this, never the caller's
    descriptor, so nothing done to a descriptor object later moves a cache's bounds.
    """

    num_tensors: int
    shape: tuple[int, ...]
    data_type: DataType
    placement: Placement
    batch_dim: int
    #: ``shape[batch_dim]`` when the descriptor was built (see ``CacheDesc.batch_size``).
    batch_size: int
    seq_len_dim_index: int
    kv_tensor_format: str | None
    is_blocks: bool

    @classmethod
    def of(cls, desc: CacheDesc, *, is_blocks: bool = False) -> CacheLayout:
        """Freeze ``desc`` as it is now (one read of its shape)."""
        return cls(
            num_tensors=desc._num_tensors,
            shape=tuple(desc._shape),
            data_type=desc._data_type,
            placement=desc._placement,
            batch_dim=desc._batch_dim,
            batch_size=desc._batch_size,
            seq_len_dim_index=desc._seq_len_dim_index,
            kv_tensor_format=desc._kv_tensor_format,
            is_blocks=is_blocks,
        )

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one tensor (``CacheDesc.size`` of the frozen shape).

        :raises LLMException: ``LLM_PARAM_INVALID`` as :func:`tensor_size`.
        """
        return tensor_size(self.shape, self.data_type)

    def to_desc(self) -> CacheDesc:
        """A new :class:`CacheDesc` equal to this layout; changing it changes nothing here."""
        desc = CacheDesc.__new__(CacheDesc)
        desc._num_tensors = self.num_tensors
        desc._shape = list(self.shape)
        desc._data_type = self.data_type
        desc._placement = self.placement
        desc._batch_dim = self.batch_dim
        desc._batch_size = self.batch_size
        desc._seq_len_dim_index = self.seq_len_dim_index
        desc._kv_tensor_format = self.kv_tensor_format
        desc._is_blocks = self.is_blocks
        return desc


class CacheKey(_KeyValue):
    """Names one batch row of a remote batch cache: ``(cluster_id, req_id, model_id, prefix_id)``.

    ``CacheKey(cluster_id, req_id, model_id=0, prefix_id=2**64-1)`` by position, or by keyword
    with ``prompt_cluster_id`` or ``cluster_id``, ``req_id``, ``model_id``, ``prefix_id``.
    At most 4 arguments; a cluster id and ``req_id`` are required; all values are uint64.
    Raises ``LLMException(LLM_PARAM_INVALID)`` for too many, missing, unknown or duplicated
    arguments, ``TypeError`` / ``ValueError`` for non-int or out-of-range values.

    Keys compare and hash by ``(cluster_id, req_id, model_id, prefix_id)``.
    """

    __slots__ = ("_cluster_id", "_model_id", "_prefix_id", "_req_id")

    _POSITIONAL = ("cluster_id", "req_id", "model_id", "prefix_id")
    _VALID = ("prompt_cluster_id", "cluster_id", "req_id", "model_id", "prefix_id")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        merged = _check_kwargs(args, kwargs, self._POSITIONAL, self._VALID)
        if "req_id" not in merged:
            param_invalid("Param req_id is required")
        key_name = "cluster_id" if "cluster_id" in merged else "prompt_cluster_id"
        cluster_id = merged[key_name]
        req_id = merged["req_id"]
        model_id = merged.get("model_id", 0)
        prefix_id = merged.get("prefix_id", INVALID_ID)
        check_int("cluster_id", cluster_id, "uint64")
        check_int("req_id", req_id, "uint64")
        check_int("model_id", model_id, "uint64")
        check_int("prefix_id", prefix_id, "uint64")
        self._cluster_id: int = cluster_id
        self._req_id: int = req_id
        self._model_id: int = model_id
        self._prefix_id: int = prefix_id

    @property
    def cluster_id(self) -> int:
        """cluster_id of the endpoint that holds the cache."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as ``cluster_id``."""
        return self._cluster_id

    @property
    def req_id(self) -> int:
        """Request id; ``2**64-1`` means none."""
        return self._req_id

    @property
    def model_id(self) -> int:
        """Model id (default 0)."""
        return self._model_id

    @property
    def prefix_id(self) -> int:
        """Shared-prefix id; ``2**64-1`` (default) means none."""
        return self._prefix_id

    def is_placeholder(self) -> bool:
        """True for a key that marks an unused batch row in ``allocate_cache``.

        That is ``req_id == 2**64-1`` with no valid ``prefix_id``; such keys are never bound.
        """
        return self._req_id == INVALID_ID and not is_valid_id(self._prefix_id)

    def identity(self) -> tuple[str, int, int]:
        """What a cache key is bound by on its owner: the cluster id is not part of it.

        ``("prefix", prefix_id, model_id)`` when ``prefix_id`` is valid, else
        ``("req", req_id, model_id)``.
        """
        if is_valid_id(self._prefix_id):
            return ("prefix", self._prefix_id, self._model_id)
        return ("req", self._req_id, self._model_id)

    def _key(self) -> tuple[int, int, int, int]:
        return (self._cluster_id, self._req_id, self._model_id, self._prefix_id)

    def __repr__(self) -> str:
        return (
            f"CacheKey(cluster_id={self._cluster_id}, req_id={self._req_id}, "
            f"prefix_id={self._prefix_id}, model_id={self._model_id})"
        )


class CacheKeyByIdAndIndex(_KeyValue):
    """Addresses batch row ``batch_index`` of cache ``cache_id`` on endpoint ``cluster_id``.

    Raises ``TypeError`` for non-ints and ``ValueError`` outside the C ranges: ``cluster_id``
    uint64, ``cache_id`` int64, ``batch_index`` uint32. Compares and hashes by all three.
    """

    __slots__ = ("_batch_index", "_cache_id", "_cluster_id")

    def __init__(self, cluster_id: int, cache_id: int, batch_index: int = 0) -> None:
        check_int("cluster_id", cluster_id, "uint64")
        check_int("cache_id", cache_id, "int64")
        check_int("batch_index", batch_index, "uint32")
        self._cluster_id = cluster_id
        self._cache_id = cache_id
        self._batch_index = batch_index

    @property
    def cluster_id(self) -> int:
        """cluster_id of the endpoint that holds the cache."""
        return self._cluster_id

    @property
    def cache_id(self) -> int:
        """Id of the cache on that endpoint."""
        return self._cache_id

    @property
    def batch_index(self) -> int:
        """Batch row of the cache (default 0)."""
        return self._batch_index

    def _key(self) -> tuple[int, int, int]:
        return (self._cluster_id, self._cache_id, self._batch_index)

    def __repr__(self) -> str:
        return (
            f"CacheKeyByIdAndIndex(cluster_id={self._cluster_id}, "
            f"cache_id={self._cache_id}, batch_index={self._batch_index})"
        )


class BlocksCacheKey(_KeyValue):
    """Names a whole blocks (PA) cache: ``(cluster_id, model_id)``.

    ``BlocksCacheKey(cluster_id, model_id=0)`` by position, or by keyword with
    ``prompt_cluster_id`` or ``cluster_id`` and ``model_id``. At most 2 arguments; a cluster id
    is required; both values must be ``int`` (a type check only, as in the reference).
    Raises ``LLMException(LLM_PARAM_INVALID)`` for too many, missing, unknown or duplicated
    arguments and ``TypeError`` for non-ints. Compares and hashes by ``(cluster_id, model_id)``.

    Values outside uint64 construct, as in the reference, but every call that takes the key
    (``pull_blocks``, ``push_blocks``, ``allocate_blocks_cache``, ``register_blocks_cache``,
    ``transfer_cache_async``) refuses it first with ``ValueError`` (see
    :func:`check_blocks_key_range`).
    """

    __slots__ = ("_cluster_id", "_cluster_id_key", "_model_id")

    _cluster_id: int
    _model_id: int
    _cluster_id_key: str
    _POSITIONAL = ("cluster_id", "model_id")
    _VALID = ("prompt_cluster_id", "cluster_id", "model_id")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not kwargs and 0 < len(args) <= 2:  # (cluster_id[, model_id]): the usual way
            cluster_id, model_id = args if len(args) == 2 else (args[0], 0)
            if type(cluster_id) is int and type(model_id) is int:
                self._cluster_id, self._model_id = cluster_id, model_id
                self._cluster_id_key = "cluster_id"
                return
        merged = _check_kwargs(args, kwargs, self._POSITIONAL, self._VALID)
        key_name = "cluster_id" if "cluster_id" in merged else "prompt_cluster_id"
        cluster_id = merged[key_name]
        model_id = merged.get("model_id", 0)
        check_type("cluster_id", cluster_id, int)
        check_type("model_id", model_id, int)
        self._cluster_id = cluster_id
        self._model_id = model_id
        # repr names the cluster id the way the caller did.
        self._cluster_id_key = key_name

    @property
    def cluster_id(self) -> int:
        """cluster_id of the endpoint that holds the cache."""
        return self._cluster_id

    @property
    def prompt_cluster_id(self) -> int:
        """Same as ``cluster_id``."""
        return self._cluster_id

    @property
    def model_id(self) -> int:
        """Model id (default 0); lets one endpoint register several blocks caches."""
        return self._model_id

    def _key(self) -> tuple[int, int]:
        return (self._cluster_id, self._model_id)

    def __repr__(self) -> str:
        return (
            f"BlocksCacheKey({self._cluster_id_key}={self._cluster_id}, model_id={self._model_id})"
        )


def check_blocks_key_range(name: str, key: BlocksCacheKey) -> None:
    """Refuse a ``BlocksCacheKey`` whose ``cluster_id`` or ``model_id`` is outside uint64.

    The key constructs with any int (as the reference's does); the calls that use it take
    uint64 values, so they check here before anything else.

    :raises ValueError: naming ``name``, the key and the field.
    """
    if 0 <= key._cluster_id <= INVALID_ID and 0 <= key._model_id <= INVALID_ID:
        return
    for field, value in (("cluster_id", key.cluster_id), ("model_id", key.model_id)):
        if not 0 <= value <= INVALID_ID:
            raise ValueError(
                f"{name} {key!r}: BlocksCacheKey {field} {value} is outside uint64 "
                f"range [0, {INVALID_ID}]"
            )


class MemInfo:
    """A memory range for ``remap_registered_memory``: ``mem_type``, ``addr`` and ``size`` bytes.

    Type-checked only (``TypeError``); the range checks belong to the caller.
    """

    __slots__ = ("_addr", "_mem_type", "_size")

    def __init__(self, mem_type: Memtype, addr: int, size: int) -> None:
        check_type("mem_type", mem_type, Memtype)
        check_type("addr", addr, int)
        check_type("size", size, int)
        self._mem_type = mem_type
        self._addr = addr
        self._size = size

    @property
    def mem_type(self) -> Memtype:
        """Kind of memory."""
        return self._mem_type

    @property
    def addr(self) -> int:
        """Start address."""
        return self._addr

    @property
    def size(self) -> int:
        """Length in bytes."""
        return self._size

    def __repr__(self) -> str:
        return f"MemInfo(mem_type={self._mem_type}, addr={self._addr}, size={self._size})"


class TransferConfig:
    """One destination of ``transfer_cache_async`` given by raw tensor addresses.

    ``dst_addrs`` lists two addresses (K, V) per transferred layer; ``src_layer_range`` None
    means all layers; ``src_batch_index`` picks the row of a batch source. Setters validate
    like the constructor: ``TypeError`` / ``ValueError`` for types and ranges
    (``dst_cluster_id`` uint64, ``dst_addrs`` list/tuple of uint64, ``src_batch_index``
    uint32), ``LLMException(LLM_PARAM_INVALID)`` for a range whose step is not 1 or that does
    not satisfy ``0 <= start < stop``. ``dst_layer_range`` is a plain attribute, always None.
    """

    __slots__ = (
        "_dst_addrs",
        "_dst_cluster_id",
        "_src_batch_index",
        "_src_layer_range",
        "dst_layer_range",
    )

    def __init__(
        self,
        dst_cluster_id: int,
        dst_addrs: list[int] | tuple[int, ...],
        src_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        check_int("dst_cluster_id", dst_cluster_id, "uint64")
        check_int_list("dst_addrs", dst_addrs, "uint64")
        check_layer_range("src_layer_range", src_layer_range)
        check_int("src_batch_index", src_batch_index, "uint32")
        self._dst_cluster_id = dst_cluster_id
        self._dst_addrs = dst_addrs
        self._src_layer_range = src_layer_range
        self._src_batch_index = src_batch_index
        self.dst_layer_range: range | None = None

    @property
    def dst_cluster_id(self) -> int:
        """cluster_id of the destination endpoint."""
        return self._dst_cluster_id

    @dst_cluster_id.setter
    def dst_cluster_id(self, dst_cluster_id: int) -> None:
        check_int("dst_cluster_id", dst_cluster_id, "uint64")
        self._dst_cluster_id = dst_cluster_id

    @property
    def dst_addrs(self) -> list[int] | tuple[int, ...]:
        """Destination tensor addresses, K then V for each layer of ``src_layer_range``."""
        return self._dst_addrs

    @dst_addrs.setter
    def dst_addrs(self, dst_addrs: list[int] | tuple[int, ...]) -> None:
        check_int_list("dst_addrs", dst_addrs, "uint64")
        self._dst_addrs = dst_addrs

    @property
    def src_layer_range(self) -> range | None:
        """Source layers to send (step 1); None means all layers."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, src_layer_range: range | None) -> None:
        check_layer_range("src_layer_range", src_layer_range)
        self._src_layer_range = src_layer_range

    @property
    def src_batch_index(self) -> int:
        """Batch row of a batch (non-PA) source."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, src_batch_index: int) -> None:
        check_int("src_batch_index", src_batch_index, "uint32")
        self._src_batch_index = src_batch_index

    def __repr__(self) -> str:
        return (
            f"TransferConfig(dst_cluster_id={self._dst_cluster_id}, "
            f"dst_addrs={self._dst_addrs}, "
            f"src_layer_range={self._src_layer_range}, "
            f"src_batch_index={self._src_batch_index})"
        )


class TransferWithCacheKeyConfig:
    """One destination of ``transfer_cache_async`` given by a remote cache key.

    Needs ``enable_remote_cache_accessible``. Both ranges are required although they default
    to None: None raises ``TypeError``. Each range needs step 1 and ``0 <= start < stop``, and
    the two need the same length (``LLMException(LLM_PARAM_INVALID)`` otherwise).
    ``src_batch_index`` is uint32 and must be 0 with a ``BlocksCacheKey``.
    ``dst_cluster_id`` is always ``cache_key.cluster_id``.

    The setters check each value on its own (the range setters also refuse None); the
    equal-length rule is checked again when the transfer starts.
    """

    __slots__ = ("_cache_key", "_dst_layer_range", "_src_batch_index", "_src_layer_range")

    def __init__(
        self,
        cache_key: BlocksCacheKey | CacheKeyByIdAndIndex,
        src_layer_range: range | None = None,
        dst_layer_range: range | None = None,
        src_batch_index: int = 0,
    ) -> None:
        check_type("cache_key", cache_key, BlocksCacheKey, CacheKeyByIdAndIndex)
        src = _required_range("src_layer_range", src_layer_range)
        dst = _required_range("dst_layer_range", dst_layer_range)
        if len(src) != len(dst):
            param_invalid(
                f"src_layer_range size should be equal to dst_layer_range size, "
                f"but got {src} and {dst}"
            )
        check_int("src_batch_index", src_batch_index, "uint32")
        _check_blocks_batch_index(cache_key, src_batch_index)
        self._cache_key = cache_key
        self._src_layer_range = src
        self._dst_layer_range = dst
        self._src_batch_index = src_batch_index

    @property
    def cache_key(self) -> BlocksCacheKey | CacheKeyByIdAndIndex:
        """Key of the destination cache (blocks cache or batch row)."""
        return self._cache_key

    @cache_key.setter
    def cache_key(self, cache_key: BlocksCacheKey | CacheKeyByIdAndIndex) -> None:
        check_type("cache_key", cache_key, BlocksCacheKey, CacheKeyByIdAndIndex)
        _check_blocks_batch_index(cache_key, self._src_batch_index)
        self._cache_key = cache_key

    @property
    def dst_cluster_id(self) -> int:
        """``cache_key.cluster_id``."""
        return self._cache_key.cluster_id

    @property
    def src_layer_range(self) -> range:
        """Source layers to send (step 1)."""
        return self._src_layer_range

    @src_layer_range.setter
    def src_layer_range(self, src_layer_range: range) -> None:
        self._src_layer_range = _required_range("src_layer_range", src_layer_range)

    @property
    def dst_layer_range(self) -> range:
        """Destination layers, one per source layer in order (step 1)."""
        return self._dst_layer_range

    @dst_layer_range.setter
    def dst_layer_range(self, dst_layer_range: range) -> None:
        self._dst_layer_range = _required_range("dst_layer_range", dst_layer_range)

    @property
    def src_batch_index(self) -> int:
        """Batch row of a batch (non-PA) source; 0 with a ``BlocksCacheKey``."""
        return self._src_batch_index

    @src_batch_index.setter
    def src_batch_index(self, src_batch_index: int) -> None:
        check_int("src_batch_index", src_batch_index, "uint32")
        _check_blocks_batch_index(self._cache_key, src_batch_index)
        self._src_batch_index = src_batch_index

    def __repr__(self) -> str:
        return (
            f"TransferWithCacheKeyConfig(cache_key={self._cache_key}, "
            f"src_layer_range={self._src_layer_range}, "
            f"dst_layer_range={self._dst_layer_range}, "
            f"src_batch_index={self._src_batch_index})"
        )


def _required_range(name: str, value: range | None) -> range:
    # None is refused with TypeError here, although the signature defaults to None.
    check_layer_range(name, value, allow_none=False)
    assert isinstance(value, range)  # for mypy: the check above raised otherwise
    return value


def _check_blocks_batch_index(cache_key: object, src_batch_index: int) -> None:
    if isinstance(cache_key, BlocksCacheKey) and src_batch_index != 0:
        param_invalid(
            f"src_batch_index should be 0 when cache_key is BlocksCacheKey, got {src_batch_index}"
        )


class KvCache:
    """A v1 cache handle: ``cache_id``, ``cache_desc`` and tensor addresses per device.

    Kept for callers that import it; the v1 API itself is not supported. ``cache_id`` is
    int64 (``TypeError`` / ``ValueError`` otherwise).
    """

    __slots__ = ("_cache_desc", "_cache_id", "_kv_cache_manager", "_per_device_tensor_addrs")

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc,
        per_device_tensor_addrs: list[list[int]],
        kv_cache_manager: Any = None,
    ) -> None:
        check_int("cache_id", cache_id, "int64")
        self._cache_id = cache_id
        self._cache_desc = cache_desc
        self._per_device_tensor_addrs = per_device_tensor_addrs
        self._kv_cache_manager = kv_cache_manager

    @property
    def cache_id(self) -> int:
        """Id of the cache (-1 for a CPU cache)."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """Descriptor of the cache."""
        return self._cache_desc

    @property
    def per_device_tensor_addrs(self) -> list[list[int]]:
        """One list of ``num_tensors`` addresses per device."""
        return self._per_device_tensor_addrs

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int] | list[list[int]]) -> KvCache:
        """Wrap host buffers as a KvCache with ``cache_id = -1``.

        ``addrs`` is a flat list of ``num_tensors`` addresses, or a list of such lists (one per
        device); the two forms cannot be mixed. Raises ``TypeError`` for wrong types and
        ``LLMException(LLM_PARAM_INVALID)`` when the placement is not HOST, ``addrs`` is
        empty, mixes forms, or a list's length differs from ``num_tensors``.
        """
        check_type("cache_desc", cache_desc, CacheDesc)
        if cache_desc.placement != Placement.HOST:
            param_invalid("cache_desc placement must be HOST")
        check_type("addrs", addrs, list)
        if not addrs:
            param_invalid("addrs length should be bigger than zero.")
        nested = isinstance(addrs[0], list)
        for addr in addrs:
            check_type("the internal element of addrs", addr, list, int)
            if isinstance(addr, list) != nested:
                param_invalid("the type of the internal element of addrs should be consistent.")
            if isinstance(addr, list):
                for item in addr:
                    check_type("the internal element of addrs", item, int)
                if len(addr) != cache_desc.num_tensors:
                    param_invalid(
                        f"cache_desc num_tensors:{cache_desc.num_tensors} should be equal to "
                        f"size of the internal element of addrs:{len(addr)}"
                    )
        if not nested and len(addrs) != cache_desc.num_tensors:
            param_invalid(
                f"cache_desc num_tensors:{cache_desc.num_tensors} "
                f"should be equal to size of addrs:{len(addrs)}"
            )
        per_device: list[list[int]] = (
            [list(a) for a in addrs if isinstance(a, list)]
            if nested
            else [[a for a in addrs if isinstance(a, int)]]
        )
        return cls(-1, cache_desc, per_device, None)

    def __repr__(self) -> str:
        return (
            f"KvCache(cache_id = {self._cache_id}, "
            f"num_devices = {len(self._per_device_tensor_addrs)})"
        )
