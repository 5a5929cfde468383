"""What the connector core reads from outside: its settings, a request's kv_transfer_params,
and frames on its control port. Bad input gets a clear error and nothing else: no crash, no
hang, and the server goes on serving."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aio_datadist._connector.config import ConnectorConfig
from aio_datadist._connector.control import (
    MAX_FRAME,
    ControlClient,
    ControlError,
    ControlRefusal,
    ControlServer,
    Identity,
    ServerConnection,
)
from aio_datadist._connector.params import RemoteSource, producer_params
from aio_datadist._transport.auth import LinkSecret

# -- settings ---------------------------------------------------------------------------------


def test_settings_have_defaults_and_pass_engine_options_through() -> None:
    config = ConnectorConfig.from_extra(
        {"port": 7100, "transport": "tcp", "same_host": "false", "ucx_lanes": 2},
        default_host="10.0.0.1",
    )
    assert (config.host, config.port, config.mode) == ("10.0.0.1", 7100, "pull")
    assert config.rank_port(7100, 3) == 7103 and config.rank_port(0, 3) == 0
    options = config.llm_config(listen="10.0.0.1:0", device_id=0).generate_options()
    assert options["aio.Transport"] == "tcp" and options["aio.SameHost"] == "0"
    assert options["llm.SyncKvCacheWaitTime"] == "30000"
    assert options["llm.EnableRemoteCacheAccessible"] == "1"
    assert "secret" not in repr(ConnectorConfig.from_extra({"link_secret": "s"}, default_host="h"))


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"prot": 1}, "unknown connector setting"),
        ({"mode": "pulll"}, "mode"),
        ({"port": 70000}, "port"),
        ({"port": "x"}, "port"),
        ({"port": True}, "port"),
        ({"abort_timeout": 0}, "abort_timeout"),
        ({"abort_timeout": "nan"}, "abort_timeout"),
        ({"load_timeout": -1}, "load_timeout"),
        ({"same_host": "maybe"}, "same_host"),
        ({"transport": 3}, "transport"),
        ({"transport": "carrier-pigeon"}, "transport"),
        ({"ucx_lanes": 99}, "ucx_lanes"),
        ({"link_secret": ""}, "link_secret"),
        ({"host": ""}, "host"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(extra: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ConnectorConfig.from_extra(extra, default_host="127.0.0.1")


def test_the_vllm_module_says_what_it_needs_without_vllm() -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ImportError, match=r"pip install 'aio_datadist\[vllm\]'"):
        import aio_datadist.vllm  # noqa: F401


# -- kv_transfer_params -----------------------------------------------------------------------


def test_producer_params_read_back() -> None:
    params = producer_params(
        engine_id="e",
        request_id="r",
        ranks=[("10.0.0.1", 7100), ("10.0.0.1", 7101)],
        block_ids=[3, 4],
        num_tokens=40,
        tp_size=2,
        mode="pull",
        transfer_id=None,
    )
    source = RemoteSource.from_params(json.loads(json.dumps(params)))
    assert source.address(1) == ("10.0.0.1", 7101) and source.block_ids == (3, 4)
    with pytest.raises(ValueError, match="rank 2"):
        source.address(2)
    with pytest.raises(ValueError, match="connector version"):
        RemoteSource.from_params({**params, "connector_version": 99})
    with pytest.raises(ValueError, match="NixlConnector"):
        RemoteSource.from_params({**params, "connector": "NixlConnector"})
    with pytest.raises(ValueError, match="transfer_id"):
        RemoteSource.from_params({**params, "transfer_mode": "push"})


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
KEYS = st.sampled_from(
    [
        "remote_host", "remote_port", "remote_ranks", "remote_block_ids", "remote_request_id",
        "transfer_mode", "transfer_id", "tp_size", "remote_num_tokens", "connector",
        "connector_version", "do_remote_prefill",
    ]
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(KEYS | st.text(max_size=6), JSON, max_size=12))
def test_any_params_read_or_are_refused_with_value_error(params: dict[str, Any]) -> None:
    try:
        source = RemoteSource.from_params(params)
    except ValueError:
        return
    assert isinstance(source.host, str) and isinstance(source.port, int)
    assert all(isinstance(b, int) and b >= 0 for b in source.block_ids)


# -- the control port -------------------------------------------------------------------------

IDENTITY = Identity("e", 0, 1, 7, ("127.0.0.1", 1), {"num_layers": 1})


class Echo:
    """A request handler that answers ``ping`` and refuses the rest."""

    async def on_request(
        self, connection: ServerConnection, op: str, message: dict[str, Any]
    ) -> dict[str, Any]:
        if op != "ping":
            raise ControlRefusal(f"no {op}")
        return {"pong": message.get("n")}

    def on_disconnect(self, connection: ServerConnection) -> None:
        pass


async def serve(secret: LinkSecret | None = None) -> tuple[ControlServer, int]:
    server = ControlServer(IDENTITY, secret, Echo())
    _, port = await server.start("127.0.0.1", 0)
    return server, port


async def client(port: int, secret: LinkSecret | None = None) -> ControlClient:
    return await ControlClient.connect(
        "127.0.0.1", port, IDENTITY, secret, 5.0, lambda _: None, lambda *_: None
    )


async def test_requests_are_answered_and_refusals_carry_the_reason() -> None:
    server, port = await serve()
    peer = await client(port)
    try:
        assert peer.peer == IDENTITY
        replies = await asyncio.gather(*(peer.call("ping", 5.0, n=i) for i in range(20)))
        assert [r["pong"] for r in replies] == list(range(20))
        with pytest.raises(ControlRefusal, match="no nope"):
            await peer.call("nope", 5.0)
    finally:
        await peer.close()
        await server.close()


@pytest.mark.parametrize(
    ("server_secret", "client_secret", "says"),
    [("a", "b", "secrets differ"), ("a", None, "requires a link secret"), (None, "a", "has none")],
)
async def test_a_handshake_with_another_secret_is_refused(
    server_secret: str | None, client_secret: str | None, says: str
) -> None:
    server, port = await serve(LinkSecret(server_secret) if server_secret else None)
    try:
        with pytest.raises(ControlError, match=says):
            await client(port, LinkSecret(client_secret) if client_secret else None)
        assert (await client(port, LinkSecret(server_secret) if server_secret else None)).peer
    finally:
        await server.close()


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=600), st.booleans())
def test_garbage_on_the_control_port_is_dropped_and_serving_goes_on(
    junk: bytes, framed: bool
) -> None:
    async def scenario() -> None:
        server, port = await serve()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            payload = struct.pack(">I", len(junk)) + junk if framed else junk
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            await asyncio.wait_for(reader.read(), 12)  # the server answers or closes
            writer.close()
            peer = await client(port)
            assert (await peer.call("ping", 5.0, n=1))["pong"] == 1
            await peer.close()
        finally:
            await server.close()

    asyncio.run(scenario())


async def test_an_oversized_frame_is_refused_without_reading_it() -> None:
    server, port = await serve()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(struct.pack(">I", MAX_FRAME + 1))
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 12) == b""  # closed
        writer.close()
    finally:
        await server.close()
