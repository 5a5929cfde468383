"""The communicator route: device rows between members of a rank-table domain, moved by the
serving side through the domain's communicator (``domain``)."""

from __future__ import annotations

import dataclasses

from aio_datadist._engine.access import NO_ROWS, encode_access
from aio_datadist._engine.request import Completion, Transfer, completed
from aio_datadist._engine.routes import Route, send_request
from aio_datadist._routes.hccl.domain import CommRoute
from aio_datadist._transport.base import Channel

__all__ = ("CommunicatorRoute",)


class CommunicatorRoute(Route):
    """Device rows between members of a rank-table domain: the request names them and the
    serving side moves the bytes through the domain's communicator; the link carries only
    the request and its answer."""

    name = "communicator"
    rank = 20

    def __init__(self, channel: Channel, member: CommRoute) -> None:
        self.channel = channel
        self.member = member

    def link(self) -> Channel | None:
        return self.channel

    def accepts(self, transfer: Transfer) -> bool:
        return transfer.device and self.member.takes(transfer.rows)

    def in_caller(self, transfer: Transfer) -> bool:
        return False

    def start(self, transfer: Transfer, deadline_ns: int) -> Completion | None:
        body = encode_access(dataclasses.replace(transfer.access, deliver=transfer.rows))
        future = send_request(self.channel, transfer, body, NO_ROWS, 0, deadline_ns)
        return completed(future, deadline_ns, self.channel)
