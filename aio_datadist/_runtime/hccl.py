"""HCCL (``libhccl.so``) for rank-table ``link`` domains on Ascend machines: whether it is
present, and this rank's communicator in a domain.

``AIO_DATADIST_HCCL`` names the library to use instead of ``libhccl.so`` from the loader's
search path. The ACL runtime probes at open and reports the outcome.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from aio_datadist._native import acl, hccl
from aio_datadist.status import LinkFailedError, LLMStatusCode

__all__ = ("HCCL_ENV", "HcclCommunicator", "HcclPresence", "probe")

HCCL_ENV = "AIO_DATADIST_HCCL"
_NONE: npt.NDArray[np.uint64] = np.empty(0, dtype=np.uint64)


@dataclass(frozen=True)
class HcclPresence:
    """The outcome of probing for libhccl."""

    library: str
    """The path or name that was tried."""
    available: bool
    """True when the library loaded with every required entry point."""
    reason: str = ""
    """Why it is not available (empty when it is)."""
    cluster_info: bool = False
    """True when ``HcclCommInitClusterInfo`` (rank-table files) is offered too."""
    one_sided: bool = False
    """True when the one-sided calls (memory binding, ``HcclBatchGet``/``Put``) are offered."""

    @property
    def domains(self) -> bool:
        """True when rank-table domains can move bytes through HCCL."""
        return self.available and self.cluster_info and self.one_sided


def probe() -> HcclPresence:
    """Load libhccl (``AIO_DATADIST_HCCL`` or ``libhccl.so``) and say whether it can be used."""
    library = os.environ.get(HCCL_ENV, "").strip() or hccl.DEFAULT_LIBRARY
    try:
        hccl.load(library)
    except hccl.HcclUnavailable as exc:
        return HcclPresence(library, False, str(exc))
    return HcclPresence(
        library, True, cluster_info=hccl.has_cluster_info(), one_sided=hccl.has_one_sided()
    )


class HcclCommunicator:
    """This rank's HCCL communicator in a rank-table domain, on one Ascend device.

    Thread-safe. Memory is registered and bound before :meth:`prepare`; :meth:`transfer`
    then runs ``HcclBatchGet``/``HcclBatchPut`` on the device's stream.
    """

    def __init__(self, device: acl.AclDevice, rank_table_path: str, rank: int) -> None:
        """``HcclCommInitClusterInfo`` of ``rank_table_path`` as ``rank``.

        :raises LLMException: HCCL refused (see :mod:`aio_datadist._native.hccl`).
        """
        self._device = device
        self.rank = rank
        self._comm = hccl.comm_init_cluster_info(rank_table_path, rank)
        self._handles: list[int] = []
        #: Bound ranges as (starts, ends), sorted by start; replaced whole.
        self._spans = (_NONE, _NONE)
        self._lock = threading.Condition()
        self._in_flight = 0  # transfers running; close waits for them

    def bind(self, addr: int, nbytes: int, *, on_device: bool) -> None:
        """Register ``[addr, addr + nbytes)`` and bind it to the communicator."""
        with self._lock:
            if not self._comm:
                raise RuntimeError("the communicator is closed")
            self._handles.append(hccl.bind_mem(self._comm, addr, nbytes, on_device=on_device))
            starts = np.append(self._spans[0], np.uint64(addr))
            ends = np.append(self._spans[1], np.uint64(addr + nbytes))
            order = np.argsort(starts, kind="stable")
            self._spans = (starts[order], ends[order])

    def prepare(self, timeout_s: int) -> None:
        """``HcclCommPrepare``: exchange the bound memory with every rank."""
        hccl.prepare(self._comm, timeout_s)

    def covers(self, rows: npt.NDArray[np.uint64]) -> bool:
        """True when every ``(addr, nbytes)`` row lies inside one bound range."""
        starts, ends = self._spans
        if not len(rows) or not len(starts):
            return False
        idx = np.searchsorted(starts, rows[:, 0], side="right").astype(np.int64) - 1
        if bool((idx < 0).any()):
            return False
        return bool((rows[:, 0] + rows[:, 1] <= ends[idx]).all())

    def transfer(self, rank: int, rows: npt.NDArray[np.uint64], *, get: bool) -> None:
        """``HcclBatchGet`` (``get``) or ``HcclBatchPut`` of ``(local, remote, nbytes)`` rows
        with ``rank``, waited for on the device's stream.

        :raises LLMException: ``LLM_LINK_FAILED`` once the communicator is closed (the domain
            was unlinked), else as :func:`aio_datadist._native.hccl.batch`.
        """
        with self._lock:
            comm = self._comm
            if not comm:
                raise LinkFailedError(
                    "the communication domain was unlinked",
                    status_code=LLMStatusCode.LLM_LINK_FAILED,
                )
            self._in_flight += 1
        try:
            hccl.batch(self._device, comm, rank, np.ascontiguousarray(rows), get=get)
        finally:
            with self._lock:
                self._in_flight -= 1
                if not self._in_flight:
                    self._lock.notify_all()

    def close(self) -> None:
        """Unbind and deregister the memory, then ``HcclCommDestroy``, once no transfer
        runs any more; idempotent.

        Every step runs even when an earlier one failed; the first failure is raised.
        """
        with self._lock:
            comm, self._comm = self._comm, 0
            handles, self._handles = self._handles, []
            self._spans = (_NONE, _NONE)
            self._lock.wait_for(lambda: self._in_flight == 0)
        if not comm:
            return
        first: Exception | None = None
        for handle in handles:
            try:
                hccl.unbind_mem(comm, handle)
            except Exception as exc:  # the rest still goes
                first = first or exc
        try:
            hccl.comm_destroy(comm)
        except Exception as exc:
            first = first or exc
        if first is not None:
            raise first
