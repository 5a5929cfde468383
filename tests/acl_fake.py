"""Helpers for tests against the fake libascendcl (``fakelibs/fake_ascendcl.c``)."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from aio_datadist._runtime.base import CopyKind, DeviceRuntime

ROOT = Path(__file__).resolve().parent.parent
#: Environment variables of the fake; every test starts with none of them set.
FAKE_VARS = (
    "FAKE_ACL_DEVICES",
    "FAKE_ACL_FAIL",
    "FAKE_ACL_FAIL_MALLOC_OVER",
    "FAKE_ACL_FAIL_MALLOC_HOST_OVER",
)


class FakeAcl:
    """The fake library as the tests see it: its call log, its device memory, its counters."""

    def __init__(self, path: Path, log: Path) -> None:
        self.path = path
        self.log = log
        self._lib = ctypes.CDLL(str(path))
        self._lib.fake_acl_read.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self._lib.fake_acl_write.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self._lib.fake_acl_count.argtypes = [ctypes.c_char_p]
        self._lib.fake_acl_count.restype = ctypes.c_long

    def lines(self) -> list[str]:
        """Every logged call, oldest first: ``"name args -> rc"``."""
        return self.log.read_text().splitlines() if self.log.exists() else []

    def calls(self, *, bind: bool = False) -> list[str]:
        """Names of the logged calls; context binding calls only when ``bind``."""
        names = [line.split()[0] for line in self.lines()]
        if bind:
            return names
        return [n for n in names if n not in ("aclrtSetCurrentContext", "aclrtGetCurrentContext")]

    def clear_log(self) -> None:
        self.log.unlink(missing_ok=True)

    def read(self, addr: int, nbytes: int) -> bytes:
        """Bytes of device memory, read by the fake itself (not through the runtime)."""
        buf = ctypes.create_string_buffer(nbytes)
        assert self._lib.fake_acl_read(addr, buf, nbytes) == 0, f"{addr:#x} is not device memory"
        return buf.raw

    def write(self, addr: int, data: bytes) -> None:
        assert self._lib.fake_acl_write(addr, data, len(data)) == 0

    def count(self, what: str) -> int:
        """Live ``device`` / ``host`` allocations, ``streams``, ``refs:<id>`` or ``inited``."""
        return int(self._lib.fake_acl_count(what.encode()))

    def assert_released(self) -> None:
        """Every device reset and every allocation freed (after collecting dropped arenas)."""
        gc.collect()
        assert self.count("refs:0") == 0, "device 0 is still set"
        assert (self.count("device"), self.count("host"), self.count("streams")) == (0, 0, 0)


def read_device(rt: DeviceRuntime, addr: int, nbytes: int) -> bytes:
    """Bytes of device memory, read back through the runtime (device-to-host copy)."""
    buf = np.zeros(nbytes, np.uint8)
    rt.copy_batch(np.array([[buf.ctypes.data, addr, nbytes]], np.uint64), CopyKind.DEVICE_TO_HOST)
    return buf.tobytes()


def write_device(rt: DeviceRuntime, addr: int, data: bytes) -> None:
    """Write ``data`` to device memory through the runtime (host-to-device copy)."""
    buf = np.frombuffer(data, np.uint8).copy()
    rt.copy_batch(
        np.array([[addr, buf.ctypes.data, len(data)]], np.uint64), CopyKind.HOST_TO_DEVICE
    )


def run_script(code: str, env: dict[str, str], timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter (fresh ACL state) with ``env`` added; return stdout."""
    full = dict(os.environ, **env)
    full["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=full,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"script failed ({done.returncode}):\n{done.stderr}"
    return done.stdout
