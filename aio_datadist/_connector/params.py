"""``kv_transfer_params``: what a prefill's answer tells the decode that continues it.

The convention is vLLM's (and NixlConnector's): the client (a proxy) sends a request to the
prefill instance (P) with ``{"do_remote_decode": true}``; P's answer carries the parameters
below, and the same request sent to the decode instance (D) with them verbatim loads P's KV
instead of recomputing it. In push mode a proxy may instead send both requests at once with a
shared ``transfer_id``, D's naming P's address (:meth:`RemoteSource.from_params` accepts
both).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aio_datadist._connector.config import MODE_PULL, MODE_PUSH, MODES

__all__ = ("CONNECTOR_NAME", "PARAMS_VERSION", "RemoteSource", "producer_params")

#: Names this connector in the parameters, so that a D of another connector refuses them.
CONNECTOR_NAME = "aio_datadist"
#: Bumped on an incompatible change of the parameters or the control protocol.
PARAMS_VERSION = 1


def producer_params(
    *,
    engine_id: str,
    request_id: str,
    ranks: Sequence[tuple[str, int]],
    block_ids: Sequence[int],
    num_tokens: int,
    tp_size: int,
    mode: str,
    transfer_id: str | None,
) -> dict[str, Any]:
    """The ``kv_transfer_params`` P returns for a request it prefilled for a remote decode."""
    host, port = ranks[0]
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_ranks": [[h, p] for h, p in ranks],
        "remote_block_ids": list(block_ids),
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "transfer_mode": mode,
        "transfer_id": transfer_id,
        "connector": CONNECTOR_NAME,
        "connector_version": PARAMS_VERSION,
    }


def _require(params: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    value = params.get(key)
    if value is None:
        raise ValueError(f"kv_transfer_params lacks {key}")
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"kv_transfer_params {key} is {value!r}")
    return value


@dataclass(frozen=True)
class RemoteSource:
    """Where a decode gets one request's KV: P's address per TP rank and what P holds."""

    mode: str
    host: str
    port: int
    ranks: tuple[tuple[str, int], ...]
    engine_id: str | None
    #: P's id of the request (pull mode).
    request_id: str | None
    #: The id P and D share for a push.
    transfer_id: str | None
    block_ids: tuple[int, ...]
    num_tokens: int | None
    tp_size: int | None

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemoteSource:
        """Read a decode request's ``kv_transfer_params``.

        :raises ValueError: a field missing or of the wrong kind, another connector's or
            version's parameters, a pull without P's request id, a push without a transfer id.
        """
        connector = params.get("connector", CONNECTOR_NAME)
        if connector != CONNECTOR_NAME:
            raise ValueError(f"kv_transfer_params are {connector!r}'s, not {CONNECTOR_NAME}'s")
        version = params.get("connector_version", PARAMS_VERSION)
        if version != PARAMS_VERSION:
            raise ValueError(
                f"kv_transfer_params are of connector version {version!r}; this decode speaks "
                f"version {PARAMS_VERSION} (run the same aio_datadist on both instances)"
            )
        mode = params.get("transfer_mode") or MODE_PULL
        if mode not in MODES:
            raise ValueError(f"kv_transfer_params transfer_mode {mode!r} is not one of {MODES}")
        host = _require(params, "remote_host", str)
        port = _require(params, "remote_port", int)
        raw_ranks = params.get("remote_ranks") or [[host, port]]
        try:
            ranks = tuple((str(h), int(p)) for h, p in raw_ranks)
        except (TypeError, ValueError):
            raise ValueError(f"kv_transfer_params remote_ranks is {raw_ranks!r}") from None
        blocks = params.get("remote_block_ids") or ()
        if isinstance(blocks, Sequence) and len(blocks) == 1 and isinstance(blocks[0], list):
            blocks = blocks[0]  # one KV cache group, given per group
        if not isinstance(blocks, Sequence) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks
        ):
            raise ValueError(f"kv_transfer_params remote_block_ids is {blocks!r}")
        request_id = params.get("remote_request_id")
        transfer_id = params.get("transfer_id")
        if mode == MODE_PULL and not isinstance(request_id, str):
            raise ValueError("kv_transfer_params lacks remote_request_id (needed to pull)")
        if mode == MODE_PUSH and not isinstance(transfer_id, str):
            raise ValueError("kv_transfer_params lacks transfer_id (needed for a push)")
        tp_size = params.get("tp_size")
        num_tokens = params.get("remote_num_tokens")
        return cls(
            mode=mode,
            host=host,
            port=port,
            ranks=ranks,
            engine_id=params.get("remote_engine_id"),
            request_id=request_id if isinstance(request_id, str) else None,
            transfer_id=transfer_id if isinstance(transfer_id, str) else None,
            block_ids=tuple(blocks),
            num_tokens=num_tokens if isinstance(num_tokens, int) else None,
            tp_size=tp_size if isinstance(tp_size, int) else None,
        )

    def address(self, rank: int) -> tuple[str, int]:
        """P's control address for TP rank ``rank``.

        :raises ValueError: P named fewer ranks.
        """
        if rank < len(self.ranks):
            return self.ranks[rank]
        raise ValueError(f"the prefill names {len(self.ranks)} TP rank(s); this is rank {rank}")
