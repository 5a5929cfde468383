"""Typed wrappers over the CUDA runtime calls of the C extension (``cuda_rt.h``).

Like :mod:`aio_datadist._native.api`, every return code goes through one check, which
raises the documented ``LLMException`` subclass: ``LLM_DEVICE_OUT_OF_MEMORY`` when device
memory runs out, ``LLM_OUT_OF_MEMORY`` for pinned host memory, ``LLM_PARAM_INVALID`` for
arguments CUDA (or the C layer) refuses, ``LLM_FAILED`` for any other CUDA failure. The
message names the failing CUDA function and its error (``cudaMalloc:
cudaErrorMemoryAllocation: out of memory``). Loading the library raises
:class:`CudaLoadError` instead, so the runtime policy can report why CUDA is not used.

Every call releases the GIL (cffi does so for all calls) and returns only when its work on
the device is complete.
"""

from __future__ import annotations

import threading
from enum import IntEnum
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from ..status import LLMStatusCode, raise_for_status
from ._ffi import ffi, lib

__all__ = (
    "IPC_HANDLE_BYTES",
    "CopyMode",
    "CudaContext",
    "CudaLibrary",
    "CudaLoadError",
    "Stage",
    "load",
)

IPC_HANDLE_BYTES: int = int(lib.DD_CUDA_IPC_HANDLE_BYTES)
"""Bytes of a CUDA IPC memory handle."""

STAGE_SLOTS_MAX: int = int(lib.DD_CUDA_STAGE_SLOTS_MAX)
"""Most pinned buffers one staging ring may use."""

_CUDART_UNLOADING = 4  # cudaErrorCudartUnloading: the process is exiting

_FEATURES: dict[int, str] = {
    lib.DD_CUDA_FEAT_BATCH: "memcpy_batch",
    lib.DD_CUDA_FEAT_KERNELS: "copy_kernel",
    lib.DD_CUDA_FEAT_MEMSET: "memset",
    lib.DD_CUDA_FEAT_ATTRIBUTES: "pointer_attributes",
}
_FEATURE_BITS = {name: bit for bit, name in _FEATURES.items()}


class CudaLoadError(OSError):
    """libcudart could not be loaded; the message lists every attempt."""


class CopyMode(IntEnum):
    """How :meth:`CudaContext.copy` moves rows."""

    ENGINE = 0
    """Copy engines: one ``cudaMemcpyBatchAsync`` when usable, else one call per row."""
    LOOP = 1
    """Copy engines, one ``cudaMemcpyAsync`` per (merged) row."""
    KERNEL = 2
    """Device to device only: one gather-scatter kernel; ENGINE when it is unavailable."""


def last_error() -> tuple[int, str]:
    """The calling thread's last CUDA failure: ``(cudaError_t, description)``; 0 when none."""
    buf = ffi.new("char[]", int(lib.DD_CUDA_ERRMSG_BYTES))
    code = int(lib.dd_cuda_last_error(buf, len(buf)))
    return code, ffi.string(buf).decode("utf-8", "replace")


def _check(rc: int, what: str, oom: LLMStatusCode = LLMStatusCode.LLM_OUT_OF_MEMORY) -> None:
    """Raise for a ``dd_cuda_*`` return code; read the CUDA error before any other call."""
    if rc == 0:
        return
    _, detail = last_error()
    if rc == lib.DD_ENOMEM:
        status = oom
    elif rc == lib.DD_EINVAL:
        status = LLMStatusCode.LLM_PARAM_INVALID
    else:
        status = LLMStatusCode.LLM_FAILED
    if not detail:
        detail = {
            lib.DD_ENOMEM: "out of memory",
            lib.DD_EINVAL: "invalid argument",
            lib.DD_CUDA_ENOSYS: "not offered by this CUDA runtime",
        }.get(rc, f"native error {rc}")
    raise_for_status(status, f"{what}: {detail}")


def _features(bits: int) -> frozenset[str]:
    return frozenset(name for bit, name in _FEATURES.items() if bits & bit)


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < 1 << 64:
        _check(lib.DD_EINVAL, f"{name}={value} is outside [0, 2**64)")
    return value


def _table(array: object, width: int, name: str) -> npt.NDArray[np.uint64]:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(array).__name__}")
    if array.dtype != np.uint64:
        raise TypeError(f"{name} must have dtype uint64, got {array.dtype}")
    if array.ndim != 2 or array.shape[1] != width:
        raise ValueError(f"{name} must have shape (n, {width}), got {array.shape}")
    if not (array.flags.c_contiguous and array.flags.aligned):
        raise ValueError(f"{name} must be C-contiguous and aligned")
    return array


