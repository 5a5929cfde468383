"""A worker's KV cache as the engine sees it: layers of equal blocks at fixed addresses.

Serving engines page their KV cache: each layer's memory is ``num_blocks`` blocks of the same
size, and a request owns a list of block ids that index every layer alike. One layer is one
region (K and V joined in each block, or MLA's latent vector) or two (K and V apart). A
:class:`KvLayout` records the regions in layer order; the node registers them in place as one
blocks cache of ``num_layers * tensors_per_layer`` tensors, so that a transfer names blocks
once for every layer and ``tensor_num_per_layer`` makes a layer of a layer's regions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from aio_datadist.data_type import DataType
from aio_datadist.enums import Placement
from aio_datadist.types import CacheDesc

__all__ = ("KvLayout",)


@dataclass(frozen=True)
class KvLayout:
    """The regions of a worker's paged KV cache.

    ``addrs[l * tensors_per_layer + j]`` is region ``j`` of layer ``l``; block ``b`` of a
    region is the ``block_bytes`` bytes at ``addr + b * block_bytes``.
    """

    num_layers: int
    tensors_per_layer: int
    num_blocks: int
    block_bytes: int
    addrs: tuple[int, ...]
    #: Tokens per block.
    block_size: int
    #: The element type's name (``bfloat16``, ``float8_e4m3fn``, ...): both ends must agree.
    dtype: str
    #: ``cpu`` or ``cuda``.
    device: str = "cpu"
    device_index: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.tensors_per_layer < 1:
            raise ValueError("a KV layout needs at least one layer of at least one region")
        if len(self.addrs) != self.num_layers * self.tensors_per_layer:
            raise ValueError(
                f"{len(self.addrs)} region addresses for {self.num_layers} layers of "
                f"{self.tensors_per_layer} region(s)"
            )
        if self.num_blocks < 1 or self.block_bytes < 1 or self.block_size < 1:
            raise ValueError("a KV layout needs blocks of at least one byte and one token")
        if any(a <= 0 for a in self.addrs):
            raise ValueError("a KV region has a null address")
        spans = sorted((a, a + self.region_bytes) for a in self.addrs)
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise ValueError("two KV regions overlap")

    @property
    def region_bytes(self) -> int:
        """Bytes of one region: ``num_blocks * block_bytes``."""
        return self.num_blocks * self.block_bytes

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id stands for across every layer and region."""
        return self.block_bytes * len(self.addrs)

    def describe(self) -> dict[str, Any]:
        """What a peer must share for blocks to move between the two, as plain JSON values
        (the number of blocks and the addresses may differ)."""
        return {
            "num_layers": self.num_layers,
            "tensors_per_layer": self.tensors_per_layer,
            "block_bytes": self.block_bytes,
            "block_size": self.block_size,
            "dtype": self.dtype,
        }

    def mismatch(self, peer: Any) -> str | None:
        """Why blocks cannot move between this layout and a peer's ``describe()``; None when
        they can."""
        mine = self.describe()
        if not isinstance(peer, dict):
            return f"the peer sent no KV layout ({peer!r})"
        wrong = [
            f"{k} {peer.get(k)!r} there, {v!r} here" for k, v in mine.items() if peer.get(k) != v
        ]
        if wrong:
            return "the KV cache layouts differ: " + "; ".join(wrong)
        return None

    def cache_desc(self) -> CacheDesc:
        """The blocks cache the regions are registered as: bytes, block-indexed."""
        return CacheDesc(
            len(self.addrs),
            [self.num_blocks, self.block_bytes],
            DataType.DT_UINT8,
            Placement.DEVICE,
        )
