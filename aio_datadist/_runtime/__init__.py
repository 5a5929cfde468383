"""Device runtimes and the policy that picks one at ``init``.

``AIO_DATADIST_RUNTIME`` selects explicitly (``host``; ``auto`` by default). ``auto`` tries the
accelerator runtimes this build knows in order and falls back to ``host``, logging the choice
once per process.
"""

from __future__ import annotations

import os

from aio_datadist._log import get_logger
from aio_datadist._runtime.base import CopyKind, DeviceRuntime
from aio_datadist._runtime.host import HostRuntime
from aio_datadist.status import LLMStatusCode, ParamInvalidError

__all__ = ("CopyKind", "DeviceRuntime", "HostRuntime", "RUNTIME_ENV", "select_runtime")

RUNTIME_ENV = "AIO_DATADIST_RUNTIME"
_log = get_logger("runtime")
_announced: set[str] = set()


def select_runtime(device_id: int) -> DeviceRuntime:
    """Create the runtime for ``device_id`` chosen by ``AIO_DATADIST_RUNTIME`` (default auto).

    :raises LLMException: ``LLM_PARAM_INVALID`` for an unknown runtime name.
    """
    policy = os.environ.get(RUNTIME_ENV, "auto").strip().lower() or "auto"
    if policy not in ("auto", "host"):
        raise ParamInvalidError(
            f"{RUNTIME_ENV}={policy!r} is not a known runtime; this build offers 'host' "
            "(and 'auto', which picks the best available)",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    runtime = HostRuntime(device_id)
    if runtime.name not in _announced:
        _announced.add(runtime.name)
        _log.info(
            "runtime.selected",
            runtime=runtime.name,
            policy=policy,
            note="no accelerator runtime available: Placement.DEVICE memory is host memory",
        )
    return runtime
