"""Links: the table of peers an engine is linked to, and the documented link/unlink rules.

``link_clusters``/``unlink_clusters`` report per-cluster status codes (with their reasons,
:class:`~aio_datadist.cluster.LinkResults`) instead of raising for link failures; argument
errors still raise (``TypeError``/``ValueError``/``LLMException``).

The table holds, per remote cluster, the link this side made and the link the peer made
(each live or broken). Two rules decide what may coexist:

* **one link per pair** (the default backend): a link is usable in both directions whoever
  made it, so a cluster linked either way answers ``LLM_ALREADY_LINK`` to a second
  ``link_clusters``. Graceful unlink (``force=False``) removes both ends, forced unlink
  only this end.
* **directional** (``transfer_backend="hixl"``, the reference's HIXL engine): each side's
  ``link_clusters`` makes its own link, so two endpoints may link to each other at once;
  ``unlink_clusters`` drops only this side's link, by ``remote_cluster_id`` alone.

A link that closes without this side asking (the peer finalized, died, or dropped its end
with a forced unlink, or the connection broke) stays in the table as a :class:`BrokenLink`:
transfers to that cluster fail with ``LLM_LINK_FAILED`` saying who closed it and when,
until the caller unlinks or links again. It is not a link: it never blocks a new one, and
``switch_role`` ignores it. A peer's graceful unlink removes the link at both ends and
leaves nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

import structlog

from aio_datadist._engine.metrics import TransferMetrics
from aio_datadist._engine.routes import Route, link_routes
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
from aio_datadist.cluster import LinkResults, LLMClusterInfo, ip_int_to_str
from aio_datadist.status import (
    LinkFailedError,
    LLMException,
    LLMStatusCode,
    NotYetLinkError,
    lookup,
)

if TYPE_CHECKING:  # the providers import the engine's modules
    from aio_datadist._routes.provider import RouteProvider

__all__ = (
    "MAX_CLUSTERS_PER_CALL",
    "BrokenLink",
    "Link",
    "LinkTable",
    "check_clusters",
    "overall_status",
)

_S = LLMStatusCode

#: Most clusters one link_clusters/unlink_clusters call may name.
MAX_CLUSTERS_PER_CALL = 16
#: Pause before another attempt at an address that refused (``link_retry_count`` > 1).
_RETRY_PAUSE_S = 0.05
#: How long a new link from a peer waits for that peer's previous link to be seen closed.
#: A peer links again only once its own end of the old link is gone, so the old one here is
#: stale: its close is in flight (a forced unlink just closed the socket). Past this, the
#: old link is live and the new one is refused with ``LLM_ALREADY_LINK``.
STALE_LINK_GRACE_S = 1.0
#: Most broken links remembered; the oldest go first (trimmed once a quarter more broke, so
#: a churn of links costs no scan of them all at every close).
MAX_BROKEN_LINKS = 4096


@dataclass(eq=False)
class Link:
    """One live link to a remote cluster."""

    remote: Hello
    channel: Channel
    initiator: bool  # True when this side called link_clusters
    #: The ways transfers reach the peer, in rank order (``_engine.routes``): the link's
    #: own, and those its providers and a domain placed; replaced whole, never changed in
    #: place.
    routes: list[Route] = field(default_factory=list)
    #: Set (table lock held) once the link left the table: no route is placed on it then.
    gone: bool = False

    @property
    def live(self) -> bool:
        """True while the link's channel is open."""
        return not self.channel.closed

    def broken(self) -> BrokenLink:
        """What this link leaves behind once its channel closed."""
        reason = self.channel.close_reason or "the link closed"
        return BrokenLink(self.remote.cluster_id, self.initiator, self.channel.remote, reason)


@dataclass(frozen=True)
class BrokenLink:
    """What stays of a link that closed without this side asking: who closed it, and when."""

    cluster_id: int
    #: True for the link this side had made.
    initiator: bool
    #: The peer's address as the link knew it ("" when none).
    address: str
    #: Why it closed, as its transport saw it.
    reason: str
    #: When it was seen closed (``time.time()``).
    at: float = 0.0

    def __post_init__(self) -> None:
        if not self.at:
            object.__setattr__(self, "at", time.time())

    def error(self) -> LinkFailedError:
        """The ``LLM_LINK_FAILED`` error a transfer over this link meets."""
        when = datetime.fromtimestamp(self.at).astimezone().isoformat(timespec="milliseconds")
        where = f" ({self.address})" if self.address else ""
        return LinkFailedError(
            f"the link to cluster {self.cluster_id}{where} failed at {when}: {self.reason}; "
            "unlink it (unlink_clusters) or link again",
            status_code=_S.LLM_LINK_FAILED,
        )


