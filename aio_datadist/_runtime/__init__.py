"""Device runtimes and the policy that picks one at ``init``.

``AIO_DATADIST_RUNTIME`` selects explicitly: ``host``, ``cuda`` or ``acl``; ``auto`` (the
default) tries the accelerator runtimes in that order — CUDA, then Ascend ACL — and falls
back to ``host``, logging the choice once per process. An accelerator runtime module
(``aio_datadist._runtime.<name>``) offers ``open_runtime(device_id)``, which raises
:class:`RuntimeUnavailable` when its library or device is missing.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from aio_datadist._log import get_logger
from aio_datadist._runtime.base import CopyKind, DeviceRuntime, RuntimeUnavailable
from aio_datadist._runtime.host import HostRuntime
from aio_datadist.status import LLMStatusCode, ParamInvalidError

__all__ = (
    "ACCELERATORS",
    "RUNTIME_ENV",
    "CopyKind",
    "DeviceRuntime",
    "HostRuntime",
    "RuntimeUnavailable",
    "select_runtime",
)

RUNTIME_ENV = "AIO_DATADIST_RUNTIME"
#: Accelerator runtimes in the order ``auto`` tries them.
ACCELERATORS = ("cuda", "acl")
_log = get_logger("runtime")
_announced: set[str] = set()


def _opener(name: str) -> Callable[[int], DeviceRuntime] | None:
    """``open_runtime`` of the accelerator module ``name``; None when this build lacks it."""
    try:
        module = importlib.import_module(f"aio_datadist._runtime.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"aio_datadist._runtime.{name}":
            raise
        return None
    opener: Callable[[int], DeviceRuntime] = module.open_runtime
    return opener


def _open(name: str, device_id: int) -> DeviceRuntime:
    opener = _opener(name)
    if opener is None:
        raise RuntimeUnavailable(f"this build has no {name} runtime")
    return opener(device_id)


def select_runtime(device_id: int) -> DeviceRuntime:
    """Create the runtime for ``device_id`` chosen by ``AIO_DATADIST_RUNTIME`` (default auto).

    :raises LLMException: ``LLM_PARAM_INVALID`` for an unknown runtime name, or for an
        accelerator runtime asked for by name that cannot be used here (the message says why).
    """
    policy = os.environ.get(RUNTIME_ENV, "auto").strip().lower() or "auto"
    known = ("auto", "host", *ACCELERATORS)
    if policy not in known:
        raise ParamInvalidError(
            f"{RUNTIME_ENV}={policy!r} is not a known runtime; choose one of {', '.join(known)}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    runtime: DeviceRuntime | None = None
    skipped: dict[str, str] = {}
    if policy in ACCELERATORS:
        try:
            runtime = _open(policy, device_id)
        except RuntimeUnavailable as exc:
            raise ParamInvalidError(
                f"{RUNTIME_ENV}={policy} but the {policy} runtime cannot be used: {exc}",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            ) from None
    elif policy == "auto":
        for name in ACCELERATORS:
            try:
                runtime = _open(name, device_id)
                break
            except RuntimeUnavailable as exc:
                skipped[name] = str(exc)
    if runtime is None:
        runtime = HostRuntime(device_id)
    if runtime.name not in _announced:
        _announced.add(runtime.name)
        extra: dict[str, object] = {"skipped": skipped} if skipped else {}
        if runtime.device_memory_is_host:
            extra["note"] = "no accelerator runtime in use: Placement.DEVICE memory is host memory"
        _log.info("runtime.selected", runtime=runtime.name, policy=policy, **extra)
    return runtime
