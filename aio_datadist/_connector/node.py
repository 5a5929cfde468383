"""A node: one worker's engine, its registered KV cache, its control channel and its peers.

:class:`KvNode` is what a serving engine's connector holds per worker. ``start`` (blocking,
at worker start) runs the event loop thread, initialises an ``AsyncLLMDataDist`` listening for
transfer links, registers the worker's KV regions in place as one blocks cache that peers may
read and write, and opens the control port. Everything after that runs on the loop; the
engine's hooks hand work over with ``loop.call`` and collect :class:`Outcomes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
from dataclasses import dataclass

from aio_datadist._connector.config import ConnectorConfig
from aio_datadist._connector.consumer import Consumer
from aio_datadist._connector.control import (
    ControlClient,
    ControlError,
    ControlServer,
    Identity,
)
from aio_datadist._connector.layout import KvLayout
from aio_datadist._connector.loop import LoopThread
from aio_datadist._connector.outcomes import Counters, Outcomes
from aio_datadist._connector.producer import Producer
from aio_datadist._log import get_logger
from aio_datadist._runtime import RUNTIME_ENV
from aio_datadist._transport.auth import LinkSecret, secret_from_environment
from aio_datadist.aio import AsyncLLMDataDist
from aio_datadist.cache import Cache
from aio_datadist.cluster import LLMClusterInfo
from aio_datadist.enums import LLMRole
from aio_datadist.stats import DataDistStats
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import BlocksCacheKey

__all__ = ("KvNode", "Peer", "cluster_id_for")

_LINK_BROKEN = (LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_NOT_YET_LINK)


def cluster_id_for(engine_id: str, rank: int) -> int:
    """The cluster id of an engine's TP rank: a 63-bit hash, stable for the engine id."""
    digest = hashlib.blake2b(f"{engine_id}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & (2**63 - 1) or 1


@dataclass(eq=False)
class Peer:
    """A node this one loads from: its control connection and the transfer link to it."""

    address: tuple[str, int]
    client: ControlClient
    link: LLMClusterInfo

    @property
    def cluster_id(self) -> int:
        """The peer's cluster id."""
        return self.client.peer.cluster_id


class KvNode:
    """One worker's side of disaggregated serving (see the module docstring)."""

    def __init__(
        self,
        config: ConnectorConfig,
        layout: KvLayout,
        *,
        engine_id: str,
        rank: int,
        tp_size: int,
        role: LLMRole = LLMRole.MIX,
        log_under: str = "aio_datadist",
    ) -> None:
        self.config = config
        #: Where the node's events go: ``aio_datadist.kv`` by default; an integration puts
        #: them under its host's logger (``vllm.aio_datadist.kv``).
        self.log = get_logger("kv", under=log_under)
        self.layout = layout
        self.engine_id = engine_id
        self.rank = rank
        self.tp_size = tp_size
        self.role = role
        self.cluster_id = cluster_id_for(engine_id, rank)
        self.loop = LoopThread(f"aio_datadist-kv-{rank}", self.log)
        self.outcomes = Outcomes()
        self.counters = Counters()
        self.producer = Producer(self)
        self.consumer = Consumer(self)
        self._secret: LinkSecret | None = None
        self._dd: AsyncLLMDataDist | None = None
        self._cache: Cache | None = None
        self._server: ControlServer | None = None
        self._identity: Identity | None = None
        self._peers: dict[tuple[str, int], Peer] = {}
        self._connecting: dict[tuple[str, int], asyncio.Lock] = {}
        #: Where peers reach this node's control channel (set by ``start``).
        self.control_address: tuple[str, int] = (config.host, 0)

    # -- life ------------------------------------------------------------------------------
    @property
    def dd(self) -> AsyncLLMDataDist:
        """The engine (after ``start``)."""
        assert self._dd is not None, "the node is not started"
        return self._dd

    @property
    def cache(self) -> Cache:
        """The registered KV cache (after ``start``)."""
        assert self._cache is not None, "the node is not started"
        return self._cache

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the loop, the engine, the registration and the control port (blocking).

        :raises ValueError: a setting the engine refuses, or the runtime the layout needs is
            not the one ``AIO_DATADIST_RUNTIME`` selects.
        :raises LLMException: the engine could not start (the address is in use, say).
        :raises ControlError: the control port cannot be opened.
        """
        self._choose_runtime()
        if self.config.link_secret is not None:
            self._secret = LinkSecret(self.config.link_secret)
        else:
            self._secret = secret_from_environment()
        self.loop.start()
        try:
            self.loop.run(self._start(), timeout_s)
        except BaseException:
            self.close()
            raise

    def _choose_runtime(self) -> None:
        """The engine's DEVICE placement must be the memory the KV lives in."""
        wanted = "host" if self.layout.device == "cpu" else self.layout.device
        chosen = os.environ.get(RUNTIME_ENV, "").strip().lower()
        if chosen in ("", "auto"):
            os.environ[RUNTIME_ENV] = wanted
        elif chosen != wanted:
            raise ValueError(
                f"the KV cache is in {self.layout.device} memory, which the {wanted} runtime "
                f"serves, but {RUNTIME_ENV}={chosen}"
            )

    async def _start(self) -> None:
        config = self.config
        ip = socket.gethostbyname(config.host)
        data_port = config.rank_port(config.data_port, self.rank)
        dd = AsyncLLMDataDist(self.role, self.cluster_id)
        device_id = self.layout.device_index if self.layout.device != "cpu" else 0
        options = config.llm_config(listen=f"{ip}:{data_port}", device_id=device_id)
        await dd.init(options.generate_options())
        self._dd = dd
        self._cache = await dd.cache_manager.register_blocks_cache(
            self.layout.cache_desc(),
            list(self.layout.addrs),
            BlocksCacheKey(self.cluster_id, 0),
            remote_accessible=True,
        )
        self._identity = Identity(
            engine_id=self.engine_id,
            rank=self.rank,
            tp_size=self.tp_size,
            cluster_id=self.cluster_id,
            data=dd.listen_address,
            layout=self.layout.describe(),
        )
        self._server = ControlServer(self._identity, self._secret, self.producer, self.log)
        self.control_address = await self._server.start(
            config.host, config.rank_port(config.port, self.rank)
        )
        self.log.info(
            "kv.node_started",
            engine=self.engine_id,
            rank=self.rank,
            control=f"{self.control_address[0]}:{self.control_address[1]}",
            data=f"{ip}:{dd.listen_address[1] if dd.listen_address else '-'}",
            kv_bytes=self.layout.region_bytes * len(self.layout.addrs),
        )

    def close(self) -> None:
        """Stop everything ``start`` started (blocking); registered memory stays the
        engine's."""
        if self.loop.loop.is_closed():
            return
        with contextlib.suppress(TimeoutError, RuntimeError):
            if self._dd is not None or self._server is not None:
                self.loop.run(self._close(), 30.0)
        self.loop.stop()

    async def _close(self) -> None:
        await self.producer.close()
        if self._server is not None:
            await self._server.close()
        for peer in list(self._peers.values()):
            await peer.client.close()
        self._peers.clear()
        if self._dd is not None:
            await self._dd.finalize()
            self._dd = None

    def busy(self) -> bool:
        """Whether a load, a push or a held request is in flight (read from any thread;
        a snapshot)."""
        return self.consumer.in_flight > 0 or self.producer.holding

    def stats(self) -> DataDistStats | None:
        """The engine's ``stats()`` (any thread); None before ``start`` or after ``close``."""
        dd = self._dd
        if dd is None:
            return None
        try:
            return dd.stats()
        except RuntimeError:
            return None

    # -- peers ------------------------------------------------------------------------------
    async def peer(self, address: tuple[str, int]) -> Peer:
        """The peer at control ``address``, connected, checked and linked (once; kept).

        :raises ControlError: unreachable, refused, or its KV layout or TP size differs.
        """
        peer = self._peers.get(address)
        if peer is not None and not peer.client.closed:
            return peer
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            peer = self._peers.get(address)
            if peer is not None and not peer.client.closed:
                return peer
            peer = await self._connect(address)
            self._peers[address] = peer
            return peer

    async def _connect(self, address: tuple[str, int]) -> Peer:
        assert self._identity is not None
        client = await ControlClient.connect(
            address[0],
            address[1],
            self._identity,
            self._secret,
            self.config.connect_timeout_s,
            self.consumer.on_notice,
            self._lost,
        )
        try:
            them = client.peer
            reason = self.layout.mismatch(them.layout)
            if reason is None and them.tp_size != self.tp_size:
                reason = (
                    f"the peer runs tensor parallel size {them.tp_size} and this node "
                    f"{self.tp_size}; both must be the same"
                )
            if reason is None and them.rank != self.rank:
                reason = f"the peer is TP rank {them.rank}, this node rank {self.rank}"
            if reason is None and them.data is None:
                reason = "the peer does not listen for transfer links"
            if reason is not None:
                self.log.error("kv.peer_refused", peer=f"{address[0]}:{address[1]}", reason=reason)
                raise ControlError(f"refused {address[0]}:{address[1]}: {reason}")
            assert them.data is not None
            info = LLMClusterInfo()
            info.remote_cluster_id = them.cluster_id
            info.append_local_ip_info(socket.gethostbyname(self.config.host), 0)
            info.append_remote_ip_info(them.data[0], them.data[1])
            timeout_ms = int(self.config.connect_timeout_s * 1000)
            _, rets = await self.dd.link_clusters([info], timeout_ms)
            if rets[0] not in (LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK):
                raise ControlError(
                    f"cannot link to {them.data[0]}:{them.data[1]}: {rets.errors[0] or rets[0]}"
                )
        except BaseException:
            await client.close()
            raise
        return Peer(address, client, info)

    def _lost(self, client: ControlClient, error: ControlError) -> None:
        for address, peer in list(self._peers.items()):
            if peer.client is client:
                del self._peers[address]
                self.consumer.on_peer_lost(peer, error)
                self.loop.spawn(self._unlink(peer), "unlink")

    async def drop(self, peer: Peer, reason: str) -> None:
        """Forget ``peer`` and drop the transfer link to it (so that nothing more moves on
        it); the next load reconnects."""
        self.log.warning(
            "kv.peer_dropped", peer=f"{peer.address[0]}:{peer.address[1]}", reason=reason
        )
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        await peer.client.close()
        await self._unlink(peer)

    async def _unlink(self, peer: Peer) -> None:
        dd = self._dd
        if dd is None:
            return
        with contextlib.suppress(LLMException, RuntimeError):
            await dd.unlink_clusters([peer.link], 5000, force=True)

    async def pull(self, peer: Peer, src: list[int], dst: list[int]) -> None:
        """Pull blocks ``src`` of ``peer``'s KV into local blocks ``dst``, every layer.

        :raises LLMException: the engine's failure (a broken link also drops the peer).
        """
        try:
            await self.dd.cache_manager.pull_blocks(
                BlocksCacheKey(peer.cluster_id, 0), self.cache, src, dst
            )
        except LLMException as exc:
            if exc.status_code in _LINK_BROKEN:
                await self.drop(peer, f"pull failed: {exc}")
            raise
