"""The UCX route: selection, route order, the table and its release protocol, refusals, leaks.

The transfer, cross-process and fault suites run every scenario over the route as well
(``ucx``, ``ucx-tcp``); this module checks what is the route's own: both ends must enable
it (a clear error without UCX installed), where it sits among a link's routes, the table a
peer sends (decoded as untrusted input), the release protocol (a release racing a transfer
fails that transfer with ``LLM_KV_CACHE_NOT_EXIST`` and the memory returns only once the
transfer ended; a peer that does not acknowledge loses its link), that accesses outside the
peer's caches are refused before UCX sees them, and that links leave no descriptors or
threads behind. Tests that need UCX skip without it; the selection and codec tests do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aio_datadist
from aio_datadist import (
    AsyncLLMDataDist,
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist._engine.access import Access, Target, encode_access
from aio_datadist._engine.regions import BoardEntry
from aio_datadist._engine.routes import (
    Carrier,
    LinkRoute,
    Route,
    Staged,
    link_routes,
    placed,
)
from aio_datadist._native import ucx as native
from aio_datadist._native import wire
from aio_datadist._native._ffi import ffi
from aio_datadist._native.api import UcxCalls
from aio_datadist._routes.hccl.route import CommunicatorRoute
from aio_datadist._routes.samehost.route import DeviceIpcRoute, SameHostRoute
from aio_datadist._routes.ucx import board as ucxboard
from aio_datadist._routes.ucx import route as ucx_route
from aio_datadist._routes.ucx import worker as ucx
from aio_datadist._routes.ucx.lanes import LANE_MIN_BYTES
from aio_datadist._routes.ucx.links import UcxLinks
from aio_datadist._routes.ucx.remote import UcxRemote
from aio_datadist._routes.ucx.route import UcxRoute
from aio_datadist._routes.ucx.table import KeySpans, UcxKey, decode_table, encode_table
from aio_datadist._transport import WireError
from aio_datadist._transport.base import RequestKind
from tests.conftest import Face, make_options, pool_cfg
from tests.providers import ucx_links

S = LLMStatusCode
needs_ucx = pytest.mark.skipif(
    ucx.available() is not None, reason=f"UCX is not available: {ucx.available()}"
)
_ports = itertools.count(33000)
TENSORS, BLOCKS, BLOCK_BYTES = 4, 16, 64 * 1024


def blocks_desc(blocks: int = BLOCKS) -> CacheDesc:
    return CacheDesc(TENSORS, [blocks, BLOCK_BYTES], DataType.DT_UINT8, Placement.DEVICE)


def routes_of(engine: Any, cluster_id: int) -> list[str]:
    link = engine._engine.link_table().get(cluster_id)
    assert link is not None
    return [r.name for r in link.routes]


@dataclass
class Pair:
    """A listening async prompt (cluster 1) and a decoder (cluster 2) of either face."""

    prompt: AsyncLLMDataDist
    decoder: Any  # a Face, or a blocking LLMDataDist
    info: LLMClusterInfo

    async def settled(self) -> None:
        """Wait until the decoder applied the prompt's current UCX table (a cache made after
        the link reaches the route once its table arrived; the link carries it until then)."""
        await tables_settled(self.prompt, self.decoder, 1)

    async def link(self) -> None:
        dd = self.decoder.dd if isinstance(self.decoder, Face) else self.decoder
        if isinstance(self.decoder, Face):
            ret, _ = await self.decoder.call(dd.link_clusters, [self.info], 5000)
        else:
            ret, _ = await asyncio.to_thread(dd.link_clusters, [self.info], 5000)
        assert ret == S.LLM_SUCCESS


async def tables_settled(owner: Any, requester: Any, cluster_id: int) -> None:
    """Wait until ``requester`` applied ``owner``'s current UCX table on its link."""
    dd = requester.dd if isinstance(requester, Face) else requester
    link = dd._engine.link_table().get(cluster_id)
    remote = ucx_links(dd._engine).route_of(link.channel)
    seq = ucx_links(owner._engine).board.seq
    for _ in range(500):
        if remote.seq >= seq:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"table {seq} never applied (at {remote.seq})")


@pytest.fixture
async def make_pair() -> AsyncIterator[Callable[..., Any]]:
    """Pairs over loopback (the default) or TCP; each end enables UCX as asked."""
    made: list[Pair] = []

    async def factory(
        *,
        transport: str = "loopback",
        prompt_ucx: bool = True,
        decoder_ucx: bool = True,
        decoder: str = "async",
        same_host: bool = False,
        secret: str | None = None,
        link: bool = True,
        lanes: int | None = None,
    ) -> Pair:
        port = 0 if transport == "tcp" else next(_ports)

        def options(ucx_on: bool, listen: str | None = None) -> dict[str, str]:
            cfg = make_options(
                device_pool=pool_cfg(),
                remote_accessible=True,
                transport=transport,
                sync_kv_timeout=5000,
                same_host=same_host,
                link_secret=secret,
                ucx=ucx_on,
                listen=listen,
            )
            if lanes is not None:
                cfg["aio.UcxLanes"] = str(lanes)
            return cfg

        prompt = AsyncLLMDataDist(LLMRole.PROMPT, 1)
        await prompt.init(options(prompt_ucx, f"127.0.0.1:{port}"))
        if decoder == "blocking":
            dd: Any = LLMDataDist(LLMRole.DECODER, 2)
            dd.init(options(decoder_ucx))
        else:
            dd = Face(decoder, LLMRole.DECODER, 2)
            await dd.init(options(decoder_ucx))
        address = prompt._engine.link_table().listen_address
        assert address is not None
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", address[1])
        pair = Pair(prompt, dd, info)
        made.append(pair)
        if link:
            await pair.link()
        return pair

    yield factory
    for pair in made:
        if isinstance(pair.decoder, Face):
            await pair.decoder.finalize()
        else:
            pair.decoder.finalize()
        await pair.prompt.finalize()


