"""The control channel between nodes: framed JSON over TCP, authenticated, request/reply.

A decode node (the client) connects to a prefill node's control port once per peer and keeps
the connection. Frames are a 4-byte big-endian length and a JSON object. The handshake:

1. client: ``hello`` (protocol, its identity, a fresh nonce);
2. server: ``welcome`` (its identity and nonce as a signed ``body`` string, and with a link
   secret the server's proof over the transcript);
3. client: ``proof`` (its proof, or null without a secret);
4. server: ``ready``, or ``refused`` with the reason, and closes.

Proofs are ``aio_datadist._transport.auth``'s HMAC-SHA256 over both hellos and both nonces,
labelled for this protocol, so neither a link's proof nor a replay passes. After ``ready`` the
client sends requests ``{"op", "id", ...}``, each answered by ``{"re": id, "ok", ...}`` in any
order (the server handles each in a task of its own); the server may also send notices, frames
with an ``op`` and no ``re``. Everything foreign (``OSError``, a short read, bad JSON) becomes
:class:`ControlError` here, at the edge.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from aio_datadist._log import get_logger
from aio_datadist._transport.auth import (
    WRONG_CLIENT_PROOF,
    WRONG_SERVER_PROOF,
    LinkSecret,
    Side,
    Transcript,
    new_nonce,
    refusal_reason,
)

__all__ = (
    "MAX_FRAME",
    "PROTOCOL",
    "ControlClient",
    "ControlError",
    "ControlRefusal",
    "ControlServer",
    "Identity",
    "RequestHandler",
    "ServerConnection",
)

PROTOCOL = "aio_datadist-kv-control/1"
#: Largest frame either side accepts (bytes of JSON).
MAX_FRAME = 4 << 20
_LENGTH = struct.Struct(">I")
_LABEL = PROTOCOL.encode() + b"\0"
_HANDSHAKE_TIMEOUT_S = 10.0
_log = get_logger("connector.control")


class ControlError(Exception):
    """The control channel failed: refused, lost, or a peer that broke the protocol."""


class ControlRefusal(ControlError):
    """The peer answered a request with a refusal (``ok: false``); ``str()`` says why."""


@dataclass(frozen=True)
class Identity:
    """What a node tells its peers about itself in the handshake."""

    engine_id: str
    rank: int
    tp_size: int
    cluster_id: int
    #: Where its engine listens for transfer links (None: it does not listen).
    data: tuple[str, int] | None
    #: Its KV layout (``KvLayout.describe()``).
    layout: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """As a JSON object."""
        return {
            "engine_id": self.engine_id,
            "rank": self.rank,
            "tp_size": self.tp_size,
            "cluster_id": self.cluster_id,
            "data": list(self.data) if self.data is not None else None,
            "layout": self.layout,
        }

    @classmethod
    def from_json(cls, value: Any) -> Identity:
        """Read a peer's identity.

        :raises ControlError: not an identity.
        """
        try:
            data = value["data"]
            return cls(
                engine_id=str(value["engine_id"]),
                rank=int(value["rank"]),
                tp_size=int(value["tp_size"]),
                cluster_id=int(value["cluster_id"]),
                data=(str(data[0]), int(data[1])) if data is not None else None,
                layout=dict(value["layout"]),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ControlError(f"the peer sent a malformed identity ({exc!r})") from None


def _encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise ControlError(f"a control message of {len(body)} bytes is over {MAX_FRAME}")
    return _LENGTH.pack(len(body)) + body


async def _read(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """One frame: the message and its body bytes.

    :raises ControlError: the connection ended or the frame is not a JSON object.
    """
    try:
        (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if size > MAX_FRAME:
            raise ControlError(f"the peer sent a frame of {size} bytes (over {MAX_FRAME})")
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise ControlError("the peer closed the control connection") from None
    except (ConnectionError, OSError) as exc:
        raise ControlError(f"control connection lost: {exc}") from None
    try:
        message = json.loads(body)
    except ValueError:
        raise ControlError("the peer sent a frame that is not JSON") from None
    if not isinstance(message, dict):
        raise ControlError("the peer sent a frame that is not a JSON object")
    return message, body


async def _write(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    try:
        writer.write(_encode(message))
        await writer.drain()
    except (ConnectionError, OSError) as exc:
        raise ControlError(f"control connection lost: {exc}") from None


def _close(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, RuntimeError):
        writer.close()


def _transcript(hello: bytes, client_nonce: Any, server_nonce: Any, welcome: bytes) -> Transcript:
    try:
        cn, sn = bytes.fromhex(client_nonce), bytes.fromhex(server_nonce)
    except (TypeError, ValueError):
        raise ControlError("the handshake carries a malformed nonce") from None
    return Transcript(_LABEL + hello, cn, sn, welcome)


def _proof(value: Any) -> bytes | None:
    if value is None:
        return None
    try:
        return bytes.fromhex(value)
    except (TypeError, ValueError):
        raise ControlError("the handshake carries a malformed proof") from None


class ServerConnection:
    """One client connected to a :class:`ControlServer`, after its handshake."""

    def __init__(self, peer: Identity, writer: asyncio.StreamWriter) -> None:
        self.peer = peer
        self._writer = writer
        self._lock = asyncio.Lock()
        self.closed = False

    async def send(self, message: dict[str, Any]) -> None:
        """Send a frame (a reply or a notice).

        :raises ControlError: the connection is gone.
        """
        if self.closed:
            raise ControlError("the control connection is closed")
        async with self._lock:
            await _write(self._writer, message)

    def close(self) -> None:
        """Drop the connection."""
        self.closed = True
        _close(self._writer)


class RequestHandler(Protocol):
    """What a :class:`ControlServer` hands its clients' requests to."""

    async def on_request(
        self, connection: ServerConnection, op: str, message: dict[str, Any]
    ) -> dict[str, Any]:
        """Answer one request (the reply's fields); raise :class:`ControlRefusal` to refuse
        it with a reason."""
        ...

    def on_disconnect(self, connection: ServerConnection) -> None:
        """``connection`` is gone (its requests may still be running)."""
        ...


