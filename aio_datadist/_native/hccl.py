"""Typed wrappers over the native HCCL loader (``hccl.c``): presence, communicators and
one-sided transfers.

These are the calls a rank-table ``link`` needs to build an HCCL communication domain and to
move bytes in it. HCCL needs an Ascend device set on the calling thread (open an
:class:`~aio_datadist._native.acl.AclDevice` first). A failed HCCL call raises
``LLMException``: ``LLM_PARAM_INVALID`` for ``HCCL_E_PARA`` / ``HCCL_E_PTR``,
``LLM_OUT_OF_MEMORY`` for ``HCCL_E_MEMORY``, else ``LLM_FAILED``, with the ``HcclResult`` in
the message.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import numpy.typing as npt

from ..status import LLMStatusCode, raise_for_status
from . import acl
from ._ffi import ffi, lib

__all__ = (
    "DEFAULT_LIBRARY",
    "ROOT_INFO_BYTES",
    "HcclUnavailable",
    "batch",
    "bind_mem",
    "comm_destroy",
    "comm_init_cluster_info",
    "comm_init_root_info",
    "get_root_info",
    "has_cluster_info",
    "has_one_sided",
    "load",
    "prepare",
    "unbind_mem",
)

DEFAULT_LIBRARY = "libhccl.so"
"""The library ``load(None)`` opens, found through the dynamic loader's search path."""

ROOT_INFO_BYTES: int = int(lib.DD_HCCL_ROOT_INFO_BYTES)
"""Size of an ``HcclRootInfo``, the blob the root rank hands to every member."""


class HcclUnavailable(RuntimeError):
    """libhccl cannot be used here; the message says why."""


def _fail(rc: int, what: str) -> NoReturn:
    code = int(lib.dd_hccl_last_error())
    if rc == lib.DD_ACL_ENOLIB:
        raise HcclUnavailable(f"{what}: libhccl (or this entry point of it) is not loaded")
    if rc == lib.DD_EINVAL:
        status = LLMStatusCode.LLM_PARAM_INVALID
    elif rc == lib.DD_ENOMEM:
        status = LLMStatusCode.LLM_OUT_OF_MEMORY
    else:
        status = LLMStatusCode.LLM_FAILED
    reason = f"HcclResult {code}" if code else "invalid argument"
    raise_for_status(status, f"{what} failed: {reason}")
    raise AssertionError("unreachable")  # pragma: no cover


def load(path: str | None = None) -> None:
    """Resolve the HCCL entry points from ``path`` (``None``: ``libhccl.so``).

    :raises HcclUnavailable: the library cannot be opened or lacks ``HcclGetRootInfo``,
        ``HcclCommInitRootInfo`` or ``HcclCommDestroy``.
    """
    err = ffi.new("char[]", 1024)
    rc = lib.dd_hccl_load((path or DEFAULT_LIBRARY).encode(), err, 1024)
    if rc != 0:
        reason = ffi.string(err).decode("utf-8", "replace") or f"native error {rc}"
        raise HcclUnavailable(f"cannot load {path or DEFAULT_LIBRARY}: {reason}")


def has_cluster_info() -> bool:
    """True when the loaded library offers ``HcclCommInitClusterInfo`` (rank-table files)."""
    return bool(lib.dd_hccl_has_cluster_info())


def get_root_info() -> bytes:
    """``HcclGetRootInfo`` on the root rank: the ``ROOT_INFO_BYTES`` blob to share with members.

    :raises HcclUnavailable: nothing is loaded.
    :raises LLMException: as described in the module docstring.
    """
    out = ffi.new("uint8_t[]", ROOT_INFO_BYTES)
    rc = lib.dd_hccl_get_root_info(out)
    if rc != 0:
        _fail(rc, "HcclGetRootInfo")
    return bytes(ffi.buffer(out, ROOT_INFO_BYTES))


def comm_init_root_info(n_ranks: int, root_info: bytes, rank: int) -> int:
    """``HcclCommInitRootInfo``: join the ``n_ranks`` domain of ``root_info`` as ``rank``.

    Returns the communicator handle.

    :raises ValueError: ``root_info`` is not ``ROOT_INFO_BYTES`` long.
    :raises HcclUnavailable: nothing is loaded.
    :raises LLMException: ``LLM_PARAM_INVALID`` when ``rank >= n_ranks``, else as described in
        the module docstring.
    """
    if len(root_info) != ROOT_INFO_BYTES:
        raise ValueError(f"root_info must be {ROOT_INFO_BYTES} bytes, got {len(root_info)}")
    comm = ffi.new("uint64_t *")
    rc = lib.dd_hccl_comm_init_root_info(n_ranks, root_info, rank, comm)
    if rc != 0:
        _fail(rc, f"HcclCommInitRootInfo(nRanks={n_ranks}, rank={rank})")
    return int(comm[0])


