"""Whether HCCL (``libhccl.so``) is present, for rank-table ``link`` domains on Ascend machines.

``AIO_DATADIST_HCCL`` names the library to use instead of ``libhccl.so`` from the loader's
search path. The ACL runtime probes at open and reports the outcome.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aio_datadist._native import hccl

__all__ = ("HCCL_ENV", "HcclPresence", "probe")

HCCL_ENV = "AIO_DATADIST_HCCL"


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


def probe() -> HcclPresence:
    """Load libhccl (``AIO_DATADIST_HCCL`` or ``libhccl.so``) and say whether it can be used."""
    library = os.environ.get(HCCL_ENV, "").strip() or hccl.DEFAULT_LIBRARY
    try:
        hccl.load(library)
    except hccl.HcclUnavailable as exc:
        return HcclPresence(library, False, str(exc))
    return HcclPresence(library, True, cluster_info=hccl.has_cluster_info())
