"""The prefill side of a node: blocks held for decodes, and pushes into their blocks.

**Pull.** When a request that a remote decode continues finishes here, the engine
:meth:`~Producer.offer`-s its blocks: they stay until the decode says it has them
(``release``) or ``abort_timeout`` passes, then the node reports them free. A decode first
``acquire``-s the request (which pins the offer against expiry while it reads, and answers the
blocks held), pulls them through the engine, then releases.

**Push.** A decode ``expect``-s a transfer id with its own blocks. The engine plans each step
(:meth:`~Producer.plan_step`): for every push request in the step, the blocks its tokens so
far occupy. A request whose expectation is known is pushed layer by layer while the step
runs: one ``transfer_cache_async`` per request and step, its synchroniser the step's
:class:`~aio_datadist._connector.gate.LayerGate`. Blocks of steps that ended before the
expectation arrived are pushed when it does. A request's pushes run one after another, so a
block written again by a later step lands after its earlier copy. Once the prefill's last
step landed the node tells the decode (``pushed``); the request's blocks are then free like
a released offer. A decode that gives up ``cancel``-s, and the node stops before it answers.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aio_datadist._connector.control import ControlError, ControlRefusal, ServerConnection
from aio_datadist._connector.gate import GateSynchronizer, LayerGate
from aio_datadist.status import LLMException
from aio_datadist.types import BlocksCacheKey, TransferWithCacheKeyConfig

if TYPE_CHECKING:
    from aio_datadist._connector.node import KvNode

__all__ = ("PushChunk", "Producer")

#: How long an ``acquire`` waits for the engine to offer a request it has not offered yet
#: (the answer with the parameters can reach the decode before the engine's next step).
OFFER_WAIT_S = 10.0
_CANCEL_WAIT_S = 30.0
#: How many ended transfers the node remembers (a late ``expect`` of one is refused at once).
_ENDED_KEPT = 4096


@dataclass(frozen=True)
class PushChunk:
    """One step's part of a push request: its blocks so far and the tokens the step ends at."""

    request_id: str
    transfer_id: str
    #: Every block the request holds so far, in token order.
    block_ids: tuple[int, ...]
    #: Tokens of the prompt (what the decode loads).
    num_tokens: int
    #: Tokens computed once this step ends.
    end_token: int


@dataclass(eq=False)
class _Offer:
    request_id: str
    blocks: tuple[int, ...]
    num_tokens: int
    timer: asyncio.TimerHandle | None = None
    acquired: bool = False


@dataclass(eq=False)
class _Expectation:
    transfer_id: str
    connection: ServerConnection
    cluster_id: int
    #: The decode's blocks for block indices ``skip`` onwards.
    blocks: tuple[int, ...]
    skip: int
    num_tokens: int
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class _Push:
    request_id: str
    transfer_id: str
    num_tokens: int
    blocks: tuple[int, ...] = ()
    #: Tokens whose steps ended (their KV is complete in every layer).
    ready: int = 0
    #: Tokens whose blocks a push was started for.
    pushed: int = 0
    expectation: _Expectation | None = None
    #: The latest push of the request; each waits for the one before.
    last: asyncio.Task[None] | None = None
    tasks: list[Any] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    nbytes: int = 0
    error: str | None = None
    #: Ended, well (``error`` None) or not; the decode is told once the pushes settled.
    done: bool = False
    #: The decode cancelled: it is not told.
    cancelled: bool = False
    #: The engine finished the request and holds its blocks for us (``offer``).
    offered: bool = False
    #: The engine dropped the request (``forget``): it holds nothing for us.
    forgotten: bool = False


