"""Hostile peers for the serving side: a real engine listening on TCP, a raw client speaking
the frame format by hand, frame mutation for fuzzing, and floods of pipelined requests.

Shared by the bounds tests, the CI fuzz slice, ``tools/fuzz.py`` (the nightly run), the
backpressure tests and ``tools/flood.py``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import aio_datadist as llm
from aio_datadist._engine.access import Access, Target, decode_access, encode_access
from aio_datadist._engine.regions import BoardEntry, RemoteRegions, encode_entries
from aio_datadist._routes.ucx.table import UcxKey, decode_table, encode_table
from aio_datadist._transport import _wire as wire
from aio_datadist._transport.samehost import decode_extensions

HOST = "127.0.0.1"
SERVER_ID = 1
WAIT = 10.0
#: The serving engine's caches: a batch cache (with a req key on row 0 and a prefix key on
#: row 1), a blocks cache under a blocks key, and registered user memory.
TENSORS, ROWS, ROW_BYTES = 2, 4, 256
BLOCKS, BLOCK_BYTES = 8, 128
REQ_ID, PREFIX_ID, MODEL_ID = 7, 7, 5
BATCH_ID = 1  # the first cache of a fresh engine
#: Longest run of bytes the fuzz client adds to complete a frame it truncated or lengthened;
#: beyond it the client hangs up mid-frame instead.
PAD_MAX = 256 << 10
_SENTINEL_RID = (1 << 64) - 1


def pattern(n: int, seed: int) -> np.ndarray:
    """``n`` deterministic bytes that differ for each seed."""
    return ((np.arange(n, dtype=np.uint64) * 7 + seed * 13) % 251).astype(np.uint8)


def _desc(rows: int, row_bytes: int) -> llm.CacheDesc:
    return llm.CacheDesc(TENSORS, [rows, row_bytes], llm.DataType.DT_UINT8, llm.Placement.HOST)


class ServingEngine:
    """A blocking ``LLMDataDist`` (cluster 1) listening on TCP with three filled caches."""

    def __init__(self) -> None:
        cfg = llm.LLMConfig()
        cfg.device_id = 0
        cfg.enable_cache_manager = True
        cfg.transport = "tcp"
        cfg.listen_ip_info = f"{HOST}:0"
        cfg.same_host = False
        pool = json.dumps({"memory_size": 16 << 20, "page_shift": 16})
        cfg.mem_pool_cfg = pool
        cfg.host_mem_pool_cfg = pool
        self.dd = llm.LLMDataDist(llm.LLMRole.PROMPT, SERVER_ID)
        self.dd.init(dict(cfg.generate_options()))
        try:
            cm = self.dd.cache_manager
            keys = [llm.CacheKey(SERVER_ID, REQ_ID), llm.CacheKey(SERVER_ID, 0, 0, PREFIX_ID)]
            self.batch = cm.allocate_cache(_desc(ROWS, ROW_BYTES), keys)
            assert self.batch.cache_id == BATCH_ID
            self.blocks = cm.allocate_blocks_cache(
                _desc(BLOCKS, BLOCK_BYTES), llm.BlocksCacheKey(SERVER_ID, MODEL_ID)
            )
            self.user = np.zeros((TENSORS, ROWS * ROW_BYTES), np.uint8)
            addrs = [int(self.user[i].ctypes.data) for i in range(TENSORS)]
            self.registered = cm.register_cache(_desc(ROWS, ROW_BYTES), addrs)
            self.fill()
            address = self.dd._engine.link_table().listen_address
            assert address is not None
            self.port = address[1]
        except BaseException:
            self.dd.finalize()
            raise

    def fill(self) -> None:
        """Write a known pattern into every tensor of every cache."""
        for c, cache in enumerate((self.batch, self.blocks, self.registered)):
            for t, tensor in enumerate(cache.as_numpy()):
                flat = tensor.reshape(-1)
                flat[:] = pattern(flat.size, 10 * c + t)

    def tensor(self, cache_index: int, t: int) -> np.ndarray:
        """The flat bytes of tensor ``t`` of cache 0 (batch), 1 (blocks) or 2 (registered)."""
        cache = (self.batch, self.blocks, self.registered)[cache_index]
        return np.asarray(cache.as_numpy()[t]).reshape(-1)

    def pool_used(self) -> int:
        """Bytes in use in both pools."""
        cm = self.dd.cache_manager
        stats = [cm.pool_stats(p) for p in (llm.Placement.DEVICE, llm.Placement.HOST)]
        return sum(s.used for s in stats if s is not None)

    def pins(self) -> int:
        """Copies in flight over this engine's caches (0 when every served request ended)."""
        caches = self.dd._engine.caches
        assert caches is not None
        with caches.registry.lock:
            return sum(entry.pins for entry in caches.registry.entries())

    def close(self) -> None:
        """Finalize the engine."""
        self.dd.finalize()


