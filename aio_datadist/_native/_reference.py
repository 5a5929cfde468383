"""Pure-Python reference of the batched copy kernel, used by the tests as an oracle.

It copies row by row with ``ctypes.memmove`` and merges nothing, so any difference from
``api.copy_batch`` points at the C kernel's merging or splitting.
"""

from __future__ import annotations

import ctypes

import numpy as np
import numpy.typing as npt

__all__ = ("copy_batch_reference",)


def copy_batch_reference(ops: npt.NDArray[np.uint64]) -> None:
    """Apply each ``(dst, src, nbytes)`` row of ``ops`` in order, one memmove per row.

    Raises:
        ValueError: ``ops`` is not of shape ``(n, 3)``.
    """
    rows = np.asarray(ops, dtype=np.uint64)
    if rows.ndim != 2 or rows.shape[1] != 3:
        raise ValueError(f"ops must have shape (n, 3), got {rows.shape}")
    for dst, src, nbytes in rows.tolist():
        if nbytes:
            ctypes.memmove(dst, src, nbytes)
