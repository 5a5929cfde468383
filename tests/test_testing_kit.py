"""The testing kit: a linked pair in one line, faults injected into its loopback link, and
the opt-in pytest plugin, used as a serving team's test suite would use them."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LinkFailedError,
    LLMException,
    LLMStatusCode,
    LLMTimeoutError,
    Placement,
)
from aio_datadist.testing import LinkedPair, link_faults, linked_pair

ROOT = Path(__file__).resolve().parents[1]
S = LLMStatusCode
STRICT = ("-o", "asyncio_mode=strict")
DESC = CacheDesc(2, [8, 256], DataType.DT_UINT8, Placement.DEVICE)


class Caches:
    """A blocks cache on each side, the prompt's filled with known bytes."""

    def __init__(self, pair: LinkedPair) -> None:
        self.pair = pair

    async def __aenter__(self) -> Caches:
        self.src = await self.pair.prompt.cache_manager.allocate_blocks_cache(
            DESC, BlocksCacheKey(self.pair.prompt_cluster_id, 0)
        )
        self.dst = await self.pair.decoder.cache_manager.allocate_blocks_cache(DESC)
        for t, view in enumerate(self.src.as_numpy()):
            view[...] = np.arange(8 * 256, dtype=np.uint32).reshape(8, 256) % 251 + t
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pair.prompt.cache_manager.deallocate_blocks_cache(self.src)
        await self.pair.decoder.cache_manager.deallocate_blocks_cache(self.dst)

    async def pull(self, src: list[int], dst: list[int]) -> None:
        await self.pair.decoder.cache_manager.pull_blocks(
            BlocksCacheKey(self.pair.prompt_cluster_id, 0), self.dst, src, dst
        )

    def landed(self, src: list[int], dst: list[int]) -> bool:
        return all(
            np.array_equal(s[src], d[dst])
            for s, d in zip(self.src.as_numpy(), self.dst.as_numpy(), strict=True)
        )

    def untouched(self, dst: list[int]) -> bool:
        return not any(d[dst].any() for d in self.dst.as_numpy())


@pytest.fixture
async def caches() -> AsyncIterator[Caches]:
    async with linked_pair() as pair, Caches(pair) as c:
        yield c


async def test_a_linked_pair_moves_bytes(caches: Caches) -> None:
    await caches.pull([1, 2], [3, 4])
    assert caches.landed([1, 2], [3, 4])
    assert caches.pair.faults.requests == 1 and caches.pair.faults.injected == 0


async def test_fail_next_fails_that_many_transfers_with_the_chosen_code(caches: Caches) -> None:
    faults = caches.pair.faults
    faults.fail_next(2, S.LLM_TIMEOUT)
    for _ in range(2):
        with pytest.raises(LLMTimeoutError) as info:
            await caches.pull([1], [1])
        assert info.value.status_code == S.LLM_TIMEOUT
        assert "injected fault" in str(info.value)
    assert caches.untouched([1])
    await caches.pull([1], [1])  # the third goes through: the link stayed up
    assert caches.landed([1], [1])
    assert faults.injected == 2


async def test_fail_next_by_operation(caches: Caches) -> None:
    faults = caches.pair.faults
    faults.fail_next(1, S.LLM_KV_CACHE_NOT_EXIST, op="push")
    await caches.pull([0], [0])  # a pull is not a push: it moves
    assert caches.landed([0], [0])
    with pytest.raises(LLMException) as info:
        await caches.pair.decoder.cache_manager.push_blocks(
            BlocksCacheKey(caches.pair.prompt_cluster_id, 0), caches.dst, [0], [5]
        )
    assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST


async def test_a_delay_holds_the_answer_and_the_loop_stays_free(caches: Caches) -> None:
    caches.pair.faults.delay(0.2)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    tick_task = asyncio.create_task(ticker())
    start = time.monotonic()
    await caches.pull([2], [2])
    took = time.monotonic() - start
    tick_task.cancel()
    assert took >= 0.19 and caches.landed([2], [2])
    assert ticks >= 5  # the loop ran meanwhile
    caches.pair.faults.delay(0)
    start = time.monotonic()
    await caches.pull([3], [3])
    assert time.monotonic() - start < 0.15


async def test_a_delay_past_the_deadline_is_a_timeout_and_moves_nothing(caches: Caches) -> None:
    caches.pair.faults.delay(5.0)  # the pair's sync_kv_timeout is 1 s
    start = time.monotonic()
    with pytest.raises(LLMTimeoutError):
        await caches.pull([4], [4])
    assert 0.9 <= time.monotonic() - start < 3.0
    assert caches.untouched([4])


async def test_a_stalled_link_holds_requests_until_released(caches: Caches) -> None:
    faults = caches.pair.faults
    faults.stall()
    pulls = [asyncio.create_task(caches.pull([b], [b])) for b in (5, 6)]
    for _ in range(100):
        if faults.held == 2:
            break
        await asyncio.sleep(0.005)
    assert faults.held == 2 and not any(p.done() for p in pulls)
    assert caches.untouched([5, 6])
    faults.release()
    await asyncio.gather(*pulls)
    assert caches.landed([5, 6], [5, 6]) and faults.held == 0


