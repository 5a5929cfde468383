"""Two-sided links through a rank table (``link``/``unlink``/``query_register_mem_status``).

Every member of a communication domain calls ``link`` with the same rank table and the same
``{cluster_id: rank}`` map. On TCP and loopback a rank's endpoint is found in the table:

* the address is the ``host_ip`` of the rank's server entry when given, else the device's
  ``device_ip``;
* the port is the device entry's ``port`` when given, else ``aio.CommBasePort`` (default
  27000) plus the rank.

Each member connects to every member of a lower rank (retrying until the peer listens) and,
while ``link`` runs, accepts every member of a higher rank on its own endpoint. Endpoints are
shared: on a host without accelerators every device ip is the host's and every domain numbers
its ranks from 0, so many domains of one host meet at the same few endpoints, linking at the
same moment. A link names its domain in its handshake and the endpoint hands it to that
domain's member, in this process or another (``_transport.rendezvous``); no configuration is
needed. The resulting links are ordinary links: ``pull_*``/``push_*`` reach the members by
cluster id.

Where the engine's runtime has a collective library (HCCL on Ascend, with its rank-table
and one-sided calls), ``link`` also joins the domain's communicator as this rank: it binds
the engine's pools and every remote-accessible registered cache to it (which is why memory
must be registered before ``link``, and why ``remote_accessible=True`` is refused after
it) and prepares it with every member. Device rows of transfers between the members then
move through the communicator (:mod:`aio_datadist._routes.hccl.domain`). ``unlink`` unbinds the
memory and destroys the communicator. A library that refuses fails ``link`` with
``LLM_LINK_FAILED`` and drops the links it made.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.links import Link, LinkTable
from aio_datadist._engine.routes import Route, placed
from aio_datadist._log import get_logger
from aio_datadist._routes.hccl.domain import CommRoute, CommRoutes
from aio_datadist._routes.hccl.route import CommunicatorRoute
from aio_datadist._runtime.base import Communicator
from aio_datadist._transport.base import Channel, Hello, LinkRefused, RequestHandler
from aio_datadist._validate import check_int, check_type, param_invalid
from aio_datadist.enums import Placement, RegisterMemStatus
from aio_datadist.status import LinkFailedError, LLMException, LLMStatusCode, ParamInvalidError

__all__ = ("CommDomains", "check_link_args", "rank_endpoints")

#: Seconds ``link`` waits for the other members when ``link_total_time`` is 0 (like HCCL).
DEFAULT_CONNECT_TIMEOUT_S = 120


def check_link_args(comm_name: Any, cluster_rank_info: Any, rank_table: Any) -> None:
    """Validate the arguments of ``link`` as documented."""
    check_type("comm_name", comm_name, str)
    check_type("cluster_rank_info", cluster_rank_info, dict)
    check_type("rank_table", rank_table, str)
    if not comm_name or len(comm_name) >= 128:
        param_invalid(f"comm_name must have 1 to 127 characters, got {len(comm_name)}")
    if not 2 <= len(cluster_rank_info) <= 4:
        param_invalid(f"cluster_rank_info needs 2 to 4 members, got {len(cluster_rank_info)}")
    previous = -1
    for cluster_id, rank in cluster_rank_info.items():
        check_int("cluster_rank_info key", cluster_id, "uint64")
        check_int("cluster_rank_info value", rank, "uint32")
        if rank <= previous:
            param_invalid("cluster_rank_info ranks must be ascending in dict order")
        previous = rank


def rank_endpoints(rank_table: str, base_port: int) -> dict[int, tuple[str, int]]:
    """Each rank's ``(host, port)`` from a rank table (see the module docstring).

    :raises LLMException: ``LLM_PARAM_INVALID`` for a table that is not JSON of the
        documented shape.
    """
    try:
        table = json.loads(rank_table)
        endpoints: dict[int, tuple[str, int]] = {}
        for server in table["server_list"]:
            for device in server["device"]:
                rank = int(device["rank_id"])
                host = server.get("host_ip") or device["device_ip"]
                port = int(device.get("port", base_port + rank))
                endpoints[rank] = (str(host), port)
    except (ValueError, KeyError, TypeError) as exc:
        raise ParamInvalidError(
            f"rank_table is not a valid rank table: {exc!r}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from None
    return endpoints


def _adding(member: CommRoute, link: Link) -> list[Route]:
    """``link``'s routes with the one through ``member``'s communicator."""
    return placed(link.routes, [CommunicatorRoute(link.channel, member)], CommunicatorRoute)


def _removing(member: CommRoute, link: Link) -> list[Route]:
    """``link``'s routes without the one through ``member``'s communicator."""
    return [
        r
        for r in link.routes
        if not (isinstance(r, CommunicatorRoute) and r.member.communicator is member.communicator)
    ]


@dataclass
class _Domain:
    name: str
    members: list[int]
    communicator: Communicator | None = None


class _CommAcceptor:
    """Accepts only the members of one domain, registering them in the link table."""

    def __init__(self, links: LinkTable, members: set[int]) -> None:
        self._links = links
        self._members = members
        #: Members linked so far (accepted here, or connected to by this side).
        self.linked: set[int] = set()

    @property
    def handler(self) -> RequestHandler:
        return self._links.handler

    def accept(self, peer: Hello, channel: Channel) -> Hello:
        if peer.cluster_id not in self._members:
            raise LinkRefused(
                LLMStatusCode.LLM_LINK_FAILED,
                f"cluster {peer.cluster_id} is not a member of this communication domain",
            )
        accepted = self._links.accept(peer, channel)
        self.linked.add(peer.cluster_id)
        return accepted


class CommDomains:
    """The communication domains of one engine; comm ids start at 1."""

    def __init__(
        self,
        links: LinkTable,
        caches: CacheService,
        routes: CommRoutes,
        base_port: int,
        total_time_s: int,
    ) -> None:
        self._links = links
        self._caches = caches
        self._routes = routes
        self._log = get_logger("comm", cluster_id=links.local.cluster_id)
        self._base_port = base_port
        env = os.environ.get("HCCL_CONNECT_TIMEOUT", "")
        default = int(env) if env.isdigit() else DEFAULT_CONNECT_TIMEOUT_S
        self._total_time = total_time_s or default
        self._domains: dict[int, _Domain] = {}
        self._next_id = 1
        self._lock = threading.Lock()
        #: Set by :meth:`close`: a domain still being set up gives up at once.
        self._closed = False

    def link(self, comm_name: str, cluster_rank_info: dict[int, int], rank_table: str) -> int:
        """Link with every other member; returns the comm id.

        :raises LLMException: ``LLM_PARAM_INVALID`` (this cluster not a member, rank not in
            the table), ``LLM_LINK_FAILED`` (members did not all link in time, or the
            runtime's collective library refused the domain).
        """
        me = self._links.local.cluster_id
        if me not in cluster_rank_info:
            param_invalid(f"this cluster ({me}) is not in cluster_rank_info")
        endpoints = rank_endpoints(rank_table, self._base_port)
        for cluster_id, rank in cluster_rank_info.items():
            if rank not in endpoints:
                param_invalid(f"rank {rank} of cluster {cluster_id} is not in the rank table")
        my_rank = cluster_rank_info[me]
        others = {c: r for c, r in cluster_rank_info.items() if c != me}
        deadline = time.monotonic() + self._total_time
        already = {c for c in others if self._links.get(c) is not None}
        acceptor = _CommAcceptor(self._links, set(others))
        try:
            listener = None
            if any(rank > my_rank for rank in others.values()):
                host, port = endpoints[my_rank]
                try:
                    listener = self._links.transport.listen_shared(
                        host, port, (comm_name, me), acceptor, self._total_time
                    )
                except LinkRefused as exc:
                    raise LinkFailedError(
                        f"communication domain {comm_name!r}: rank {my_rank} cannot listen "
                        f"on {host}:{port}: {exc}",
                        status_code=LLMStatusCode.LLM_LINK_FAILED,
                    ) from exc
            try:
                for cluster_id, rank in others.items():
                    if rank < my_rank:
                        self._connect(comm_name, cluster_id, endpoints[rank], deadline)
                        acceptor.linked.add(cluster_id)
                self._await_members(comm_name, others, acceptor.linked, deadline)
            finally:
                if listener is not None:
                    listener.close()
            communicator = self._join(comm_name, rank_table, my_rank, deadline)
        except LLMException as exc:
            for cluster_id in others.keys() - already:  # links made before stay
                self._links.drop(cluster_id, timeout=3.0)
            if exc.status_code == LLMStatusCode.LLM_LINK_FAILED:
                raise
            raise LinkFailedError(
                f"communication domain {comm_name!r}: {exc}",
                status_code=LLMStatusCode.LLM_LINK_FAILED,
            ) from None
        if communicator is not None:
            for cluster_id, rank in others.items():
                member = CommRoute(communicator, rank)
                self._routes[cluster_id] = member  # the serving side's
                self._links.set_routes(cluster_id, functools.partial(_adding, member))
        with self._lock:
            comm_id = self._next_id
            self._next_id += 1
            self._domains[comm_id] = _Domain(comm_name, list(others), communicator)
        return comm_id

    def _await_members(
        self, comm_name: str, others: dict[int, int], linked: set[int], deadline: float
    ) -> None:
        """Wait until every other member is linked; fail early when one linked and left
        (it gave up on the domain)."""
        while True:
            self._check_open(comm_name)
            missing = [c for c in others if self._links.get(c) is None]
            if not missing:
                return
            left = [c for c in missing if c in linked]
            if left:
                raise LinkFailedError(
                    f"communication domain {comm_name!r}: clusters {left} linked and left "
                    "while the domain was being set up",
                    status_code=LLMStatusCode.LLM_LINK_FAILED,
                )
            if time.monotonic() > deadline:
                raise LinkFailedError(
                    f"communication domain {comm_name!r}: clusters {missing} did not link "
                    f"within {self._total_time} s",
                    status_code=LLMStatusCode.LLM_LINK_FAILED,
                )
            time.sleep(0.005)

    def _check_open(self, comm_name: str) -> None:
        """Give up setting up ``comm_name`` once the engine finalized (no thread waits for
        members of a domain nobody can use)."""
        if self._closed:
            raise LinkFailedError(
                f"communication domain {comm_name!r}: the engine was finalized while the "
                "domain was being set up",
                status_code=LLMStatusCode.LLM_LINK_FAILED,
            )

    def _join(
        self, comm_name: str, rank_table: str, rank: int, deadline: float
    ) -> Communicator | None:
        """This rank's communicator of the domain with the engine's memory bound and
        prepared; None when the runtime has none."""
        try:
            fd, path = tempfile.mkstemp(prefix="aio-datadist-rank-table-", suffix=".json")
        except OSError as exc:
            raise LinkFailedError(
                f"communication domain {comm_name!r}: cannot write the rank table: {exc}",
                status_code=LLMStatusCode.LLM_LINK_FAILED,
            ) from exc
        try:
            with os.fdopen(fd, "w") as f:
                f.write(rank_table)
            communicator = self._caches.runtime.open_communicator(path, rank)
        except OSError as exc:
            raise LinkFailedError(
                f"communication domain {comm_name!r}: cannot write the rank table: {exc}",
                status_code=LLMStatusCode.LLM_LINK_FAILED,
            ) from exc
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if communicator is None:
            return None
        try:
            for addr, nbytes, on_device in self._bindable():
                communicator.bind(addr, nbytes, on_device=on_device)
            communicator.prepare(max(1, int(deadline - time.monotonic())))
        except BaseException:
            try:
                communicator.close()
            except LLMException as exc:
                self._log.warning("comm.close_failed", comm_name=comm_name, reason=str(exc))
            raise
        self._log.info("comm.joined", comm_name=comm_name, rank=rank)
        return communicator

    def _bindable(self) -> list[tuple[int, int, bool]]:
        """``(addr, nbytes, on_device)`` of the memory members may reach: the pools, and
        the remote-accessible caches registered outside them (overlapping ranges merged)."""
        caches = self._caches
        spans = [
            (pool.arena.addr, pool.arena.nbytes, placement is Placement.DEVICE)
            for placement, pool in caches.pools.items()
        ]
        with caches.registry.lock:
            for entry in caches.registry.entries():
                if entry.pool is None and entry.remote_accessible and not entry.released:
                    device = entry.placement is Placement.DEVICE
                    spans.extend((a, entry.tensor_bytes, device) for a in entry.addrs if a)
        merged: list[tuple[int, int, bool]] = []
        for addr, nbytes, device in sorted(spans):
            if merged and merged[-1][2] == device and addr <= merged[-1][0] + merged[-1][1]:
                low, size, _ = merged[-1]
                merged[-1] = (low, max(size, addr + nbytes - low), device)
            elif nbytes > 0:
                merged.append((addr, nbytes, device))
        return merged

    def _connect(
        self, comm_name: str, cluster_id: int, endpoint: tuple[str, int], deadline: float
    ) -> None:
        """Link to the member ``cluster_id`` at its endpoint, retrying until it listens."""
        while True:
            self._check_open(comm_name)
            remaining = max(0.001, deadline - time.monotonic())
            error = self._links.link_member(cluster_id, endpoint, remaining, comm_name)
            if error is None:
                return
            if time.monotonic() > deadline:
                raise LinkFailedError(
                    f"cannot link to cluster {cluster_id} at {endpoint[0]}:{endpoint[1]}: {error}",
                    status_code=LLMStatusCode.LLM_LINK_FAILED,
                ) from error
            time.sleep(0.02)

    def _domain(self, comm_id: Any) -> _Domain:
        check_int("comm_id", comm_id, "uint64")
        with self._lock:
            domain = self._domains.get(comm_id)
        if domain is None:
            param_invalid(f"comm_id {comm_id} is not a linked communication domain")
        assert domain is not None
        return domain

    def unlink(self, comm_id: Any) -> None:
        """Unlink every member of the domain (both ends) and leave its communicator.

        :raises LLMException: the collective library failed to release the communicator
            (the links are gone all the same).
        """
        domain = self._domain(comm_id)
        with self._lock:
            self._domains.pop(comm_id, None)
        try:
            self._leave(domain)
        finally:
            for cluster_id in domain.members:
                self._links.drop(cluster_id, timeout=3.0)

    def _leave(self, domain: _Domain) -> None:
        communicator = domain.communicator
        if communicator is None:
            return
        for cluster_id in domain.members:
            route = self._routes.get(cluster_id)
            if route is not None and route.communicator is communicator:
                del self._routes[cluster_id]
                self._links.set_routes(cluster_id, functools.partial(_removing, route))
        communicator.close()

    def close(self) -> None:
        """Leave every domain's communicator (the engine finalizes; links close apart); a
        domain still being set up gives up."""
        with self._lock:
            self._closed = True
            domains, self._domains = list(self._domains.values()), {}
        for domain in domains:
            try:
                self._leave(domain)
            except LLMException as exc:
                self._log.warning("comm.close_failed", comm_name=domain.name, reason=str(exc))

    def status(self, comm_id: Any) -> RegisterMemStatus:
        """``OK`` while every member is linked, ``FAILED`` once a member's link broke."""
        domain = self._domain(comm_id)
        if all(self._links.get(c) is not None for c in domain.members):
            return RegisterMemStatus.OK
        return RegisterMemStatus.FAILED
