"""Tests of the native copies (``copy``, ``copy_batch``) against the pure-Python reference,
and of host memory."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aio_datadist._native
from aio_datadist._native import api, features, impl
from aio_datadist._native._reference import copy_batch_reference
from aio_datadist.status import LLMException, LLMStatusCode, OutOfMemoryError, ParamInvalidError

U8 = npt.NDArray[np.uint8]
Ops = npt.NDArray[np.uint64]
MiB = 1 << 20


def addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def random_bytes(n: int, seed: int) -> U8:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def make_ops(rows: list[tuple[int, int, int]]) -> Ops:
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def check_against_reference(
    src: U8, rows: list[tuple[int, int, int]], threads: int, dst_size: int
) -> None:
    """Run ``rows`` (dst offset, src offset, nbytes) natively and in the reference."""
    ours = np.zeros(dst_size, np.uint8)
    ref = np.zeros(dst_size, np.uint8)
    api.copy_batch(make_ops([(addr(ours) + d, addr(src) + s, n) for d, s, n in rows]), threads)
    copy_batch_reference(make_ops([(addr(ref) + d, addr(src) + s, n) for d, s, n in rows]))
    assert np.array_equal(ours, ref)


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = api.copy_threads()
    yield
    api.set_copy_threads(before)


def test_implementation_and_features() -> None:
    assert impl == "cffi"
    assert {"pool", "copy_batch", "copy_threads", "hostmem"} <= features
    assert api.SPLIT_THRESHOLD > 0


# --- copy -------------------------------------------------------------------------------


def test_single_copy() -> None:
    src = random_bytes(10_000, 1)
    dst = np.zeros_like(src)
    api.copy(addr(dst) + 3, addr(src) + 5, 9000)
    assert np.array_equal(dst[3:9003], src[5:9005])
    assert not dst[:3].any() and not dst[9003:].any()


def test_single_copy_of_zero_bytes_touches_nothing() -> None:
    api.copy(0, 0, 0)


@pytest.mark.parametrize(("dst", "src", "n"), [(0, 8, 8), (8, 0, 8), (-1, 8, 8), (8, 8, -1)])
def test_single_copy_bad_arguments(dst: int, src: int, n: int) -> None:
    with pytest.raises(ParamInvalidError):
        api.copy(dst, src, n)


# --- fill -------------------------------------------------------------------------------


def test_fill_sets_exactly_the_range() -> None:
    buf = np.full(10_000, 0xAB, np.uint8)
    api.fill(addr(buf) + 3, 0, 9000)
    assert not buf[3:9003].any()
    assert bool((buf[:3] == 0xAB).all()) and bool((buf[9003:] == 0xAB).all())
    api.fill(addr(buf), 0x5C, 2)
    assert buf[:3].tolist() == [0x5C, 0x5C, 0xAB]
    api.fill(0, 0, 0)  # nothing to set


@pytest.mark.parametrize(
    ("at", "value", "n"),
    [(0, 0, 8), (8, -1, 8), (8, 256, 8), (-1, 0, 8), (8, 0, -1), (2**64 - 4, 0, 8)],
)
def test_fill_bad_arguments(at: int, value: int, n: int) -> None:
    with pytest.raises(ParamInvalidError):
        api.fill(at, value, n)
    with pytest.raises(TypeError):
        api.fill(8, 0.0, 8)  # type: ignore[arg-type]


# --- copy_batch against the reference ----------------------------------------------------

SLOT = 256
SLOTS = 64


@st.composite
def small_batches(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Rows over SLOTS slots of SLOT bytes: unique destination slots, so no overlap."""
    n = draw(st.integers(min_value=0, max_value=SLOTS))
    dst_slots = draw(st.permutations(range(SLOTS)))[:n]
    rows = []
    for d in dst_slots:
        length = draw(st.sampled_from([0, 1, 7, 64, SLOT]) | st.integers(0, SLOT))
        s = draw(st.integers(0, SLOTS * SLOT - length))
        rows.append((d * SLOT, s, length))
    return rows


@settings(max_examples=100, deadline=None)
@given(rows=small_batches(), threads=st.sampled_from([0, 1, 2, 3]))
def test_random_small_batches_match_reference(
    rows: list[tuple[int, int, int]], threads: int
) -> None:
    src = random_bytes(SLOTS * SLOT, 2)
    check_against_reference(src, rows, threads, SLOTS * SLOT)


