"""Copy planning: turn validated cache operations into batches of ``(dst, src, nbytes)`` rows.

Pure functions over addresses and indices (numpy, vectorised); no I/O and no locking. The
result is executed by one runtime call per batch, inline or on a worker thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from aio_datadist._runtime.base import CopyKind
from aio_datadist._validate import check_int, check_int_list
from aio_datadist.enums import Placement

__all__ = (
    "COPY_KINDS",
    "BlockMap",
    "CopyPlan",
    "Ops",
    "block_ops",
    "copy_map",
    "row_ops",
    "staged",
    "swap_map",
)

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


#: A planned block map: ``(sources, destinations, a destination is also a source)``.
BlockMap = tuple["npt.NDArray[np.uint64]", "npt.NDArray[np.uint64]", bool]

#: The runtime's copy kind, by (source placement, destination placement).
COPY_KINDS = {
    (Placement.HOST, Placement.HOST): CopyKind.HOST_TO_HOST,
    (Placement.HOST, Placement.DEVICE): CopyKind.HOST_TO_DEVICE,
    (Placement.DEVICE, Placement.HOST): CopyKind.DEVICE_TO_HOST,
    (Placement.DEVICE, Placement.DEVICE): CopyKind.DEVICE_TO_DEVICE,
}


_UINT64_MAX = 2**64 - 1


def _plain_uint64s(*lists: list[Any]) -> bool:
    """Whether every item of ``lists`` is a plain ``int`` in uint64 range (checked at C
    speed, for long block maps; the item-by-item check then names a wrong one)."""
    for values in lists:
        if values and (
            not set(map(type, values)) <= {int} or min(values) < 0 or max(values) > _UINT64_MAX
        ):
            return False
    return True


def _block_map(last: dict[int, int]) -> BlockMap:
    """``{dst: src}`` as arrays, and whether a destination is also a source."""
    dsts = np.fromiter(last.keys(), dtype=np.uint64, count=len(last))
    srcs = np.fromiter(last.values(), dtype=np.uint64, count=len(last))
    return srcs, dsts, not last.keys().isdisjoint(last.values())


def copy_map(info: dict[Any, Any]) -> BlockMap:
    """The block map of ``copy_blocks`` ``{src: [dst, ...]}``: each destination once, from
    the last source that names it, checked as the API documents."""
    keys, values = list(info), list(info.values())
    if set(map(type, values)) <= {list, tuple}:
        flat = list(itertools.chain.from_iterable(values))
        if _plain_uint64s(keys, flat):
            repeated = itertools.chain.from_iterable(map(itertools.repeat, keys, map(len, values)))
            return _block_map(dict(zip(flat, repeated, strict=True)))
    last: dict[int, int] = {}
    for src_block, dst_blocks in info.items():  # raises, naming the wrong item
        check_int("copy_block_info key", src_block, "uint64")
        check_int_list(f"copy_block_info[{src_block}]", dst_blocks, "uint64")
        for dst_block in dst_blocks:
            last[dst_block] = src_block
    return _block_map(last)


def swap_map(info: dict[Any, Any]) -> BlockMap:
    """The block map of ``swap_blocks`` ``{src: dst}``: each destination once, from the last
    source that names it, checked as the API documents."""
    if not _plain_uint64s(list(info), list(info.values())):
        for src_block, dst_block in info.items():  # raises, naming the wrong item
            check_int("src_to_dst key", src_block, "uint64")
            check_int(f"src_to_dst[{src_block}]", dst_block, "uint64")
    return _block_map({dst: src for src, dst in info.items()})