def comm_init_cluster_info(rank_table_path: str, rank: int) -> int:
    """``HcclCommInitClusterInfo``: join the domain a rank-table file describes as ``rank``.

    :raises HcclUnavailable: nothing is loaded or the library lacks this entry point.
    :raises LLMException: as described in the module docstring.
    """
    comm = ffi.new("uint64_t *")
    rc = lib.dd_hccl_comm_init_cluster_info(rank_table_path.encode(), rank, comm)
    if rc != 0:
        _fail(rc, f"HcclCommInitClusterInfo({rank_table_path!r}, rank={rank})")
    return int(comm[0])


def comm_destroy(comm: int) -> None:
    """``HcclCommDestroy`` of a handle from ``comm_init_*``.

    :raises HcclUnavailable: nothing is loaded.
    :raises LLMException: as described in the module docstring.
    """
    rc = lib.dd_hccl_comm_destroy(comm)
    if rc != 0:
        _fail(rc, "HcclCommDestroy")


def has_one_sided() -> bool:
    """True when the loaded library offers the one-sided calls (``HcclRegisterGlobalMem``,
    ``HcclCommBindMem``, ``HcclCommPrepare``, ``HcclBatchPut``, ``HcclBatchGet`` and their
    inverses)."""
    return bool(lib.dd_hccl_has_one_sided())


def bind_mem(comm: int, addr: int, nbytes: int, *, on_device: bool) -> int:
    """Register ``nbytes`` at ``addr`` (device or host memory) and bind it to ``comm``, so
    that the other ranks may read and write it; returns the registration's handle.

    :raises HcclUnavailable: nothing is loaded or the library lacks the one-sided calls.
    :raises LLMException: as described in the module docstring.
    """
    handle = ffi.new("uint64_t *")
    rc = lib.dd_hccl_bind_mem(comm, int(on_device), addr, nbytes, handle)
    if rc != 0:
        _fail(rc, f"HcclRegisterGlobalMem/HcclCommBindMem({nbytes} bytes at {addr:#x})")
    return int(handle[0])


def unbind_mem(comm: int, handle: int) -> None:
    """Unbind a :func:`bind_mem` registration from ``comm`` and deregister it.

    :raises HcclUnavailable: nothing is loaded or the library lacks the one-sided calls.
    :raises LLMException: as described in the module docstring.
    """
    rc = lib.dd_hccl_unbind_mem(comm, handle)
    if rc != 0:
        _fail(rc, "HcclCommUnbindMem/HcclDeregisterGlobalMem")


def prepare(comm: int, timeout_s: int) -> None:
    """``HcclCommPrepare`` (full mesh): exchange the bound memory with every rank, waiting up
    to ``timeout_s`` seconds for them.

    :raises HcclUnavailable: nothing is loaded or the library lacks the one-sided calls.
    :raises LLMException: as described in the module docstring.
    """
    rc = lib.dd_hccl_prepare(comm, timeout_s)
    if rc != 0:
        _fail(rc, f"HcclCommPrepare(timeout={timeout_s} s)")


def batch(
    device: acl.AclDevice, comm: int, remote_rank: int, rows: npt.NDArray[np.uint64], *, get: bool
) -> None:
    """Move the ``(local address, remote address, nbytes)`` rows between this rank and
    ``remote_rank`` on ``device``'s stream (``HcclBatchGet`` reads the remote rows into the
    local ones, ``HcclBatchPut`` writes the local rows to the remote ones); done on return.

    :raises ValueError: ``rows`` is not a C-contiguous uint64 array of shape ``(n, 3)``.
    :raises HcclUnavailable: nothing is loaded or the library lacks the one-sided calls.
    :raises LLMException: as described in the module docstring; a failure of the stream is
        ``LLM_FAILED`` with ACL's message.
    """
    if rows.dtype != np.uint64 or rows.ndim != 2 or rows.shape[1] != 3:
        raise ValueError(f"rows must be uint64 of shape (n, 3), got {rows.dtype} {rows.shape}")
    if not rows.flags.c_contiguous:
        raise ValueError("rows must be C-contiguous")
    n = rows.shape[0]
    if n == 0:
        return
    name = "HcclBatchGet" if get else "HcclBatchPut"
    rc = lib.dd_hccl_batch(
        device.handle, comm, remote_rank, ffi.from_buffer("uint64_t[]", rows), n, int(get)
    )
    if rc == 0:
        return
    if rc == lib.DD_ACL_EFAIL and int(lib.dd_hccl_last_error()) == 0:
        code, message = acl.last_error()
        raise_for_status(LLMStatusCode.LLM_FAILED, f"{name} of {n} rows: {message or code}")
    if rc == lib.DD_ECLOSED:
        raise_for_status(LLMStatusCode.LLM_FAILED, f"{name}: the ACL runtime is closed")
    _fail(rc, f"{name} of {n} rows with rank {remote_rank}")
