"""Bytes moved through a rank-table domain's device communicator instead of the link.

When ``link`` builds a communication domain on a runtime with a collective library (HCCL
on Ascend), every member binds its pools and remote-accessible caches to its communicator.
A request between two members whose local rows lie in that bound memory then names those
rows in its access (``Access.deliver``): the serving side resolves and checks its own rows
exactly as for any request, and moves the bytes one-sided through the communicator: it
writes the requester's rows for a pull (``HcclBatchPut``) and reads them for a push
(``HcclBatchGet``). The link carries only the request and its answer; no payload crosses
it and nothing is staged through host buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aio_datadist._memory.rows import pair_rows
from aio_datadist._runtime.base import Communicator
from aio_datadist._transport.base import Iov, RequestKind
from aio_datadist.status import LLMStatusCode, ParamInvalidError

__all__ = ("CommRoute", "CommRoutes", "deliver")


@dataclass(frozen=True, eq=False)
class CommRoute:
    """The way to one member of a domain through this rank's communicator."""

    communicator: Communicator
    peer_rank: int

    def takes(self, local: Iov) -> bool:
        """True when the requester's ``local`` rows may be named in a request (they lie in
        memory bound to the communicator)."""
        return self.communicator.covers(local)


#: Routes by the member's cluster id; shared by the requesting and the serving side.
CommRoutes = dict[int, CommRoute]


def deliver(route: CommRoute, kind: RequestKind, served: Iov, requester: Iov) -> None:
    """Move a request's bytes between the serving side's rows ``served`` and the requester's
    rows ``requester`` through the communicator; done on return.

    :raises LLMException: ``LLM_PARAM_INVALID`` when the two sides differ in size, or as the
        communicator's library reports.
    """
    pull = kind is RequestKind.PULL
    try:
        ops = pair_rows(requester, served) if pull else pair_rows(served, requester)
    except ValueError as exc:
        raise ParamInvalidError(
            f"the request does not match the cache here: {exc}",
            status_code=LLMStatusCode.LLM_PARAM_INVALID,
        ) from None
    # (dst, src, n) ops as (local, remote, n): a pull writes ours (src) to theirs (dst).
    rows = np.ascontiguousarray(ops[:, [1, 0, 2]] if pull else ops)
    route.communicator.transfer(route.peer_rank, rows, get=not pull)
