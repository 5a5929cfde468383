"""The worker side of the connector: one node per worker, driven by vLLM's hooks.

Every hook returns at once: it hands work to the node's event loop thread (offers, loads,
a step's pushes, a layer written) or collects what the node finished. ``register_kv_caches``
is the exception: at worker start it starts the node (engine, registration, control port),
which takes about as long as the engine's own start-up of its listener.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aio_datadist._connector.config import ConnectorConfig
from aio_datadist._connector.gate import LayerGate
from aio_datadist._connector.node import KvNode
from aio_datadist._connector.params import RemoteSource
from aio_datadist._connector.tensors import kv_layout
from aio_datadist.enums import LLMRole
from aio_datadist.vllm.metadata import AioConnectorMetadata, AioHandshake

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ("WorkerSide",)

#: vLLM's ``kv_role`` to the engine's role (a label in CacheManager mode).
_ROLES = {"kv_producer": LLMRole.PROMPT, "kv_consumer": LLMRole.DECODER}
LOG_UNDER = "vllm.aio_datadist"
#: How to ask vLLM for KV tensors this connector registers.
LAYOUT_HINT = "run vLLM with a layer-outermost KV cache layout (VLLM_KV_CACHE_LAYOUT=LBHNC)"
#: Longest wait for a transfer to end on a step that computes nothing (seconds).
IDLE_WAIT_S = 0.005


class WorkerSide:
    """Worker-side state of one worker."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        config: ConnectorConfig,
        engine_id: str,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self._vllm_config = vllm_config
        self._config = config
        self._engine_id = engine_id
        self._kv_cache_config = kv_cache_config
        self._rank = int(get_tensor_model_parallel_rank())
        self._tp_size = int(get_tensor_model_parallel_world_size())
        transfer = vllm_config.kv_transfer_config
        self._role = _ROLES.get(getattr(transfer, "kv_role", ""), LLMRole.MIX)
        self._node: KvNode | None = None
        self._layers: dict[str, int] = {}
        self._step = 0
        self._gate: LayerGate | None = None
        self._events: list[Any] | None = None
        self._on_device = False
        self._failed_blocks: set[int] = set()
        self._routes: dict[str, tuple[int, int, int]] = {}

    @property
    def node(self) -> KvNode:
        """The worker's node (after ``register_kv_caches``)."""
        assert self._node is not None, "register_kv_caches has not run"
        return self._node

    # -- start and stop ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Register the worker's KV tensors in place and start the node."""
        layout, self._layers = kv_layout(
            kv_caches,
            num_blocks=int(self._kv_cache_config.num_blocks),
            block_size=int(self._vllm_config.cache_config.block_size),
            hint=LAYOUT_HINT,
        )
        self._on_device = layout.device != "cpu"
        node = KvNode(
            self._config,
            layout,
            engine_id=self._engine_id,
            rank=self._rank,
            tp_size=self._tp_size,
            role=self._role,
            log_under=LOG_UNDER,
        )
        node.start()
        self._node = node

    def handshake(self) -> AioHandshake | None:
        """Where this worker's control channel listens (for the scheduler side)."""
        if self._node is None:
            return None
        host, port = self._node.control_address
        return AioHandshake(host=host, port=port, rank=self._rank)

    def shutdown(self) -> None:
        """Stop the node."""
        if self._node is not None:
            self._node.close()

    # -- each step --------------------------------------------------------------------------
    def bind(self, meta: AioConnectorMetadata) -> None:
        """A step's metadata arrived, before its forward: hand over offers and drops, and
        open the step's gate when it computes push requests."""
        node = self._node
        if node is None:
            return
        call = node.loop.call
        for request_id, (blocks, tokens, transfer_id) in meta.offers.items():
            call(node.producer.offer, request_id, tuple(blocks), tokens, transfer_id)
        for request_id in meta.forget:
            call(node.producer.forget, request_id)
        for params in meta.abandon:
            try:
                call(node.consumer.abandon, RemoteSource.from_params(params))
            except ValueError as exc:
                node.log.warning("kv.bad_params", error=str(exc))
        if meta.push_chunks:
            self._step += 1
            layers = node.layout.num_layers
            events: list[Any] | None = [None] * layers if self._on_device else None
            ready = None
            if events is not None:
                captured = events

                def ready(layer: int) -> bool:
                    event = captured[layer]
                    return event is None or bool(event.query())

            self._gate, self._events = LayerGate(layers, ready), events
            call(node.producer.plan_step, self._step, self._gate, list(meta.push_chunks))

    def start_load(self, meta: AioConnectorMetadata) -> None:
        """Start this step's loads (each request's layers in one transfer, all concurrent)."""
        node = self._node
        if node is None:
            return
        for load in meta.loads:
            try:
                source = RemoteSource.from_params(load.params)
            except ValueError as exc:
                node.log.warning("kv.load_failed", request=load.request_id, error=str(exc))
                node.counters.add("load_failures")
                node.outcomes.failed(load.request_id, list(load.blocks))
                continue
            node.loop.call(
                node.consumer.load,
                load.request_id,
                source,
                list(load.blocks),
                load.skip,
                load.num_tokens,
            )

    def save_layer(self, layer_name: str) -> None:
        """Layer ``layer_name`` of this step is written (queued, on a device)."""
        gate = self._gate
        if gate is None:
            return
        index = self._layers.get(layer_name)
        if index is None:
            return
        if self._events is not None:
            import torch

            event = torch.cuda.Event()
            event.record()
            self._events[index] = event
        self.node.loop.call(gate.mark, index)

    def end_step(self) -> None:
        """The step's forward is done: its layers are all written."""
        if self._gate is None:
            return
        self._gate = None
        self.node.loop.call(self.node.producer.end_step, self._step, True)

    # -- results ----------------------------------------------------------------------------
    def transfer_results(self, meta: AioConnectorMetadata | None) -> tuple[set[str], set[str]]:
        """(requests whose blocks may go, requests whose load ended) since the last call; the
        failed loads' blocks wait for :meth:`load_errors`.

        On a step that computes nothing while transfers are in flight (vLLM steps on only to
        collect them), this waits up to ``IDLE_WAIT_S`` for one to end: vLLM's loop would
        otherwise spin a core until then, and with P and D on one host that core may be the
        one P computes on.
        """
        if self._node is None:
            return set(), set()
        idle = meta is not None and meta.idle and not meta.loads and not meta.push_chunks
        wait = IDLE_WAIT_S if idle and self._node.busy() else 0.0
        taken = self._node.outcomes.take(wait)
        self._failed_blocks |= taken.failed_blocks
        return taken.finished_sending, taken.finished_recving

    def load_errors(self) -> set[int]:
        """Local blocks of loads that failed since the last call."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def stats(self) -> dict[str, Any] | None:
        """What the node did since the last call; None when nothing."""
        if self._node is None:
            return None
        data = self._node.counters.take()
        snapshot = self._node.stats()
        routes: dict[str, list[int]] = {}
        if snapshot is not None:
            for route in snapshot.routes:
                key = f"{route.route}/{route.op}"
                now = (route.count, route.failed, route.bytes)
                before = self._routes.get(key, (0, 0, 0))
                delta = [a - b for a, b in zip(now, before, strict=True)]
                self._routes[key] = now
                if any(delta):
                    routes[key] = delta
        data["routes"] = routes
        counted = any(v for k, v in data.items() if k != "routes")
        return data if counted or routes else None
