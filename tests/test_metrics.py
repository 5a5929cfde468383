"""Metrics per transfer: ``stats()`` of both faces, the failure log, the switch, and the
Prometheus export, over the loopback transport and over TCP (link and same-host routes)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataDistStats,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist._transport.base import RequestKind
from aio_datadist.metrics import PrometheusCollector
from aio_datadist.stats import BUCKETS_S
from aio_datadist.testing import LinkedPair, linked_pair
from tests.conftest import make_options, pool_cfg

S = LLMStatusCode
DESC = CacheDesc(2, [8, 1024], DataType.DT_UINT8, Placement.DEVICE)
BLOCK = 1024


async def caches(pair: LinkedPair) -> tuple[object, object]:
    src = await pair.prompt.cache_manager.allocate_blocks_cache(
        DESC, BlocksCacheKey(pair.prompt_cluster_id, 0)
    )
    dst = await pair.decoder.cache_manager.allocate_blocks_cache(DESC)
    return src, dst


async def pull(pair: LinkedPair, dst: object, blocks: list[int]) -> None:
    await pair.decoder.cache_manager.pull_blocks(
        BlocksCacheKey(pair.prompt_cluster_id, 0), dst, blocks, blocks
    )


async def test_stats_count_transfers_by_route_op_status_and_peer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aio_datadist")
    async with linked_pair() as pair:
        _, dst = await caches(pair)
        for _ in range(3):
            await pull(pair, dst, [1, 2])
        pair.faults.fail_next(1, S.LLM_TIMEOUT)
        with pytest.raises(LLMException):
            await pull(pair, dst, [3])
        with pytest.raises(LLMException) as info:  # refused by the peer: no such key
            await pair.decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 9), dst, [0], [0])
        assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
        stats = pair.decoder.stats()
    assert isinstance(stats, DataDistStats) and stats.metrics and stats.cluster_id == 2
    (route,) = stats.routes
    assert (route.route, route.op) == ("link", "pull")
    assert route.by_status == {"LLM_SUCCESS": 3, "LLM_TIMEOUT": 1, "LLM_KV_CACHE_NOT_EXIST": 1}
    assert route.count == 5 and route.failed == 2
    assert route.bytes == 3 * 2 * 2 * BLOCK  # 3 pulls of 2 blocks of 2 tensors
    assert sum(route.buckets) == 5 and len(route.buckets) == len(BUCKETS_S) + 1
    assert 0 < route.p50_us <= route.p90_us <= route.p99_us <= route.max_us
    assert stats.transfers == 5 and stats.failed == 2 and stats.bytes == route.bytes
    assert stats.bytes_by_route() == {"link": route.bytes}
    (peer,) = stats.peers
    assert (peer.cluster_id, peer.transfers, peer.failed, peer.bytes) == (1, 5, 2, route.bytes)
    assert set(stats.links) == {1} and stats.link_routes == {1: ("link", "staged-link")}
    assert stats.pools["DEVICE"].used > 0 and stats.pools["DEVICE"].capacity >= 64 << 20
    failed = [r for r in caplog.records if r.getMessage().startswith("transfer.failed")]
    assert len(failed) == 2
    timeout, missing = (r.getMessage() for r in failed)
    assert "status=LLM_TIMEOUT" in timeout and "model_id=0" in timeout and "route=link" in timeout
    assert failed[0].levelno == logging.WARNING and failed[1].levelno == logging.INFO
    assert "status=LLM_KV_CACHE_NOT_EXIST" in missing and "model_id=9" in missing


async def test_a_failure_log_names_the_req_id_of_a_key_pull(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aio_datadist")
    async with linked_pair(options={"llm.EnableRemoteCacheAccessible": "0"}) as pair:
        dst = await pair.decoder.cache_manager.allocate_cache(
            CacheDesc(1, [1, 64], DataType.DT_UINT8)
        )
        with pytest.raises(LLMException):
            await pair.decoder.cache_manager.pull_cache(CacheKey(1, req_id=77), dst, 0)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("transfer.failed")]
    assert "req_id=77" in record.getMessage()


async def test_metrics_off_records_nothing() -> None:
    async with linked_pair(options={"aio.Metrics": "0"}) as pair:
        _, dst = await caches(pair)
        await pull(pair, dst, [1])
        stats = pair.decoder.stats()
    assert not stats.metrics and stats.routes == () and stats.peers == ()
    assert stats.transfers == 0 and set(stats.links) == {1}


def test_the_recorder_folds_what_ended_and_keeps_the_last_durations() -> None:
    # Recording only queues; a reader, or the recorder once FOLD_AT wait, folds the queue:
    # nothing is lost or counted twice, and the percentiles cover the last RECENT transfers.
    from aio_datadist._engine import metrics as m
    from aio_datadist._engine.request import RemoteBlocks, Transfer
    from aio_datadist._log import get_logger
    from aio_datadist._transport.base import RequestKind
    from aio_datadist._transport.deadlines import now_ns
    from aio_datadist.stats import RECENT

    recorder = m.TransferMetrics(get_logger("test"))
    remote = RemoteBlocks(0, 0, 1, [1], 100)
    t = Transfer(RequestKind.PULL, 7, remote, None, None, nbytes=100)  # type: ignore[arg-type]
    base = now_ns()
    n = RECENT + m.FOLD_AT + 5
    for i in range(n):
        # the oldest transfers are slow, the last RECENT fast (they start later)
        recorder.record("same-host", t, base - (10**9 if i < n - RECENT else 1000), None)
        assert len(recorder._ended) < m.FOLD_AT
    failed = LLMException("gone", status_code=S.LLM_LINK_FAILED)
    recorder.record("link", t, now_ns(), failed)
    (link, same) = recorder.routes()
    assert (same.route, same.op, same.by_status, same.bytes) == (
        "same-host",
        "pull",
        {"LLM_SUCCESS": n},
        100 * n,
    )
    assert sum(same.buckets) == n and same.max_us < 10**6  # the slow ones left the window
    assert link.by_status == {"LLM_LINK_FAILED": 1} and link.bytes == 0
    assert [(p.cluster_id, p.transfers, p.failed, p.bytes) for p in recorder.peers()] == [
        (7, n + 1, 1, 100 * n)
    ]
    assert not recorder._ended


def test_a_bad_metrics_option_is_refused() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    with pytest.raises(LLMException) as info:
        dd.init({**make_options(device_pool=pool_cfg()), "aio.Metrics": "yes"})
    assert info.value.status_code == S.LLM_PARAM_INVALID


def test_the_blocking_face_has_stats_and_refuses_before_init() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 5)
    with pytest.raises(RuntimeError):
        dd.stats()
    dd.init(make_options(device_pool=pool_cfg()))
    try:
        stats = dd.stats()
        assert stats.cluster_id == 5 and stats.transfers == 0 and stats.links == {}
        assert set(stats.pools) == {"DEVICE"}
    finally:
        dd.finalize()
    with pytest.raises(RuntimeError):
        dd.stats()


@pytest.fixture(params=[False, True], ids=["link", "same-host"])
async def tcp_pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[LinkedPair, bool]]:
    """A pair linked over TCP, and whether the same-host route is allowed."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    same_host = request.param
    prompt = AsyncLLMDataDist(LLMRole.PROMPT, 1)
    decoder = AsyncLLMDataDist(LLMRole.DECODER, 2)
    opts = dict(device_pool=pool_cfg(), remote_accessible=True, transport="tcp")
    await prompt.init(make_options(**opts, listen=f"127.0.0.1:{port}", same_host=same_host))
    await decoder.init(make_options(**opts, same_host=same_host))
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info("127.0.0.1", port)
    try:
        assert (await decoder.link_clusters([info], 5000))[0] == S.LLM_SUCCESS
        yield LinkedPair(prompt, decoder), same_host
    finally:
        await decoder.finalize()
        await prompt.finalize()


