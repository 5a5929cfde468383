"""Rank-table domains of one host meet at shared endpoints, and never collide.

On a host without accelerators every device ip of a rank table is the host's, and
vllm-ascend numbers the two ranks of every prefill/decode pair 0 and 1: every pair asks
for the same endpoints at the same moment. These tests link several pairs at once, in one
process and in eight, with one rank table and no per-pair configuration, and check every
byte pulled afterwards; they also take an endpoint's owner away mid-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    RegisterMemStatus,
)
from tests.conftest import make_options, pool_cfg

S = LLMStatusCode
PEER = Path(__file__).with_name("peer_domain.py")
_loopback_ports = itertools.count(53000, 10)  # apart from the other modules' loopback ports


def free_base_port() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (a rank table's two endpoints)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        with contextlib.suppress(OSError), socket.socket() as s:
            s.bind(("127.0.0.1", port + 1))
            return port
    raise AssertionError("no two free consecutive ports")


def rank_table(ranks: int = 2) -> str:
    """A vllm-ascend style rank table (version 1.2): every device ip the host's, no ports."""
    return json.dumps(
        {
            "version": "1.2",
            "server_count": "1",
            "server_list": [
                {
                    "server_id": "127.0.0.1",
                    "device": [
                        {
                            "device_id": str(rank),
                            "device_ip": "127.0.0.1",
                            "super_device_id": str(rank),
                            "rank_id": str(rank),
                        }
                        for rank in range(ranks)
                    ],
                }
            ],
        }
    )


def blocks_desc() -> CacheDesc:
    return CacheDesc(2, [4, 1024], DataType.DT_UINT8, Placement.DEVICE)


# -- engines of one process ------------------------------------------------------------------
@pytest.fixture(params=["tcp", "loopback"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def engines() -> AsyncIterator[list[AsyncLLMDataDist]]:
    made: list[AsyncLLMDataDist] = []
    yield made
    for engine in made:
        await engine.finalize()


async def make_engine(
    made: list[AsyncLLMDataDist], transport: str, role: LLMRole, cluster_id: int, base: int
) -> AsyncLLMDataDist:
    engine = AsyncLLMDataDist(role, cluster_id)
    made.append(engine)
    options = make_options(device_pool=pool_cfg(), remote_accessible=True, transport=transport)
    options["aio.CommBasePort"] = str(base)
    await engine.init(options)
    return engine


async def test_pairs_of_one_process_link_at_once_through_the_same_endpoints(
    engines: list[AsyncLLMDataDist], transport: str
) -> None:
    base = free_base_port() if transport == "tcp" else next(_loopback_ports)
    table = rank_table()
    pairs = []
    for n in range(3):
        p_id, d_id = 100 + 2 * n, 101 + 2 * n
        prompt = await make_engine(engines, transport, LLMRole.PROMPT, p_id, base)
        decoder = await make_engine(engines, transport, LLMRole.DECODER, d_id, base)
        pairs.append((p_id, d_id, prompt, decoder))
    sources = []
    for p_id, _, prompt, _ in pairs:
        cache = await prompt.cache_manager.allocate_blocks_cache(
            blocks_desc(), BlocksCacheKey(p_id)
        )
        for t, view in enumerate(cache.as_numpy()):
            view[...] = np.arange(view.size, dtype=np.uint64).reshape(view.shape) % 251 + p_id + t
        sources.append(cache)
    # Every pair calls its domain the same name, as vllm-ascend does on one host.
    comm = "pd_comm_127.0.0.1_127.0.0.1"
    links = []
    for p_id, d_id, prompt, decoder in pairs:
        members = {p_id: 0, d_id: 1}
        links += [prompt.link(comm, members, table), decoder.link(comm, members, table)]
    comm_ids = await asyncio.gather(*links)
    assert comm_ids == [1] * len(links)
    for (p_id, _, _, decoder), source in zip(pairs, sources, strict=True):
        assert await decoder.query_register_mem_status(1) is RegisterMemStatus.OK
        dst = await decoder.cache_manager.allocate_blocks_cache(blocks_desc())
        await decoder.cache_manager.pull_blocks(
            BlocksCacheKey(p_id), dst, [3, 2, 1, 0], [0, 1, 2, 3]
        )
        for got, sent in zip(dst.as_numpy(), source.as_numpy(), strict=True):
            np.testing.assert_array_equal(got, sent[::-1])
        # each decoder is linked to its own prompt only
        assert decoder._engine.link_table().get(p_id) is not None
        assert len(decoder._engine.link_table()) == 1
        await decoder.cache_manager.deallocate_blocks_cache(dst)
    for _, _, prompt, decoder in pairs:
        await asyncio.gather(prompt.unlink(1), decoder.unlink(1))
    for (_, _, prompt, _), source in zip(pairs, sources, strict=True):
        await prompt.cache_manager.deallocate_blocks_cache(source)


async def test_a_rank_endpoint_refuses_links_for_no_domain_it_serves(
    engines: list[AsyncLLMDataDist], transport: str
) -> None:
    base = free_base_port() if transport == "tcp" else next(_loopback_ports)
    prompt = await make_engine(engines, transport, LLMRole.PROMPT, 1, base)
    stranger = await make_engine(engines, transport, LLMRole.DECODER, 7, base)
    waiting = asyncio.ensure_future(prompt.link("comm", {1: 0, 2: 1}, rank_table()))
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", base)
    for _ in range(200):  # until the prompt listens, a refusal names nobody listening
        ret, rets = await stranger.link_clusters([info], 1000)
        error = rets.errors[0]
        assert ret == S.LLM_LINK_FAILED and error is not None
        if "rank endpoint" in str(error) or "domain" in str(error):
            break
        await asyncio.sleep(0.01)
    assert "rank endpoint" in str(error) or "domain" in str(error), error
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError, LLMException):
        await waiting


async def test_an_endpoint_held_by_another_program_fails_link_with_its_status(
    engines: list[AsyncLLMDataDist],
) -> None:
    base = free_base_port()
    prompt = await make_engine(engines, "tcp", LLMRole.PROMPT, 1, base)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base))
        squatter.listen()
        with pytest.raises(LLMException) as info:
            await prompt.link("comm", {1: 0, 2: 1}, rank_table())
    assert info.value.status_code == S.LLM_LINK_FAILED
    assert f"127.0.0.1:{base}" in str(info.value) and "in use" in str(info.value)
    assert isinstance(info.value.__cause__, Exception)  # the refusal, and the OSError below