class Answer(NamedTuple):
    """One frame the server sent: its kind, request id, status and body or payload."""

    kind: wire.FrameKind
    rid: int
    status: int
    data: bytes


def frame(kind: wire.FrameKind, rid: int = 0, body: bytes = b"", payload: bytes = b"") -> bytes:
    """A whole frame: header, body, payload."""
    return (
        wire.pack_header(kind, rid, body_len=len(body), payload_len=len(payload)) + body + payload
    )


def hello_frame(cluster_id: int) -> bytes:
    """A HELLO from a decoder ``cluster_id`` to the serving engine."""
    body = wire.encode_hello(wire.HelloBody(cluster_id, int(llm.LLMRole.DECODER), SERVER_ID))
    return frame(wire.FrameKind.HELLO, body=body)


def pull_frame(rid: int, access: Access, nbytes: int) -> bytes:
    """A PULL of ``nbytes`` of ``access``."""
    return frame(wire.FrameKind.PULL, rid, struct.pack("<Q", nbytes) + encode_access(access))


def push_frame(rid: int, access: Access, payload: bytes) -> bytes:
    """A PUSH of ``payload`` into ``access``."""
    return frame(wire.FrameKind.PUSH, rid, encode_access(access), payload)


_cluster_ids = itertools.count(1000)


def _connect(port: int, timeout: float = WAIT, buffers: int = 0) -> socket.socket:
    """A connection to ``port``; ``buffers``: its socket buffers' size (0: the kernel's)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if buffers:  # before connecting, so the kernel never grows them
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffers)
        sock.settimeout(timeout)
        sock.connect((HOST, port))
        # A frame and the sentinel after it go out at once, not 40 ms apart (Nagle, delayed
        # ACK).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except BaseException:
        sock.close()
        raise
    return sock


class RawPeer:
    """A client that made a real handshake and then speaks frames by hand (as cluster
    :attr:`cluster_id`; ``buffers``: its socket buffers' size, 0: the kernel's)."""

    def __init__(self, port: int, timeout: float = WAIT, buffers: int = 0) -> None:
        self.sock = _connect(port, timeout, buffers)
        self._rids = itertools.count(1)
        self.cluster_id = next(_cluster_ids)
        try:
            self.sock.sendall(hello_frame(self.cluster_id))
            answer = self.read()
        except BaseException:
            self.sock.close()
            raise
        if answer is None or answer.kind is not wire.FrameKind.HELLO_ACK:
            self.sock.close()
            raise ConnectionError(f"handshake refused: {answer}")

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()

    def _recv_exact(self, n: int) -> bytes | None:
        data = bytearray()
        while len(data) < n:
            chunk = self.sock.recv(min(n - len(data), 1 << 20))
            if not chunk:
                return None
            data += chunk
        return bytes(data)

    def read(self) -> Answer | None:
        """The next frame from the server, or None once it closed the connection."""
        try:
            raw = self._recv_exact(wire.HEADER.size)
            if raw is None:
                return None
            h = wire.decode_header(raw)
            data = self._recv_exact(h.body_len + h.payload_len)
        except ConnectionResetError:
            return None
        if data is None:
            return None
        return Answer(h.kind, h.request_id, h.status, data)

    def request(self, data: bytes, rid: int) -> Answer | None:
        """Send one request frame and return the answer to ``rid`` (skipping others)."""
        self.sock.sendall(data)
        while True:
            answer = self.read()
            if answer is None or answer.rid == rid:
                return answer

    def pull(self, access: Access, nbytes: int) -> Answer | None:
        """Pull ``nbytes`` of ``access``: PULL_DATA with the bytes, or ERROR."""
        rid = next(self._rids)
        return self.request(pull_frame(rid, access, nbytes), rid)

    def push(self, access: Access, payload: bytes) -> Answer | None:
        """Push ``payload`` into ``access``: PUSH_ACK, or ERROR."""
        rid = next(self._rids)
        return self.request(push_frame(rid, access, payload), rid)

    def pull_done(self, rid: int) -> None:
        """Confirm that pull ``rid`` landed (lets the server drop a req key)."""
        self.sock.sendall(frame(wire.FrameKind.PULL_DONE, rid))


def valid_accesses() -> list[tuple[Access, int]]:
    """Well-formed accesses to the serving engine's caches, with their sizes in bytes."""
    one = dict(tensor_start=0, tensor_count=TENSORS)
    blocks = np.array([1, 6, 3], dtype=np.uint64)
    return [
        (Access(Target.CACHE_INDEX, ident=BATCH_ID, row=2, seg_bytes=ROW_BYTES, **one), 512),
        (Access(Target.REQ_KEY, ident=REQ_ID, seg_bytes=64, offset=32, **one), 128),
        (Access(Target.PREFIX_KEY, ident=PREFIX_ID, seg_bytes=ROW_BYTES, **one), 512),
        (
            Access(Target.BLOCKS_KEY, ident=MODEL_ID, seg_bytes=BLOCK_BYTES, blocks=blocks, **one),
            TENSORS * 3 * BLOCK_BYTES,
        ),
    ]


