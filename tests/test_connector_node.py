"""The engine-neutral connector core: two nodes in one process, KV in numpy arrays.

A prefill node (P) and a decode node (D) each register their "KV cache" (per layer one or two
regions of equal blocks) and talk over real control connections and transfer links on
127.0.0.1: pulls with leases, layer-wise pushes in steps, and every way a load can fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aio_datadist._connector.config import ConnectorConfig
from aio_datadist._connector.gate import LayerGate
from aio_datadist._connector.layout import KvLayout
from aio_datadist._connector.node import KvNode
from aio_datadist._connector.outcomes import Taken
from aio_datadist._connector.params import RemoteSource, producer_params
from aio_datadist._connector.producer import PushChunk

LAYERS, BLOCKS, BLOCK_BYTES, BLOCK_SIZE = 3, 16, 4096, 32


class Node:
    """A started node, its KV arrays and what it reported so far."""

    def __init__(self, name: str, regions: int = 1, **settings: Any) -> None:
        self.arrays = [np.zeros((BLOCKS, BLOCK_BYTES), np.uint8) for _ in range(LAYERS * regions)]
        layout = KvLayout(
            num_layers=LAYERS,
            tensors_per_layer=regions,
            num_blocks=BLOCKS,
            block_bytes=BLOCK_BYTES,
            addrs=tuple(int(a.ctypes.data) for a in self.arrays),
            block_size=BLOCK_SIZE,
            dtype="bfloat16",
        )
        config = ConnectorConfig.from_extra(
            {"host": "127.0.0.1", "load_timeout": 5, "connect_timeout": 2, **settings},
            default_host="127.0.0.1",
        )
        self.node = KvNode(config, layout, engine_id=name, rank=0, tp_size=1)
        self.node.start()
        self.seen = Taken()

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for array in self.arrays:
            array[...] = rng.integers(0, 256, array.shape, dtype=np.uint8)

    def collect(self) -> Taken:
        taken = self.node.outcomes.take()
        self.seen.finished_sending |= taken.finished_sending
        self.seen.finished_recving |= taken.finished_recving
        self.seen.failed_recving |= taken.failed_recving
        self.seen.failed_blocks |= taken.failed_blocks
        return self.seen

    def on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        self.node.loop.call(fn, *args)

    def source(self, request_id: str, blocks: list[int], tokens: int, **over: Any) -> RemoteSource:
        params = producer_params(
            engine_id=self.node.engine_id,
            request_id=request_id,
            ranks=[self.node.control_address],
            block_ids=blocks,
            num_tokens=tokens,
            tp_size=1,
            mode=over.pop("mode", "pull"),
            transfer_id=over.pop("transfer_id", None),
        )
        return RemoteSource.from_params({**params, **over})

    def close(self) -> None:
        self.node.close()


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Node]]:
    # A node picks the runtime its KV's memory needs (AIO_DATADIST_RUNTIME); other tests
    # find the variable as it was.
    monkeypatch.delenv("AIO_DATADIST_RUNTIME", raising=False)
    made: list[Node] = []

    def make(name: str, **kwargs: Any) -> Node:
        node = Node(name, **kwargs)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


def same_blocks(p: Node, d: Node, p_blocks: list[int], d_blocks: list[int]) -> bool:
    return all(
        np.array_equal(pa[p_blocks], da[d_blocks])
        for pa, da in zip(p.arrays, d.arrays, strict=True)
    )


@pytest.mark.parametrize("regions", [1, 2])
def test_a_pull_moves_every_layer_and_releases_the_blocks(
    nodes: Callable[..., Node], regions: int
) -> None:
    p, d = nodes("p", regions=regions), nodes("d", regions=regions)
    p.fill(1)
    p.on_loop(p.node.producer.offer, "r1", (5, 6, 7), 70)
    d.on_loop(d.node.consumer.load, "d1", p.source("r1", [5, 6, 7], 70), [1, 2, 3], 0, 70)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert not d.seen.failed_recving
    assert same_blocks(p, d, [5, 6, 7], [1, 2, 3])
    assert not any(a[[0, 4]].any() for a in d.arrays)  # nothing else written
    wait_for(lambda: "r1" in p.collect().finished_sending)  # released by the decode
    counts = d.node.counters.take()
    assert counts["loads"] == 1 and counts["load_bytes"] == 3 * BLOCK_BYTES * LAYERS * regions
    assert p.node.counters.take()["released"] == 1


def test_a_pull_skips_the_blocks_the_decode_has(nodes: Callable[..., Node]) -> None:
    p, d = nodes("p"), nodes("d")
    p.fill(2)
    p.on_loop(p.node.producer.offer, "r1", (9, 3, 4), 80)
    # the decode had the first block (a prefix cache hit): it loads blocks 1 and 2 only
    d.on_loop(d.node.consumer.load, "d1", p.source("r1", [9, 3, 4], 80), [11, 12], 1, 80)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert same_blocks(p, d, [3, 4], [11, 12])
    assert not any(a[9].any() or a[0].any() for a in d.arrays)


def test_a_decode_that_asks_before_the_offer_waits_for_it(nodes: Callable[..., Node]) -> None:
    p, d = nodes("p"), nodes("d")
    p.fill(3)
    d.on_loop(d.node.consumer.load, "d1", p.source("r1", [2], 20), [0], 0, 20)
    wait_for(lambda: "r1" in p.node.producer._offered)  # the acquire is waiting
    p.on_loop(p.node.producer.offer, "r1", (2,), 20)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert not d.seen.failed_recving and same_blocks(p, d, [2], [0])


def test_blocks_nobody_takes_are_freed_at_the_abort_timeout_and_a_late_pull_fails(
    nodes: Callable[..., Node],
) -> None:
    p, d = nodes("p", abort_timeout=0.2), nodes("d")
    p.on_loop(p.node.producer.offer, "r1", (1, 2), 40)
    wait_for(lambda: "r1" in p.collect().finished_sending)
    assert p.node.counters.take()["expired"] == 1
    d.on_loop(d.node.consumer.load, "d1", p.source("r1", [1, 2], 40), [5, 6], 0, 40)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert d.seen.failed_recving == {"d1"} and d.seen.failed_blocks == {5, 6}
    assert not any(a.any() for a in d.arrays)


def test_a_load_from_nowhere_fails_at_once(nodes: Callable[..., Node]) -> None:
    d = nodes("d")
    source = RemoteSource.from_params(
        {"remote_host": "127.0.0.1", "remote_port": 9, "remote_request_id": "r1"}
    )
    d.on_loop(d.node.consumer.load, "d1", source, [3], 0, 10)
    wait_for(lambda: "d1" in d.collect().finished_recving, timeout=5)
    assert d.seen.failed_blocks == {3}


@pytest.mark.parametrize(
    ("p_secret", "d_secret", "ok"),
    [("s3cret", "s3cret", True), ("s3cret", "other", False), (None, "s3cret", False)],
)
def test_control_connections_are_authenticated(
    nodes: Callable[..., Node], p_secret: str | None, d_secret: str | None, ok: bool
) -> None:
    p = nodes("p", **({"link_secret": p_secret} if p_secret else {}))
    d = nodes("d", **({"link_secret": d_secret} if d_secret else {}))
    p.on_loop(p.node.producer.offer, "r1", (1,), 10)
    d.on_loop(d.node.consumer.load, "d1", p.source("r1", [1], 10), [2], 0, 10)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert (d.seen.failed_recving == set()) is ok


def test_a_peer_with_another_layout_is_refused(nodes: Callable[..., Node]) -> None:
    p, d = nodes("p", regions=2), nodes("d", regions=1)
    p.on_loop(p.node.producer.offer, "r1", (1,), 10)
    d.on_loop(d.node.consumer.load, "d1", p.source("r1", [1], 10), [2], 0, 10)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert d.seen.failed_recving == {"d1"}


def test_another_tensor_parallel_size_is_refused(nodes: Callable[..., Node]) -> None:
    p, d = nodes("p"), nodes("d")
    p.on_loop(p.node.producer.offer, "r1", (1,), 10)
    d.on_loop(d.node.consumer.load, "d1", p.source("r1", [1], 10, tp_size=2), [2], 0, 10)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert d.seen.failed_recving == {"d1"}


def expect_push(p: Node, d: Node, blocks: list[int], tokens: int, wait: bool = True) -> None:
    """D loads request "d1" by push (transfer "t1" of P's request "r1") into ``blocks``; with
    ``wait``, until P holds the expectation."""
    source = p.source("r1", [], tokens, mode="push", transfer_id="t1")
    d.on_loop(d.node.consumer.load, "d1", source, blocks, 0, tokens)
    if wait:
        wait_for(lambda: "t1" in p.node.producer._expected)


def step(p: Node, number: int, chunks: list[PushChunk], layers_first: bool = True) -> None:
    """Run one "forward" on P: plan, mark each layer as it is written, end."""
    gate = LayerGate(LAYERS)
    p.on_loop(p.node.producer.plan_step, number, gate, chunks)
    for layer in range(LAYERS):
        p.on_loop(gate.mark, layer)
    p.on_loop(p.node.producer.end_step, number, True)


@pytest.mark.parametrize("expect_first", [True, False])
def test_a_push_lands_layer_by_layer_across_steps(
    nodes: Callable[..., Node], expect_first: bool
) -> None:
    p, d = nodes("p"), nodes("d")
    p.fill(4)
    blocks = (4, 5, 6)
    source = p.source("r1", [], 70, mode="push", transfer_id="t1")
    if expect_first:
        d.on_loop(d.node.consumer.load, "d1", source, [7, 8, 9], 0, 70)
        wait_for(lambda: "t1" in p.node.producer._expected)
    step(p, 1, [PushChunk("r1", "t1", blocks[:2], 70, 40)])  # a first chunk of 40 tokens
    step(p, 2, [PushChunk("r1", "t1", blocks, 70, 70)])
    if not expect_first:
        d.on_loop(d.node.consumer.load, "d1", source, [7, 8, 9], 0, 70)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert not d.seen.failed_recving
    assert same_blocks(p, d, [4, 5, 6], [7, 8, 9])
    p.on_loop(p.node.producer.offer, "r1", blocks, 70)  # the engine finished the request
    wait_for(lambda: "r1" in p.collect().finished_sending)
    assert p.node.counters.take()["pushes"] == 1


def test_a_push_waits_at_the_gate_for_each_layer(nodes: Callable[..., Node]) -> None:
    p, d = nodes("p"), nodes("d")
    p.fill(5)
    expect_push(p, d, [3], 30)
    gate = LayerGate(LAYERS)
    p.on_loop(p.node.producer.plan_step, 1, gate, [PushChunk("r1", "t1", (2,), 30, 30)])
    p.on_loop(gate.mark, 0)

    def landed(layer: int) -> bool:
        return bool(np.array_equal(d.arrays[layer][3], p.arrays[layer][2]))

    wait_for(lambda: landed(0))
    assert not landed(1) and not landed(2)  # layer 1 not written yet: not sent
    p.on_loop(gate.mark, 1)
    wait_for(lambda: landed(1))
    assert "d1" not in d.collect().finished_recving
    p.on_loop(gate.mark, 2)
    p.on_loop(p.node.producer.end_step, 1, True)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert not d.seen.failed_recving and landed(2)


def test_a_push_the_prefill_never_makes_times_out_and_is_cancelled(
    nodes: Callable[..., Node],
) -> None:
    p, d = nodes("p"), nodes("d", load_timeout=0.3)
    expect_push(p, d, [3], 30, wait=False)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert d.seen.failed_blocks == {3}
    wait_for(lambda: "t1" not in p.node.producer._expected)  # the decode cancelled it


def test_a_push_fails_when_the_prefill_goes_away(nodes: Callable[..., Node]) -> None:
    p, d = nodes("p"), nodes("d")
    expect_push(p, d, [3], 30)
    p.close()
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert d.seen.failed_recving == {"d1"}


def test_a_push_of_another_prompt_length_fails_on_both_sides(nodes: Callable[..., Node]) -> None:
    p, d = nodes("p"), nodes("d")
    expect_push(p, d, [3, 4], 50)
    step(p, 1, [PushChunk("r1", "t1", (1,), 30, 30)])
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert d.seen.failed_recving == {"d1"}
    p.on_loop(p.node.producer.offer, "r1", (1,), 30)
    wait_for(lambda: "r1" in p.collect().finished_sending)


def test_an_aborted_prefill_fails_the_push(nodes: Callable[..., Node]) -> None:
    p, d = nodes("p"), nodes("d")
    expect_push(p, d, [3, 4, 5], 70)
    step(p, 1, [PushChunk("r1", "t1", (1, 2), 70, 40)])
    p.on_loop(p.node.producer.forget, "r1")
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert d.seen.failed_recving == {"d1"}
    assert not p.node.producer._pushes


def test_node_threads_end_at_close(nodes: Callable[..., Node]) -> None:
    p = nodes("p")
    thread = p.node.loop._thread
    p.close()
    assert not thread.is_alive()


async def test_a_load_does_not_need_the_callers_loop(nodes: Callable[..., Node]) -> None:
    """The hooks are plain calls from the engine's thread; a running loop there is not used."""
    p, d = nodes("p"), nodes("d")
    p.on_loop(p.node.producer.offer, "r1", (1,), 10)
    d.on_loop(d.node.consumer.load, "d1", p.source("r1", [1], 10), [2], 0, 10)
    deadline = time.monotonic() + 10
    while "d1" not in d.collect().finished_recving:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


def test_a_decode_asking_for_an_ended_push_is_refused_at_once(nodes: Callable[..., Node]) -> None:
    p, d = nodes("p", abort_timeout=0.3), nodes("d", load_timeout=30)
    step(p, 1, [PushChunk("r1", "t1", (1,), 30, 30)])
    p.on_loop(p.node.producer.offer, "r1", (1,), 30, "t1")
    wait_for(lambda: "r1" in p.collect().finished_sending)  # nobody came: freed
    started = time.monotonic()
    source = p.source("r1", [], 30, mode="push", transfer_id="t1")
    d.on_loop(d.node.consumer.load, "d1", source, [3], 0, 30)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert d.seen.failed_blocks == {3}
    assert time.monotonic() - started < 10  # refused, not waited out (load_timeout is 30 s)


def test_an_unexpected_error_in_a_load_is_reported_not_lost(
    nodes: Callable[..., Node], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    p, d = nodes("p"), nodes("d")

    async def broken(*args: Any) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr(d.node.consumer, "_pull", broken)
    p.on_loop(p.node.producer.offer, "r1", (1,), 10)
    with caplog.at_level("WARNING", logger="aio_datadist.kv"):
        d.on_loop(d.node.consumer.load, "d1", p.source("r1", [1], 10), [2], 0, 10)
        wait_for(lambda: "d1" in d.collect().finished_recving)
    assert d.seen.failed_blocks == {2}
    assert any("kv.load_failed request=d1" in r.getMessage() for r in caplog.records)


def test_an_expectation_arriving_mid_step_joins_the_running_step(
    nodes: Callable[..., Node],
) -> None:
    """D asks while P's step runs: the layers written so far go at once, the rest as the
    step's gate opens them (not after the step)."""
    p, d = nodes("p"), nodes("d")
    p.fill(7)
    gate = LayerGate(LAYERS)
    p.on_loop(p.node.producer.plan_step, 1, gate, [PushChunk("r1", "t1", (2,), 30, 30)])
    p.on_loop(gate.mark, 0)
    expect_push(p, d, [5], 30, wait=False)

    def landed(layer: int) -> bool:
        return bool(np.array_equal(d.arrays[layer][5], p.arrays[layer][2]))

    wait_for(lambda: landed(0))  # layer 0 went while the step still runs
    assert not landed(1)
    p.on_loop(gate.mark, 1)
    wait_for(lambda: landed(1))
    p.on_loop(gate.mark, 2)
    p.on_loop(p.node.producer.end_step, 1, True)
    wait_for(lambda: "d1" in d.collect().finished_recving)
    assert not d.seen.failed_recving and landed(2)
    assert p.node.counters.take()["pushes"] == 1
