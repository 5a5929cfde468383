"""The Ascend runtime: device memory, page-locked host memory and copies through libascendcl.

``AIO_DATADIST_ASCENDCL`` names the library to load instead of ``libascendcl.so`` from the
loader's search path. ACL is initialised once per process and stays initialised (see
:func:`aio_datadist._native.acl.init`); each runtime holds its device from ``open_runtime``
until :meth:`AclRuntime.close` and the last free of its memory, whichever comes later.
"""

from __future__ import annotations

import os

import numpy as np
import numpy.typing as npt

from aio_datadist._log import get_logger
from aio_datadist._native import acl
from aio_datadist._runtime.base import CopyKind, DeviceRuntime, RuntimeUnavailable
from aio_datadist._runtime.hccl import HcclCommunicator, HcclPresence, probe

__all__ = ("ASCENDCL_ENV", "AclRuntime", "open_runtime")

ASCENDCL_ENV = "AIO_DATADIST_ASCENDCL"
_log = get_logger("runtime.acl")


class AclRuntime(DeviceRuntime):
    """Device memory from ``aclrtMalloc``, host memory from ``aclrtMallocHost``, copies on a stream.

    Device memory is not host memory: caches on it have no numpy views; their bytes move only
    through :meth:`copy_batch`.
    """

    name = "acl"
    device_memory_is_host = False

    def __init__(self, device: acl.AclDevice, library: str, hccl: HcclPresence) -> None:
        """Wrap an open device; use :func:`open_runtime` rather than calling this."""
        super().__init__(device.device_id)
        self._device = device
        self.library = library
        """The libascendcl path or name in use."""
        self.hccl = hccl
        """Whether libhccl is present, for rank-table ``link`` domains."""
        self.features: frozenset[str] = frozenset({"acl"} | ({"hccl"} if hccl.available else set()))
        """What this runtime offers: ``acl``, plus ``hccl`` when libhccl is present."""
        self._closed = False

    def alloc_device(self, nbytes: int) -> int:
        return self._device.malloc(nbytes)

    def free_device(self, addr: int, nbytes: int) -> None:
        self._device.free(addr)

    def alloc_host(self, nbytes: int) -> int:
        return self._device.malloc_host(nbytes)

    def free_host(self, addr: int, nbytes: int) -> None:
        self._device.free_host(addr)

    def copy_batch(self, ops: npt.NDArray[np.uint64], kind: CopyKind) -> None:
        self._device.copy_batch(ops, int(kind))

    def synchronize(self) -> None:
        self._device.synchronize()

    def zero_device(self, addr: int, nbytes: int) -> None:
        """``aclrtMemset``; through a zeroed pinned buffer where the library lacks it."""
        if not self._device.memset(addr, 0, nbytes):
            super().zero_device(addr, nbytes)

    def open_communicator(self, rank_table_path: str, rank: int) -> HcclCommunicator | None:
        """This rank's HCCL communicator of the rank table; None without libhccl's rank-table
        and one-sided calls."""
        if not self.hccl.domains:
            return None
        return HcclCommunicator(self._device, rank_table_path, rank)

    def close(self) -> None:
        """Destroy the stream; the device is reset now, or when the last allocation is freed."""
        if self._closed:
            return
        self._closed = True
        self._device.close()
        _log.debug("acl.closed", device_id=self.device_id)


def open_runtime(device_id: int) -> AclRuntime:
    """Load libascendcl, initialise ACL and open ``device_id``.

    :raises RuntimeUnavailable: the library cannot be loaded or initialised, ACL reports no
        device, or ``device_id`` is not below the device count; the message says which.
    :raises LLMException: ``LLM_FAILED`` when the device exists but cannot be opened.
    """
    library = os.environ.get(ASCENDCL_ENV, "").strip() or acl.DEFAULT_LIBRARY
    try:
        acl.load(library)
        count = acl.device_count()
    except acl.AclUnavailable as exc:
        raise RuntimeUnavailable(f"libascendcl cannot be used: {exc}") from None
    if count == 0:
        raise RuntimeUnavailable(f"{library} is loaded but ACL reports no Ascend device")
    if not 0 <= device_id < count:
        raise RuntimeUnavailable(
            f"device_id {device_id} is out of range: ACL reports {count} Ascend device(s)"
        )
    device = acl.AclDevice(device_id)
    presence = probe()
    _log.info(
        "acl.opened",
        device_id=device_id,
        devices=count,
        library=library,
        hccl=presence.library if presence.available else f"absent ({presence.reason})",
    )
    return AclRuntime(device, library, presence)