# -- selection ----------------------------------------------------------------------------
@needs_ucx
def test_features_name_the_ucx_loaded() -> None:
    info = ucx.ucx_info()
    features = aio_datadist.features
    assert {"ucx", f"ucx:version={info['version']}", f"ucx:path={info['path']}"} <= features
    assert {f"ucx:transport={tl}" for tl in info["transports"]} <= features
    assert "ucx:memory=host" in features
    assert "runtime:host" in features and "pool" in features


async def test_enabling_ucx_without_ucx_fails_at_init_saying_why(
    make_face: Callable[..., Face], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    missing = tmp_path / "no-such-libucp.so"
    monkeypatch.setenv(native.ENV_VAR, str(missing))
    native._reset_for_tests()
    try:
        face = make_face()
        with pytest.raises(LLMException) as info:
            await face.init(make_options(device_pool=pool_cfg(), ucx=True))
        assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED
        message = str(info.value)
        assert "aio.Ucx=1" in message and str(missing) in message, message
        assert not face.dd._engine.initialized
        # nothing else changes: the same engine initialises without the route
        await face.init(make_options(device_pool=pool_cfg()))
        assert ucx_links(face.dd._engine) is None
    finally:
        monkeypatch.delenv(native.ENV_VAR)
        native._reset_for_tests()


async def test_the_option_takes_one_or_zero(make_face: Callable[..., Face]) -> None:
    options = make_options(device_pool=pool_cfg())
    options["aio.Ucx"] = "yes"
    with pytest.raises(LLMException) as info:
        await make_face().init(options)
    assert info.value.status_code == S.LLM_PARAM_INVALID and "aio.Ucx" in str(info.value)
    cfg = LLMConfig()
    assert cfg.ucx is None and "aio.Ucx" not in cfg.generate_options()
    cfg.ucx = False
    assert cfg.generate_options()["aio.Ucx"] == "0"
    with pytest.raises(TypeError):
        cfg.ucx = "1"  # type: ignore[assignment]


async def test_the_lanes_option_takes_one_to_eight(make_face: Callable[..., Face]) -> None:
    for bad in ("0", "9", "two"):
        options = make_options(device_pool=pool_cfg())
        options["aio.UcxLanes"] = bad
        with pytest.raises(LLMException) as info:
            await make_face().init(options)
        assert info.value.status_code == S.LLM_PARAM_INVALID and "aio.UcxLanes" in str(info.value)
    cfg = LLMConfig()
    assert cfg.ucx_lanes is None and "aio.UcxLanes" not in cfg.generate_options()
    cfg.ucx_lanes = 3
    assert cfg.generate_options()["aio.UcxLanes"] == "3"
    for wrong in (0, 9):
        with pytest.raises(LLMException):
            cfg.ucx_lanes = wrong
    with pytest.raises(TypeError):
        cfg.ucx_lanes = "2"  # type: ignore[assignment]


@needs_ucx
@pytest.mark.parametrize(("prompt_ucx", "decoder_ucx"), [(True, False), (False, True)])
async def test_both_ends_must_enable_it(
    make_pair: Callable[..., Any], prompt_ucx: bool, decoder_ucx: bool
) -> None:
    pair = await make_pair(prompt_ucx=prompt_ucx, decoder_ucx=decoder_ucx)
    assert routes_of(pair.decoder.dd, 1) == ["link", "staged-link"]
    assert routes_of(pair.prompt, 2) == ["link", "staged-link"]
    src = await pair.prompt.cache_manager.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    dst = await pair.decoder.cm.allocate_blocks_cache(blocks_desc())
    src.as_numpy()[1][3] = 9
    await pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), dst, [3], [0])
    assert (dst.as_numpy()[1][0] == 9).all()
    await pair.decoder.cm.deallocate_blocks_cache(dst)
    await pair.prompt.cache_manager.deallocate_blocks_cache(src)


@needs_ucx
@pytest.mark.parametrize("face_kind", ["sync", "async"])
async def test_one_worker_per_engine_in_multi_thread_mode(
    make_pair: Callable[..., Any], face_kind: str
) -> None:
    pair = await make_pair(decoder=face_kind)
    assert routes_of(pair.decoder.dd, 1)[:2] == ["ucx", "staged-ucx"]
    assert routes_of(pair.prompt, 2)[:2] == ["ucx", "staged-ucx"]
    links = ucx_links(pair.decoder.dd._engine)
    assert links.worker.thread_mode == native.UCS_THREAD_MODE_MULTI
    route = next(r for r in pair.decoder.dd._engine.link_table().get(1).routes if r.name == "ucx")
    assert route.progress.worker is links.worker  # every link of the engine shares it


# -- where the route sits -------------------------------------------------------------------
class _Carrier(Carrier):
    name = "ucx"
    rank = 40

    def accepts(self, transfer: Any) -> bool:
        return True

    def start(self, transfer: Any, deadline_ns: int, waiting: Any) -> Any:
        return None

    def send(self, transfer: Any, local: Any, deadline_ns: int) -> Any:
        return None


def test_the_route_order() -> None:
    channel: Any = type("Channel", (), {"streams": True})()
    staging: Any = object()
    peer: Any = object()

    def with_carrier(routes: list[Route]) -> list[Route]:
        carrier = _Carrier()
        return placed(routes, (carrier, Staged(carrier, staging)), _Carrier)

    def with_peer_memory(routes: list[Route]) -> list[Route]:
        added = (SameHostRoute(peer), DeviceIpcRoute(peer))
        return placed(routes, added, (SameHostRoute, DeviceIpcRoute))

    base = link_routes(channel, staging)
    ucx_first = with_peer_memory(with_carrier(base))
    proof_first = with_carrier(with_peer_memory(base))
    order = ["same-host", "device-ipc", "ucx", "staged-ucx", "link", "staged-link"]
    assert [r.name for r in ucx_first] == [r.name for r in proof_first] == order
    domain = CommunicatorRoute.__new__(CommunicatorRoute)  # only its place is looked at
    with_domain = placed(ucx_first, (domain,), CommunicatorRoute)
    assert [r.name for r in with_domain] == ["same-host", "communicator", *order[1:]]
    again = with_carrier(ucx_first)  # a new table's route replaces it
    assert [r.name for r in again] == order
    staged = next(r for r in again if r.name == "staged-ucx")
    assert isinstance(staged, Staged) and isinstance(staged.inner, _Carrier)
    assert isinstance(again[-2], LinkRoute)


