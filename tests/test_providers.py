"""Route providers: the engine knows them by one interface and one list, so a new way of
moving bytes is one package plus one line in ``aio_datadist._routes.PROVIDERS``."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMStatusCode,
    Placement,
)
from aio_datadist._engine import engine as engine_module
from aio_datadist._engine.access import Access, Target, encode_access
from aio_datadist._engine.request import Completion, Transfer
from aio_datadist._engine.routes import LinkRoute, Route, placed
from aio_datadist._routes.catalog import PROVIDERS
from aio_datadist._routes.provider import LinkHandle, Opening, ProviderSpec, RouteProvider
from aio_datadist._transport._wire import HelloExtension
from aio_datadist._transport.base import Channel, Hello
from aio_datadist._transport.handshake import hello_from_wire, hello_to_wire
from aio_datadist.enums import LLMRole
from aio_datadist.status import LLMException
from aio_datadist.testing import linked_pair

S = LLMStatusCode
#: A record type no transport reads: the probe's offer.
PROBE_RECORD = 0x7F01
DESC = CacheDesc(2, [4, 64], DataType.DT_UINT8, Placement.DEVICE)


class ProbeRoute(Route):
    """Host rows over the link, counted: a route that ranks before the link's own."""

    name = "probe"
    rank = 45

    def __init__(self, channel: Channel) -> None:
        self.inner = LinkRoute(channel)
        self.started = 0

    def accepts(self, transfer: Transfer) -> bool:
        return self.inner.accepts(transfer)

    def link(self) -> Any:
        return self.inner.link()

    def in_caller(self, transfer: Transfer) -> bool:
        return self.inner.in_caller(transfer)

    def start(self, transfer: Transfer, deadline_ns: int) -> Completion | None:
        self.started += 1
        return self.inner.start(transfer, deadline_ns)


@dataclass
class Probe(RouteProvider):
    """Records what the engine tells it."""

    cluster_id: int
    attached: list[Channel] = field(default_factory=list)
    detached: list[Channel] = field(default_factory=list)
    routes: list[ProbeRoute] = field(default_factory=list)
    closed: int = 0

    def offer(self, hello: Hello) -> Hello:
        return hello.offering(PROBE_RECORD, b"probe %d" % self.cluster_id)

    def attach(self, link: LinkHandle) -> None:
        self.attached.append(link.channel)
        if link.channel.peer.offered(PROBE_RECORD) is None:
            return
        route = ProbeRoute(link.channel)
        if link.place(lambda routes: placed(routes, (route,), ProbeRoute)):
            self.routes.append(route)

    def detach(self, channel: Channel) -> None:
        self.detached.append(channel)

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> dict[int, Probe]:
    """Every engine initialised in the test gets a probe provider, by cluster id."""
    made: dict[int, Probe] = {}

    def open_probe(opening: Opening) -> Probe:
        made[opening.cluster_id] = Probe(opening.cluster_id)
        return made[opening.cluster_id]

    spec = ProviderSpec("probe", open_probe)
    monkeypatch.setattr(engine_module, "PROVIDERS", (*PROVIDERS, spec))
    return made


async def test_a_listed_provider_takes_part_in_every_link(probes: dict[int, Probe]) -> None:
    async with linked_pair() as pair:
        prompt, decoder = probes[pair.prompt_cluster_id], probes[pair.decoder_cluster_id]
        link = pair.decoder._engine.link_table().get(pair.prompt_cluster_id)
        assert link is not None
        assert decoder.attached == [link.channel] and len(prompt.attached) == 1
        # Its offer crossed the handshake; its route sits by rank, before the link's own.
        assert link.remote.offered(PROBE_RECORD) == b"probe %d" % pair.prompt_cluster_id
        names = [r.name for r in link.routes]
        assert names.index("probe") == names.index("link") - 1
        assert pair.decoder.stats().link_routes[pair.prompt_cluster_id] == tuple(names)

        key = BlocksCacheKey(pair.prompt_cluster_id, 0)
        src = await pair.prompt.cache_manager.allocate_blocks_cache(DESC, key)
        dst = await pair.decoder.cache_manager.allocate_blocks_cache(DESC)
        for t, view in enumerate(src.as_numpy()):
            view[...] = np.arange(4 * 64).reshape(4, 64) % 199 + t
        await pair.decoder.cache_manager.pull_blocks(key, dst, [1, 3], [0, 2])
        assert decoder.routes[0].started == 1  # the transfer took the provider's route
        for s, d in zip(src.as_numpy(), dst.as_numpy(), strict=True):
            assert (d[[0, 2]] == s[[1, 3]]).all()
        await pair.decoder.cache_manager.deallocate_blocks_cache(dst)
        await pair.prompt.cache_manager.deallocate_blocks_cache(src)

        await pair.decoder.unlink_clusters([_cluster(pair.prompt_cluster_id)], force=True)
        assert decoder.detached == [link.channel]  # told once the link left
    # Each engine closed its provider once, at finalize.
    assert prompt.closed == decoder.closed == 1


async def test_a_provider_never_places_routes_on_a_link_that_went(
    probes: dict[int, Probe],
) -> None:
    async with linked_pair() as pair:
        table = pair.decoder._engine.link_table()
        link = table.get(pair.prompt_cluster_id)
        assert link is not None
        await pair.decoder.unlink_clusters([_cluster(pair.prompt_cluster_id)], force=True)
        before = list(link.routes)
        assert not table._place(link, lambda routes: [])  # the handle's place()
        assert link.routes == before


async def test_a_control_request_of_a_provider_that_is_off_names_its_setting() -> None:
    async with linked_pair() as pair:  # no aio.Ucx on either side
        link = pair.decoder._engine.link_table().get(pair.prompt_cluster_id)
        assert link is not None
        payload = np.zeros(64, dtype=np.uint8)
        rows = np.array([[payload.ctypes.data, 64]], dtype=np.uint64)
        body = encode_access(Access(Target.UCX_TABLE, ident=1))
        deadline = time.monotonic_ns() + 5_000_000_000
        future: Future[None] = link.channel.push(body, rows, 64, deadline)
        error = await asyncio.to_thread(future.exception, 10)
        assert isinstance(error, LLMException)
        assert error.status_code == S.LLM_FEATURE_NOT_ENABLED
        assert "UCX_TABLE" in str(error) and "aio.Ucx" in str(error)


_RECORD_TYPES = st.integers(0, 0xFFFF).filter(
    lambda k: (
        k not in (HelloExtension.AUTH_NONCE, HelloExtension.COMM_NAME, HelloExtension.HOST_PRESENCE)
    )
)


@given(
    offers=st.dictionaries(_RECORD_TYPES, st.binary(max_size=64), max_size=6),
    cluster_id=st.integers(0, 2**64 - 1),
)
def test_the_handshake_carries_offers_it_does_not_read(
    offers: dict[int, bytes], cluster_id: int
) -> None:
    hello = Hello(cluster_id, LLMRole.DECODER)
    for kind, body in offers.items():
        hello = hello.offering(kind, body)
    assert hello_from_wire(hello_to_wire(hello)) == (hello, None)
    for kind, body in offers.items():
        assert hello.offered(kind) == body


def _cluster(cluster_id: int) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    return info
