"""Shared fixtures: engines through both faces, pool-leak and event-loop-blocking guards."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import aio_datadist as llm_datadist
from aio_datadist import LLMConfig, LLMDataDist, LLMRole, Placement
from tests import vllm_env

MiB = 1 << 20
POOL_BYTES = 64 * MiB
PAGE_SHIFT = 16


def pytest_configure(config: pytest.Config) -> None:
    """The suite reads DEVICE caches through numpy, so it runs on the host runtime (device
    memory is host memory there) wherever an accelerator exists; tests of an accelerator
    runtime select it themselves. Peer processes inherit the choice."""
    os.environ["AIO_DATADIST_RUNTIME"] = "host"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Tests in real vLLM need a Python with vLLM, which can take minutes to make: start
    finding or making it now, beside the rest of the suite."""
    if any(item.get_closest_marker("vllm") for item in session.items):
        vllm_env.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    vllm_env.stop()
    cross_process = sys.modules.get("tests.test_cross_process")
    if cross_process is not None:
        cross_process.close_pool()  # peers started for tests that did not come


def pool_cfg(memory_size: int = POOL_BYTES, page_shift: int | None = PAGE_SHIFT) -> str:
    cfg: dict[str, int] = {"memory_size": memory_size}
    if page_shift is not None:
        cfg["page_shift"] = page_shift
    return json.dumps(cfg)


def make_options(
    *,
    device_pool: str | None = None,
    host_pool: str | None = None,
    remote_accessible: bool | None = None,
    cache_manager: bool = True,
    transport: str = "loopback",
    listen: str | None = None,
    sync_kv_timeout: int | None = None,
    same_host: bool | None = None,
    link_secret: str | bytes | None = None,
    ucx: bool | None = None,
) -> dict[str, str]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = cache_manager
    cfg.transport = transport
    if listen is not None:
        cfg.listen_ip_info = listen
    if sync_kv_timeout is not None:
        cfg.sync_kv_timeout = sync_kv_timeout
    if same_host is not None:
        cfg.same_host = same_host
    if link_secret is not None:
        cfg.link_secret = link_secret
    if ucx is not None:
        cfg.ucx = ucx
    if device_pool is not None:
        cfg.mem_pool_cfg = device_pool
    if host_pool is not None:
        cfg.host_mem_pool_cfg = host_pool
    if remote_accessible is not None:
        cfg.enable_remote_cache_accessible = remote_accessible
    return dict(cfg.generate_options())


class AwaitableProxy:
    """Presents a blocking object with the async facade's calling convention.

    Every method that is a coroutine on the async face becomes one here, running the blocking
    call in place; so one scenario, written with ``await``, runs through both faces.
    """

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not callable(attr) or name == "pool_stats":
            return attr

        @functools.wraps(attr)
        async def call(*args: Any, **kwargs: Any) -> Any:
            return attr(*args, **kwargs)

        return call


class Face:
    """One engine reached through the blocking API or the async facade."""

    def __init__(self, kind: str, role: LLMRole = LLMRole.PROMPT, cluster_id: int = 1) -> None:
        self.kind = kind
        if kind == "sync":
            self.dd: Any = LLMDataDist(role, cluster_id)
        else:
            self.dd = llm_datadist.AsyncLLMDataDist(role, cluster_id)

    async def init(self, options: dict[str, str]) -> None:
        result = self.dd.init(options)
        if inspect.isawaitable(result):
            await result

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a method of either face, awaiting it when it is a coroutine."""
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def finalize(self) -> None:
        result = self.dd.finalize()
        if inspect.isawaitable(result):
            await result

    @property
    def cm(self) -> Any:
        cm = self.dd.cache_manager
        return AwaitableProxy(cm) if self.kind == "sync" else cm

    def pool_used(self) -> dict[Placement, int]:
        cm = self.dd.cache_manager
        used = {}
        for placement in (Placement.DEVICE, Placement.HOST):
            stats = cm.pool_stats(placement)
            if stats is not None:
                used[placement] = stats.used
        return used


@pytest.fixture(params=["sync", "async"])
def face_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def face(face_kind: str) -> AsyncIterator[Face]:
    """An initialised engine with a 64 MiB device pool and a 64 MiB host pool.

    At teardown every test must have returned all pool memory (leak guard).
    """
    f = Face(face_kind)
    await f.init(make_options(device_pool=pool_cfg(), host_pool=pool_cfg()))
    try:
        yield f
        leaked = await leaked_pool_memory(f)
        assert not leaked, f"pool memory leaked: {leaked}"
    finally:
        await f.finalize()


@pytest.fixture
async def make_face(face_kind: str) -> AsyncIterator[Callable[..., Face]]:
    """Build un-initialised engines of the parametrised face; all are finalized afterwards."""
    made: list[Face] = []

    def factory(role: LLMRole = LLMRole.PROMPT, cluster_id: int = 1) -> Face:
        f = Face(face_kind, role, cluster_id)
        made.append(f)
        return f

    yield factory
    for f in made:
        await f.finalize()


@dataclass
class Cleanup:
    """Undo steps a test registers as it goes (``cleanup(fn)``), run in reverse order."""

    items: list[Callable[[], object]] = field(default_factory=list)

    def __call__(self, fn: Callable[[], object]) -> None:
        self.items.append(fn)


@pytest.fixture
def cleanup() -> Iterator[Cleanup]:
    c = Cleanup()
    yield c
    for fn in reversed(c.items):
        fn()


@pytest.fixture(autouse=True)
def _no_live_blocking_engine() -> Iterator[None]:
    """Every test must finalize the blocking LLMDataDist it initialised."""
    yield
    live = LLMDataDist._live
    if live is not None:
        live.finalize()
        pytest.fail("a test left a blocking LLMDataDist initialised")


@pytest.fixture
async def loop_lag() -> AsyncIterator[list[float]]:
    """Samples event-loop lag (seconds) every millisecond while the test runs."""
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    task = asyncio.create_task(ticker())
    yield lags
    stop.set()
    await task


async def leaked_pool_memory(face: Face, wait_s: float = 5.0) -> dict[str, int]:
    """Pool memory ``face`` still holds, by placement, after waiting up to ``wait_s`` for it
    to come back: memory a failed call's requests hold returns once the transport has ended
    every one of them, which may be an instant after the call raised."""
    deadline = time.monotonic() + wait_s
    while True:
        leaked = {str(k): v for k, v in face.pool_used().items() if v}
        if not leaked or time.monotonic() > deadline:
            return leaked
        await asyncio.sleep(0.01)


async def fresh_ticks(lags: list[float]) -> int:
    """Wait for ``loop_lag``'s ticker to record a tick; return the index from which its ticks
    measure only what follows this call. A tick spans whatever held the loop before it, so
    work the test itself did on the loop (making a pattern, say) is charged to the ticks
    before that index, not to the transfer that follows."""
    seen = len(lags)
    while len(lags) == seen:
        await asyncio.sleep(0.001)
    return len(lags)


async def push_blocks(face: Face, *args: Any, **kwargs: Any) -> None:
    """Run push_blocks through either face: the blocking call raises its failure, and the
    async face's ``CacheTask`` raises the same when awaited."""
    result = await face.cm.push_blocks(*args, **kwargs)
    # None from the blocking call, LLM_SUCCESS from the awaited task.
    assert result in (None, llm_datadist.LLMStatusCode.LLM_SUCCESS)
