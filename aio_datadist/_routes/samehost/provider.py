"""The same-host provider: this engine's region board, offered at the handshake, and the
one-sided routes to a peer the kernel proved a process of this host."""

from __future__ import annotations

import threading
from dataclasses import replace

import structlog

from aio_datadist._engine.caches import CacheService
from aio_datadist._engine.regions import BoardArena, BoardEntry, RegionBoard
from aio_datadist._engine.registry import CacheEntry
from aio_datadist._engine.routes import placed
from aio_datadist._log import get_logger
from aio_datadist._routes.provider import LinkHandle, Opening, RouteProvider
from aio_datadist._routes.samehost.memory import PeerMemory, open_peer_memory
from aio_datadist._routes.samehost.route import DeviceIpcRoute, SameHostRoute
from aio_datadist._transport.base import Channel, Hello
from aio_datadist._transport.samehost import HostPresence, SameHostPeer, local_host_key
from aio_datadist.status import LLMException

__all__ = ("SameHostProvider", "open_same_host")


def open_same_host(opening: Opening) -> SameHostProvider | None:
    """The same-host provider; None when one-sided access is off, the transport is not TCP,
    or the host cannot make a board."""
    settings = opening.settings
    if not settings.same_host or (settings.transport or "tcp") != "tcp":
        return None
    log = get_logger("samehost", cluster_id=opening.cluster_id, role=opening.role)
    host_key = local_host_key()
    if host_key is None:
        return None
    try:
        board = RegionBoard()
    except OSError as exc:
        log.info("samehost.unavailable", reason=f"no region board: {exc}")
        return None
    return SameHostProvider(opening.caches, board, HostPresence(*host_key, board_fd=board.fd), log)


class SameHostProvider(RouteProvider):
    """Publishes this engine's reachable caches on a region board peers of this host map,
    and gives each proven same-host link its one-sided routes."""

    def __init__(
        self,
        caches: CacheService,
        board: RegionBoard,
        presence: HostPresence,
        log: structlog.stdlib.BoundLogger,
    ) -> None:
        self._caches = caches
        self._staging = caches.staging
        self.board = board
        self._presence = presence
        self._log = log
        self._lock = threading.Lock()
        self._memories: dict[Channel, PeerMemory] = {}
        self._tokens: dict[tuple[int, int], bytes | None] = {}
        self._closed = False
        caches.registry.add_listener(self._publish)

    # -- the board -----------------------------------------------------------------------
    def _publish(self) -> None:
        """Publish every reachable cache this side holds (registry lock held)."""
        if self._closed:
            return
        board = self.board
        was_full = board.overflowed
        live = [
            e for e in self._caches.registry.entries() if not e.released and e.remote_accessible
        ]
        for key in set(self._tokens) - {(e.cache_id, min(e.addrs, default=0)) for e in live}:
            del self._tokens[key]
        published = []
        for e in live:
            shared = self._token(e)
            if shared is not None:
                model_id = e.blocks_key.model_id if e.blocks_key is not None else -1
                published.append(
                    BoardEntry(
                        e.cache_id,
                        model_id,
                        e.row_bytes,
                        e.num_rows,
                        e.tensor_bytes,
                        e.addrs,
                        shared,
                        None if shared else self._arena(e),
                    )
                )
        board.publish(published)
        if board.overflowed and not was_full:
            self._log.warning("samehost.board_full", note="peers use the link for every transfer")

    def _token(self, e: CacheEntry) -> bytes | None:
        """b"" for host-readable memory; the runtime's sharing token for device memory
        (cached per cache); None when the entry cannot be published."""
        if not self._caches.on_device(e):
            return b""
        low, nbytes = _span(e)
        key = (e.cache_id, low)
        if key not in self._tokens:
            try:
                self._tokens[key] = self._caches.runtime.share(low, nbytes) if e.addrs else None
            except LLMException:
                self._tokens[key] = None
        return self._tokens[key]

    def _arena(self, e: CacheEntry) -> BoardArena | None:
        """The shared host memory holding a host-readable cache, which peers map."""
        return self._caches.runtime.host_share(*_span(e)) if e.addrs else None

    # -- links ---------------------------------------------------------------------------
    def offer(self, hello: Hello) -> Hello:
        """This side's handshake with its board, for a peer of this host to map."""
        return replace(hello, presence=self._presence)

    def attach(self, link: LinkHandle) -> None:
        """Add the one-sided routes once the transport proved the peer a process of this
        host (both ends offered a board)."""
        proof = link.channel.same_host
        if proof is not None:
            proof.then(lambda peer: self._proven(link, peer))

    def _proven(self, link: LinkHandle, peer: SameHostPeer) -> None:
        memory = open_peer_memory(peer, self._staging, link.log)
        if memory is None:
            return
        channel = link.channel
        with self._lock:
            if self._closed or channel in self._memories:
                memory.close()
                return
            self._memories[channel] = memory
        placing = (SameHostRoute(memory), DeviceIpcRoute(memory))
        if not link.place(lambda routes: placed(routes, placing, (SameHostRoute, DeviceIpcRoute))):
            self._forget(channel, memory)

    def detach(self, channel: Channel) -> None:
        """Stop the proof still in progress and the one-sided access of ``channel``."""
        if channel.same_host is not None:
            channel.same_host.close()
        with self._lock:
            memory = self._memories.get(channel)
        if memory is not None:
            self._forget(channel, memory)

    def _forget(self, channel: Channel, memory: PeerMemory) -> None:
        with self._lock:
            if self._memories.get(channel) is not memory:
                return
            del self._memories[channel]
        memory.close()

    def peer_memory(self, channel: Channel) -> PeerMemory | None:
        """The one-sided access of ``channel``'s link (None: its peer is not proven)."""
        with self._lock:
            return self._memories.get(channel)

    def close(self) -> None:
        """Stop publishing and unlink the board (the links closed already)."""
        with self._caches.registry.lock:
            self._closed = True
        with self._lock:
            memories, self._memories = list(self._memories.values()), {}
        for memory in memories:
            memory.close()
        self.board.close()


def _span(e: CacheEntry) -> tuple[int, int]:
    """``(start, nbytes)`` from the lowest tensor to the end of the highest."""
    low = min(e.addrs, default=0)
    return low, max(e.addrs, default=0) + e.tensor_bytes - low
