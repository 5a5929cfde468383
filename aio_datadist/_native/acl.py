"""Typed wrappers over the native Ascend ACL runtime (``acl_rt.c``): the only module that calls it.

``load`` and ``init`` raise :class:`AclUnavailable` when libascendcl cannot be used at all (no
library, a missing symbol, a failing ``aclInit``). Everything else raises the documented
``LLMException`` subclass, its message naming the failed ACL call, the ACL error code and
ACL's own message:

* a failed device allocation (``aclrtMalloc``): ``LLM_DEVICE_OUT_OF_MEMORY``;
* a failed host allocation (``aclrtMallocHost``, or the bookkeeping): ``LLM_OUT_OF_MEMORY``;
* bad arguments, rejected here or by ACL (parameter and device-id errors): ``LLM_PARAM_INVALID``;
* any other ACL failure, or use after ``close``: ``LLM_FAILED``.

Every call releases the GIL; no call blocks on Python, so copies may run on worker threads.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from ..status import LLMStatusCode, raise_for_status
from ._ffi import ffi, lib

__all__ = (
    "DEFAULT_LIBRARY",
    "AclDevice",
    "AclUnavailable",
    "device_count",
    "finalize",
    "init",
    "last_error",
    "load",
)

DEFAULT_LIBRARY = "libascendcl.so"
"""The library ``load(None)`` opens, found through the dynamic loader's search path."""

_U64_LIMIT = 1 << 64
_KINDS = range(lib.DD_ACL_HOST_TO_HOST, lib.DD_ACL_DEVICE_TO_DEVICE + 1)


class AclUnavailable(RuntimeError):
    """libascendcl cannot be used here; the message says why (library, symbol or ``aclInit``)."""


def last_error() -> tuple[int, str]:
    """The calling thread's last ACL failure as ``(acl_code, message)``; ``(0, "")`` if none."""
    code = ffi.new("int32_t *")
    msg = ffi.new("char[]", lib.DD_ACL_MSG_MAX)
    lib.dd_acl_last_error(code, msg, lib.DD_ACL_MSG_MAX)
    return int(code[0]), ffi.string(msg).decode("utf-8", "replace")


_REASONS: dict[int, str] = {
    lib.DD_ENOMEM: "out of memory",
    lib.DD_EINVAL: "invalid argument",
    lib.DD_ECLOSED: "the ACL runtime is closed",
    lib.DD_ACL_ENOLIB: "libascendcl is not loaded",
    lib.DD_ACL_ENODEV: "no Ascend device",
    lib.DD_ACL_EFINALIZED: "ACL was finalized in this process",
    lib.DD_ACL_EBUSY: "ACL runtimes are still open",
}


def _fail(rc: int, what: str, oom: LLMStatusCode = LLMStatusCode.LLM_OUT_OF_MEMORY) -> NoReturn:
    """Raise the ``LLMException`` for native return code ``rc`` of the call ``what``."""
    code, message = last_error()
    detail = message if code else _REASONS.get(rc, f"native error {rc}")
    if rc == lib.DD_ENOMEM:
        status = oom
    elif rc == lib.DD_EINVAL:
        status = LLMStatusCode.LLM_PARAM_INVALID
    else:
        status = LLMStatusCode.LLM_FAILED
    raise_for_status(status, f"{what} failed: {detail}")
    raise AssertionError("unreachable")  # pragma: no cover


def load(path: str | None = None) -> None:
    """Resolve the ACL function table from ``path`` (``None``: ``libascendcl.so``).

    Loading the loaded path again does nothing; another path replaces it only while no
    :class:`AclDevice` is open.

    :raises AclUnavailable: the library cannot be opened or lacks a required symbol, or
        another library is in use by open devices.
    """
    err = ffi.new("char[]", 1024)
    target = (path or DEFAULT_LIBRARY).encode()
    rc = lib.dd_acl_load(target, err, 1024)
    if rc != 0:
        reason = ffi.string(err).decode("utf-8", "replace") or _REASONS.get(rc, str(rc))
        raise AclUnavailable(f"cannot load {path or DEFAULT_LIBRARY}: {reason}")


def init() -> None:
    """Run ``aclInit`` unless this process already did (kept for the process lifetime).

    :raises AclUnavailable: no library is loaded, ``aclInit`` failed, or ``finalize`` ran.
    """
    rc = lib.dd_acl_init()
    if rc != 0:
        code, message = last_error()
        raise AclUnavailable(message if code else _REASONS.get(rc, f"native error {rc}"))