# -- the table --------------------------------------------------------------------------------
KEYS = [
    UcxKey(0x10000, 0x100000, "host", b"rkey-a"),
    UcxKey(0x400000, 0x10000, "cuda", b"rkey-b"),
]
ENTRIES = [
    BoardEntry(1, 7, 4096, 8, 32768, (0x10000, 0x18000)),
    BoardEntry(2, -1, 1024, 4, 4096, (0x400000,)),
]


def test_a_table_round_trips() -> None:
    host = bytes(range(wire.UCX_HOST_SIZE))
    table = decode_table(encode_table(42, b"worker-address", host, KEYS, ENTRIES))
    assert (table.seq, table.address, table.host, table.keys) == (
        42,
        b"worker-address",
        host,
        tuple(KEYS),
    )
    assert table.regions.by_id == {e.cache_id: e for e in ENTRIES}
    assert table.regions.by_model[7] == ENTRIES[0]


@pytest.mark.parametrize(
    ("keys", "entries", "why"),
    [
        ([KEYS[0]], ENTRIES, "no UCX registration"),  # a tensor outside every key
        ([UcxKey(0x10000, 0x1000, "host", b"k")], ENTRIES[:1], "no UCX registration"),
        ([UcxKey(2**64 - 16, 32, "host", b"k")], [], "malformed UCX registration"),
        # ends exactly at 2**64: no uint64 holds its end (found by tools/fuzz.py)
        ([UcxKey(2**64 - 16, 16, "host", b"k")], [], "malformed UCX registration"),
        ([UcxKey(0x10000, 0, "host", b"k")], [], "malformed UCX registration"),
        ([UcxKey(0x10000, 16, "host", b"")], [], "malformed UCX registration"),
    ],
)
def test_a_table_out_of_bounds_is_refused(
    keys: list[UcxKey], entries: list[BoardEntry], why: str
) -> None:
    with pytest.raises(WireError, match=why):
        decode_table(encode_table(1, b"a", b"", keys, entries))


