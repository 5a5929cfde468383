"""LLMClusterInfo: ids, roles, ip conversion, port checks, repr."""

from __future__ import annotations

import socket
import struct
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aio_datadist.cluster import LLMClusterInfo, ip_int_to_str, ip_str_to_int
from aio_datadist.enums import LLMRole


def test_fresh_info() -> None:
    info = LLMClusterInfo()
    assert info.remote_cluster_id is None
    assert info.remote_role_type is None
    assert info.local_ip_info_list == []
    assert info.remote_ip_info_list == []


def test_remote_cluster_id() -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = 2**64 - 1
    assert info.remote_cluster_id == 2**64 - 1
    info.remote_cluster_id = 0
    assert info.remote_cluster_id == 0


@pytest.mark.parametrize("value", [-1, 2**64])
def test_remote_cluster_id_range(value: int) -> None:
    with pytest.raises(ValueError, match="remote_cluster_id"):
        LLMClusterInfo().remote_cluster_id = value


@pytest.mark.parametrize("value", ["1", 1.0, None, True])
def test_remote_cluster_id_type(value: Any) -> None:
    with pytest.raises(TypeError, match="remote_cluster_id"):
        LLMClusterInfo().remote_cluster_id = value


def test_remote_role_type() -> None:
    info = LLMClusterInfo()
    info.remote_role_type = LLMRole.DECODER
    assert info.remote_role_type is LLMRole.DECODER
    info.remote_role_type = 1
    assert info.remote_role_type == 1
    with pytest.raises(TypeError, match="remote_role_type"):
        info.remote_role_type = "PROMPT"  # type: ignore[assignment]


def test_ip_string_is_little_endian() -> None:
    info = LLMClusterInfo()
    info.append_local_ip_info("1.2.3.4", 26000)
    info.append_remote_ip_info("192.168.1.1", 0)
    assert info.local_ip_info_list == [(0x04030201, 26000)]
    assert info.remote_ip_info_list == [(0x0101A8C0, 0)]


def test_ip_int_passes_through() -> None:
    info = LLMClusterInfo()
    info.append_remote_ip_info(0x0100007F, 65535)
    info.append_remote_ip_info("127.0.0.1", 1)
    assert info.remote_ip_info_list == [(0x0100007F, 65535), (0x0100007F, 1)]


@pytest.mark.parametrize("ip", ["1.2.3.x", "", "300.1.1.1", "1.2.3.4\x00", "\u00e9"])
def test_bad_ip_string(ip: str) -> None:
    with pytest.raises(RuntimeError, match="Can not parse ip str:"):
        LLMClusterInfo().append_local_ip_info(ip, 1)


@pytest.mark.parametrize("ip", ["localhost", "prompt-0.cluster.local"])
def test_a_host_name_is_refused_with_the_cause(ip: str) -> None:
    with pytest.raises(RuntimeError) as exc_info:
        LLMClusterInfo().append_remote_ip_info(ip, 1)
    message = str(exc_info.value)
    assert message.startswith(f"Can not parse ip str:{ip}: ")
    assert f"{ip!r} is a host name" in message
    assert "pass a dotted IPv4 address such as 127.0.0.1" in message


def test_a_malformed_ip_names_what_is_accepted() -> None:
    with pytest.raises(RuntimeError) as exc_info:
        LLMClusterInfo().append_local_ip_info("300.1.1.1", 1)
    message = str(exc_info.value)
    assert message.startswith("Can not parse ip str:300.1.1.1: ")
    assert "not a dotted IPv4 address" in message and "127.0.0.1" in message


@pytest.mark.parametrize("port", [-1, 65536])
def test_port_out_of_uint16(port: int) -> None:
    info = LLMClusterInfo()
    with pytest.raises(ValueError, match="port"):
        info.append_local_ip_info("1.1.1.1", port)
    with pytest.raises(ValueError, match="port"):
        info.append_remote_ip_info("1.1.1.1", port)
    assert info.local_ip_info_list == []
    assert info.remote_ip_info_list == []


@pytest.mark.parametrize("ip, port", [(1.5, 1), (None, 1), (b"1.1.1.1", 1), ("1.1.1.1", "1")])
def test_type_errors(ip: Any, port: Any) -> None:
    with pytest.raises(TypeError):
        LLMClusterInfo().append_remote_ip_info(ip, port)


@pytest.mark.parametrize("ip", [-1, 2**32])
def test_int_ip_out_of_uint32(ip: int) -> None:
    with pytest.raises(ValueError, match="ip"):
        LLMClusterInfo().append_remote_ip_info(ip, 1)


def test_ip_int_to_str() -> None:
    assert ip_int_to_str(0x0100007F) == "127.0.0.1"
    assert ip_int_to_str(ip_str_to_int("10.20.30.40")) == "10.20.30.40"
    with pytest.raises(ValueError):
        ip_int_to_str(2**32)
    with pytest.raises(TypeError):
        ip_int_to_str("1.1.1.1")  # type: ignore[arg-type]


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_ip_round_trip(ip: int) -> None:
    text = ip_int_to_str(ip)
    assert ip_str_to_int(text) == ip
    # Little-endian: the first dotted octet is the least significant byte.
    assert struct.unpack("<I", socket.inet_aton(text))[0] == ip


def test_repr() -> None:
    info = LLMClusterInfo()
    info.remote_cluster_id = 7
    info.append_local_ip_info("10.0.0.1", 0)
    info.append_remote_ip_info("10.0.0.2", 26000)
    info.append_remote_ip_info("10.0.0.3", 26001)
    assert repr(info) == (
        "LLMClusterInfo(remote_cluster_id=7, remote_role_type=None, "
        "local_ip_info_list=[10.0.0.1:0], "
        "remote_ip_info_list=[10.0.0.2:26000, 10.0.0.3:26001])"
    )
