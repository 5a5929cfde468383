"""What the engine knows of a mover: one :class:`RouteProvider` interface.

A provider is one way of moving bytes beside the link's own route (same host, UCX, ...).
The engine opens each listed provider (``aio_datadist._routes.catalog.PROVIDERS``) at ``init``
from its settings; a provider the settings leave off opens as ``None``. From then on the
engine and its link table speak to providers only through this interface:

* :meth:`RouteProvider.offer` adds what the provider needs the peer to know to this
  side's handshake;
* :meth:`RouteProvider.attach` is told of every new link, and puts its routes into the
  link (:meth:`LinkHandle.place` with :func:`~aio_datadist._engine.routes.placed`) now,
  or once its own setup with the peer is done;
* :meth:`RouteProvider.established` is told when a link this side made is registered (it
  may wait, within the link's deadline, for the peer's part);
* :meth:`RouteProvider.serve` answers the requests of its own control plane that arrive
  over the link (:attr:`ProviderSpec.targets`);
* :meth:`RouteProvider.detach` and :meth:`RouteProvider.close` end it for one link and for
  the engine.

Routes sit in a link's list by :attr:`~aio_datadist._engine.routes.Route.rank`, so a
provider places its routes without knowing the others'.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from aio_datadist._engine.access import Access, Target
from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.routes import Route
from aio_datadist._engine.settings import EngineSettings
from aio_datadist._transport.base import Channel, Hello, RequestKind, Served
from aio_datadist.status import FeatureNotEnabledError, LLMStatusCode

__all__ = ("LinkHandle", "Opening", "ProviderSpec", "RouteProvider")


class LinkHandle(Protocol):
    """A link as its providers see it."""

    @property
    def channel(self) -> Channel:
        """The link's channel (its peer's handshake is ``channel.peer``)."""

    @property
    def initiator(self) -> bool:
        """True for a link this side made."""

    @property
    def log(self) -> structlog.stdlib.BoundLogger:
        """The link's logger (bound to the remote cluster)."""

    def place(self, change: Callable[[list[Route]], list[Route]]) -> bool:
        """Replace the link's routes by ``change(routes)`` (``routes.placed``); False, and
        nothing changed, when the link went meanwhile."""

    def fail(self, reason: str) -> None:
        """Break the link for ``reason`` (its peer failed this provider's protocol):
        transfers to its cluster fail with ``LLM_LINK_FAILED`` saying so until it is
        unlinked or linked again, and the peer sees its end closed."""


@dataclass(frozen=True)
class Opening:
    """What a provider is opened from: the engine's settings, caches and names."""

    settings: EngineSettings
    caches: CacheService
    cluster_id: int
    #: The role's name, for the provider's logger.
    role: str


class RouteProvider(ABC):
    """One mover of one engine (see the module docstring)."""

    def offer(self, hello: Hello) -> Hello:
        """This side's handshake with what the peer must know of this provider."""
        return hello

    @abstractmethod
    def attach(self, link: LinkHandle) -> None:
        """A link was made (both handshakes known): take part in it, placing routes on it
        now or later. Called before the link is registered; never raises for the peer's
        sake (a peer that does not offer the provider gets no route)."""

    def established(self, link: LinkHandle, timeout: float) -> None:
        """The link this side made is registered: the provider may start its part with the
        peer and wait up to ``timeout`` seconds for it (nothing, by default)."""
        return None

    @abstractmethod
    def detach(self, channel: Channel) -> None:
        """The link over ``channel`` closed or is being closed: release its part of it."""

    def serve(self, hello: Hello, kind: RequestKind, access: Access, nbytes: int) -> Served:
        """Serve a request of this provider's control plane from ``hello``'s link.

        :raises LLMException: as the provider documents.
        """
        raise FeatureNotEnabledError(
            f"cluster {hello.cluster_id} sent a {access.target.name}, which this engine "
            "does not serve",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )

    @abstractmethod
    def close(self) -> None:
        """End the provider: the engine's links are closed already, its caches not yet."""


@dataclass(frozen=True)
class ProviderSpec:
    """One provider as the engine lists it."""

    #: Its name in logs.
    name: str
    #: Opens it for an engine, or None where the settings leave it off.
    open: Callable[[Opening], RouteProvider | None]
    #: The request targets of its control plane, served over the link.
    targets: frozenset[Target] = frozenset()
    #: How to turn it on, for the error a peer's control request meets where it is off.
    enabled_by: str = ""
