"""Fuzzing, the bounded slice CI runs: body decoders, the region-board parser, a live TCP
server fed mutated frames, and the public API called with random arguments.

The nightly run is ``tools/fuzz.py`` (100,000 frames and more); both share ``wirefuzz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import aio_datadist as llm
from aio_datadist._engine.access import (
    MAX_ROWS,
    Access,
    Target,
    decode_access,
    encode_access,
    encode_blocks_access,
)
from aio_datadist._engine.regions import BoardEntry, RemoteRegions, encode_entries
from aio_datadist._transport._wire import MAX_ERROR_TEXT, MAX_PAYLOAD, WireError, decode_error_text
from aio_datadist._transport.samehost import decode_extensions
from tests.wirefuzz import (
    FuzzReport,
    ServingEngine,
    fuzz_server,
    good_client_works,
    mutate,
    parse_frame,
    resources_flat,
    seed_frames,
)

FUZZ = settings(max_examples=300, deadline=None)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)

# -- decoders ------------------------------------------------------------------------------------

address_rows = st.lists(
    st.tuples(st.integers(0, 2**63), st.integers(0, MAX_PAYLOAD)), max_size=4
).map(lambda r: np.array(r, dtype=np.uint64).reshape(-1, 2))

accesses = st.builds(
    Access,
    target=st.sampled_from(Target),
    ident=u64,
    model_id=u64,
    row=u64,
    tensor_start=u32,
    tensor_count=u32,
    offset=u64,
    seg_bytes=st.integers(0, MAX_PAYLOAD),
    tail_bytes=st.integers(0, MAX_PAYLOAD),
    drop_key=st.booleans(),
    blocks=st.lists(u64, max_size=8).map(lambda b: np.array(b, dtype=np.uint64)),
    rows=address_rows,
    deliver=address_rows,
)


@FUZZ
@given(accesses)
def test_access_round_trip(access: Access) -> None:
    back = decode_access(encode_access(access))
    for name in Access.__slots__:
        assert np.array_equal(getattr(back, name), getattr(access, name)), name


@FUZZ
@given(u64, u32, u32, st.integers(0, MAX_PAYLOAD), st.lists(u64, max_size=200))
def test_blocks_access_encodes_as_its_access(
    model_id: int, start: int, count: int, seg: int, blocks: list[int]
) -> None:
    access = Access(
        Target.BLOCKS_KEY,
        ident=model_id,
        tensor_start=start,
        tensor_count=count,
        seg_bytes=seg,
        blocks=np.array(blocks, dtype=np.uint64),
    )
    body = encode_blocks_access(model_id, start, count, seg, blocks)
    assert body == encode_access(access)
    assert encode_blocks_access(model_id, start, count, seg, tuple(blocks)) == body


@FUZZ
@given(st.binary(max_size=200))
def test_arbitrary_access_bodies_only_raise_wire_error(body: bytes) -> None:
    with contextlib.suppress(WireError):
        access = decode_access(body)
        assert len(access.blocks) <= MAX_ROWS and len(access.rows) <= MAX_ROWS
        assert len(access.deliver) <= MAX_ROWS
        assert access.seg_bytes <= MAX_PAYLOAD and access.tail_bytes <= MAX_PAYLOAD


@FUZZ
@given(accesses, st.data())
def test_mutated_access_bodies_decode_or_raise_wire_error(access: Access, data: Any) -> None:
    body = bytearray(encode_access(access))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    with contextlib.suppress(WireError):
        decoded = decode_access(bytes(body[:cut]))
        assert decoded.nbytes >= 0  # every size computation over it stays exact
        assert int(decoded.deliver[:, 1].sum()) >= 0


@FUZZ
@given(st.binary(max_size=120))
def test_hello_extensions_only_raise_wire_error(blob: bytes) -> None:
    with contextlib.suppress(WireError):
        decode_extensions(blob)


@given(st.binary(max_size=2 * MAX_ERROR_TEXT))
def test_error_text_never_raises(body: bytes) -> None:
    assert len(decode_error_text(body)) <= MAX_ERROR_TEXT


@settings(max_examples=1000, deadline=None)
@given(st.randoms(use_true_random=False))
def test_mutated_frames_through_every_decoder(rng: random.Random) -> None:
    seeds = seed_frames()
    with contextlib.suppress(WireError, ValueError):
        parse_frame(mutate(rng, rng.choice(seeds), seeds))


entries = st.builds(
    BoardEntry,
    cache_id=u64,
    blocks_model_id=st.integers(-1, 2**63 - 1),
    row_bytes=st.integers(0, 1 << 20),
    num_rows=st.integers(0, 64),
    tensor_bytes=st.integers(0, 1 << 30),
    addrs=st.lists(st.integers(0, 2**63), max_size=4).map(tuple),
)


@FUZZ
@given(st.lists(entries, max_size=3), st.data())
def test_mutated_board_tables_parse_to_sound_entries_or_fail(
    board: list[BoardEntry], data: Any
) -> None:
    table = bytearray(encode_entries(board))
    if table:
        for _ in range(data.draw(st.integers(0, 3))):
            table[data.draw(st.integers(0, len(table) - 1))] = data.draw(st.integers(0, 255))
        del table[data.draw(st.integers(0, len(table))) :]
    try:
        regions = RemoteRegions.decode(2, bytes(table))
    except (ValueError, struct.error):
        return
    for entry in regions.by_id.values():  # what a reader uses never points past a tensor
        assert entry.row_bytes * entry.num_rows <= entry.tensor_bytes
        assert all(addr + entry.tensor_bytes <= 2**64 for addr in entry.addrs)


# -- a live server -------------------------------------------------------------------------------


def test_live_server_survives_mutated_frames() -> None:
    engine = ServingEngine()
    try:
        # A seed reproduces a run (what tools/fuzz.py takes); shrinking would replay a live
        # run dozens of times for no smaller input.
        @settings(max_examples=4, deadline=None, phases=[Phase.explicit, Phase.generate])
        @given(st.integers(0, 2**32 - 1))
        def fuzz(seed: int) -> None:
            rng, report = random.Random(seed), FuzzReport()
            with resources_flat(engine) as leaked:
                fuzz_server(engine, rng, frames=500, handshakes=50, report=report)
            assert report.frames == 550
            stuck = [o for o in report.outcomes if "timeout" in o or "garbled" in o]
            assert not stuck, report.outcomes
            # No growth: a worker thread of the process may end meanwhile, none may stay.
            assert leaked["fds"] <= 0 and leaked["threads"] <= 0, (leaked, report.outcomes)
            assert leaked["pool_bytes"] == 0 and leaked["pins"] == 0, (leaked, report.outcomes)
            assert good_client_works(engine)

        fuzz()
    finally:
        engine.close()


# -- the public API ------------------------------------------------------------------------------

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.binary(max_size=4),
    st.lists(st.integers(-4, 2**64), max_size=4),
    st.tuples(st.integers(-4, 70), st.integers(-4, 70)),
    st.dictionaries(st.text(max_size=3), st.integers(-2, 3), max_size=2),
    st.sampled_from(list(llm.Placement) + list(llm.DataType) + list(llm.LLMRole)),
)
args = st.lists(junk, max_size=6)
ALLOWED = (TypeError, ValueError, llm.LLMException)

CONSTRUCTORS: list[Callable[..., Any]] = [
    llm.CacheDesc,
    llm.CacheKey,
    llm.CacheKeyByIdAndIndex,
    llm.BlocksCacheKey,
    llm.TransferConfig,
    llm.TransferWithCacheKeyConfig,
    llm.MemInfo,
    llm.KvCache,
    llm.LLMDataDist,
    llm.AsyncLLMDataDist,
]


@FUZZ
@given(st.sampled_from(CONSTRUCTORS), args, st.dictionaries(st.sampled_from(
    ["cluster_id", "req_id", "model_id", "prefix_id", "num_tensors", "shape", "data_type",
     "placement", "batch_index", "cache_id", "dst_addrs", "src_layer_range", "size"]
), junk, max_size=2))  # fmt: skip
def test_constructors_raise_only_documented_errors(
    make: Callable[..., Any], positional: list[Any], keywords: dict[str, Any]
) -> None:
    with contextlib.suppress(*ALLOWED):
        make(*positional, **keywords)


CONFIG_FIELDS = [
    "device_id", "sync_kv_timeout", "enable_cache_manager", "enable_remote_cache_accessible",
    "listen_ip_info", "mem_pool_cfg", "host_mem_pool_cfg", "mem_utilization", "buf_pool_cfg",
    "local_comm_res", "transfer_backend", "link_total_time", "link_retry_count", "transport",
    "same_host", "cluster_id", "zero_on_alloc",
]  # fmt: skip


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(CONFIG_FIELDS), junk), max_size=4))
def test_config_fields_raise_only_documented_errors(sets: list[tuple[str, Any]]) -> None:
    cfg = llm.LLMConfig()
    for name, value in sets:
        with contextlib.suppress(*ALLOWED, AttributeError):  # AttributeError: not a field here
            setattr(cfg, name, value)
    with contextlib.suppress(*ALLOWED):
        cfg.generate_options()


@FUZZ
@given(st.lists(st.tuples(junk, junk), max_size=3), junk)
def test_cluster_info_raises_only_documented_errors(
    addresses: list[tuple[Any, Any]], cluster_id: Any
) -> None:
    info = llm.LLMClusterInfo()
    with contextlib.suppress(*ALLOWED):
        info.remote_cluster_id = cluster_id
    # The reference raises RuntimeError for an IP string inet_aton rejects (documented).
    for ip, port in addresses:
        with contextlib.suppress(*ALLOWED, RuntimeError):
            info.append_remote_ip_info(ip, port)
        with contextlib.suppress(*ALLOWED, RuntimeError):
            info.append_local_ip_info(ip, port)


#: Cache-manager calls whose arguments name only caches, keys and indices. The raw-address
#: calls (register_*, remap_registered_memory) trust the caller's addresses by contract.
METHODS = [
    "allocate_cache", "allocate_blocks_cache", "deallocate_cache", "deallocate_blocks_cache",
    "remove_cache_key", "unregister_cache", "copy_cache", "copy_blocks", "swap_blocks",
    "pull_cache", "pull_blocks", "push_cache", "push_blocks", "transfer_cache_async",
]  # fmt: skip


def arguments(caches: list[Any]) -> st.SearchStrategy[Any]:
    """Junk, or well-formed descs, keys and caches (so calls get past the first check)."""
    good = st.sampled_from(
        [
            llm.CacheDesc(2, [4, 64], llm.DataType.DT_FLOAT, llm.Placement.HOST),
            llm.CacheDesc(2, [4, 64], llm.DataType.DT_FLOAT),
            llm.CacheKey(1, 5),
            llm.CacheKeyByIdAndIndex(2, 1, 0),
            llm.BlocksCacheKey(2, 3),
            llm.TransferConfig(2, [0x1000, 0x2000]),
            *caches,
            [0, 1],
            [[0, 1]],
            {0: 1},
        ]
    )
    return st.one_of(junk, good, st.lists(good, max_size=2))


Invoke = Callable[..., Any]  # invoke(fn, *args): call, await where needed, return the result


def _call_everything(invoke: Invoke, cm: Any, dd: Any) -> None:
    def free(cache: Any) -> None:
        call = cm.deallocate_blocks_cache if cache.is_blocks_cache else cm.deallocate_cache
        with contextlib.suppress(*ALLOWED):
            invoke(call, cache)

    desc = llm.CacheDesc(2, [4, 64], llm.DataType.DT_FLOAT, llm.Placement.HOST)
    caches = [invoke(cm.allocate_cache, desc), invoke(cm.allocate_blocks_cache, desc)]

    @settings(max_examples=400, deadline=None)
    @given(st.sampled_from(METHODS), st.data())
    def call(name: str, data: Any) -> None:
        values = data.draw(st.lists(arguments(caches), max_size=5))
        with contextlib.suppress(*ALLOWED):
            result = invoke(getattr(cm, name), *values)
            if isinstance(result, llm.Cache):
                free(result)

    call()
    with contextlib.suppress(*ALLOWED):
        invoke(dd.query_register_mem_status, 0)
    for cache in caches:
        free(cache)
    assert cm.pool_stats(llm.Placement.HOST).used == 0


def _engine_options() -> dict[str, str]:
    cfg = llm.LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.transport = "loopback"
    cfg.mem_pool_cfg = '{"memory_size": 8388608}'
    cfg.host_mem_pool_cfg = '{"memory_size": 8388608}'
    return dict(cfg.generate_options())


def test_blocking_api_with_random_arguments() -> None:
    def invoke(fn: Callable[..., Any], *values: Any) -> Any:
        result = fn(*values)
        if isinstance(result, llm.CacheTask):
            result.synchronize()
        return result

    dd = llm.LLMDataDist(llm.LLMRole.DECODER, 9)
    dd.init(_engine_options())
    try:
        _call_everything(invoke, dd.cache_manager, dd)
    finally:
        dd.finalize()


async def _call_and_await(fn: Callable[..., Any], *values: Any) -> Any:
    result = fn(*values)
    if asyncio.iscoroutine(result) or isinstance(result, llm.CacheTask):
        result = await result
    return result


def test_async_api_with_random_arguments() -> None:
    loop = asyncio.new_event_loop()

    def invoke(fn: Callable[..., Any], *values: Any) -> Any:
        return loop.run_until_complete(_call_and_await(fn, *values))

    dd = llm.AsyncLLMDataDist(llm.LLMRole.DECODER, 9)
    try:
        invoke(dd.init, _engine_options())
        cm = invoke(lambda: dd.cache_manager)
        _call_everything(invoke, cm, dd)
    finally:
        invoke(dd.finalize)
        loop.close()
