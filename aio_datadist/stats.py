"""What an engine moved and holds: the snapshot ``LLMDataDist.stats()`` and
``AsyncLLMDataDist.stats()`` return.

Transfers are counted per route and op (:class:`RouteSnapshot`) and per peer cluster
(:class:`PeerSnapshot`) as they end (``LLMConfig.metrics``, on by default); links report
what they hold (:class:`~aio_datadist._transport.base.ChannelStats`), pools their usage
(:class:`~aio_datadist._native.api.PoolStats`). ``aio_datadist.metrics`` exports the same
to Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass

from aio_datadist._native.api import PoolStats
from aio_datadist._transport.base import ChannelStats
from aio_datadist.status import LLMStatusCode

__all__ = (
    "BUCKETS_S",
    "RECENT",
    "ChannelStats",
    "DataDistStats",
    "PeerSnapshot",
    "PoolStats",
    "RouteSnapshot",
)

#: Upper bounds (seconds) of the latency histogram's buckets; the last bucket is unbounded.
BUCKETS_S = (
    10e-6,
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    500e-3,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: Durations kept per (route, op) for the recent percentiles.
RECENT = 4096


@dataclass(frozen=True)
class RouteSnapshot:
    """The transfers of one (route, op) so far."""

    route: str
    """The route's name (``same-host``, ``link``, ...)."""
    op: str
    """``pull`` or ``push``."""
    by_status: dict[str, int]
    """Transfers ended, by status code name (``LLM_SUCCESS`` for the successful ones)."""
    bytes: int
    """Payload bytes of the successful transfers."""
    seconds: float
    """Total duration of every transfer ended, in seconds."""
    buckets: tuple[int, ...]
    """Transfers per latency bucket (bounds :data:`BUCKETS_S`, then one unbounded)."""
    p50_us: float
    """Median duration of the last :data:`RECENT` transfers, in microseconds."""
    p90_us: float
    """90th percentile, as ``p50_us``."""
    p99_us: float
    """99th percentile, as ``p50_us``."""
    max_us: float
    """Longest of the last :data:`RECENT` transfers, in microseconds."""

    @property
    def count(self) -> int:
        """Transfers ended."""
        return sum(self.by_status.values())

    @property
    def failed(self) -> int:
        """Transfers that failed."""
        return self.count - self.by_status.get(LLMStatusCode.LLM_SUCCESS.name, 0)


@dataclass(frozen=True)
class PeerSnapshot:
    """The transfers with one peer cluster so far."""

    cluster_id: int
    transfers: int
    failed: int
    bytes: int
    """Payload bytes of the successful transfers."""


@dataclass(frozen=True)
class DataDistStats:
    """A snapshot of one engine: its transfers, links and pools."""

    cluster_id: int
    """The engine's cluster id."""
    metrics: bool
    """Whether transfers are recorded (``LLMConfig.metrics``)."""
    routes: tuple[RouteSnapshot, ...]
    """Transfers by (route, op), sorted."""
    peers: tuple[PeerSnapshot, ...]
    """Transfers by peer cluster, sorted."""
    links: dict[int, ChannelStats]
    """What each live link holds, by remote cluster id."""
    link_routes: dict[int, tuple[str, ...]]
    """The routes each live link offers, in the order a transfer tries them."""
    pools: dict[str, PoolStats]
    """Memory pools by placement name (``DEVICE``, ``HOST``)."""

    @property
    def transfers(self) -> int:
        """Transfers ended."""
        return sum(r.count for r in self.routes)

    @property
    def failed(self) -> int:
        """Transfers that failed."""
        return sum(r.failed for r in self.routes)

    @property
    def bytes(self) -> int:
        """Payload bytes of the successful transfers."""
        return sum(r.bytes for r in self.routes)

    def bytes_by_route(self) -> dict[str, int]:
        """Payload bytes of the successful transfers, by route name."""
        out: dict[str, int] = {}
        for r in self.routes:
            out[r.route] = out.get(r.route, 0) + r.bytes
        return out
