"""One bounds check per access form: a blocks access is checked by ``dd_blocks_check`` on every
path (Python serving and one-sided transfers through ``access_rows``, the native serving path,
``block_rows`` and ``vm_copy_blocks``), with the refusals the Python path has always given."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._engine.access import Access, Target, access_rows
from aio_datadist._native import api
from aio_datadist.status import LLMStatusCode, ParamInvalidError

ADDRS = (0x10000, 0x90000, 0x120000, 0x400000)
BLOCK_BYTES = 64
NUM_BLOCKS = 8


def reference(
    addrs: tuple[int, ...], block_bytes: int, num_blocks: int, access: Access
) -> list[tuple[int, int]] | str:
    """The rows of a blocks access, or the refusal, as the rules read in plain Python."""
    start, count = access.tensor_start, access.tensor_count
    seg, last = access.seg_bytes, access.last_bytes
    if count < 1 or start + count > len(addrs):
        return f"tensors [{start}, {start + count}) are outside the cache's {len(addrs)} tensors"
    if seg < 1 or seg > block_bytes or last > block_bytes:
        return f"block segments of {seg}/{last} bytes do not fit blocks of {block_bytes} bytes"
    blocks = access.blocks.tolist()
    for block in blocks:
        if block >= num_blocks:
            return f"block index {block} is outside [0, {num_blocks})"
    return [
        (base + block * block_bytes, last if k == len(blocks) - 1 else seg)
        for base in addrs[start : start + count]
        for k, block in enumerate(blocks)
    ]


def blocks_access(start: int, count: int, blocks: list[int], seg: int, tail: int) -> Access:
    return Access(
        Target.BLOCKS_KEY,
        tensor_start=start,
        tensor_count=count,
        seg_bytes=seg,
        tail_bytes=tail,
        blocks=np.asarray(blocks, dtype=np.uint64),
    )


@settings(max_examples=400)
@given(
    start=st.integers(0, 5),
    count=st.integers(0, 5),
    blocks=st.lists(
        st.one_of(st.integers(0, NUM_BLOCKS + 1), st.just(2**64 - 1)), min_size=1, max_size=6
    ),
    seg=st.integers(0, BLOCK_BYTES + 1),
    tail=st.integers(0, BLOCK_BYTES + 1),
)
def test_access_rows_keep_the_python_rules_and_messages(
    start: int, count: int, blocks: list[int], seg: int, tail: int
) -> None:
    access = blocks_access(start, count, blocks, seg, tail)
    want = reference(ADDRS, BLOCK_BYTES, NUM_BLOCKS, access)
    if isinstance(want, str):
        with pytest.raises(ParamInvalidError) as info:
            access_rows(ADDRS, BLOCK_BYTES, NUM_BLOCKS, access, 0)
        assert str(info.value) == want
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        return
    got = access_rows(ADDRS, BLOCK_BYTES, NUM_BLOCKS, access, 0)
    assert got.dtype == np.uint64 and got.flags.c_contiguous
    assert [tuple(r) for r in got.tolist()] == want


def test_blocks_that_wrap_around_the_address_space_are_refused() -> None:
    addrs = (2**64 - 5 * BLOCK_BYTES,)  # block 4 would end at 2**64
    fits = blocks_access(0, 1, [3], BLOCK_BYTES, 0)
    assert access_rows(addrs, BLOCK_BYTES, NUM_BLOCKS, fits, 0).tolist() == [
        [2**64 - 2 * BLOCK_BYTES, BLOCK_BYTES]
    ]
    with pytest.raises(ParamInvalidError, match="wrap around the address space"):
        access_rows(addrs, BLOCK_BYTES, NUM_BLOCKS, blocks_access(0, 1, [4], BLOCK_BYTES, 0), 0)
    with pytest.raises(ParamInvalidError, match="wrap around the address space"):
        access_rows((0,), BLOCK_BYTES, NUM_BLOCKS, blocks_access(0, 1, [0], BLOCK_BYTES, 0), 0)


def test_a_field_outside_u64_is_refused_not_raised_as_overflow() -> None:
    access = blocks_access(0, 1, [0], BLOCK_BYTES, 0)
    with pytest.raises(ParamInvalidError):
        api.blocks_access_rows(ADDRS, BLOCK_BYTES, NUM_BLOCKS, 0, 1, access.blocks, 2**64, 0)


@settings(max_examples=200)
@given(
    blocks=st.lists(st.integers(0, NUM_BLOCKS + 1), min_size=1, max_size=4),
    seg=st.integers(0, BLOCK_BYTES + 1),
    count=st.integers(1, 3),
)
def test_block_rows_refuse_what_access_rows_refuse(blocks: list[int], seg: int, count: int) -> None:
    layout = api.BlockLayout(ADDRS, BLOCK_BYTES, NUM_BLOCKS)
    access = blocks_access(1, count, blocks, seg, 0)
    try:
        want = access_rows(ADDRS, BLOCK_BYTES, NUM_BLOCKS, access, 0)
    except ParamInvalidError:
        with pytest.raises(ParamInvalidError):
            api.block_rows(layout, 1, count, blocks, seg)
        return
    np.testing.assert_array_equal(api.block_rows(layout, 1, count, blocks, seg), want)