class CudaLibrary:
    """One loaded libcudart: memory, pinning and IPC calls, each naming its device."""

    __slots__ = ("_ptr", "features", "path", "version")

    def __init__(self, ptr: Any, path: str) -> None:
        self._ptr = ptr
        self.path: str = path
        """What was loaded: the path or soname asked for, or ``"default"``."""
        self.version: int = int(lib.dd_cuda_runtime_version(ptr))
        """``cudaRuntimeGetVersion`` (e.g. 12080); 0 when unknown."""
        self.features: frozenset[str] = _features(int(lib.dd_cuda_features(ptr)))
        """Optional functions: memcpy_batch, copy_kernel, memset, pointer_attributes."""

    def probe_devices(self) -> tuple[int, str]:
        """``(device count, reason)``; the reason says why the count is 0 (no driver...)."""
        out = ffi.new("int *")
        _check(lib.dd_cuda_device_count(self._ptr, out), "cudaGetDeviceCount")
        count = int(out[0])
        return count, "" if count else (last_error()[1] or "no CUDA device")

    def malloc(self, device: int, nbytes: int) -> int:
        """``cudaMalloc`` on ``device``.

        :raises LLMException: ``LLM_DEVICE_OUT_OF_MEMORY`` when the device is full,
            ``LLM_PARAM_INVALID`` for ``nbytes <= 0`` or a bad device.
        """
        if _int(nbytes, "nbytes") == 0:
            _check(lib.DD_EINVAL, "cudaMalloc of 0 bytes")
        out = ffi.new("uint64_t *")
        _check(
            lib.dd_cuda_malloc(self._ptr, device, nbytes, out),
            f"cudaMalloc of {nbytes} bytes on device {device}",
            oom=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
        )
        return int(out[0])

    def free(self, device: int, addr: int) -> None:
        """``cudaFree``; a no-op once the CUDA runtime is unloading at process exit."""
        rc = lib.dd_cuda_free(self._ptr, device, _int(addr, "addr"))
        if rc != 0 and last_error()[0] == _CUDART_UNLOADING:
            return
        _check(rc, f"cudaFree of {addr:#x}")

    def host_alloc(self, device: int, nbytes: int) -> int:
        """Pinned, portable, mapped host memory (``cudaHostAlloc``).

        :raises LLMException: ``LLM_OUT_OF_MEMORY`` when it cannot be had.
        """
        if _int(nbytes, "nbytes") == 0:
            _check(lib.DD_EINVAL, "cudaHostAlloc of 0 bytes")
        out = ffi.new("uint64_t *")
        _check(
            lib.dd_cuda_host_alloc(self._ptr, device, nbytes, out),
            f"cudaHostAlloc of {nbytes} bytes",
        )
        return int(out[0])

    def host_free(self, device: int, addr: int) -> None:
        """``cudaFreeHost``; a no-op once the CUDA runtime is unloading at process exit."""
        rc = lib.dd_cuda_host_free(self._ptr, device, _int(addr, "addr"))
        if rc != 0 and last_error()[0] == _CUDART_UNLOADING:
            return
        _check(rc, f"cudaFreeHost of {addr:#x}")

    def host_register(self, device: int, addr: int, nbytes: int) -> None:
        """Pin existing host memory (``cudaHostRegister``, portable)."""
        _check(
            lib.dd_cuda_host_register(self._ptr, device, _int(addr, "addr"), _int(nbytes, "n")),
            f"cudaHostRegister of {nbytes} bytes at {addr:#x}",
        )

    def host_unregister(self, device: int, addr: int) -> None:
        """Unpin memory pinned by :meth:`host_register`."""
        _check(
            lib.dd_cuda_host_unregister(self._ptr, device, _int(addr, "addr")),
            f"cudaHostUnregister of {addr:#x}",
        )

    def pointer_types(self, device: int, addrs: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint8]:
        """The ``cudaMemoryType`` of each of ``addrs`` (``cudaPointerGetAttributes``): 0
        pageable host memory, 1 pinned host memory, 2 device memory, 3 managed memory.

        :raises LLMException: ``LLM_FAILED`` when the runtime lacks the function.
        """
        flat = np.ascontiguousarray(addrs, dtype=np.uint64).reshape(-1)
        out = np.zeros(len(flat), dtype=np.uint8)
        if len(flat):
            _check(
                lib.dd_cuda_pointer_types(
                    self._ptr,
                    device,
                    ffi.from_buffer("uint64_t[]", flat),
                    len(flat),
                    ffi.from_buffer("uint8_t[]", out),
                ),
                "cudaPointerGetAttributes",
            )
        return out

    def ipc_get(self, device: int, addr: int) -> bytes:
        """The ``cudaIpcGetMemHandle`` of the allocation holding ``addr``."""
        out = ffi.new("uint8_t[]", IPC_HANDLE_BYTES)
        _check(
            lib.dd_cuda_ipc_get(self._ptr, device, _int(addr, "addr"), out),
            f"cudaIpcGetMemHandle of {addr:#x}",
        )
        return bytes(ffi.buffer(out))

    def ipc_open(self, device: int, handle: bytes) -> int:
        """Map a peer process's allocation; returns its base address here."""
        if not isinstance(handle, bytes | bytearray) or len(handle) != IPC_HANDLE_BYTES:
            raise TypeError(f"handle must be {IPC_HANDLE_BYTES} bytes")
        out = ffi.new("uint64_t *")
        _check(
            lib.dd_cuda_ipc_open(self._ptr, device, ffi.from_buffer(bytes(handle)), out),
            "cudaIpcOpenMemHandle",
        )
        return int(out[0])

    def ipc_close(self, device: int, addr: int) -> None:
        """Unmap memory from :meth:`ipc_open`."""
        _check(
            lib.dd_cuda_ipc_close(self._ptr, device, _int(addr, "addr")),
            f"cudaIpcCloseMemHandle of {addr:#x}",
        )

    def __repr__(self) -> str:
        return f"<CudaLibrary {self.path} version={self.version}>"