class Producer:
    """The prefill side of one node (everything on the node's loop)."""

    def __init__(self, node: KvNode) -> None:
        self._node = node
        self._offers: dict[str, _Offer] = {}
        self._offered: dict[str, asyncio.Event] = {}
        self._pushes: dict[str, _Push] = {}  # by request id
        self._by_transfer: dict[str, _Push] = {}
        self._expected: dict[str, _Expectation] = {}  # expectations of unknown transfers
        self._gates: dict[int, tuple[LayerGate, list[PushChunk]]] = {}
        #: Why recent requests and transfers ended, so that a decode asking late is refused
        #: at once (request ids and transfer ids do not collide: P makes one, D the other).
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()

    @property
    def holding(self) -> bool:
        """Whether requests are held for decodes or pushes run (a snapshot, any thread)."""
        return bool(self._offers or self._pushes)

    # -- offers (pull and push) -----------------------------------------------------------
    def offer(
        self,
        request_id: str,
        blocks: tuple[int, ...],
        num_tokens: int,
        transfer_id: str | None = None,
    ) -> None:
        """The engine finished ``request_id`` and holds ``blocks`` for a remote decode until
        it is released, pushed (``transfer_id`` names a push), or ``abort_timeout`` passes."""
        if transfer_id is not None and request_id not in self._pushes:
            # A push none of whose steps was planned here: every block is ready.
            late = _Push(request_id, transfer_id, num_tokens, blocks=blocks, ready=num_tokens)
            self._pushes[request_id] = late
            self._by_transfer[transfer_id] = late
            waiting = self._expected.pop(transfer_id, None)
            if waiting is not None:
                self._attach(late, waiting)
        offer = _Offer(request_id, blocks, num_tokens)
        offer.timer = asyncio.get_running_loop().call_later(
            self._node.config.abort_timeout_s, self._expire, request_id
        )
        old = self._offers.pop(request_id, None)
        if old is not None and old.timer is not None:
            old.timer.cancel()
        self._offers[request_id] = offer
        push = self._pushes.get(request_id)
        if push is not None:  # a push request: free once its pushes ended
            push.offered = True
            self._release_if_done(push)
            return
        event = self._offered.pop(request_id, None)
        if event is not None:
            event.set()

    def _expire(self, request_id: str) -> None:
        offer = self._offers.get(request_id)
        if offer is None:
            return
        self._node.log.warning(
            "kv.offer_expired",
            request=request_id,
            acquired=offer.acquired,
            timeout_s=self._node.config.abort_timeout_s,
        )
        self._node.counters.add("expired")
        push = self._pushes.get(request_id)
        if push is not None and not push.done:
            self._finish(push, "the decode did not take the KV before the abort timeout")
            return  # freed once the pushes in flight settled
        self._free(request_id, "freed at the abort timeout")

    def _free(self, request_id: str, why: str = "released") -> None:
        """The decode is done with ``request_id`` (or did not come): its blocks may go."""
        offer = self._offers.pop(request_id, None)
        if offer is None:
            return
        if offer.timer is not None:
            offer.timer.cancel()
        self._remember(request_id, why)
        self._node.outcomes.sent(request_id)

    def _remember(self, key: str, why: str) -> None:
        """Keep why ``key`` (a request or a transfer) ended, for a decode that asks late."""
        self._ended[key] = why
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    def forget(self, request_id: str) -> None:
        """The engine dropped ``request_id`` (aborted) and holds nothing for it; a decode
        expecting its push is told."""
        push = self._pushes.get(request_id)
        if push is not None:
            push.forgotten = True
            self._finish(push, "the prefill request was aborted")
            self._release_if_done(push)

    # -- control requests -----------------------------------------------------------------
    async def on_request(
        self, connection: ServerConnection, op: str, message: dict[str, Any]
    ) -> dict[str, Any]:
        """Answer a decode's request (see the module docstring)."""
        if op == "acquire":
            return await self._acquire(str(message.get("request")))
        if op == "release":
            request_id = str(message.get("request"))
            if request_id in self._offers and request_id not in self._pushes:
                self._node.counters.add("released")
                self._free(request_id)
            return {}
        if op == "expect":
            return self._expect(connection, message)
        if op == "cancel":
            await self._cancel(str(message.get("transfer")))
            return {}
        raise ControlRefusal(f"unknown request {op!r}")

    def on_disconnect(self, connection: ServerConnection) -> None:
        """A decode's control connection is gone: stop pushing to it."""
        for push in list(self._pushes.values()):
            expectation = push.expectation
            if expectation is not None and expectation.connection is connection:
                self._finish(push, "the decode's control connection closed")
        for transfer_id, expectation in list(self._expected.items()):
            if expectation.connection is connection:
                self._drop_expectation(transfer_id)

    async def _acquire(self, request_id: str) -> dict[str, Any]:
        offer = self._offers.get(request_id)
        ended = self._ended.get(request_id)
        if offer is None and ended is not None:
            raise ControlRefusal(f"request {request_id} is not held here any more: {ended}")
        if offer is None:
            event = self._offered.setdefault(request_id, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), OFFER_WAIT_S)
            self._offered.pop(request_id, None)
            offer = self._offers.get(request_id)
        if offer is None or request_id in self._pushes:
            raise ControlRefusal(
                f"request {request_id} is not held here (freed at the abort timeout, "
                "released already, or never prefilled here)"
            )
        if not offer.acquired:
            offer.acquired = True
            if offer.timer is not None:  # pinned while the decode reads: a longer bound
                offer.timer.cancel()
            offer.timer = asyncio.get_running_loop().call_later(
                self._node.config.abort_timeout_s + self._node.config.load_timeout_s,
                self._expire,
                request_id,
            )
        return {"blocks": list(offer.blocks), "num_tokens": offer.num_tokens}

    def _expect(self, connection: ServerConnection, message: dict[str, Any]) -> dict[str, Any]:
        try:
            transfer_id = str(message["transfer"])
            expectation = _Expectation(
                transfer_id=transfer_id,
                connection=connection,
                cluster_id=int(message["cluster"]),
                blocks=tuple(int(b) for b in message["blocks"]),
                skip=int(message["skip"]),
                num_tokens=int(message["num_tokens"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ControlRefusal(f"malformed expect ({exc!r})") from None
        push = self._by_transfer.get(transfer_id)
        ended = self._ended.get(transfer_id)
        if push is None and ended is not None:
            raise ControlRefusal(f"transfer {transfer_id} has ended: {ended}")
        if push is None:
            # The prefill has not started this request yet: keep it until it does.
            if transfer_id in self._expected:
                raise ControlRefusal(f"transfer {transfer_id} is expected already")
            expectation.timer = asyncio.get_running_loop().call_later(
                self._node.config.abort_timeout_s, self._drop_expectation, transfer_id
            )
            self._expected[transfer_id] = expectation
            return {}
        if push.expectation is not None or push.done:
            raise ControlRefusal(f"transfer {transfer_id} is expected already or has ended")
        self._attach(push, expectation)
        return {}

    def _drop_expectation(self, transfer_id: str) -> None:
        expectation = self._expected.pop(transfer_id, None)
        if expectation is not None and expectation.timer is not None:
            expectation.timer.cancel()

    def _attach(self, push: _Push, expectation: _Expectation) -> None:
        if expectation.timer is not None:
            expectation.timer.cancel()
        push.expectation = expectation
        if expectation.num_tokens != push.num_tokens:
            self._finish(
                push,
                f"the decode expects {expectation.num_tokens} tokens and the prefill has "
                f"{push.num_tokens} (not the same prompt?)",
            )
            return
        self._push_ready(push)
        self._join_running_step(push)

    def _join_running_step(self, push: _Push) -> None:
        """The expectation arrived while a step computing this request runs: push its part
        now, each layer as that step's gate opens it (layers already written go at once), so
        that the rest of the step still overlaps the transfer."""
        for gate, chunks in self._gates.values():
            for chunk in chunks:
                if chunk.request_id == push.request_id and chunk.end_token > push.pushed:
                    self._start(push, push.pushed, chunk.end_token, gate)
                    push.pushed = chunk.end_token

    async def _cancel(self, transfer_id: str) -> None:
        self._drop_expectation(transfer_id)
        push = self._by_transfer.get(transfer_id)
        if push is None:
            return
        push.cancelled = True
        self._finish(push, "the decode cancelled the transfer")
        last = push.last
        if last is not None:  # answer once nothing more will be written
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(last), _CANCEL_WAIT_S)

    # -- pushes ---------------------------------------------------------------------------
    def plan_step(self, step: int, gate: LayerGate, chunks: list[PushChunk]) -> None:
        """A step that computes ``chunks`` is about to run; ``gate`` opens its layers."""
        self._gates[step] = (gate, chunks)
        for chunk in chunks:
            push = self._pushes.get(chunk.request_id)
            if push is None:
                push = _Push(chunk.request_id, chunk.transfer_id, chunk.num_tokens)
                self._pushes[chunk.request_id] = push
                self._by_transfer[chunk.transfer_id] = push
            push.blocks = chunk.block_ids
            waiting = self._expected.pop(chunk.transfer_id, None)
            if waiting is not None and push.expectation is None:
                self._attach(push, waiting)  # pushes this step's part too
            elif push.expectation is not None and not push.done and chunk.end_token > push.pushed:
                self._start(push, push.pushed, chunk.end_token, gate)
                push.pushed = chunk.end_token

    def end_step(self, step: int, ok: bool) -> None:
        """The step ended (``ok``: its forward ran, so its layers are all written)."""
        entry = self._gates.pop(step, None)
        if entry is None:
            return
        gate, chunks = entry
        gate.close(ok=ok)
        for chunk in chunks:
            push = self._pushes.get(chunk.request_id)
            if push is None or push.done:
                continue
            if not ok:
                self._finish(push, "the prefill step failed")
                continue
            push.ready = max(push.ready, chunk.end_token)
            self._push_ready(push)

    def _push_ready(self, push: _Push) -> None:
        """Push what ended and was not pushed yet; once the whole prompt was pushed, finish
        when the last push lands."""
        if push.expectation is None or push.done:
            return
        if push.ready > push.pushed:
            gate = LayerGate.open(self._node.layout.num_layers)
            self._start(push, push.pushed, push.ready, gate)
            push.pushed = push.ready
        if push.ready >= push.num_tokens and not push.done:
            self._node.loop.spawn(self._finish_after(push, push.last), "push-finish")

    async def _finish_after(self, push: _Push, last: asyncio.Task[None] | None) -> None:
        if last is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(last)
        if push.last is last:
            self._finish(push, None)

    def _start(self, push: _Push, start_token: int, end_token: int, gate: LayerGate) -> None:
        expectation = push.expectation
        assert expectation is not None
        size = self._node.layout.block_size
        first = max(start_token // size, expectation.skip)
        src: list[int] = []
        dst: list[int] = []
        for index in range(first, -(-end_token // size)):
            at = index - expectation.skip
            if index >= len(push.blocks) or at >= len(expectation.blocks):
                side = "prefill" if index >= len(push.blocks) else "decode"
                self._finish(push, f"block {index} of the request has no {side} block")
                return
            src.append(push.blocks[index])
            dst.append(expectation.blocks[at])
        if src:
            push.last = self._node.loop.spawn(
                self._run_push(push, expectation.cluster_id, src, dst, gate, push.last), "push"
            )

    async def _run_push(
        self,
        push: _Push,
        cluster_id: int,
        src: list[int],
        dst: list[int],
        gate: LayerGate,
        previous: asyncio.Task[None] | None,
    ) -> None:
        if previous is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(previous)
        if push.done:
            return
        node = self._node
        layers = node.layout.num_layers
        key = BlocksCacheKey(cluster_id, 0)
        try:
            task = node.dd.cache_manager.transfer_cache_async(
                node.cache,
                GateSynchronizer(gate),
                [TransferWithCacheKeyConfig(key, range(0, layers), range(0, layers))],
                src_block_indices=src,
                dst_block_indices=dst,
                tensor_num_per_layer=node.layout.tensors_per_layer,
            )
            push.tasks.append(task)
            await task
            push.nbytes += len(src) * node.layout.bytes_per_block
        except asyncio.CancelledError:
            self._finish(push, "the push was cancelled")
        except LLMException as exc:
            self._finish(push, f"{type(exc).__name__}: {exc}")

    def _finish(self, push: _Push, error: str | None) -> None:
        """End ``push`` (well when ``error`` is None); the decode hears of it once every
        push in flight settled, and the blocks go once the engine offered them."""
        if push.done:
            return
        push.done, push.error = True, error
        if error is not None:
            for task in push.tasks:
                task.cancel()  # stops before the next layer
        self._node.loop.spawn(self._settle(push), "push-settle")

    async def _settle(self, push: _Push) -> None:
        last = push.last
        if last is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(last)
        expectation = push.expectation
        counters = self._node.counters
        if push.error is None:
            counters.push(time.monotonic() - push.started, push.nbytes)
        elif expectation is not None:
            counters.add("push_failures")
            self._node.log.warning(
                "kv.push_failed",
                request=push.request_id,
                transfer=push.transfer_id,
                error=push.error,
            )
        if expectation is not None and not push.cancelled:
            message = {
                "op": "pushed",
                "transfer": push.transfer_id,
                "ok": push.error is None,
                "error": push.error,
            }
            with contextlib.suppress(ControlError):
                await expectation.connection.send(message)
        push.last = None
        self._release_if_done(push)

    def _release_if_done(self, push: _Push) -> None:
        """Forget an ended push; free its blocks when the engine holds them for us (an
        aborted request's blocks are the engine's again already)."""
        if not push.done or push.last is not None:
            return
        if push.offered or push.forgotten:
            self._pushes.pop(push.request_id, None)
            self._by_transfer.pop(push.transfer_id, None)
            self._remember(push.transfer_id, push.error or "pushed")
        if push.offered:
            self._free(push.request_id)

    async def close(self) -> None:
        """Cancel the pushes in flight and every timer (at shut-down)."""
        for push in list(self._pushes.values()):
            for task in push.tasks:
                task.cancel()
        for offer in self._offers.values():
            if offer.timer is not None:
                offer.timer.cancel()
        for expectation in self._expected.values():
            if expectation.timer is not None:
                expectation.timer.cancel()