class ControlServer:
    """Accepts control connections and serves their requests."""

    def __init__(
        self,
        identity: Identity,
        secret: LinkSecret | None,
        handler: RequestHandler,
        log: Any = None,
    ) -> None:
        self._log = log if log is not None else _log
        self._identity = identity
        self._secret = secret
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._connections: set[ServerConnection] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (0: a free port); the address bound.

        :raises ControlError: the address cannot be used.
        """
        try:
            self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        except (OSError, ValueError) as exc:
            raise ControlError(
                f"cannot listen for control connections on {host}:{port}: {exc}"
            ) from None
        bound = self._server.sockets[0].getsockname()
        return host, int(bound[1])

    async def close(self) -> None:
        """Stop listening and drop every connection."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Identity:
        hello, hello_bytes = await _read(reader)
        if hello.get("op") != "hello" or hello.get("protocol") != PROTOCOL:
            raise ControlError(f"not a {PROTOCOL} client (hello {hello.get('protocol')!r})")
        peer = Identity.from_json(hello.get("identity"))
        nonce = new_nonce().hex()
        body = json.dumps(
            {"protocol": PROTOCOL, "identity": self._identity.to_json(), "nonce": nonce},
            separators=(",", ":"),
        )
        transcript = _transcript(hello_bytes, hello.get("nonce"), nonce, body.encode())
        proof = None if self._secret is None else self._secret.prove(Side.SERVER, transcript)
        await _write(
            writer, {"op": "welcome", "body": body, "proof": proof.hex() if proof else None}
        )
        answer, _ = await _read(reader)
        client_proof = _proof(answer.get("proof"))
        reason = refusal_reason(
            client_secret=client_proof is not None, server_secret=self._secret is not None
        )
        if reason is None and self._secret is not None and client_proof is not None:
            client_transcript = _transcript(hello_bytes, hello.get("nonce"), nonce, b"")
            if not self._secret.verify(Side.CLIENT, client_transcript, client_proof):
                reason = WRONG_CLIENT_PROOF
        if reason is not None:
            await _write(writer, {"op": "refused", "reason": reason})
            raise ControlError(reason)
        await _write(writer, {"op": "ready"})
        return peer

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            peer = await asyncio.wait_for(self._handshake(reader, writer), _HANDSHAKE_TIMEOUT_S)
        except (TimeoutError, ControlError) as exc:
            peer = writer.get_extra_info("peername")
            self._log.warning(
                "control.handshake_refused", peer=str(peer), error=str(exc) or "timed out"
            )
            _close(writer)
            return
        connection = ServerConnection(peer, writer)
        self._connections.add(connection)
        try:
            while True:
                message, _ = await _read(reader)
                task = asyncio.get_running_loop().create_task(self._answer(connection, message))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except ControlError:
            pass
        finally:
            connection.close()
            self._connections.discard(connection)
            self._handler.on_disconnect(connection)

    async def _answer(self, connection: ServerConnection, message: dict[str, Any]) -> None:
        request_id = message.get("id")
        op = message.get("op")
        try:
            if not isinstance(op, str) or not isinstance(request_id, int):
                raise ControlRefusal(f"malformed request {message!r:.200}")
            reply = {
                "re": request_id,
                "ok": True,
                **await self._handler.on_request(connection, op, message),
            }
        except ControlRefusal as exc:
            reply = {"re": request_id, "ok": False, "error": str(exc)}
        except Exception as exc:  # a handler bug answers the request and is logged
            self._log.error("control.handler_failed", op=op, error=repr(exc), exc_info=exc)
            reply = {"re": request_id, "ok": False, "error": f"internal error: {exc!r}"}
        with contextlib.suppress(ControlError):
            await connection.send(reply)