_loaded: dict[str, CudaLibrary] = {}
_load_lock = threading.Lock()


def load(path: str | None = None) -> CudaLibrary:
    """Load libcudart from ``path`` (a file or soname), or from the usual sonames when None.

    Loading the same path again returns the same object; the library is never unloaded.

    :raises CudaLoadError: nothing could be loaded; the message lists every attempt.
    """
    key = path or ""
    with _load_lock:
        found = _loaded.get(key)
        if found is not None:
            return found
        out = ffi.new("dd_cuda_lib **")
        err = ffi.new("char[]", 2048)
        rc = lib.dd_cuda_load(path.encode() if path else ffi.NULL, out, err, len(err))
        if rc != 0:
            raise CudaLoadError(ffi.string(err).decode("utf-8", "replace") or f"error {rc}")
        loaded = CudaLibrary(out[0], path or "default")
        _loaded[key] = loaded
        return loaded


class Stage:
    """A staging ring streaming device memory through pinned host buffers.

    Iterate for ``(addr, nbytes)`` chunks of pinned host memory, in stream order: reading
    (``D2H``), each holds the next bytes of the device rows while later chunks are already
    on their way; writing (``H2D``), each is to be filled with the next bytes, and is sent
    to the device when the next chunk is taken (or on a clean exit). A chunk is valid until
    the next one is taken. Use as a context manager: leaving waits for outstanding copies;
    leaving on an exception drops an unsent chunk.
    """

    __slots__ = ("_ctx", "_iov", "_ptr", "direction")

    def __init__(self, ctx: CudaContext, ptr: Any, iov: npt.NDArray[np.uint64], direction: int):
        self._ctx = ctx
        self._ptr = ptr
        self._iov = iov  # read by the C side until close
        self.direction = direction

    def __iter__(self) -> Stage:
        return self

    def __next__(self) -> tuple[int, int]:
        if self._ptr is None:
            raise StopIteration
        out = ffi.new("uint64_t[2]")
        _check(lib.dd_cuda_stage_next(self._ptr, out, out + 1), "staging ring")
        if out[1] == 0:
            raise StopIteration
        return int(out[0]), int(out[1])

    def close(self, commit: bool = True) -> None:
        """Wait for outstanding copies and release the ring; idempotent.

        ``commit`` (writing) sends a filled chunk not yet sent; False drops it.
        """
        ptr, self._ptr = self._ptr, None
        if ptr is not None:
            _check(lib.dd_cuda_stage_close(ptr, int(commit)), "staging ring close")

    def __enter__(self) -> Stage:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(commit=exc_type is None)


