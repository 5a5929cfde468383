"""Typed wrappers over the native HCCL loader (``hccl.c``): presence and communicator set-up.

These are the calls a rank-table ``link`` needs to build an HCCL communication domain; the
engine does not use them yet. HCCL needs an Ascend device set on the calling thread (open an
:class:`~aio_datadist._native.acl.AclDevice` first). A failed HCCL call raises
``LLMException``: ``LLM_PARAM_INVALID`` for ``HCCL_E_PARA`` / ``HCCL_E_PTR``,
``LLM_OUT_OF_MEMORY`` for ``HCCL_E_MEMORY``, else ``LLM_FAILED``, with the ``HcclResult`` in
the message.
"""

from __future__ import annotations

from typing import NoReturn

from ..status import LLMStatusCode, raise_for_status
from ._ffi import ffi, lib

__all__ = (
    "DEFAULT_LIBRARY",
    "ROOT_INFO_BYTES",
    "HcclUnavailable",
    "comm_destroy",
    "comm_init_cluster_info",
    "comm_init_root_info",
    "get_root_info",
    "has_cluster_info",
    "load",
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