async def test_the_route_of_each_transfer_is_named(tcp_pair: tuple[LinkedPair, bool]) -> None:
    pair, same_host = tcp_pair
    src, dst = await caches(pair)
    for view in src.as_numpy():  # type: ignore[attr-defined]
        view[...] = 3
    await pull(pair, dst, [4, 5])
    await pair.decoder.cache_manager.push_blocks(BlocksCacheKey(1, 0), dst, [4], [6])
    assert all((v[6] == 3).all() for v in src.as_numpy())  # type: ignore[attr-defined]
    stats = pair.decoder.stats()
    names = {(r.route, r.op): r.count for r in stats.routes}
    route = "same-host" if same_host else "link"
    assert names == {(route, "pull"): 1, (route, "push"): 1}
    assert stats.link_routes[1][-2:] == ("link", "staged-link") and route in stats.link_routes[1]
    assert np.isclose(sum(r.bytes for r in stats.routes), 3 * 2 * BLOCK)


async def test_the_prometheus_export(tcp_pair: tuple[LinkedPair, bool]) -> None:
    pair, _ = tcp_pair
    _, dst = await caches(pair)
    await pull(pair, dst, [1])
    registry = CollectorRegistry()
    PrometheusCollector(pair.decoder, pair.prompt).register(registry)
    text = generate_latest(registry).decode()
    route = next(r.route for r in pair.decoder.stats().routes)
    labels = f'cluster_id="2",op="pull",route="{route}"'
    assert f'aio_datadist_transfers_total{{{labels},status="LLM_SUCCESS"}} 1.0' in text
    assert f"aio_datadist_transfer_bytes_total{{{labels}}} {2 * BLOCK}.0" in text
    inf = f'cluster_id="2",le="+Inf",op="pull",route="{route}"'
    assert f"aio_datadist_transfer_duration_seconds_bucket{{{inf}}} 1.0" in text
    assert f"aio_datadist_transfer_duration_seconds_count{{{labels}}} 1.0" in text
    assert 'aio_datadist_peer_transfers_total{cluster_id="2",peer="1"} 1.0' in text
    assert 'aio_datadist_link_queued_bytes{cluster_id="1",peer="2"}' in text
    assert 'aio_datadist_pool_used_bytes{cluster_id="1",placement="DEVICE"}' in text
    with pytest.raises(TypeError):
        PrometheusCollector(object())  # type: ignore[arg-type]


