"""Memory-row tables: pairing two splits of the same bytes, and the small-table fast paths."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._engine import access as access_module
from aio_datadist._engine.access import Access, Target
from aio_datadist._memory.rows import pair_rows, small_rows


def _table(addrs: list[int], lens: list[int]) -> np.ndarray:
    return np.array(list(zip(addrs, lens, strict=True)), dtype=np.uint64).reshape(-1, 2)


def _byte_map(dst: np.ndarray, src: np.ndarray) -> list[tuple[int, int]]:
    """(dst byte address, src byte address) for every payload byte, walked one by one."""
    d = [int(a) + i for a, n in dst.tolist() for i in range(int(n))]
    s = [int(a) + i for a, n in src.tolist() for i in range(int(n))]
    return list(zip(d, s, strict=True))


def _ops_map(ops: np.ndarray) -> list[tuple[int, int]]:
    return [(int(d) + i, int(s) + i) for d, s, n in ops.tolist() for i in range(int(n))]


lengths = st.lists(st.integers(0, 7), min_size=0, max_size=8)


@settings(max_examples=200, deadline=None)
@given(lengths, lengths, st.booleans())
def test_pair_rows_maps_every_byte_once(d_lens: list[int], s_lens: list[int], same: bool) -> None:
    if same:
        s_lens = list(d_lens)
    elif sum(d_lens) != sum(s_lens):
        s_lens = [*s_lens, sum(d_lens) - sum(s_lens)] if sum(d_lens) > sum(s_lens) else d_lens
    dst = _table([10_000 + 100 * i for i in range(len(d_lens))], d_lens)
    src = _table([90_000 + 100 * i for i in range(len(s_lens))], s_lens)
    ops = pair_rows(dst, src)
    assert ops.dtype == np.uint64 and ops.shape[1] == 3
    assert (ops[:, 2] > 0).all()
    assert _ops_map(ops) == _byte_map(dst, src)


def test_pair_rows_refuses_different_sizes() -> None:
    with pytest.raises(ValueError, match="hold 4 bytes"):
        pair_rows(_table([0], [4]), _table([0], [5]))


def test_small_rows_matches_the_vectorised_layout() -> None:
    bases, blocks, block, seg = [1000, 50_000], [3, 0, 7], 64, 48
    got = small_rows(bases, blocks, block, seg)
    want = np.array([[b + k * block, seg] for b in bases for k in blocks], dtype=np.uint64).reshape(
        -1, 2
    )
    np.testing.assert_array_equal(got, want)
    assert got.flags.c_contiguous and got.dtype == np.uint64


@pytest.mark.parametrize("tail", [0, 16])
def test_access_rows_of_blocks_are_the_python_rows(tail: int) -> None:
    access = Access(
        Target.BLOCKS_KEY,
        tensor_start=1,
        tensor_count=2,
        seg_bytes=64,
        tail_bytes=tail,
        blocks=np.array([5, 1, 2], dtype=np.uint64),
    )
    addrs = (0x1000, 0x9000, 0x20000, 0x40000)
    got = access_module.access_rows(addrs, 64, 8, access, 0)
    want = small_rows(addrs[1:3], [5, 1, 2], 64, 64)
    want[2::3, 1] = access.last_bytes
    np.testing.assert_array_equal(got, want)
    assert got.flags.c_contiguous and got.dtype == np.uint64
    assert int(got[:, 1].sum()) == access.nbytes
