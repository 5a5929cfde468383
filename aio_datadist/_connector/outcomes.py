"""What a node finished, for the serving engine to collect, and what it counted on the way.

The node's loop records; the engine's thread takes (:meth:`Outcomes.take`,
:meth:`Counters.take`). Both are guarded by a lock, and taking empties them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ("Counters", "Outcomes", "Taken")


@dataclass
class Taken:
    """One collection of outcomes."""

    #: Requests whose blocks a remote decode no longer needs (the engine may free them).
    finished_sending: set[str] = field(default_factory=set)
    #: Requests whose load ended (well or not).
    finished_recving: set[str] = field(default_factory=set)
    #: Requests whose load failed (also in ``finished_recving``).
    failed_recving: set[str] = field(default_factory=set)
    #: Local blocks of the failed loads.
    failed_blocks: set[int] = field(default_factory=set)


class Outcomes:
    """Outcomes waiting to be collected."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._taken = Taken()

    def sent(self, request_id: str) -> None:
        """A request's blocks are free to go."""
        with self._lock:
            self._taken.finished_sending.add(request_id)
            self._lock.notify_all()

    def received(self, request_id: str) -> None:
        """A request's KV arrived."""
        with self._lock:
            self._taken.finished_recving.add(request_id)
            self._lock.notify_all()

    def failed(self, request_id: str, blocks: list[int]) -> None:
        """A request's load failed; ``blocks`` hold nothing usable."""
        with self._lock:
            self._taken.finished_recving.add(request_id)
            self._taken.failed_recving.add(request_id)
            self._taken.failed_blocks.update(blocks)
            self._lock.notify_all()

    def take(self, wait_s: float = 0.0) -> Taken:
        """Everything recorded since the last call; with ``wait_s``, first wait up to that
        long for something to be recorded when nothing is."""
        with self._lock:
            if wait_s > 0 and not self._pending():
                self._lock.wait(wait_s)
            taken, self._taken = self._taken, Taken()
        return taken

    def _pending(self) -> bool:
        taken = self._taken
        return bool(taken.finished_sending or taken.finished_recving)


#: Counter names and what they count.
COUNTERS = {
    "loads": "loads (pulls, or pushes waited for) that completed",
    "load_failures": "loads that failed",
    "load_bytes": "KV bytes loaded",
    "pushes": "pushed requests that completed",
    "push_failures": "pushed requests that failed",
    "push_bytes": "KV bytes pushed",
    "expired": "finished requests whose blocks were freed at the abort timeout",
    "released": "finished requests released by the decode that loaded them",
}


class Counters:
    """What the node did since the last :meth:`take`: counts, and each load's seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._load_seconds: list[float] = []
        self._push_seconds: list[float] = []

    def add(self, name: str, value: int = 1) -> None:
        """Add ``value`` to counter ``name``."""
        with self._lock:
            self._counts[name] += value

    def load(self, seconds: float, nbytes: int) -> None:
        """A load completed."""
        with self._lock:
            self._counts["loads"] += 1
            self._counts["load_bytes"] += nbytes
            self._load_seconds.append(seconds)

    def push(self, seconds: float, nbytes: int) -> None:
        """A push completed (its last layer landed)."""
        with self._lock:
            self._counts["pushes"] += 1
            self._counts["push_bytes"] += nbytes
            self._push_seconds.append(seconds)

    def take(self) -> dict[str, Any]:
        """Counts and durations since the last call (the counters start again at zero)."""
        with self._lock:
            data: dict[str, Any] = dict(self._counts)
            data["load_seconds"] = self._load_seconds
            data["push_seconds"] = self._push_seconds
            self._counts = dict.fromkeys(COUNTERS, 0)
            self._load_seconds, self._push_seconds = [], []
        return data
