"""Lanes of the UCX route: more UCX workers, each progressed by a thread of its own, so that
a large transfer's bytes move on several cores at once.

Over UCX's cross-memory transports (``cma``) the copy of a get or a put runs inside
``ucp_worker_progress`` of the initiator's worker, one piece at a time: one worker moves bytes
at the rate of one core. A transfer of at least :data:`LANE_MIN_BYTES` host bytes is cut into
as many parts of about equal size as the engine has lanes (:func:`split`): the first moves on
the engine's own worker as every transfer does (``_engine.ucxroute``), each other on a
:class:`UcxLane`'s worker through an endpoint of its own to the same peer, with remote keys
unpacked on that endpoint (``_engine.ucxremote``).

The caller starts a lane's part itself (the lane's worker is ``UCS_THREAD_MODE_MULTI``) and
signals the lane's worker; the lane's thread, a native one (``dd_ucx_lane``: it never waits
for the GIL), asleep on that worker's event fd, wakes and progresses it until it is idle.
The completion that ends a part signals the engine's worker (``dd_ucx_count_notify``), so
whoever waits for the transfer, asleep on that worker's event fd or progressing it, sees it
complete. Smaller transfers stay on one worker: waking a thread costs more than their copy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from aio_datadist._native.api import UcxLaneThread
from aio_datadist._transport.ucx import UcxContext, UcxWorker

__all__ = ("LANE_MIN_BYTES", "MAX_LANES", "UcxLane", "split")

#: The smallest transfer (bytes) cut into parts for the lanes.
LANE_MIN_BYTES = 1 << 20
#: The most lanes an engine may have (``aio.UcxLanes``), its own worker included.
MAX_LANES = 8
#: Parts are cut at multiples of this many bytes (pages of the usual size).
_CUT_ALIGN = 4096


class UcxLane:
    """A UCX worker of the engine's context and the native thread that progresses it."""

    def __init__(self, context: UcxContext, index: int, *, name: str) -> None:
        self.worker = UcxWorker(context, name=f"{name}-lane{index}")
        try:
            self._thread: UcxLaneThread | None = self._start()
        except BaseException:
            self.worker.close()
            raise

    def _start(self) -> UcxLaneThread | None:
        """The thread that progresses the worker (``_native.api.UcxCalls.lane``)."""
        worker = self.worker
        return worker._calls.lane(worker._word, worker.event_fd())

    def wake(self) -> None:
        """Have the lane's thread progress its worker (after a part started on it)."""
        self.worker.signal()

    def close(self) -> None:
        """Stop the thread and destroy the worker (after the endpoints on it closed)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()
        self.worker.close()


def split(
    ops: npt.NDArray[np.uint64], key_of: npt.NDArray[np.intp], parts: int
) -> list[tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp]]]:
    """Cut the ops ``(local, remote, nbytes)`` into at most ``parts`` runs of about equal
    bytes, in order, an op that straddles a cut cut in two (at a multiple of 4 KiB of the
    transfer); no run is empty."""
    sizes = ops[:, 2].astype(np.int64)
    total = int(sizes.sum())
    if parts < 2 or total < 2 * _CUT_ALIGN:
        return [(ops, key_of)]
    ends = np.cumsum(sizes)
    starts = ends - sizes
    cuts = sorted(
        {total * k // parts // _CUT_ALIGN * _CUT_ALIGN for k in range(1, parts)} - {0, total}
    )
    runs: list[tuple[npt.NDArray[np.uint64], npt.NDArray[np.intp]]] = []
    at = 0  # the first byte of the transfer not yet in a run
    for cut in [*cuts, total]:
        first = int(np.searchsorted(ends, at, side="right"))  # the op holding byte ``at``
        last = int(np.searchsorted(ends, cut, side="left"))  # the op holding byte ``cut - 1``
        run = ops[first : last + 1].copy()
        head = at - int(starts[first])  # bytes of the first op in the run before it
        run[0, 0] += np.uint64(head)
        run[0, 1] += np.uint64(head)
        run[0, 2] -= np.uint64(head)
        run[-1, 2] -= np.uint64(int(ends[last]) - cut)  # bytes of the last op after it
        runs.append((run, key_of[first : last + 1]))
        at = cut
    return runs