# -- mutation ----------------------------------------------------------------------------------

_INTERESTING = (0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0xFFFFFFFF, 1 << 24, 1 << 40, 1 << 63, 2**64 - 1)


def seed_frames() -> list[bytes]:
    """Valid frames of every kind a peer may send on a link, to mutate."""
    frames = []
    for rid, (access, nbytes) in enumerate(valid_accesses(), 1):
        frames.append(pull_frame(rid, access, nbytes))
        frames.append(push_frame(rid + 100, access, bytes(nbytes)))
    rows = np.array([[0x1000, 16], [0x2000, 32]], dtype=np.uint64)
    frames.append(pull_frame(9, Access(Target.ADDRESSES, rows=rows), 48))
    frames += [
        frame(wire.FrameKind.PING, 5),
        frame(wire.FrameKind.PONG, 5),
        frame(wire.FrameKind.PULL_DONE, 1),
        frame(wire.FrameKind.PUSH_ACK, 3),
        frame(wire.FrameKind.PULL_DATA, 4, payload=bytes(64)),
        frame(wire.FrameKind.ERROR, 6, b"no"),
        frame(wire.FrameKind.BYE),
        hello_frame(77),
    ]
    return frames


def mutate(rng: random.Random, data: bytes, others: list[bytes]) -> bytes:
    """A random mutation of ``data``: bit flips, interesting values, cuts, splices, noise."""
    buf = bytearray(data)
    how = rng.randrange(8)
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif how == 1:
        buf[rng.randrange(len(buf))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF))
    elif how in (2, 3):  # a u32 or u64 field, aligned as the codecs lay them out
        size = rng.choice((4, 8))
        at = rng.randrange(0, max(1, len(buf) - size + 1))
        value = rng.choice(_INTERESTING) & ((1 << (8 * size)) - 1)
        if rng.random() < 0.3:
            value = (int.from_bytes(buf[at : at + size], "little") + rng.choice((-1, 1))) % (
                1 << (8 * size)
            )
        buf[at : at + size] = value.to_bytes(size, "little")
    elif how == 4:
        del buf[rng.randrange(len(buf)) :]
    elif how == 5:
        buf += rng.randbytes(rng.randint(1, 64))
    elif how == 6:
        other = rng.choice(others)
        buf = buf[: rng.randrange(len(buf) + 1)] + other[rng.randrange(len(other)) :]
    else:
        buf = bytearray(rng.randbytes(rng.randint(1, 160)))
    return bytes(buf)


def complete(
    data: bytes, limit: int = wire.MAX_HELLO_BODY + wire.HEADER.size
) -> tuple[bytes, bool]:
    """``data`` padded so that every frame the server would wait on is whole.

    Returns the bytes to send and whether they are whole (False: a frame announces more than
    ``limit`` bytes, and the client should hang up after sending). Header by header, as the
    server reads: a frame header the server cannot decode ends the stream (it closes there).
    """
    out = bytearray(data)
    at = 0
    while at < len(out) or at == 0:
        if len(out) < at + wire.HEADER.size:
            out += bytes(at + wire.HEADER.size - len(out))
        try:
            h = wire.decode_header(bytes(out[at : at + wire.HEADER.size]))
        except wire.WireError:
            return bytes(out), True
        end = at + wire.HEADER.size + h.body_len + h.payload_len
        if end - len(out) > limit:
            return bytes(out), False
        if end > len(out):
            out += bytes(end - len(out))
        at = end
    return bytes(out), True


