"""``Cache``: a group of same-shaped tensors allocated or registered by a cache manager."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from aio_datadist._memory import views
from aio_datadist._validate import check_int_list, check_type
from aio_datadist.enums import Placement
from aio_datadist.status import LLMStatusCode, ParamInvalidError
from aio_datadist.types import CacheDesc, CacheLayout

if TYPE_CHECKING:
    from aio_datadist._engine.caches import CacheService

__all__ = ("Cache",)


class Cache:
    """A KV cache: ``num_tensors`` tensors described by ``cache_desc``, one address each.

    Returned by the cache manager's allocate and register calls (users do not construct it),
    or wrapped around host buffers by :meth:`create_cpu_cache` for ``swap_blocks``.

    The cache keeps its own frozen copy of the descriptor it was made from (its
    ``CacheLayout``); views and every operation on the cache use that copy, so changing the
    caller's descriptor afterwards (``update_dim``) cannot move the cache's bounds.
    """

    __slots__ = (
        "_cache_id",
        "_cache_manager",
        "_is_blocks_cache",
        "_is_registered",
        "_keepalive",
        "_layout",
        "_owner",
        "_tensor_addrs",
    )

    def __init__(
        self,
        cache_id: int,
        cache_desc: CacheDesc | CacheLayout,
        tensor_addrs: list[int],
        cache_manager: Any = None,
        is_registered: bool = False,
        is_blocks_cache: bool = False,
    ) -> None:
        self._cache_id = cache_id
        self._layout = (
            cache_desc
            if isinstance(cache_desc, CacheLayout)
            else CacheLayout.of(cache_desc, is_blocks=is_blocks_cache)
        )
        self._tensor_addrs: tuple[int, ...] = tuple(tensor_addrs)
        self._cache_manager = cache_manager
        self._is_registered = is_registered
        self._is_blocks_cache = is_blocks_cache
        self._owner: CacheService | None = None
        self._keepalive: object = None

    @property
    def cache_id(self) -> int:
        """Id of the cache, unique within one ``init``; ``-1`` for a CPU cache."""
        return self._cache_id

    @property
    def cache_desc(self) -> CacheDesc:
        """Descriptor of the cache's tensors as the cache was made: a new copy on each access.

        The copy is the caller's to change; the cache keeps its own layout whatever is done
        to it (or to the descriptor passed to the allocate or register call).
        """
        return self._layout.to_desc()

    @property
    def tensor_addrs(self) -> list[int]:
        """One address per tensor (a new list); ``[]`` once the cache was deallocated or
        unregistered."""
        return list(self._tensor_addrs)

    @property
    def is_blocks_cache(self) -> bool:
        """True for a PagedAttention (blocks) cache, whose dimension 0 indexes blocks."""
        return self._is_blocks_cache

    @classmethod
    def create_cpu_cache(cls, cache_desc: CacheDesc, addrs: list[int]) -> Cache:
        """Wrap host buffers (one per tensor) as a blocks cache for ``swap_blocks``.

        The memory stays the caller's; it is not registered.

        :raises TypeError: wrong argument types.
        :raises ValueError: an address outside uint64.
        :raises LLMException: ``LLM_PARAM_INVALID`` when the placement is not HOST or the number
            of addresses differs from ``num_tensors``.
        """
        check_type("cache_desc", cache_desc, CacheDesc)
        check_int_list("addrs", addrs, "uint64", containers=(list,))
        if cache_desc.placement is not Placement.HOST:
            raise ParamInvalidError(
                f"create_cpu_cache needs a HOST placement, but got {cache_desc.placement!s}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        if len(addrs) != cache_desc.num_tensors:
            raise ParamInvalidError(
                f"create_cpu_cache needs {cache_desc.num_tensors} addresses "
                f"(num_tensors), but got {len(addrs)}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        return cls(-1, cache_desc, addrs, None, False, True)

    def _host_addressable(self) -> bool:
        if self._layout.placement is Placement.HOST:
            return True
        return self._owner is not None and self._owner.runtime.device_memory_is_host

    def as_numpy(self) -> list[np.ndarray[Any, np.dtype[Any]]]:
        """Numpy arrays over the cache's tensors, sharing memory.

        Their shape is the descriptor's shape when the cache was allocated or registered
        (``cache_desc.shape``); a later ``update_dim`` on any descriptor does not change it.

        Writing to them writes the cache. BF16 tensors appear as raw ``uint16`` words. The arrays
        stay safe to touch after the cache or engine is released (the memory is kept mapped while
        a view exists), but then they no longer belong to the cache.

        :raises LLMException: ``LLM_PARAM_INVALID`` when the memory is on an accelerator (the
            runtime in use is not the host one) or the cache has been released.
        """
        if not self._tensor_addrs:
            raise ParamInvalidError(
                f"cache {self._cache_id} has been released: no tensors to view",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        if not self._host_addressable():
            raise ParamInvalidError(
                f"cache {self._cache_id} lives in accelerator memory, which the host cannot "
                "view: copy it to a HOST cache (copy_cache, swap_blocks) to read it",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        layout = self._layout
        return [
            views.numpy_view(addr, layout.shape, layout.data_type, self._keepalive)
            for addr in self._tensor_addrs
        ]

    def as_torch(self) -> list[Any]:
        """Torch tensors over the cache's tensors, sharing memory (BF16 as ``torch.bfloat16``).

        Needs torch installed; it is imported on first use only.

        :raises ImportError: torch is not installed.
        :raises LLMException: as :meth:`as_numpy`.
        """
        return [views.torch_view(a, self._layout.data_type) for a in self.as_numpy()]

    def __str__(self) -> str:
        return (
            f"Cache(cache_id = {self._cache_id}, device_tensor_addrs = "
            f"{len(self._tensor_addrs)}, is_blocks_cache = {self._is_blocks_cache})"
        )

    __repr__ = __str__
