"""One-sided transfers with a linked process on the same host.

A :class:`PeerMemory` belongs to one link whose peer published a region board
(``_engine.regions``) and shares this host's kernel and pid namespace. A pull or push that
names the peer's memory by blocks key, by cache id and batch index, or by raw addresses is
resolved against the board here, bounds-checked exactly as the serving side would, and
moved with one batched ``process_vm_readv``/``process_vm_writev`` call: no request crosses
the socket and the peer's threads do nothing. The call runs in the caller's thread, or, for
an event loop awaiting a copy of ``api.BACKGROUND_MIN`` bytes or more once the kernel let a
copy with this peer through, on the native copy workers, completing on the loop
(``_engine.background``). Requests by cache key (which may drop the
key on the peer) and anything the board does not show go over the link as before.

Host caches in the peer's shared memory (``DeviceRuntime.host_share``: a sealed memory
file, named on the board) are mapped here once per arena and copied with memcpy on the same
copy workers, pid 0 (``api.host_map_peer``; the kernel allows it exactly where it allows
``process_vm_readv``). A mapping stays while the board names its arena and no copy uses it;
where it cannot be made, the copy goes through the kernel as above.

Device caches the peer shared through its runtime (CUDA IPC) are mapped here once per
allocation and copied by this engine's runtime (device to device, or to and from host
rows); a local device cache against the peer's host memory is staged through pinned host
buffers around the ``process_vm`` call. Where the runtime cannot map the peer's memory,
device requests go over the link for good, with one log line.

Where the kernel refuses cross-process access (``ptrace_scope``, another user, container
policy) the link falls back to its socket for good, with one log line. One-sided pulls see
the peer's caches as published at the time of the call; a cache the peer releases while a
pull reads it fails that pull with ``LLM_KV_CACHE_NOT_EXIST`` (the board changed under it).
"""

from __future__ import annotations

import asyncio
import os
import select
import threading
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import structlog

from aio_datadist._engine.access import Access, Target
from aio_datadist._engine.background import start_on_loop
from aio_datadist._engine.regions import (
    ONE_SIDED_TARGETS,
    BoardArena,
    BoardEntry,
    RegionView,
    RemoteRegions,
    paired,
    resolve,
)
from aio_datadist._engine.request import DONE, Blocks, Completion, RemoteBlocks
from aio_datadist._memory.staging import Staging
from aio_datadist._native import api
from aio_datadist._runtime.base import CopyKind
from aio_datadist._transport.base import Iov, RequestKind
from aio_datadist._transport.samehost import SameHostPeer
from aio_datadist.status import (
    KvCacheNotExistError,
    LLMException,
    LLMStatusCode,
    ParamInvalidError,
)

__all__ = ("PeerMemory", "open_peer_memory")

_ADDR_SPACE = 1 << 64
#: The copy kind with a peer's shared device memory, by (local rows on device, request kind).
_SHARED_COPY = {
    (True, RequestKind.PULL): CopyKind.DEVICE_TO_DEVICE,
    (True, RequestKind.PUSH): CopyKind.DEVICE_TO_DEVICE,
    (False, RequestKind.PULL): CopyKind.DEVICE_TO_HOST,
    (False, RequestKind.PUSH): CopyKind.HOST_TO_DEVICE,
}


def open_peer_memory(
    peer: SameHostPeer, staging: Staging, log: structlog.stdlib.BoundLogger
) -> PeerMemory | None:
    """The one-sided route to the proven same-host ``peer``; None when its board cannot be
    mapped (it is not a sealed region board)."""
    try:
        view = RegionView(peer.board_fd)
    except OSError as exc:
        log.info("samehost.unavailable", peer_pid=peer.pid, reason=str(exc))
        return None
    log.info("samehost.ready", peer_pid=peer.pid)
    return PeerMemory(peer.pid, view, staging, log)


