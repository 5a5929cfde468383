"""Layer-wise ``transfer_cache_async``: per-layer requests and task results of a call the
planner checked (``Planner.layer_job``).

A :class:`LayerJob` holds the checked configs, the request of each (config, layer) and the
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
from aio_datadist._engine.planner import LayerPlan, Planner, local_blocks, local_rows
from aio_datadist._engine.request import Completion, Transfer
from aio_datadist._log import get_logger
from aio_datadist._native import api
from aio_datadist._transport.base import RequestKind
from aio_datadist.status import (
    LLMException,
    LLMFailedError,
    LLMStatusCode,
    LLMTimeoutError,
    ParamInvalidError,
)
from aio_datadist.synchronizer import is_async_synchronizer
from aio_datadist.task import CacheTask
from aio_datadist.types import (
    BlocksCacheKey,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

__all__ = ("LayerJob",)

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

    def __init__(self, planner: Planner, planned: LayerPlan) -> None:
        self.planner = planner
        self.entry = planned.entry
        self.synchronizer = planned.synchronizer
        self.is_async = is_async_synchronizer(planned.synchronizer)
        self.configs = [_Config(c.config, c.src, c.dst_start) for c in planned.configs]
        self.num_layers = planned.num_layers
        self.src_blocks = planned.src_blocks
        self.dst_blocks = planned.dst_blocks
        self.dst_block_bytes = planned.dst_block_bytes
        self.plan = planned.plan
        #: Tensors per layer (``tensor_num_per_layer``): layer k is tensors [k*n, (k+1)*n).
        self.per_layer = planned.per_layer
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
