"""Tests of the native page pool (``aio_datadist._native.api.NativePool``).

The pool never touches its arena, so most tests manage a made-up address range.
"""

from __future__ import annotations

import itertools
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._native.api import NativePool, PoolStats
from aio_datadist.status import (
    LLMFailedError,
    LLMStatusCode,
    OutOfMemoryError,
    ParamInvalidError,
)

BASE = 1 << 40
PAGE_SHIFT = 12
PAGE = 1 << PAGE_SHIFT


def make_pool(pages: int, base: int = BASE, shift: int = PAGE_SHIFT) -> NativePool:
    return NativePool(base, pages << shift, shift)


def assert_empty(pool: NativePool) -> None:
    st_ = pool.stats()
    assert st_.used == 0
    assert st_.allocations == 0
    assert st_.free == st_.capacity == pool.capacity
    assert st_.largest_free == st_.capacity


def test_properties_and_initial_stats() -> None:
    pool = make_pool(16)
    assert pool.base == BASE
    assert pool.page_size == PAGE
    assert pool.capacity == 16 * PAGE
    assert pool.stats() == PoolStats(
        capacity=16 * PAGE,
        used=0,
        free=16 * PAGE,
        largest_free=16 * PAGE,
        allocations=0,
        page_size=PAGE,
    )


def test_size_is_rounded_down_to_pages() -> None:
    pool = NativePool(BASE, 5 * PAGE + PAGE - 1, PAGE_SHIFT)
    assert pool.capacity == 5 * PAGE
    assert pool.stats().capacity == 5 * PAGE


@pytest.mark.parametrize("size", [0, 1, PAGE - 1])
def test_size_below_one_page_is_rejected(size: int) -> None:
    with pytest.raises(ParamInvalidError) as info:
        NativePool(BASE, size, PAGE_SHIFT)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


@pytest.mark.parametrize("shift", [9, 31, 0, -1, 64])
def test_page_shift_out_of_range_is_rejected(shift: int) -> None:
    with pytest.raises(ParamInvalidError):
        NativePool(BASE, 1 << 32, shift)


@pytest.mark.parametrize("shift", [10, 30])
def test_page_shift_bounds_are_accepted(shift: int) -> None:
    pool = NativePool(BASE, 4 << shift, shift)
    assert pool.page_size == 1 << shift
    addr, handle = pool.alloc(1)
    assert addr == BASE
    assert pool.stats().used == 1 << shift
    pool.free(handle)
    assert_empty(pool)


def test_arena_past_end_of_address_space_is_rejected() -> None:
    with pytest.raises(ParamInvalidError):
        NativePool((1 << 64) - PAGE, 2 * PAGE, PAGE_SHIFT)
    top = NativePool((1 << 64) - 2 * PAGE, 2 * PAGE, PAGE_SHIFT)  # ends exactly at 2**64
    assert top.alloc(2 * PAGE)[0] == (1 << 64) - 2 * PAGE