# -- eight processes -------------------------------------------------------------------------
class Member:
    """One ``tests/peer_domain.py`` process."""

    def __init__(
        self, role: str, me: int, prompt: int, decoder: int, comm: str, base: int, table: str
    ) -> None:
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        args = [role, me, prompt, decoder, comm, base]
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(table + "\n")
        self.proc.stdin.flush()

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            return -1


@pytest.fixture
def members() -> Iterator[list[Member]]:
    made: list[Member] = []
    yield made
    for member in made:
        if member.proc.poll() is None:
            member.proc.kill()
        member.proc.wait(10)
        for pipe in (member.proc.stdin, member.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


def test_four_pairs_in_eight_processes_link_at_once_and_pull_exact(
    members: list[Member],
) -> None:
    base, table = free_base_port(), rank_table()
    comm = "pd_comm_127.0.0.1_127.0.0.1"
    for n in range(4):
        p_id, d_id = 10 + 2 * n, 11 + 2 * n
        members.append(Member("prompt", p_id, p_id, d_id, comm, base, table))
        members.append(Member("decoder", d_id, p_id, d_id, comm, base, table))
    assert [m.line() for m in members] == ["ready"] * 8
    for member in members:  # all at once
        member.send("go")
    outcomes = [m.line() for m in members]
    assert outcomes == ["linked", "exact"] * 4, outcomes
    assert [m.finish() for m in members] == [0] * 8


def test_an_endpoint_outlives_the_process_that_owned_it(members: list[Member]) -> None:
    base, table = free_base_port(), rank_table()
    # Domain "a": its prompt takes the endpoint and waits for a decoder that never comes.
    owner = Member("prompt", 20, 20, 21, "a", base, table)
    members.append(owner)
    assert owner.line() == "ready"
    owner.send("go")
    # Domain "b": its prompt registers with the owner.
    prompt = Member("prompt", 30, 30, 31, "b", base, table)
    members.append(prompt)
    assert prompt.line() == "ready"
    prompt.send("go")
    wait_for_hub(base, members=2)
    owner.proc.send_signal(signal.SIGKILL)
    owner.proc.wait(10)
    # Its member takes the endpoint over, and domain "b" links as if nothing happened.
    decoder = Member("decoder", 31, 30, 31, "b", base, table)
    members.append(decoder)
    assert decoder.line() == "ready"
    decoder.send("go")
    assert (prompt.line(), decoder.line()) == ("linked", "exact")
    assert (prompt.finish(), decoder.finish()) == (0, 0)


def wait_for_hub(base: int, members: int) -> None:
    """Until ``members`` processes hold the endpoint's hub (owner and members)."""
    name = f"@aio-datadist/endpoint/127.0.0.1:{base}"
    for _ in range(1000):
        with open("/proc/net/unix", encoding="ascii") as f:
            held = sum(1 for line in f if line.rstrip().endswith(name))
        if held >= members:
            return
        time.sleep(0.01)
    raise AssertionError(f"the hub of 127.0.0.1:{base} never had {members} processes")