def test_an_engine_not_initialised_exports_nothing() -> None:
    registry = CollectorRegistry()
    PrometheusCollector(LLMDataDist(LLMRole.PROMPT, 3)).register(registry)
    assert "aio_datadist_transfers_total{" not in generate_latest(registry).decode()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["link", "ucx"]),
            st.sampled_from([RequestKind.PULL, RequestKind.PUSH]),
            st.integers(0, 2),
            st.sampled_from([int(S.LLM_SUCCESS), int(S.LLM_TIMEOUT)]),
            st.integers(0, 1 << 20),
            st.integers(0, 10**10),
        ),
        max_size=300,
    ),
    st.lists(st.integers(1, 40), min_size=1, max_size=5),
)
def test_folding_in_any_steps_gives_the_figures_of_every_transfer(
    rows: list[tuple[str, RequestKind, int, int, int, int]], steps: list[int]
) -> None:
    # Transfers of several routes, ops and peers folded a few at a time, then the rest: the
    # counts, bytes, histogram and durations are those of all of them, one by one.
    import bisect

    from aio_datadist._engine import metrics as m
    from aio_datadist._log import get_logger
    from aio_datadist.stats import BUCKETS_S

    recorder = m.TransferMetrics(get_logger("test"))
    for i, row in enumerate(rows):
        recorder._ended.append(row)
        recorder._fold(steps[i % len(steps)] if i % 7 == 0 else 0)
    routes = {(r.route, r.op): r for r in recorder.routes()}
    bounds = [int(b * 1e9) for b in BUCKETS_S]
    for (route, kind), snap in routes.items():
        mine = [r for r in rows if (r[0], r[1].value) == (route, kind)]
        assert sum(snap.by_status.values()) == len(mine)
        assert snap.bytes == sum(r[4] for r in mine)
        assert round(snap.seconds * 1e9) == sum(r[5] for r in mine)
        expected = [0] * (len(BUCKETS_S) + 1)
        for r in mine:
            expected[bisect.bisect_left(bounds, r[5])] += 1
        assert list(snap.buckets) == expected
        assert snap.max_us == max(r[5] for r in mine) / 1e3
    assert len(routes) == len({(r[0], r[1]) for r in rows})
    peers = {p.cluster_id: p for p in recorder.peers()}
    for cluster_id, p in peers.items():
        mine = [r for r in rows if r[2] == cluster_id]
        failed = sum(r[3] != int(S.LLM_SUCCESS) for r in mine)
        assert (p.transfers, p.failed, p.bytes) == (len(mine), failed, sum(r[4] for r in mine))


@pytest.mark.parametrize("written", [0, 3, 4090, 4096, 9000])
@pytest.mark.parametrize("count", [0, 1, 7, 4096, 5000])
def test_the_ring_keeps_the_last_durations_in_their_places(written: int, count: int) -> None:
    import array

    from aio_datadist._engine.metrics import _ring_write
    from aio_datadist.stats import RECENT

    ring = array.array("q", bytes(8 * RECENT))
    model = [0] * RECENT
    values = tuple(range(1, count + 1))
    for i, v in enumerate(values):
        model[(written + i) % RECENT] = v
    _ring_write(ring, written, values)
    assert list(ring) == model