BIG_BLOCK = 256 << 10
BIG_BLOCKS = 24  # 6 MiB, above SPLIT_THRESHOLD


@st.composite
def big_batches(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    """Block-sized rows, often consecutive (merged) and cut at odd lengths."""
    order = draw(st.permutations(range(BIG_BLOCKS)))
    identity = draw(st.booleans())
    rows = []
    for i, d in enumerate(range(BIG_BLOCKS) if identity else order):
        s = i if identity else order[(i * 7) % BIG_BLOCKS]
        length = draw(st.sampled_from([BIG_BLOCK, BIG_BLOCK, 0, BIG_BLOCK - 1, 4097]))
        rows.append((d * BIG_BLOCK, s * BIG_BLOCK, length))
    return rows


@settings(max_examples=25, deadline=None)
@given(rows=big_batches(), threads=st.sampled_from([0, 2, 3, 8]))
def test_random_big_batches_match_reference(rows: list[tuple[int, int, int]], threads: int) -> None:
    src = random_bytes(BIG_BLOCKS * BIG_BLOCK, 3)
    check_against_reference(src, rows, threads, BIG_BLOCKS * BIG_BLOCK)


def test_adjacent_rows_are_merged_and_copied_right() -> None:
    src = random_bytes(64 * 1024, 4)
    # Rows continuing each other on both sides, then a row that continues only dst.
    rows = [(i * 1024, i * 1024, 1024) for i in range(16)]
    rows.append((16 * 1024, 40 * 1024, 1024))
    rows += [(17 * 1024 + i * 100, 41 * 1024 + i * 100, 100) for i in range(10)]
    check_against_reference(src, rows, 1, 64 * 1024)


def test_zero_length_rows_are_skipped() -> None:
    src = random_bytes(4096, 5)
    rows = [(0, 0, 0), (0, 100, 50), (50, 0, 0), (50, 150, 50), (0, 0, 0)]
    # Null addresses are fine on zero-length rows.
    dst = np.zeros(4096, np.uint8)
    ops = make_ops([(addr(dst) + d, addr(src) + s, n) for d, s, n in rows] + [(0, 0, 0)])
    api.copy_batch(ops)
    assert np.array_equal(dst[:100], src[100:200])
    assert not dst[100:].any()
    check_against_reference(src, rows, 2, 4096)


def test_empty_batch() -> None:
    api.copy_batch(np.empty((0, 3), np.uint64))


@pytest.mark.parametrize("threads", [2, 3, 8, api.MAX_COPY_THREADS])
def test_one_range_larger_than_threshold_is_split(threads: int) -> None:
    n = 2 * api.SPLIT_THRESHOLD + 12345
    src = random_bytes(n + 64, 6)
    check_against_reference(src, [(5, 7, n)], threads, n + 64)


@pytest.mark.parametrize("threads", [2, 4])
def test_split_points_on_row_boundaries(threads: int) -> None:
    # Four 1 MiB rows that do not continue each other: slices start exactly at row starts.
    src = random_bytes(4 * MiB, 7)
    rows = [(i * MiB, (3 - i) * MiB, MiB) for i in range(4)]
    rows.insert(2, (0, 0, 0))
    check_against_reference(src, rows, threads, 4 * MiB)


def test_batch_above_threshold_with_many_small_rows() -> None:
    block = 4096
    count = (api.SPLIT_THRESHOLD // block) * 2 + 3
    src = random_bytes(count * block, 8)
    perm = np.random.default_rng(8).permutation(count)
    rows = [(int(d) * block, i * block, block) for i, d in enumerate(perm)]
    check_against_reference(src, rows, 2, count * block)


def test_concurrent_batches_from_several_python_threads() -> None:
    size = 3 * api.SPLIT_THRESHOLD
    block = 64 << 10
    nblocks = size // block
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            src = random_bytes(size, seed)
            dst = np.zeros(size, np.uint8)
            for _ in range(5):
                perm = rng.permutation(nblocks)
                ops = make_ops(
                    [
                        (addr(dst) + int(d) * block, addr(src) + i * block, block)
                        for i, d in enumerate(perm)
                    ]
                )
                api.copy_batch(ops, threads=2)
                expect = src.reshape(nblocks, block)[np.argsort(perm)].reshape(-1)
                assert np.array_equal(dst, expect)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# --- argument checks ---------------------------------------------------------------------


def test_bad_ops_types() -> None:
    good = np.zeros((1, 3), np.uint64)
    for bad in (
        good.tolist(),
        good.astype(np.int64),
        good.astype(np.float64),
        good.astype(">u8"),
        good.astype(np.uint32),
    ):
        with pytest.raises(TypeError):
            api.copy_batch(bad)  # type: ignore[arg-type]


def test_bad_ops_shapes_and_layouts() -> None:
    for bad in (
        np.zeros(3, np.uint64),
        np.zeros((2, 2), np.uint64),
        np.zeros((2, 4), np.uint64),
        np.zeros((1, 3, 1), np.uint64),
        np.zeros((4, 3), np.uint64)[::2],
        np.asfortranarray(np.zeros((4, 3), np.uint64)),
        np.zeros((3, 4), np.uint64)[:, :3],
        np.frombuffer(bytearray(8 * 3 + 1), np.uint64, count=3, offset=1).reshape(1, 3),
    ):
        with pytest.raises(ValueError):
            api.copy_batch(bad)


def test_ops_array_is_not_copied_or_changed() -> None:
    src = random_bytes(8192, 9)
    dst = np.zeros(8192, np.uint8)
    ops = make_ops([(addr(dst) + i * 1024, addr(src) + i * 1024, 1024) for i in range(8)])
    before = ops.copy()
    ops.flags.writeable = False  # read-only arrays are accepted as they are
    api.copy_batch(ops)
    assert np.array_equal(ops, before)
    assert np.array_equal(dst, src)


def test_null_address_rejects_whole_batch_before_copying() -> None:
    src = random_bytes(4096, 10)
    dst = np.zeros(4096, np.uint8)
    ops = make_ops([(addr(dst), addr(src), 1024), (0, addr(src), 16)])
    with pytest.raises(ParamInvalidError) as info:
        api.copy_batch(ops)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert not dst.any()


def test_wrapping_row_is_rejected() -> None:
    src = random_bytes(16, 11)
    with pytest.raises(ParamInvalidError):
        api.copy_batch(make_ops([((1 << 64) - 8, addr(src), 16)]))


@pytest.mark.parametrize("threads", [-1, api.MAX_COPY_THREADS + 1])
def test_bad_thread_counts(threads: int) -> None:
    with pytest.raises(ParamInvalidError):
        api.copy_batch(np.zeros((1, 3), np.uint64), threads)


def _python(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter that imports this checkout's package."""
    root = Path(aio_datadist._native.__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


# --- thread settings ---------------------------------------------------------------------


def test_default_thread_count() -> None:
    # Run in a fresh process so no other test's setting leaks in.
    code = "from aio_datadist._native import api; print(api.copy_threads())"
    assert int(_python(code)) == min(os.cpu_count() or 1, 8)


@pytest.mark.usefixtures("restore_threads")
def test_set_copy_threads() -> None:
    api.set_copy_threads(1)
    assert api.copy_threads() == 1
    src = random_bytes(3 * api.SPLIT_THRESHOLD, 12)
    check_against_reference(src, [(0, 0, src.size)], 0, src.size)
    api.set_copy_threads(3)
    assert api.copy_threads() == 3
    check_against_reference(src, [(0, 0, src.size)], 0, src.size)
    for bad in (0, -1, api.MAX_COPY_THREADS + 1):
        with pytest.raises(ParamInvalidError):
            api.set_copy_threads(bad)
    assert api.copy_threads() == 3


# --- process life ------------------------------------------------------------------------


def _run_script(body: str) -> None:
    script = textwrap.dedent(
        """
        import numpy as np
        from aio_datadist._native import api
        src = np.arange(8 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        def batch():
            dst[:] = 0
            ops = np.array([[dst.ctypes.data, src.ctypes.data, src.size]], np.uint64)
            api.copy_batch(ops, threads=4)
            assert (dst == src).all()
        """
    ) + textwrap.dedent(body)
    _python(script)


def test_process_with_workers_exits_cleanly() -> None:
    _run_script("batch()\n")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_can_copy() -> None:
    _run_script(
        """
        import os
        batch()
        pid = os.fork()
        if pid == 0:
            try:
                batch()
            finally:
                os._exit(0 if (dst == src).all() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        batch()
        """
    )


# --- host memory -------------------------------------------------------------------------


def _view(address: int, n: int) -> U8:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address))


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
@pytest.mark.parametrize("n", [1, 4096, 12345, 100_000, 8 * MiB + 1])
def test_host_alloc_is_aligned_zeroed_and_writable(n: int, shared: bool) -> None:
    page = api.host_page_size()
    fd = -1
    if shared:
        a, fd = api.host_alloc_shared(n)
    else:
        a = api.host_alloc(n)
    try:
        # aligned to the largest power of two (up to 2 MiB) that fits in it, whatever
        # address the kernel would pick: a pool's pages start aligned
        length = -(-n // page) * page
        align = page
        while align < 2 * MiB and align * 2 <= length:
            align *= 2
        assert a % align == 0
        view = _view(a, n)
        assert not view.any()
        view[:] = 0xAB
        src = random_bytes(n, 13)
        api.copy(a, addr(src), n)
        assert np.array_equal(view, src)
    finally:
        api.host_free(a, n)
        if fd >= 0:
            os.close(fd)


def test_host_alloc_bad_sizes() -> None:
    for alloc in (api.host_alloc, api.host_alloc_shared):
        for bad in (0, -1):
            with pytest.raises(ParamInvalidError):
                alloc(bad)
        with pytest.raises(OutOfMemoryError) as info:
            alloc(1 << 62)
        assert info.value.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY


def test_host_free_bad_arguments() -> None:
    a = api.host_alloc(4096)
    with pytest.raises(ParamInvalidError):
        api.host_free(a + 1, 4096)
    with pytest.raises(ParamInvalidError):
        api.host_free(a, 0)
    api.host_free(a, 4096)


# -- cross-process batches ---------------------------------------------------------------
_PEER = textwrap.dedent(
    """
    import sys
    import numpy as np
    buf = np.frombuffer(bytes(range(256)) * (int(sys.argv[1]) // 256), dtype=np.uint8).copy()
    print(int(buf.ctypes.data), flush=True)
    sys.stdin.read()                       # until the test closes stdin
    sys.stdout.write(str(int(buf.astype(np.uint64).sum())) + "\\n")
    """
)


@pytest.fixture
def peer_buffer() -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """A child process holding a known buffer: (process, its address there, its size)."""
    size = 8 * MiB
    proc = subprocess.Popen(
        [sys.executable, "-c", _PEER, str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    where = int(proc.stdout.readline())
    try:
        yield proc, where, size
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _vm_or_skip(pid: int, ops: Ops, *, write: bool, threads: int = 0) -> None:
    try:
        api.vm_copy_batch(pid, ops, write=write, threads=threads)
    except PermissionError as exc:
        pytest.skip(f"the kernel refuses cross-process memory access here: {exc}")


@pytest.mark.parametrize("threads", [1, 2])
def test_vm_copy_batch_reads_and_writes_another_process(
    peer_buffer: tuple[subprocess.Popen[str], int, int], threads: int
) -> None:
    proc, there, size = peer_buffer
    expected = np.frombuffer(bytes(range(256)) * (size // 256), dtype=np.uint8)
    local = np.zeros(size, dtype=np.uint8)
    # scattered 64 KiB pieces, in reverse order, then the whole buffer at once
    piece = 64 << 10
    rows = [(addr(local) + i * piece, there + i * piece, piece) for i in reversed(range(64))]
    _vm_or_skip(proc.pid, make_ops(rows), write=False, threads=threads)
    np.testing.assert_array_equal(local[: 64 * piece], expected[: 64 * piece])
    local[:] = 0
    _vm_or_skip(proc.pid, make_ops([(addr(local), there, size)]), write=False, threads=threads)
    np.testing.assert_array_equal(local, expected)
    # write ones back over the peer's buffer and let it report the sum
    ones = np.ones(size, dtype=np.uint8)
    _vm_or_skip(proc.pid, make_ops([(there, addr(ones), size)]), write=True, threads=threads)
    out, _ = proc.communicate("", timeout=30)
    assert int(out.strip()) == size


def test_vm_copy_batch_more_ranges_than_iov_max(
    peer_buffer: tuple[subprocess.Popen[str], int, int],
) -> None:
    proc, there, size = peer_buffer
    expected = np.frombuffer(bytes(range(256)) * (size // 256), dtype=np.uint8)
    local = np.zeros(size, dtype=np.uint8)
    # 3000 rows of 1 KiB that never merge (every other KiB), crossing IOV_MAX twice
    rows = [(addr(local) + 2048 * i, there + 2048 * i + 1024, 1024) for i in range(3000)]
    _vm_or_skip(proc.pid, make_ops(rows), write=False, threads=1)
    got = local[: 2048 * 3000].reshape(3000, 2048)[:, :1024]
    want = expected[: 2048 * 3000].reshape(3000, 2048)[:, 1024:]
    np.testing.assert_array_equal(got, want)


def test_vm_copy_batch_errors(peer_buffer: tuple[subprocess.Popen[str], int, int]) -> None:
    proc, there, _ = peer_buffer
    local = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(TypeError):
        api.vm_copy_batch("1", make_ops([]), write=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        api.vm_copy_batch(-1, make_ops([]), write=False)
    with pytest.raises(ParamInvalidError):  # a null address is refused before any I/O
        api.vm_copy_batch(proc.pid, make_ops([(0, there, 16)]), write=False)
    try:  # an address that is not mapped in the peer
        api.vm_copy_batch(proc.pid, make_ops([(addr(local), 4096, 4096)]), write=False)
    except PermissionError as exc:
        pytest.skip(f"the kernel refuses cross-process memory access here: {exc}")
    except OSError as exc:
        assert exc.errno == errno.EFAULT
    else:
        pytest.fail("reading an unmapped address succeeded")
    proc.kill()
    proc.wait()
    with pytest.raises(ProcessLookupError):
        api.vm_copy_batch(proc.pid, make_ops([(addr(local), there, 4096)]), write=False)


def _wait_posted(signal: api.CopySignal, tasks: list[api.CopyTask]) -> None:
    """Wait on the signal's eventfd as an event loop would, until every task was reaped."""
    left = list(tasks)
    deadline = time.monotonic() + 30
    while left:
        assert time.monotonic() < deadline, "a background copy never ended"
        ready, _, _ = select.select([signal.fd], [], [], 1.0)
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(signal.fd, 8)
        left = [t for t in left if not t.reap()]


def test_background_copies_end_on_their_signal(
    peer_buffer: tuple[subprocess.Popen[str], int, int],
) -> None:
    proc, there, size = peer_buffer
    expected = np.frombuffer(bytes(range(256)) * (size // 256), dtype=np.uint8)
    local = np.zeros(size, dtype=np.uint8)
    signal = api.CopySignal()
    try:
        # under 1 MiB: copied by the caller, no task
        small = make_ops([(addr(local), there, 4096)])
        try:
            assert api.vm_copy_batch(proc.pid, small, write=False, signal=signal) is None
        except PermissionError as exc:
            pytest.skip(f"the kernel refuses cross-process memory access here: {exc}")
        np.testing.assert_array_equal(local[:4096], expected[:4096])
        # scattered 64 KiB pieces in reverse, and blocks: each a task of its own, in flight
        # together on the copy workers
        piece = 64 << 10
        rows = [(addr(local) + i * piece, there + i * piece, piece) for i in reversed(range(64))]
        first = api.vm_copy_batch(proc.pid, make_ops(rows), write=False, signal=signal)
        block = 64 << 10
        theirs = api.BlockLayout([there + size // 2], block, 64)
        mine = _layout(local[size // 2 :], 1, block, 64)
        picks = list(range(63, -1, -2))  # 32 blocks, 2 MiB
        second = api.vm_copy_blocks(
            proc.pid,
            (mine, 0, list(range(32))),
            (theirs, 0, picks),
            1,
            block,
            write=False,
            signal=signal,
        )
        assert first is not None and second is not None
        _wait_posted(signal, [first, second])
        assert first.reap() and second.reap()  # reaped once; True after that
        np.testing.assert_array_equal(local[: 64 * piece], expected[: 64 * piece])
        got = local[size // 2 :].reshape(64, block)[:32]
        want = expected[size // 2 :].reshape(64, block)[picks]
        np.testing.assert_array_equal(got, want)
        # a write back, waited for with reap(wait=True) after the signal was given up
        ones = np.ones(size, dtype=np.uint8)
        task = api.vm_copy_batch(
            proc.pid, make_ops([(there, addr(ones), size)]), write=True, signal=signal
        )
        signal.close()
        assert task is not None and task.reap(wait=True)
        out, _ = proc.communicate("", timeout=30)
        assert int(out.strip()) == size
    finally:
        signal.close()
    with pytest.raises(LLMException):  # a closed signal starts nothing
        api.vm_copy_batch(
            proc.pid, make_ops([(addr(local), there, size)]), write=False, signal=signal
        )


def test_background_copy_failures_are_the_reaps(
    peer_buffer: tuple[subprocess.Popen[str], int, int],
) -> None:
    proc, there, size = peer_buffer
    local = np.zeros(size, dtype=np.uint8)
    signal = api.CopySignal()
    try:
        with pytest.raises(ParamInvalidError):  # bad rows: refused at the start
            api.vm_copy_batch(proc.pid, make_ops([(0, there, size)]), write=False, signal=signal)
        # an address the peer has not mapped, past the first MiB: the copy starts, and
        # its reap says what failed
        rows = make_ops([(addr(local), there, MiB), (addr(local) + MiB, 4096, 2 * MiB)])
        try:
            task = api.vm_copy_batch(proc.pid, rows, write=False, signal=signal)
        except PermissionError as exc:
            pytest.skip(f"the kernel refuses cross-process memory access here: {exc}")
        assert task is not None
        with pytest.raises(OSError) as info:
            task.reap(wait=True)
        assert info.value.errno == errno.EFAULT
        assert task.reap()  # gone: nothing more to say
        proc.kill()
        proc.wait()
        whole = make_ops([(addr(local), there, size)])
        try:
            task = api.vm_copy_batch(proc.pid, whole, write=False, signal=signal)
        except ProcessLookupError:
            return  # the kernel refused at once: fine too
        assert task is not None
        with pytest.raises(ProcessLookupError):
            task.reap(wait=True)
    finally:
        signal.close()


# -- blocks -----------------------------------------------------------------------------------


def _layout(buf: npt.NDArray[np.uint8], tensors: int, block: int, blocks: int) -> api.BlockLayout:
    return api.BlockLayout([addr(buf) + t * block * blocks for t in range(tensors)], block, blocks)


@given(
    start=st.integers(0, 3),
    count=st.integers(0, 4),
    blocks=st.lists(st.integers(0, 7), max_size=12),
    seg=st.integers(1, 16),
)
@settings(max_examples=200, deadline=None)
def test_block_rows_match_the_python_rows(
    start: int, count: int, blocks: list[int], seg: int
) -> None:
    buf = np.zeros(4 * 8 * 16, dtype=np.uint8)
    layout = _layout(buf, 4, 16, 8)
    if start + count > 4:
        with pytest.raises(ParamInvalidError):
            api.block_rows(layout, start, count, blocks, seg)
        return
    want = [
        (addr(buf) + t * 128 + b * 16, seg) for t in range(start, start + count) for b in blocks
    ]
    got = api.block_rows(layout, start, count, blocks, seg)
    assert got.dtype == np.uint64 and got.shape == (len(want), 2)
    assert [tuple(r) for r in got.tolist()] == want
    as_array = api.block_rows(layout, start, count, np.asarray(blocks, dtype=np.uint64), seg)
    np.testing.assert_array_equal(as_array, got)


@pytest.mark.parametrize(
    ("blocks", "seg", "error"),
    [
        ([8], 16, ParamInvalidError),  # block past the end
        ([-1], 16, ParamInvalidError),
        ([2**64], 16, ParamInvalidError),
        ([1], 17, ParamInvalidError),  # segment over a block
        ([1], 0, ParamInvalidError),
        (["1"], 16, TypeError),
        ([1.0], 16, TypeError),
        (np.asarray([1], dtype=np.int64), 16, TypeError),
    ],
)
def test_block_rows_refusals(blocks: object, seg: int, error: type[Exception]) -> None:
    buf = np.zeros(4 * 8 * 16, dtype=np.uint8)
    with pytest.raises(error):
        api.block_rows(_layout(buf, 4, 16, 8), 0, 2, blocks, seg)


def test_block_layout_refuses_addresses_that_wrap() -> None:
    layout = api.BlockLayout([2**64 - 64], 16, 8)
    with pytest.raises(ParamInvalidError):
        api.block_rows(layout, 0, 1, [7], 16)


def test_vm_copy_blocks_reads_and_writes_another_process(
    peer_buffer: tuple[subprocess.Popen[str], int, int],
) -> None:
    proc, there, size = peer_buffer
    expected = np.frombuffer(bytes(range(256)) * (size // 256), dtype=np.uint8)
    block, per_tensor = 4096, 64  # the peer's 8 MiB: 32 tensors of 64 blocks
    theirs = api.BlockLayout([there + t * block * per_tensor for t in range(32)], block, 64)
    local = np.zeros(4 * 16 * block, dtype=np.uint8)  # 4 tensors of 16 blocks
    mine = _layout(local, 4, block, 16)
    src_blocks, dst_blocks = [63, 0, 17], [1, 15, 2]
    try:
        api.vm_copy_blocks(
            proc.pid, (mine, 1, dst_blocks), (theirs, 5, src_blocks), 3, block, write=False
        )
    except PermissionError as exc:
        pytest.skip(f"the kernel refuses cross-process memory access here: {exc}")
    got = local.reshape(4, 16, block)
    want = expected.reshape(32, 64, block)
    for t in range(3):
        for s, d in zip(src_blocks, dst_blocks, strict=True):
            np.testing.assert_array_equal(got[1 + t, d], want[5 + t, s])
    assert not got[0].any() and not got[1, 0].any()
    # write a block of ones over every block of the peer's first tensor, half a block each
    ones = np.ones(64 * block // 2, dtype=np.uint8)
    api.vm_copy_blocks(
        proc.pid,
        (theirs, 0, list(range(64))),
        (_layout(ones, 1, block // 2, 64), 0, list(range(64))),
        1,
        block // 2,
        write=True,
    )
    out, _ = proc.communicate("", timeout=30)
    half = expected.reshape(32, 64, block)[0, :, : block // 2].astype(np.uint64).sum()
    assert int(out.strip()) == int(expected.astype(np.uint64).sum()) - int(half) + 64 * block // 2


def test_vm_copy_blocks_refuses_before_moving(
    peer_buffer: tuple[subprocess.Popen[str], int, int],
) -> None:
    proc, there, _ = peer_buffer
    theirs = api.BlockLayout([there], 4096, 16)
    local = np.zeros(4 * 4096, dtype=np.uint8)
    mine = _layout(local, 1, 4096, 4)
    bad: list[tuple[object, object, int, int]] = [
        ((mine, 0, [4]), (theirs, 0, [0]), 1, 4096),  # local block past the end
        ((mine, 0, [0]), (theirs, 0, [16]), 1, 4096),  # their block past the end
        ((mine, 0, [0]), (theirs, 1, [0]), 1, 4096),  # their tensor past the end
        ((mine, 0, [0, 1]), (theirs, 0, [0]), 1, 4096),  # lists differ
        ((mine, 0, [0]), (theirs, 0, [0]), 1, 8192),  # segment over a block
    ]
    for dst, src, count, seg in bad:
        with pytest.raises(ParamInvalidError):
            api.vm_copy_blocks(proc.pid, dst, src, count, seg, write=False)  # type: ignore[arg-type]
    assert not local.any()
    with pytest.raises(TypeError):
        api.vm_copy_blocks(proc.pid, (mine, 0, ["0"]), (theirs, 0, [0]), 1, 4096, write=False)
    with pytest.raises(ValueError):
        api.vm_copy_blocks(-1, (mine, 0, [0]), (theirs, 0, [0]), 1, 4096, write=False)
    proc.kill()
    proc.wait()
    with pytest.raises((ProcessLookupError, PermissionError)):
        api.vm_copy_blocks(proc.pid, (mine, 0, [0]), (theirs, 0, [0]), 1, 4096, write=False)


def test_blocks_ops_pair_the_rows_of_both_layouts() -> None:
    # The ops of a blocks copy are each side's block rows, side by side: what pairing the
    # two sides' rows (block_rows) gives, in one call.
    rng = np.random.default_rng(7)
    dst_buf = np.zeros(3 * 8 * 64, dtype=np.uint8)
    src_buf = np.zeros(5 * 16 * 32, dtype=np.uint8)
    dst, src = _layout(dst_buf, 3, 64, 8), _layout(src_buf, 5, 32, 16)
    for _ in range(20):
        count = int(rng.integers(1, 4))
        n = int(rng.integers(0, 6))
        d_blocks = [int(b) for b in rng.integers(0, 8, n)]
        s_blocks = [int(b) for b in rng.integers(0, 16, n)]
        d_start, s_start = int(rng.integers(0, 4 - count)), int(rng.integers(0, 6 - count))
        seg = int(rng.integers(1, 33))
        ops = api.blocks_ops((dst, d_start, d_blocks), (src, s_start, s_blocks), count, seg)
        d_rows = api.block_rows(dst, d_start, count, d_blocks, seg)
        s_rows = api.block_rows(src, s_start, count, s_blocks, seg)
        assert ops.shape == (count * n, 3)
        np.testing.assert_array_equal(ops[:, 0], d_rows[:, 0])
        np.testing.assert_array_equal(ops[:, 1], s_rows[:, 0])
        assert (ops[:, 2] == seg).all()


def test_blocks_ops_refuse_what_a_blocks_copy_refuses() -> None:
    mine = _layout(np.zeros(4 * 4096, dtype=np.uint8), 1, 4096, 4)
    theirs = _layout(np.zeros(16 * 4096, dtype=np.uint8), 1, 4096, 16)
    bad: list[tuple[object, object, int, int]] = [
        ((mine, 0, [4]), (theirs, 0, [0]), 1, 4096),  # a block past the end
        ((mine, 0, [0]), (theirs, 0, [16]), 1, 4096),
        ((mine, 0, [0]), (theirs, 1, [0]), 1, 4096),  # a tensor past the end
        ((mine, 0, [0, 1]), (theirs, 0, [0]), 1, 4096),  # the lists differ
        ((mine, 0, [0]), (theirs, 0, [0]), 1, 8192),  # a segment over a block
        ((mine, 0, [0]), (theirs, 0, [0]), 1, 0),  # an empty segment
        ((mine, 0, [0]), (theirs, 0, [0]), 1, -1),  # a segment outside uint64
    ]
    for dst, src, count, seg in bad:
        with pytest.raises(ParamInvalidError):
            api.blocks_ops(dst, src, count, seg)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        api.blocks_ops((mine, 0, ["0"]), (theirs, 0, [0]), 1, 4096)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        api.blocks_ops((mine, 0, [0]), (theirs, 0, [0]), 1, "4096")  # type: ignore[arg-type]


_SHARED_CHILD = (
    "import ctypes, os, sys; from aio_datadist._native import api; "
    "a, fd = api.host_alloc_shared(1 << 20); "
    "v = (ctypes.c_uint8 * (1 << 20)).from_address(a); "
    "v[:] = bytes(range(256)) * 4096; "
    "print(fd, os.fstat(fd).st_ino, flush=True); sys.stdin.read(); print(v[5], flush=True)"
)


def test_shared_memory_is_mapped_by_a_peer_only_as_published() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SHARED_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        fd_no, ino = (int(v) for v in proc.stdout.readline().split())
        try:
            there = api.host_map_peer(proc.pid, fd_no, ino, 1 << 20)
        except PermissionError as exc:
            pytest.skip(f"the kernel refuses to hand over a descriptor here: {exc}")
        local = np.zeros(8192, dtype=np.uint8)
        # pid 0: both sides mapped here, moved with memcpy
        api.vm_copy_batch(0, make_ops([(addr(local), there + 4096, 8192)]), write=False)
        np.testing.assert_array_equal(local, np.tile(np.arange(256, dtype=np.uint8), 32))
        local[5] = 200
        api.vm_copy_batch(0, make_ops([(there, addr(local), 8)]), write=True)
        api.host_free(there, 1 << 20)
        for wrong in ((fd_no, ino + 1, 1 << 20), (fd_no, ino, 2 << 20), (0, ino, 1 << 20)):
            with pytest.raises(OSError) as info:
                api.host_map_peer(proc.pid, *wrong)
            assert info.value.errno == errno.EBADF  # not the published file: never mapped
        with pytest.raises(ValueError):
            api.host_map_peer(proc.pid, -1, ino, 1 << 20)
        proc.stdin.close()
        assert proc.stdout.readline().strip() == "200"  # the write landed in the peer
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        if not proc.stdin.closed:
            proc.stdin.close()
    with pytest.raises((ProcessLookupError, PermissionError)):
        api.host_map_peer(proc.pid, fd_no, ino, 1 << 20)