async def test_a_stalled_request_times_out_at_its_deadline(caches: Caches) -> None:
    caches.pair.faults.stall()
    with pytest.raises(LLMTimeoutError):
        await caches.pull([7], [7])
    assert caches.untouched([7])


async def test_drop_fails_held_and_later_transfers_as_a_dead_peer(caches: Caches) -> None:
    faults = caches.pair.faults
    faults.stall()
    held = asyncio.create_task(caches.pull([1], [1]))
    for _ in range(100):
        if faults.held:
            break
        await asyncio.sleep(0.005)
    faults.drop()
    with pytest.raises(LinkFailedError):
        await held
    with pytest.raises(LLMException) as info:
        await caches.pull([1], [1])
    assert info.value.status_code == S.LLM_LINK_FAILED
    assert caches.untouched([1])


async def test_reset_clears_every_fault(caches: Caches) -> None:
    faults = caches.pair.faults
    faults.fail_next(3)
    faults.delay(10)
    faults.reset()
    await caches.pull([1], [1])
    assert caches.landed([1], [1])


async def test_prompt_faults_act_on_the_prompts_requests() -> None:
    async with linked_pair(prompt_cluster_id=7, decoder_cluster_id=8) as pair:
        assert pair.prompt_faults is not pair.faults
        assert pair.prompt_cluster_id == 7 and pair.decoder_cluster_id == 8


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ((0,), ValueError),
        ((1.5,), TypeError),
        ((True,), TypeError),
        ((1, 0), TypeError),
        ((1, S.LLM_SUCCESS), ValueError),
    ],
)
async def test_bad_fault_arguments_are_refused(
    caches: Caches, args: tuple[object, ...], error: type[Exception]
) -> None:
    with pytest.raises(error):
        caches.pair.faults.fail_next(*args)  # type: ignore[arg-type]


async def test_bad_delay_and_op_are_refused(caches: Caches) -> None:
    faults = caches.pair.faults
    with pytest.raises(ValueError):
        faults.delay(-1)
    with pytest.raises(ValueError):
        faults.delay(float("nan"))
    with pytest.raises(TypeError):
        faults.delay("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        faults.fail_next(1, op="copy")


async def test_link_faults_needs_a_live_loopback_link() -> None:
    async with linked_pair() as pair:
        with pytest.raises(LLMException) as info:
            link_faults(pair.decoder, 99)
        assert info.value.status_code == S.LLM_NOT_YET_LINK
    with pytest.raises(TypeError):
        link_faults(object(), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        async with linked_pair(prompt_cluster_id=3, decoder_cluster_id=3):
            pass


def test_the_documented_example_passes_with_the_plugin(tmp_path: Path) -> None:
    """``docs/snippets/test_retry_example.py`` (shown on the testing page) run as a user's
    suite would run it: pytest, the opt-in plugin, pytest-asyncio in strict mode."""
    example = ROOT / "docs" / "snippets" / "test_retry_example.py"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *STRICT, str(example)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "AIO_DATADIST_RUNTIME": "host"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 passed" in done.stdout


def test_faults_act_on_the_blocking_face_too() -> None:
    from aio_datadist import AsyncLLMDataDist, LLMClusterInfo, LLMDataDist, LLMRole
    from aio_datadist.testing import _options

    loop = asyncio.new_event_loop()
    prompt = AsyncLLMDataDist(LLMRole.PROMPT, 1)
    decoder = LLMDataDist(LLMRole.DECODER, 2)
    try:

        async def serve() -> Any:
            await prompt.init(_options(16 << 20, None, 1000, None, "127.0.0.1:39999", None))
            return await prompt.cache_manager.allocate_blocks_cache(DESC, BlocksCacheKey(1, 0))

        src = loop.run_until_complete(serve())
        for view in src.as_numpy():
            view[...] = 9
        decoder.init(_options(16 << 20, None, 1000, None, None, None))
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", 39999)
        assert decoder.link_clusters([info], 5000)[0] == S.LLM_SUCCESS
        dst = decoder.cache_manager.allocate_blocks_cache(DESC)
        faults = link_faults(decoder, 1)
        faults.fail_next(1, S.LLM_LINK_FAILED)
        with pytest.raises(LinkFailedError):
            decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [1])
        faults.delay(0.1)
        start = time.monotonic()
        decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [1], [1])
        assert time.monotonic() - start >= 0.09
        assert all((d[1] == 9).all() for d in dst.as_numpy())
        faults.stall()
        with pytest.raises(LLMTimeoutError):
            decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [2], [2])
        assert not any(d[2].any() for d in dst.as_numpy())
    finally:
        decoder.finalize()
        loop.run_until_complete(prompt.finalize())
        loop.close()
