"""The CUDA runtime: device memory from libcudart, loaded with dlopen when the engine starts.

``Placement.DEVICE`` pools are carved from one ``cudaMalloc`` arena per pool; host pools
are pinned (``cudaHostAlloc``). Copies run on per-call streams of a :class:`CudaContext`:

* device to device: one gather-scatter kernel per batch when every row lies in memory this
  runtime allocated (the kernel passed its self-test on this device), else the copy
  engines (``cudaMemcpyBatchAsync`` where the runtime has it, else one call per row);
* host to device and back: straight through the copy engines when the host side is pinned
  (known from this runtime's own ``alloc_host`` / :meth:`CudaRuntime.register_host`, else
  asked of ``cudaPointerGetAttributes``); pageable rows go through a ring of pinned staging
  buffers, so the CPU copy of one chunk overlaps the DMA of the previous one. A batch of
  many scattered rows (16 or more once neighbours merge) between this runtime's own
  ``alloc_host`` memory (mapped into the device's address space) and device memory it
  allocated or mapped runs as one launch of the same kernel, which reads or writes the
  pinned memory over the bus itself instead of one DMA per row.

Beyond :class:`DeviceRuntime`, the runtime offers what transports need for device memory:
:meth:`~CudaRuntime.stage_out` / :meth:`~CudaRuntime.stage_in` stream device bytes through
pinned buffers with overlap (for sockets), and :meth:`~CudaRuntime.ipc_handle` /
:meth:`~CudaRuntime.open_ipc` / :meth:`~CudaRuntime.close_ipc` share device memory with
other processes on the same host.

``AIO_DATADIST_CUDART`` names the library to load (a path or a soname); by default the
usual sonames are tried, then a libcudart shipped in the ``nvidia-cuda-runtime`` wheel.
"""

from __future__ import annotations

import importlib.util
import os
import struct
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt

from aio_datadist._log import get_logger
from aio_datadist._native import api
from aio_datadist._native.cuda import CopyMode, CudaContext, CudaLibrary, CudaLoadError, Stage, load
from aio_datadist._runtime.base import CopyKind, DeviceRuntime, RuntimeUnavailable
from aio_datadist._runtime.ranges import AddressRanges
from aio_datadist.status import LLMStatusCode, ParamInvalidError

__all__ = (
    "CUDART_ENV",
    "IPC_TOKEN_BYTES",
    "STAGE_CHUNK_BYTES",
    "STAGE_SLOTS",
    "CudaRuntime",
    "open_runtime",
)

CUDART_ENV = "AIO_DATADIST_CUDART"
#: Bytes per pinned staging buffer; big enough that a DMA runs at full speed.
STAGE_CHUNK_BYTES = 4 << 20
#: Staging buffers per lane: one being filled or drained by the CPU, the rest in flight.
STAGE_SLOTS = 4
#: Bytes of a token from :meth:`CudaRuntime.ipc_handle`.
IPC_TOKEN_BYTES = 80

_PINNED_MEMORY, _DEVICE_MEMORY = 1, 2  # cudaMemoryTypeHost, cudaMemoryTypeDevice
_TOKEN = struct.Struct("<64sQQ")  # CUDA IPC handle, offset into the allocation, its size
_log = get_logger("runtime.cuda")


