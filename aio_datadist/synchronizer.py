"""``LayerSynchronizer``: the user's hook telling a layer-wise transfer when a layer is ready."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from typing import Any

__all__ = ("LayerSynchronizer", "is_async_synchronizer")


class LayerSynchronizer(ABC):
    """Blocks (or awaits) until the model has finished computing a layer.

    ``transfer_cache_async`` calls :meth:`synchronize_layer` before sending each layer; True
    starts that layer's transfer, False fails the task. With the async facade the method may
    be ``async def`` (awaited on the engine's loop); a plain method runs on a worker thread.
    """

    @abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> Any:
        """Wait until layer ``layer_index`` is computed; return True to send it.

        :param layer_index: 0-based layer number.
        :param timeout_in_millis: always None (the timeout is not supported yet).
        """


def is_async_synchronizer(synchronizer: LayerSynchronizer) -> bool:
    """True when ``synchronize_layer`` is a coroutine function."""
    return inspect.iscoroutinefunction(synchronizer.synchronize_layer)
