"""HCCL presence detection and communicator set-up against a fake libhccl (``fake_hccl.c``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from aio_datadist import LLMException, LLMStatusCode
from aio_datadist._native import hccl
from aio_datadist._runtime.acl import open_runtime
from aio_datadist._runtime.hccl import HCCL_ENV, probe
from tests.acl_fake import FAKE_VARS, FakeAcl
from tests.fakelibs import build


@pytest.fixture
def fake_hccl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake libhccl selected through ``AIO_DATADIST_HCCL``; returns its call log."""
    log = tmp_path / "hccl.log"
    monkeypatch.setenv(HCCL_ENV, str(build("fake_hccl.c", "libhccl.so")))
    monkeypatch.setenv("FAKE_HCCL_LOG", str(log))
    return log


def test_absent_library_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "libhccl.so"
    monkeypatch.setenv(HCCL_ENV, str(missing))
    presence = probe()
    assert not presence.available and presence.library == str(missing)
    assert str(missing) in presence.reason


def test_library_without_hccl_symbols_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HCCL_ENV, str(build("fake_ascendcl.c", "libascendcl.so")))
    presence = probe()
    assert not presence.available and "has no symbol HcclGetRootInfo" in presence.reason


def test_present_library_and_a_communicator(fake_hccl: Path, tmp_path: Path) -> None:
    presence = probe()
    assert presence.available and presence.cluster_info and presence.reason == ""
    root = hccl.get_root_info()
    assert len(root) == hccl.ROOT_INFO_BYTES == 4108 and root.startswith(b"fake-hccl-root")
    comm = hccl.comm_init_root_info(2, root, 1)
    hccl.comm_destroy(comm)
    with pytest.raises(LLMException) as exc:  # HCCL_E_NOT_FOUND from the library
        hccl.comm_destroy(comm)
    assert exc.value.status_code == LLMStatusCode.LLM_FAILED and "HcclResult 6" in str(exc.value)
    with pytest.raises(LLMException) as exc:  # refused before HCCL is called
        hccl.comm_init_root_info(2, root, 2)
    assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as exc:  # HCCL_E_PARA: not a root info HCCL made
        hccl.comm_init_root_info(2, bytes(hccl.ROOT_INFO_BYTES), 0)
    assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    with pytest.raises(ValueError):
        hccl.comm_init_root_info(2, root[:-1], 0)
    table = tmp_path / "rank_table.json"
    table.write_text("{}")
    hccl.comm_destroy(hccl.comm_init_cluster_info(str(table), 0))
    with pytest.raises(LLMException) as exc:  # HCCL_E_OPEN_FILE_FAILURE
        hccl.comm_init_cluster_info(str(tmp_path / "missing.json"), 0)
    assert "HcclResult 10" in str(exc.value)
    assert [line.split()[0] for line in fake_hccl.read_text().splitlines()] == [
        "HcclGetRootInfo",
        "HcclCommInitRootInfo",
        "HcclCommDestroy",
        "HcclCommDestroy",
        "HcclCommInitRootInfo",
        "HcclCommInitClusterInfo",
        "HcclCommDestroy",
        "HcclCommInitClusterInfo",
    ]


def test_acl_runtime_reports_hccl(
    fake_hccl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in FAKE_VARS:
        monkeypatch.delenv(var, raising=False)
    fake_acl = build("fake_ascendcl.c", "libascendcl.so")
    monkeypatch.setenv("AIO_DATADIST_ASCENDCL", str(fake_acl))
    rt = open_runtime(0)
    try:
        assert rt.features == {"acl", "hccl"} and rt.hccl.available and rt.hccl.domains
    finally:
        rt.close()
    FakeAcl(fake_acl, tmp_path / "unused.log").assert_released()


def test_one_sided_calls_check_their_arguments_before_hccl(
    fake_hccl: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in FAKE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AIO_DATADIST_ASCENDCL", str(build("fake_ascendcl.c", "libascendcl.so")))
    rt = open_runtime(0)
    table = tmp_path / "rank_table.json"
    table.write_text("{}")
    comm = rt.open_communicator(str(table), 0)
    assert comm is not None and comm.rank == 0
    try:
        buf = np.zeros(4096, np.uint8)
        comm.bind(buf.ctypes.data, buf.nbytes, on_device=False)
        assert comm.covers(np.array([[buf.ctypes.data + 8, 4088]], np.uint64))
        assert not comm.covers(np.array([[buf.ctypes.data + 8, 4089]], np.uint64))
        assert not comm.covers(np.array([[buf.ctypes.data - 1, 1]], np.uint64))
        comm.prepare(5)
        for rows in ([[0, buf.ctypes.data, 8]], [[buf.ctypes.data, 1 << 20, 0]]):
            with pytest.raises(LLMException) as exc:  # null address, empty row
                comm.transfer(1, np.array(rows, np.uint64), get=True)
            assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
        with pytest.raises(ValueError):
            comm.transfer(1, np.zeros((1, 2), np.uint64), get=True)
        with pytest.raises(LLMException) as exc:  # HCCL_E_NOT_FOUND: no rank 1 in the domain
            comm.transfer(1, np.array([[buf.ctypes.data, 1 << 20, 8]], np.uint64), get=False)
        assert exc.value.status_code == LLMStatusCode.LLM_FAILED
        assert "HcclBatchPut" in str(exc.value) and "HcclResult 6" in str(exc.value)
    finally:
        comm.close()
        comm.close()  # idempotent
        rt.close()
    with pytest.raises(LLMException) as exc:  # the domain was unlinked
        comm.transfer(1, np.array([[buf.ctypes.data, 1 << 20, 8]], np.uint64), get=True)
    assert exc.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    names = [line.split()[0] for line in fake_hccl.read_text().splitlines()]
    assert names.count("HcclBatchGet") == 0 and names.count("HcclBatchPut") == 1
    assert names[-3:] == ["HcclCommUnbindMem", "HcclDeregisterGlobalMem", "HcclCommDestroy"]
