"""What the scheduler side tells the workers each step, and what a worker tells the
scheduler side once at start. Plain dataclasses: vLLM pickles them between processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

from aio_datadist._connector.producer import PushChunk

__all__ = ("AioConnectorMetadata", "AioHandshake", "LoadSpec")


@dataclass(frozen=True)
class LoadSpec:
    """A request whose KV a decode worker loads."""

    request_id: str
    #: The request's ``kv_transfer_params`` (where the KV is).
    params: dict[str, Any]
    #: Local blocks to fill: the request's blocks from index ``skip`` on.
    blocks: list[int]
    #: Leading blocks already here (local prefix cache hits).
    skip: int
    #: Prompt tokens the load covers.
    num_tokens: int


@dataclass
class AioConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers."""

    #: Prefill side: finished requests whose blocks are held for a decode, by request id:
    #: (blocks, tokens computed, the push's transfer id or None).
    offers: dict[str, tuple[list[int], int, str | None]] = field(default_factory=dict)
    #: Prefill side: push requests dropped before they finished.
    forget: list[str] = field(default_factory=list)
    #: Prefill side: this step's part of each push request it computes.
    push_chunks: list[PushChunk] = field(default_factory=list)
    #: Decode side: loads to start.
    loads: list[LoadSpec] = field(default_factory=list)
    #: Decode side: requests dropped before their load (``kv_transfer_params`` of each).
    abandon: list[dict[str, Any]] = field(default_factory=list)
    #: The step computes nothing (vLLM steps on to collect transfers).
    idle: bool = False


@dataclass
class AioHandshake(KVConnectorHandshakeMetadata):
    """Where a worker's control channel listens."""

    host: str
    port: int
    rank: int
