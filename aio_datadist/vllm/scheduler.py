"""The scheduler side of the connector: which requests load, which wait for a decode, and
what the workers do each step. No I/O here; the workers move and talk.

As NixlConnector does: a request with ``do_remote_decode`` finishes on the prefill (P) with
its blocks held (``request_finished`` returns True and the parameters a decode needs); a
request with ``do_remote_prefill`` on the decode (D) loads every prompt token P computed
(``get_num_new_matched_tokens``), asynchronously, into the blocks vLLM allocates for it.
In push mode P also sends, each step, the blocks a push request's tokens occupy so far.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aio_datadist._connector.config import MODE_PUSH, MODES, ConnectorConfig
from aio_datadist._connector.params import RemoteSource, producer_params
from aio_datadist._connector.producer import PushChunk
from aio_datadist._log import get_logger
from aio_datadist.vllm.metadata import AioConnectorMetadata, AioHandshake, LoadSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ("SchedulerSide",)

_log = get_logger("connector", under="vllm.aio_datadist")


class _PushRequest:
    __slots__ = ("blocks", "num_tokens", "transfer_id")

    def __init__(self, transfer_id: str, num_tokens: int) -> None:
        self.transfer_id = transfer_id
        self.num_tokens = num_tokens
        self.blocks: list[int] = []


def _mode(params: dict[str, Any], default: str) -> str:
    mode = params.get("transfer_mode") or default
    return mode if mode in MODES else default


class SchedulerSide:
    """Scheduler-side state of one engine."""

    def __init__(self, vllm_config: VllmConfig, config: ConnectorConfig, engine_id: str) -> None:
        self._config = config
        self._engine_id = engine_id
        self._block_size = int(vllm_config.cache_config.block_size)
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._ranks: list[tuple[str, int]] = []
        self._meta = AioConnectorMetadata()
        self._pushes: dict[str, _PushRequest] = {}
        self._warned_pull = False

    # -- start ------------------------------------------------------------------------------
    def set_handshakes(self, handshakes: dict[int, Any]) -> None:
        """The workers' control addresses, by TP rank."""
        ranks = {}
        for rank, handshake in handshakes.items():
            if isinstance(handshake, AioHandshake):
                ranks[rank] = (handshake.host, handshake.port)
        self._ranks = [ranks[r] for r in sorted(ranks)]

    # -- decode side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """D: every prompt token past the local prefix hit loads from P, asynchronously."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """D: the blocks a load fills are allocated; the load starts next step. P: a push
        request is scheduled."""
        params = request.kv_transfer_params
        if not params:
            return
        if params.get("do_remote_decode") and _mode(params, self._config.mode) == MODE_PUSH:
            transfer_id = params.get("transfer_id")
            if isinstance(transfer_id, str) and request.request_id not in self._pushes:
                self._pushes[request.request_id] = _PushRequest(
                    transfer_id, request.num_prompt_tokens
                )
            elif not isinstance(transfer_id, str) and not self._warned_pull:
                self._warned_pull = True  # once: the proxy does not speak push
                _log.warning(
                    "kv.push_without_transfer_id",
                    request=request.request_id,
                    note="push mode needs a transfer_id in each request's kv_transfer_params "
                    "(as examples/vllm/proxy.py --mode push sends); requests without one "
                    "are served as pulls",
                )
            return
        if not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one load per request
        if num_external_tokens <= 0:  # all here already: P may free its blocks
            self._meta.abandon.append(dict(params, do_remote_prefill=True))
            return
        group = blocks.blocks[0] if blocks.blocks else []
        skip = 0
        while skip < len(group) and group[skip].block_hash is not None:
            skip += 1
        local = [b.block_id for b in group[skip:] if not b.is_null]
        self._meta.loads.append(
            LoadSpec(
                request_id=request.request_id,
                params=dict(params, do_remote_prefill=True),
                blocks=local,
                skip=skip,
                num_tokens=request.num_prompt_tokens,
            )
        )

    # -- each step --------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> AioConnectorMetadata:
        """This step's work for the workers (and a fresh slate for the next)."""
        meta, self._meta = self._meta, AioConnectorMetadata()
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        if self._pushes:
            self._push_chunks(scheduler_output, meta)
        return meta

    def _push_chunks(self, output: SchedulerOutput, meta: AioConnectorMetadata) -> None:
        scheduled = output.num_scheduled_tokens
        for new in output.scheduled_new_reqs:
            push = self._pushes.get(new.req_id)
            if push is not None:
                push.blocks = list(new.block_ids[0])
                self._chunk(meta, new.req_id, push, new.num_computed_tokens, scheduled)
        cached = output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            push = self._pushes.get(req_id)
            if push is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    push.blocks = list(new_blocks[0])
                else:
                    push.blocks.extend(new_blocks[0])
            self._chunk(meta, req_id, push, cached.num_computed_tokens[i], scheduled)

    def _chunk(
        self,
        meta: AioConnectorMetadata,
        req_id: str,
        push: _PushRequest,
        computed: int,
        scheduled: dict[str, int],
    ) -> None:
        end = min(computed + scheduled.get(req_id, 0), push.num_tokens)
        if computed >= push.num_tokens:
            return
        meta.push_chunks.append(
            PushChunk(req_id, push.transfer_id, tuple(push.blocks), push.num_tokens, end)
        )
        if end >= push.num_tokens:
            del self._pushes[req_id]  # its last chunk

    # -- end of a request -------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: hold the blocks of a request a decode continues, and say where they are. D: a
        request dropped before its load lets P free its blocks."""
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # dropped before it was scheduled here
            params["do_remote_prefill"] = False
            self._meta.abandon.append(dict(params))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        mode = _mode(params, self._config.mode)
        pushed = request.request_id in self._pushes or mode == MODE_PUSH
        self._pushes.pop(request.request_id, None)
        finished = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        if not finished or not block_ids:
            if pushed:
                self._meta.forget.append(request.request_id)
            return False, None
        if not self._ranks:
            _log.error(
                "kv.no_workers",
                request=request.request_id,
                note="the workers' control addresses are unknown; the blocks are freed",
            )
            if pushed:
                self._meta.forget.append(request.request_id)
            return False, None
        blocks = list(block_ids)
        transfer_id = params.get("transfer_id")
        if not isinstance(transfer_id, str) or mode != MODE_PUSH:
            transfer_id = None
        self._meta.offers[request.request_id] = (blocks, request.num_computed_tokens, transfer_id)
        return True, producer_params(
            engine_id=self._engine_id,
            request_id=request.request_id,
            ranks=self._ranks,
            block_ids=blocks,
            num_tokens=request.num_computed_tokens,
            tp_size=self._tp_size,
            mode=MODE_PUSH if transfer_id is not None else "pull",
            transfer_id=transfer_id,
        )

    def check_source(self, params: dict[str, Any]) -> RemoteSource | None:
        """Read a decode request's parameters; None (logged) when they are unusable."""
        try:
            return RemoteSource.from_params(params)
        except ValueError as exc:
            _log.error("kv.bad_params", error=str(exc))
            return None
