"""AddressRanges: bulk lookups of address ranges, row by row and in one pass alike."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._runtime.ranges import AddressRanges

U64_MAX = (1 << 64) - 1


def reference(ranges: dict[int, int], addr: int, nbytes: int) -> bool:
    return any(start <= addr and addr + nbytes <= end for start, end in ranges.items())


@st.composite
def layouts(draw: st.DrawFn) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """Disjoint ranges, and rows around and across them (some wrapping past 2**64)."""
    cuts = sorted(draw(st.sets(st.integers(0, 1 << 20), min_size=0, max_size=12)))
    base = draw(st.sampled_from([0, 1 << 40, U64_MAX - (1 << 21)]))
    ranges = {base + a: base + b for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b}
    points = [base + c for c in cuts] + [0, U64_MAX]
    rows = draw(
        st.lists(
            st.tuples(
                st.one_of(st.sampled_from(points), st.integers(0, U64_MAX)),
                st.one_of(st.integers(0, 1 << 12), st.integers(0, U64_MAX)),
            ),
            min_size=0,
            max_size=20,
        )
    )
    return ranges, rows


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_covers_matches_the_reference(layout: tuple[dict[int, int], list[tuple[int, int]]]) -> None:
    ranges, rows = layout
    known = AddressRanges()
    for start, end in ranges.items():
        known.add(start, end - start)
    addrs = np.array([a for a, _ in rows], dtype=np.uint64)
    lengths = np.array([n for _, n in rows], dtype=np.uint64)
    got = known.covers(addrs, lengths)
    assert got.dtype == np.bool_ and got.shape == (len(rows),)
    assert got.tolist() == [reference(ranges, a, n) for a, n in rows]
    for addr, _ in rows:
        found = known.find(addr)
        expected = next(((s, e - s) for s, e in ranges.items() if s <= addr < e), None)
        assert found == expected


def test_changes_are_seen_by_later_lookups() -> None:
    known = AddressRanges()
    one = np.array([4096], dtype=np.uint64), np.array([16], dtype=np.uint64)
    many = np.full(16, 4096, dtype=np.uint64), np.full(16, 16, dtype=np.uint64)
    assert not known.covers(*one).any() and not known.covers(*many).any()
    known.add(4096, 4096)
    assert known.covers(*one).all() and known.covers(*many).all()
    assert known.remove(4096) == 4096 and known.remove(4096) is None
    assert not known.covers(*one).any() and not known.covers(*many).any()
    assert len(known) == 0
