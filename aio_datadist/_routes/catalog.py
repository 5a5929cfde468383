"""The listed route providers: each way of moving bytes beside the link's own route that the
engine opens at ``init``, known to it only through
:class:`~aio_datadist._routes.provider.RouteProvider`.

A new way of moving bytes is a new package under ``_routes`` with a :class:`ProviderSpec`,
listed in :data:`PROVIDERS`.
"""

from __future__ import annotations

from aio_datadist._engine.access import Target
from aio_datadist._routes.provider import ProviderSpec
from aio_datadist._routes.samehost.provider import open_same_host
from aio_datadist._routes.ucx.links import open_ucx

__all__ = ("PROVIDERS",)

#: Every provider, in the order the engine opens them (and closes them in reverse).
PROVIDERS: tuple[ProviderSpec, ...] = (
    ProviderSpec("samehost", open_same_host),
    ProviderSpec(
        "ucx",
        open_ucx,
        targets=frozenset({Target.UCX_TABLE, Target.UCX_ACK}),
        enabled_by="aio.Ucx",
    ),
)