# -- the live server under fuzz ------------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _status_name(status: int) -> str:
    try:
        return llm.LLMStatusCode(status).name
    except ValueError:
        return str(status)


@dataclass
class FuzzReport:
    """What a fuzz run saw."""

    frames: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    parser: collections.Counter[str] = field(default_factory=collections.Counter)
    handshakes: int = 0
    elapsed_s: float = 0.0


def _outcome(peer: socket.socket, sentinel: bool) -> str:
    """Read until the sentinel PONG (the link survived) or the server closed it; without a
    sentinel, until the first answer."""
    reader = RawPeer.__new__(RawPeer)
    reader.sock = peer
    first: str | None = None
    while True:
        try:
            answer = reader.read()
        except TimeoutError:
            return "timeout"
        except wire.WireError:
            return "garbled answer"
        if answer is None:
            return first or "closed"
        if answer.kind is wire.FrameKind.PONG and answer.rid == _SENTINEL_RID and sentinel:
            return first or "served"
        if first is None:
            if answer.kind is wire.FrameKind.ERROR:
                first = f"error {_status_name(answer.status)}"
            else:
                first = answer.kind.name.lower()
        if not sentinel:
            return first


def fuzz_handshake_frame(port: int, data: bytes) -> str:
    """Send ``data`` as the first frame of a new connection; the outcome."""
    whole, ok = complete(data)
    sock = _connect(port)
    try:
        try:
            sock.sendall(whole)
            if not ok:
                sock.shutdown(socket.SHUT_WR)
        except TimeoutError:
            return "handshake timeout"
        except OSError:  # the server closed first
            return "handshake closed"
        return "handshake " + _outcome(sock, False)
    finally:
        sock.close()


class LinkSession:
    """Mutated frames on one link, the next after the sentinel PONG of the last.

    Faster than a link per frame; a new link is made whenever the server closed one.
    """

    def __init__(self, port: int) -> None:
        self.port = port
        self.peer: RawPeer | None = None
        self.handshakes = 0

    def send(self, data: bytes) -> str:
        """Send ``data`` and return its outcome."""
        whole, ok = complete(data, PAD_MAX)
        if self.peer is None:
            self.peer = RawPeer(self.port)
            self.handshakes += 1
        sock = self.peer.sock
        try:
            if ok:
                sock.sendall(whole + frame(wire.FrameKind.PING, _SENTINEL_RID))
            else:
                sock.sendall(whole)
                sock.shutdown(socket.SHUT_WR)
            result = _outcome(sock, ok)
        except TimeoutError:
            result = "timeout"
        except OSError:  # the server closed first
            result = "closed"
        if not ok:
            result = f"hung up ({result})"
        if not result.startswith(("served", "error", "pull_data", "push_ack", "pong")):
            self.close()
        return result

    def close(self) -> None:
        """Close the current link."""
        if self.peer is not None:
            self.peer.close()
            self.peer = None


def settle(check: Callable[[], bool], timeout: float = WAIT) -> bool:
    """Poll ``check`` until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def good_client_works(engine: ServingEngine) -> bool:
    """A fresh peer pulls a batch row and gets exactly the engine's bytes."""
    engine.fill()
    access = Access(
        Target.CACHE_INDEX,
        ident=BATCH_ID,
        row=1,
        tensor_count=TENSORS,
        seg_bytes=ROW_BYTES,
    )
    with RawPeer(engine.port) as peer:
        answer = peer.pull(access, TENSORS * ROW_BYTES)
    if answer is None or answer.kind is not wire.FrameKind.PULL_DATA:
        return False
    expected = b"".join(
        engine.tensor(0, t)[ROW_BYTES : 2 * ROW_BYTES].tobytes() for t in range(TENSORS)
    )
    return answer.data == expected


