"""Argument checks shared by every public constructor and method, with the documented errors.

Wrong Python types raise ``TypeError`` ("<name> only support [...], but got <type>"); integers
outside their C type range raise ``ValueError``; other invalid values raise
``LLMException(LLM_PARAM_INVALID)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from aio_datadist.status import LLMStatusCode, ParamInvalidError

__all__ = (
    "INVALID_ID",
    "check_type",
    "check_int",
    "check_int_list",
    "check_layer_range",
    "param_invalid",
)

INVALID_ID = 2**64 - 1

_RANGES: dict[str, tuple[int, int]] = {
    "uint8": (0, 2**8 - 1),
    "uint16": (0, 2**16 - 1),
    "int32": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint64": (0, 2**64 - 1),
}


def _type_names(types: tuple[type, ...]) -> str:
    return "[" + ", ".join(t.__name__ for t in types) + "]"


def check_type(name: str, value: Any, *types: type, allow_none: bool = False) -> None:
    """Raise ``TypeError`` unless ``value`` is an instance of one of ``types`` (or None)."""
    if type(value) in types or (value is None and allow_none):
        return
    # bool is an int subclass; an int parameter must not silently accept True/False.
    if isinstance(value, bool) and bool not in types:
        raise TypeError(f"{name} only support {_type_names(types)}, but got {type(value)}")
    if not isinstance(value, types):
        raise TypeError(f"{name} only support {_type_names(types)}, but got {type(value)}")


def check_int(name: str, value: Any, kind: str = "int64", *, allow_none: bool = False) -> None:
    """Check that ``value`` is an ``int`` within the range of C type ``kind``."""
    if value is None and allow_none:
        return
    check_type(name, value, int)
    lo, hi = _RANGES[kind]
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in {kind} range [{lo}, {hi}], but got {value}")


def check_int_list(
    name: str, value: Any, kind: str = "uint64", *, containers: tuple[type, ...] = (list, tuple)
) -> None:
    """Check a list/tuple of ints, each within the range of ``kind``."""
    if type(value) not in containers:
        check_type(name, value, *containers)
    lo, hi = _RANGES[kind]
    for item in value:
        # Exact ints in range (every valid item) pass without building a name.
        if type(item) is not int or not lo <= item <= hi:
            for i, each in enumerate(value):  # the slow check names the first bad item
                check_int(f"{name}[{i}]", each, kind)
            return


def param_invalid(message: str) -> NoReturn:
    """Raise ``LLMException(LLM_PARAM_INVALID)`` with ``message``."""
    raise ParamInvalidError(message, status_code=LLMStatusCode.LLM_PARAM_INVALID)


def check_layer_range(name: str, value: Any, *, allow_none: bool = True) -> None:
    """Check a layer range: a ``range`` with step 1 and ``0 <= start < stop``."""
    if value is None and allow_none:
        return
    check_type(name, value, range)
    if value.step != 1:
        param_invalid(f"{name} step must be 1, but got {value.step}")
    if not 0 <= value.start < value.stop:
        param_invalid(f"{name} must satisfy 0 <= start < stop, but got {value}")
    if value.stop > 2**32:
        raise ValueError(f"{name} must fit in uint32, but got {value}")


def all_ints(values: Iterable[Any]) -> bool:
    """True when every item is a plain int (not bool)."""
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)
