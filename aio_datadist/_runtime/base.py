"""The device-runtime interface: how memory of a placement is allocated, copied and synchronised.

One runtime is chosen per engine at ``init``. The cache manager talks only to this
interface, so CUDA and Ascend runtimes drop in without touching it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from types import TracebackType
from typing import Protocol

import numpy as np
import numpy.typing as npt

from aio_datadist._native import api
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = (
    "ZERO_CHUNK_BYTES",
    "Communicator",
    "CopyKind",
    "DeviceRuntime",
    "RuntimeUnavailable",
    "StageRing",
)

#: Bytes of the zeroed pinned buffer through which :meth:`DeviceRuntime.zero_device` writes
#: device memory on a runtime without a device memset.
ZERO_CHUNK_BYTES = 4 << 20


class RuntimeUnavailable(RuntimeError):
    """A device runtime cannot be used here: its library or a device is missing."""


class CopyKind(IntEnum):
    """Direction of a copy, in the terms device runtimes use."""

    HOST_TO_HOST = 0
    HOST_TO_DEVICE = 1
    DEVICE_TO_HOST = 2
    DEVICE_TO_DEVICE = 3


class StageRing(Protocol):
    """Device rows streamed through pinned host chunks, in order (``DeviceRuntime.stage_ring``).

    Iterating gives ``(addr, nbytes)`` chunks of pinned host memory. Reading the device
    (``DEVICE_TO_HOST``), each chunk holds the next bytes while later ones are already being
    copied; writing it (``HOST_TO_DEVICE``), each is to be filled with the next bytes and goes
    to the device when the next chunk is taken, or on a clean exit (an exception drops it).
    A chunk is valid until the next one is taken; leaving waits for outstanding copies.
    """

    def __enter__(self) -> StageRing: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...

    def __iter__(self) -> StageRing: ...

    def __next__(self) -> tuple[int, int]: ...


class Communicator(Protocol):
    """This rank of a device communication domain (``DeviceRuntime.open_communicator``).

    Memory is bound before :meth:`prepare`; afterwards the ranks move bytes between their
    bound memory one-sided, the peer's threads doing nothing.
    """

    rank: int
    """This rank in the domain."""

    def bind(self, addr: int, nbytes: int, *, on_device: bool) -> None:
        """Offer ``[addr, addr + nbytes)`` (device or host memory) to the other ranks."""

    def prepare(self, timeout_s: int) -> None:
        """Exchange the bound memory with every rank (all ranks call it together)."""

    def covers(self, rows: npt.NDArray[np.uint64]) -> bool:
        """True when every ``(addr, nbytes)`` row lies inside memory bound here."""

    def transfer(self, rank: int, rows: npt.NDArray[np.uint64], *, get: bool) -> None:
        """Move ``(local addr, remote addr, nbytes)`` rows with ``rank``: read its memory
        into ours (``get``) or write ours to its memory; done on return."""

    def close(self) -> None:
        """Unbind the memory and leave the domain; idempotent."""


@dataclass(frozen=True, slots=True)
class HostShare:
    """Host memory a same-host peer may map: a memory file sealed at its size
    (``api.host_alloc_shared``), open here as descriptor ``fd``, mapped at ``base``."""

    fd: int
    ino: int
    base: int
    nbytes: int


class DeviceRuntime(ABC):
    """Memory and copy primitives of one device (or of host memory standing in for one)."""

    #: Short name reported in logs and ``features`` (``"host"``, ``"cuda"``, ``"acl"``).
    name: str
    #: True when device memory is ordinary host memory (readable through numpy views).
    device_memory_is_host: bool
    #: True when memory fresh from :meth:`alloc_device` and :meth:`alloc_host` reads zero
    #: (anonymous mappings); pools then zero only memory that was handed out before.
    fresh_memory_is_zero: bool = False
    #: True when memory from :meth:`alloc_device` and :meth:`alloc_host` is committed on
    #: first touch (plain host mappings); pools then commit each cache's fresh pages when
    #: they hand it out (:meth:`populate`), so no transfer takes a page fault.
    fresh_memory_is_lazy: bool = False
    #: Allocate host memory that a same-host peer may map (:meth:`host_share`), where this
    #: runtime can; set before allocating (the engine does, from ``aio.SharedPools``).
    share_host_memory: bool = False

    def __init__(self, device_id: int) -> None:
        self.device_id = device_id

    @abstractmethod
    def alloc_device(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of device memory and return its address.

        :raises LLMException: ``LLM_DEVICE_OUT_OF_MEMORY`` when the device cannot supply it.
        """

    @abstractmethod
    def free_device(self, addr: int, nbytes: int) -> None:
        """Free memory from :meth:`alloc_device`."""

    @abstractmethod
    def alloc_host(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of host memory suited to device copies (pinned where it matters).

        :raises LLMException: ``LLM_OUT_OF_MEMORY`` when the host cannot supply it.
        """

    @abstractmethod
    def free_host(self, addr: int, nbytes: int) -> None:
        """Free memory from :meth:`alloc_host`."""

    @abstractmethod
    def copy_batch(self, ops: npt.NDArray[np.uint64], kind: CopyKind) -> None:
        """Copy every ``(dst, src, nbytes)`` row of ``ops`` in one call, complete on return.

        Rows must not overlap each other's destinations. Runs with the GIL released.
        """

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until every copy this runtime started has completed."""

    def populate(self, addr: int, nbytes: int) -> None:
        """Commit ``nbytes`` of memory at ``addr`` (page-aligned, from :meth:`alloc_device`
        or :meth:`alloc_host`) now; its contents do not change. Only called where
        :attr:`fresh_memory_is_lazy`; this default commits host memory in one native call
        with the GIL released.

        :raises LLMException: ``LLM_OUT_OF_MEMORY`` when the memory cannot be had,
            ``LLM_FAILED`` when the kernel refuses for another reason.
        """
        try:
            api.host_populate(addr, nbytes)
        except OSError as exc:
            raise LLMException(
                f"cannot commit {nbytes} bytes of host memory: {exc.strerror}",
                status_code=LLMStatusCode.LLM_FAILED,
            ) from exc

    def zero_host(self, addr: int, nbytes: int) -> None:
        """Set ``nbytes`` of host memory at ``addr`` (from :meth:`alloc_host`) to zero.

        One native memset with the GIL released.
        """
        api.fill(addr, 0, nbytes)

    def zero_device(self, addr: int, nbytes: int) -> None:
        """Set ``nbytes`` of device memory at ``addr`` to zero; done on return.

        Device memory that is host memory is set directly; otherwise this default writes it
        through :meth:`copy_batch` from a zeroed pinned buffer of :data:`ZERO_CHUNK_BYTES`.
        Runtimes with a device memset override it.

        :raises LLMException: the runtime refused the copy.
        """
        if nbytes <= 0:
            return
        if self.device_memory_is_host:
            api.fill(addr, 0, nbytes)
            return
        chunk = min(nbytes, ZERO_CHUNK_BYTES)
        buffer = self.alloc_host(chunk)
        try:
            api.fill(buffer, 0, chunk)
            starts = np.arange(0, nbytes, chunk, dtype=np.uint64)
            ops = np.empty((len(starts), 3), dtype=np.uint64)
            ops[:, 0] = np.uint64(addr) + starts
            ops[:, 1] = buffer
            ops[:, 2] = np.minimum(np.uint64(nbytes) - starts, np.uint64(chunk))
            self.copy_batch(ops, CopyKind.HOST_TO_DEVICE)
        finally:
            self.free_host(buffer, chunk)

    def stage_ring(self, iov: npt.NDArray[np.uint64], kind: CopyKind) -> StageRing | None:
        """A native ring streaming the device rows ``(addr, nbytes)`` of ``iov`` through
        pinned chunks that overlap device copies with the caller's I/O; None when this
        runtime has none (callers then stage chunk by chunk with :meth:`copy_batch`).
        ``kind`` is ``DEVICE_TO_HOST`` or ``HOST_TO_DEVICE``; ``iov`` must not change
        until the ring is closed."""
        return None

    def share(self, addr: int, nbytes: int) -> bytes | None:
        """A token through which another process on this host reaches ``[addr, addr +
        nbytes)`` of device memory (see :meth:`open_shared`); None when this runtime cannot
        share that range (no support, or memory it did not allocate in one piece)."""
        return None

    def open_shared(self, token: bytes) -> int:
        """Map a range another process shared with :meth:`share`; returns its start here.

        :raises LLMException: the range cannot be mapped (``LLM_FAILED``).
        """
        raise LLMException(
            f"the {self.name} runtime cannot map other processes' device memory",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )

    def close_shared(self, addr: int) -> None:  # noqa: B027 - optional, pairs open_shared
        """Drop a mapping from :meth:`open_shared` (``addr`` is what it returned)."""

    def host_share(self, addr: int, nbytes: int) -> HostShare | None:
        """The shared memory holding ``[addr, addr + nbytes)`` of host memory this runtime
        allocated, which a same-host peer may map; None when that memory is private (peers
        then copy it with ``process_vm_readv``)."""
        return None

    def open_communicator(self, rank_table_path: str, rank: int) -> Communicator | None:
        """Join, as ``rank``, the device communication domain a rank-table file describes
        (a rank-table ``link``); None when this runtime has no collective library for it
        (the domain's links then carry every byte).

        :raises LLMException: the library refused (``LLM_PARAM_INVALID``, ``LLM_FAILED``).
        """
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release runtime resources (streams, contexts); the runtime is unusable afterwards."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} device_id={self.device_id}>"