@contextlib.contextmanager
def resources_flat(engine: ServingEngine) -> Iterator[dict[str, int]]:
    """Measure fds, threads and pool use around a block; the deltas land in the dict."""
    deltas: dict[str, int] = {}
    before = (_open_fds(), threading.active_count(), engine.pool_used())
    yield deltas
    # each count on its own (a tuple compares its first item first: one descriptor fewer
    # would hide a thread still running)
    settle(lambda: _open_fds() <= before[0] and threading.active_count() <= before[1])
    settle(lambda: engine.pins() == 0)
    deltas["fds"] = _open_fds() - before[0]
    deltas["threads"] = threading.active_count() - before[1]
    deltas["pool_bytes"] = engine.pool_used() - before[2]
    deltas["pins"] = engine.pins()


def fuzz_server(
    engine: ServingEngine, rng: random.Random, frames: int, handshakes: int, report: FuzzReport
) -> None:
    """Push ``frames`` mutated frames over links and ``handshakes`` mutated first frames."""
    seeds = seed_frames()
    session = LinkSession(engine.port)
    try:
        for _ in range(frames):
            data = mutate(rng, rng.choice(seeds), seeds)
            report.outcomes[session.send(data)] += 1
            report.frames += 1
    finally:
        session.close()
    report.handshakes += session.handshakes
    hellos = [hello_frame(rng.randrange(2000, 1 << 32)) for _ in range(4)] + seeds[:4]
    for _ in range(handshakes):
        data = mutate(rng, rng.choice(hellos), hellos)
        report.outcomes[fuzz_handshake_frame(engine.port, data)] += 1
        report.frames += 1


# -- the parsers ---------------------------------------------------------------------------------

_NUMBERS = re.compile(r"""b'[^']*'|b"[^"]*"|0x[0-9a-f]+|-?\d+|\([^)]*\)""")


def _reason(exc: Exception) -> str:
    return _NUMBERS.sub("N", str(exc))[:60]


def parse_frame(data: bytes) -> None:
    """Run every decoder a server applies to ``data`` (WireError or ValueError when bad)."""
    h = wire.decode_header(data[: wire.HEADER.size])
    body = data[wire.HEADER.size : wire.HEADER.size + h.body_len]
    if h.kind in (wire.FrameKind.HELLO, wire.FrameKind.HELLO_ACK):
        decode_extensions(wire.decode_hello(body).extensions)
    elif h.kind is wire.FrameKind.PULL:
        if len(body) < 8:
            raise wire.WireError("PULL body lacks its byte count")
        decode_access(body[8:]).nbytes  # noqa: B018 (the size computation is parsed too)
    elif h.kind is wire.FrameKind.PUSH:
        decode_access(body).nbytes  # noqa: B018
    elif h.kind is wire.FrameKind.ERROR:
        wire.decode_error_text(body)