class ControlClient:
    """A connection to a peer's :class:`ControlServer`: requests, and the peer's notices."""

    def __init__(
        self,
        peer: Identity,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_notice: Callable[[dict[str, Any]], None],
        on_close: Callable[[ControlClient, ControlError], None],
    ) -> None:
        self.peer = peer
        self._writer = writer
        self._on_notice = on_notice
        self._on_close = on_close
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 1
        self._lock = asyncio.Lock()
        self.closed = False
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        identity: Identity,
        secret: LinkSecret | None,
        timeout_s: float,
        on_notice: Callable[[dict[str, Any]], None],
        on_close: Callable[[ControlClient, ControlError], None],
    ) -> ControlClient:
        """Connect and shake hands within ``timeout_s``.

        :raises ControlError: refused, unreachable, timed out, or the peer's proof is wrong.
        """

        async def shake() -> ControlClient:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except (OSError, ValueError) as exc:
                raise ControlError(f"cannot reach {host}:{port}: {exc}") from None
            try:
                peer = await cls._handshake(reader, writer, identity, secret)
            except BaseException:
                _close(writer)
                raise
            return cls(peer, reader, writer, on_notice, on_close)

        try:
            return await asyncio.wait_for(shake(), timeout_s)
        except TimeoutError:
            raise ControlError(f"no handshake with {host}:{port} within {timeout_s:g} s") from None

    @staticmethod
    async def _handshake(
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        identity: Identity,
        secret: LinkSecret | None,
    ) -> Identity:
        nonce = new_nonce().hex()
        hello = {
            "op": "hello",
            "protocol": PROTOCOL,
            "identity": identity.to_json(),
            "nonce": nonce,
        }
        frame = _encode(hello)
        try:
            writer.write(frame)
            await writer.drain()
        except (ConnectionError, OSError) as exc:
            raise ControlError(f"control connection lost: {exc}") from None
        hello_bytes = frame[_LENGTH.size :]
        welcome, _ = await _read(reader)
        if welcome.get("op") == "refused":
            raise ControlError(f"refused: {welcome.get('reason')}")
        body = welcome.get("body")
        if welcome.get("op") != "welcome" or not isinstance(body, str):
            raise ControlError("the peer does not speak the control protocol")
        try:
            info = json.loads(body)
        except ValueError:
            raise ControlError("the peer sent a malformed welcome") from None
        if not isinstance(info, dict) or info.get("protocol") != PROTOCOL:
            raise ControlError(f"the peer speaks {info!r:.100}, not {PROTOCOL}")
        server_proof = _proof(welcome.get("proof"))
        reason = refusal_reason(
            client_secret=secret is not None, server_secret=server_proof is not None
        )
        transcript = _transcript(hello_bytes, nonce, info.get("nonce"), body.encode())
        if (
            reason is None
            and secret is not None
            and server_proof is not None
            and not secret.verify(Side.SERVER, transcript, server_proof)
        ):
            reason = WRONG_SERVER_PROOF
        if reason is not None:
            raise ControlError(reason)
        client_transcript = _transcript(hello_bytes, nonce, info["nonce"], b"")
        proof = None if secret is None else secret.prove(Side.CLIENT, client_transcript).hex()
        await _write(writer, {"op": "proof", "proof": proof})
        answer, _ = await _read(reader)
        if answer.get("op") != "ready":
            raise ControlError(f"refused: {answer.get('reason', answer)}")
        return Identity.from_json(info.get("identity"))

    async def call(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """Send request ``op`` and await its reply (within ``timeout_s``).

        :raises ControlRefusal: the peer refused it (the reason is the message).
        :raises ControlError: the connection is gone or the reply did not come in time.
        """
        if self.closed:
            raise ControlError("the control connection is closed")
        request_id = self._next_id
        self._next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            async with self._lock:
                await _write(self._writer, {"op": op, "id": request_id, **fields})
            try:
                reply = await asyncio.wait_for(asyncio.shield(future), timeout_s)
            except TimeoutError:
                raise ControlError(f"no answer to {op} within {timeout_s:g} s") from None
        finally:
            self._pending.pop(request_id, None)
        if not reply.get("ok"):
            raise ControlRefusal(str(reply.get("error", "refused")))
        return reply

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        error = ControlError("the control connection is closed")
        try:
            while True:
                message, _ = await _read(reader)
                reply_to = message.get("re")
                if reply_to is None:
                    try:
                        self._on_notice(message)
                    except Exception as exc:  # a notice handler bug is logged, not fatal
                        _log.error("control.notice_failed", error=repr(exc), exc_info=exc)
                    continue
                future = self._pending.get(reply_to) if isinstance(reply_to, int) else None
                if future is not None and not future.done():
                    future.set_result(message)
        except ControlError as exc:
            error = exc
        except asyncio.CancelledError:
            pass
        finally:
            self._shut(error)

    def _shut(self, error: ControlError) -> None:
        if self.closed:
            return
        self.closed = True
        _close(self._writer)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ControlError(str(error)))
        self._on_close(self, error)

    async def close(self) -> None:
        """Close the connection; pending requests fail with :class:`ControlError`."""
        self._shut(ControlError("the control connection was closed here"))
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task
