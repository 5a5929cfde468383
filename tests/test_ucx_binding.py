"""The UCX binding: struct layouts, RMA get/put in one process and between two, failures.

Skipped as a whole when UCX cannot be loaded (``pip install 'aio_datadist[ucx]'`` or set
``AIO_DATADIST_UCX``). Transports are pinned per test with ``UCX_TLS``: ``tcp,self`` (the
software RMA a cross-host link uses, with peer-failure handling) and ``sm,self`` (cma
between processes on this host; UCX's shared-memory transports have no peer-failure
handling, so those endpoints are made with ``peer_errors=False``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aio_datadist._native import api
from aio_datadist._native import ucx as native
from aio_datadist._routes.ucx import worker as ucx
from aio_datadist.status import LLMException, LLMStatusCode

_reason = ucx.available()
if _reason is not None:
    pytest.skip(f"UCX is not available: {_reason}", allow_module_level=True)

ROOT = str(Path(__file__).resolve().parent.parent)
PEER = str(Path(__file__).with_name("peer_ucx.py"))
TLS = [pytest.param("tcp,self", id="tcp"), pytest.param("sm,self", id="sm")]
SECOND = 1_000_000_000
BIG = 64 << 20


def _deadline(seconds: float = 20.0) -> int:
    return time.monotonic_ns() + int(seconds * SECOND)


def _spans(rng: np.random.Generator, size: int, count: int) -> list[tuple[int, int]]:
    """Random (offset, length) pairs inside ``size``: 1 byte, odd sizes, odd offsets, a big
    one, and the very last byte."""
    spans = [(0, 1), (size - 1, 1), (1, 4095), (3, 1 << 20), (size - 12345, 12345)]
    for _ in range(count):
        n = int(rng.integers(1, 300_000))
        spans.append((int(rng.integers(0, size - n)), n))
    return spans


# -- the binding --------------------------------------------------------------------------


def _include_dir() -> Path | None:
    path = native.loaded_path()
    if path is None:
        return None
    include = Path(path).resolve().parent.parent / "include"
    return include if (include / "ucp" / "api" / "ucp.h").is_file() else None


LAYOUT_STRUCTS = [
    "ucp_params_t",
    "ucp_context_attr_t",
    "ucp_worker_params_t",
    "ucp_worker_attr_t",
    "ucp_ep_params_t",
    "ucp_mem_map_params_t",
    "ucp_request_param_t",
    "ucp_err_handler_t",
    "ucs_sock_addr_t",
    "ucs_cpu_set_t",
]


def test_struct_layouts_match_the_headers(tmp_path: Path) -> None:
    """Every bound struct's size and field offsets equal those of the installed headers."""
    cc = shutil.which("cc") or shutil.which("gcc")
    include = _include_dir()
    if cc is None or include is None:
        pytest.skip("needs a C compiler and the UCX headers next to the loaded libucp")
    ffi = native.ffi
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include <ucp/api/ucp.h>"]
    lines.append("int main(void) {")
    expected = []
    for name in LAYOUT_STRUCTS:
        ctype = ffi.typeof(name)
        lines.append(f'printf("{name} sizeof %zu\\n", sizeof({name}));')
        expected.append(f"{name} sizeof {ffi.sizeof(ctype)}")
        for field, _ in ctype.fields:
            lines.append(f'printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
            expected.append(f"{name} {field} {ffi.offsetof(ctype, field)}")
    lines.append('printf("ucs_status_t sizeof %zu\\n", sizeof(ucs_status_t));')
    expected.append(f"ucs_status_t sizeof {ffi.sizeof('ucs_status_t')}")
    lines.append("return 0; }")
    (tmp_path / "layout.c").write_text("\n".join(lines))
    subprocess.run(
        [cc, f"-I{include}", "-o", str(tmp_path / "layout"), str(tmp_path / "layout.c")],
        check=True,
        capture_output=True,
    )
    got = subprocess.run([str(tmp_path / "layout")], check=True, capture_output=True, text=True)
    assert got.stdout.splitlines() == expected


def test_api_version_is_no_newer_than_the_headers() -> None:
    include = _include_dir()
    if include is None:
        pytest.skip("no UCX headers next to the loaded libucp")
    text = (include / "ucp" / "api" / "ucp_version.h").read_text()
    major = int(text.split("#define UCP_API_MAJOR")[1].split()[0])
    minor = int(text.split("#define UCP_API_MINOR")[1].split()[0])
    assert (major, minor) >= (native.API_MAJOR, native.API_MINOR)


def test_status_pointer_macros() -> None:
    ffi = native.ffi
    assert native.ptr_status(ffi.NULL) == native.UCS_OK
    assert native.ptr_status(ffi.cast("void *", 0x7F0000001000)) == native.UCS_INPROGRESS
    for status in (-1, -6, -25, -80, -100):
        assert native.ptr_status(ffi.cast("void *", status)) == status


def test_every_status_has_a_documented_code() -> None:
    codes = {s: ucx.status_code(s) for s in range(-100, 0)}
    assert codes[-6] == codes[-25] == codes[-80] == codes[-45] == LLMStatusCode.LLM_LINK_FAILED
    assert codes[-5] == codes[-19] == LLMStatusCode.LLM_PARAM_INVALID
    assert codes[-20] == LLMStatusCode.LLM_TIMEOUT
    assert codes[-4] == LLMStatusCode.LLM_OUT_OF_MEMORY
    assert codes[-22] == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert codes[-15] == LLMStatusCode.LLM_FAILED


def test_info_names_library_version_and_transports() -> None:
    info = ucx.ucx_info()
    assert info["available"] is True
    assert info["path"] == native.loaded_path() and os.path.isfile(info["path"])
    assert info["version"].count(".") == 2
    assert "tcp/lo" in info["transports"], info


@pytest.mark.parametrize("env", [{}, {"UCX_TCP_TX_SEG_SIZE": "16k"}], ids=["default", "env"])
def test_a_context_applies_the_librarys_defaults_unless_the_environment_sets_them(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    """tcp segments of 256 KiB (UCX: 8 KiB out, 64 KiB in) and CUDA IPC reads, each left to
    the environment where it names the setting."""
    for key in ("UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE", "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    real = native.load()
    modified: dict[str, str] = {}

    class Spy:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def ucp_config_modify(self, config: Any, key: bytes, value: bytes) -> int:
            modified[key.decode()] = value.decode()
            return int(real.ucp_config_modify(config, key, value))

    monkeypatch.setattr(native, "load", lambda: Spy())
    with ucx.UcxContext():
        pass
    expected = {
        "CUDA_IPC_ENABLE_GET_ZCOPY": "y",
        "TCP_TX_SEG_SIZE": "256k",
        "TCP_RX_SEG_SIZE": "256k",
    }
    for key in env:
        del expected[key.removeprefix("UCX_")]
    assert modified == expected


# -- one process, two workers -------------------------------------------------------------


class Pair:
    """One context, two workers; the target's worker is progressed by a serving thread."""

    def __init__(self, peer_errors: bool) -> None:
        self.peer_errors = peer_errors
        self.context = ucx.UcxContext()
        self.requester = ucx.UcxWorker(self.context)
        self.target = ucx.UcxWorker(self.context)
        self.stop = threading.Event()
        self.server = threading.Thread(target=self.target.serve, args=(self.stop,))
        self.server.start()
        self.ep = ucx.Endpoint(self.requester, self.target.address(), peer_errors=peer_errors)

    def close(self) -> None:
        self.ep.close(_deadline(), force=True)
        self.stop.set()
        self.target.signal()
        self.server.join()
        self.requester.close()
        self.target.close()
        self.context.close()


@pytest.fixture(params=TLS)
def pair(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    monkeypatch.setenv("UCX_TLS", request.param)
    pair = Pair(peer_errors=request.param.startswith("tcp"))
    yield pair
    pair.close()


def test_get_and_put_exact_bytes_in_one_process(pair: Pair) -> None:
    rng = np.random.default_rng(7)
    remote = rng.integers(0, 256, BIG, dtype=np.uint8)
    local = np.zeros(BIG, dtype=np.uint8)
    with (
        ucx.Registration(pair.context, remote.ctypes.data, BIG) as reg,
        ucx.Registration(pair.context, local.ctypes.data, BIG),
        ucx.RemoteKey(pair.ep, reg.rkey, reg.addr, reg.nbytes) as rkey,
    ):
        request = ucx.get(pair.ep, local.ctypes.data, BIG, reg.addr, rkey)
        pair.requester.wait(request, _deadline())
        assert np.array_equal(local, remote)
        for off, n in _spans(rng, BIG, 40):
            dst = int(rng.integers(0, BIG - n))
            local[dst : dst + n] = 0
            request = ucx.get(pair.ep, local.ctypes.data + dst, n, reg.addr + off, rkey)
            pair.requester.wait(request, _deadline())
            assert np.array_equal(local[dst : dst + n], remote[off : off + n]), (off, n)
        for off, n in _spans(rng, BIG, 40):
            src = int(rng.integers(0, BIG - n))
            local[src : src + n] = rng.integers(0, 256, n, dtype=np.uint8)
            before, after = remote[off - 1] if off else None, remote[(off + n) % BIG]
            request = ucx.put(pair.ep, local.ctypes.data + src, n, reg.addr + off, rkey)
            pair.requester.wait(request, _deadline())
            pair.ep.flush(_deadline())
            assert np.array_equal(remote[off : off + n], local[src : src + n]), (off, n)
            if off:
                assert remote[off - 1] == before
            if off + n < BIG:
                assert remote[off + n] == after


def test_out_of_range_and_closed_objects_are_refused(pair: Pair) -> None:
    remote = np.zeros(1 << 20, dtype=np.uint8)
    local = np.zeros(2 << 20, dtype=np.uint8)
    reg = ucx.Registration(pair.context, remote.ctypes.data, remote.nbytes)
    rkey = ucx.RemoteKey(pair.ep, reg.rkey, reg.addr, reg.nbytes)
    base = local.ctypes.data
    for addr, n in [(reg.addr + 1, reg.nbytes), (reg.addr - 1, 2), (reg.addr + reg.nbytes, 1)]:
        with pytest.raises(LLMException, match="outside the peer's registration") as info:
            ucx.get(pair.ep, base, n, addr, rkey)
        assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as info:
        ucx.put(pair.ep, base, 0, reg.addr, rkey)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as info:
        ucx.RemoteKey(pair.ep, b"", reg.addr, reg.nbytes)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    rkey.close()
    with pytest.raises(LLMException, match="remote key is closed") as info:
        ucx.get(pair.ep, base, 16, reg.addr, rkey)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    reg.close()
    with pytest.raises(LLMException) as info:
        ucx.Endpoint(pair.requester, b"")
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


def test_a_batch_of_gets_and_puts_through_two_keys_moves_exact_bytes(pair: Pair) -> None:
    rng = np.random.default_rng(11)
    block, blocks = 4096, 256
    remotes = [rng.integers(0, 256, block * blocks, dtype=np.uint8) for _ in range(2)]
    local = np.zeros(block * blocks, dtype=np.uint8)
    regs = [ucx.Registration(pair.context, r.ctypes.data, r.nbytes) for r in remotes]
    keys = [ucx.RemoteKey(pair.ep, r.rkey, r.addr, r.nbytes) for r in regs]
    src, dst = rng.permutation(blocks), rng.permutation(blocks)
    key_of = (np.arange(blocks) % 2).astype(np.intp)
    base = local.ctypes.data
    ops = np.array(
        [
            [base + int(d) * block, regs[k].addr + int(s) * block, block]
            for s, d, k in zip(src, dst, key_of, strict=True)
        ],
        dtype=np.uint64,
    )
    remote_keys = [ucx.RemoteKeys(pair.ep, keys)]
    (requests,), failure = ucx.rma(ops, remote_keys, write=False)
    assert failure is None
    assert pair.requester.wait_until(requests.done, _deadline())
    assert len(requests) == 0
    requests.result()
    views = [r.reshape(blocks, block) for r in remotes]
    got = local.reshape(blocks, block)
    for s, d, k in zip(src, dst, key_of, strict=True):
        assert np.array_equal(got[d], views[k][s])
    local[:] = rng.integers(0, 256, local.nbytes, dtype=np.uint8)  # now push it back
    (requests,), failure = ucx.rma(ops, remote_keys, write=True)
    assert failure is None
    flush = pair.ep.flush_request()
    assert pair.requester.wait_until(lambda: requests.done() and flush.done(), _deadline())
    for s, d, k in zip(src, dst, key_of, strict=True):
        assert np.array_equal(views[k][s], got[d])
    (empty,), failure = ucx.rma(ops[:0], remote_keys, write=False)
    assert failure is None and empty.done() and len(empty) == 0
    outside = ops.copy()
    outside[7, 1] = regs[1].addr + regs[1].nbytes - block + 1  # one byte past its key
    with pytest.raises(LLMException, match="outside the peer's registrations") as info:
        ucx.rma(outside, remote_keys, write=False)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    outside[7, 1], outside[3, 2] = ops[7, 1], 0  # an empty op
    with pytest.raises(LLMException, match="op 3 is empty") as info:
        ucx.rma(outside, remote_keys, write=False)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    for key in keys:
        key.close()
    with pytest.raises(LLMException, match="remote key is closed") as info:
        ucx.rma(ops, remote_keys, write=False)
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    for reg in regs:
        reg.close()


def test_a_batch_a_lane_thread_progresses_wakes_the_worker_it_names(pair: Pair) -> None:
    # a second worker progressed by a native lane thread; the batches started on it (not yet
    # progressed: its thread sleeps until signalled) name the requester's worker, whose event
    # fd (armed, never progressed meanwhile) must wake when the last request completes
    rng = np.random.default_rng(5)
    block, blocks = 65536, 64
    remote = rng.integers(0, 256, block * blocks, dtype=np.uint8)
    local = np.zeros_like(remote)
    lane = ucx.UcxWorker(pair.context)
    before = _threads()
    thread = lane._calls.lane(lane._word, lane.event_fd())
    lane_tid = _named_thread(_threads() - before, "aio-dd-ucx-lane")
    ep = ucx.Endpoint(lane, pair.target.address(), peer_errors=pair.peer_errors)
    reg = ucx.Registration(pair.context, remote.ctypes.data, remote.nbytes)
    rkey = ucx.RemoteKey(ep, reg.rkey, reg.addr, reg.nbytes)
    order = rng.permutation(blocks)
    ops = np.array(
        [
            [local.ctypes.data + i * block, reg.addr + int(b) * block, block]
            for i, b in enumerate(order)
        ],
        dtype=np.uint64,
    )
    keys = [ucx.RemoteKeys(ep, [rkey])]

    def run(write: bool, *, posted: bool = False) -> None:
        _wait_asleep_in_poll(lane_tid)  # the lane's thread, done with the last part, sleeps
        while not pair.requester.arm():  # events pending: take them first
            pair.requester.drain()
        lanes = [thread] if posted else []
        (requests,), failure = ucx.rma(ops, keys, write=write, flush=write, lanes=lanes)
        assert failure is None
        requests.notify(pair.requester)
        if not posted:  # not posted to the lane's thread: it moves them once woken
            lane.signal()
        poller = select.poll()
        poller.register(pair.requester.event_fd(), select.POLLIN)
        if not requests.done():  # (posted: the lane may have finished before the notify)
            assert poller.poll(10_000), "the last completion did not signal the named waiter"
        assert requests.done()
        requests.result()

    try:
        run(write=False)
        assert np.array_equal(local.reshape(blocks, block), remote.reshape(blocks, block)[order])
        local[:] = rng.integers(0, 256, local.nbytes, dtype=np.uint8)
        run(write=True)  # the flush is in the batch: done means in the target's memory
        assert np.array_equal(remote.reshape(blocks, block)[order], local.reshape(blocks, block))
        local[:] = 0
        run(write=False, posted=True)  # a part posted to the sleeping thread wakes it
        assert np.array_equal(local.reshape(blocks, block), remote.reshape(blocks, block)[order])
    finally:
        thread.stop()
        thread.stop()  # once is enough; again does nothing
        rkey.close()
        ep.close(_deadline(), force=True)
        reg.close()
        lane.close()


def _threads() -> set[int]:
    """The ids of this process's threads."""
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _named_thread(tids: set[int], name: str) -> int:
    """The one thread among ``tids`` named ``name`` (waiting for it to take the name)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        named = [t for t in tids if Path(f"/proc/self/task/{t}/comm").read_text().strip() == name]
        if named:
            (tid,) = named
            return tid
        time.sleep(0.001)
    raise AssertionError(f"no new thread named {name}")


def _wait_asleep_in_poll(tid: int) -> None:
    """Wait until the thread ``tid`` of this process sleeps in ``poll`` (its kernel wait
    channel), as a native lane does between parts."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/self/task/{tid}/wchan") as wchan:
            if "poll" in wchan.read():
                return
        time.sleep(0.001)
    raise AssertionError(f"thread {tid} did not go to sleep in poll")


def test_the_native_batch_calls_refuse_missing_functions_and_handles() -> None:
    from aio_datadist._native import api
    from aio_datadist.status import ParamInvalidError

    addresses = native.call_addresses(api.UCX_CALLS.values())
    assert all(addresses.values())
    with pytest.raises(ParamInvalidError, match="no address for ucp_request_free"):
        api.UcxCalls({k: v for k, v in addresses.items() if k != "ucp_request_free"})
    calls = api.UcxCalls(addresses)
    with pytest.raises(ParamInvalidError):
        calls.drain(0, 0)  # no worker
    count = calls.count()
    ops, keys = np.array([[4096, 4096, 16]], np.uint64), np.array([[0, 1 << 20]], np.uint64)
    parts = api.UcxParts(keys, [api.UcxPart(0, np.zeros(1, np.uint64), None)])  # no endpoint
    with pytest.raises(ParamInvalidError):
        calls.transfer(ops, parts, write=False)  # (no count bound to the part either)
    parts.bind(0, 1, count)
    with pytest.raises(ParamInvalidError):
        calls.transfer(ops, parts, write=False)
    with pytest.raises(ParamInvalidError):
        api.UcxParts(keys, [])
    assert count.left() == (0, 0)  # nothing started, nothing counted
    with pytest.raises(OSError):
        calls.lane(0, -1)  # no worker


@contextlib.contextmanager
def _served_pair() -> Iterator[tuple[Any, Any, Any, Any, Any, np.ndarray, np.ndarray]]:
    """Two workers of one context, ``a`` with an endpoint to ``b`` and the remote key of 64
    KiB registered on ``b``'s side: ``(a, b, ep, rkey, reg, remote, local)``; ``b`` must
    grant ``UCS_THREAD_MODE_MULTI`` (else the test is skipped)."""
    with ucx.UcxContext() as context, ucx.UcxWorker(context) as a, ucx.UcxWorker(context) as b:
        if b.thread_mode != ucx._MULTI:
            pytest.skip("this libucp grants no UCS_THREAD_MODE_MULTI")
        remote = np.arange(1 << 16, dtype=np.uint8)
        local = np.zeros_like(remote)
        reg = ucx.Registration(context, remote.ctypes.data, remote.nbytes)
        ep = ucx.Endpoint(a, b.address(), peer_errors=True)
        rkey = ucx.RemoteKey(ep, reg.rkey, reg.addr, reg.nbytes)
        try:
            yield a, b, ep, rkey, reg, remote, local
        finally:
            rkey.close()
            ep.close(_deadline(2), force=True)
            reg.close()


def test_a_serving_wait_answers_gets_natively_until_woken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over tcp the target must progress for a get to move: one native wait of the target's
    serving thread answers every get until its wake fd is written after ``look`` (the write
    is taken), and comes back at its deadline, or with ``until_work`` once progress found
    work. A write without ``look`` does not end it."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    with _served_pair() as (a, b, ep, rkey, reg, remote, local):
        wake = os.eventfd(0, os.EFD_NONBLOCK)
        turn = api.UcxTurn()
        results: list[bool | None] = []

        def serving(deadline_ns: int | None = None, until_work: bool = False) -> threading.Thread:
            def run() -> None:
                results.append(b.serve_until(turn, wake, deadline_ns, until_work))

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        def pulled() -> None:
            local[:] = 0
            a.wait(ucx.get(ep, local.ctypes.data, local.nbytes, reg.addr, rkey), _deadline())
            assert np.array_equal(local, remote)

        try:
            server = serving()
            for _ in range(10):  # every get answered by the one native wait
                pulled()
            os.eventfd_write(wake, 1)  # no look: the wait goes on
            for _ in range(10):
                pulled()
            assert server.is_alive() and not results
            turn.look()
            os.eventfd_write(wake, 1)
            server.join(10)
            assert results == [False]
            assert select.select([wake], [], [], 0)[0] == []  # the write was taken
            start = time.monotonic_ns()
            serving(start + SECOND // 20).join(10)  # the deadline
            assert results[-1] is False and time.monotonic_ns() - start >= SECOND // 20
            server = serving(until_work=True)
            request = ucx.get(ep, local.ctypes.data, local.nbytes, reg.addr, rkey)
            deadline = time.monotonic() + 10
            while server.is_alive() and time.monotonic() < deadline:  # (a sends as it progresses)
                a.drain()
                server.join(0.001)
            assert not server.is_alive()  # back with the first work (the get may need more)
            assert results[-1] is True
            server = serving()
            a.wait(request, _deadline())
            turn.look()
            os.eventfd_write(wake, 1)
            server.join(10)
        finally:
            turn.look()
            os.eventfd_write(wake, 1)
            os.close(wake)


def test_a_serving_wait_stands_down_while_a_waiter_progresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While its turn counts a waiter, the serving wait leaves the worker alone (a get over
    tcp, which needs the target to progress, does not move) and parks on its wake fd; the
    last waiter to leave finds it parked, and one write resumes it natively: the get moves
    and the call has not returned."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    with (
        _served_pair() as (a, b, ep, rkey, reg, remote, local),
        _serving_thread(b, 0) as (turn, wake, server, results),
    ):
        a.wait(ucx.get(ep, local.ctypes.data, 8, reg.addr, rkey), _deadline())  # served
        assert turn.waiters(1) == 0  # a waiter comes: the thread sees it when woken
        os.eventfd_write(wake, 1)  # (no look)
        assert _parked(turn, api.UcxTurn.PARKED)  # (no spin time: parked for good)
        request = ucx.get(ep, local.ctypes.data, local.nbytes, reg.addr, rkey)
        assert not a.wait_until(request.done, time.monotonic_ns() + SECOND // 5)
        assert turn.waiters(0) == api.UcxTurn.PARKED  # the last waiter leaves
        os.eventfd_write(wake, 1)  # (no look) resume
        a.wait(request, _deadline())
        assert np.array_equal(local, remote)
        assert server.is_alive() and not results  # it resumed natively


@contextlib.contextmanager
def _serving_thread(
    worker: ucx.UcxWorker, spin_ns: int
) -> Iterator[tuple[api.UcxTurn, int, threading.Thread, list[bool | None]]]:
    """A thread in one native serving wait on ``worker`` with ``spin_ns``: its turn, its wake
    fd, the thread and what the wait returned; ended (look, then a write) on the way out,
    where the wait must have returned False once."""
    wake = os.eventfd(0, os.EFD_NONBLOCK)
    turn = api.UcxTurn()
    results: list[bool | None] = []
    server = threading.Thread(
        target=lambda: results.append(worker.serve_until(turn, wake, None, False, spin_ns))
    )
    server.start()
    try:
        yield turn, wake, server, results
    finally:
        turn.look()
        os.eventfd_write(wake, 1)
        server.join(10)
        os.close(wake)
    assert results == [False]


def _parked(turn: api.UcxTurn, mode: int) -> bool:
    """Whether the serving thread is parked as ``mode`` says within 10 s (a waiter counted
    meanwhile)."""
    deadline = time.monotonic() + 10
    while turn.waiters(1) != mode and time.monotonic() < deadline:
        time.sleep(0.001)
    return turn.waiters(1) == mode


def test_a_serving_wait_with_a_spin_time_parks_that_long_first_then_for_good(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a spin time, the first park after the serving thread had the worker lasts at
    most that long and then looks at the waiters again by itself: a waiter that leaves
    within it writes nothing, and the get it left behind moves all the same. A waiter still
    there when that park ends leaves the thread parked for good, resumed by a write."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    with (
        _served_pair() as (a, b, ep, rkey, reg, remote, local),
        _serving_thread(b, SECOND) as (turn, wake, server, results),
    ):
        a.wait(ucx.get(ep, local.ctypes.data, 8, reg.addr, rkey), _deadline())  # served
        turn.waiters(1)  # a waiter comes: the thread sees it when woken
        os.eventfd_write(wake, 1)  # (no look)
        assert _parked(turn, api.UcxTurn.PARKED_TIMED)
        request = ucx.get(ep, local.ctypes.data, local.nbytes, reg.addr, rkey)
        assert not a.wait_until(request.done, time.monotonic_ns() + SECOND // 20)
        assert turn.waiters(0) == api.UcxTurn.PARKED_TIMED  # leaves: nothing to write
        a.wait(request, _deadline())  # the thread looked again by itself and served it
        assert np.array_equal(local, remote)
        turn.waiters(1)  # a waiter that stays past the timed park
        os.eventfd_write(wake, 1)  # (no look: in case the thread slept meanwhile)
        assert _parked(turn, api.UcxTurn.PARKED)
        local[:] = 0
        request = ucx.get(ep, local.ctypes.data, local.nbytes, reg.addr, rkey)
        assert not a.wait_until(request.done, time.monotonic_ns() + SECOND // 20)
        assert turn.waiters(0) == api.UcxTurn.PARKED
        os.eventfd_write(wake, 1)  # (no look) resume
        a.wait(request, _deadline())
        assert np.array_equal(local, remote)
        assert server.is_alive() and not results  # it resumed natively, twice


def test_wait_sleeps_until_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A get whose target never progresses times out (LLM_TIMEOUT) without burning CPU."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    with ucx.UcxContext() as context, ucx.UcxWorker(context) as a, ucx.UcxWorker(context) as b:
        remote = np.zeros(1 << 20, dtype=np.uint8)
        local = np.zeros_like(remote)
        reg = ucx.Registration(context, remote.ctypes.data, remote.nbytes)
        ep = ucx.Endpoint(a, b.address())
        rkey = ucx.RemoteKey(ep, reg.rkey, reg.addr, reg.nbytes)
        request = ucx.get(ep, local.ctypes.data, local.nbytes, reg.addr, rkey)
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic()
        with pytest.raises(LLMException, match="deadline") as info:
            a.wait(request, time.monotonic_ns() + SECOND // 2)
        elapsed = time.monotonic() - start
        used = resource.getrusage(resource.RUSAGE_SELF)
        assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert 0.45 <= elapsed < 2.0
        spent = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
        assert spent < 0.25 * elapsed, f"waiting used {spent:.3f}s CPU in {elapsed:.3f}s"
        request.abandon()
        rkey.close()
        ep.close(_deadline(2), force=True)
        reg.close()


def test_a_batch_cut_off_by_a_forced_close_completes_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch of gets whose target never progresses stays in flight; closing the endpoint by
    force completes every request through the batch's count, with the failure kept."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    with ucx.UcxContext() as context, ucx.UcxWorker(context) as a, ucx.UcxWorker(context) as b:
        remote = np.arange(1 << 20, dtype=np.uint64).view(np.uint8)
        local = np.zeros_like(remote)
        reg = ucx.Registration(context, remote.ctypes.data, remote.nbytes)
        ep = ucx.Endpoint(a, b.address())
        rkey = ucx.RemoteKey(ep, reg.rkey, reg.addr, reg.nbytes)
        n = 64
        piece = remote.nbytes // n
        ops = np.array(
            [[local.ctypes.data + i * piece, reg.addr + i * piece, piece] for i in range(n)],
            dtype=np.uint64,
        )
        (requests,), failure = ucx.rma(ops[::-1].copy(), [ucx.RemoteKeys(ep, [rkey])], write=False)
        assert failure is None
        a.drain()
        assert not requests.done() and len(requests) > 0  # b never serves them
        with pytest.raises(LLMException, match="still in flight"):
            requests.result()
        rkey.close()
        ep.close(_deadline(5), force=True)
        assert a.wait_until(requests.done, _deadline(5))
        with pytest.raises(LLMException) as info:
            requests.result()
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED, info.value
        reg.close()


# -- two processes ------------------------------------------------------------------------


class Peer:
    """``tests/peer_ucx.py`` in a child process: registered memory, served."""

    def __init__(self, tls: str, nbytes: int = BIG, seed: int = 11) -> None:
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, UCX_TLS=tls, PYTHONPATH=path)
        self.proc = subprocess.Popen(
            [sys.executable, PEER, str(nbytes), str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        hello: dict[str, Any] = json.loads(self.proc.stdout.readline())
        self.address = bytes.fromhex(hello["address"])
        self.rkey = bytes.fromhex(hello["rkey"])
        self.addr: int = hello["addr"]
        self.nbytes: int = hello["nbytes"]
        self.expected = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)

    def read(self, off: int, n: int) -> bytes:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"read {off} {n}\n")
        self.proc.stdin.flush()
        return bytes.fromhex(self.proc.stdout.readline().strip())

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            assert self.proc.wait(timeout=30) == 0
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def local_side(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ucx.UcxContext, ucx.UcxWorker]]:
    context = ucx.UcxContext()
    worker = ucx.UcxWorker(context)
    yield context, worker
    worker.close()
    context.close()


@pytest.mark.parametrize("tls", [p.values[0] for p in TLS], ids=["tcp", "sm"])
def test_get_and_put_between_two_processes(tls: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", tls)
    peer = Peer(tls)
    context = ucx.UcxContext()
    worker = ucx.UcxWorker(context)
    local = np.zeros(BIG, dtype=np.uint8)
    try:
        reg = ucx.Registration(context, local.ctypes.data, BIG)
        ep = ucx.Endpoint(worker, peer.address, peer_errors=tls.startswith("tcp"))
        rkey = ucx.RemoteKey(ep, peer.rkey, peer.addr, peer.nbytes)
        worker.wait(ucx.get(ep, local.ctypes.data, BIG, peer.addr, rkey), _deadline())
        assert np.array_equal(local, peer.expected)
        rng = np.random.default_rng(3)
        for off, n in _spans(rng, BIG, 20):
            dst = int(rng.integers(0, BIG - n))
            local[dst : dst + n] = 0
            worker.wait(ucx.get(ep, local.ctypes.data + dst, n, peer.addr + off, rkey), _deadline())
            assert np.array_equal(local[dst : dst + n], peer.expected[off : off + n])
        for off, n in _spans(rng, BIG, 10):
            n = min(n, 100_000)  # checked back through the pipe as hex
            data = rng.integers(0, 256, n, dtype=np.uint8)
            local[:n] = data
            worker.wait(ucx.put(ep, local.ctypes.data, n, peer.addr + off, rkey), _deadline())
            ep.flush(_deadline())
            edge = max(off - 1, 0)
            got = peer.read(edge, n + 2)
            assert got[off - edge : off - edge + n] == data.tobytes(), (off, n)
            peer.expected[off : off + n] = data
            assert got == peer.expected[edge : edge + n + 2].tobytes()
        rkey.close()
        ep.close(_deadline())
        reg.close()
    finally:
        peer.close()
        worker.close()
        context.close()


def test_a_peer_that_dies_fails_the_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over tcp, a get from a killed peer and an endpoint to a dead worker fail with
    LLM_LINK_FAILED well before their deadlines."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    peer = Peer("tcp,self", nbytes=1 << 20)
    context = ucx.UcxContext()
    worker = ucx.UcxWorker(context)
    local = np.zeros(1 << 20, dtype=np.uint8)
    try:
        ep = ucx.Endpoint(worker, peer.address)
        rkey = ucx.RemoteKey(ep, peer.rkey, peer.addr, peer.nbytes)
        worker.wait(ucx.get(ep, local.ctypes.data, 4096, peer.addr, rkey), _deadline())
        peer.kill()
        start = time.monotonic()
        with pytest.raises(LLMException) as info:
            for _ in range(100):  # the first gets may still be accepted by the socket
                worker.wait(
                    ucx.get(ep, local.ctypes.data, local.nbytes, peer.addr, rkey), _deadline(15)
                )
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED, info.value
        assert time.monotonic() - start < 15
        rkey.close()
        ep.close(_deadline(5))

        start = time.monotonic()
        with pytest.raises(LLMException) as info:
            ep = ucx.Endpoint(worker, peer.address)
            rkey = ucx.RemoteKey(ep, peer.rkey, peer.addr, peer.nbytes)
            try:
                worker.wait(ucx.get(ep, local.ctypes.data, 64, peer.addr, rkey), _deadline(15))
            finally:
                rkey.close()
                ep.close(_deadline(5), force=True)
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED, info.value
        assert time.monotonic() - start < 15
    finally:
        peer.close()
        worker.close()
        context.close()


@pytest.mark.parametrize("tls", [p.values[0] for p in TLS], ids=["tcp", "sm"])
def test_an_access_outside_the_peers_memory_fails_the_link(
    tls: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What UCX itself does when the requester-side bounds check is bypassed (a key that lies
    about its length) and the address is not mapped in the peer: the requester gets
    LLM_LINK_FAILED, never a crash. Over cma the kernel refuses the read and the peer is
    unharmed; over tcp UCX's software RMA does not check target addresses and the *peer*
    dies of SIGSEGV. This is why the bounds check runs before UCX and the route is offered
    only on authenticated links."""
    monkeypatch.setenv("UCX_TLS", tls)
    peer = Peer(tls, nbytes=1 << 20)
    context = ucx.UcxContext()
    worker = ucx.UcxWorker(context)
    local = np.zeros(4096, dtype=np.uint8)
    try:
        ep = ucx.Endpoint(worker, peer.address, peer_errors=tls.startswith("tcp"))
        rkey = ucx.RemoteKey(ep, peer.rkey, peer.addr, 1 << 46)
        with pytest.raises(LLMException) as info:
            far = peer.addr + (1 << 45)
            worker.wait(ucx.get(ep, local.ctypes.data, local.nbytes, far, rkey), _deadline(15))
        assert info.value.status_code == LLMStatusCode.LLM_LINK_FAILED, info.value
        if tls.startswith("tcp"):
            assert peer.proc.wait(timeout=10) == -signal.SIGSEGV
        else:
            assert peer.proc.poll() is None
            assert peer.read(0, 16) == peer.expected[:16].tobytes()
        rkey.close()
        ep.close(_deadline(5), force=True)
    finally:
        peer.close()
        worker.close()
        context.close()


# -- awaited on an event loop --------------------------------------------------------------


async def test_gets_awaited_together_on_the_loop(pair: Pair) -> None:
    """Many requests awaited at once share the worker's event fd in the loop's selector."""
    rng = np.random.default_rng(11)
    remote = rng.integers(0, 256, BIG, dtype=np.uint8)
    local = np.zeros(BIG, dtype=np.uint8)
    with (
        ucx.Registration(pair.context, remote.ctypes.data, BIG) as reg,
        ucx.Registration(pair.context, local.ctypes.data, BIG),
        ucx.RemoteKey(pair.ep, reg.rkey, reg.addr, reg.nbytes) as rkey,
    ):
        piece = BIG // 16
        requests = [
            ucx.get(pair.ep, local.ctypes.data + i * piece, piece, reg.addr + i * piece, rkey)
            for i in range(16)
        ]
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        beat = asyncio.create_task(ticker())
        await asyncio.gather(*(pair.requester.wait_async(r, _deadline()) for r in requests))
        beat.cancel()
        assert np.array_equal(local, remote)
        assert not pair.requester._waiters  # the fd left the selector


async def test_an_awaited_request_times_out_without_burning_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    with ucx.UcxContext() as context, ucx.UcxWorker(context) as a, ucx.UcxWorker(context) as b:
        remote = np.zeros(1 << 20, dtype=np.uint8)
        local = np.zeros_like(remote)
        reg = ucx.Registration(context, remote.ctypes.data, remote.nbytes)
        ep = ucx.Endpoint(a, b.address())  # b never progresses: the get never completes
        rkey = ucx.RemoteKey(ep, reg.rkey, reg.addr, reg.nbytes)
        request = ucx.get(ep, local.ctypes.data, local.nbytes, reg.addr, rkey)
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        start = time.monotonic()
        with pytest.raises(LLMException, match="deadline") as info:
            await a.wait_async(request, time.monotonic_ns() + SECOND // 2)
        elapsed = time.monotonic() - start
        used = resource.getrusage(resource.RUSAGE_SELF)
        assert info.value.status_code == LLMStatusCode.LLM_TIMEOUT
        assert 0.45 <= elapsed < 2.0
        spent = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
        assert spent < 0.25 * elapsed, f"waiting used {spent:.3f}s CPU in {elapsed:.3f}s"
        assert not a._waiters
        request.abandon()
        rkey.close()
        ep.close(_deadline(2), force=True)
        reg.close()
