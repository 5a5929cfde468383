"""The same-host routes: one-sided transfers with a process on this host, against its
region board (:class:`~aio_datadist._routes.samehost.memory.PeerMemory`)."""

from __future__ import annotations

from aio_datadist._engine.request import Blocks, Completion, Transfer
from aio_datadist._engine.routes import Route
from aio_datadist._routes.samehost.memory import PeerMemory

__all__ = ("DeviceIpcRoute", "SameHostRoute")


class SameHostRoute(Route):
    """Host rows moved one-sided with a process on this host (its region board): in the
    caller, or, when an event loop waits, large ones on the native copy workers."""

    name = "same-host"
    rank = 10

    def __init__(self, peer: PeerMemory) -> None:
        self.peer = peer

    def accepts(self, transfer: Transfer) -> bool:
        return not transfer.device and not transfer.commit and self.peer.serves(transfer.target)

    def in_caller(self, transfer: Transfer) -> bool:
        # Once the kernel let a copy through, an event loop's large copies run on the
        # native copy workers (``PeerMemory.transfer``); until then, in the caller.
        return not self.peer.proven

    def start(self, transfer: Transfer, deadline_ns: int) -> Completion | None:
        remote, local = transfer.remote, transfer.local
        if remote is not None and local.__class__ is Blocks and remote.seg == local.seg:
            return self.peer.transfer_blocks(transfer.kind, remote, local, deadline_ns)
        return self.peer.transfer(transfer.kind, transfer.access, transfer.rows, deadline_ns)


class DeviceIpcRoute(Route):
    """Device rows moved one-sided with a process on this host: device to device through
    the peer's shared device memory, or staged around ``process_vm`` for its host memory."""

    name = "device-ipc"
    rank = 30

    def __init__(self, peer: PeerMemory) -> None:
        self.peer = peer

    def accepts(self, transfer: Transfer) -> bool:
        return transfer.device and not transfer.commit and self.peer.serves(transfer.target)

    def start(self, transfer: Transfer, deadline_ns: int) -> Completion | None:
        return self.peer.transfer(
            transfer.kind, transfer.access, transfer.rows, deadline_ns, local_on_device=True
        )