def test_a_table_of_another_version_or_with_bad_fields_is_refused() -> None:
    good = bytearray(encode_table(1, b"a", b"", KEYS, ENTRIES))
    other = bytearray(good)
    other[0] = wire.UCX_VERSION + 1
    with pytest.raises(WireError, match="version"):
        decode_table(bytes(other))
    with pytest.raises(WireError, match="without a worker address"):
        decode_table(encode_table(1, b"", b"", KEYS, ENTRIES))
    with pytest.raises(WireError, match="host identity"):
        decode_table(encode_table(1, b"a", b"short", KEYS, ENTRIES))
    memory = bytearray(good)
    at = good.index(b"rkey-a") - 8  # the first key's memory type (u32), before its rkey blob
    memory[at : at + 4] = (77).to_bytes(4, "little")
    with pytest.raises(WireError, match="memory type 77"):
        decode_table(bytes(memory))
    with pytest.raises(WireError):
        decode_table(bytes(good) + b"\0")
    with pytest.raises(WireError, match="exceeds"):
        decode_table(bytes(wire.UCX_MAX_TABLE + 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_tables_only_raise_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode_table(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_tables_decode_within_their_keys_or_raise_wire_error(data: Any) -> None:
    body = bytearray(encode_table(3, b"addr", b"", KEYS, ENTRIES))
    for _ in range(data.draw(st.integers(1, 6))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    try:
        table = decode_table(bytes(body))
    except WireError:
        return
    spans = KeySpans(table.keys)
    for entry in table.regions.by_id.values():
        addrs = np.asarray(entry.addrs, dtype=np.uint64)
        lens = np.full(len(addrs), entry.tensor_bytes, dtype=np.uint64)
        assert spans.index(addrs, lens) is not None
        assert entry.row_bytes * entry.num_rows <= entry.tensor_bytes


def test_key_spans_find_the_registration_that_holds_a_span() -> None:
    keys = sorted(
        [UcxKey(0x1000, 0x10000, "host", b"a"), UcxKey(0x2000, 0x100, "host", b"b")],
        key=lambda k: k.addr,
    )
    spans = KeySpans(keys)
    u64 = np.uint64
    got = spans.index(np.array([0x1000, 0x2000, 0x2100], u64), np.array([16, 0x100, 0x200], u64))
    assert got is not None and got.tolist() == [0, 1, 0]  # the larger one holds the last
    assert spans.index(np.array([0x10F00], u64), np.array([0x200], u64)) is None
    assert spans.index(np.array([0x10], u64), np.array([1], u64)) is None
    assert spans.index(np.array([2**64 - 8], u64), np.array([16], u64)) is None
    assert KeySpans([]).index(np.array([0x1000], u64), np.array([1], u64)) is None


# -- the release protocol -------------------------------------------------------------------
@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold the next UCX transfers after they took the peer's table and before their
    requests start (``UcxRemote.start`` finding what they reach): ``(entered, release)``."""
    entered, release = threading.Event(), threading.Event()
    found = ucx_route._found

    def held(*args: Any) -> Any:
        entered.set()
        assert release.wait(20), "the held transfer was never released"
        return found(*args)

    monkeypatch.setattr(ucx_route, "_found", held)
    yield entered, release
    release.set()


def _span(cache: Any) -> tuple[int, int]:
    addrs = cache.tensor_addrs
    return min(addrs), max(addrs) + cache.cache_desc.size


def _used(engine: AsyncLLMDataDist) -> int:
    return int(engine.cache_manager.pool_stats(Placement.DEVICE).used)


@needs_ucx
async def test_a_release_racing_a_transfer_fails_it_and_frees_only_after_it_ended(
    make_pair: Callable[..., Any], hold: tuple[threading.Event, threading.Event]
) -> None:
    entered, release = hold
    pair = await make_pair(decoder="blocking")
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cache_manager
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    for view in src.as_numpy():
        view[...] = 0x11
    released_span = _span(src)
    await pair.settled()
    dst = dcm.allocate_blocks_cache(blocks_desc())
    pull = asyncio.ensure_future(
        asyncio.to_thread(dcm.pull_blocks, BlocksCacheKey(1, 0), dst, list(range(8)), [0] * 8)
    )
    assert await asyncio.to_thread(entered.wait, 10)
    before = _used(pair.prompt)
    dealloc = asyncio.ensure_future(pcm.deallocate_blocks_cache(src))
    await asyncio.sleep(0.3)
    # the peer holds the cache: it is gone from the table, its memory is not back
    assert not dealloc.done()
    assert _used(pair.prompt) == before
    assert src.cache_id not in ucx_links(pair.prompt._engine).board.published()
    # new memory is not the released memory
    other = await pcm.allocate_blocks_cache(blocks_desc())
    low, high = _span(other)
    assert high <= released_span[0] or low >= released_span[1]
    for view in other.as_numpy():
        view[...] = 0x22
    release.set()
    await _ends_before_the_release(pull)
    await asyncio.wait_for(dealloc, 10)  # the peer acknowledged: the memory is back
    assert _used(pair.prompt) == before + _used_by(other) - _used_by_span(released_span)
    got = dst.as_numpy()[0][0]
    assert (got == 0x11).all() or not got.any()  # the released cache's bytes, never reused memory
    dcm.deallocate_blocks_cache(dst)
    await pcm.deallocate_blocks_cache(other)
    assert _used(pair.prompt) == 0


async def _ends_before_the_release(pull: Any) -> bool:
    """A held transfer took the peer's table before a release: the release applies only
    after the transfer started (the table is taken and the requests started under one lock).
    True when it completed in that call; False when its requests were still in flight as the
    release applied, and it failed with ``LLM_KV_CACHE_NOT_EXIST`` (the bytes it moved are
    the released cache's: the peer frees it only after the transfer ended)."""
    try:
        await pull
    except LLMException as exc:
        assert exc.status_code == S.LLM_KV_CACHE_NOT_EXIST, exc
        return False
    return True


def _over_ucx_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines made from now use UCX's tcp transport only, on the loopback device (a get or
    put then completes after its start, as across a network)."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")


def _used_by(cache: Any) -> int:
    low, high = _span(cache)
    return _used_by_span((low, high))


def _used_by_span(span: tuple[int, int]) -> int:
    page = 1 << 16  # the test pools' page
    return -(-(span[1] - span[0]) // page) * page


@needs_ucx
async def test_unregister_returns_once_the_peer_let_go_of_the_memory(
    make_pair: Callable[..., Any], hold: tuple[threading.Event, threading.Event]
) -> None:
    entered, release = hold
    pair = await make_pair(decoder="blocking")
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cache_manager
    arrays = [np.full((BLOCKS, BLOCK_BYTES), t, np.uint8) for t in range(TENSORS)]
    src = await pcm.register_blocks_cache(
        blocks_desc(), [int(a.ctypes.data) for a in arrays], BlocksCacheKey(1, 0), True
    )
    board = ucx_links(pair.prompt._engine).board
    assert src.cache_id in board._own  # the tensors were registered with UCX
    await pair.settled()
    dst = dcm.allocate_blocks_cache(blocks_desc())
    pull = asyncio.ensure_future(
        asyncio.to_thread(dcm.pull_blocks, BlocksCacheKey(1, 0), dst, [1, 2], [1, 2])
    )
    assert await asyncio.to_thread(entered.wait, 10)
    unregister = asyncio.ensure_future(pcm.unregister_cache(src.cache_id))
    await asyncio.sleep(0.3)
    assert not unregister.done() and src.cache_id in board._own
    release.set()
    if await _ends_before_the_release(pull):
        got = [int(dst.as_numpy()[t][b][0]) for t in range(TENSORS) for b in (1, 2)]
        assert got == [t for t in range(TENSORS) for _ in (1, 2)]
    await asyncio.wait_for(unregister, 10)
    assert src.cache_id not in board._own  # unmapped before unregister_cache returned
    del arrays  # the caller may free its memory now
    dcm.deallocate_blocks_cache(dst)


@needs_ucx
async def test_a_peer_that_does_not_acknowledge_loses_its_link(
    make_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ucxboard, "ACK_TIMEOUT_S", 0.5)
    pair = await make_pair(decoder="blocking", transport="tcp")
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cache_manager
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    await pair.settled()
    dst = dcm.allocate_blocks_cache(blocks_desc())
    await asyncio.to_thread(dcm.pull_blocks, BlocksCacheKey(1, 0), dst, [0], [0])
    # the decoder acknowledges no table from now (as a process that stopped would not)
    monkeypatch.setattr(UcxLinks, "_ours_to_ack", lambda *_: None)
    start = time.monotonic()
    await asyncio.wait_for(pcm.deallocate_blocks_cache(src), 10)
    assert 0.4 < time.monotonic() - start < 5
    assert _used(pair.prompt) == 0  # the release went on
    links = pair.prompt._engine.link_table()
    assert links.get(2) is None
    broken = links.broken(2)
    assert broken is not None and "did not acknowledge a UCX table" in broken.reason
    # the decoder sees its link closed: its transfers fail as over any link that broke
    ours = pair.decoder._engine.link_table()
    deadline = time.monotonic() + 10
    while ours.get(1) is not None:
        assert time.monotonic() < deadline, "the decoder never saw its link close"
        await asyncio.sleep(0.01)
    with pytest.raises(LLMException) as info:
        await asyncio.to_thread(dcm.pull_blocks, BlocksCacheKey(1, 0), dst, [0], [0])
    assert info.value.status_code == S.LLM_LINK_FAILED, info.value
    dcm.deallocate_blocks_cache(dst)


# -- refusals ---------------------------------------------------------------------------------
@needs_ucx
async def test_accesses_outside_the_peers_caches_are_refused_before_ucx_sees_them(
    make_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    rma = ucx.rma

    def counted(ops: Any, *args: Any, **kwargs: Any) -> Any:
        result = rma(ops, *args, **kwargs)  # (raises, nothing started, for a refused access)
        started.append(len(ops))
        return result

    monkeypatch.setattr("aio_datadist._routes.ucx.remote.rma", counted)
    resolved: list[object] = []
    resolve = ucx_route.resolve

    def resolving(regions: Any, access: Any) -> Any:
        resolved.append(access)
        return resolve(regions, access)

    monkeypatch.setattr(ucx_route, "resolve", resolving)
    pair = await make_pair()
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    await pair.settled()
    dst = await dcm.allocate_blocks_cache(blocks_desc(BLOCKS * 2))
    for bad in ([BLOCKS], [0, BLOCKS + 5]):
        with pytest.raises(LLMException) as info:
            await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, bad, list(range(len(bad))))
        assert info.value.status_code == S.LLM_PARAM_INVALID
    with pytest.raises(LLMException) as info:  # layers past the peer's tensors
        await dcm.pull_blocks(
            BlocksCacheKey(1, 0),
            dst,
            [0],
            [0],
            src_layer_range=range(2, 3),
            dst_layer_range=range(0, 1),
            tensor_num_per_layer=2,
        )
    assert info.value.status_code == S.LLM_PARAM_INVALID
    assert started == []  # none of them reached UCX
    assert len(resolved) == 3  # each refusal named as the serving side would
    await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [1, 2], [3, 4])
    assert started == [2 * TENSORS]  # two blocks of each tensor, in one batch
    assert len(resolved) == 3  # whole blocks both sides: paired in one native call
    await dcm.deallocate_blocks_cache(dst)
    await pcm.deallocate_blocks_cache(src)


def _push(channel: Any, target: Target, payload: bytes, kind: RequestKind) -> LLMException:
    """A control request on ``channel``; the error it is answered with."""
    body = encode_access(Access(target, ident=5))
    buf = np.frombuffer(payload or b"\0", dtype=np.uint8)
    rows = np.array([[buf.ctypes.data, len(payload)]], dtype=np.uint64)[: 1 if payload else 0]
    deadline = time.monotonic_ns() + 5_000_000_000
    if kind is RequestKind.PUSH:
        future: Future[None] = channel.push(body, rows, len(payload), deadline)
    else:
        future = channel.pull(body, rows, len(payload), deadline)
    error = future.exception(10)
    assert isinstance(error, LLMException), error
    return error


@needs_ucx
async def test_the_control_plane_refuses_what_it_does_not_expect(
    make_pair: Callable[..., Any],
) -> None:
    plain = await make_pair(decoder_ucx=False)
    channel = plain.decoder.dd._engine.link_table().get(1).channel
    error = await asyncio.to_thread(_push, channel, Target.UCX_TABLE, b"x" * 64, RequestKind.PUSH)
    assert error.status_code == S.LLM_FEATURE_NOT_ENABLED and "without UCX" in str(error)
    await plain.decoder.finalize()
    await plain.prompt.finalize()

    pair = await make_pair()
    channel = pair.decoder.dd._engine.link_table().get(1).channel
    for target, payload, kind in [
        (Target.UCX_TABLE, b"not a table", RequestKind.PUSH),
        (Target.UCX_ACK, b"payload", RequestKind.PUSH),
        (Target.UCX_TABLE, b"x" * 16, RequestKind.PULL),
    ]:
        error = await asyncio.to_thread(_push, channel, target, payload, kind)
        assert error.status_code == S.LLM_PARAM_INVALID, error
    # the link and its route are intact
    assert routes_of(pair.decoder.dd, 1)[0] == "ucx"
    src = await pair.prompt.cache_manager.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    dst = await pair.decoder.cm.allocate_blocks_cache(blocks_desc())
    await pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
    await pair.decoder.cm.deallocate_blocks_cache(dst)
    await pair.prompt.cache_manager.deallocate_blocks_cache(src)


# -- links ----------------------------------------------------------------------------------
@needs_ucx
async def test_authenticated_links_carry_the_route(make_pair: Callable[..., Any]) -> None:
    pair = await make_pair(transport="tcp", secret="a shared secret")
    link = pair.decoder.dd._engine.link_table().get(1)
    assert link.channel.authenticated and routes_of(pair.decoder.dd, 1)[0] == "ucx"
    src = await pair.prompt.cache_manager.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    src.as_numpy()[2][5] = 0x5C
    dst = await pair.decoder.cm.allocate_blocks_cache(blocks_desc())
    await pair.decoder.cm.pull_blocks(BlocksCacheKey(1, 0), dst, [5], [6])
    assert (dst.as_numpy()[2][6] == 0x5C).all()
    await pair.decoder.cm.deallocate_blocks_cache(dst)
    await pair.prompt.cache_manager.deallocate_blocks_cache(src)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


#: Threads of a link, which end as its close completes: its reader and sender.
_LINK_THREADS = ("aio-dd-tcp-read-", "aio-dd-tcp-send-")


async def _lasting_threads(before: set[int], timeout: float = 10.0) -> list[str]:
    """The threads started since ``before`` (thread idents) once every link thread among
    them ended (waited for up to ``timeout`` seconds; one still running then is counted),
    less the listeners' handshake workers: a pool of at most four, each gone 5 s after its
    last handshake, never one per link."""

    def new() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.ident not in before]

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(t.name.startswith(_LINK_THREADS) for t in new()):
            break
        await asyncio.sleep(0.02)
    return sorted(t.name for t in new() if not t.name.endswith("-step"))


@needs_ucx
async def test_links_and_transfers_leave_no_descriptors_or_threads(
    make_pair: Callable[..., Any],
) -> None:
    pair = await make_pair(transport="tcp", link=False)
    pcm, dcm, dd = pair.prompt.cache_manager, pair.decoder.cm, pair.decoder
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    samples: list[tuple[int, int]] = []
    before = {t.ident for t in threading.enumerate()}
    for i in range(12):
        await pair.link()
        assert routes_of(dd.dd, 1)[0] == "ucx"
        dst = await dcm.allocate_blocks_cache(blocks_desc())
        await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [i % BLOCKS], [0])
        await dcm.deallocate_blocks_cache(dst)
        ret, _ = await dd.call(dd.dd.unlink_clusters, [pair.info], 2000)
        assert ret == S.LLM_SUCCESS
        for _ in range(200):  # the prompt's end goes with the peer's unlink
            if pair.prompt._engine.link_table().get(2) is None:
                break
            await asyncio.sleep(0.01)
        if i >= 3:  # after the first links warmed UCX up
            threads = len(await _lasting_threads(before))
            # a link's socket closes as its close completes, which may trail its threads
            for _ in range(500):
                if not samples or _fds() <= samples[0][0]:
                    break
                await asyncio.sleep(0.02)
            samples.append((_fds(), threads))
    # (UCX closes some of its connections lazily: the count may drop, never grow)
    assert max(fds for fds, _ in samples) <= samples[0][0], samples
    assert len({threads for _, threads in samples}) == 1, samples
    assert _used(pair.prompt) == _used_by(src)  # only the cache the test keeps
    await pcm.deallocate_blocks_cache(src)
    assert _used(pair.prompt) == 0


# -- device memory ----------------------------------------------------------------------------
@needs_ucx
@pytest.mark.parametrize("ucx_offers_cuda", [False, True])
async def test_device_rows_are_staged_around_the_route(
    monkeypatch: pytest.MonkeyPatch, ucx_offers_cuda: bool
) -> None:
    """Under an accelerator runtime whose memory UCX cannot reach (the fake libcudart),
    device rows against the peer's host cache go through pinned buffers around the UCX
    route; the peer's device caches are not published, so the link stages them. So too
    where UCX offers CUDA memory (a GPU machine) but refuses the runtime's device pool as
    such: what UCX can reach is not what this runtime allocates."""
    from tests.test_device_transfers import read
    from tests.test_runtime_cuda import _fake as fake_cudart

    if ucx_offers_cuda:
        init = ucx.UcxContext.__init__

        def offering_cuda(self: ucx.UcxContext, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.memory_types = self.memory_types | {"cuda"}

        monkeypatch.setattr(ucx.UcxContext, "__init__", offering_cuda)
    fake = fake_cudart()
    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "cuda")
    monkeypatch.setenv("AIO_DATADIST_CUDART", str(fake.path))
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "1")
    fake.reset()
    taken: list[str] = []
    send = UcxRoute.send

    def spy(self: UcxRoute, transfer: Any, *args: Any, **kwargs: Any) -> Any:
        taken.append("device" if transfer.device else "host")
        return send(self, transfer, *args, **kwargs)

    monkeypatch.setattr(UcxRoute, "send", spy)
    opts = dict(device_pool=pool_cfg(), host_pool=pool_cfg(), remote_accessible=True, ucx=True)
    port = next(_ports)
    prompt = AsyncLLMDataDist(LLMRole.PROMPT, 1)
    await prompt.init(make_options(**opts, listen=f"127.0.0.1:{port}"))  # type: ignore[arg-type]
    decoder = AsyncLLMDataDist(LLMRole.DECODER, 2)
    await decoder.init(make_options(**opts))  # type: ignore[arg-type]
    try:
        info = LLMClusterInfo()
        info.remote_cluster_id = 1
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        assert (await decoder.link_clusters([info], 5000))[0] == S.LLM_SUCCESS
        assert not ucx_links(prompt._engine).cuda and not ucx_links(decoder._engine).cuda
        host_desc = CacheDesc(TENSORS, [BLOCKS, 1024], DataType.DT_UINT8, Placement.HOST)
        dev_desc = CacheDesc(TENSORS, [BLOCKS, 1024], DataType.DT_UINT8, Placement.DEVICE)
        host_src = await prompt.cache_manager.allocate_blocks_cache(host_desc, BlocksCacheKey(1, 0))
        dev_src = await prompt.cache_manager.allocate_blocks_cache(dev_desc, BlocksCacheKey(1, 1))
        for t, view in enumerate(host_src.as_numpy()):
            view[...] = 0x30 + t
        published = ucx_links(prompt._engine).board.published()
        assert host_src.cache_id in published and dev_src.cache_id not in published
        dst = await decoder.cache_manager.allocate_blocks_cache(dev_desc)
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [3, 4], [0, 1])
        assert taken == ["device"]  # staged around the UCX route
        for t, got in enumerate(read(decoder, dst)):
            assert (got[[0, 1]] == 0x30 + t).all()
        await decoder.cache_manager.pull_blocks(BlocksCacheKey(1, 1), dst, [0], [2])
        assert taken == ["device", "device"]  # tried, declined: the peer's device cache
        await decoder.cache_manager.deallocate_blocks_cache(dst)
        await prompt.cache_manager.deallocate_blocks_cache(host_src)
        await prompt.cache_manager.deallocate_blocks_cache(dev_src)
    finally:
        await decoder.finalize()
        await prompt.finalize()


