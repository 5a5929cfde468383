"""The ``aio-datadist`` command as a user runs it: ``info``, ``bench`` (both routes, both
faces, pull and push) and ``ping`` (a live listener, a wrong cluster, nobody there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aio_datadist._native import ucx
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
NEEDS_UCX = pytest.mark.skipif(
    ucx.load_error() is not None, reason=f"UCX is not available: {ucx.load_error()}"
)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "aio_datadist", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_help_and_bad_arguments() -> None:
    for args in ((), ("info",), ("bench",), ("ping",)):
        done = run(*args, "--help")
        assert done.returncode == 0 and done.stdout.startswith("usage: aio-datadist")
    for args in (
        ("frobnicate",),
        ("ping", "nohostport"),
        ("ping", "127.0.0.1:70000"),
        ("bench", "--size-mib", "5"),
        ("bench", "--iters", "0"),
        ("bench", "--serve"),
    ):
        done = run(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert "error:" in done.stderr.strip().splitlines()[-1]


def test_info_reports_the_machine() -> None:
    done = run("info", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["version"] and "net" in data["native"]
    assert set(data["runtimes"]) == {"cuda", "acl", "hccl"}
    for rt in data["runtimes"].values():
        assert rt["available"] or rt["reason"]  # found, or why not
    assert isinstance(data["ucx"]["available"], bool)
    same = data["same_host"]
    assert same["allowed"] == (same["peer_read"] == "ok")
    assert data["logging"]["env"] == "AIO_DATADIST_LOG"
    table = run("info")
    assert table.returncode == 0 and "same-host route" in table.stdout


@pytest.mark.parametrize(
    ("route", "face", "op"),
    [
        ("samehost", "async", "pull"),
        ("tcp", "sync", "pull"),
        ("tcp", "async", "push"),
        pytest.param("ucx", "sync", "pull", marks=NEEDS_UCX),
    ],
)
def test_bench_measures_every_workload(route: str, face: str, op: str) -> None:
    done = run(
        "bench", "--route", route, "--face", face, "--op", op,
        "--size-mib", "4", "--iters", "20", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["route"] == {"samehost": "same-host"}.get(route, route)
    assert (data["face"], data["op"], data["size_mib"]) == (face, op, 4)
    for key in ("memcpy_GBps", "socket_GBps", "W1_GBps", "W2_GBps", "W3_p50_us"):
        assert data[key] > 0, key
    ratio = data["W1_GBps"] / data["memcpy_GBps"]
    assert data["W1_vs_memcpy"] == pytest.approx(ratio, rel=0.02, abs=0.002)
    assert data["W2_blocks"] == 64  # 4 MiB: one block of each of the 64 tensors
    assert data["link_routes"][-2:] == ["link", "staged-link"]
    assert ("same-host" in data["link_routes"]) == (route == "samehost")
    assert (data["link_routes"][0] == "ucx") == (route == "ucx")


def test_bench_prints_a_table() -> None:
    done = run("bench", "--size-mib", "4", "--iters", "10", "--quiet")
    assert done.returncode == 0, done.stderr
    assert "W1" in done.stdout and "vs memcpy" in done.stdout and "plain TCP socket" in done.stdout


@pytest.fixture
def listener() -> Iterator[int]:
    port, plain = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    serve = ("bench", "--serve", "--size-mib", "4", "--listen", f"127.0.0.1:{port}")
    server = subprocess.Popen(
        [sys.executable, "-m", "aio_datadist", *serve, "--plain-port", str(plain)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield port
    finally:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.close()
        server.wait(30)
        server.stdout.close()


def test_ping_a_listener(listener: int) -> None:
    done = run("ping", f"127.0.0.1:{listener}", "--count", "5", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["ok"] and data["link_ms"] > 0
    assert 0 < data["rtt_us"]["min"] <= data["rtt_us"]["p50"] <= data["rtt_us"]["max"]
    assert data["routes"][-2:] == ["link", "staged-link"]
    wrong = run("ping", f"127.0.0.1:{listener}", "--cluster-id", "5")
    assert wrong.returncode == 1
    assert "LLM_LINK_FAILED" in wrong.stdout and "not 5" in wrong.stdout


def test_ping_nobody_there() -> None:
    done = run("ping", f"127.0.0.1:{free_port()}", "--json")
    assert done.returncode == 1
    data = json.loads(done.stdout)
    assert not data["ok"] and data["status"] == "LLM_LINK_FAILED"
    assert "refused" in data["reason"].lower()