class CudaContext:
    """Copies on one device: a pool of lanes (stream, events, staging ring) shared by callers.

    Each call takes a lane of its own for its duration, so concurrent calls from several
    threads never share a stream. ``stage_chunk`` bytes per staging buffer, ``stage_slots``
    buffers per lane (pinned, allocated on first staged use).
    """

    __slots__ = ("_lock", "_ptr", "device", "library")

    def __init__(self, library: CudaLibrary, device: int, stage_chunk: int, stage_slots: int):
        out = ffi.new("dd_cuda_ctx **")
        _check(
            lib.dd_cuda_ctx_create(library._ptr, device, stage_chunk, stage_slots, out),
            f"CUDA context for device {device} (stage_chunk={stage_chunk}, "
            f"stage_slots={stage_slots} in [2, {STAGE_SLOTS_MAX}])",
        )
        self._ptr: Any = ffi.gc(out[0], lib.dd_cuda_ctx_destroy)
        self._lock = threading.Lock()
        self.library = library
        self.device = device

    def _handle(self) -> Any:
        ptr = self._ptr
        if ptr is None:
            raise_for_status(LLMStatusCode.LLM_FAILED, "the CUDA runtime was closed")
        return ptr

    @property
    def features(self) -> frozenset[str]:
        """Features enabled on this context (a subset of the library's)."""
        return _features(int(lib.dd_cuda_ctx_features(self._handle())))

    def set_feature(self, name: str, enabled: bool) -> None:
        """Switch ``"memcpy_batch"`` or ``"copy_kernel"`` off, or back on where offered."""
        if name not in ("memcpy_batch", "copy_kernel"):
            raise ValueError(f"unknown switchable feature {name!r}")
        _check(
            lib.dd_cuda_ctx_set_feature(self._handle(), _FEATURE_BITS[name], int(enabled)),
            name,
        )

    @property
    def kernel_note(self) -> str:
        """Why the copy kernel is unusable here; empty when usable or not tried yet."""
        note: bytes = ffi.string(lib.dd_cuda_ctx_kernel_note(self._handle()))
        return note.decode("utf-8", "replace")

    def copy(self, ops: npt.NDArray[np.uint64], kind: int, mode: CopyMode) -> None:
        """Copy rows ``(dst, src, nbytes)`` between device or pinned memory, complete on return.

        :raises LLMException: ``LLM_PARAM_INVALID`` for a bad row or one CUDA refuses
            (nothing is copied for a null or wrapping row), ``LLM_FAILED`` otherwise.
        """
        _table(ops, 3, "ops")
        n = len(ops)
        if n:
            _check(
                lib.dd_cuda_copy(self._handle(), ffi.from_buffer("uint64_t[]", ops), n, kind, mode),
                f"CUDA copy of {n} rows (kind {kind}, {mode.name.lower()})",
            )

    def copy_staged(self, ops: npt.NDArray[np.uint64], kind: int) -> None:
        """As :meth:`copy` for H2D/D2H rows whose host side is pageable: through the ring."""
        _table(ops, 3, "ops")
        n = len(ops)
        if n:
            _check(
                lib.dd_cuda_copy_staged(
                    self._handle(), ffi.from_buffer("uint64_t[]", ops), n, kind
                ),
                f"staged CUDA copy of {n} rows (kind {kind})",
            )

    def memset(self, addr: int, value: int, nbytes: int) -> None:
        """Set ``nbytes`` of device memory at ``addr`` to the byte ``value``."""
        _check(
            lib.dd_cuda_memset(self._handle(), _int(addr, "addr"), value, _int(nbytes, "n")),
            f"cudaMemsetAsync of {nbytes} bytes at {addr:#x}",
        )

    def stage(self, direction: int, iov: npt.NDArray[np.uint64]) -> Stage:
        """Open a staging ring over the device rows ``(addr, nbytes)`` of ``iov``.

        ``direction`` is 2 (device to host: read the rows) or 1 (host to device: write
        them). ``iov`` must not change until the stage is closed.
        """
        _table(iov, 2, "iov")
        out = ffi.new("dd_cuda_stage **")
        _check(
            lib.dd_cuda_stage_open(
                self._handle(), direction, ffi.from_buffer("uint64_t[]", iov), len(iov), out
            ),
            f"staging ring over {len(iov)} rows",
        )
        return Stage(self, out[0], iov, direction)

    def close(self) -> None:
        """Synchronise and free every lane; later calls raise ``LLM_FAILED``. Idempotent."""
        with self._lock:
            ptr, self._ptr = self._ptr, None
        if ptr is not None:
            ffi.release(ptr)