class PeerMemory:
    """One-sided access to the caches a same-host peer published."""

    def __init__(
        self, pid: int, view: RegionView, staging: Staging, log: structlog.stdlib.BoundLogger
    ) -> None:
        self.pid = pid
        self._view = view
        self._staging = staging
        self._log = log
        #: False once the kernel refused: every later request goes over the link.
        self.enabled = True
        #: True once a copy with the peer went through, or its memory was mapped here: the
        #: kernel allows access, so a copy may run in the background (its failure is then
        #: the transfer's).
        self.proven = False
        #: False once the runtime could not map the peer's device memory (or never can:
        #: a process cannot map its own).
        self.device_sharing = pid != os.getpid()
        self._mapped: dict[bytes, int] = {}
        self._map_lock = threading.Lock()
        #: False once the kernel refused to hand over the peer's shared memory: its host
        #: caches are copied with ``process_vm`` from then on.
        self.mapping = True
        self._arenas: dict[tuple[int, int], _Arena] = {}
        self._arenas_seq = -1
        #: A pidfd of the peer, readable once it exited (a copy into its mapped memory would
        #: still work): watched by a poll object per thread; closed with this object.
        self._pidfd = -1
        self._pollers = threading.local()

    def close(self) -> None:
        """Stop one-sided access (the link closed) and unmap the peer's memory (a shared
        arena a copy still uses, when that copy ends)."""
        self.enabled = False
        self._view.close()
        with self._map_lock:
            mapped, self._mapped = self._mapped, {}
            self.device_sharing = False
            self.mapping = False
            arenas, self._arenas = self._arenas, {}
            for arena in arenas.values():
                arena.drop()
        for addr in mapped.values():
            self._staging.runtime.close_shared(addr)

    def serves(self, target: Target) -> bool:
        """True while requests naming the peer's memory this way may go one-sided."""
        return self.enabled and target in ONE_SIDED_TARGETS

    def transfer(
        self,
        kind: RequestKind,
        access: Access,
        local: Iov,
        deadline_ns: int,
        *,
        local_on_device: bool = False,
    ) -> Completion | None:
        """Move one request's bytes one-sided; None when the link must carry it instead.

        In an event loop's thread a copy of host rows of at least ``api.BACKGROUND_MIN``
        bytes runs on the native copy workers (see :meth:`_copy`) and the completion, with
        ``deadline_ns``, ends on the loop. ``local_on_device``: the ``local`` rows are
        device memory of this engine's runtime.

        :raises LLMException: ``LLM_PARAM_INVALID`` (outside the peer's cache),
            ``LLM_KV_CACHE_NOT_EXIST`` (released meanwhile), ``LLM_LINK_FAILED`` (the peer
            process is gone), ``LLM_FAILED`` (the kernel reported another fault); a
            completion ending on the loop fails the same ways.
        """
        if not self.serves(access.target):
            return None
        regions = self._regions()
        if regions is None:
            return None
        resolved = resolve(regions, access)
        if resolved is None:
            return None
        entries, remote = resolved
        on_device = [bool(e.token) for e in entries]
        if any(on_device):
            mapped = self._map(entries, remote) if all(on_device) else None
            if mapped is None:
                return None
            ops = paired(kind, local, mapped)
            self._staging.runtime.copy_batch(ops, _SHARED_COPY[local_on_device, kind])
            self._check_still_there(regions, entries)
            return DONE
        write = kind is RequestKind.PUSH
        if not local_on_device:
            ops = paired(kind, local, remote)
            nbytes = int(ops[:, 2].sum())
            held = self._hold(regions, entries)
            if held is None:
                args = (self.pid, ops)
            else:
                theirs = 0 if write else 1
                spans = {(a.base, a.nbytes, a.addr) for a in held}
                ops[:, theirs] = _translated(ops[:, theirs], list(spans))
                args = (0, ops)
            return self._copy(
                regions, entries, api.vm_copy_batch, args, write, nbytes, deadline_ns, held
            )
        staged = self._staging.inbound(local) if not write else self._staging.outbound(local)
        done = None
        try:
            ops = paired(kind, staged.iov, remote)
            done = self._copy(regions, entries, api.vm_copy_batch, (self.pid, ops), write, 0, 0)
        finally:
            staged.finish(done is not None)
        return done

    def transfer_blocks(
        self,
        kind: RequestKind,
        remote: RemoteBlocks,
        local: Blocks,
        deadline_ns: int,
    ) -> Completion | None:
        """:meth:`transfer` of blocks between host blocks caches, in one native call:
        ``remote`` (blocks of the peer's blocks cache ``remote.model_id``) into ``local``
        (blocks of this side's), or back for a push; both name whole blocks of ``seg``
        bytes of as many tensors.

        None when this route does not take it, nothing moved: the peer does not publish
        that cache in host memory, or a block, tensor or size lies outside it (the general
        route then names the problem exactly as the serving side would).

        :raises LLMException: as :meth:`transfer`.
        """
        if not self.enabled:
            return None
        regions = self._regions()
        if regions is None:
            return None
        entry = regions.by_model.get(remote.model_id)
        if entry is None or entry.token:
            return None
        held = self._hold(regions, [entry])
        if held is None:
            pid, layout = self.pid, regions.layout(entry)
        else:
            pid, layout = 0, regions.layout(entry, held[0].addr - held[0].base)
        theirs = (layout, remote.start, remote.blocks)
        mine = (local.layout, local.start, local.blocks)
        count, seg = local.count, local.seg
        push = kind is RequestKind.PUSH
        if push:
            args: tuple[Any, ...] = (pid, theirs, mine, count, seg)
        else:
            args = (pid, mine, theirs, count, seg)
        nbytes = count * len(remote.blocks) * seg
        try:
            return self._copy(
                regions,
                [entry],
                api.vm_copy_blocks,
                args,
                push,
                nbytes,
                deadline_ns,
                held,
            )
        except ParamInvalidError:
            return None

    def _regions(self) -> RemoteRegions | None:
        """The peer's board as it is now (None: no consistent snapshot); when it changed,
        the mappings of arenas it no longer names are dropped."""
        regions = self._view.regions()
        if regions is not None and regions.seq != self._arenas_seq and self._arenas:
            self._sweep(regions)
        return regions

    def _hold(self, regions: RemoteRegions, entries: list[BoardEntry]) -> list[_Arena] | None:
        """The peer's shared arenas holding ``entries``, mapped here and held for one copy
        (:meth:`_end` or :meth:`_release` them after it); None when one is private or cannot
        be mapped (the copy then goes through the kernel).

        Holding takes no lock: a copy adds itself to its arena's users, then looks whether
        the arena was dropped meanwhile; dropping marks the arena, then unmaps it only if it
        has no users. One of the two always sees the other (list appends and attribute
        writes are atomic under the GIL), so a held arena is never unmapped under its copy.
        """
        if not self.mapping:
            return None
        held: list[_Arena] = []
        for entry in entries:
            published = entry.arena
            if published is None:
                self._release(held)
                return None
            arena = self._arenas.get((published.fd, published.ino))
            if arena is None or arena.base != published.base or arena.nbytes != published.nbytes:
                arena = self._map_arena(regions, published)
            if arena is None:
                self._release(held)
                return None
            arena.users.append(None)
            if arena.dropped:  # dropped since it was looked up: not for this copy
                self._release([arena])
                self._release(held)
                return None
            held.append(arena)
        return held

    def _map_arena(self, regions: RemoteRegions, published: BoardArena) -> _Arena | None:
        """Map ``published`` here (replacing an older mapping under its key); None when it
        cannot be, or ``regions`` is older than the last sweep (its arena might stay mapped
        for good)."""
        with self._map_lock:
            if not self.mapping or regions.seq < self._arenas_seq:
                return None
            key = (published.fd, published.ino)
            older = self._arenas.get(key)
            if older is not None and (older.base, older.nbytes) == (
                published.base,
                published.nbytes,
            ):
                return older  # another thread mapped it meanwhile
            if self._pidfd < 0:  # the first mapping: watch for the peer's exit from now on
                try:
                    self._pidfd = os.pidfd_open(self.pid)
                except OSError as exc:
                    self._unmappable(exc)
                    return None
                weakref.finalize(self, os.close, self._pidfd)
            try:
                addr = api.host_map_peer(self.pid, published.fd, published.ino, published.nbytes)
            except PermissionError as exc:
                self._unmappable(exc)
                return None
            except (OSError, ValueError, LLMException):  # gone meanwhile: its entry is stale
                return None
            if older is not None:
                self._arenas.pop(key).drop()
            arena = self._arenas[key] = _Arena(addr, published.base, published.nbytes)
            # The kernel handed over the peer's file under the very check process_vm_readv
            # passes (ptrace access), so copies with this peer may run in the background.
            self.proven = True
            return arena

    def _unmappable(self, exc: OSError) -> None:
        self.mapping = False
        self._log.info(
            "samehost.unmapped", peer_pid=self.pid, reason=str(exc), fallback="process_vm"
        )

    def _end(self, held: list[_Arena]) -> None:
        """A copy with the peer's mapped memory ended: release ``held``, and fail the copy
        once the peer exited (its memory outlives it here, so the copy itself cannot tell)."""
        self._release(held)
        poller = getattr(self._pollers, "poller", None)
        if poller is None:  # (a poll object is never polled by two threads at once)
            poller = self._pollers.poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
        if poller.poll(0):
            raise LLMException(
                f"the peer process {self.pid} is gone", status_code=LLMStatusCode.LLM_LINK_FAILED
            )

    def _release(self, held: list[_Arena] | None) -> None:
        """End one copy's use of ``held``; an arena dropped meanwhile is unmapped by the last
        copy that used it."""
        if not held:
            return
        for arena in held:
            arena.users.pop()
            if arena.dropped and not arena.users:
                with self._map_lock:
                    arena.unmap_if_idle()

    def _sweep(self, regions: RemoteRegions) -> None:
        """Drop the mappings of arenas the board no longer names (each when no copy uses
        it); called when the board changed."""
        named = {(e.arena.fd, e.arena.ino) for e in regions.by_id.values() if e.arena is not None}
        with self._map_lock:
            for key in [k for k in self._arenas if k not in named]:
                self._arenas.pop(key).drop()
            self._arenas_seq = regions.seq

    def _map(self, entries: list[BoardEntry], remote: Iov) -> Iov | None:
        """``remote`` rows translated into this process through the peer's sharing tokens;
        None when the runtime cannot map them (the link carries such requests from then on)."""
        spans = []
        for entry in entries:
            base = self._open(entry)
            if base is None:
                return None
            spans.append((*entry.span, base))
        out = remote.copy()
        out[:, 0] = _translated(remote[:, 0], spans)
        return out

    def _open(self, entry: BoardEntry) -> int | None:
        with self._map_lock:
            if not self.device_sharing:
                return None
            base = self._mapped.get(entry.token)
            if base is not None:
                return base
            try:
                base = self._staging.runtime.open_shared(entry.token)
            except (LLMException, TypeError) as exc:
                self.device_sharing = False
                self._log.warning(
                    "samehost.device_unshared", peer_pid=self.pid, reason=str(exc), fallback="link"
                )
                return None
            self._mapped[entry.token] = base
            return base

    def _copy(
        self,
        regions: RemoteRegions,
        entries: list[BoardEntry],
        copy: Callable[..., api.CopyTask | None],
        args: tuple[Any, ...],
        write: bool,
        nbytes: int,
        deadline_ns: int,
        held: list[_Arena] | None = None,
    ) -> Completion | None:
        """Run ``copy(*args, write=write)`` (``nbytes``) with the peer's host memory: in this
        thread, or, in an event loop's thread, a copy of ``api.BACKGROUND_MIN`` bytes or more
        once a copy with this peer went through (or its memory was mapped here), on the
        native copy workers (``_engine.background``; ``deadline_ns`` is its completion's).
        ``held``: the peer's arenas the copy uses, mapped here (pid 0), released when it
        ended. None when the kernel refused (use the link)."""
        try:
            if nbytes >= api.BACKGROUND_MIN and self.proven and _loop_here():
                completion = start_on_loop(
                    partial(_background, copy, args, write),
                    partial(self._ended, regions, entries, held),
                    deadline_ns,
                )
                if completion is not None:
                    return completion
            else:
                copy(*args, write=write)
        except BaseException as exc:  # nothing runs on: the arenas are free again
            if held is not None:
                self._release(held)
            if isinstance(exc, PermissionError):
                self.enabled = False
                self._log.warning(
                    "samehost.denied", peer_pid=self.pid, reason=str(exc), fallback="link"
                )
                return None
            if isinstance(exc, OSError):
                raise self._failure(exc, regions, entries) from None
            raise
        self.proven = True
        if held is not None:
            self._end(held)
        self._check_still_there(regions, entries)
        return DONE

    def _ended(
        self,
        regions: RemoteRegions,
        entries: list[BoardEntry],
        held: list[_Arena] | None,
        error: OSError | None,
    ) -> None:
        """A copy on the native copy workers ended (on the loop): release the arenas it
        used, and raise the transfer's failure, if any."""
        if held is not None:
            self._end(held)
        if error is not None:
            raise self._failure(error, regions, entries)
        self._check_still_there(regions, entries)

    def _failure(
        self, exc: OSError, regions: RemoteRegions, entries: list[BoardEntry]
    ) -> LLMException:
        """The transfer's failure for a copy that failed with ``exc`` (a cache the peer
        released meanwhile is raised as such)."""
        if isinstance(exc, ProcessLookupError):
            return LLMException(
                f"the peer process {self.pid} is gone", status_code=LLMStatusCode.LLM_LINK_FAILED
            )
        self._check_still_there(regions, entries)
        return LLMException(
            f"one-sided transfer with process {self.pid} failed: {exc}",
            status_code=LLMStatusCode.LLM_FAILED,
        )

    def _check_still_there(self, before: RemoteRegions, entries: list[BoardEntry]) -> None:
        """Fail the transfer when the peer released a cache it used while the bytes moved."""
        seq = self._view.seq()
        if seq == before.seq:
            return
        if seq < 0 or self._view.withdrawn():
            raise LLMException(
                f"the link to process {self.pid} closed during the transfer",
                status_code=LLMStatusCode.LLM_LINK_FAILED,
            )
        now = self._view.regions()
        if now is not None and all(now.by_id.get(e.cache_id) == e for e in entries):
            return
        raise KvCacheNotExistError(
            "the peer released the cache while it was being transferred",
            status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
        )


