"""Array views of cache tensors: numpy always, torch when it is installed (never imported early)."""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from aio_datadist.data_type import DataType
from aio_datadist.status import LLMStatusCode, ParamInvalidError

__all__ = ("numpy_dtype", "numpy_view", "torch_view")

# BF16 has no numpy type: its views hold the raw 16-bit words.
_NUMPY: dict[DataType, str] = {
    DataType.DT_FLOAT: "<f4",
    DataType.DT_FLOAT16: "<f2",
    DataType.DT_BF16: "<u2",
    DataType.DT_INT8: "i1",
    DataType.DT_UINT8: "u1",
    DataType.DT_INT16: "<i2",
    DataType.DT_UINT16: "<u2",
    DataType.DT_INT32: "<i4",
    DataType.DT_UINT32: "<u4",
    DataType.DT_INT64: "<i8",
    DataType.DT_UINT64: "<u8",
    DataType.DT_DOUBLE: "<f8",
    DataType.DT_BOOL: "?",
    DataType.DT_STRING: "<u8",
}

_TORCH: dict[DataType, str] = {
    DataType.DT_FLOAT: "float32",
    DataType.DT_FLOAT16: "float16",
    DataType.DT_BF16: "bfloat16",
    DataType.DT_INT8: "int8",
    DataType.DT_UINT8: "uint8",
    DataType.DT_INT16: "int16",
    DataType.DT_UINT16: "uint16",
    DataType.DT_INT32: "int32",
    DataType.DT_UINT32: "uint32",
    DataType.DT_INT64: "int64",
    DataType.DT_UINT64: "uint64",
    DataType.DT_DOUBLE: "float64",
    DataType.DT_BOOL: "bool",
}


def numpy_dtype(data_type: DataType) -> np.dtype[Any]:
    """The numpy dtype used for views of ``data_type`` (BF16: raw ``uint16`` words)."""
    return np.dtype(_NUMPY[data_type])


class _Region:
    """Exposes host memory through ``__array_interface__`` and keeps its owner alive."""

    __slots__ = ("__array_interface__", "_owner")

    def __init__(self, addr: int, shape: tuple[int, ...], typestr: str, owner: object) -> None:
        self.__array_interface__ = {
            "data": (addr, False),
            "shape": shape,
            "typestr": typestr,
            "version": 3,
        }
        self._owner = owner


def numpy_view(
    addr: int, shape: tuple[int, ...], data_type: DataType, owner: object = None
) -> np.ndarray[Any, np.dtype[Any]]:
    """A writable numpy array over host memory at ``addr``; ``owner`` is kept alive by it."""
    if addr == 0:
        raise ParamInvalidError(
            "cannot view a released cache (tensor address 0)",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        )
    return np.asarray(_Region(addr, tuple(shape), _NUMPY[data_type], owner))


def torch_view(array: np.ndarray[Any, np.dtype[Any]], data_type: DataType) -> Any:
    """A torch tensor sharing ``array``'s memory, with torch's own dtype for ``data_type``.

    :raises ImportError: torch is not installed.
    """
    torch = importlib.import_module("torch")
    if data_type not in _TORCH:
        raise TypeError(f"{data_type} has no torch equivalent")
    tensor = torch.from_numpy(array)
    if data_type is DataType.DT_BF16:
        tensor = tensor.view(torch.bfloat16)
    elif data_type is DataType.DT_UINT16:
        tensor = tensor.view(torch.uint16)
    return tensor
