"""The engine: an endpoint's role, cluster id, options and lifecycle (``init``/``finalize``)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.comm import CommDomains, check_link_args
from aio_datadist._engine.links import LinkTable, check_clusters
from aio_datadist._engine.metrics import TransferMetrics
from aio_datadist._engine.planner import Planner
from aio_datadist._engine.serving import ControlPlane, Server
from aio_datadist._engine.settings import EngineSettings
from aio_datadist._log import get_logger
from aio_datadist._memory.pool import MemoryPool
from aio_datadist._routes.catalog import PROVIDERS
from aio_datadist._routes.hccl.domain import CommRoutes
from aio_datadist._routes.provider import Opening, RouteProvider
from aio_datadist._runtime import select_runtime
from aio_datadist._runtime.base import DeviceRuntime
from aio_datadist._transport import make_transport
from aio_datadist._transport.base import ChannelStats, Hello
from aio_datadist._validate import check_int, check_type
from aio_datadist.cluster import LinkResults
from aio_datadist.config import (
    OPTION_LISTEN_IP_INFO,
    parse_listen_ip_info,
    prepare_init_options,
)
from aio_datadist.enums import LLMRole, Placement, RegisterMemStatus
from aio_datadist.stats import DataDistStats
from aio_datadist.status import (
    ExistLinkError,
    FeatureNotEnabledError,
    LLMFailedError,
    LLMStatusCode,
    ParamInvalidError,
)

__all__ = ("Engine",)


class Engine:
    """One endpoint. Both faces drive it; it owns the cache service between init and finalize."""

    def __init__(self, role: Any, cluster_id: Any) -> None:
        check_type("role", role, LLMRole)
        check_int("cluster_id", cluster_id, "uint64")
        self.role: LLMRole = role
        self.cluster_id: int = cluster_id
        self.settings: EngineSettings | None = None
        self.caches: CacheService | None = None
        self.links: LinkTable | None = None
        self.planner: Planner | None = None
        self._providers: dict[str, RouteProvider] = {}
        self.comms: CommDomains | None = None
        self._lock = threading.Lock()
        self._log = get_logger("engine", cluster_id=cluster_id, role=role.name)

    @property
    def initialized(self) -> bool:
        """True between a successful ``init`` and ``finalize``."""
        return self.settings is not None

    def init(self, options: Any) -> None:
        """Validate ``options``, choose the runtime and create the pools.

        A second call on an initialised engine does nothing.

        :raises TypeError: ``options`` is not a dict.
        :raises LLMException: ``LLM_PARAM_INVALID`` for invalid options.
        """
        check_type("options", options, dict)
        with self._lock:
            if self.settings is not None:
                return
            settings = EngineSettings(prepare_init_options(options, self.role))
            runtime = select_runtime(settings.device_id)
            runtime.share_host_memory = settings.shared_pools
            pools: dict[Placement, MemoryPool] = {}
            try:
                for placement, cfg in (
                    (Placement.DEVICE, settings.device_pool),
                    (Placement.HOST, settings.host_pool),
                ):
                    if cfg is not None:
                        pools[placement] = MemoryPool(
                            runtime, placement, *cfg, zero=settings.zero_on_alloc
                        )
            except BaseException:
                _close_all(pools, runtime)
                raise
            log = self._log.bind(device_id=settings.device_id)
            caches_log = get_logger("cache", cluster_id=self.cluster_id, role=self.role.name)
            caches = CacheService(
                runtime,
                pools,
                remote_cache_accessible=settings.remote_cache_accessible,
                log=caches_log,
            )
            opening = Opening(settings, caches, self.cluster_id, self.role.name)
            providers: dict[str, RouteProvider] = {}
            try:
                for spec in PROVIDERS:
                    provider = spec.open(opening)
                    if provider is not None:
                        providers[spec.name] = provider
            except BaseException:
                _close_providers(providers)
                caches.close()
                raise
            hello = Hello(self.cluster_id, self.role)
            for provider in providers.values():
                hello = provider.offer(hello)
            routes: CommRoutes = {}
            links = LinkTable(
                hello,
                make_transport(
                    settings.transport, settings.link_secret, busy_poll_us=settings.busy_poll_us
                ),
                Server(caches, routes, _control_plane(providers)),
                get_logger("link", cluster_id=self.cluster_id, role=self.role.name),
                staging=caches.staging,
                directional=settings.hixl,
                providers=tuple(providers.values()),
            )
            links.retry_count = max(1, settings.link_retry_count)
            if settings.metrics:
                links.metrics = TransferMetrics(
                    get_logger("transfer", cluster_id=self.cluster_id, role=self.role.name)
                )
            if settings.listen is not None:
                try:
                    links.listen(*settings.listen)
                except OSError as exc:
                    _close_providers(providers)
                    caches.close()
                    host, port = settings.listen
                    raise LLMFailedError(
                        f"cannot listen on {host}:{port}: {exc}",
                        status_code=LLMStatusCode.LLM_FAILED,
                    ) from None
            self.caches, self.links, self._providers = caches, links, providers
            self.comms = CommDomains(
                links, caches, routes, settings.comm_base_port, settings.link_total_time_s
            )
            self.planner = Planner(
                caches,
                timeout_ms=settings.sync_kv_timeout_ms,
                remote_cache_accessible=settings.remote_cache_accessible,
                log=caches_log,
            )
            self.settings = settings
        log.info(
            "engine.initialized",
            runtime=runtime.name,
            cache_manager=settings.cache_manager_mode,
            device_pool=settings.device_pool,
            host_pool=settings.host_pool,
        )

    def cache_service(self) -> CacheService:
        """The cache service, checking the documented preconditions of ``cache_manager``.

        :raises RuntimeError: not initialised.
        :raises LLMException: ``LLM_PARAM_INVALID`` outside CacheManager mode.
        """
        settings, caches = self.settings, self.caches
        if settings is None or caches is None:
            raise RuntimeError("llm datadist is not initialized")
        if not settings.cache_manager_mode:
            raise ParamInvalidError(
                "cache_manager needs CacheManager mode: set LLMConfig.enable_cache_manager = True"
                " (the v1 KvCacheManager API is not supported)",
                status_code=LLMStatusCode.LLM_PARAM_INVALID,
            )
        return caches

    def link_table(self) -> LinkTable:
        """The link table of the initialised engine.

        :raises RuntimeError: not initialised.
        """
        links = self.links
        if links is None:
            raise RuntimeError("llm datadist is not initialized")
        return links

    def link_stats(self, cluster_id: int) -> ChannelStats | None:
        """How the live link to ``cluster_id`` (the one transfers use) serves that peer: the
        work it holds and the pauses of its reading; None when no link is live.

        :raises RuntimeError: not initialised.
        """
        link = self.link_table().get(cluster_id)
        return None if link is None else link.channel.stats()

    def stats(self) -> DataDistStats:
        """A snapshot of what this engine moved and holds (``stats()`` of both faces).

        :raises RuntimeError: not initialised.
        """
        links = self.link_table()
        caches = self.caches
        metrics = links.metrics
        live = links.live_links()
        return DataDistStats(
            cluster_id=self.cluster_id,
            metrics=metrics is not None,
            routes=() if metrics is None else tuple(metrics.routes()),
            peers=() if metrics is None else tuple(metrics.peers()),
            links={c: link.channel.stats() for c, link in live.items()},
            link_routes={c: tuple(r.name for r in link.routes) for c, link in live.items()},
            pools={}
            if caches is None
            else {placement.name: pool.stats() for placement, pool in caches.pools.items()},
        )

    def link_clusters(self, clusters: Any, timeout: Any) -> tuple[LLMStatusCode, LinkResults]:
        """``link_clusters``: link to servers; per-cluster results, link failures never raise."""
        links = self.link_table()
        settings = self.settings
        assert settings is not None
        need_local_ip = settings.cache_manager_mode and not settings.local_comm_res
        check_clusters(clusters, timeout, need_local_ip=need_local_ip)
        return links.link_clusters(clusters, timeout)

    def unlink_clusters(
        self, clusters: Any, timeout: Any, force: Any
    ) -> tuple[LLMStatusCode, LinkResults]:
        """``unlink_clusters``: graceful (both ends) or forced (this end) unlink."""
        links = self.link_table()
        check_type("force", force, bool)
        check_clusters(clusters, timeout, need_local_ip=False)
        return links.unlink_clusters(clusters, timeout, force)

    def switch_role(self, role: Any, switch_options: Any) -> None:
        """``switch_role``: change role, and listen on ``llm.listenIpInfo`` or stop listening.

        With the hixl backend the endpoint keeps listening on its init address.

        :raises LLMException: ``LLM_EXIST_LINK`` while any link exists;
            ``LLM_FEATURE_NOT_ENABLED`` for another listen address with the hixl backend.
        """
        check_type("role", role, LLMRole)
        check_type("switch_options", switch_options, dict, allow_none=True)
        links = self.link_table()
        options = switch_options or {}
        listen = options.get(OPTION_LISTEN_IP_INFO)
        address = None if listen is None else parse_listen_ip_info(listen)
        if len(links):
            raise ExistLinkError(
                f"cannot switch role while {len(links)} link(s) exist: unlink them first",
                status_code=LLMStatusCode.LLM_EXIST_LINK,
            )
        settings = self.settings
        if settings is not None and settings.hixl:
            # Every hixl endpoint stays a server on its init address.
            if address is not None and address != settings.listen:
                raise FeatureNotEnabledError(
                    f"the hixl backend cannot change its listen address ({listen!r}) with "
                    "switch_role",
                    status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                )
        elif address is None:
            links.stop_listening()
        else:
            try:
                links.listen(*address)
            except OSError as exc:
                raise LLMFailedError(
                    f"cannot listen on {address[0]}:{address[1]}: {exc}",
                    status_code=LLMStatusCode.LLM_FAILED,
                ) from None
        self.role = role
        links.local = dataclasses.replace(links.local, role=role)
        self._log.info("engine.role_switched", new_role=role.name, listen=listen)

    def comm_domains(self, call: str) -> CommDomains:
        """The communication domains of the initialised engine, for ``call``.

        :raises RuntimeError: not initialised.
        :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` with the hixl backend, which has
            no rank-table domains (as the reference's).
        """
        comms, caches, settings = self.comms, self.caches, self.settings
        if comms is None or caches is None or settings is None:
            raise RuntimeError("llm datadist is not initialized")
        if settings.hixl:
            raise FeatureNotEnabledError(
                f"{call} is not supported with transfer_backend='hixl': link with "
                "link_clusters instead",
                status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
            )
        return comms

    def link(self, comm_name: Any, cluster_rank_info: Any, rank_table: Any) -> int:
        """``link``: a two-sided link with every member of a rank table's domain."""
        self.link_table()
        check_link_args(comm_name, cluster_rank_info, rank_table)
        comm_id = self.comm_domains("link").link(comm_name, cluster_rank_info, rank_table)
        if self.caches is not None:
            self.caches.two_sided_linked = True
        return comm_id

    def unlink(self, comm_id: Any) -> None:
        """``unlink``: drop the links of a communication domain."""
        self.link_table()
        check_int("comm_id", comm_id, "uint64")
        self.comm_domains("unlink").unlink(comm_id)

    def query_register_mem_status(self, comm_id: Any) -> RegisterMemStatus:
        """``query_register_mem_status``: ``OK`` once (and while) the domain is linked."""
        self.link_table()
        check_int("comm_id", comm_id, "uint64")
        return self.comm_domains("query_register_mem_status").status(comm_id)

    def finalize(self) -> None:
        """Release every link, cache, pool and runtime resource; a no-op when not initialised."""
        with self._lock:
            caches, self.caches, self.settings = self.caches, None, None
            links, self.links, self.planner = self.links, None, None
            comms, self.comms = self.comms, None
            providers, self._providers = self._providers, {}
        if comms is not None:
            comms.close()  # communicators first: they hold the memory bound
        if links is not None:
            links.close()
        _close_providers(providers)  # after the links, before the pools they hold
        if caches is not None:
            caches.close()
            self._log.info("engine.finalized")

    def provider(self, name: str) -> RouteProvider | None:
        """The initialised engine's route provider ``name`` (``_routes.PROVIDERS``); None
        where its settings leave it off."""
        return self._providers.get(name)


def _close_all(pools: dict[Placement, MemoryPool], runtime: DeviceRuntime) -> None:
    for pool in pools.values():
        pool.close()
    runtime.close()


def _close_providers(providers: dict[str, RouteProvider]) -> None:
    """Close ``providers`` in the reverse of their opening order."""
    for provider in reversed(list(providers.values())):
        provider.close()


def _control_plane(providers: dict[str, RouteProvider]) -> ControlPlane:
    """Who serves each provider's control requests over a link: the open provider, or the
    setting that would enable it."""
    plane: ControlPlane = {}
    for spec in PROVIDERS:
        for target in spec.targets:
            plane[target] = providers.get(spec.name) or spec.enabled_by
    return plane
