"""Run with a Python that has torch: vLLM's KV tensor layouts registered in place and moved.

For each layout vLLM's attention backends use (K and V joined in each block, K and V apart,
MLA's single latent cache), a prefill node and a decode node register torch tensors of that
layout; a pull and a layer-wise push must move exactly the named blocks of every layer.
A layout whose blocks are not contiguous per layer is refused with the layout to ask for.
Prints ``ok`` when every check held (``tests/test_vllm_serving.py`` runs it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aio_datadist._connector.config import ConnectorConfig
from aio_datadist._connector.gate import LayerGate
from aio_datadist._connector.node import KvNode
from aio_datadist._connector.params import RemoteSource, producer_params
from aio_datadist._connector.producer import PushChunk
from aio_datadist._connector.tensors import kv_layout

BLOCKS, BLOCK_SIZE, LAYERS = 12, 16, 3


def caches(kind: str, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)

    out = {}
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.self_attn.attn"
        if kind == "joined":  # [blocks, heads, tokens, K|V]
            out[name] = rand(BLOCKS, 2, BLOCK_SIZE, 64)
        elif kind == "split":  # [2, blocks, tokens, heads, head]
            out[name] = rand(2, BLOCKS, BLOCK_SIZE, 2, 32)
        else:  # MLA: [blocks, tokens, latent]
            out[name] = rand(BLOCKS, BLOCK_SIZE, 96)
    return out


def node(name: str, tensors: dict[str, torch.Tensor]) -> tuple[KvNode, dict[str, int]]:
    layout, index = kv_layout(tensors, num_blocks=BLOCKS, block_size=BLOCK_SIZE)
    config = ConnectorConfig.from_extra({"host": "127.0.0.1"}, default_host="127.0.0.1")
    made = KvNode(config, layout, engine_id=name, rank=0, tp_size=1)
    made.start()
    return made, index


def blocks(tensor: torch.Tensor, ids: list[int], kind: str) -> torch.Tensor:
    return tensor[:, ids] if kind == "split" else tensor[ids]


def wait(predicate: object, what: str) -> None:
    deadline = time.monotonic() + 20
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not in time")
        time.sleep(0.005)


def check(kind: str) -> None:
    p_kv, d_kv = caches(kind, 1), caches(kind, 2)
    (p, _), (d, index) = node(f"p-{kind}", p_kv), node(f"d-{kind}", d_kv)
    assert list(index.values()) == list(range(LAYERS)), index
    expected = 2 if kind == "split" else 1
    assert p.layout.tensors_per_layer == expected, (kind, p.layout)
    try:
        # pull: P's blocks 3, 7 into D's 0, 1
        params = producer_params(engine_id=p.engine_id, request_id="r", ranks=[p.control_address],
                                 block_ids=[3, 7], num_tokens=20, tp_size=1, mode="pull",
                                 transfer_id=None)  # fmt: skip
        p.loop.call(p.producer.offer, "r", (3, 7), 20)
        d.loop.call(d.consumer.load, "d1", RemoteSource.from_params(params), [0, 1], 0, 20)
        got = d.outcomes.take
        seen: set[str] = set()
        wait(lambda: seen.update(got().finished_recving) or "d1" in seen, "pull")
        for name in p_kv:
            assert torch.equal(blocks(d_kv[name], [0, 1], kind), blocks(p_kv[name], [3, 7], kind))
            assert not torch.equal(blocks(d_kv[name], [2], kind), blocks(p_kv[name], [2], kind))
        # push, layer by layer: P's block 5 into D's block 9
        source = RemoteSource.from_params({**params, "transfer_mode": "push", "transfer_id": "t"})
        d.loop.call(d.consumer.load, "d2", source, [9], 0, 10)
        wait(lambda: "t" in p.producer._expected, "expect")
        gate = LayerGate(LAYERS)
        p.loop.call(p.producer.plan_step, 1, gate, [PushChunk("q", "t", (5,), 10, 10)])
        for layer in range(LAYERS):
            p.loop.call(gate.mark, layer)
        p.loop.call(p.producer.end_step, 1, True)
        wait(lambda: seen.update(got().finished_recving) or "d2" in seen, "push")
        assert not d.outcomes.take().failed_blocks
        for name in p_kv:
            assert torch.equal(blocks(d_kv[name], [9], kind), blocks(p_kv[name], [5], kind))
    finally:
        d.close()
        p.close()


def refused() -> None:
    raw = torch.zeros(BLOCKS, LAYERS, 2, BLOCK_SIZE, 64, dtype=torch.bfloat16)  # blocks outermost
    tensors = {f"layer{i}": raw[:, i] for i in range(LAYERS)}
    try:
        kv_layout(tensors, num_blocks=BLOCKS, block_size=BLOCK_SIZE, hint="ask for LBHNC")
    except ValueError as exc:
        assert "one after another; ask for LBHNC" in str(exc), exc
    else:
        raise AssertionError("a block-outermost layout was accepted")


if __name__ == "__main__":
    for kind in ("joined", "split", "mla"):
        check(kind)
    refused()
    print("ok")