def fuzz_parsers(rng: random.Random, frames: int, report: FuzzReport) -> None:
    """Push ``frames`` mutated frames (and a tenth as many region-board and UCX tables)
    through the decoders."""
    seeds = [
        *(pull_frame(i, a, n) for i, (a, n) in enumerate(valid_accesses())),
        hello_frame(3),
        frame(wire.FrameKind.ERROR, 1, b"refused"),
        frame(wire.FrameKind.PING, 1),
    ]
    for _ in range(frames):
        try:
            parse_frame(mutate(rng, rng.choice(seeds), seeds))
            report.parser["frame accepted"] += 1
        except (wire.WireError, ValueError) as exc:
            report.parser[f"frame: {_reason(exc)}"] += 1
    table = encode_entries(
        [BoardEntry(1, 5, 128, 8, 1024, (0x10000, 0x20000)), BoardEntry(2, -1, 64, 4, 256, (0,))]
    )
    for _ in range(frames // 10):
        try:
            RemoteRegions.decode(2, mutate(rng, table, [table]))
            report.parser["board accepted"] += 1
        except (ValueError, struct.error) as exc:
            report.parser[f"board: {_reason(exc)}"] += 1
    keys = [UcxKey(0x10000, 0x20000, "host", b"rkey"), UcxKey(0x1, 0x100, "cuda", b"k")]
    ucx_table = encode_table(
        3, b"worker", bytes(24), keys, [BoardEntry(1, 5, 128, 8, 1024, (0x10000, 0x20000))]
    )
    for _ in range(frames // 10):
        try:
            decode_table(mutate(rng, ucx_table, [ucx_table]))
            report.parser["ucx table accepted"] += 1
        except wire.WireError as exc:  # the one error a UCX table decoder raises
            report.parser[f"ucx table: {_reason(exc)}"] += 1


# -- floods: a peer that pipelines requests and reads the answers slowly -------------------------


def blocks_access(blocks: np.ndarray, seg_bytes: int) -> Access:
    """An access to ``seg_bytes`` of each of ``blocks`` of every tensor of the blocks cache."""
    return Access(
        Target.BLOCKS_KEY,
        ident=MODEL_ID,
        tensor_count=TENSORS,
        seg_bytes=seg_bytes,
        blocks=blocks.astype(np.uint64),
    )


def blocks_bytes(blocks: np.ndarray, seg_bytes: int) -> bytes:
    """What a pull of :func:`blocks_access` reads: tensor after tensor, block after block."""
    return b"".join(
        pattern(BLOCKS * BLOCK_BYTES, 10 + t)
        .reshape(BLOCKS, BLOCK_BYTES)[blocks, :seg_bytes]
        .tobytes()
        for t in range(TENSORS)
    )


class ServingProcess:
    """A :class:`ServingEngine` in a process of its own (``tests/peer_serving.py``) with the
    given serve limits, so that its memory can be measured apart from the peers'."""

    def __init__(self, queued_bytes: int, requests: int) -> None:
        root = Path(__file__).resolve().parents[1]
        path = os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))
        script = str(root / "tests" / "peer_serving.py")
        self.proc = subprocess.Popen(
            [sys.executable, script, str(queued_bytes), str(requests)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=path),
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"the serving process did not start: {line!r}")
        self.port = int(line)

    def rss(self) -> int:
        """Its resident memory in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise RuntimeError("no VmRSS")

    def stats(self, cluster_id: int) -> dict[str, Any]:
        """The stats of its live link to ``cluster_id`` (``ChannelStats`` as a dict).

        Raises:
            LookupError: no link to that cluster is live.
        """
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"stats {cluster_id}\n")
        self.proc.stdin.flush()
        stats = json.loads(self.proc.stdout.readline())
        if stats is None:
            raise LookupError(f"no live link to cluster {cluster_id}")
        return dict(stats)

    def dump_threads(self) -> None:
        """Have it write every thread's stack to its stderr (this test's captured stderr)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("threads\n")
        self.proc.stdin.flush()
        self.proc.stdout.readline()

    def close(self) -> None:
        """Finalize the engine and wait for the process (killed if it does not end)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(WAIT)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self.proc.stdout.close()


class Flood:
    """A hostile peer's sending half: frames from ``make(rid)`` sent from a thread as fast as
    the server takes them, ``batch`` a write, ``count`` of them (0: until stopped). Reading
    the answers is up to the caller (:meth:`read_one`, :meth:`read_all`)."""

    def __init__(
        self, peer: RawPeer, make: Callable[[int], bytes], batch: int, count: int = 0
    ) -> None:
        self.peer, self.make, self.batch, self.count = peer, make, batch, count
        self.sent = 0  # frames handed to the socket (counted before they go)
        self.answered = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not (self.count and self.sent >= self.count):
                n = min(self.batch, self.count - self.sent) if self.count else self.batch
                data = b"".join(self.make(rid) for rid in range(self.sent + 1, self.sent + n + 1))
                self.sent += n
                self.peer.sock.sendall(data)
        except BaseException as exc:
            self.error = exc

    def read_one(self, expected: bytes) -> None:
        """Read the next answer: it must be the PULL_DATA of the next pull, ``expected``."""
        answer = self.peer.read()
        if answer is None:
            raise AssertionError(f"the server closed the link after {self.answered} answers")
        self.answered += 1
        if (answer.kind, answer.rid) != (wire.FrameKind.PULL_DATA, self.answered):
            raise AssertionError(f"answer {self.answered} is {answer[:3]}")
        if answer.data != expected:
            raise AssertionError(f"answer {self.answered} differs")

    def read_all(self, expected: bytes) -> int:
        """Stop sending (a flood without a count), then read an answer to every frame sent,
        each the PULL_DATA of ``expected``, in order; how many were answered."""
        if not self.count:
            self._stop.set()
        while True:
            if self.answered == self.sent:
                self.thread.join(0.05)
                if not self.thread.is_alive() and self.answered == self.sent:
                    break
                continue
            self.read_one(expected)
        if self.error is not None:
            raise AssertionError(f"sending failed: {self.error!r}")
        return self.answered