def device_count() -> int:
    """Devices ACL reports (``aclrtGetDeviceCount``); 0 when it reports ``ACL_ERROR_RT_NO_DEVICE``.

    :raises AclUnavailable: as :func:`init`.
    :raises LLMException: ``LLM_FAILED`` when ACL fails otherwise.
    """
    init()
    count = ffi.new("uint32_t *")
    rc = lib.dd_acl_device_count(count)
    if rc == lib.DD_ACL_ENODEV:
        return 0
    if rc != 0:
        _fail(rc, "counting Ascend devices")
    return int(count[0])


def finalize() -> None:
    """Run ``aclFinalize`` if this process's ``aclInit`` was ours; ACL is unusable afterwards.

    For applications that own the process and want ACL torn down before exit; the library
    never calls it by itself.

    :raises LLMException: ``LLM_FAILED`` while devices are open or when ``aclFinalize`` fails.
    """
    rc = lib.dd_acl_finalize()
    if rc != 0:
        _fail(rc, "aclFinalize")


def _size(nbytes: object, what: str) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int, got {type(nbytes).__name__}")
    if not 0 < nbytes < _U64_LIMIT:
        raise_for_status(LLMStatusCode.LLM_PARAM_INVALID, f"{what} of {nbytes} bytes")
    return nbytes


def _addr(addr: object) -> int:
    if isinstance(addr, bool) or not isinstance(addr, int):
        raise TypeError(f"addr must be an int, got {type(addr).__name__}")
    if not 0 <= addr < _U64_LIMIT:
        raise_for_status(LLMStatusCode.LLM_PARAM_INVALID, f"address {addr} is outside uint64")
    return addr


