"""The decode side of a node: loading a request's KV from the prefill that computed it.

**Pull.** Reach P's node (control connection and transfer link, kept for later requests),
``acquire`` the request (P then holds its blocks while we read and answers which they are),
pull them into the local blocks with one ``pull_blocks`` of every layer, and ``release``.

**Push.** Tell P which local blocks take the request (``expect``) and wait for its ``pushed``
notice; P writes them layer by layer while it prefills. A decode that gives up first
``cancel``-s and waits for P's answer, which comes once nothing more will be written; when
that answer does not come, the transfer link to P is dropped before the blocks are given back.

Either way a load ends in the node's outcomes as received or failed, never silently: a failure
is logged once, naming the request, and its local blocks are reported so that the engine
recomputes (or fails) them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

from aio_datadist._connector.config import MODE_PULL
from aio_datadist._connector.control import ControlError
from aio_datadist._connector.params import RemoteSource
from aio_datadist.status import LLMException

if TYPE_CHECKING:
    from aio_datadist._connector.node import KvNode, Peer

__all__ = ("Consumer", "LoadError")

_SHORT_S = 5.0


class LoadError(Exception):
    """A load cannot go on; ``str()`` says why."""


class Consumer:
    """The decode side of one node (everything on the node's loop)."""

    def __init__(self, node: KvNode) -> None:
        self._node = node
        self._waiters: dict[str, tuple[asyncio.Future[dict[str, Any]], Peer]] = {}
        #: Loads started and not yet ended.
        self.in_flight = 0

    def load(
        self,
        request_id: str,
        source: RemoteSource,
        blocks: list[int],
        skip: int,
        num_tokens: int,
    ) -> None:
        """Load ``request_id``'s KV into ``blocks`` (its block indices ``skip`` onwards; the
        first ``skip`` blocks are here already); ``num_tokens`` is the prompt's length."""
        self.in_flight += 1
        task = self._node.loop.spawn(
            self._load(request_id, source, blocks, skip, num_tokens), "load"
        )
        task.add_done_callback(self._ended)

    def _ended(self, _: object) -> None:
        self.in_flight -= 1

    def abandon(self, source: RemoteSource) -> None:
        """This side dropped a request before loading it: let P free its blocks now."""
        self._node.loop.spawn(self._abandon(source), "abandon")

    async def _abandon(self, source: RemoteSource) -> None:
        with contextlib.suppress(ControlError, LoadError, ValueError):
            peer = await self._node.peer(source.address(self._node.rank))
            if source.mode == MODE_PULL:
                await peer.client.call("release", _SHORT_S, request=source.request_id)
            else:
                await peer.client.call("cancel", _SHORT_S, transfer=source.transfer_id)

    async def _load(
        self,
        request_id: str,
        source: RemoteSource,
        blocks: list[int],
        skip: int,
        num_tokens: int,
    ) -> None:
        node = self._node
        started = time.monotonic()
        try:
            if source.tp_size is not None and source.tp_size != node.tp_size:
                raise LoadError(
                    f"the prefill runs tensor parallel size {source.tp_size} and this decode "
                    f"{node.tp_size}; both must be the same"
                )
            peer = await node.peer(source.address(node.rank))
            if source.mode == MODE_PULL:
                nbytes = await self._pull(peer, source, blocks, skip, num_tokens)
            else:
                nbytes = await self._await_push(peer, source, blocks, skip, num_tokens)
        except Exception as exc:  # every failure ends the load, reported, never lost
            expected = isinstance(exc, (LoadError, ControlError, LLMException, ValueError))
            node.counters.add("load_failures")
            node.log.warning(
                "kv.load_failed",
                request=request_id,
                remote=f"{source.host}:{source.port}",
                mode=source.mode,
                blocks=len(blocks),
                error=f"{type(exc).__name__}: {exc}",
                exc_info=None if expected else exc,
            )
            node.outcomes.failed(request_id, blocks)
            return
        node.counters.load(time.monotonic() - started, nbytes)
        node.outcomes.received(request_id)

    async def _pull(
        self, peer: Peer, source: RemoteSource, blocks: list[int], skip: int, num_tokens: int
    ) -> int:
        node = self._node
        timeout = node.config.load_timeout_s
        lease = await peer.client.call("acquire", timeout, request=source.request_id)
        try:
            held = [int(b) for b in lease.get("blocks", ())]
            computed = int(lease.get("num_tokens", 0))
            needed = -(-num_tokens // node.layout.block_size) - skip
            if computed < num_tokens or needed > len(held) - skip or needed > len(blocks):
                raise LoadError(
                    f"the prefill holds {computed} tokens in {len(held)} block(s); this decode "
                    f"loads {num_tokens} tokens into {len(blocks)} block(s) after {skip} of its own"
                )
            if needed > 0:
                try:
                    await asyncio.wait_for(
                        node.pull(peer, held[skip : skip + needed], blocks[:needed]), timeout
                    )
                except TimeoutError:
                    raise LoadError(f"the pull took over load_timeout ({timeout:g} s)") from None
            return max(needed, 0) * node.layout.bytes_per_block
        finally:
            node.loop.spawn(self._release(peer, source), "release")

    async def _release(self, peer: Peer, source: RemoteSource) -> None:
        with contextlib.suppress(ControlError):
            await peer.client.call("release", _SHORT_S, request=source.request_id)

    async def _await_push(
        self, peer: Peer, source: RemoteSource, blocks: list[int], skip: int, num_tokens: int
    ) -> int:
        node = self._node
        transfer_id = source.transfer_id
        assert transfer_id is not None
        if not blocks:
            await peer.client.call("cancel", _SHORT_S, transfer=transfer_id)
            return 0
        notice: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[transfer_id] = (notice, peer)
        try:
            await peer.client.call(
                "expect",
                node.config.connect_timeout_s,
                transfer=transfer_id,
                cluster=node.cluster_id,
                blocks=blocks,
                skip=skip,
                num_tokens=num_tokens,
            )
            timeout = node.config.load_timeout_s
            try:
                result = await asyncio.wait_for(asyncio.shield(notice), timeout)
            except TimeoutError:
                await self._stop_push(peer, transfer_id)
                raise LoadError(f"no push within load_timeout ({timeout:g} s)") from None
            except ControlError:
                await node.drop(peer, "the control connection closed during a push")
                raise
        finally:
            self._waiters.pop(transfer_id, None)
        if not result.get("ok"):
            raise LoadError(f"the prefill's push failed: {result.get('error')}")
        return len(blocks) * node.layout.bytes_per_block

    async def _stop_push(self, peer: Peer, transfer_id: str) -> None:
        """Make sure P writes no more into blocks we are about to give back."""
        try:
            await peer.client.call(
                "cancel", self._node.config.connect_timeout_s, transfer=transfer_id
            )
        except ControlError:
            await self._node.drop(peer, "no answer to a push's cancel")

    def on_notice(self, message: dict[str, Any]) -> None:
        """A notice from a prefill (a push ended)."""
        if message.get("op") != "pushed":
            return
        waiter = self._waiters.get(str(message.get("transfer")))
        if waiter is not None and not waiter[0].done():
            waiter[0].set_result(message)

    def on_peer_lost(self, peer: Peer, error: ControlError) -> None:
        """``peer``'s control connection is gone: the pushes expected from it fail."""
        for future, owner in list(self._waiters.values()):
            if owner is peer and not future.done():
                future.set_exception(ControlError(str(error)))