@pytest.mark.parametrize("bad", [1.0, "1", None])
def test_non_int_arguments_raise_type_error(bad: object) -> None:
    with pytest.raises(TypeError):
        NativePool(bad, PAGE, PAGE_SHIFT)  # type: ignore[arg-type]
    pool = make_pool(4)
    with pytest.raises(TypeError):
        pool.alloc(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pool.free(bad)  # type: ignore[arg-type]


def test_one_byte_uses_one_page() -> None:
    pool = make_pool(8)
    _, h = pool.alloc(1)
    assert pool.stats().used == PAGE
    _, h2 = pool.alloc(PAGE)
    assert pool.stats().used == 2 * PAGE
    _, h3 = pool.alloc(PAGE + 1)
    assert pool.stats().used == 4 * PAGE
    assert pool.stats().allocations == 3
    for handle in (h, h2, h3):
        pool.free(handle)
    assert_empty(pool)


@pytest.mark.parametrize("nbytes", [0, -1, -PAGE])
def test_non_positive_alloc_is_rejected(nbytes: int) -> None:
    pool = make_pool(4)
    with pytest.raises(ParamInvalidError):
        pool.alloc(nbytes)
    assert_empty(pool)


@pytest.mark.parametrize("base", [BASE, BASE + 12345, 0, 7])
def test_addresses_are_page_aligned_relative_to_base(base: int) -> None:
    pool = make_pool(64, base=base)
    rng = random.Random(1)
    live = []
    for _ in range(20):
        addr, h = pool.alloc(rng.randint(1, 3 * PAGE))
        assert (addr - base) % PAGE == 0
        assert base <= addr < base + pool.capacity
        live.append(h)
    for h in live:
        pool.free(h)
    assert_empty(pool)


def test_exhaustion_raises_out_of_memory_and_pool_stays_usable() -> None:
    pool = make_pool(16)
    addr, whole = pool.alloc(16 * PAGE)
    assert addr == BASE
    with pytest.raises(OutOfMemoryError) as info:
        pool.alloc(1)
    err = info.value
    assert err.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
    text = str(err)
    assert "used 65536" in text and "capacity 65536" in text and "largest_free 0" in text
    assert pool.stats().allocations == 1
    pool.free(whole)
    _, h = pool.alloc(PAGE)
    with pytest.raises(OutOfMemoryError):
        pool.alloc(16 * PAGE)
    pool.free(h)
    assert_empty(pool)


def test_request_bigger_than_capacity_is_out_of_memory() -> None:
    pool = make_pool(4)
    with pytest.raises(OutOfMemoryError):
        pool.alloc(5 * PAGE)
    with pytest.raises(OutOfMemoryError):
        pool.alloc((1 << 64) - 1)
    assert_empty(pool)


def test_coalescing_freed_neighbours() -> None:
    pool = make_pool(12)
    a, ha = pool.alloc(4 * PAGE)
    b, hb = pool.alloc(4 * PAGE)
    c, hc = pool.alloc(4 * PAGE)
    assert (a, b, c) == (BASE, BASE + 4 * PAGE, BASE + 8 * PAGE)
    pool.free(ha)
    pool.free(hb)
    assert pool.stats().largest_free == 8 * PAGE
    ab, hab = pool.alloc(8 * PAGE)
    assert ab == a
    pool.free(hab)
    pool.free(hc)
    assert_empty(pool)


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_any_free_order_coalesces_fully(order: tuple[int, ...]) -> None:
    pool = make_pool(9)
    handles = [pool.alloc(3 * PAGE)[1] for _ in range(3)]
    for i in order:
        pool.free(handles[i])
    assert_empty(pool)
    assert pool.alloc(9 * PAGE)[0] == BASE


def test_fragmentation_pattern() -> None:
    pool = make_pool(64)
    blocks = [pool.alloc(PAGE) for _ in range(64)]
    with pytest.raises(OutOfMemoryError):
        pool.alloc(PAGE)
    for _, h in blocks[::2]:
        pool.free(h)
    st_ = pool.stats()
    assert st_.used == st_.free == 32 * PAGE
    assert st_.largest_free == PAGE
    with pytest.raises(OutOfMemoryError) as info:
        pool.alloc(2 * PAGE)
    assert f"largest_free {PAGE}" in str(info.value)
    # Single pages still fit in the holes, best fit keeps them from splitting elsewhere.
    refill = [pool.alloc(PAGE) for _ in range(32)]
    assert sorted(addr for addr, _ in refill) == sorted(addr for addr, _ in blocks[::2])
    for _, h in refill + blocks[1::2]:
        pool.free(h)
    assert_empty(pool)


def test_best_fit_prefers_the_tightest_hole() -> None:
    pool = make_pool(32)
    # Holes of 5, 2 and 3 pages separated by live single pages.
    layout = [5, 1, 2, 1, 3, 1]
    blocks = [pool.alloc(n * PAGE) for n in layout]
    rest = pool.alloc(pool.stats().free)
    for i in (0, 2, 4):
        pool.free(blocks[i][1])
    addr, h = pool.alloc(3 * PAGE)
    assert addr == blocks[4][0]
    addr2, h2 = pool.alloc(2 * PAGE)
    assert addr2 == blocks[2][0]
    for handle in (h, h2, rest[1], blocks[1][1], blocks[3][1], blocks[5][1]):
        pool.free(handle)
    assert_empty(pool)


def test_double_free_is_detected_and_harmless() -> None:
    pool = make_pool(8)
    _, h = pool.alloc(PAGE)
    _, keep = pool.alloc(PAGE)
    pool.free(h)
    before = pool.stats()
    with pytest.raises(ParamInvalidError) as info:
        pool.free(h)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert pool.stats() == before
    pool.free(keep)
    assert_empty(pool)


def test_stale_handle_after_slot_reuse_is_detected() -> None:
    pool = make_pool(8)
    _, old = pool.alloc(PAGE)
    pool.free(old)
    _, new = pool.alloc(PAGE)
    assert new & 0xFFFFFFFF == old & 0xFFFFFFFF  # same record, new generation
    assert new != old
    with pytest.raises(ParamInvalidError):
        pool.free(old)
    assert pool.stats().allocations == 1
    pool.free(new)
    assert_empty(pool)


def test_bogus_handles_are_rejected() -> None:
    pool = make_pool(8)
    _, h = pool.alloc(2 * PAGE)
    before = pool.stats()
    bogus = [0, 1, 12345, h ^ (1 << 32), h & 0xFFFFFFFF, (1 << 64) - 1, -1, 1 << 64]
    for handle in bogus:
        with pytest.raises(ParamInvalidError):
            pool.free(handle)
        assert pool.stats() == before
    pool.free(h)
    assert_empty(pool)


def test_handle_of_a_free_segment_is_rejected() -> None:
    pool = make_pool(8)
    _, h = pool.alloc(PAGE)
    # Record index 1 is the free tail split off by the allocation; generation 1 is its first.
    with pytest.raises(ParamInvalidError):
        pool.free((1 << 32) | 1)
    pool.free(h)
    assert_empty(pool)


def test_close_is_idempotent_and_use_after_close_fails() -> None:
    pool = make_pool(8)
    _, h = pool.alloc(PAGE)
    pool.close()
    pool.close()
    for call in (lambda: pool.alloc(PAGE), lambda: pool.free(h), pool.stats):
        with pytest.raises(LLMFailedError) as info:
            call()
        assert info.value.status_code == LLMStatusCode.LLM_FAILED


def test_many_allocations_grow_bookkeeping() -> None:
    pool = NativePool(BASE, 20000 << 10, 10)
    handles = [pool.alloc(1)[1] for _ in range(20000)]
    assert pool.stats().free == 0
    random.Random(3).shuffle(handles)
    for h in handles:
        pool.free(h)
    assert_empty(pool)


def test_concurrent_alloc_free_from_four_threads() -> None:
    pool = make_pool(4096)
    live: dict[int, int] = {}  # addr -> end, over all threads
    lock = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[tuple[int, int]] = []
        try:
            barrier.wait()
            for _ in range(3000):
                if mine and (rng.random() < 0.5 or len(mine) > 64):
                    addr, h = mine.pop(rng.randrange(len(mine)))
                    with lock:
                        del live[addr]
                    pool.free(h)
                    continue
                size = rng.randint(1, 8 * PAGE)
                try:
                    addr, h = pool.alloc(size)
                except OutOfMemoryError:
                    continue
                end = addr + -(-size // PAGE) * PAGE
                with lock:
                    for a, e in live.items():
                        assert end <= a or e <= addr, "overlapping allocations"
                    live[addr] = end
                mine.append((addr, h))
            for addr, h in mine:
                with lock:
                    del live[addr]
                pool.free(h)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert pool.stats().used == 0
    assert_empty(pool)


# --- model-based check --------------------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(min_value=1, max_value=12 * PAGE)),
        st.tuples(st.just("free"), st.integers(min_value=0, max_value=1 << 16)),
        st.tuples(st.just("bogus"), st.integers(min_value=0, max_value=(1 << 64) - 1)),
    ),
    max_size=120,
)