def test_cuda_memory_registers_with_ucx_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where UCX reaches CUDA memory (a GPU, and a UCX built with CUDA), device memory of
    the CUDA runtime registers as such."""
    if ucx.available() is not None:
        pytest.skip(f"UCX is not available: {ucx.available()}")
    if "cuda" not in ucx.ucx_info().get("memory_types", []):
        pytest.skip("this UCX reaches no CUDA memory (no GPU, or a UCX built without CUDA)")
    from aio_datadist._runtime import select_runtime

    monkeypatch.setenv("AIO_DATADIST_RUNTIME", "cuda")
    try:
        runtime = select_runtime(0)
    except LLMException as exc:
        pytest.skip(f"no CUDA runtime: {exc}")
    assert runtime.name == "cuda"
    try:
        addr = runtime.alloc_device(1 << 20)
        try:
            with ucx.UcxContext() as context:
                reg = ucx.Registration(context, addr, 1 << 20, memory="cuda")
                assert reg.memory == "cuda" and reg.rkey
                reg.close()
        finally:
            runtime.free_device(addr, 1 << 20)
    finally:
        runtime.close()


@needs_ucx
def test_registering_memory_ucx_cannot_reach_is_refused() -> None:
    if "cuda" in ucx.ucx_info().get("memory_types", []):
        pytest.skip("this UCX reaches CUDA memory")
    buf = np.zeros(4096, np.uint8)
    with ucx.UcxContext() as context, pytest.raises(LLMException) as info:
        ucx.Registration(context, buf.ctypes.data, buf.nbytes, memory="cuda")
    assert info.value.status_code == S.LLM_FEATURE_NOT_ENABLED


# -- lanes --------------------------------------------------------------------------------------
def _thread_names() -> list[str]:
    """The names of this process's threads, native ones included."""
    names = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
            names.append(comm.read().strip())
    return names


