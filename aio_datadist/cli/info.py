"""``aio-datadist info``: what this machine offers aio_datadist."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from typing import Any

__all__ = ("gather", "render")

_PTRACE_SCOPES = {
    "0": "a process may read another of the same user",
    "1": "only a process's descendants: unrelated peers fall back to the link",
    "2": "only with CAP_SYS_PTRACE",
    "3": "never: the same-host route is off",
}
_CAP_SYS_PTRACE = 19
#: Two unrelated processes, as two engines are: one holds known bytes, the other reads them
#: the way the same-host route does.
_HOLDER = (
    "import sys, numpy as np; b = np.frombuffer(b'aio-datadist', np.uint8).copy(); "
    "print(b.ctypes.data, flush=True); sys.stdin.read()"
)
_READER = """
import sys
import numpy as np
from aio_datadist._native import api
pid, addr = int(sys.argv[1]), int(sys.argv[2])
out = np.zeros(12, np.uint8)
try:
    api.vm_copy_batch(pid, np.array([[out.ctypes.data, addr, 12]], np.uint64), write=False)
except OSError as exc:
    print(f"refused: {exc}")
else:
    print("ok" if out.tobytes() == b"aio-datadist" else "read other bytes")
"""


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return None


def _peer_read() -> str:
    """Let one process read another's memory as the same-host route would: "ok" or why not."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        addr = holder.stdout.readline().strip()
        reader = subprocess.run(
            [sys.executable, "-c", _READER, str(holder.pid), addr],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()
    lines = (reader.stdout or reader.stderr).strip().splitlines()
    return lines[-1] if lines else f"the probe failed (exit status {reader.returncode})"


def _same_host() -> dict[str, Any]:
    """Whether two unrelated processes here may read each other (the same-host route)."""
    scope = _read("/proc/sys/kernel/yama/ptrace_scope")
    status = _read("/proc/self/status") or ""
    caps = re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.MULTILINE)
    cgroup = _read("/proc/1/cgroup") or ""
    peer_read = _peer_read()
    return {
        "allowed": peer_read == "ok",
        "peer_read": peer_read,
        "ptrace_scope": scope,
        "ptrace_scope_means": _PTRACE_SCOPES.get(scope or "", "no Yama module: as 0"),
        "cap_sys_ptrace": bool(caps and int(caps[1], 16) >> _CAP_SYS_PTRACE & 1),
        "container": os.path.exists("/.dockerenv")
        or bool(re.search(r"docker|kubepods|containerd|lxc", cgroup)),
    }


def _cuda() -> dict[str, Any]:
    try:
        from aio_datadist._native import cuda
    except ImportError as exc:
        return {"available": False, "reason": f"not in this build: {exc}"}
    try:
        lib = cuda.load()
    except Exception as exc:  # every way a vendor library fails to load is reported
        return {"available": False, "reason": str(exc)}
    count, reason = lib.probe_devices()
    out: dict[str, Any] = {
        "available": count > 0,
        "library": lib.path,
        "version": lib.version,
        "devices": count,
        "features": sorted(lib.features),
    }
    if reason:
        out["reason"] = reason
    return out


def _vendor(module: str) -> dict[str, Any]:
    """ACL or HCCL: whether the vendor library loads (no device is opened)."""
    try:
        native = __import__(f"aio_datadist._native.{module}", fromlist=["load"])
    except ImportError as exc:
        return {"available": False, "reason": f"not in this build: {exc}"}
    try:
        native.load()
    except Exception as exc:  # every way a vendor library fails to load is reported
        return {"available": False, "reason": str(exc)}
    return {"available": True, "library": native.DEFAULT_LIBRARY}


def _ucx() -> dict[str, Any]:
    from aio_datadist._routes.ucx.worker import ucx_info

    return ucx_info()


def _logging() -> dict[str, Any]:
    from aio_datadist._log import LOG_ENV

    value = os.environ.get(LOG_ENV)
    return {
        "env": LOG_ENV,
        "value": value,
        "on": bool(value),
        "how": f"{LOG_ENV}=info (or debug) in the environment, or aio_datadist.enable_logging()",
    }


def gather() -> dict[str, Any]:
    """Everything ``info`` reports, as plain data."""
    import aio_datadist
    from aio_datadist._runtime import RUNTIME_ENV

    return {
        "version": aio_datadist.__version__,
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "native": sorted(f for f in aio_datadist.features if not f.startswith("runtime:")),
        "runtime_policy": os.environ.get(RUNTIME_ENV, "auto"),
        "runtimes": {"cuda": _cuda(), "acl": _vendor("acl"), "hccl": _vendor("hccl")},
        "ucx": _ucx(),
        "same_host": _same_host(),
        "logging": _logging(),
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(what, state, detail)`` rows for the table."""
    rows = [
        ("aio_datadist", data["version"], f"Python {data['python']}, {data['platform']}"),
        ("native build", "yes", ", ".join(data["native"]) or "-"),
        ("runtime choice", data["runtime_policy"], "AIO_DATADIST_RUNTIME: auto, host, cuda, acl"),
    ]
    for name, rt in data["runtimes"].items():
        detail = rt.get("reason", "")
        if rt.get("library"):
            version = f" version {rt['version']}" if rt.get("version") else ""
            devices = f", {rt['devices']} device(s)" if "devices" in rt else ""
            library = (
                "libcudart (the usual sonames)" if rt["library"] == "default" else rt["library"]
            )
            detail = f"{library}{version}{devices}" + (f"; {detail}" if detail else "")
        rows.append((f"runtime {name}", _yes(rt["available"]), detail))
    ucx = data["ucx"]
    if ucx.get("available"):
        detail = f"{ucx['path']} {ucx['version']}; " + (", ".join(ucx.get("transports", [])) or "-")
    else:
        detail = ucx.get("reason", "")
    rows.append(("UCX", _yes(bool(ucx.get("available"))), detail))
    same = data["same_host"]
    rows.append(
        (
            "same-host route",
            _yes(same["allowed"]),
            f"peer read: {same['peer_read']}; ptrace_scope {same['ptrace_scope']} "
            f"({same['ptrace_scope_means']}); CAP_SYS_PTRACE {_yes(same['cap_sys_ptrace'])}; "
            f"container {_yes(same['container'])}",
        )
    )
    log = data["logging"]
    rows.append(("logging", "on" if log["on"] else "off", log["how"]))
    return rows
