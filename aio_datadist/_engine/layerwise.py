"""Layer-wise ``transfer_cache_async``: validation, per-layer requests and task results.

A :class:`LayerJob` holds the validated configs, the request of each (config, layer) and the
result rules; ``_engine.driver.run_layers`` drives it for both faces: it asks the
synchroniser for a layer, starts that layer's requests without waiting for them, and goes on
with the next layer, so layer k moves while the model finishes layer k+1. Cancellation and
failures stop the job at a layer edge; a request already sent completes.

No failure is reduced to a bare code: each config keeps the exception behind its status (the
transfer's, or the synchroniser's wrapped in ``LLM_PARAM_INVALID``), which ``await task``
raises; an exception raised by the synchroniser is also logged once at WARNING.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from aio_datadist._engine.access import Access, Target
from aio_datadist._engine.planner import Planner, local_blocks, local_rows
from aio_datadist._engine.registry import CacheEntry
from aio_datadist._engine.request import Completion, Plan, Transfer
from aio_datadist._log import get_logger
from aio_datadist._native import api
from aio_datadist._transport.base import RequestKind
from aio_datadist._validate import check_int, check_int_list, check_type
from aio_datadist.cache import Cache
from aio_datadist.enums import Placement
from aio_datadist.status import (
    LLMException,
    LLMFailedError,
    LLMStatusCode,
    LLMTimeoutError,
    ParamInvalidError,
)
from aio_datadist.synchronizer import LayerSynchronizer, is_async_synchronizer
from aio_datadist.task import CacheTask
from aio_datadist.types import (
    BlocksCacheKey,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_blocks_key_range,
)

__all__ = ("LayerJob", "plan_layer_job")

_S = LLMStatusCode
_log = get_logger("layerwise")


def _invalid(message: str) -> ParamInvalidError:
    return ParamInvalidError(message, status_code=_S.LLM_PARAM_INVALID)


@dataclass(eq=False)
class _Config:
    """One validated transfer config and its progress."""

    config: TransferConfig | TransferWithCacheKeyConfig
    src: range
    dst_start: int
    started: bool = False
    submitted_last: bool = False
    outstanding: int = 0  # requests started and not yet completed
    failure: LLMStatusCode | None = None
    #: The exception behind ``failure``, for ``await task`` to raise.
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        """Every layer was sent and every request completed without a failure."""
        return self.submitted_last and not self.outstanding and self.failure is None


class LayerJob:
    """One ``transfer_cache_async`` call: its configs, requests and results."""

    def __init__(
        self,
        planner: Planner,
        entry: CacheEntry,
        synchronizer: LayerSynchronizer,
        configs: list[_Config],
        num_layers: int,
        src_blocks: list[int],
        dst_blocks: list[int],
        dst_block_bytes: int,
        plan: Plan,
        per_layer: int = 2,
    ) -> None:
        self.planner = planner
        self.entry = entry
        self.synchronizer = synchronizer
        self.is_async = is_async_synchronizer(synchronizer)
        self.configs = configs
        self.num_layers = num_layers
        self.src_blocks = src_blocks
        self.dst_blocks = dst_blocks
        self.dst_block_bytes = dst_block_bytes
        self.plan = plan
        #: Tensors per layer (``tensor_num_per_layer``): layer k is tensors [k*n, (k+1)*n).
        self.per_layer = per_layer
        self.stopped = False
        self._lock = threading.Lock()
        self._completions: list[Completion] = []

    # -- per layer ------------------------------------------------------------------------
    def targets(self, layer: int) -> list[int]:
        """Indices of the configs that transfer ``layer``."""
        return [i for i, c in enumerate(self.configs) if layer in c.src]

    def fail(
        self, indices: Sequence[int], status: LLMStatusCode, error: BaseException | None = None
    ) -> None:
        """Record ``status`` (and the exception behind it) for configs and stop the job; a
        config keeps its first failure."""
        with self._lock:
            for i in indices:
                cfg = self.configs[i]
                cfg.started = True
                if cfg.failure is None:
                    cfg.failure = status
                    cfg.error = error
            self.stopped = True

    def synchronizer_failed(self, layer: int, indices: Sequence[int], exc: Exception) -> None:
        """``synchronize_layer(layer)`` raised ``exc``: fail the configs of ``layer`` with
        ``LLM_PARAM_INVALID`` chained to it, and log it once at WARNING."""
        error = ParamInvalidError(
            f"synchronize_layer({layer}) raised {type(exc).__name__}: {exc}",
            status_code=_S.LLM_PARAM_INVALID,
        )
        error.__cause__ = exc
        _log.warning(
            "task.synchronizer_failed",
            layer=layer,
            error=f"{type(exc).__name__}: {exc}",
            exc_info=exc,
        )
        self.fail(indices, _S.LLM_PARAM_INVALID, error)

    def synchronizer_refused(self, layer: int, indices: Sequence[int], result: object) -> None:
        """``synchronize_layer(layer)`` returned ``result``, not true: fail the configs of
        ``layer`` with ``LLM_PARAM_INVALID``."""
        error = ParamInvalidError(
            f"synchronize_layer({layer}) returned {result!r}: the layer was not sent",
            status_code=_S.LLM_PARAM_INVALID,
        )
        self.fail(indices, _S.LLM_PARAM_INVALID, error)

    def transfers(self, layer: int, indices: Sequence[int]) -> list[tuple[int, Transfer]]:
        """The requests of ``layer`` for the configs ``indices``; failures stop the job."""
        self.plan.deadline_ns = api.deadline_after(self.planner.timeout_ms / 1000)
        out: list[tuple[int, Transfer]] = []
        for i in indices:
            try:
                out.append((i, self._transfer(self.configs[i], layer)))
            except LLMException as exc:
                self.fail([i], exc.status_code, exc)
                break
        return out

    def track(self, task: CacheTask, index: int, layer: int, completion: Completion) -> None:
        """Record a started request of config ``index``; the plan holds its pins.

        A config's success is reported as soon as its last request completed, so a later
        ``task.cancel()`` leaves it alone (and turns every unfinished config into a failure).
        """
        cfg = self.configs[index]
        self.plan.track(completion)
        with self._lock:
            cfg.started = True
            cfg.outstanding += 1
            if layer == cfg.src.stop - 1:
                cfg.submitted_last = True
            self._completions.append(completion)

        def done(fut: Future[None]) -> None:
            exc = fut.exception()
            if exc is not None:
                status = exc.status_code if isinstance(exc, LLMException) else _S.LLM_FAILED
                self.fail([index], status, exc)
            with self._lock:
                cfg.outstanding -= 1
                finished = cfg.finished
            if finished:
                task._set_result(index, _S.LLM_SUCCESS)

        completion.add_done_callback(done)

    @property
    def completions(self) -> list[Completion]:
        """Every request started so far."""
        with self._lock:
            return list(self._completions)

    def finish(self, task: CacheTask) -> None:
        """Fill the task's results and finish it; the pins go once every request completed.

        A config whose requests did not all complete (the wait gave up) reports
        ``LLM_TIMEOUT``; one stopped before its last layer ``LLM_FAILED``.
        """
        with self._lock:
            outcomes = [
                (cfg.failure, cfg.error, cfg.started, cfg.submitted_last, cfg.outstanding)
                for cfg in self.configs
            ]
        for i, (failure, error, started, submitted_last, outstanding) in enumerate(outcomes):
            if failure is not None:
                task._set_result(i, failure, error)
            elif outstanding:
                task._set_result(
                    i,
                    _S.LLM_TIMEOUT,
                    LLMTimeoutError(
                        f"transfer config {i}: a request did not complete within sync_kv_timeout",
                        status_code=_S.LLM_TIMEOUT,
                    ),
                )
            elif submitted_last:
                task._set_result(i, _S.LLM_SUCCESS)
            elif started:
                task._set_result(
                    i,
                    _S.LLM_FAILED,
                    LLMFailedError(
                        f"transfer config {i} stopped before its last layer",
                        status_code=_S.LLM_FAILED,
                    ),
                )
        self.plan.seal()
        task._finish()

    # -- requests -------------------------------------------------------------------------
    def _source(self, layer: int, row: int) -> tuple[Any, int, list[int] | None]:
        """Local rows of ``layer`` (its ``per_layer`` tensors), their segment size and the
        source blocks.

        A PA source without block indices sends its first block of each tensor.
        """
        n = self.per_layer
        entry, tensors, seg = self.entry, (n * layer, n), self.entry.row_bytes
        if entry.is_blocks:
            blocks = self.src_blocks or [0]
            return local_blocks(entry, tensors, blocks, seg), seg, blocks
        return local_rows(entry, tensors, row=row, seg=seg), seg, None

    def _transfer(self, cfg: _Config, layer: int) -> Transfer:
        config = cfg.config
        dst_layer = cfg.dst_start + (layer - cfg.src.start)
        rows, seg, blocks = self._source(layer, config.src_batch_index)
        n_src = len(blocks) if blocks is not None else 1
        if self.dst_blocks:
            chunk = self.dst_block_bytes
            if blocks is not None:
                count, seg_bytes, tail = n_src, seg, seg
            else:
                count = -(-seg // chunk)
                seg_bytes, tail = chunk, seg - (count - 1) * chunk
                if count > len(self.dst_blocks):
                    raise _invalid(
                        f"a row of {seg} bytes needs {count} destination blocks of {chunk} "
                        f"bytes, but dst_block_indices has {len(self.dst_blocks)}"
                    )
            dst_blocks = np.asarray(self.dst_blocks[:count], dtype=np.uint64)
        else:
            count, seg_bytes, tail, dst_blocks = 1, seg * n_src, 0, None
        n = self.per_layer
        if isinstance(config, TransferConfig):
            cluster = config.dst_cluster_id
            k = n * (layer - cfg.src.start)
            bases = np.asarray(config.dst_addrs[k : k + n], dtype=np.uint64)
            if dst_blocks is None:
                remote = np.stack([bases, np.full(n, seg * n_src, dtype=np.uint64)], axis=1)
            else:
                lens = np.full(count, seg_bytes, dtype=np.uint64)
                lens[-1] = tail
                starts = bases[:, None] + dst_blocks[None, :] * np.uint64(chunk)
                remote = np.stack([starts.reshape(-1), np.tile(lens, n)], axis=1)
            access = Access(Target.ADDRESSES, rows=np.ascontiguousarray(remote, dtype=np.uint64))
        else:
            key = config.cache_key
            cluster = key.cluster_id
            fields: dict[str, Any] = {
                "tensor_start": n * dst_layer,
                "tensor_count": n,
                "seg_bytes": seg_bytes,
                "tail_bytes": tail if dst_blocks is not None else 0,
                "blocks": dst_blocks if dst_blocks is not None else np.empty(0, np.uint64),
            }
            if isinstance(key, BlocksCacheKey):
                if dst_blocks is None:
                    fields["blocks"] = np.zeros(1, dtype=np.uint64)
                    fields["tail_bytes"] = 0
                access = Access(Target.BLOCKS_KEY, ident=key.model_id, **fields)
            else:
                access = Access(
                    Target.CACHE_INDEX, ident=key.cache_id, row=key.batch_index, **fields
                )
        return self.planner.transfer(cluster, RequestKind.PUSH, access, rows, self.entry)


def plan_layer_job(
    planner: Planner,
    src_cache: Any,
    layer_synchronizer: Any,
    transfer_configs: Any,
    src_block_indices: Any,
    dst_block_indices: Any,
    dst_block_memory_size: Any,
    *,
    allow_async: bool,
    tensor_num_per_layer: Any = 2,
) -> LayerJob:
    """Validate a ``transfer_cache_async`` call (synchronously) and build its job.

    ``tensor_num_per_layer`` (aio_datadist's extension; the reference always takes 2, K and
    V) is how many consecutive tensors make one layer: 1 for caches that keep K and V of a
    layer in one tensor (vLLM's joined pages, MLA's latent cache).
    """
    check_type("src_cache", src_cache, Cache)
    check_int("tensor_num_per_layer", tensor_num_per_layer, "int32")
    if tensor_num_per_layer < 1:
        raise _invalid(f"tensor_num_per_layer must be >= 1, got {tensor_num_per_layer}")
    per_layer = int(tensor_num_per_layer)
    if src_cache._layout.placement is Placement.HOST:
        raise _invalid("transfer_cache_async does not take a HOST source cache")
    src_blocks = [] if src_block_indices is None else src_block_indices
    dst_blocks = [] if dst_block_indices is None else dst_block_indices
    check_int_list("src_block_indices", src_blocks, "uint64")
    check_int_list("dst_block_indices", dst_blocks, "uint64")
    check_int("dst_block_memory_size", dst_block_memory_size, "uint64", allow_none=True)
    check_type("layer_synchronizer", layer_synchronizer, LayerSynchronizer)
    if not allow_async and is_async_synchronizer(layer_synchronizer):
        raise TypeError(
            "the blocking transfer_cache_async needs a plain synchronize_layer; an async def "
            "synchroniser needs AsyncLLMDataDist"
        )
    check_type("transfer_configs", transfer_configs, list, tuple)
    wanted = TransferWithCacheKeyConfig if planner.remote_cache_accessible else TransferConfig
    for i, config in enumerate(transfer_configs):
        if not isinstance(config, wanted):
            raise TypeError(
                f"transfer_configs[{i}] must be a {wanted.__name__} "
                f"({'with' if planner.remote_cache_accessible else 'without'} "
                "enable_remote_cache_accessible)"
            )
        if isinstance(config, TransferWithCacheKeyConfig) and isinstance(
            config.cache_key, BlocksCacheKey
        ):
            check_blocks_key_range(f"transfer_configs[{i}].cache_key", config.cache_key)
    if src_blocks and not dst_blocks:
        raise _invalid("a PA source needs dst_block_indices (PA to non-PA is not supported)")
    if src_blocks and len(src_blocks) != len(dst_blocks):
        raise _invalid(
            f"src_block_indices has {len(src_blocks)} entries but dst_block_indices has "
            f"{len(dst_blocks)}"
        )
    with planner.caches.registry.lock:
        entry = planner.caches.entry(src_cache, "src_cache")
        if src_blocks:
            if not entry.is_blocks:
                raise _invalid("src_block_indices needs a blocks (PA) source cache")
            for b in src_blocks:
                if b >= entry.num_rows:
                    raise _invalid(f"src block index {b} is outside [0, {entry.num_rows})")
        dst_bytes = dst_block_memory_size or 0
        if dst_blocks and not dst_bytes:
            if not entry.is_blocks:
                raise _invalid(
                    "dst_block_memory_size is needed when a batch source goes to dst blocks"
                )
            dst_bytes = entry.row_bytes
        if not dst_blocks and dst_bytes:
            raise _invalid("dst_block_memory_size must be None or 0 for a non-PA destination")
        num = len(entry.addrs)
        if num % per_layer:
            if per_layer == 2:
                raise _invalid(f"transfer_cache_async needs an even num_tensors, got {num}")
            raise _invalid(
                f"num_tensors {num} is not a multiple of tensor_num_per_layer {per_layer}"
            )
        layers = num // per_layer
        configs: list[_Config] = []
        for i, config in enumerate(transfer_configs):
            src = config.src_layer_range
            src = range(0, layers) if src is None else src
            if not 0 <= src.start < src.stop <= layers:
                raise _invalid(f"transfer_configs[{i}] layer range {src} is outside [0, {layers})")
            if isinstance(config, TransferConfig):
                if len(config.dst_addrs) != per_layer * len(src):
                    raise _invalid(
                        f"transfer_configs[{i}] has {len(config.dst_addrs)} dst_addrs for "
                        f"{len(src)} layers ({per_layer} per layer)"
                    )
                dst_start = src.start
            else:
                dst_start = config.dst_layer_range.start
            if entry.is_blocks and config.src_batch_index != 0:
                raise _invalid(f"transfer_configs[{i}].src_batch_index must be 0 for a PA source")
            if not entry.is_blocks and config.src_batch_index >= entry.num_rows:
                raise _invalid(
                    f"transfer_configs[{i}].src_batch_index {config.src_batch_index} >= batch "
                    f"size {entry.num_rows}"
                )
            configs.append(_Config(config, src, dst_start))
        plan = planner.plan([], [entry])
    return LayerJob(
        planner,
        entry,
        layer_synchronizer,
        configs,
        layers,
        list(src_blocks),
        list(dst_blocks),
        dst_bytes,
        plan,
        per_layer,
    )
