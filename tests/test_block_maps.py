"""The block maps of ``copy_blocks`` and ``swap_blocks``: what the planner makes of them
(each destination once, from the last source that names it) and the errors of bad items,
the same on the checked-at-once path for long maps and the item-by-item one."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._engine.plan import copy_map, swap_map

BLOCK = st.integers(0, 40)
#: Items a caller may get wrong: negatives, out of range, bools, floats, numpy ints.
ODD = st.one_of(
    st.integers(-3, -1), st.just(2**64), st.booleans(), st.floats(0, 3), st.just(np.int64(1))
)


def reference(pairs: list[tuple[int, int]]) -> dict[int, int]:
    last: dict[int, int] = {}
    for src, dst in pairs:
        last[dst] = src
    return last


def as_dict(srcs: Any, dsts: Any) -> dict[int, int]:
    return {int(d): int(s) for s, d in zip(srcs, dsts, strict=True)}


def outcome(fn: Any, info: dict[Any, Any]) -> tuple[str, Any]:
    try:
        srcs, dsts, overlap = fn(info)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", (as_dict(srcs, dsts), overlap)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(BLOCK, st.lists(BLOCK, max_size=4), max_size=30))
def test_copy_map_keeps_the_last_source_of_each_destination(info: dict[int, list[int]]) -> None:
    srcs, dsts, overlap = copy_map(info)
    want = reference([(s, d) for s, ds in info.items() for d in ds])
    assert as_dict(srcs, dsts) == want and len(dsts) == len(want)
    assert overlap == bool(set(want) & set(want.values()))
    assert srcs.dtype == dsts.dtype == np.uint64


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(BLOCK, BLOCK, max_size=30))
def test_swap_map_keeps_the_last_source_of_each_destination(info: dict[int, int]) -> None:
    srcs, dsts, _ = swap_map(info)
    assert as_dict(srcs, dsts) == reference(list(info.items()))


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.one_of(BLOCK, ODD), st.lists(st.one_of(BLOCK, ODD), max_size=3), max_size=8)
)
def test_a_bad_item_anywhere_is_named_whatever_the_path(info: dict[Any, list[Any]]) -> None:
    # The reference: every item checked one by one, as the documented errors say.
    kind, detail = outcome(copy_map, info)
    bad = [
        v
        for v in (*info, *(d for ds in info.values() for d in ds))
        if type(v) is not int or not 0 <= v < 2**64
    ]
    if not bad:
        assert kind == "ok"
    else:
        assert kind in ("TypeError", "ValueError"), detail


@pytest.mark.parametrize(
    ("info", "error"),
    [
        ({0: [1], 5: [2, -1]}, "copy_block_info[5][1] must be in uint64 range"),
        ({0: [1], -2: [3]}, "copy_block_info key must be in uint64 range"),
        ({0: [True]}, "copy_block_info[0][0] only support [int]"),
        ({0: 1}, "copy_block_info[0] only support [list, tuple]"),
    ],
)
def test_copy_map_errors_name_the_item(info: dict[Any, Any], error: str) -> None:
    with pytest.raises((TypeError, ValueError)) as exc:
        copy_map(info)
    assert error in str(exc.value)


def test_a_long_map_is_checked_at_once_and_matches_the_reference() -> None:
    rng = np.random.default_rng(3)
    src = [int(v) for v in rng.permutation(4096)]
    dst = [int(v) for v in 4096 + rng.permutation(4096)]
    info = {s: [d, (d + 1) % 8192] for s, d in zip(src, dst, strict=True)}
    srcs, dsts, overlap = copy_map(info)
    assert as_dict(srcs, dsts) == reference([(s, d) for s, ds in info.items() for d in ds])
    assert overlap
    with pytest.raises(ValueError, match=r"copy_block_info\[\d+\]\[1\] must be in uint64"):
        copy_map({**info, 7: [1, 2**64]})
