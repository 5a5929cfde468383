"""Two hosts, simulated: a prompt and a decoder process in two network namespaces joined by a
veth pair, the same-host route off, so the link (and UCX, over its tcp transport) really
crosses an interface.

Skipped where namespaces cannot be made (not root, no ``ip``, a container that refuses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aio_datadist._routes.ucx import worker as ucx
from tests.netns import VethPair, why_not
from tests.peer_prompt import read_ready

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tests" / "peer_prompt.py"
DECODER = ROOT / "tests" / "netns_decoder.py"
BLOCKS, BLOCK_BYTES = 32, 256 * 1024  # 4 tensors x 8 MiB
ROUTES = ["link"] + (["ucx"] if ucx.available() is None else [])


@pytest.fixture(scope="module")
def pair() -> Iterator[VethPair]:
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    try:
        made = VethPair()
    except OSError as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    with made:
        yield made


def _env(pair: VethPair, route: str, ns: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), AIO_DATADIST_RUNTIME="host")
    if route == "ucx":
        env.update(pair.ucx_env(ns), AIO_TEST_UCX="1")
    return env


def _run(pair: VethPair, route: str) -> dict[str, object]:
    """The prompt in namespace ``a``, the decoder in ``b``: the decoder's report."""
    env = _env(pair, route, pair.a)
    env["AIO_TEST_LISTEN_IP"] = pair.ip_a
    prompt = subprocess.Popen(  # port 0: the prompt reports the one it bound
        pair.command(pair.a, [sys.executable, str(PEER), "0", str(BLOCKS), str(BLOCK_BYTES)]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert prompt.stdout is not None
        port = read_ready(prompt.stdout)
        done = subprocess.run(
            pair.command(
                pair.b,
                [sys.executable, str(DECODER), pair.ip_a, str(port), str(BLOCKS), str(BLOCK_BYTES)],
            ),
            capture_output=True,
            text=True,
            timeout=90,
            env=_env(pair, route, pair.b),
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        report: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
        return report
    finally:
        assert prompt.stdin is not None
        prompt.stdin.close()
        try:
            prompt.wait(20)
        except subprocess.TimeoutExpired:
            prompt.kill()
            prompt.wait(5)
        if prompt.stdout is not None:
            prompt.stdout.close()


@pytest.mark.parametrize("route", ROUTES)
def test_transfers_cross_the_veth_pair(pair: VethPair, route: str) -> None:
    report = _run(pair, route)
    assert report["ok"] is True, report
    routes = report["routes"]
    assert isinstance(routes, list)
    if route == "ucx":
        assert routes[:2] == ["ucx", "staged-ucx"], report
        # UCX's tcp transport, on the veth device of this side only
        assert report["transports"] == [f"tcp/{pair.dev_b}"], report
    else:
        assert "ucx" not in routes and report["transports"] == [], report


@pytest.mark.skipif(ucx.available() is not None, reason="UCX is not available")
def test_the_ucx_route_under_a_one_millisecond_round_trip(pair: VethPair) -> None:
    if not pair.delay(500):
        pytest.skip("the kernel has no netem qdisc (sch_netem)")
    try:
        report = _run(pair, "ucx")
    finally:
        pair.delay(0)
    assert report["ok"] is True and report["routes"][:1] == ["ucx"], report  # type: ignore[index]
