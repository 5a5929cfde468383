"""Faults injected into one end of a loopback link, for tests of a caller's failure paths.

A :class:`LinkFaults` belongs to one :class:`~aio_datadist._transport.loopback.LoopbackChannel`
and acts on the requests made from that end (pulls and pushes of caches and blocks, from
either face). Each request asks :meth:`LinkFaults.admit` before anything moves:

* a failure planned with :meth:`~LinkFaults.fail_next` ends it at once with the chosen
  status code, nothing moved;
* with :meth:`~LinkFaults.delay` set, it is served that many seconds later on a timer thread;
  with the link stalled (:meth:`~LinkFaults.stall`), once :meth:`~LinkFaults.release` is
  called. Either way the request fails with ``LLM_TIMEOUT`` (nothing moved) if its deadline
  comes first, and with ``LLM_LINK_FAILED`` if the link closes first; meanwhile the caller
  waits as for an answer over a socket (an event loop stays free);
* :meth:`~LinkFaults.drop` closes both ends as if the peer process had died.

With no fault set a request takes one uncontended lock more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

from aio_datadist._transport.base import RequestKind
from aio_datadist._transport.deadlines import now_ns
from aio_datadist.status import LLMStatusCode, lookup

__all__ = ("LinkFaults",)

#: Serves one admitted request (the channel's own serving and copy) and completes it.
Serve = Callable[[], None]

_OPS = {"pull": RequestKind.PULL, "push": RequestKind.PUSH}


class _Held:
    """A request waiting for its delay to end or the link to be released."""

    __slots__ = ("done", "future", "serve", "timer")

    def __init__(self, future: Future[None], serve: Serve) -> None:
        self.future = future
        self.serve = serve
        self.timer: threading.Timer | None = None
        self.done = False


class LinkFaults:
    """Faults of one end of a loopback link (see the module docstring); thread-safe."""

    def __init__(self, drop: Callable[[], None]) -> None:
        self._drop = drop
        self._lock = threading.Lock()
        self._failures: list[tuple[RequestKind | None, LLMStatusCode]] = []
        self._delay_s = 0.0
        self._stalled = False
        self._held: list[_Held] = []
        self._closed = False
        #: Requests this end made since the link formed.
        self.requests = 0
        #: Requests failed by :meth:`fail_next`.
        self.injected = 0

    # -- the test's side --------------------------------------------------------------------
    def fail_next(
        self,
        count: int = 1,
        status: LLMStatusCode = LLMStatusCode.LLM_LINK_FAILED,
        *,
        op: str | None = None,
    ) -> None:
        """Fail the next ``count`` requests (of ``op``, ``"pull"`` or ``"push"``; any when
        None) with ``status``; nothing of theirs moves and the link stays up.

        :raises TypeError: ``count`` is not an int or ``status`` not an ``LLMStatusCode``.
        :raises ValueError: ``count`` < 1, ``status`` is ``LLM_SUCCESS``, an unknown ``op``.
        """
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"count must be an int, got {type(count).__name__}")
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        if not isinstance(status, LLMStatusCode):
            raise TypeError(f"status must be an LLMStatusCode, got {type(status).__name__}")
        if status is LLMStatusCode.LLM_SUCCESS:
            raise ValueError("status must be a failure, not LLM_SUCCESS")
        if op is not None and op not in _OPS:
            raise ValueError(f"op must be 'pull', 'push' or None, got {op!r}")
        kind = None if op is None else _OPS[op]
        with self._lock:
            self._failures.extend([(kind, status)] * count)

    def delay(self, seconds: float) -> None:
        """Serve each later request ``seconds`` after it is made (0: at once again).

        :raises TypeError: not a number. :raises ValueError: negative or not finite.
        """
        if isinstance(seconds, bool) or not isinstance(seconds, int | float):
            raise TypeError(f"seconds must be a number, got {type(seconds).__name__}")
        if not 0 <= seconds < float("inf"):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        with self._lock:
            self._delay_s = float(seconds)

    def stall(self) -> None:
        """Hold every request from now on until :meth:`release` (or its deadline)."""
        with self._lock:
            self._stalled = True

    def release(self) -> None:
        """End a stall: the held requests are served, in the order they were made, on a
        thread of their own."""
        with self._lock:
            self._stalled = False
            held, self._held = self._held, []
        if held:
            threading.Thread(
                target=self._serve_all, args=(held,), name="aio_datadist-faults", daemon=True
            ).start()

    def drop(self) -> None:
        """Close both ends of the link as if the peer process had died: held requests and
        every later one fail with ``LLM_LINK_FAILED``."""
        self._drop()

    def reset(self) -> None:
        """Clear planned failures and the delay, and :meth:`release` a stall."""
        with self._lock:
            self._failures.clear()
            self._delay_s = 0.0
        self.release()

    @property
    def held(self) -> int:
        """Requests waiting for a delay or a release now."""
        with self._lock:
            return len(self._held)

    # -- the channel's side -----------------------------------------------------------------
    def admit(
        self, kind: RequestKind, deadline_ns: int, future: Future[None], serve: Serve
    ) -> bool:
        """Decide a request's fate: True when the channel serves it now; otherwise its
        ``future`` is failed here, or ``serve`` runs later (it completes ``future``)."""
        with self._lock:
            self.requests += 1
            for i, (want, status) in enumerate(self._failures):
                if want is None or want is kind:
                    del self._failures[i]
                    self.injected += 1
                    future.set_exception(
                        lookup(status)(
                            f"injected fault: {kind.value} failed with {status.name}",
                            status_code=status,
                        )
                    )
                    return False
            if self._closed:
                return True  # the channel reports the closed link itself
            if not self._stalled and self._delay_s <= 0:
                return True
            held = _Held(future, serve)
            self._held.append(held)
            wait_s = None if self._stalled else self._delay_s
        left_s = None if deadline_ns <= 0 else max(0.0, (deadline_ns - now_ns()) / 1e9)
        if wait_s is not None and (left_s is None or wait_s < left_s):
            self._arm(held, wait_s, self._serve_one)
        elif left_s is not None:
            self._arm(held, left_s, self._expire)
        return False

    def close(self) -> None:
        """The link closed: every held request fails with ``LLM_LINK_FAILED``."""
        with self._lock:
            self._closed = True
            held, self._held = self._held, []
        for h in held:
            if self._take(h):
                h.future.set_exception(
                    lookup(LLMStatusCode.LLM_LINK_FAILED)(
                        "the link closed while the request was held by an injected fault",
                        status_code=LLMStatusCode.LLM_LINK_FAILED,
                    )
                )

    # -- inside -----------------------------------------------------------------------------
    @staticmethod
    def _arm(held: _Held, after_s: float, fire: Callable[[_Held], None]) -> None:
        timer = threading.Timer(after_s, fire, args=(held,))
        timer.daemon = True
        held.timer = timer
        timer.start()

    def _take(self, held: _Held) -> bool:
        """Claim ``held`` for completion once (a timer, a release and a close may race)."""
        with self._lock:
            if held.done:
                return False
            held.done = True
            if held in self._held:
                self._held.remove(held)
        if held.timer is not None and held.timer is not threading.current_thread():
            held.timer.cancel()
        return True

    def _serve_one(self, held: _Held) -> None:
        if self._take(held):
            held.serve()

    def _serve_all(self, held: list[_Held]) -> None:
        for h in held:
            self._serve_one(h)

    def _expire(self, held: _Held) -> None:
        if self._take(held):
            held.future.set_exception(
                lookup(LLMStatusCode.LLM_TIMEOUT)(
                    "the deadline passed while the request was held by an injected fault",
                    status_code=LLMStatusCode.LLM_TIMEOUT,
                )
            )
