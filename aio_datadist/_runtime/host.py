"""The host runtime: serves both placements from host memory on machines without an accelerator."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from aio_datadist._native import api
from aio_datadist._runtime.base import CopyKind, DeviceRuntime

__all__ = ("HostRuntime",)


class HostRuntime(DeviceRuntime):
    """Device memory is ordinary host memory; every copy is a native batched memcpy."""

    name = "host"
    device_memory_is_host = True
    #: Both placements are fresh anonymous mappings (``host_alloc``), zero until written.
    fresh_memory_is_zero = True

    def alloc_device(self, nbytes: int) -> int:
        return api.host_alloc(nbytes)

    def free_device(self, addr: int, nbytes: int) -> None:
        api.host_free(addr, nbytes)

    def alloc_host(self, nbytes: int) -> int:
        return api.host_alloc(nbytes)

    def free_host(self, addr: int, nbytes: int) -> None:
        api.host_free(addr, nbytes)

    def copy_batch(self, ops: npt.NDArray[np.uint64], kind: CopyKind) -> None:
        api.copy_batch(ops)

    def synchronize(self) -> None:
        """Host copies complete before ``copy_batch`` returns; nothing to wait for."""
