"""``AioDataDistConnector``: vLLM's ``KVConnectorBase_V1`` on aio_datadist.

Load it with ``--kv-transfer-config '{"kv_connector": "AioDataDistConnector",
"kv_connector_module_path": "aio_datadist.vllm", "kv_role": "kv_both"}'`` on the prefill and
the decode instance; ``kv_connector_extra_config`` takes the settings of
:class:`aio_datadist._connector.config.ConnectorConfig` (``host``, ``port``, ``mode``,
``link_secret``, ``abort_timeout``, the engine's transport settings, ...). Requests follow
NixlConnector's convention, so vLLM's disaggregation proxies work unchanged. The facade only
dispatches: the scheduler side is :class:`~aio_datadist.vllm.scheduler.SchedulerSide`, the
worker side :class:`~aio_datadist.vllm.worker.WorkerSide`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from aio_datadist._connector.config import MODE_PUSH, ConnectorConfig
from aio_datadist.vllm.metadata import AioConnectorMetadata
from aio_datadist.vllm.metrics import AioKVConnectorStats, AioPromMetrics
from aio_datadist.vllm.scheduler import SchedulerSide
from aio_datadist.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ("AioDataDistConnector",)


def _config(vllm_config: VllmConfig) -> ConnectorConfig:
    from vllm.utils.network_utils import get_ip

    transfer = vllm_config.kv_transfer_config
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    return ConnectorConfig.from_extra(extra, default_host=get_ip())


class AioDataDistConnector(KVConnectorBase_V1):
    """P/D disaggregation over aio_datadist: pull (D reads P's blocks) or layer-wise push."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._settings = _config(vllm_config)
        parallel = vllm_config.parallel_config
        if getattr(parallel, "pipeline_parallel_size", 1) != 1:
            raise ValueError("AioDataDistConnector supports pipeline parallel size 1 only")
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
            if getattr(parallel, name, 1) != 1:
                raise ValueError(f"AioDataDistConnector does not support {name} > 1")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError(
                "AioDataDistConnector supports models whose layers share one KV cache group "
                f"(this model has {len(kv_cache_config.kv_cache_groups)})"
            )
        engine_id = str(self._kv_transfer_config.engine_id)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(vllm_config, self._settings, engine_id)
        else:
            assert kv_cache_config is not None
            self.worker_side = WorkerSide(vllm_config, self._settings, engine_id, kv_cache_config)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """Layer-outermost pages (each layer's blocks one after another), except for MLA,
        whose single latent cache is that already."""
        model = vllm_config.model_config
        if model is None or getattr(model, "use_mla", False):
            return None
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Push mode follows each layer as the forward writes it."""
        return (extra_config or {}).get("mode") == MODE_PUSH

    # -- worker side --------------------------------------------------------------------------
    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side call on the scheduler side"
        return self.worker_side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register vLLM's KV tensors in place and start the worker's node."""
        self._worker().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """Where this worker's control channel listens."""
        return self.worker_side.handshake() if self.worker_side is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Take the step's metadata (before the forward)."""
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None and isinstance(connector_metadata, AioConnectorMetadata):
            self.worker_side.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start the step's loads; they finish asynchronously (``get_finished``)."""
        meta = self._connector_metadata
        if isinstance(meta, AioConnectorMetadata):
            self._worker().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole requests, reported by ``get_finished``: nothing to wait for."""

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Push mode: the layer is written, its pushes may go."""
        self._worker().save_layer(layer_name)

    def wait_for_save(self) -> None:
        """The step's forward ended; its pushes go on without blocking the model runner."""
        if self.worker_side is not None:
            self.worker_side.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(requests whose blocks may go, requests whose load ended)."""
        return self._worker().transfer_results(self._bound())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """As ``get_finished``; failed loads report their blocks through
        ``get_block_ids_with_load_errors``."""
        sending, recving = self._worker().transfer_results(self._bound())
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)

    def _bound(self) -> AioConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, AioConnectorMetadata) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks of loads that failed (vLLM recomputes or fails their requests, as
        ``kv_load_failure_policy`` says)."""
        return self._worker().load_errors()

    def get_kv_connector_stats(self) -> AioKVConnectorStats | None:
        """What the node did since the last step."""
        if self.worker_side is None:
            return None
        data = self.worker_side.stats()
        return AioKVConnectorStats(data=data) if data is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> AioKVConnectorStats:
        """The stats object for ``data`` (or an empty one)."""
        return AioKVConnectorStats(data=data) if data is not None else AioKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> AioPromMetrics:
        """The connector's Prometheus metrics."""
        return AioPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Stop the worker's node."""
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # -- scheduler side -----------------------------------------------------------------------
    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-side call on a worker"
        return self.scheduler_side

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """The workers' control addresses, by TP rank."""
        self._scheduler().set_handshakes(dict(metadata))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """D: the prompt tokens past the local prefix hit load from P, asynchronously."""
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """D: a load's blocks are allocated. P: a push request is scheduled."""
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's work for the workers."""
        return self._scheduler().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: hold a request's blocks for its decode and say where they are."""
        return self._scheduler().request_finished(request, block_ids)