class AclDevice:
    """One Ascend device held by this process: ``aclrtSetDevice`` at open, reset after ``close``.

    Thread-safe; every call binds the device's context to the calling thread first. After
    :meth:`close` no allocation or copy is accepted, but memory may still be freed; the device
    is reset once the last allocation is gone.
    """

    __slots__ = ("_ptr", "device_id")

    def __init__(self, device_id: int) -> None:
        """Open ``device_id`` (``aclInit`` first if this process has not run it).

        :raises AclUnavailable: as :func:`init`.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a device id ACL rejects,
            ``LLM_FAILED`` when ``aclrtSetDevice`` or ``aclrtGetCurrentContext`` fails.
        """
        if isinstance(device_id, bool) or not isinstance(device_id, int):
            raise TypeError(f"device_id must be an int, got {type(device_id).__name__}")
        if not 0 <= device_id < 1 << 31:
            raise_for_status(LLMStatusCode.LLM_PARAM_INVALID, f"device_id {device_id}")
        init()
        out = ffi.new("dd_acl_rt **")
        rc = lib.dd_acl_open(device_id, out)
        if rc != 0:
            _fail(rc, f"opening Ascend device {device_id}")
        self._ptr: Any = ffi.gc(out[0], lib.dd_acl_destroy)
        self.device_id = device_id

    @property
    def handle(self) -> Any:
        """The native runtime object, for other native calls on this device (HCCL)."""
        return self._ptr

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of device memory (``aclrtMalloc``, huge pages first).

        :raises LLMException: ``LLM_DEVICE_OUT_OF_MEMORY`` when the device cannot supply it,
            ``LLM_PARAM_INVALID`` for ``nbytes <= 0``, ``LLM_FAILED`` after ``close``.
        """
        _size(nbytes, "device allocation")
        out = ffi.new("uint64_t *")
        rc = lib.dd_acl_malloc(self._ptr, nbytes, out)
        if rc != 0:
            _fail(
                rc,
                f"aclrtMalloc of {nbytes} bytes on device {self.device_id}",
                LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
            )
        return int(out[0])

    def free(self, addr: int) -> None:
        """Free device memory from :meth:`malloc` (``aclrtFree``).

        :raises LLMException: ``LLM_PARAM_INVALID`` for an address this device did not hand
            out, ``LLM_FAILED`` when ACL refuses.
        """
        rc = lib.dd_acl_free(self._ptr, _addr(addr))
        if rc != 0:
            _fail(rc, f"aclrtFree of {addr:#x} on device {self.device_id}")

    def malloc_host(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of page-locked host memory (``aclrtMallocHost``).

        :raises LLMException: ``LLM_OUT_OF_MEMORY`` when it cannot be had, otherwise as
            :meth:`malloc`.
        """
        _size(nbytes, "host allocation")
        out = ffi.new("uint64_t *")
        rc = lib.dd_acl_malloc_host(self._ptr, nbytes, out)
        if rc != 0:
            _fail(rc, f"aclrtMallocHost of {nbytes} bytes for device {self.device_id}")
        return int(out[0])

    def free_host(self, addr: int) -> None:
        """Free host memory from :meth:`malloc_host` (``aclrtFreeHost``).

        :raises LLMException: as :meth:`free`.
        """
        rc = lib.dd_acl_free_host(self._ptr, _addr(addr))
        if rc != 0:
            _fail(rc, f"aclrtFreeHost of {addr:#x} for device {self.device_id}")

    def copy_batch(self, ops: npt.NDArray[np.uint64], kind: int) -> int:
        """Copy every ``(dst, src, nbytes)`` row of ``ops`` in direction ``kind``; done on return.

        ``kind`` takes the ``aclrtMemcpyKind`` values 0-3 (host-to-host, host-to-device,
        device-to-host, device-to-device). Returns how many (merged) rows went through the
        device's stream; the others used the synchronous ``aclrtMemcpy``.

        :raises TypeError: ``ops`` is not a uint64 numpy array.
        :raises ValueError: ``ops`` is not C-contiguous of shape ``(n, 3)``.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a bad ``kind`` or a row with a null
            address or wrapping (nothing moves then) or an address ACL rejects; ``LLM_FAILED``
            when ACL fails otherwise or after ``close``.
        """
        if not isinstance(ops, np.ndarray):
            raise TypeError(f"ops must be a numpy.ndarray, got {type(ops).__name__}")
        if ops.dtype != np.uint64:
            raise TypeError(f"ops must have dtype uint64, got {ops.dtype}")
        if ops.ndim != 2 or ops.shape[1] != 3:
            raise ValueError(f"ops must have shape (n, 3), got {ops.shape}")
        if not (ops.flags.c_contiguous and ops.flags.aligned):
            raise ValueError("ops must be C-contiguous and aligned")
        if isinstance(kind, bool) or not isinstance(kind, int) or kind not in _KINDS:
            raise_for_status(LLMStatusCode.LLM_PARAM_INVALID, f"copy kind {kind!r}")
        n = ops.shape[0]
        if n == 0:
            return 0
        queued = ffi.new("uint64_t *")
        rc = lib.dd_acl_copy_batch(self._ptr, ffi.from_buffer("uint64_t[]", ops), n, kind, queued)
        if rc != 0:
            _fail(rc, f"copy of {n} rows (kind {kind}) on device {self.device_id}")
        return int(queued[0])

    def synchronize(self) -> None:
        """Wait for the device's stream (``aclrtSynchronizeStream``), when it has one.

        :raises LLMException: ``LLM_FAILED`` when ACL reports a failure.
        """
        rc = lib.dd_acl_synchronize(self._ptr)
        if rc != 0:
            _fail(rc, f"synchronizing device {self.device_id}")

    def memset(self, addr: int, value: int, nbytes: int) -> bool:
        """Set ``nbytes`` of device memory at ``addr`` to the byte ``value`` (``aclrtMemset``).

        Returns False, doing nothing, when the library has no ``aclrtMemset``.

        :raises TypeError: an argument is not an int.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a null or wrapping range, a value
            outside 0..255 or an address ACL rejects; ``LLM_FAILED`` when ACL fails
            otherwise or after ``close``.
        """
        _addr(addr)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"value must be an int, got {type(value).__name__}")
        if not 0 <= value <= 255:
            raise_for_status(LLMStatusCode.LLM_PARAM_INVALID, f"memset byte value {value}")
        if nbytes == 0:
            return True
        _size(nbytes, "memset")
        rc = lib.dd_acl_memset(self._ptr, addr, value, nbytes)
        if rc == lib.DD_ACL_ENOLIB:
            return False
        if rc != 0:
            _fail(rc, f"memset of {nbytes} bytes at {addr:#x} on device {self.device_id}")
        return True

    def close(self) -> None:
        """Destroy the stream and give the device back once no allocation is left. Idempotent.

        :raises LLMException: ``LLM_FAILED`` when ``aclrtDestroyStream`` or
            ``aclrtResetDevice`` fails (the runtime is closed all the same).
        """
        rc = lib.dd_acl_close(self._ptr)
        if rc != 0:
            _fail(rc, f"closing device {self.device_id}")

    def __repr__(self) -> str:
        return f"<AclDevice device_id={self.device_id}>"