def _fill(cache: Any, seed: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    views = cache.as_numpy()
    for v in views:
        v.view(np.uint8)[...] = rng.integers(0, 256, v.view(np.uint8).shape, dtype=np.uint8)
    return [v.view(np.uint8).copy() for v in views]


@needs_ucx
@pytest.mark.parametrize("transport", ["loopback", "tcp"])
@pytest.mark.parametrize(("decoder", "lanes"), [("async", 1), ("async", 3), ("blocking", 2)])
async def test_large_transfers_are_cut_across_the_lanes(
    make_pair: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
    transport: str,
    decoder: str,
    lanes: int,
) -> None:
    parts: list[int] = []  # how many parts each transfer was started in
    rma = ucx.rma

    def counted(ops: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
        parts.append(len(keys))
        return rma(ops, keys, *args, **kwargs)

    monkeypatch.setattr("aio_datadist._routes.ucx.remote.rma", counted)
    pair = await make_pair(transport=transport, decoder=decoder, lanes=lanes)
    dd = pair.decoder.dd if isinstance(pair.decoder, Face) else pair.decoder
    ours = ucx_links(dd._engine)
    assert 1 + len(ours.lanes) == lanes
    threads = [n for n in _thread_names() if n == "aio-dd-ucx-lane"]
    assert len(threads) == 2 * (lanes - 1)  # the prompt's engine has as many
    pcm = pair.prompt.cache_manager
    dcm = pair.decoder.cm if isinstance(pair.decoder, Face) else pair.decoder.cache_manager

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        if isinstance(pair.decoder, Face):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)

    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    want = _fill(src, 1)
    dst = await call(dcm.allocate_blocks_cache, blocks_desc())
    await pair.settled()
    order = [int(b) for b in np.random.default_rng(2).permutation(BLOCKS)]
    assert TENSORS * BLOCKS * BLOCK_BYTES >= LANE_MIN_BYTES
    await call(dcm.pull_blocks, BlocksCacheKey(1, 0), dst, order, list(range(BLOCKS)))
    got = [v.view(np.uint8) for v in dst.as_numpy()]
    for t in range(TENSORS):
        assert np.array_equal(got[t], want[t][order]), t
    assert parts == [lanes]  # (each lane's thread moved its part: the bytes are all there)
    # a push of new bytes the other way, then one block (below the lanes' size) each way
    parts.clear()
    sent = _fill(dst, 3)
    await call(dcm.push_blocks, BlocksCacheKey(1, 0), dst, list(range(BLOCKS)), order)
    back = [v.view(np.uint8) for v in src.as_numpy()]
    for t in range(TENSORS):
        assert np.array_equal(back[t][order], sent[t]), t
    assert parts == [lanes]
    parts.clear()
    await call(dcm.pull_blocks, BlocksCacheKey(1, 0), dst, [0], [1])
    await call(dcm.push_blocks, BlocksCacheKey(1, 0), dst, [2], [3])
    assert parts == [1, 1]
    assert routes_of(dd, 1)[0] == "ucx"
    await call(dcm.deallocate_blocks_cache, dst)
    await pcm.deallocate_blocks_cache(src)


@needs_ucx
async def test_over_ucx_tcp_large_transfers_stay_on_one_worker(
    make_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over UCX's tcp transport the kernel copies on both sides: more workers only contend
    # for the cores, so the lanes take no part.
    _over_ucx_tcp(monkeypatch)
    parts: list[int] = []
    rma = ucx.rma

    def counted(ops: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
        parts.append(len(keys))
        return rma(ops, keys, *args, **kwargs)

    monkeypatch.setattr("aio_datadist._routes.ucx.remote.rma", counted)
    pair = await make_pair(lanes=2)
    engine = pair.decoder.dd._engine
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    want = _fill(src, 5)
    dst = await dcm.allocate_blocks_cache(blocks_desc())
    await pair.settled()
    assert TENSORS * BLOCKS * BLOCK_BYTES >= LANE_MIN_BYTES
    await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, list(range(BLOCKS)), list(range(BLOCKS)))
    got = [v.view(np.uint8) for v in dst.as_numpy()]
    for t in range(TENSORS):
        assert np.array_equal(got[t], want[t]), t
    assert parts == [1]
    assert routes_of(pair.decoder.dd, 1)[0] == "ucx"
    remote = ucx_links(engine).route_of(engine.links.get(1).channel)
    assert remote is not None and remote.transports()
    assert all(tl.startswith(("tcp/", "self/")) for tl in remote.transports())
    await dcm.deallocate_blocks_cache(dst)
    await pcm.deallocate_blocks_cache(src)


@needs_ucx
async def test_awaited_calls_share_one_pump_that_stands_aside_between_them(
    make_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over UCX's tcp transport a get completes after its start: awaited calls on one loop
    # share one pump task, made once and kept asleep between the calls (no task made or
    # ended per call), which counts as a waiter only while a batch started on the loop is
    # pending; finalize ends it.
    _over_ucx_tcp(monkeypatch)
    pair = await make_pair()
    links = ucx_links(pair.decoder.dd._engine)
    assert links is not None
    progress = links.progress
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    want = _fill(src, 7)
    dst = await dcm.allocate_blocks_cache(blocks_desc())
    await pair.settled()

    def pumps() -> list[asyncio.Task[Any]]:
        return [
            t
            for t in asyncio.all_tasks()
            if getattr(t.get_coro(), "__qualname__", "") == "UcxProgress._pump"
        ]

    # no busy-poll: every call's batch outlives its start and is awaited through the pump
    monkeypatch.setattr(progress, "spin_ns", 0)
    made: set[asyncio.Task[Any]] = set()
    for i in range(6):
        await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, [i % BLOCKS], [i % BLOCKS])
        made.update(pumps())
        assert progress._active == 0  # between calls the progress thread has the worker
    assert len(made) == 1
    (pump,) = made
    assert not pump.done()
    got = [v.view(np.uint8).reshape(BLOCKS, -1) for v in dst.as_numpy()]
    for t in range(TENSORS):
        assert np.array_equal(got[t][:6], want[t].reshape(BLOCKS, -1)[:6]), t
    await dcm.deallocate_blocks_cache(dst)
    await pcm.deallocate_blocks_cache(src)
    await pair.decoder.finalize()
    for _ in range(100):
        if pump.done():
            break
        await asyncio.sleep(0.01)
    assert pump.cancelled()
    assert progress._active == 0


@needs_ucx
async def test_a_blocking_transfer_busy_polls_once_then_its_waiter_sleeps(
    make_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Over UCX's tcp transport a get completes after its start. With a busy-poll too short
    # for the peer's answer, the start's busy-poll misses it and hands the batch over; the
    # blocking waiter then sleeps on the worker's event fd without busy-polling again.
    _over_ucx_tcp(monkeypatch)
    pair = await make_pair(decoder="blocking")
    links = ucx_links(pair.decoder._engine)
    assert links is not None
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cache_manager
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    want = _fill(src, 9)
    dst = dcm.allocate_blocks_cache(blocks_desc())
    await pair.settled()
    spins: list[int] = []
    spin = ucx.Requests.spin

    def counted(self: Any, spin_ns: int) -> bool:
        spins.append(spin_ns)
        return spin(self, spin_ns)

    monkeypatch.setattr(ucx.Requests, "spin", counted)

    class Missed:  # a batch whose requests a busy-poll does not complete
        spun = False

        def __init__(self) -> None:
            self.requests = [ucx.Requests(None, "ucp_get_nbx", links.progress.worker)]

        def poll(self) -> bool:
            return False

    missed = Missed()
    assert not links.progress._spin_batch(missed)  # type: ignore[arg-type]  # (the start's)
    assert not links.progress._spin_batch(missed)  # type: ignore[arg-type]  # (the waiter's)
    assert len(spins) == 1, spins  # busy-polled once: the waiter sleeps on the event fd
    spins.clear()
    monkeypatch.setattr(links.progress, "spin_ns", 1)  # (1 ns: never long enough)
    slept: list[int] = []
    sleep = ucx.UcxWorker._sleep

    def sleeping(self: Any, *args: Any, **kwargs: Any) -> bool:
        slept.append(1)
        return bool(sleep(self, *args, **kwargs))

    monkeypatch.setattr(ucx.UcxWorker, "_sleep", sleeping)
    for i in range(4):
        await asyncio.to_thread(dcm.pull_blocks, BlocksCacheKey(1, 0), dst, [i], [i])
    assert len(spins) <= 4  # one busy-poll per transfer at most, in its start
    assert slept  # a batch the busy-poll missed was slept for
    got = [v.view(np.uint8).reshape(BLOCKS, -1) for v in dst.as_numpy()]
    for t in range(TENSORS):
        assert np.array_equal(got[t][:4], want[t].reshape(BLOCKS, -1)[:4]), t
    dcm.deallocate_blocks_cache(dst)
    await pcm.deallocate_blocks_cache(src)


@needs_ucx
async def test_a_lane_whose_part_misses_the_deadline_fails_the_whole_transfer(
    make_pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lane whose thread never progresses its part: the transfer fails at its deadline
    # with LLM_TIMEOUT, the route closes (its requests cancelled, nothing left in flight)
    # and the link carries the next transfer. Over UCX's tcp transport (where a part may
    # stall, as across a network), with the transfer cut across the lanes all the same.
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setattr(UcxRemote, "_cuts", lambda self, ep: True)

    class Idle:  # a lane "thread" that never runs: its parts are never progressed
        def _handle(self) -> Any:
            return ffi.NULL

        def stop(self) -> None:
            pass

    monkeypatch.setattr(UcxCalls, "lane", lambda self, worker, efd: Idle())
    pair = await make_pair(transport="tcp", lanes=2)
    pcm, dcm = pair.prompt.cache_manager, pair.decoder.cm
    src = await pcm.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    want = _fill(src, 5)
    dst = await dcm.allocate_blocks_cache(blocks_desc())
    await pair.settled()
    link = pair.decoder.dd._engine.link_table().get(1)
    remote = ucx_links(pair.decoder.dd._engine).route_of(link.channel)
    assert remote is not None and remote.usable
    every = list(range(BLOCKS))
    started = time.monotonic()
    with pytest.raises(LLMException) as info:
        await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, every, every)
    assert info.value.status_code == S.LLM_TIMEOUT
    assert time.monotonic() - started < 5 + 3  # the deadline, and the cancellation
    assert not remote.usable
    await dcm.pull_blocks(BlocksCacheKey(1, 0), dst, every, every)
    got = [v.view(np.uint8) for v in dst.as_numpy()]
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    await dcm.deallocate_blocks_cache(dst)
    started = time.monotonic()  # the peer's tables are still acknowledged: no wait
    await pcm.deallocate_blocks_cache(src)
    assert time.monotonic() - started < 2
    assert pair.prompt._engine.link_table().get(2) is not None  # and the link stays


def test_a_batch_completed_while_another_thread_looked_is_seen_by_that_thread() -> None:
    """Two threads poll one batch: the one that finds the other looking leaves (its poll is
    False), and the one looking, whose look began before the last request completed, sees
    the completion when it lets go, so a waiter never sleeps on a batch already complete."""

    class Remote:
        def end(self, snap: object, entries: object) -> bool:
            return True  # (the peer still publishes what the batch reached)

    looks: list[bool] = []

    class Requests:
        """Completes during the first look, as another thread progressed it meanwhile."""

        def __init__(self) -> None:
            self.completed = False

        def done(self) -> bool:
            if not self.completed:
                self.completed = True  # (the other thread completed it) ...
                looks.append(batch.poll())  # ... and polls: the lock is taken, it leaves
                return False  # the look that began before the completion saw it in flight
            return True

        def result(self) -> None:
            pass

        def release(self) -> None:
            pass

    batch = ucx_route.Batch(Remote(), None, [], [Requests()], None, 0)  # type: ignore[arg-type, list-item]
    assert batch.poll() is True
    assert looks == [False] and batch.future.done() and batch.future.exception() is None
