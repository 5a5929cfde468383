"""Memory rows: ``(addr, len)`` tables describing scattered memory in payload order.

Transfers describe both ends as rows; the two ends of one request add up to the same bytes
but may split them differently (a remote batch row landing in local blocks, say).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

__all__ = ("SMALL_ROWS", "Rows", "pair_rows", "small_rows")

#: ``(addr, len)`` rows: a C-contiguous ``(n, 2)`` uint64 array.
Rows = npt.NDArray[np.uint64]

#: Up to this many rows, plain Python builds tables faster than vectorised numpy.
SMALL_ROWS = 64
#: Up to this many rows a side, plain Python pairs two tables faster than numpy.
_SMALL_PAIRS = 8


def small_rows(bases: Sequence[int], blocks: Iterable[int], block_bytes: int, seg: int) -> Rows:
    """Rows of ``seg`` bytes at ``base + block * block_bytes``, per base then per block.

    The plain-Python form of the vectorised tables, for a handful of rows.
    """
    flat: list[int] = []
    add = flat.append
    blocks = tuple(blocks)
    for base in bases:
        for block in blocks:
            add(base + block * block_bytes)
            add(seg)
    return np.array(flat, dtype=np.uint64).reshape(-1, 2)


def pair_rows(dst: Rows, src: Rows) -> npt.NDArray[np.uint64]:
    """Copy ops moving the bytes of the ``(addr, len)`` rows ``src`` into the rows ``dst``.

    Both describe the same number of bytes, split differently; the result has one
    ``(dst, src, nbytes)`` row per piece where neither side crosses a row boundary.

    :raises ValueError: the two sides do not add up to the same size.
    """
    if len(dst) == len(src) <= _SMALL_PAIRS:
        ops = _same_split(dst.tolist(), src.tolist())
        if ops is not None:
            return ops
    elif len(dst) == len(src) and np.array_equal(dst[:, 1], src[:, 1]):
        # The same split on both sides (the common case): one op per row.
        ops = np.empty((len(dst), 3), dtype=np.uint64)
        ops[:, 0] = dst[:, 0]
        ops[:, 1] = src[:, 0]
        ops[:, 2] = dst[:, 1]
        return ops[ops[:, 2] > 0] if len(dst) and not dst[:, 1].all() else ops
    d_end = np.cumsum(dst[:, 1], dtype=np.uint64) if len(dst) else np.empty(0, np.uint64)
    s_end = np.cumsum(src[:, 1], dtype=np.uint64) if len(src) else np.empty(0, np.uint64)
    d_total = int(d_end[-1]) if len(d_end) else 0
    s_total = int(s_end[-1]) if len(s_end) else 0
    if d_total != s_total:
        raise ValueError(f"destination rows hold {d_total} bytes, source rows {s_total}")
    if d_total == 0:
        return np.empty((0, 3), dtype=np.uint64)
    ends = np.union1d(d_end, s_end)
    ends = ends[ends > 0]  # leading empty rows make no piece
    starts = np.concatenate([np.zeros(1, dtype=np.uint64), ends[:-1]])
    di = np.searchsorted(d_end, starts, side="right")
    si = np.searchsorted(s_end, starts, side="right")
    ops = np.empty((len(ends), 3), dtype=np.uint64)
    ops[:, 0] = dst[di, 0] + (starts - (d_end[di] - dst[di, 1]))
    ops[:, 1] = src[si, 0] + (starts - (s_end[si] - src[si, 1]))
    ops[:, 2] = ends - starts
    return ops


def _same_split(dst: list[list[int]], src: list[list[int]]) -> npt.NDArray[np.uint64] | None:
    """One op per non-empty row when both sides split their bytes alike; else None."""
    flat: list[int] = []
    for (d_addr, d_len), (s_addr, s_len) in zip(dst, src, strict=True):
        if d_len != s_len:
            return None
        if d_len:
            flat += (d_addr, s_addr, d_len)
    return np.array(flat, dtype=np.uint64).reshape(-1, 3)