class _Arena:
    """A peer's shared arena (``base``, ``nbytes`` there) mapped here at ``addr``; unmapped
    once dropped and no copy uses it (``users``: one item per copy). :meth:`drop` and
    :meth:`unmap_if_idle` run under the peer's map lock."""

    __slots__ = ("addr", "base", "dropped", "nbytes", "users")

    def __init__(self, addr: int, base: int, nbytes: int) -> None:
        self.addr = addr
        self.base = base
        self.nbytes = nbytes
        self.users: list[None] = []
        self.dropped = False

    def drop(self) -> None:
        """No new copy may use it: unmap now, or when the last copy using it ends."""
        self.dropped = True
        self.unmap_if_idle()

    def unmap_if_idle(self) -> None:
        """Unmap a dropped arena no copy uses (once)."""
        if self.dropped and not self.users and self.addr:
            addr, self.addr = self.addr, 0
            api.host_free(addr, self.nbytes)


def _translated(addrs: np.ndarray, spans: list[tuple[int, int, int]]) -> np.ndarray:
    """``addrs`` of the peer moved here: each lies inside one ``(start, nbytes, here)`` span
    of the peer's memory and becomes ``here + (addr - start)``."""
    if len(spans) == 1:  # one shift for all
        start, _, here = spans[0]
        return addrs + np.uint64((here - start) % _ADDR_SPACE)
    out = addrs.copy()
    for start, nbytes, here in spans:
        inside = (addrs >= start) & (addrs < start + nbytes)
        out[inside] = addrs[inside] - np.uint64(start) + np.uint64(here)
    return out


def _loop_here() -> bool:
    """True when an event loop runs in this thread (not so for a start an event loop handed
    to a worker thread)."""
    return asyncio._get_running_loop() is not None


def _background(
    copy: Callable[..., api.CopyTask | None],
    args: tuple[Any, ...],
    write: bool,
    signal: api.CopySignal | None,
) -> api.CopyTask | None:
    return copy(*args, write=write, signal=signal)
