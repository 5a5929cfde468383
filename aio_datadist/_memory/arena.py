"""An arena: one block of runtime memory whose release waits for every view into it to go."""

from __future__ import annotations

import weakref
from collections.abc import Callable

__all__ = ("Arena",)


class Arena:
    """``nbytes`` of memory at ``addr``, freed by ``free`` once the arena is unreachable.

    Its pool drops its reference when it closes (``finalize``), whatever still refers to the
    pool; cache objects and their numpy views keep the arena (and so the memory) alive until
    they are gone too, so a stale view never reads unmapped memory.
    """

    __slots__ = ("__weakref__", "_finalizer", "addr", "nbytes")

    def __init__(self, addr: int, nbytes: int, free: Callable[[int, int], None]) -> None:
        self.addr = addr
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, free, addr, nbytes)

    def __repr__(self) -> str:
        return f"<Arena addr={self.addr:#x} nbytes={self.nbytes}>"
