"""``DataType``: element types of cache tensors, their sizes and numpy equivalents.

The module attributes ``dtype_to_np_dtype``, ``np_dtype_to_dtype`` and ``valid_np_dtypes``
are built on first access, as in the reference package (BF16 maps to ``float16`` there).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ("DataType", "element_size")


class DataType(Enum):
    """Element type of a cache tensor; values are those of ``ge::DataType``."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_STRING = 13
    DT_BF16 = 27


_SIZES: dict[DataType, int] = {
    DataType.DT_FLOAT: 4,
    DataType.DT_FLOAT16: 2,
    DataType.DT_INT8: 1,
    DataType.DT_INT32: 4,
    DataType.DT_UINT8: 1,
    DataType.DT_INT16: 2,
    DataType.DT_UINT16: 2,
    DataType.DT_UINT32: 4,
    DataType.DT_INT64: 8,
    DataType.DT_UINT64: 8,
    DataType.DT_DOUBLE: 8,
    DataType.DT_BOOL: 1,
    DataType.DT_STRING: 8,
    DataType.DT_BF16: 2,
}


def element_size(data_type: DataType) -> int:
    """Bytes per element of ``data_type`` (``DT_STRING`` counts as a pointer, 8 bytes)."""
    return _SIZES[data_type]


_NP_NAMES: dict[DataType, str] = {
    DataType.DT_FLOAT: "float32",
    DataType.DT_FLOAT16: "float16",
    DataType.DT_BF16: "float16",
    DataType.DT_INT8: "int8",
    DataType.DT_INT16: "int16",
    DataType.DT_UINT16: "uint16",
    DataType.DT_UINT8: "uint8",
    DataType.DT_INT32: "int32",
    DataType.DT_INT64: "int64",
    DataType.DT_UINT32: "uint32",
    DataType.DT_UINT64: "uint64",
    DataType.DT_BOOL: "bool",
    DataType.DT_DOUBLE: "float64",
}


def __getattr__(name: str) -> Any:
    import numpy as np

    if name == "dtype_to_np_dtype":
        return {dt: np.dtype(n) for dt, n in _NP_NAMES.items()}
    if name == "np_dtype_to_dtype":
        return {np.dtype(n): dt for dt, n in _NP_NAMES.items() if dt is not DataType.DT_BF16}
    if name == "valid_np_dtypes":
        return [np.dtype(n) for dt, n in _NP_NAMES.items() if dt is not DataType.DT_BF16]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
