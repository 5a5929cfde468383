"""The route providers of an engine, for tests that look at a link's same-host or UCX part."""

from __future__ import annotations

from typing import cast

from aio_datadist._engine.engine import Engine
from aio_datadist._routes.samehost.memory import PeerMemory
from aio_datadist._routes.samehost.provider import SameHostProvider
from aio_datadist._routes.ucx.links import UcxLinks


def peer_memory(engine: Engine, cluster_id: int) -> PeerMemory | None:
    """The one-sided access of ``engine``'s link to ``cluster_id`` (None: none)."""
    link = engine.link_table().get(cluster_id)
    provider = engine.provider("samehost")
    if link is None or provider is None:
        return None
    return cast(SameHostProvider, provider).peer_memory(link.channel)


def ucx_links(engine: Engine) -> UcxLinks | None:
    """``engine``'s UCX route (None without ``aio.Ucx``)."""
    return cast("UcxLinks | None", engine.provider("ucx"))