def _largest_gap(live: dict[int, tuple[int, int]], base: int, capacity: int) -> int:
    """Biggest free run implied by the live ranges: with full coalescing it is exact."""
    edges = sorted(live.values())
    cursor, best = base, 0
    for addr, size in edges:
        best = max(best, addr - cursor)
        cursor = addr + size
    return max(best, base + capacity - cursor)


@settings(max_examples=100, deadline=None)
@given(ops=_ops, pages=st.integers(min_value=1, max_value=64))
def test_random_sequences_match_a_python_model(ops: list[tuple[str, int]], pages: int) -> None:
    pool = make_pool(pages)
    live: dict[int, tuple[int, int]] = {}  # handle -> (addr, rounded size)
    freed: list[int] = []
    for kind, arg in ops:
        if kind == "alloc":
            rounded = -(-arg // PAGE) * PAGE
            fits = rounded <= _largest_gap(live, BASE, pool.capacity)
            try:
                addr, h = pool.alloc(arg)
            except OutOfMemoryError:
                assert not fits, "OOM although a free run was big enough"
                continue
            assert fits
            assert (addr - BASE) % PAGE == 0
            assert addr >= BASE and addr + rounded <= BASE + pool.capacity
            assert h not in live
            live[h] = (addr, rounded)
        elif kind == "free" and live:
            h = list(live)[arg % len(live)]
            pool.free(h)
            del live[h]
            freed.append(h)
        elif kind == "free" and freed:
            with pytest.raises(ParamInvalidError):
                pool.free(freed[arg % len(freed)])
        elif kind == "bogus" and arg not in live:
            with pytest.raises(ParamInvalidError):
                pool.free(arg)

        ranges = sorted(live.values())
        for (a, sa), (b, _) in itertools.pairwise(ranges):
            assert a + sa <= b, "overlapping live ranges"
        stats = pool.stats()
        assert stats.used == sum(size for _, size in live.values())
        assert stats.allocations == len(live)
        assert stats.free == stats.capacity - stats.used
        assert stats.largest_free == _largest_gap(live, BASE, pool.capacity)
    for h in live:
        pool.free(h)
    assert_empty(pool)


def test_fit_behind_many_too_small_fragments_is_found() -> None:
    """A fit listed after more than the scan limit of too-small holes of its class."""
    pool = make_pool(4 + 40 * 3 + 8)
    target = pool.alloc(3 * PAGE)
    live = [pool.alloc(PAGE)[1]]
    small = []
    for _ in range(40):
        small.append(pool.alloc(2 * PAGE)[1])
        live.append(pool.alloc(PAGE)[1])
    live.append(pool.alloc(pool.stats().free)[1])
    pool.free(target[1])  # freed first: it ends up last on its list
    for h in small:
        pool.free(h)
    assert pool.stats().largest_free == 3 * PAGE
    addr, h = pool.alloc(3 * PAGE)
    assert addr == target[0]
    pool.free(h)
    for h in live:
        pool.free(h)
    assert_empty(pool)
