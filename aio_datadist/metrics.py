"""Prometheus export of engines' ``stats()`` (optional: ``pip install aio_datadist[metrics]``).

::

    from prometheus_client import start_http_server
    from aio_datadist.metrics import PrometheusCollector

    PrometheusCollector(datadist).register()  # the default registry
    start_http_server(9100)

The collector reads each engine's :meth:`~aio_datadist.LLMDataDist.stats` when scraped, so
transfers pay nothing for it. Every series carries the label ``cluster_id`` (the engine's).

=========================================  =========  ======================================
metric                                     type       more labels
=========================================  =========  ======================================
``aio_datadist_transfers_total``           counter    ``route``, ``op``, ``status``
``aio_datadist_transfer_bytes_total``      counter    ``route``, ``op`` (successful ones)
``aio_datadist_transfer_duration_seconds`` histogram  ``route``, ``op``
``aio_datadist_peer_transfers_total``      counter    ``peer``
``aio_datadist_peer_failures_total``       counter    ``peer``
``aio_datadist_peer_bytes_total``          counter    ``peer``
``aio_datadist_link_queued_bytes``         gauge      ``peer``
``aio_datadist_link_requests``             gauge      ``peer`` (the peer's, in flight)
``aio_datadist_link_paused_seconds_total`` counter    ``peer``
``aio_datadist_pool_capacity_bytes``       gauge      ``placement``
``aio_datadist_pool_used_bytes``           gauge      ``placement``
=========================================  =========  ======================================

``route`` is the pipeline route's name (``same-host``, ``device-ipc``, ``communicator``,
``link``, ``staged-link``, ...), ``op`` is ``pull`` or ``push``, ``status`` the status code's
name (``LLM_SUCCESS``, ``LLM_TIMEOUT``, ...), ``peer`` the remote cluster id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from aio_datadist.aio import AsyncLLMDataDist
from aio_datadist.stats import BUCKETS_S, DataDistStats
from aio_datadist.sync import LLMDataDist

try:
    from prometheus_client.core import (
        REGISTRY,
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "aio_datadist.metrics needs prometheus_client: pip install 'aio_datadist[metrics]'"
    ) from exc

__all__ = ("PrometheusCollector",)

_PREFIX = "aio_datadist"


class PrometheusCollector(Collector):
    """Exports the ``stats()`` of the given engines (either face) at each scrape."""

    def __init__(self, *datadists: LLMDataDist | AsyncLLMDataDist) -> None:
        """:raises TypeError: an argument is not an engine of either face."""
        for dd in datadists:
            if not isinstance(dd, LLMDataDist | AsyncLLMDataDist):
                raise TypeError(
                    f"expected LLMDataDist or AsyncLLMDataDist objects, got {type(dd).__name__}"
                )
        self._datadists = datadists

    def register(self, registry: CollectorRegistry = REGISTRY) -> PrometheusCollector:
        """Register with ``registry`` (the default one by default); returns self."""
        registry.register(self)
        return self

    def _snapshots(self) -> list[DataDistStats]:
        out = []
        for dd in self._datadists:
            try:
                out.append(dd.stats())
            except RuntimeError:  # not initialised (yet, or any more): nothing to export
                continue
        return out

    def collect(self) -> Iterator[Any]:
        """The metric families of every initialised engine (called by the registry)."""
        families = _Families()
        for s in self._snapshots():
            families.add(s)
        yield from families.all()


class _Families:
    """The metric families of one scrape, filled engine by engine."""

    def __init__(self) -> None:
        p = _PREFIX
        route = ["cluster_id", "route", "op"]
        peer = ["cluster_id", "peer"]
        pool = ["cluster_id", "placement"]
        self.transfers = CounterMetricFamily(
            f"{p}_transfers", "Transfers ended, by route, op and status.", labels=[*route, "status"]
        )
        self.bytes = CounterMetricFamily(
            f"{p}_transfer_bytes", "Payload bytes of successful transfers.", labels=route
        )
        self.duration = HistogramMetricFamily(
            f"{p}_transfer_duration_seconds", "Duration of transfers.", labels=route
        )
        self.peer_transfers = CounterMetricFamily(
            f"{p}_peer_transfers", "Transfers ended with a peer cluster.", labels=peer
        )
        self.peer_failures = CounterMetricFamily(
            f"{p}_peer_failures", "Transfers with a peer cluster that failed.", labels=peer
        )
        self.peer_bytes = CounterMetricFamily(
            f"{p}_peer_bytes", "Payload bytes moved with a peer cluster.", labels=peer
        )
        self.queued = GaugeMetricFamily(
            f"{p}_link_queued_bytes", "Bytes a link holds for its peer's answers.", labels=peer
        )
        self.requests = GaugeMetricFamily(
            f"{p}_link_requests", "The peer's requests a link holds.", labels=peer
        )
        self.paused = CounterMetricFamily(
            f"{p}_link_paused_seconds", "Seconds a link paused reading the peer.", labels=peer
        )
        self.capacity = GaugeMetricFamily(
            f"{p}_pool_capacity_bytes", "Bytes a memory pool manages.", labels=pool
        )
        self.used = GaugeMetricFamily(
            f"{p}_pool_used_bytes", "Bytes of a memory pool in use.", labels=pool
        )

    def add(self, s: DataDistStats) -> None:
        me = str(s.cluster_id)
        for r in s.routes:
            labels = [me, r.route, r.op]
            for status, n in sorted(r.by_status.items()):
                self.transfers.add_metric([*labels, status], n)
            self.bytes.add_metric(labels, r.bytes)
            cumulative, running = [], 0
            for bound, n in zip((*map(str, BUCKETS_S), "+Inf"), r.buckets, strict=True):
                running += n
                cumulative.append((bound, running))
            self.duration.add_metric(labels, cumulative, r.seconds)
        for peer in s.peers:
            labels = [me, str(peer.cluster_id)]
            self.peer_transfers.add_metric(labels, peer.transfers)
            self.peer_failures.add_metric(labels, peer.failed)
            self.peer_bytes.add_metric(labels, peer.bytes)
        for cluster, link in sorted(s.links.items()):
            labels = [me, str(cluster)]
            self.queued.add_metric(labels, link.queued_bytes)
            self.requests.add_metric(labels, link.requests)
            self.paused.add_metric(labels, link.paused_s)
        for placement, pool in sorted(s.pools.items()):
            self.capacity.add_metric([me, placement], pool.capacity)
            self.used.add_metric([me, placement], pool.used)

    def all(self) -> Iterator[Any]:
        yield from (
            self.transfers,
            self.bytes,
            self.duration,
            self.peer_transfers,
            self.peer_failures,
            self.peer_bytes,
            self.queued,
            self.requests,
            self.paused,
            self.capacity,
            self.used,
        )