def _invalid(message: str) -> ParamInvalidError:
    return ParamInvalidError(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def _wheel_libraries() -> list[str]:
    """libcudart files of an installed ``nvidia-cuda-runtime`` wheel (as torch ships)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found: list[str] = []
    for root in spec.submodule_search_locations:
        found += sorted(str(p) for p in Path(root).glob("cuda_runtime/lib/libcudart.so*"))
    return found


def _load_library() -> CudaLibrary:
    """The library named by ``AIO_DATADIST_CUDART``, or the first default one that loads."""
    wanted = os.environ.get(CUDART_ENV, "").strip()
    if wanted:
        return load(wanted)
    errors: list[str] = []
    for candidate in (None, *_wheel_libraries()):
        try:
            return load(candidate)
        except CudaLoadError as exc:
            errors.append(str(exc))
    raise CudaLoadError("; ".join(errors))


def open_runtime(device_id: int) -> CudaRuntime:
    """The CUDA runtime for ``device_id``.

    :raises RuntimeUnavailable: libcudart cannot be loaded, reports no device, or has no
        device ``device_id``; the message says which.
    """
    try:
        library = _load_library()
    except CudaLoadError as exc:
        raise RuntimeUnavailable(f"libcudart cannot be loaded: {exc}") from None
    count, reason = library.probe_devices()
    if count == 0:
        raise RuntimeUnavailable(f"{library.path} reports no CUDA device: {reason}")
    if not 0 <= device_id < count:
        raise RuntimeUnavailable(
            f"device_id {device_id} is out of range: {library.path} reports {count} device(s)"
        )
    return CudaRuntime(device_id, library)


class CudaRuntime(DeviceRuntime):
    """Device memory and copies of one CUDA device (see the module docstring).

    Thread-safe: concurrent calls each use a stream of their own. Every copy is complete
    when its call returns, so :meth:`synchronize` has nothing to wait for.
    """

    name = "cuda"
    device_memory_is_host = False

    def __init__(
        self,
        device_id: int,
        library: CudaLibrary,
        *,
        stage_chunk_bytes: int | None = None,
        stage_slots: int | None = None,
    ) -> None:
        """Use device ``device_id`` of ``library``.

        ``stage_chunk_bytes`` (rounded up to 4 KiB) and ``stage_slots`` size the pinned
        staging ring of each stream: ``stage_slots`` buffers of ``stage_chunk_bytes``
        (defaults: :data:`STAGE_CHUNK_BYTES`, :data:`STAGE_SLOTS`).
        """
        super().__init__(device_id)
        self.library = library
        chunk = STAGE_CHUNK_BYTES if stage_chunk_bytes is None else stage_chunk_bytes
        slots = STAGE_SLOTS if stage_slots is None else stage_slots
        self._ctx = CudaContext(library, device_id, chunk, slots)
        self._device = AddressRanges()  # this runtime's cudaMalloc allocations
        self._pinned = AddressRanges()  # its cudaHostAlloc and cudaHostRegister memory
        self._mapped_host = AddressRanges()  # its cudaHostAlloc memory (device-accessible)
        self._ipc = AddressRanges()  # peer allocations mapped by open_ipc
        self._ipc_lock = threading.Lock()
        self._ipc_refs: dict[bytes, list[int]] = {}  # handle -> [base, references]
        self._ipc_handles: dict[int, bytes] = {}  # base -> handle
        _log.debug(
            "cuda.opened",
            device_id=device_id,
            library=library.path,
            version=library.version,
            features=sorted(library.features),
        )

    @property
    def features(self) -> frozenset[str]:
        """Optional CUDA paths in use: memcpy_batch, copy_kernel, memset, pointer_attributes."""
        return self._ctx.features

    def set_feature(self, name: str, enabled: bool) -> None:
        """Switch ``"memcpy_batch"`` or ``"copy_kernel"`` off (or back on where offered)."""
        self._ctx.set_feature(name, enabled)

    @property
    def kernel_note(self) -> str:
        """Why the copy kernel is not used on this device ("" when it is, or untried)."""
        return self._ctx.kernel_note

    # -- memory ---------------------------------------------------------------------------
    def alloc_device(self, nbytes: int) -> int:
        addr = self.library.malloc(self.device_id, nbytes)
        self._device.add(addr, nbytes)
        return addr

    def free_device(self, addr: int, nbytes: int) -> None:
        self._device.remove(addr)
        self.library.free(self.device_id, addr)

    def alloc_host(self, nbytes: int) -> int:
        addr = self.library.host_alloc(self.device_id, nbytes)
        self._pinned.add(addr, nbytes)
        self._mapped_host.add(addr, nbytes)
        return addr

    def free_host(self, addr: int, nbytes: int) -> None:
        self._mapped_host.remove(addr)
        self._pinned.remove(addr)
        self.library.host_free(self.device_id, addr)

    def register_host(self, addr: int, nbytes: int) -> None:
        """Pin ``nbytes`` of the caller's host memory at ``addr`` so copies skip staging.

        :raises LLMException: ``LLM_PARAM_INVALID`` / ``LLM_FAILED`` when CUDA refuses
            (already pinned, not host memory).
        """
        self.library.host_register(self.device_id, addr, nbytes)
        self._pinned.add(addr, nbytes)

    def unregister_host(self, addr: int) -> None:
        """Unpin memory pinned by :meth:`register_host`."""
        self._pinned.remove(addr)
        self.library.host_unregister(self.device_id, addr)

    # -- copies ---------------------------------------------------------------------------
    def copy_batch(self, ops: npt.NDArray[np.uint64], kind: CopyKind) -> None:
        if len(ops) == 0:
            return
        if kind is CopyKind.HOST_TO_HOST:
            api.copy_batch(ops)
            return
        if kind is CopyKind.DEVICE_TO_DEVICE:
            self._ctx.copy(ops, kind, self._kernel_mode(ops, kind))
            return
        host = ops[:, 1] if kind is CopyKind.HOST_TO_DEVICE else ops[:, 0]
        if self._device.covers(host, ops[:, 2]).any():
            raise _invalid(f"the host side of a {kind.name} copy is device memory")
        pinned = self._pinned_rows(host, ops[:, 2])
        if pinned.all():
            self._ctx.copy(ops, kind, self._kernel_mode(ops, kind))
        elif not pinned.any():
            self._ctx.copy_staged(ops, kind)
        else:
            self._ctx.copy(np.ascontiguousarray(ops[pinned]), kind, CopyMode.ENGINE)
            self._ctx.copy_staged(np.ascontiguousarray(ops[~pinned]), kind)

    def _kernel_mode(self, ops: npt.NDArray[np.uint64], kind: CopyKind) -> CopyMode:
        # The kernel faults the whole context on a bad address, so it only runs over memory
        # this runtime allocated or mapped: device memory, and its cudaHostAlloc memory
        # (mapped, at the same address on the device). Anything else goes to the copy
        # engines, which report it. (The native layer still sends a host batch of few rows
        # to the engines, one DMA each; many scattered rows go to one launch.)
        if "copy_kernel" not in self._ctx.features:
            return CopyMode.ENGINE
        lengths = ops[:, 2]
        dst = self._mapped_host if kind is CopyKind.DEVICE_TO_HOST else None
        src = self._mapped_host if kind is CopyKind.HOST_TO_DEVICE else None
        inside = self._reached(dst, ops[:, 0], lengths) & self._reached(src, ops[:, 1], lengths)
        return CopyMode.KERNEL if bool(inside.all()) else CopyMode.ENGINE

    def _reached(
        self,
        host: AddressRanges | None,
        addrs: npt.NDArray[np.uint64],
        lengths: npt.NDArray[np.uint64],
    ) -> npt.NDArray[np.bool_]:
        """Rows a kernel reaches: inside ``host`` where that side is host memory, else inside
        device memory this runtime allocated or mapped."""
        return self._mapped(addrs, lengths) if host is None else host.covers(addrs, lengths)

    def _mapped(
        self, addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64]
    ) -> npt.NDArray[np.bool_]:
        """Rows inside device memory this runtime allocated or mapped from a peer."""
        return self._device.covers(addrs, lengths) | self._ipc.covers(addrs, lengths)

    def _pinned_rows(
        self, addrs: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint64]
    ) -> npt.NDArray[np.bool_]:
        pinned = self._pinned.covers(addrs, lengths)
        unknown = ~pinned
        if unknown.any() and "pointer_attributes" in self.library.features:
            first = np.ascontiguousarray(addrs[unknown])
            with np.errstate(over="ignore"):
                last = first + np.maximum(lengths[unknown], np.uint64(1)) - np.uint64(1)
            types = np.stack(
                [
                    self.library.pointer_types(self.device_id, first),
                    self.library.pointer_types(self.device_id, last),
                ]
            )
            if (types == _DEVICE_MEMORY).any():
                # Staging would read it with the CPU: refuse rather than fault.
                raise _invalid("the host side of a copy is device memory")
            pinned[unknown] = (types == _PINNED_MEMORY).all(axis=0)
        return pinned

    def synchronize(self) -> None:
        """Copies complete before their call returns; nothing to wait for."""

    def memset(self, addr: int, value: int, nbytes: int) -> None:
        """Fill ``nbytes`` of device memory at ``addr`` with the byte ``value``."""
        self._ctx.memset(addr, value, nbytes)

    def zero_device(self, addr: int, nbytes: int) -> None:
        """``cudaMemsetAsync`` on a lane's stream, waited for; through a zeroed pinned buffer
        where this CUDA runtime lacks it."""
        if "memset" in self._ctx.features:
            self.memset(addr, 0, nbytes)
        else:
            super().zero_device(addr, nbytes)

    def download(self, addr: int, nbytes: int) -> bytes:
        """Copy ``nbytes`` of device memory at ``addr`` to a new ``bytes`` (for tests, tools)."""
        out = np.empty(nbytes, dtype=np.uint8)
        if nbytes:
            ops = np.array([[out.ctypes.data, addr, nbytes]], dtype=np.uint64)
            self.copy_batch(ops, CopyKind.DEVICE_TO_HOST)
        return out.tobytes()

    def upload(self, addr: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` into device memory at ``addr``."""
        src = np.frombuffer(data, dtype=np.uint8)
        if len(src):
            ops = np.array([[addr, src.ctypes.data, len(src)]], dtype=np.uint64)
            self.copy_batch(ops, CopyKind.HOST_TO_DEVICE)

    # -- streaming device memory (for transports) -------------------------------------------
    def stage_out(self, iov: npt.NDArray[np.uint64]) -> Stage:
        """Read the device rows ``(addr, nbytes)`` of ``iov`` as pinned host chunks, in order.

        ``with rt.stage_out(iov) as chunks: for addr, n in chunks: sock_send(fd, addr, n)``:
        each chunk holds the next bytes and stays valid until the next is taken, while the
        device already copies the following ones. ``iov`` must not change meanwhile.
        """
        return self._ctx.stage(CopyKind.DEVICE_TO_HOST, iov)

    def stage_in(self, iov: npt.NDArray[np.uint64]) -> Stage:
        """Write the device rows ``(addr, nbytes)`` of ``iov`` from pinned host chunks.

        ``with rt.stage_in(iov) as chunks: for addr, n in chunks: sock_recv(fd, addr, n)``:
        fill each chunk with the next bytes; it goes to the device when the next chunk is
        taken, or when the block exits cleanly (an exception drops it). On exit every byte
        has arrived.
        """
        return self._ctx.stage(CopyKind.HOST_TO_DEVICE, iov)

    def stage_ring(self, iov: npt.NDArray[np.uint64], kind: CopyKind) -> Stage:
        """The native staging ring of :meth:`stage_out` / :meth:`stage_in` for ``kind``."""
        if kind is CopyKind.DEVICE_TO_HOST:
            return self.stage_out(iov)
        if kind is CopyKind.HOST_TO_DEVICE:
            return self.stage_in(iov)
        raise ValueError(f"a staging ring copies between host and device, not {kind.name}")

    # -- sharing device memory with other processes --------------------------------------
    def ipc_handle(self, addr: int) -> bytes:
        """A token (:data:`IPC_TOKEN_BYTES` bytes) that another process on this host passes
        to :meth:`open_ipc` to reach ``addr``; its allocation must come from :meth:`alloc_device`.

        :raises LLMException: ``LLM_PARAM_INVALID`` for memory this runtime did not allocate.
        """
        found = self._device.find(addr)
        if found is None:
            raise _invalid(f"address {addr:#x} is not device memory allocated by this runtime")
        base, size = found
        handle = self.library.ipc_get(self.device_id, base)
        return _TOKEN.pack(handle, addr - base, size)

    def open_ipc(self, token: bytes) -> int:
        """Map the memory a peer's :meth:`ipc_handle` names; returns its address here.

        Opening the same allocation again shares the mapping; each open needs a
        :meth:`close_ipc`. A process cannot open its own tokens (CUDA refuses).

        :raises TypeError: ``token`` is not :data:`IPC_TOKEN_BYTES` bytes.
        :raises LLMException: ``LLM_FAILED`` when CUDA cannot map it.
        """
        if not isinstance(token, bytes | bytearray) or len(token) != IPC_TOKEN_BYTES:
            raise TypeError(f"token must be {IPC_TOKEN_BYTES} bytes from ipc_handle()")
        handle, offset, size = _TOKEN.unpack(bytes(token))
        if offset >= size:
            raise _invalid(f"token offset {offset} is outside its {size}-byte allocation")
        with self._ipc_lock:
            ref = self._ipc_refs.get(handle)
            if ref is None:
                base = self.library.ipc_open(self.device_id, handle)
                ref = self._ipc_refs[handle] = [base, 0]
                self._ipc_handles[base] = handle
                self._ipc.add(base, size)
            ref[1] += 1
            return ref[0] + int(offset)

    def share(self, addr: int, nbytes: int) -> bytes | None:
        """An :meth:`ipc_handle` token for ``addr`` when ``[addr, addr + nbytes)`` lies in one
        allocation of this runtime; else None."""
        found = self._device.find(addr)
        if found is None or addr + nbytes > found[0] + found[1]:
            return None
        return self.ipc_handle(addr)

    def open_shared(self, token: bytes) -> int:
        """:meth:`open_ipc`."""
        return self.open_ipc(token)

    def close_shared(self, addr: int) -> None:
        """:meth:`close_ipc`."""
        self.close_ipc(addr)

    def close_ipc(self, addr: int) -> None:
        """Drop one :meth:`open_ipc` of the allocation holding ``addr``; unmapped at the last.

        :raises LLMException: ``LLM_PARAM_INVALID`` when no open mapping holds ``addr``.
        """
        with self._ipc_lock:
            found = self._ipc.find(addr)
            if found is None:
                raise _invalid(f"address {addr:#x} is not in memory opened by open_ipc")
            base = found[0]
            handle = self._ipc_handles[base]
            ref = self._ipc_refs[handle]
            ref[1] -= 1
            if ref[1]:
                return
            del self._ipc_refs[handle], self._ipc_handles[base]
            self._ipc.remove(base)
            self.library.ipc_close(self.device_id, base)

    def close(self) -> None:
        """Release streams and staging buffers, and unmap peers' memory still open.

        Memory from :meth:`alloc_device` / :meth:`alloc_host` stays valid until freed:
        pools free their arenas once no view refers to them.
        """
        self._ctx.close()
        with self._ipc_lock:
            bases = list(self._ipc_handles)
            self._ipc_refs.clear()
            self._ipc_handles.clear()
        for base in bases:
            self._ipc.remove(base)
            self.library.ipc_close(self.device_id, base)
