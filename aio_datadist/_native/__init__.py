"""The native layer: owns the choice of native implementation and says what it offers.

There is one implementation today, the cffi extension ``_ffi`` built from ``build_ffi.py``
(``impl == "cffi"``). Import the typed wrappers from ``aio_datadist._native.api``; that
module is the only one that touches the extension's ``ffi`` and ``lib``.

Raises:
    ImportError: the extension is not built; the message says how to build it and the
        original import error is chained.
"""

from __future__ import annotations

import importlib

__all__ = ("features", "impl")

try:
    importlib.import_module(f"{__name__}._ffi")
except ImportError as exc:
    raise ImportError(
        "aio_datadist native extension (aio_datadist._native._ffi) is not built: install the "
        "package with a C compiler available (`pip install .`, or `pip install -e . "
        "--no-build-isolation` for development), or run `python build_ffi.py` in the "
        f"source tree ({exc})"
    ) from exc

impl: str = "cffi"
"""Which native implementation is loaded."""

features: frozenset[str] = frozenset(
    {"pool", "copy_batch", "copy_threads", "hostmem", "net", "vm_copy"}
)
"""What the loaded implementation can do: page pool, batched copy, threaded copy, host memory,
scatter-gather socket I/O, batched copies with another process on this host."""
