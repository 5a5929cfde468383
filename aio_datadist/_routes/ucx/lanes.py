"""Lanes of the UCX route: more UCX workers, each progressed by a thread of its own, so that
a large transfer's bytes move on several cores at once.

Over UCX's cross-memory transports (``cma``) the copy of a get or a put runs inside
``ucp_worker_progress`` of the initiator's worker, one piece at a time: one worker moves bytes
at the rate of one core. A transfer of at least :data:`LANE_MIN_BYTES` host bytes is cut into
as many parts of about equal size as the engine has lanes (by ``ucx.rma``, in one native
call that checks, cuts and starts every part: ``dd_ucx_transfer``): the first moves on
the engine's own worker as every transfer does (``_routes.ucx.route``), each other on a
:class:`UcxLane`'s worker through an endpoint of its own to the same peer, with remote keys
unpacked on that endpoint (``_routes.ucx.remote``).

The caller starts a lane's part itself (the lane's worker is ``UCS_THREAD_MODE_MULTI``) and
signals the lane's worker; the lane's thread, a native one (``dd_ucx_lane``: it never waits
for the GIL), asleep on that worker's event fd, wakes and progresses it until it is idle.
The completion that ends a part signals the engine's worker (``dd_ucx_count_notify``), so
whoever waits for the transfer, asleep on that worker's event fd or progressing it, sees it
complete. Smaller transfers stay on one worker: waking a thread costs more than their copy.

Only a transfer whose endpoint goes through a cross-memory transport is cut: over UCX's tcp
transport the kernel copies on both sides, and more workers only contend for the cores
(on one host, 2 vCPUs: blocking W2 0.8 to 1.1 GB/s cut in two, 1.4 to 2.1 on one worker).
"""

from __future__ import annotations

from aio_datadist._native.api import UcxLaneThread
from aio_datadist._routes.ucx.worker import UcxContext, UcxWorker

__all__ = ("CROSS_MEMORY", "LANE_MIN_BYTES", "MAX_LANES", "UcxLane")

#: The smallest transfer (bytes) cut into parts for the lanes.
LANE_MIN_BYTES = 1 << 20
#: UCX's cross-memory transports (one process reads and writes another's memory, the copy
#: in the initiator's progress): the transfers cut across the lanes are the ones that go
#: through one of these.
CROSS_MEMORY = frozenset({"cma", "knem", "xpmem"})
#: The most lanes an engine may have (``aio.UcxLanes``), its own worker included.
MAX_LANES = 8


class UcxLane:
    """A UCX worker of the engine's context and the native thread that progresses it."""

    def __init__(self, context: UcxContext, index: int, *, name: str) -> None:
        self.worker = UcxWorker(context, name=f"{name}-lane{index}")
        try:
            #: The thread that progresses the worker (``_native.api.UcxCalls.lane``).
            self.thread: UcxLaneThread = self.worker._calls.lane(
                self.worker._word, self.worker.event_fd()
            )
        except BaseException:
            self.worker.close()
            raise

    def close(self) -> None:
        """Stop the thread and destroy the worker (after the endpoints on it closed)."""
        self.thread.stop()
        self.worker.close()