_Entry = Link | BrokenLink


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
    failures = [s for s in statuses if s != _S.LLM_SUCCESS]
    return failures[-1] if failures else _S.LLM_SUCCESS


def _failure(status: LLMStatusCode, message: str) -> LLMException:
    return lookup(status)(message, status_code=status)


def _refuse_batch(clusters: Sequence[LLMClusterInfo]) -> tuple[LLMStatusCode, LinkResults] | None:
    """The result for a call naming no cluster or too many; None when the size is fine."""
    if not clusters:
        return _S.LLM_PARAM_INVALID, LinkResults()
    if len(clusters) > MAX_CLUSTERS_PER_CALL:
        error = _failure(
            _S.LLM_CLUSTER_NUM_EXCEED_LIMIT,
            f"{len(clusters)} clusters in one call; at most {MAX_CLUSTERS_PER_CALL}",
        )
        results = LinkResults([error] * len(clusters))
        return error.status_code, results
    return None


class LinkTable:
    """The links of one engine, its listener, and the link/unlink procedures.

    ``directional`` selects the HIXL rules (see the module docstring).
    """

    def __init__(
        self,
        local: Hello,
        transport: Transport,
        handler: RequestHandler,
        log: structlog.stdlib.BoundLogger,
        *,
        staging: Staging | None = None,
        directional: bool = False,
        providers: Sequence[RouteProvider] = (),
    ) -> None:
        self.local = local
        #: How the link's route reaches device memory (None: host rows only).
        self.staging = staging
        #: The route providers, told of every link (``aio_datadist._routes``).
        self.providers = tuple(providers)
        self.transport = transport
        self.directional = directional
        self._handler = handler
        # By (remote cluster id, made by this side).
        self._entries: dict[tuple[int, bool], _Entry] = {}
        self._broke_since_trim = 0  # links broken since the broken ones were last trimmed
        self._lock = threading.Lock()
        self._listener: Listener | None = None
        self._log = log
        #: Attempts per address within a link_clusters timeout (``link_retry_count``).
        self.retry_count = 1
        #: Where every transfer over these links is recorded (None: ``aio.Metrics`` off).
        self.metrics: TransferMetrics | None = None

    # -- listening ------------------------------------------------------------------------
    def listen(self, host: str, port: int) -> None:
        """Become a server on ``host:port`` (replacing any earlier listener).

        :raises OSError: the address cannot be used.
        """
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
    def _live(self, cluster_id: int, *, own_only: bool = False) -> Link | None:
        """The live link to ``cluster_id`` (this side's first): with the lock held, or for
        one read that may race a link closing (``route``)."""
        entries = self._entries
        entry = entries.get((cluster_id, True))
        if isinstance(entry, Link) and entry.live:
            return entry
        if own_only:
            return None
        entry = entries.get((cluster_id, False))
        return entry if isinstance(entry, Link) and entry.live else None

    def live_links(self) -> dict[int, Link]:
        """The live link to each linked cluster (the one transfers use), by cluster id."""
        with self._lock:
            clusters = {cluster_id for cluster_id, _ in self._entries}
            found = {c: self._live(c) for c in clusters}
        return {c: link for c, link in found.items() if link is not None}

    def get(self, cluster_id: int) -> Link | None:
        """The live link to ``cluster_id`` (the one this side made first), or None."""
        with self._lock:
            return self._live(cluster_id)

    def broken(self, cluster_id: int) -> BrokenLink | None:
        """What is left of a link to ``cluster_id`` that closed, when no live one exists."""
        with self._lock:
            if self._live(cluster_id) is not None:
                return None
            for own in (True, False):
                entry = self._entries.get((cluster_id, own))
                if entry is not None:
                    return entry if isinstance(entry, BrokenLink) else entry.broken()
        return None

    def route(self, cluster_id: int) -> Link:
        """The link transfers to ``cluster_id`` use.

        :raises LLMException: ``LLM_LINK_FAILED`` naming who closed it and when, for a link
            that closed without this side asking; ``LLM_NOT_YET_LINK`` when there is none.
        """
        # Read without the lock: each dict read is atomic, and a link that closes right after
        # is what a locked read could return too.
        link = self._live(cluster_id)
        if link is not None:
            return link
        broken = self.broken(cluster_id)
        if broken is not None:
            raise broken.error()
        raise NotYetLinkError(
            f"cluster {cluster_id} is not linked: call link_clusters (or link) first",
            status_code=_S.LLM_NOT_YET_LINK,
        )

    def set_routes(self, cluster_id: int, change: Callable[[Link], list[Route]]) -> None:
        """Replace the routes of the live links to ``cluster_id`` with ``change(link)`` (a
        domain adds or removes its communicator's route)."""
        with self._lock:
            for own in (True, False):
                entry = self._entries.get((cluster_id, own))
                if isinstance(entry, Link):
                    entry.routes = change(entry)

    def __len__(self) -> int:
        """The number of clusters with a live link."""
        with self._lock:
            return len(
                {cid for (cid, _), e in self._entries.items() if isinstance(e, Link) and e.live}
            )

    # -- serving side ---------------------------------------------------------------------
    @property
    def handler(self) -> RequestHandler:
        """Serves the requests that arrive on this engine's channels."""
        return self._handler

    def _blocks_accept(self, cluster_id: int) -> Link | None:
        """The live link that keeps a new one from ``cluster_id`` out; lock held."""
        if self.directional:
            entry = self._entries.get((cluster_id, False))
            return entry if isinstance(entry, Link) and entry.live else None
        return self._live(cluster_id)

    def accept(self, peer: Hello, channel: Channel) -> Hello:
        """Register a link a peer made to us (called by the transport during its handshake).

        A live link that keeps it out is given :data:`STALE_LINK_GRACE_S` to be seen closed
        (the peer drops its end before it links again).

        :raises LinkRefused: the peer claims our cluster id or means another cluster
            (``LLM_LINK_FAILED``), or a live link keeps it out (``LLM_ALREADY_LINK``).
        """
        if peer.cluster_id == self.local.cluster_id:
            raise LinkRefused(_S.LLM_LINK_FAILED, f"peer has our own cluster id {peer.cluster_id}")
        if peer.to_cluster_id not in (None, self.local.cluster_id):
            raise LinkRefused(
                _S.LLM_LINK_FAILED,
                f"this is cluster {self.local.cluster_id}, not {peer.to_cluster_id}",
            )
        peer = replace(peer, to_cluster_id=None, comm=None)
        cluster_id = peer.cluster_id
        link = self._equipped(Link(peer, channel, initiator=False))
        deadline = time.monotonic() + STALE_LINK_GRACE_S
        while True:
            with self._lock:
                if self._blocks_accept(cluster_id) is None:
                    self._register(link)
                    break
            if time.monotonic() >= deadline:
                self._detach(link)
                raise LinkRefused(_S.LLM_ALREADY_LINK, f"cluster {cluster_id} is already linked")
            time.sleep(0.002)
        channel.on_close(self._forget)
        self._log.info(
            "link.accepted", remote_cluster_id=cluster_id, authenticated=channel.authenticated
        )
        self._note_unauthenticated(link)
        return self.local

    def _register(self, link: Link) -> None:
        """Enter ``link`` (lock held): it replaces its slot's old entry, and in a table of
        one link per pair, what is left of a broken link of the pair either way."""
        cluster_id = link.remote.cluster_id
        old = self._entries.pop((cluster_id, link.initiator), None)
        if old is not None:
            self._detach(old)
        if not self.directional:
            other = (cluster_id, not link.initiator)
            if isinstance(self._entries.get(other), BrokenLink):
                del self._entries[other]
        self._entries[(cluster_id, link.initiator)] = link

    def _note_unauthenticated(self, link: Link) -> None:
        if not link.channel.authenticated:
            self._log.info(
                "link.unauthenticated",
                remote_cluster_id=link.remote.cluster_id,
                note="no link secret: the peer did not prove who it is",
            )

    def _equipped(self, link: Link) -> Link:
        """``link`` with the link's own routes, each provider told of it (they place their
        routes once their part with the peer is ready)."""
        link.routes = link_routes(link.channel, self.staging)
        handle = _Handle(self, link)
        for provider in self.providers:
            provider.attach(handle)
        return link

    def _place(self, link: Link, change: Callable[[list[Route]], list[Route]]) -> bool:
        """``link.routes = change(link.routes)`` unless the link went (``LinkHandle``)."""
        with self._lock:
            if link.gone or link.channel.closed:
                return False
            link.routes = change(link.routes)
            return True

    def _fail(self, link: Link, reason: str) -> None:
        """Break ``link`` for ``reason`` (its peer failed a provider's protocol): transfers
        to its cluster fail with ``LLM_LINK_FAILED`` saying so, until it is unlinked or
        linked again; the peer sees its end closed."""
        with self._lock:
            for key, entry in self._entries_of(link.channel):
                self._entries[key] = BrokenLink(
                    key[0], entry.initiator, link.channel.remote, reason
                )
                self._trim_broken()
        self._log.warning("link.broken", remote_cluster_id=link.remote.cluster_id, reason=reason)
        self._detach(link)
        link.channel.close(notify_peer=False, timeout=1.0)

    def _detach(self, entry: _Entry) -> None:
        """``entry`` left the table: its providers release their part of it."""
        if not isinstance(entry, Link):
            return
        entry.gone = True
        for provider in self.providers:
            provider.detach(entry.channel)

    def _forget(self, channel: Channel) -> None:
        """A channel closed without this side asking: its link becomes a broken link, or
        just goes when the peer unlinked it (at both ends, as documented), where another
        live link to the same cluster stays, and for a peer's own link in a directional
        table (that one is the peer's business)."""
        with self._lock:
            for key, entry in self._entries_of(channel):
                cluster_id = key[0]
                self._detach(entry)
                if (
                    channel.unlinked_by_peer
                    or (self.directional and not entry.initiator)
                    or (not self.directional and self._live(cluster_id) is not None)
                ):
                    del self._entries[key]
                else:
                    broken = entry.broken()
                    self._entries[key] = broken
                    self._trim_broken()
                self._log.info(
                    "link.closed",
                    remote_cluster_id=cluster_id,
                    initiator=entry.initiator,
                    reason=channel.close_reason,
                )

    def _entries_of(self, channel: Channel) -> list[tuple[tuple[int, bool], Link]]:
        """(Lock held.) The links over ``channel``: looked up by its peer's cluster id, with
        a scan of every entry only where that finds none."""
        found: list[tuple[tuple[int, bool], Link]] = []
        for initiator in (True, False):
            key = (channel.peer.cluster_id, initiator)
            entry = self._entries.get(key)
            if isinstance(entry, Link) and entry.channel is channel:
                found.append((key, entry))
        if found:
            return found
        return [
            (key, entry)
            for key, entry in self._entries.items()
            if isinstance(entry, Link) and entry.channel is channel
        ]

    def _trim_broken(self) -> None:
        """(Lock held, a link just broke.) Drop the oldest broken links past
        :data:`MAX_BROKEN_LINKS`, looking at them all only once a quarter of that broke."""
        self._broke_since_trim += 1
        if self._broke_since_trim < MAX_BROKEN_LINKS // 4:
            return
        self._broke_since_trim = 0
        broken = [(e.at, k) for k, e in self._entries.items() if isinstance(e, BrokenLink)]
        for _, key in sorted(broken)[: max(0, len(broken) - MAX_BROKEN_LINKS)]:
            del self._entries[key]

    # -- client side ----------------------------------------------------------------------
    def link_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout_ms: int
    ) -> tuple[LLMStatusCode, LinkResults]:
        """Link to every cluster in parallel; arguments were checked by :func:`check_clusters`.

        Never raises for a failed link: each cluster's status and reason is in the results.
        """
        refused = _refuse_batch(clusters)
        if refused is not None:
            return refused
        timeout = timeout_ms / 1000
        if len(clusters) == 1:
            outcomes = [self._link_guarded(clusters[0], timeout)]
        else:
            outcomes = self._in_parallel(clusters, timeout)
        results = LinkResults(outcomes)
        return overall_status(results), results

    def _in_parallel(
        self, clusters: Sequence[LLMClusterInfo], timeout: float
    ) -> list[LLMException | None]:
        try:
            with ThreadPoolExecutor(min(len(clusters), MAX_CLUSTERS_PER_CALL)) as pool:
                return list(pool.map(lambda c: self._link_guarded(c, timeout), clusters))
        except RuntimeError as exc:  # no thread to be had: link one after the other
            self._log.warning("link.no_threads", reason=str(exc))
            return [self._link_guarded(c, timeout) for c in clusters]

    def _link_guarded(
        self, info: LLMClusterInfo, timeout: float, comm: str | None = None
    ) -> LLMException | None:
        """:meth:`_link_one`, with any failure it did not foresee reported, never raised."""
        try:
            return self._link_one(info, timeout, comm)
        except Exception as exc:
            self._log.warning(
                "link.failed", remote_cluster_id=info.remote_cluster_id, exc_info=True
            )
            error = _failure(
                _S.LLM_LINK_FAILED, f"link to cluster {info.remote_cluster_id}: {exc!r}"
            )
            error.__cause__ = exc
            return error

    def link_member(
        self, cluster_id: int, endpoint: tuple[str, int], timeout: float, comm: str
    ) -> LLMException | None:
        """Link to the member ``cluster_id`` of the communication domain ``comm`` at its rank
        endpoint; None on success or when already linked, else why not."""
        info = LLMClusterInfo()
        info.remote_cluster_id = cluster_id
        info.append_remote_ip_info(*endpoint)
        error = self._link_guarded(info, timeout, comm)
        if error is not None and error.status_code == _S.LLM_ALREADY_LINK:
            return None
        return error

    def _link_one(
        self, info: LLMClusterInfo, timeout: float, comm: str | None
    ) -> LLMException | None:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        with self._lock:
            if self._live(remote_id, own_only=self.directional) is not None:
                return _failure(_S.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked")
        if not info.remote_ip_info_list:
            self._log.warning("link.failed", remote_cluster_id=remote_id, reason="no remote ip")
            return _failure(
                _S.LLM_PARAM_INVALID,
                f"cluster {remote_id} has no remote ip: call append_remote_ip_info",
            )
        if self.directional and len(info.remote_ip_info_list) != 1:
            return _failure(
                _S.LLM_PARAM_INVALID,
                "the hixl backend links to exactly one remote ip:port per cluster, "
                f"got {len(info.remote_ip_info_list)}",
            )
        error: LLMException = _failure(_S.LLM_LINK_FAILED, f"cannot link to cluster {remote_id}")
        deadline = time.monotonic() + timeout
        attempts = [
            (attempt, ip, port)
            for attempt in range(self.retry_count)
            for ip, port in info.remote_ip_info_list
        ]
        for attempt, ip, port in attempts:
            host = ip_int_to_str(ip)
            where = f"{host}:{port}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if attempt and error.status_code == _S.LLM_LINK_FAILED:
                time.sleep(min(_RETRY_PAUSE_S, remaining))  # the server may be starting
            try:
                hello = replace(self.local, to_cluster_id=remote_id, comm=comm)
                channel = self.transport.connect(host, port, hello, self._handler, remaining)
            except LinkRefused as exc:
                error = _failure(exc.status, f"link to cluster {remote_id} at {where}: {exc}")
                error.__cause__ = exc.__cause__
                self._log.warning(
                    "link.failed",
                    remote_cluster_id=remote_id,
                    address=where,
                    status=str(exc.status),
                    reason=str(exc),
                )
                continue
            if channel.peer.cluster_id != remote_id:
                channel.close(notify_peer=True, timeout=max(0.0, deadline - time.monotonic()))
                reason = f"the peer at {where} is cluster {channel.peer.cluster_id}"
                self._log.warning(
                    "link.failed", remote_cluster_id=remote_id, address=where, reason=reason
                )
                error = _failure(_S.LLM_LINK_FAILED, f"link to cluster {remote_id}: {reason}")
                continue
            link = self._equipped(Link(channel.peer, channel, initiator=True))
            return self._established(link, where, deadline)
        return error

    def _established(self, link: Link, where: str, deadline: float) -> LLMException | None:
        """Enter a link this side made (the handshake is done); its providers may wait until
        ``deadline`` (``time.monotonic()``) for their part with the peer (UCX, for the
        peer's table), so that the transfers after ``link_clusters`` take their routes."""
        remote_id = link.remote.cluster_id
        with self._lock:
            duplicate = self._live(remote_id, own_only=True)
            if duplicate is None:
                self._register(link)
        if duplicate is not None:  # another call of this side linked it meanwhile
            self._detach(link)
            link.channel.close(notify_peer=True, timeout=1.0)
            return _failure(_S.LLM_ALREADY_LINK, f"cluster {remote_id} is already linked")
        link.channel.on_close(self._forget)
        handle = _Handle(self, link)
        for provider in self.providers:
            provider.established(handle, max(0.0, deadline - time.monotonic()))
        self._log.info(
            "link.established",
            remote_cluster_id=remote_id,
            address=where,
            authenticated=link.channel.authenticated,
        )
        self._note_unauthenticated(link)
        return None

    def unlink_clusters(
        self, clusters: Sequence[LLMClusterInfo], timeout_ms: int, force: bool
    ) -> tuple[LLMStatusCode, LinkResults]:
        """Unlink every cluster; arguments were checked by :func:`check_clusters`."""
        refused = _refuse_batch(clusters)
        if refused is not None:
            return refused
        timeout = timeout_ms / 1000
        results = LinkResults(self._unlink_one(info, timeout, force) for info in clusters)
        return overall_status(results), results

    def _take(self, cluster_id: int, *, own_only: bool) -> list[_Entry]:
        """Remove the entries of ``cluster_id`` (only this side's link and broken links
        where ``own_only``); their peer memory closed."""
        with self._lock:
            taken = []
            for own in (True, False):
                entry = self._entries.get((cluster_id, own))
                if entry is None or (own_only and not own and isinstance(entry, Link)):
                    continue
                del self._entries[(cluster_id, own)]
                taken.append(entry)
        for entry in taken:
            self._detach(entry)
        return taken

    def _unlink_one(self, info: LLMClusterInfo, timeout: float, force: bool) -> LLMException | None:
        remote_id = info.remote_cluster_id
        assert remote_id is not None
        if self.directional:  # always local, by cluster id alone; the peer's link stays
            for entry in self._take(remote_id, own_only=True):
                if isinstance(entry, Link):
                    entry.channel.close(notify_peer=True, timeout=timeout)
                    self._log.info("link.unlinked", remote_cluster_id=remote_id, force=force)
            return None
        if not force and len(info.remote_ip_info_list) != 1:
            return _failure(
                _S.LLM_PARAM_INVALID,
                "a graceful unlink (force=False) needs exactly one remote ip, got "
                f"{len(info.remote_ip_info_list)}",
            )
        taken = self._take(remote_id, own_only=False)
        live = [e for e in taken if isinstance(e, Link) and e.live]
        if not taken and not force:
            return _failure(_S.LLM_NOT_YET_LINK, f"cluster {remote_id} is not linked")
        told = True
        for link in live:
            told = link.channel.close(notify_peer=not force, timeout=timeout) and told
        if live:
            self._log.info(
                "link.unlinked", remote_cluster_id=remote_id, force=force, peer_told=told
            )
        if not force and not told:
            return _failure(
                _S.LLM_NOTIFY_PROMPT_UNLINK_FAILED,
                f"cluster {remote_id} could not be told of the unlink: call unlink_clusters "
                "on it to clean up",
            )
        return None

    def drop(self, cluster_id: int, timeout: float) -> bool:
        """Remove every link to ``cluster_id`` at both ends; False when there was none."""
        taken = self._take(cluster_id, own_only=False)
        for entry in taken:
            if isinstance(entry, Link):
                told = entry.channel.close(notify_peer=True, timeout=timeout)
                self._log.info("link.unlinked", remote_cluster_id=cluster_id, peer_told=told)
        return bool(taken)

    def close(self, timeout: float = 1.0) -> None:
        """Stop listening and drop every link, telling peers (finalize)."""
        self.stop_listening()
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            self._detach(entry)
            if isinstance(entry, Link):
                entry.channel.close(notify_peer=True, timeout=timeout, finalizing=True)


class _Handle:
    """A link as its providers see it (``_routes.provider.LinkHandle``)."""

    def __init__(self, table: LinkTable, link: Link) -> None:
        self._table = table
        self._link = link
        self.log = table._log.bind(remote_cluster_id=link.remote.cluster_id)

    @property
    def channel(self) -> Channel:
        return self._link.channel

    @property
    def initiator(self) -> bool:
        return self._link.initiator

    def place(self, change: Callable[[list[Route]], list[Route]]) -> bool:
        return self._table._place(self._link, change)

    def fail(self, reason: str) -> None:
        self._table._fail(self._link, reason)
