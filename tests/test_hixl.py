"""``transfer_backend="hixl"``: the reference's HIXL link semantics, across two processes.

Each side's ``link_clusters`` makes its own one-directional link, so two endpoints that
each listen may link to each other at the same moment, in either order, and both get
``LLM_SUCCESS``; ``unlink_clusters`` naming only ``remote_cluster_id`` drops this side's
link and leaves the peer's. The peer (``tests/peer_hixl.py``) is a blocking-API process;
this side runs through both faces.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from tests.conftest import Face, pool_cfg
from tests.peer_domain import BLOCK_BYTES, BLOCKS, TENSORS, pattern
from tests.test_rank_endpoints import free_base_port

S = LLMStatusCode
PEER = Path(__file__).with_name("peer_hixl.py")
ME, OTHER = 5, 6


class HixlPeer:
    """The other endpoint, in its own process."""

    def __init__(self, port: int, other_port: int) -> None:
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), str(port), str(OTHER), str(other_port), str(ME)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.ask(None) == "ready"

    def ask(self, command: str | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def ports() -> tuple[int, int]:
    base = free_base_port()
    return base, base + 1


@pytest.fixture
def peer(ports: tuple[int, int]) -> Iterator[HixlPeer]:
    mine, theirs = ports
    p = HixlPeer(theirs, mine)
    yield p
    p.close()


@pytest.fixture
async def face(face_kind: str, ports: tuple[int, int]) -> AsyncIterator[Face]:
    f = Face(face_kind, LLMRole.DECODER, ME)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.sync_kv_timeout = 5000
    cfg.enable_cache_manager = True
    cfg.transfer_backend = "hixl"
    cfg.listen_ip_info = f"127.0.0.1:{ports[0]}"
    cfg.mem_pool_cfg = pool_cfg()
    await f.init(dict(cfg.generate_options()))
    yield f
    await f.finalize()


def to_peer(port: int, *, ip: bool = True) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = OTHER
    if ip:
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
    return info


async def pulled_exact(face: Face, dst: Any) -> bool:
    await face.cm.pull_blocks(BlocksCacheKey(OTHER), dst, list(range(BLOCKS)), list(range(BLOCKS)))
    return all(np.array_equal(view, pattern(t, OTHER)) for t, view in enumerate(dst.as_numpy()))


@pytest.mark.parametrize("order", ["together", "peer_first", "this_first"])
async def test_endpoints_that_link_to_each_other_both_succeed(
    face: Face, peer: HixlPeer, ports: tuple[int, int], order: str
) -> None:
    desc = CacheDesc(TENSORS, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.DEVICE)
    mine = [pattern(t, ME) for t in range(TENSORS)]
    await face.cm.register_blocks_cache(
        desc, [int(t.ctypes.data) for t in mine], BlocksCacheKey(ME)
    )
    dst = await face.cm.allocate_blocks_cache(desc)
    link = face.call(face.dd.link_clusters, [to_peer(ports[1])], 5000)
    if order == "together":
        theirs, ours = await asyncio.gather(asyncio.to_thread(peer.ask, "link"), link)
    elif order == "peer_first":
        theirs = peer.ask("link")
        ours = await link
    else:
        ours = await link
        theirs = peer.ask("link")
    assert theirs == "LLM_SUCCESS"
    assert ours == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
    assert await pulled_exact(face, dst)
    assert peer.ask("pull") == "exact"
    # A second link of this side's is refused; the peer's is its own business.
    ret, rets = await face.call(face.dd.link_clusters, [to_peer(ports[1])], 5000)
    assert ret == S.LLM_ALREADY_LINK and rets.errors[0] is not None

    # Unlink by cluster id alone: this side's link goes, the peer's stays.
    ret, rets = await face.call(face.dd.unlink_clusters, [to_peer(0, ip=False)], 1000)
    assert (ret, rets, rets.errors) == (S.LLM_SUCCESS, [S.LLM_SUCCESS], [None])
    assert peer.ask("pull") == "exact"
    ret, _ = await face.call(face.dd.unlink_clusters, [to_peer(0, ip=False)], 1000, True)
    assert ret == S.LLM_SUCCESS  # nothing left to unlink: still a success, force ignored
    assert peer.ask("unlink") == "LLM_SUCCESS"
    for _ in range(500):  # until the peer's link is seen gone here
        if face.dd._engine.link_table().get(OTHER) is None:
            break
        await asyncio.sleep(0.01)
    with pytest.raises(LLMException) as info:
        await pulled_exact(face, dst)
    assert info.value.status_code == S.LLM_NOT_YET_LINK
    # And both may link again.
    assert (await face.call(face.dd.link_clusters, [to_peer(ports[1])], 5000))[0] == S.LLM_SUCCESS
    assert peer.ask("link") == "LLM_SUCCESS"
    assert await pulled_exact(face, dst)
    await face.cm.deallocate_blocks_cache(dst)


async def test_rank_table_calls_are_not_enabled_with_hixl(face: Face) -> None:
    for call, args in (
        (face.dd.link, ("comm", {ME: 0, OTHER: 1}, "{}")),
        (face.dd.unlink, (1,)),
        (face.dd.query_register_mem_status, (1,)),
    ):
        with pytest.raises(LLMException) as info:
            await face.call(call, *args)
        assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED


async def test_hixl_keeps_its_listen_address_through_switch_role(
    face: Face, ports: tuple[int, int]
) -> None:
    from aio_datadist import LLMRole as Role

    await face.call(face.dd.switch_role, Role.PROMPT)  # no address: stays listening
    assert face.dd._engine.link_table().listen_address is not None
    same = {"llm.listenIpInfo": f"127.0.0.1:{ports[0]}"}
    await face.call(face.dd.switch_role, Role.DECODER, same)
    with pytest.raises(LLMException) as info:
        await face.call(face.dd.switch_role, Role.PROMPT, {"llm.listenIpInfo": "127.0.0.1:1"})
    assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
