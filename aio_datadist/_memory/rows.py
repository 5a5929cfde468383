"""Memory rows: ``(addr, len)`` tables describing scattered memory in payload order.

Transfers describe both ends as rows; the two ends of one request add up to the same bytes
but may split them differently (a remote batch row landing in local blocks, say).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ("Rows", "pair_rows")

#: ``(addr, len)`` rows: a C-contiguous ``(n, 2)`` uint64 array.
Rows = npt.NDArray[np.uint64]


def pair_rows(dst: Rows, src: Rows) -> npt.NDArray[np.uint64]:
    """Copy ops moving the bytes of the ``(addr, len)`` rows ``src`` into the rows ``dst``.

    Both describe the same number of bytes, split differently; the result has one
    ``(dst, src, nbytes)`` row per piece where neither side crosses a row boundary.

    :raises ValueError: the two sides do not add up to the same size.
    """
    d_end = np.cumsum(dst[:, 1], dtype=np.uint64) if len(dst) else np.empty(0, np.uint64)
    s_end = np.cumsum(src[:, 1], dtype=np.uint64) if len(src) else np.empty(0, np.uint64)
    d_total = int(d_end[-1]) if len(d_end) else 0
    s_total = int(s_end[-1]) if len(s_end) else 0
    if d_total != s_total:
        raise ValueError(f"destination rows hold {d_total} bytes, source rows {s_total}")
    if d_total == 0:
        return np.empty((0, 3), dtype=np.uint64)
    ends = np.union1d(d_end, s_end)
    starts = np.concatenate([np.zeros(1, dtype=np.uint64), ends[:-1]])
    di = np.searchsorted(d_end, starts, side="right")
    si = np.searchsorted(s_end, starts, side="right")
    ops = np.empty((len(ends), 3), dtype=np.uint64)
    ops[:, 0] = dst[di, 0] + (starts - (d_end[di] - dst[di, 1]))
    ops[:, 1] = src[si, 0] + (starts - (s_end[si] - src[si, 1]))
    ops[:, 2] = ends - starts
    return ops
