"""Links: the table of peers an engine is linked to, and the documented link/unlink rules.

``link_clusters``/``unlink_clusters`` report per-cluster status codes instead of raising for
link failures; argument errors still raise (``TypeError``/``ValueError``/``LLMException``).
A link is usable in both directions whoever made it; the side with a listen address is the
server. Graceful unlink (``force=False``) removes both ends; forced unlink only this end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import structlog

from aio_datadist._engine.onesided import PeerMemory, open_peer_memory
from aio_datadist._memory.staging import Staging
from aio_datadist._transport.base import (
    Channel,
    Hello,
    LinkRefused,
    Listener,
    RequestHandler,
    Transport,
)
from aio_datadist._validate import check_int, check_type, param_invalid
from aio_datadist.cluster import LLMClusterInfo, ip_int_to_str
from aio_datadist.status import LLMStatusCode

__all__ = ("MAX_CLUSTERS_PER_CALL", "Link", "LinkTable", "check_clusters", "overall_status")

#: Most clusters one link_clusters/unlink_clusters call may name.
MAX_CLUSTERS_PER_CALL = 16
#: Pause before another attempt at an address that refused (``link_retry_count`` > 1).
_RETRY_PAUSE_S = 0.05


@dataclass(eq=False)
class Link:
    """One live link to a remote cluster."""

    remote: Hello
    channel: Channel
    initiator: bool  # True when this side called link_clusters
    #: One-sided access to the peer's caches when it runs on this host.
    peer_memory: PeerMemory | None = None


def _close_peer_memory(link: Link) -> None:
    if link.peer_memory is not None:
        link.peer_memory.close()


def check_clusters(clusters: Any, timeout: Any, *, need_local_ip: bool) -> None:
    """Validate the arguments shared by link_clusters and unlink_clusters.

    :raises TypeError: ``clusters`` is not a list/tuple of ``LLMClusterInfo``.
    :raises ValueError: ``timeout`` outside int32.
    :raises LLMException: ``LLM_PARAM_INVALID`` for ``timeout <= 0``, a cluster without
        ``remote_cluster_id``, or (``need_local_ip``) without a local ip.
    """
    check_type("clusters", clusters, list, tuple)
    for i, info in enumerate(clusters):
        check_type(f"clusters[{i}]", info, LLMClusterInfo)
    check_int("timeout", timeout, "int32")
    if timeout <= 0:
        param_invalid(f"timeout must be > 0 ms, but got {timeout}")
    for i, info in enumerate(clusters):
        if info.remote_cluster_id is None:
            param_invalid(f"clusters[{i}].remote_cluster_id is not set")
        if need_local_ip and not info.local_ip_info_list:
            param_invalid(
                f"clusters[{i}] has no local ip: call append_local_ip_info "
                "(needed when local_comm_res is not set)"
            )


def overall_status(statuses: Sequence[LLMStatusCode]) -> LLMStatusCode:
    """``LLM_SUCCESS`` if every cluster succeeded, else the last failure in input order."""
    failures = [s for s in statuses if s != LLMStatusCode.LLM_SUCCESS]
    return failures[-1] if failures else LLMStatusCode.LLM_SUCCESS


def _refuse_batch(
    clusters: Sequence[LLMClusterInfo],
) -> tuple[LLMStatusCode, list[LLMStatusCode]] | None:
    """The result for a call naming no cluster or too many; None when the size is fine."""
    if not clusters:
        return LLMStatusCode.LLM_PARAM_INVALID, []
    if len(clusters) > MAX_CLUSTERS_PER_CALL:
        code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
        return code, [code] * len(clusters)
    return None


class LinkTable:
    """The links of one engine, its listener, and the link/unlink procedures."""

    def __init__(
        self,
        local: Hello,
        transport: Transport,
        handler: RequestHandler,
        log: structlog.stdlib.BoundLogger,
        *,
        staging: Staging | None = None,
    ) -> None:
        self.local = local
        #: How same-host routes reach device memory; None: this engine publishes no board.
        self.staging = staging
        self.transport = transport
        self._handler = handler
        self._links: dict[int, Link] = {}
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self._log = log
        #: Attempts per address within a link_clusters timeout (``link_retry_count``).
        self.retry_count = 1

    # -- listening ------------------------------------------------------------------------
    def listen(self, host: str, port: int) -> None:
        """Become a server on ``host:port`` (replacing any earlier listener)."""
        self.stop_listening()
        self._listener = self.transport.listen(host, port, self)
        self._log.info("link.listening", transport=self.transport.name, address=f"{host}:{port}")

    def stop_listening(self) -> None:
        """Stop accepting links; existing links stay."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """Where this engine listens, or None for a pure client."""
        return None if self._listener is None else self._listener.address

    # -- lookup ---------------------------------------------------------------------------
    def get(self, cluster_id: int) -> Link | None:
        """The live link to ``cluster_id``."""
        with self._lock:
            link = self._links.get(cluster_id)
        return None if link is None or link.channel.closed else link

    def __len__(self) -> int:
        with self._lock:
            return len(self._links)

    # -- serving side ---------------------------------------------------------------------
    @property
    def handler(self) -> RequestHandler:
        """Serves the requests that arrive on this engine's channels."""
        return self._handler

    def accept(self, peer: Hello, channel: Channel) -> Hello:
        """Register a link a peer made to us (called by the transport during its handshake)."""
        if peer.cluster_id == self.local.cluster_id:
            raise LinkRefused(
                LLMStatusCode.LLM_LINK_FAILED, f"peer has our own cluster id {peer.cluster_id}"
            )
        if peer.to_cluster_id not in (None, self.local.cluster_id):
            raise LinkRefused(
                LLMStatusCode.LLM_LINK_FAILED,
                f"this is cluster {self.local.cluster_id}, not {peer.to_cluster_id}",
            )
        peer = replace(peer, to_cluster_id=None)
        with self._lock:
            existing = self._links.get(peer.cluster_id)
            if existing is not None and not existing.channel.closed:
                raise LinkRefused(
                    LLMStatusCode.LLM_ALREADY_LINK, f"cluster {peer.cluster_id} is already linked"
                )
            link = Link(peer, channel, initiator=False)
            self._links[peer.cluster_id] = link
        self._attach_peer_memory(link)
        channel.on_close(self._forget)
        self._log.info(
            "link.accepted",
            remote_cluster_id=peer.cluster_id,
            authenticated=channel.authenticated,
        )
        self._note_unauthenticated(link)
        return self.local

    def _note_unauthenticated(self, link: Link) -> None:
        if not link.channel.authenticated:
            self._log.info(
                "link.unauthenticated",
                remote_cluster_id=link.remote.cluster_id,
                note="no link secret: the peer did not prove who it is",
            )

    def _attach_peer_memory(self, link: Link) -> None:
        """Open the one-sided route to a same-host peer (both ends must offer presence)."""
        if self.local.presence is not None and self.staging is not None:
            link.peer_memory = open_peer_memory(
                link.remote.presence,
                self.staging,
                self._log.bind(remote_cluster_id=link.remote.cluster_id),
            )

    def _forget(self, channel: Channel) -> None:
        with self._lock:
            for cluster_id, link in list(self._links.items()):
                if link.channel is channel:
                    del self._links[cluster_id]
                    _close_peer_memory(link)
                    self._log.info("link.closed", remote_cluster_id=cluster_id)

    # -- client side ----------------------------------------------------------------------
    def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout_ms: int
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to every cluster in parallel; arguments were checked by :func:`check_clusters`."""
        refused = _refuse_batch(clusters)
        if refused is not None:
            return refused
        if len(clusters) == 1:
            results = [self._link_one(clusters[0], timeout_ms / 1000)]
        else:
            with ThreadPoolExecutor(min(len(clusters), MAX_CLUSTERS_PER_CALL)) as pool:
                results = list(pool.map(lambda c: self._link_one(c, timeout_ms / 1000), clusters))
        return overall_status(results), results

    def _link_one(self, info: LLMClusterInfo, timeout: float) -> LLMStatusCode:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        if self.get(remote_id) is not None:
            return LLMStatusCode.LLM_ALREADY_LINK
        if not info.remote_ip_info_list:
            self._log.warning("link.failed", remote_cluster_id=remote_id, reason="no remote ip")
            return LLMStatusCode.LLM_PARAM_INVALID
        status = LLMStatusCode.LLM_LINK_FAILED
        deadline = time.monotonic() + timeout
        attempts = [
            (attempt, ip, port)
            for attempt in range(self.retry_count)
            for ip, port in info.remote_ip_info_list
        ]
        for attempt, ip, port in attempts:
            host = ip_int_to_str(ip)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return status
            if attempt and status is LLMStatusCode.LLM_LINK_FAILED:
                time.sleep(min(_RETRY_PAUSE_S, remaining))  # the server may be starting
            try:
                hello = replace(self.local, to_cluster_id=remote_id)
                channel = self.transport.connect(host, port, hello, self._handler, remaining)
            except LinkRefused as exc:
                status = exc.status
                self._log.warning(
                    "link.failed",
                    remote_cluster_id=remote_id,
                    address=f"{host}:{port}",
                    status=str(exc.status),
                    reason=str(exc),
                )
                continue
            if channel.peer.cluster_id != remote_id:
                channel.close(notify_peer=True, timeout=timeout)
                self._log.warning(
                    "link.failed",
                    remote_cluster_id=remote_id,
                    address=f"{host}:{port}",
                    reason=f"the peer there is cluster {channel.peer.cluster_id}",
                )
                status = LLMStatusCode.LLM_LINK_FAILED
                continue
            link = Link(channel.peer, channel, initiator=True)
            with self._lock:
                self._links[remote_id] = link
            self._attach_peer_memory(link)
            channel.on_close(self._forget)
            self._log.info(
                "link.established",
                remote_cluster_id=remote_id,
                address=f"{host}:{port}",
                authenticated=channel.authenticated,
            )
            self._note_unauthenticated(link)
            return LLMStatusCode.LLM_SUCCESS
        return status

    def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout_ms: int, force: bool
    ) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Unlink every cluster; arguments were checked by :func:`check_clusters`."""
        refused = _refuse_batch(clusters)
        if refused is not None:
            return refused
        results = [self._unlink_one(info, timeout_ms / 1000, force) for info in clusters]
        return overall_status(results), results

    def _unlink_one(self, info: LLMClusterInfo, timeout: float, force: bool) -> LLMStatusCode:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        if not force and len(info.remote_ip_info_list) != 1:
            return LLMStatusCode.LLM_PARAM_INVALID
        with self._lock:
            link = self._links.pop(remote_id, None)
        if link is None or link.channel.closed:
            return LLMStatusCode.LLM_SUCCESS if force else LLMStatusCode.LLM_NOT_YET_LINK
        _close_peer_memory(link)
        told = link.channel.close(notify_peer=not force, timeout=timeout)
        self._log.info("link.unlinked", remote_cluster_id=remote_id, force=force, peer_told=told)
        if not force and not told:
            return LLMStatusCode.LLM_NOTIFY_PROMPT_UNLINK_FAILED
        return LLMStatusCode.LLM_SUCCESS

    def drop(self, cluster_id: int, timeout: float) -> bool:
        """Remove the link to ``cluster_id`` at both ends; False when there was none."""
        with self._lock:
            link = self._links.pop(cluster_id, None)
        if link is None:
            return False
        _close_peer_memory(link)
        told = link.channel.close(notify_peer=True, timeout=timeout)
        self._log.info("link.unlinked", remote_cluster_id=cluster_id, peer_told=told)
        return True

    def close(self, timeout: float = 1.0) -> None:
        """Stop listening and drop every link, telling peers (finalize)."""
        self.stop_listening()
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            _close_peer_memory(link)
            link.channel.close(notify_peer=True, timeout=timeout)
