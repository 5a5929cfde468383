"""Typed wrapper over ``pump.c``: the one parser of a link's frames and the table of the
requests awaiting its answers.

Whoever waits reads the socket, one at a time, through the pump (GIL released): a blocking
caller in :meth:`FramePump.wait`, an event loop in :meth:`FramePump.poll`, else the link's
reader thread in :meth:`FramePump.run`, which also takes every frame that needs Python.
Answers of requests entered with :meth:`FramePump.enter` complete in C; outcomes nobody
claimed are taken with :meth:`FramePump.take_done`.
"""

from __future__ import annotations

import enum
import os
import threading
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ._ffi import ffi, lib
from .api import _U64S, _check, _fd

#: One outcome, as a waiter takes it (parsed once).
_OUTCOMEP = ffi.typeof("dd_pump_outcome *")

__all__ = ("FramePump", "Outcome", "PumpEvent")

_U64_MAX = (1 << 64) - 1
#: Outcomes one native call of :meth:`FramePump.take_done` takes at most.
_TAKE = 256
#: Each thread's buffers for :meth:`FramePump.take_done` (made once, not per call).
_BUFFERS = threading.local()


class PumpEvent(enum.IntEnum):
    """Why :meth:`FramePump.run` returned."""

    FRAME = lib.DD_PUMP_FRAME  #: a frame for Python: its header came back, the rest is unread
    PEER = lib.DD_PUMP_PEER  #: one of the peer's requests waits on the socket, unread
    DONE = lib.DD_PUMP_DONE  #: outcomes to take (:meth:`FramePump.take_done`)
    STALLED = lib.DD_PUMP_STALLED  #: the peer stalled mid-frame for the stall time
    IDLE = lib.DD_ETIMEDOUT  #: nothing arrived for the idle time
    CLOSED = lib.DD_ECLOSED_PEER  #: the peer's end closed


class Outcome(NamedTuple):
    """How a request the pump completed ended."""

    request_id: int
    code: int  #: ``lib.DD_PUMP_OK``, ``DD_PUMP_LATE`` (deadline mid-payload) or ``DD_PUMP_BROKEN``
    moved: int  #: payload bytes that landed


OK = int(lib.DD_PUMP_OK)
LATE = int(lib.DD_PUMP_LATE)
BROKEN = int(lib.DD_PUMP_BROKEN)


