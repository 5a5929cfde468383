"""When a step's layers are ready: the gate a layer-wise push waits at.

A serving engine computes a step's layers in order and tells the node as each one is written
(:meth:`LayerGate.mark`); a push of that step's blocks sends layer ``k`` once ``k`` is marked,
through :class:`GateSynchronizer`, the ``async def`` ``LayerSynchronizer`` that
``transfer_cache_async`` awaits on the node's loop. On a device whose kernels run behind the
host, a mark means "queued": the gate then also polls the layer's device event before it
opens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aio_datadist.synchronizer import LayerSynchronizer

__all__ = ("GateSynchronizer", "LayerGate")

_POLL_S = (50e-6, 200e-6, 1e-3)


class LayerGate:
    """The layers of one step (all methods on the node's loop)."""

    def __init__(self, num_layers: int, device_ready: Callable[[int], bool] | None = None) -> None:
        self._events = [asyncio.Event() for _ in range(num_layers)]
        self._device_ready = device_ready
        #: The step ended without its layers (the forward failed): waiters give up.
        self.aborted = False
        self.closed = False

    @classmethod
    def open(cls, num_layers: int) -> LayerGate:
        """A gate whose layers are all ready (for blocks of steps that already ended)."""
        gate = cls(num_layers)
        gate.close(ok=True)
        return gate

    def mark(self, layer: int) -> None:
        """Layer ``layer`` of the step was written (or queued, on a device)."""
        if 0 <= layer < len(self._events):
            self._events[layer].set()

    def close(self, *, ok: bool) -> None:
        """The step ended: every layer is ready, or (``ok`` False) never will be."""
        self.closed = True
        self.aborted = self.aborted or not ok
        if ok:
            self._device_ready = None  # the step ended, so its kernels did too
        for event in self._events:
            event.set()

    async def wait(self, layer: int) -> bool:
        """Wait until ``layer`` is ready; False when the step ended without it."""
        await self._events[layer].wait()
        if self.aborted:
            return False
        ready = self._device_ready
        step = 0
        while ready is not None and not ready(layer):
            await asyncio.sleep(_POLL_S[min(step, len(_POLL_S) - 1)])
            step += 1
            ready = self._device_ready
        return not self.aborted


class GateSynchronizer(LayerSynchronizer):
    """Lets ``transfer_cache_async`` send layer ``k`` once the gate says it is ready."""

    def __init__(self, gate: LayerGate) -> None:
        self._gate = gate

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        """True once layer ``layer_index`` is ready; False when its step ended without it."""
        return await self._gate.wait(layer_index)
