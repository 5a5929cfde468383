"""Copy planning: turn validated cache operations into batches of ``(dst, src, nbytes)`` rows.

Pure functions over addresses and indices (numpy, vectorised); no I/O and no locking. The
result is executed by one runtime call per batch, inline or on a worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from aio_datadist._runtime.base import CopyKind

__all__ = ("CopyPlan", "Ops", "block_ops", "row_ops", "staged")

Ops = npt.NDArray[np.uint64]


@dataclass
class CopyPlan:
    """Batches to run in order with one runtime copy kind.

    ``stage_bytes`` > 0 means the batches copy through a scratch buffer: the first batch's
    destinations and the second batch's sources are offsets into it, to be rebased on the
    scratch address at execution.
    """

    batches: list[Ops]
    kind: CopyKind
    nbytes: int
    stage_bytes: int = 0
    stage_device: bool = False
    pinned: list[object] = field(default_factory=list)


def row_ops(
    dst_addrs: Sequence[int],
    src_addrs: Sequence[int],
    dst_offset: int,
    src_offset: int,
    nbytes: int,
) -> Ops:
    """One row per tensor: ``src_addrs[i] + src_offset`` → ``dst_addrs[i] + dst_offset``."""
    ops = np.empty((len(dst_addrs), 3), dtype=np.uint64)
    ops[:, 0] = np.asarray(dst_addrs, dtype=np.uint64) + np.uint64(dst_offset)
    ops[:, 1] = np.asarray(src_addrs, dtype=np.uint64) + np.uint64(src_offset)
    ops[:, 2] = nbytes
    return ops


def block_ops(
    dst_addrs: Sequence[int],
    src_addrs: Sequence[int],
    dst_blocks: npt.NDArray[np.uint64],
    src_blocks: npt.NDArray[np.uint64],
    block_bytes: int,
) -> Ops:
    """Rows copying ``src_blocks[j]`` → ``dst_blocks[j]`` in every tensor, tensor-major order."""
    n_tensors, n_blocks = len(dst_addrs), len(dst_blocks)
    size = np.uint64(block_bytes)
    ops = np.empty((n_tensors, n_blocks, 3), dtype=np.uint64)
    ops[:, :, 0] = np.asarray(dst_addrs, dtype=np.uint64)[:, None] + dst_blocks[None, :] * size
    ops[:, :, 1] = np.asarray(src_addrs, dtype=np.uint64)[:, None] + src_blocks[None, :] * size
    ops[:, :, 2] = size
    return ops.reshape(n_tensors * n_blocks, 3)


def staged(ops: Ops) -> tuple[Ops, Ops, int]:
    """Split ``ops`` into (sources → scratch offsets, scratch offsets → destinations, bytes).

    Used when sources and destinations overlap, so every source is read before any
    destination is written.
    """
    lengths = ops[:, 2]
    offsets = np.zeros(len(ops), dtype=np.uint64)
    if len(ops) > 1:
        np.cumsum(lengths[:-1], out=offsets[1:])
    gather = np.stack([offsets, ops[:, 1], lengths], axis=1)
    scatter = np.stack([ops[:, 0], offsets, lengths], axis=1)
    return gather, scatter, int(lengths.sum())