class FramePump:
    """The pump of one link's socket ``fd`` (see the module docstring); freed with its last
    reference, so a waiter holding the link never meets a freed pump."""

    __slots__ = ("_header", "_held", "_ptr")

    def __init__(self, fd: int, stall_s: float) -> None:
        _fd(fd)
        out = ffi.new("dd_pump **")
        rc = lib.dd_pump_new(fd, max(1, int(stall_s * 1e9)), out)
        if rc == lib.DD_ESYS:
            code = ffi.errno
            raise OSError(code, f"cannot make the link's pump: {os.strerror(code)}")
        _check(rc, "pump")
        self._ptr = ffi.gc(out[0], lib.dd_pump_free)
        self._header = ffi.new("uint8_t[40]")
        # The row tables of the requests in the table, kept alive while C may write by them.
        self._held: dict[int, object] = {}

    def enter(
        self,
        rid: int,
        answer_kind: int,
        rows: npt.NDArray[np.uint64] | None,
        nbytes: int,
        deadline_ns: int,
    ) -> bool:
        """Enter request ``rid`` before it is sent: its answer (a frame of ``answer_kind``
        with ``nbytes`` of payload into ``rows``; the pump keeps the table alive, the
        caller the memory it names) completes it in the pump. False when the table cannot hold it
        (or the pump closed): Python then takes its answer."""
        if rows is None or len(rows) == 0:
            ptr, n = ffi.NULL, 0
        else:
            ptr, n = ffi.from_buffer(_U64S, rows), len(rows)
        if n:
            self._held[rid] = rows
        rc = lib.dd_pump_enter(self._ptr, rid, answer_kind, ptr, n, nbytes, max(0, deadline_ns))
        if rc != 0 and n:
            del self._held[rid]
        if rc == lib.DD_EINVAL:
            _check(
                rc,
                f"request {rid}: id 0, an answer kind that answers nothing ({answer_kind}), a "
                f"null row, or rows that do not add up to {nbytes} bytes",
            )
        return bool(rc == 0)

    def forget(self, rid: int) -> bool:
        """Take ``rid`` out of the table; False when the pump holds it (its payload is
        moving, or its outcome waits to be taken): whoever takes that outcome ends it."""
        if lib.dd_pump_forget(self._ptr, rid) != 0:
            return False
        self._held.pop(rid, None)
        return True

    def wait(self, rid: int, spin_ns: int, until_ns: int) -> Outcome | bool:
        """Wait for ``rid``'s outcome: for ``spin_ns`` read the socket here when nobody else
        does, then sleep until ``until_ns`` while the reader thread reads.
        The outcome; True when it is still pending (the reader thread takes it once done);
        False when the table does not hold it (whoever took it out ends it)."""
        one = ffi.new(_OUTCOMEP)  # (waiters on other threads have their own)
        rc = lib.dd_pump_wait(self._ptr, rid, max(0, spin_ns), until_ns, one)
        if rc == 0:
            self._held.pop(rid, None)
            return Outcome(int(one.request_id), int(one.outcome), int(one.moved))
        return bool(rc == lib.DD_ETIMEDOUT)

    def take_done(self) -> list[Outcome]:
        """The outcomes of completed requests nobody claimed."""
        buffers = _BUFFERS.__dict__  # (the reader thread and loops take: one each)
        if not buffers:
            buffers["taken"] = ffi.new("size_t *")
            buffers["outs"] = ffi.new("dd_pump_outcome[]", _TAKE)
        taken, outs = buffers["taken"], buffers["outs"]
        done: list[Outcome] = []
        while True:
            lib.dd_pump_take_done(self._ptr, outs, _TAKE, taken)
            n = int(taken[0])
            held = self._held
            for o in outs[0:n]:
                rid = int(o.request_id)
                held.pop(rid, None)
                done.append(Outcome(rid, int(o.outcome), int(o.moved)))
            if n < _TAKE:
                return done

    def poll(self) -> bool:
        """An event loop reads what the socket holds now (never waiting); False when the next
        frame is the reader thread's (it was woken): the loop stops watching until its next
        request. Outcomes completed meanwhile are listed (:meth:`take_done`)."""
        return bool(lib.dd_pump_poll(self._ptr) != lib.DD_PUMP_FRAME)

    def expect(self) -> None:
        """Another driver (an event loop watching the socket) reads soon: the reader
        thread stays off the socket meanwhile, so the answers are that driver's to take."""
        lib.dd_pump_expect(self._ptr)

    def run(self, spin_ns: int, spin_first: bool, idle_ns: int) -> tuple[PumpEvent, bytes]:
        """Read frames until one needs Python (see :class:`PumpEvent`); with the header of a
        ``FRAME``.

        Raises:
            OSError: the socket failed.
            LLMException: the pump ran out of memory for its outcome list.
        """
        rc = lib.dd_pump_run(self._ptr, spin_ns, int(spin_first), idle_ns, self._header)
        if rc == lib.DD_ESYS:
            code = ffi.errno
            raise OSError(code, os.strerror(code))
        if rc < 0 and rc not in (lib.DD_ETIMEDOUT, lib.DD_ECLOSED_PEER):
            _check(rc, "reading the link")
        event = PumpEvent(rc)
        return event, bytes(ffi.buffer(self._header)) if event is PumpEvent.FRAME else b""

    def close(self) -> None:
        """The reader stops: every request still in the table completes ``BROKEN`` (take
        them with :meth:`take_done`); later entries are refused."""
        lib.dd_pump_close(self._ptr)
