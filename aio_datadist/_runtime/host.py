"""The host runtime: serves both placements from host memory on machines without an accelerator."""

from __future__ import annotations

import os
import threading

import numpy as np
import numpy.typing as npt

from aio_datadist._native import api
from aio_datadist._runtime.base import CopyKind, DeviceRuntime, HostShare

__all__ = ("HostRuntime",)


class HostRuntime(DeviceRuntime):
    """Device memory is ordinary host memory; every copy is a native batched memcpy.

    With :attr:`share_host_memory` both placements are shared memory
    (``api.host_alloc_shared``) where the host can make it, so a same-host peer maps a cache
    here instead of copying it through the kernel (:meth:`host_share`); otherwise private
    anonymous memory, which the kernel may back with huge pages (shared memory gets them
    only where ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` allows).
    """

    name = "host"
    device_memory_is_host = True
    #: Both placements are fresh mappings, zero until written, committed on first touch.
    fresh_memory_is_zero = True
    fresh_memory_is_lazy = True

    def __init__(self, device_id: int) -> None:
        super().__init__(device_id)
        self._shared: dict[int, HostShare] = {}
        self._lock = threading.Lock()
        #: False once the host could not make shared memory: later allocations are private.
        self._can_share = True

    def alloc_device(self, nbytes: int) -> int:
        return self._alloc(nbytes)

    def free_device(self, addr: int, nbytes: int) -> None:
        self._free(addr, nbytes)

    def alloc_host(self, nbytes: int) -> int:
        return self._alloc(nbytes)

    def free_host(self, addr: int, nbytes: int) -> None:
        self._free(addr, nbytes)

    def _alloc(self, nbytes: int) -> int:
        if not (self.share_host_memory and self._can_share):
            return api.host_alloc(nbytes)
        try:
            addr, fd = api.host_alloc_shared(nbytes)
        except OSError:  # no memory files here (an old kernel, a sandbox)
            self._can_share = False
            return api.host_alloc(nbytes)
        try:
            ino = os.fstat(fd).st_ino
        except OSError:
            api.host_free(addr, nbytes)
            os.close(fd)
            raise
        with self._lock:
            self._shared[addr] = HostShare(fd, ino, addr, nbytes)
        return addr

    def _free(self, addr: int, nbytes: int) -> None:
        with self._lock:
            share = self._shared.pop(addr, None)
        api.host_free(addr, nbytes)
        if share is not None:
            os.close(share.fd)

    def host_share(self, addr: int, nbytes: int) -> HostShare | None:
        with self._lock:
            for share in self._shared.values():
                if share.base <= addr and addr + nbytes <= share.base + share.nbytes:
                    return share
        return None

    def copy_batch(self, ops: npt.NDArray[np.uint64], kind: CopyKind) -> None:
        api.copy_batch(ops)

    def synchronize(self) -> None:
        """Host copies complete before ``copy_batch`` returns; nothing to wait for."""
