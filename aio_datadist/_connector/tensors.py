"""A serving engine's torch KV cache tensors as a :class:`~.layout.KvLayout`.

An engine hands the connector one tensor per attention layer, viewing memory its worker
allocated. Each is registered in place, never copied. The layouts attention backends use
(vLLM's among them), with ``B`` the number of blocks:

* K and V joined, or one latent vector (MLA): ``[B, ...]``, blocks outermost and dense: one
  region per layer;
* K and V apart: ``[2, B, ...]``, each half dense: two regions per layer;
* a pair ``(K, V)`` of ``[B, ...]`` tensors: two regions per layer.

A layer whose blocks are not laid out one after another (a block-outermost layout, where a
block holds every layer) is refused, with the caller's hint on the layout to ask for instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aio_datadist._connector.layout import KvLayout

__all__ = ("kv_layout",)


def _dense(tensor: Any) -> bool:
    return bool(tensor.is_contiguous())


def _regions(name: str, value: Any, num_blocks: int, hint: str) -> list[tuple[int, int, Any]]:
    """(address, block bytes, a tensor) of each region of one layer's cache."""
    if isinstance(value, (tuple, list)):
        return [r for part in value for r in _regions(name, part, num_blocks, hint)]
    shape = tuple(value.shape)
    size = value.element_size()
    parts: list[Any]
    if len(shape) >= 2 and shape[0] == 2 and shape[1] % num_blocks == 0 and shape[0] != num_blocks:
        parts = [value[0], value[1]]
    elif shape and shape[0] % num_blocks == 0:
        parts = [value]
    else:
        raise ValueError(
            f"KV cache of {name}: shape {shape} has no dimension of {num_blocks} blocks first "
            "(expected [blocks, ...] or [2, blocks, ...])"
        )
    regions = []
    for part in parts:
        if not _dense(part):
            raise ValueError(
                f"KV cache of {name}: shape {tuple(part.shape)} with strides {part.stride()} "
                "does not hold each layer's blocks one after another" + (hint and f"; {hint}")
            )
        nbytes = part.numel() * size
        if nbytes % num_blocks:
            raise ValueError(f"KV cache of {name}: {nbytes} bytes are not {num_blocks} blocks")
        regions.append((int(part.data_ptr()), nbytes // num_blocks, part))
    return regions


def kv_layout(
    kv_caches: Mapping[str, Any], *, num_blocks: int, block_size: int, hint: str = ""
) -> tuple[KvLayout, dict[str, int]]:
    """The layout of ``kv_caches`` (the engine's layer name to tensor, in layer order), and
    each layer name's index in it (layers that share one cache share an index). ``hint`` ends
    the message that refuses a layout whose blocks are not one after another per layer: how
    to ask the engine for one that is.

    :raises ValueError: no layers, a layout this connector cannot register (the message says
        which layer and why), or layers that differ in block size, region count, element
        type or device.
    """
    if not kv_caches:
        raise ValueError("the worker has no KV cache to register")
    addrs: list[int] = []
    index: dict[str, int] = {}
    seen: dict[tuple[int, ...], int] = {}
    shape: tuple[int, int] | None = None
    kinds: set[tuple[str, str, int]] = set()
    for name, value in kv_caches.items():
        regions = _regions(name, value, num_blocks, hint)
        key = tuple(addr for addr, _, _ in regions)
        if key in seen:
            index[name] = seen[key]
            continue
        this = (len(regions), regions[0][1])
        if any(block != this[1] for _, block, _ in regions) or (shape and this != shape):
            raise ValueError(
                f"KV cache of {name}: {this[0]} region(s) of {this[1]}-byte blocks, where "
                f"earlier layers have {shape}; every layer must be alike"
            )
        shape = this
        tensor = regions[0][2]
        device = tensor.device
        kinds.add((str(tensor.dtype).removeprefix("torch."), device.type, device.index or 0))
        seen[key] = index[name] = len(seen)
        addrs.extend(key)
    if len(kinds) != 1:
        raise ValueError(f"KV caches of several element types or devices: {sorted(kinds)}")
    assert shape is not None
    dtype, device_type, device_index = kinds.pop()
    if device_type not in ("cpu", "cuda"):
        raise ValueError(
            f"KV cache on {device_type}: this connector registers cpu and cuda memory only"
        )
    layout = KvLayout(
        num_layers=len(seen),
        tensors_per_layer=shape[0],
        num_blocks=num_blocks,
        block_bytes=shape[1],
        addrs=tuple(addrs),
        block_size=block_size,
        dtype=dtype,
        device=device_type,
        device_index=device_index,
    )
    return layout, index
