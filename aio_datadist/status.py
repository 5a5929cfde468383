"""Status codes, the exception hierarchy and the code-to-exception registry.

Every class below is exported from ``aio_datadist``; see :class:`LLMException` for the
tree and for how to catch them. ``LLMException(msg, status_code=code)`` builds the subclass
registered for ``code``, so ``except LLMTimeoutError`` and ``except LLMException`` both work
wherever the library raises.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, ClassVar

__all__ = (
    "LLMStatusCode",
    "LLMException",
    "Status",
    "lookup",
    "raise_for_status",
    "LLMFailedError",
    "KvCacheNotExistError",
    "RepeatRequestError",
    "ParamInvalidError",
    "EngineFinalizedError",
    "NotYetLinkError",
    "AlreadyLinkError",
    "LinkFailedError",
    "UnlinkFailedError",
    "NotifyPromptUnlinkFailedError",
    "ClusterNumExceedLimitError",
    "ProcessingLinkError",
    "DeviceOutOfMemoryError",
    "ExistLinkError",
    "FeatureNotEnabledError",
    "LLMTimeoutError",
    "LinkBusyError",
    "OutOfMemoryError",
)

_GE_BASE = 0x5010B000


class LLMStatusCode(IntEnum):
    """Result codes of LLM-DataDist calls, with the values of the native package."""

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = _GE_BASE + 1
    LLM_KV_CACHE_NOT_EXIST = _GE_BASE + 2
    LLM_REPEAT_REQUEST = _GE_BASE + 3
    LLM_REQUEST_ALREADY_COMPLETED = _GE_BASE + 4
    LLM_PARAM_INVALID = _GE_BASE + 5
    LLM_ENGINE_FINALIZED = _GE_BASE + 6
    LLM_NOT_YET_LINK = _GE_BASE + 7
    LLM_ALREADY_LINK = _GE_BASE + 8
    LLM_LINK_FAILED = _GE_BASE + 9
    LLM_UNLINK_FAILED = _GE_BASE + 10
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = _GE_BASE + 11
    LLM_CLUSTER_NUM_EXCEED_LIMIT = _GE_BASE + 12
    LLM_PROCESSING_LINK = _GE_BASE + 13
    LLM_DEVICE_OUT_OF_MEMORY = _GE_BASE + 14
    LLM_PREFIX_ALREADY_EXIST = _GE_BASE + 15
    LLM_PREFIX_NOT_EXIST = _GE_BASE + 16
    LLM_SEQ_LENOVERLIMIT = _GE_BASE + 17
    LLM_NO_FREE_BLOCK = _GE_BASE + 18
    LLM_BLOCKS_OUT_OF_MEMORY = _GE_BASE + 19
    LLM_EXIST_LINK = _GE_BASE + 24
    LLM_FEATURE_NOT_ENABLED = _GE_BASE + 25
    LLM_TIMEOUT = _GE_BASE + 26
    LLM_LINK_BUSY = _GE_BASE + 27
    LLM_OUT_OF_MEMORY = _GE_BASE + 28
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"LLMStatusCode.{self.name}"


_REGISTRY: dict[LLMStatusCode, type[LLMException]] = {}


class LLMException(RuntimeError):
    """Error raised by LLM-DataDist calls; ``status_code`` says which documented failure.

    A ``RuntimeError``, as in the reference package. Each status code the library raises
    has its own subclass, all exported from ``aio_datadist``::

        RuntimeError
         └── LLMException                     .status_code: LLMStatusCode
              ├── LLMFailedError                LLM_FAILED
              ├── KvCacheNotExistError          LLM_KV_CACHE_NOT_EXIST
              ├── RepeatRequestError            LLM_REPEAT_REQUEST
              ├── ParamInvalidError             LLM_PARAM_INVALID
              ├── EngineFinalizedError          LLM_ENGINE_FINALIZED
              ├── NotYetLinkError               LLM_NOT_YET_LINK
              ├── AlreadyLinkError              LLM_ALREADY_LINK
              ├── LinkFailedError               LLM_LINK_FAILED
              ├── UnlinkFailedError             LLM_UNLINK_FAILED
              ├── NotifyPromptUnlinkFailedError LLM_NOTIFY_PROMPT_UNLINK_FAILED
              ├── ClusterNumExceedLimitError    LLM_CLUSTER_NUM_EXCEED_LIMIT
              ├── ProcessingLinkError           LLM_PROCESSING_LINK
              ├── DeviceOutOfMemoryError        LLM_DEVICE_OUT_OF_MEMORY
              ├── ExistLinkError                LLM_EXIST_LINK
              ├── FeatureNotEnabledError        LLM_FEATURE_NOT_ENABLED
              ├── LLMTimeoutError               LLM_TIMEOUT
              ├── LinkBusyError                 LLM_LINK_BUSY
              └── OutOfMemoryError              LLM_OUT_OF_MEMORY

    The other codes (the v1-only ones, ``LLM_DEVICE_MEM_ERROR``,
    ``LLM_SUSPECT_REMOTE_ERROR``, ``LLM_UNKNOWN_ERROR``) have no subclass: an exception with
    one of them is a plain ``LLMException``.

    Catch by class, or catch the base class and test the code; both work for every
    exception the library raises, and code written for the reference package (which has
    only the base class) keeps working::

        try:
            await cm.pull_blocks(key, cache, src_blocks, dst_blocks)
        except NotYetLinkError:
            ...  # link first, then retry
        except LLMException as exc:
            if exc.status_code == LLMStatusCode.LLM_TIMEOUT:
                ...  # the link must be rebuilt
            raise

    Constructing the base class with a ``status_code`` that has a registered subclass
    returns an instance of that subclass: ``LLMException("m", status_code=code)`` is an
    instance of ``lookup(code)``. A subclass built without ``status_code`` takes its own.

    :param args: the message (and any further arguments), as for ``RuntimeError``.
    :param status_code: an ``LLMStatusCode`` (or its int value); a value outside the enum is
        kept as the int given.
    """

    code: ClassVar[LLMStatusCode | None] = None
    #: Every config's status (as ``CacheTask.get_results()`` gives) on the exception that
    #: awaiting a failed ``CacheTask`` raises; None elsewhere.
    results: list[LLMStatusCode | None] | None = None

    def __init_subclass__(cls, code: LLMStatusCode | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
            _REGISTRY[code] = cls

    def __new__(cls, *args: Any, status_code: Any = LLMStatusCode.LLM_SUCCESS) -> LLMException:
        if cls is LLMException:
            try:
                sub = _REGISTRY.get(LLMStatusCode(status_code))
            except ValueError:
                sub = None
            if sub is not None:
                cls = sub
        return super().__new__(cls, *args)

    def __init__(self, *args: Any, status_code: Any = LLMStatusCode.LLM_SUCCESS) -> None:
        super().__init__(*args)
        if status_code == LLMStatusCode.LLM_SUCCESS and self.code is not None:
            status_code = self.code
        try:
            self._status_code: LLMStatusCode | int = LLMStatusCode(status_code)
        except ValueError:
            self._status_code = status_code

    @property
    def status_code(self) -> LLMStatusCode:
        """The documented status code of this failure."""
        return self._status_code  # type: ignore[return-value]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, int(self._status_code)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({super().__str__()!r}, status_code={self._status_code!s})"


def _rebuild(cls: type[LLMException], args: tuple[Any, ...], code: int) -> LLMException:
    return cls(*args, status_code=code)


class LLMFailedError(LLMException, code=LLMStatusCode.LLM_FAILED):
    """Generic failure (``LLM_FAILED``).

    Raised by ``init`` when another ``LLMDataDist`` is initialised in this process or the
    listen address cannot be bound, by cache-manager calls after ``finalize``, for a
    cancelled ``CacheTask``'s unfinished configs, and for native codes with no counterpart.
    """


class KvCacheNotExistError(LLMException, code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST):
    """The cache, key or row does not exist (``LLM_KV_CACHE_NOT_EXIST``).

    Raised for a local ``Cache`` unknown to (or released by) this engine, and by pulls and
    pushes whose remote key, cache or row is missing (for instance a row already pulled by
    its ``CacheKey``).
    """


class RepeatRequestError(LLMException, code=LLMStatusCode.LLM_REPEAT_REQUEST):
    """Duplicate request (``LLM_REPEAT_REQUEST``).

    Kept for the reference's code; the library does not raise it today.
    """


class ParamInvalidError(LLMException, code=LLMStatusCode.LLM_PARAM_INVALID):
    """An argument value is invalid (``LLM_PARAM_INVALID``).

    The library's error for values of the right type that the call cannot take: empty or
    mismatched block lists, a bad layer range, an index out of range, an unknown option, a
    key already bound, a missing memory pool. Also the status of a ``transfer_cache_async``
    config whose ``LayerSynchronizer`` returned False or raised.
    """


class EngineFinalizedError(LLMException, code=LLMStatusCode.LLM_ENGINE_FINALIZED):
    """The engine was finalized (``LLM_ENGINE_FINALIZED``).

    Kept for the reference's code; calls after ``finalize`` raise ``RuntimeError``
    (``LLMDataDist`` methods) or :class:`LLMFailedError` (cache-manager methods) instead.
    """


class NotYetLinkError(LLMException, code=LLMStatusCode.LLM_NOT_YET_LINK):
    """No usable link to the remote cluster (``LLM_NOT_YET_LINK``).

    Raised by pulls and pushes to a cluster that was never linked (or whose two-sided
    domain is not linked yet), and in ``unlink_clusters`` results for a graceful unlink of
    a cluster that is not linked.
    """


class AlreadyLinkError(LLMException, code=LLMStatusCode.LLM_ALREADY_LINK):
    """The link already exists (``LLM_ALREADY_LINK``).

    Appears in ``link_clusters`` results for a cluster this endpoint is already linked to.
    """


class LinkFailedError(LLMException, code=LLMStatusCode.LLM_LINK_FAILED):
    """A link could not be made or broke (``LLM_LINK_FAILED``).

    In ``link_clusters`` results when the peer cannot be reached or refuses; raised by a
    transfer over a link that closed without this side asking, and by ``link`` when the
    members of a domain did not all link in time.
    """


class UnlinkFailedError(LLMException, code=LLMStatusCode.LLM_UNLINK_FAILED):
    """An unlink failed (``LLM_UNLINK_FAILED``).

    Kept for the reference's code; ``unlink_clusters`` reports its failures in its results.
    """


class NotifyPromptUnlinkFailedError(
    LLMException, code=LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED
):
    """The peer could not be told of an unlink (``LLM_NOTIFY_PROMPT_UNLINK_FAILED``).

    Appears in ``unlink_clusters`` results for a graceful unlink the server did not
    acknowledge; this side's link is gone, and the server should call ``unlink_clusters``
    to clean up its end.
    """


class ClusterNumExceedLimitError(LLMException, code=LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT):
    """Too many clusters in one call (``LLM_CLUSTER_NUM_EXCEED_LIMIT``).

    Appears in ``link_clusters``/``unlink_clusters`` results when one call names more than
    16 clusters.
    """


class ProcessingLinkError(LLMException, code=LLMStatusCode.LLM_PROCESSING_LINK):
    """A link or unlink is in progress (``LLM_PROCESSING_LINK``).

    Kept for the reference's code (the documented remedy is to retry later); the library
    does not raise it today.
    """


class DeviceOutOfMemoryError(LLMException, code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY):
    """The device runtime could not allocate memory (``LLM_DEVICE_OUT_OF_MEMORY``).

    Raised when the accelerator runtime cannot supply device memory: a pool at ``init``,
    or a staging buffer of a copy.
    """


class ExistLinkError(LLMException, code=LLMStatusCode.LLM_EXIST_LINK):
    """``switch_role`` while links exist (``LLM_EXIST_LINK``).

    Unlink every cluster (and communication domain) before switching role.
    """


class FeatureNotEnabledError(LLMException, code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED):
    """A needed option was not enabled at init (``LLM_FEATURE_NOT_ENABLED``).

    Raised by ``push_cache``/``push_blocks`` without ``enable_remote_cache_accessible``, by
    ``link``/``unlink``/``query_register_mem_status`` and a listen-address change with the
    hixl backend, and always by the reserved ``remap_registered_memory``.
    """


class LLMTimeoutError(LLMException, code=LLMStatusCode.LLM_TIMEOUT):
    """A deadline ran out (``LLM_TIMEOUT``).

    Raised by a transfer that did not complete within ``sync_kv_timeout``; the documented
    remedy is to rebuild the link. ``CacheTask.synchronize`` returns (does not raise) this
    code at its own deadline.
    """


class LinkBusyError(LLMException, code=LLMStatusCode.LLM_LINK_BUSY):
    """Conflicting concurrent calls on one link (``LLM_LINK_BUSY``).

    Kept for the reference's code; the library does not raise it today.
    """


class OutOfMemoryError(LLMException, code=LLMStatusCode.LLM_OUT_OF_MEMORY):
    """The memory pool cannot hold the request (``LLM_OUT_OF_MEMORY``).

    Raised by ``allocate_cache``/``allocate_blocks_cache`` when the pool of the placement is
    full (memory of deallocated caches whose keys are still bound is not free yet).
    """


def lookup(code: LLMStatusCode | int) -> type[LLMException]:
    """Return the exception class registered for ``code`` (``LLMException`` when none is)."""
    try:
        return _REGISTRY.get(LLMStatusCode(code), LLMException)
    except ValueError:
        return LLMException


def raise_for_status(code: LLMStatusCode | int, message: str) -> None:
    """Raise the exception for ``code`` with ``message``; do nothing for ``LLM_SUCCESS``."""
    if code == LLMStatusCode.LLM_SUCCESS:
        return
    try:
        status = LLMStatusCode(code)
    except ValueError:
        status = LLMStatusCode.LLM_FAILED
    raise lookup(status)(message, status_code=status)


class Status:
    """A status code with an ``is_ok`` test, as returned by the reference's native layer."""

    __slots__ = ("_status_code",)

    def __init__(self, status: LLMStatusCode | int) -> None:
        self._status_code = status

    def is_ok(self) -> bool:
        """True when the status is ``LLM_SUCCESS``."""
        return bool(self._status_code == LLMStatusCode.LLM_SUCCESS)

    @property
    def status_code(self) -> LLMStatusCode | int:
        """The wrapped status code."""
        return self._status_code

    def __repr__(self) -> str:
        return f"Status({self._status_code!s})"
