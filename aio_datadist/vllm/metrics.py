"""The connector's statistics in vLLM: the periodic log line and ``/metrics``.

Each worker step reports what its node did since the last (``AioKVConnectorStats.data``:
counters, each load's and push's seconds, and bytes per route of the engine); vLLM adds the
workers' reports up, logs a summary and hands them to :class:`AioPromMetrics`, which exports:

* ``vllm:aio_datadist_loads_total``, ``..._load_failures_total``, ``..._load_bytes_total``
  and the histogram ``..._load_seconds`` (decode: one request's load, start to end; every
  failure is also logged with its request);
* ``vllm:aio_datadist_pushes_total``, ``..._push_failures_total``, ``..._push_bytes_total``
  and the histogram ``..._push_seconds`` (prefill in push mode: first step to last layer);
* ``vllm:aio_datadist_expired_total`` and ``..._released_total`` (prefill: held requests
  freed at the abort timeout, or released by their decode);
* ``vllm:aio_datadist_route_bytes_total``, ``..._route_transfers_total`` and
  ``..._route_failures_total``, labelled ``route`` and ``op``: what the engine moved.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from aio_datadist._connector.outcomes import COUNTERS

__all__ = ("AioKVConnectorStats", "AioPromMetrics")

_LISTS = ("load_seconds", "push_seconds")
_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(COUNTERS, 0)
    for key in _LISTS:
        data[key] = []
    data["routes"] = {}
    return data


@dataclass
class AioKVConnectorStats(KVConnectorStats):
    """What the workers' nodes did in one interval (serializable: ints, lists, dicts)."""

    data: dict[str, Any]

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:
            merged = _empty()
            merged.update(self.data)
            self.data = merged

    def reset(self) -> None:
        """Empty the interval."""
        self.data = _empty()

    def clone_and_reset(self) -> AioKVConnectorStats:
        """A copy of the interval so far, and an empty one here."""
        old = copy.copy(self)
        self.reset()
        return old

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Add ``other``'s interval to this one."""
        for key, value in other.data.items():
            if key in _LISTS:
                self.data[key].extend(value)
            elif key == "routes":
                routes = self.data["routes"]
                for route, counts in value.items():
                    before = routes.get(route, [0, 0, 0])
                    routes[route] = [a + b for a, b in zip(before, counts, strict=True)]
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def is_empty(self) -> bool:
        """Nothing happened in the interval."""
        return not any(self.data[k] for k in COUNTERS) and not self.data["routes"]

    def reduce(self) -> dict[str, int | float]:
        """A summary for vLLM's periodic log line."""
        data = self.data
        out: dict[str, int | float] = {
            "loads": data["loads"],
            "load failures": data["load_failures"],
            "MiB loaded": round(data["load_bytes"] / 2**20, 2),
            "pushes": data["pushes"],
            "push failures": data["push_failures"],
            "MiB pushed": round(data["push_bytes"] / 2**20, 2),
            "expired": data["expired"],
        }
        seconds = sorted(data["load_seconds"])
        if seconds:
            out["load ms avg"] = round(1000 * sum(seconds) / len(seconds), 3)
            out["load ms p90"] = round(1000 * seconds[int(0.9 * (len(seconds) - 1))], 3)
            total = sum(seconds)
            if total > 0:
                out["load MB/s"] = round(data["load_bytes"] / total / 1e6, 1)
        return out


class AioPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics (see the module's table)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for key, doc in COUNTERS.items():
            metric = self._counter_cls(
                name=f"vllm:aio_datadist_{key}", documentation=doc, labelnames=labelnames
            )
            self._counters[key] = create_metric_per_engine(metric, per_engine_labelvalues)
        self._histograms = {}
        for key, doc in (
            ("load_seconds", "seconds one request's KV took to load (decode)"),
            ("push_seconds", "seconds from a push's first step to its last layer landing"),
        ):
            metric = self._histogram_cls(
                name=f"vllm:aio_datadist_{key}",
                documentation=doc,
                buckets=list(_BUCKETS_S),
                labelnames=labelnames,
            )
            self._histograms[key] = create_metric_per_engine(metric, per_engine_labelvalues)
        route_labels = [*labelnames, "route", "op"]
        self._routes = [
            self._counter_cls(
                name=f"vllm:aio_datadist_route_{what}", documentation=doc, labelnames=route_labels
            )
            for what, doc in (
                ("bytes", "payload bytes the engine moved, by route and op"),
                ("transfers", "transfers the engine ended, by route and op"),
                ("failures", "transfers the engine ended with a failure, by route and op"),
            )
        ]
        self._labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one interval of one engine."""
        data = transfer_stats_data
        for key, counters in self._counters.items():
            value = data.get(key, 0)
            if value:
                counters[engine_idx].inc(value)
        for key, histograms in self._histograms.items():
            for seconds in data.get(key, ()):
                histograms[engine_idx].observe(seconds)
        labels = self._labelvalues.get(engine_idx, [])
        for name, (count, failed, nbytes) in data.get("routes", {}).items():
            route, _, op = name.partition("/")
            for metric, value in zip(self._routes, (nbytes, count, failed), strict=True):
                if value:
                    metric.labels(*labels, route, op).inc(value)
