"""LLMConfig settings and generate_options, the option-key table, and init-time option parsing."""

from __future__ import annotations

import math
from typing import Any

import pytest

from aio_datadist import LLMClusterInfo, LLMDataDist
from aio_datadist.config import (
    MAX_BUSY_POLL_US,
    OPTION_BUSY_POLL_US,
    OPTION_KEYS,
    OPTION_TRANSFER_BACKEND,
    OPTION_TRANSPORT,
    LLMConfig,
    LlmConfig,
    parse_listen_ip_info,
    parse_mem_pool_cfg,
    prepare_init_options,
)
from aio_datadist.enums import LLMRole
from aio_datadist.status import LLMException, LLMStatusCode
from tests.conftest import make_options, pool_cfg

PARAM_INVALID = LLMStatusCode.LLM_PARAM_INVALID
MEM = {"llm.MemoryUtilization": "0.95"}


def assert_param_invalid(exc_info: pytest.ExceptionInfo[LLMException]) -> None:
    assert exc_info.value.status_code == PARAM_INVALID


# -- generate_options ---------------------------------------------------------------------


def test_alias_and_fresh_config() -> None:
    assert LlmConfig is LLMConfig
    cfg = LLMConfig()
    assert cfg.options == {}
    assert cfg.generate_options() == MEM
    assert cfg.gen_options() is cfg.options


def test_fresh_getters() -> None:
    cfg = LLMConfig()
    assert cfg.device_id is None
    assert cfg.sync_kv_timeout is None
    assert cfg.ge_options == {}
    assert cfg.listen_ip_info == ""
    assert cfg.enable_cache_manager is False
    assert cfg.enable_remote_cache_accessible is False
    assert cfg.mem_pool_cfg == ""
    assert cfg.host_mem_pool_cfg == ""
    assert cfg.rdma_traffic_class is None
    assert cfg.rdma_service_level is None
    assert cfg.local_comm_res == ""
    assert cfg.link_total_time == 0
    assert cfg.link_retry_count == 1
    assert cfg.transfer_backend == ""
    assert cfg.global_resource_config == ""
    assert cfg.enable_switch_role is False
    assert cfg.deploy_res_path == ""
    assert cfg.buf_pool_cfg == ""
    assert cfg.output_max_size is None
    assert cfg.mem_utilization == 0.95
    assert cfg.cluster_info == ""
    assert cfg.transport is None


def test_vllm_ascend_config() -> None:
    cfg = LLMConfig()
    cfg.device_id = 3
    cfg.sync_kv_timeout = 20000
    cfg.enable_switch_role = True
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = True
    assert cfg.generate_options() == {
        "ge.exec.deviceId": "3",
        "ge.session_device_id": "3",
        "llm.SyncKvCacheWaitTime": "20000",
        "llm.EnableSwitchRole": "1",
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemoryUtilization": "0.95",
    }


def test_every_setting_writes_its_key() -> None:
    cfg = LLMConfig()
    cfg.ge_options = {"ge.flowGraphMemMaxSize": "4106127360"}
    cfg.device_id = [0, 1]
    cfg.sync_kv_timeout = "1500"
    cfg.listen_ip_info = "192.168.1.1:26000"
    cfg.enable_cache_manager = True
    cfg.enable_remote_cache_accessible = False
    cfg.mem_pool_cfg = '{"memory_size": 1024}'
    cfg.host_mem_pool_cfg = '{"memory_size": 2048}'
    cfg.rdma_traffic_class = 132
    cfg.rdma_service_level = 4
    cfg.local_comm_res = '{"version": "1.3"}'
    cfg.link_total_time = 20
    cfg.link_retry_count = 2
    cfg.transfer_backend = "hixl"
    cfg.global_resource_config = "{}"
    cfg.enable_switch_role = True
    cfg.deploy_res_path = "/res"
    cfg.buf_pool_cfg = "buf"
    cfg.output_max_size = 77
    cfg.mem_utilization = 0.5
    cfg.cluster_info = '{"cluster_id": 1}'
    cfg.transport = "loopback"
    cfg.same_host = False
    cfg.link_secret = b"\x00k"
    cfg.busy_poll_us = 0
    cfg.zero_on_alloc = True
    cfg.metrics = False
    cfg.ucx = True
    cfg.ucx_lanes = 4
    assert cfg.generate_options() == {
        "ge.flowGraphMemMaxSize": "4106127360",
        "ge.exec.deviceId": "0;1",
        "ge.session_device_id": "0",
        "llm.SyncKvCacheWaitTime": "1500",
        "llm.listenIpInfo": "192.168.1.1:26000",
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "0",
        "llm.MemPoolConfig": '{"memory_size": 1024}',
        "llm.HostMemPoolConfig": '{"memory_size": 2048}',
        "llm.RdmaTrafficClass": "132",
        "llm.RdmaServiceLevel": "4",
        "llm.LocalCommRes": '{"version": "1.3"}',
        "llm.LinkTotalTime": "20",
        "llm.LinkRetryCount": "2",
        "llm.TransferBackend": "hixl",
        "llm.GlobalResourceConfig": "{}",
        "llm.EnableSwitchRole": "1",
        "llm.deployResPath": "/res",
        "llm.BufPoolCfg": "buf",
        "llm.OutputMaxSize": "77",
        "llm.MemoryUtilization": "0.5",
        "llm.ClusterInfo": '{"cluster_id": 1}',
        "aio.Transport": "loopback",
        "aio.SameHost": "0",
        "aio.LinkSecret": "hex:006b",
        "aio.BusyPollUs": "0",
        "aio.ZeroOnAlloc": "1",
        "aio.Metrics": "0",
        "aio.Ucx": "1",
        "aio.UcxLanes": "4",
    }
    # The table names exactly the keys the settings wrote (plus ge_options and the session id).
    written = set(cfg.options) - {"ge.flowGraphMemMaxSize", "ge.session_device_id"}
    assert written == set(OPTION_KEYS.values())


def test_options_are_cumulative_and_the_same_dict() -> None:
    cfg = LLMConfig()
    cfg.listen_ip_info = "1.1.1.1:1"
    first = cfg.generate_options()
    cfg.listen_ip_info = None  # reset, but the earlier key stays: options accumulate
    cfg.device_id = 0
    second = cfg.generate_options()
    assert second is first
    assert second["llm.listenIpInfo"] == "1.1.1.1:1"
    assert second["ge.exec.deviceId"] == "0"


def test_ge_options_merged_first_then_overridden() -> None:
    cfg = LLMConfig()
    cfg.ge_options = {"ge.exec.deviceId": "9", "custom": "x"}
    cfg.device_id = 1
    opts = cfg.generate_options()
    assert opts["ge.exec.deviceId"] == "1"
    assert opts["custom"] == "x"


def test_ge_options_validation() -> None:
    cfg = LLMConfig()
    with pytest.raises(TypeError):
        cfg.ge_options = [("a", "b")]  # type: ignore[assignment]
    with pytest.raises(TypeError):
        cfg.ge_options = {"a": 1}  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        cfg.ge_options = {1: "a"}  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        cfg.ge_options = None  # type: ignore[assignment]
    source = {"a": "b"}
    cfg.ge_options = source
    source["c"] = "d"
    assert cfg.ge_options == {"a": "b"}


def test_unset_settings_are_absent() -> None:
    cfg = LLMConfig()
    cfg.mem_pool_cfg = ""
    cfg.host_mem_pool_cfg = ""
    cfg.listen_ip_info = ""
    cfg.enable_switch_role = False
    assert cfg.generate_options() == MEM


def test_empty_strings_written_when_set() -> None:
    cfg = LLMConfig()
    cfg.local_comm_res = ""
    cfg.transfer_backend = ""
    cfg.global_resource_config = ""
    assert cfg.generate_options() == {
        "llm.LocalCommRes": "",
        "llm.TransferBackend": "",
        "llm.GlobalResourceConfig": "",
        **MEM,
    }


def test_none_resets_optional_settings() -> None:
    cfg = LLMConfig()
    cfg.local_comm_res = "x"
    cfg.enable_cache_manager = True
    cfg.transport = "tcp"
    cfg.local_comm_res = None
    cfg.enable_cache_manager = None
    cfg.transport = None
    assert cfg.local_comm_res == ""
    assert cfg.enable_cache_manager is False
    assert cfg.transport is None
    assert cfg.generate_options() == MEM


@pytest.mark.parametrize("value, expected", [(True, "1"), (False, "0")])
@pytest.mark.parametrize(
    "name, key",
    [
        ("enable_cache_manager", "llm.EnableCacheManager"),
        ("enable_remote_cache_accessible", "llm.EnableRemoteCacheAccessible"),
    ],
)
def test_bool_settings(name: str, key: str, value: bool, expected: str) -> None:
    cfg = LLMConfig()
    setattr(cfg, name, value)
    assert getattr(cfg, name) is value
    assert cfg.generate_options()[key] == expected


@pytest.mark.parametrize(
    "name", ["enable_cache_manager", "enable_remote_cache_accessible", "enable_switch_role"]
)
@pytest.mark.parametrize("value", [1, "True", 0])
def test_bool_settings_reject_non_bool(name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=name):
        setattr(LLMConfig(), name, value)


def test_enable_switch_role_false_is_not_written() -> None:
    cfg = LLMConfig()
    cfg.enable_switch_role = False
    assert "llm.EnableSwitchRole" not in cfg.generate_options()
    cfg.enable_switch_role = True
    assert cfg.generate_options()["llm.EnableSwitchRole"] == "1"


@pytest.mark.parametrize(
    "name",
    [
        "listen_ip_info",
        "mem_pool_cfg",
        "host_mem_pool_cfg",
        "local_comm_res",
        "transfer_backend",
        "global_resource_config",
        "deploy_res_path",
        "buf_pool_cfg",
        "cluster_info",
        "transport",
    ],
)
def test_str_settings_reject_non_str(name: str) -> None:
    with pytest.raises(TypeError, match=name):
        setattr(LLMConfig(), name, 5)


def test_unknown_attribute_is_refused() -> None:
    cfg = LLMConfig()
    with pytest.raises(AttributeError):
        cfg.devcie_id = 0  # type: ignore[attr-defined]


# -- device_id ----------------------------------------------------------------------------


def test_device_id_forms() -> None:
    cfg = LLMConfig()
    cfg.device_id = (2, 5)
    assert cfg.device_id == (2, 5)
    opts = cfg.generate_options()
    assert opts["ge.exec.deviceId"] == "2;5"
    assert opts["ge.session_device_id"] == "2"
    single = LLMConfig()
    single.device_id = [7]
    assert single.device_id == [7]
    assert single.generate_options()["ge.exec.deviceId"] == "7"
    cfg.device_id = 2**31 - 1
    assert cfg.generate_options()["ge.session_device_id"] == str(2**31 - 1)


@pytest.mark.parametrize("value", ["0", 1.0, True, None, [0, "1"], [False]])
def test_device_id_type_errors(value: Any) -> None:
    with pytest.raises(TypeError, match="device_id"):
        LLMConfig().device_id = value


@pytest.mark.parametrize("value", [-1, [0, -1], [], (), [2**40, -1]])
def test_device_id_invalid(value: Any) -> None:
    with pytest.raises(LLMException) as exc_info:
        LLMConfig().device_id = value
    assert_param_invalid(exc_info)


@pytest.mark.parametrize("value", [2**31, [0, 2**31]])
def test_device_id_out_of_int32(value: Any) -> None:
    with pytest.raises(ValueError, match="device_id"):
        LLMConfig().device_id = value


# -- sync_kv_timeout ------------------------------------------------------------------------


@pytest.mark.parametrize("value, written", [(1, "1"), ("250", "250"), (2**31 - 1, str(2**31 - 1))])
def test_sync_kv_timeout(value: int | str, written: str) -> None:
    cfg = LLMConfig()
    cfg.sync_kv_timeout = value
    assert cfg.sync_kv_timeout == value
    assert cfg.generate_options()["llm.SyncKvCacheWaitTime"] == written


@pytest.mark.parametrize("value", [0, -5, "0", "abc", "-5", "1.5", "", "\u00b2"])
def test_sync_kv_timeout_invalid(value: int | str) -> None:
    with pytest.raises(LLMException) as exc_info:
        LLMConfig().sync_kv_timeout = value
    assert_param_invalid(exc_info)


@pytest.mark.parametrize("value", [2**31, "99999999999"])
def test_sync_kv_timeout_out_of_int32(value: int | str) -> None:
    with pytest.raises(ValueError, match="sync_kv_timeout"):
        LLMConfig().sync_kv_timeout = value


@pytest.mark.parametrize("value", [1.5, None, True, [1]])
def test_sync_kv_timeout_type_error(value: Any) -> None:
    with pytest.raises(TypeError, match="sync_kv_timeout"):
        LLMConfig().sync_kv_timeout = value


# -- integer settings ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["rdma_traffic_class", "rdma_service_level"])
def test_rdma_settings(name: str) -> None:
    cfg = LLMConfig()
    setattr(cfg, name, 0)
    assert getattr(cfg, name) == 0
    setattr(cfg, name, 2**32 - 1)
    assert cfg.generate_options()[OPTION_KEYS[name]] == str(2**32 - 1)
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match=name):
            setattr(cfg, name, bad)
    for bad_type in ("4", 4.0, None, True):
        with pytest.raises(TypeError, match=name):
            setattr(cfg, name, bad_type)


def test_link_total_time() -> None:
    cfg = LLMConfig()
    cfg.link_total_time = 0
    assert cfg.generate_options()["llm.LinkTotalTime"] == "0"
    cfg.link_total_time = 2**32 - 1
    assert cfg.link_total_time == 2**32 - 1
    for bad in (-1, 2**32):
        with pytest.raises(LLMException) as exc_info:
            cfg.link_total_time = bad
        assert_param_invalid(exc_info)
    with pytest.raises(TypeError, match="link_total_time"):
        cfg.link_total_time = "20"  # type: ignore[assignment]


def test_link_retry_count() -> None:
    cfg = LLMConfig()
    cfg.link_retry_count = 100
    assert cfg.link_retry_count == 100
    assert cfg.generate_options()["llm.LinkRetryCount"] == "100"
    for bad in (0, 101, -1):
        with pytest.raises(LLMException) as exc_info:
            cfg.link_retry_count = bad
        assert_param_invalid(exc_info)
    with pytest.raises(TypeError, match="link_retry_count"):
        cfg.link_retry_count = 2.0  # type: ignore[assignment]


def test_output_max_size() -> None:
    cfg = LLMConfig()
    cfg.output_max_size = 0
    assert cfg.generate_options()["llm.OutputMaxSize"] == "0"
    with pytest.raises(TypeError, match="output_max_size"):
        cfg.output_max_size = "1"  # type: ignore[assignment]


# -- mem_utilization ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 0.5, 1.0])
def test_mem_utilization(value: float) -> None:
    cfg = LLMConfig()
    cfg.mem_utilization = value
    assert cfg.mem_utilization == value
    assert cfg.generate_options()["llm.MemoryUtilization"] == str(value)


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf])
def test_mem_utilization_out_of_range(value: float) -> None:
    with pytest.raises(LLMException) as exc_info:
        LLMConfig().mem_utilization = value
    assert_param_invalid(exc_info)


@pytest.mark.parametrize("value", [1, "0.5", None, True])
def test_mem_utilization_type_error(value: Any) -> None:
    with pytest.raises(TypeError, match="mem_utilization"):
        LLMConfig().mem_utilization = value


# -- cluster_info -------------------------------------------------------------------------


def test_cluster_info_converts_listen_ips() -> None:
    cfg = LLMConfig()
    cfg.cluster_info = '{"cluster_id": 0, "listen_ip_info": [{"ip": "1.2.3.4", "port": 9}]}'
    expected = '{"cluster_id": 0, "listen_ip_info": [{"ip": 67305985, "port": 9}]}'
    assert cfg.cluster_info == expected
    assert cfg.generate_options()["llm.ClusterInfo"] == expected


@pytest.mark.parametrize("value", ["", "{", "[1]", '{"listen_ip_info": 3}'])
def test_cluster_info_invalid(value: str) -> None:
    with pytest.raises(LLMException) as exc_info:
        LLMConfig().cluster_info = value
    assert_param_invalid(exc_info)


def test_cluster_info_bad_ip() -> None:
    with pytest.raises(RuntimeError, match=r"Can not parse ip str:1\.2\.3\.x"):
        LLMConfig().cluster_info = '{"listen_ip_info": [{"ip": "1.2.3.x"}]}'


# -- transport (aio_datadist's own option) ----------------------------------------------------


@pytest.mark.parametrize("value", ["tcp", "loopback"])
def test_transport(value: str) -> None:
    cfg = LLMConfig()
    cfg.transport = value
    opts = cfg.generate_options()
    assert opts[OPTION_TRANSPORT] == value
    assert OPTION_TRANSFER_BACKEND not in opts


@pytest.mark.parametrize("value", ["udp", "TCP", "hixl", ""])
def test_transport_invalid(value: str) -> None:
    with pytest.raises(LLMException) as exc_info:
        LLMConfig().transport = value
    assert_param_invalid(exc_info)


def test_repr_shows_changed_settings() -> None:
    cfg = LLMConfig()
    assert repr(cfg) == "LLMConfig()"
    cfg.device_id = 1
    cfg.enable_cache_manager = False
    assert repr(cfg) == "LLMConfig(device_id=1, enable_cache_manager=False)"


# -- parse_listen_ip_info ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [("192.168.1.1:26000", ("192.168.1.1", 26000)), ("127.0.0.1:0", ("127.0.0.1", 0))],
)
def test_parse_listen_ip_info(value: str, expected: tuple[str, int]) -> None:
    assert parse_listen_ip_info(value) == expected


@pytest.mark.parametrize("value", ["127.0.0.1", "1:2:3", "::1:26000", ":26000", ""])
def test_parse_listen_ip_info_bad_form(value: str) -> None:
    with pytest.raises(LLMException) as exc_info:
        parse_listen_ip_info(value)
    assert_param_invalid(exc_info)


@pytest.mark.parametrize("value", ["127.0.0.1:x", "127.0.0.1:", "127.0.0.1:-1", "1.1.1.1:65536"])
def test_parse_listen_ip_info_bad_port(value: str) -> None:
    with pytest.raises(ValueError):
        parse_listen_ip_info(value)


@pytest.mark.parametrize("value", ["localhost:26000", "prompt-0:26000", "300.1.1.1:26000"])
def test_parse_listen_ip_info_refuses_what_is_not_an_ipv4_address(value: str) -> None:
    with pytest.raises(LLMException) as exc_info:
        parse_listen_ip_info(value)
    assert_param_invalid(exc_info)
    ip = value.split(":")[0]
    cause = str(exc_info.value).split(": ", 1)[1]
    # The same words as LLMClusterInfo uses for the same string.
    with pytest.raises(RuntimeError) as cluster:
        LLMClusterInfo().append_remote_ip_info(ip, 1)
    assert str(cluster.value) == f"Can not parse ip str:{ip}: {cause}"
    assert "127.0.0.1" in cause


def test_init_refuses_a_host_name_to_listen_on() -> None:
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    options = make_options(device_pool=pool_cfg(), listen="localhost:26000")
    with pytest.raises(LLMException) as exc_info:
        dd.init(options)
    assert_param_invalid(exc_info)
    assert "'localhost' is a host name" in str(exc_info.value)
    dd.init(make_options(device_pool=pool_cfg()))
    try:
        with pytest.raises(LLMException) as switched:
            dd.switch_role(LLMRole.PROMPT, {"llm.listenIpInfo": "localhost:26000"})
        assert_param_invalid(switched)
        assert "'localhost' is a host name" in str(switched.value)
    finally:
        dd.finalize()


def test_parse_listen_ip_info_type() -> None:
    with pytest.raises(TypeError):
        parse_listen_ip_info(26000)  # type: ignore[arg-type]


# -- parse_mem_pool_cfg -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, host, expected",
    [
        ('{"memory_size": 67108864}', False, (67108864, 16)),
        ('{"memory_size": 1, "page_shift": 10}', False, (1, 10)),
        ('{"memory_size": 4096, "page_shift": 30, "other": 1}', True, (4096, 30)),
        ('{"memory_size": 21474836480}', True, (20 * 2**30, 16)),
        ('{"memory_size": 21474836481}', False, (20 * 2**30 + 1, 16)),
    ],
)
def test_parse_mem_pool_cfg(value: str, host: bool, expected: tuple[int, int]) -> None:
    assert parse_mem_pool_cfg(value, host=host) == expected


@pytest.mark.parametrize(
    "value",
    [
        "",
        "not json",
        "[1]",
        "{}",
        '{"page_shift": 16}',
        '{"memory_size": 0}',
        '{"memory_size": -1}',
        '{"memory_size": "1024"}',
        '{"memory_size": 1024.0}',
        '{"memory_size": true}',
        '{"memory_size": 1024, "page_shift": 9}',
        '{"memory_size": 1024, "page_shift": 31}',
        '{"memory_size": 1024, "page_shift": "16"}',
        '{"memory_size": 1024, "page_shift": null}',
        '{"memory_size": 9223372036854775808}',
    ],
)
def test_parse_mem_pool_cfg_invalid(value: str) -> None:
    with pytest.raises(LLMException) as exc_info:
        parse_mem_pool_cfg(value, host=False)
    assert_param_invalid(exc_info)


def test_parse_mem_pool_cfg_host_limit() -> None:
    with pytest.raises(LLMException, match="20 GiB") as exc_info:
        parse_mem_pool_cfg('{"memory_size": 21474836481}', host=True)
    assert_param_invalid(exc_info)


def test_parse_mem_pool_cfg_type() -> None:
    with pytest.raises(TypeError):
        parse_mem_pool_cfg(None, host=False)  # type: ignore[arg-type]


# -- prepare_init_options ---------------------------------------------------------------------


def test_prepare_adds_role_and_copies() -> None:
    opts = {"ge.exec.deviceId": "0", "llm.EnableCacheManager": "1"}
    for role, name in [
        (LLMRole.PROMPT, "Prompt"),
        (LLMRole.DECODER, "Decoder"),
        (LLMRole.MIX, "Mix"),
    ]:
        result = prepare_init_options(opts, role)
        assert result == {**opts, "llm.Role": name}
        assert result is not opts
    assert "llm.Role" not in opts


def test_prepare_splits_listen_ip_in_cache_manager_mode() -> None:
    opts = {"llm.EnableCacheManager": "1", "llm.listenIpInfo": "10.0.0.2:26000"}
    result = prepare_init_options(opts, LLMRole.PROMPT)
    assert result["llm.ListenIp"] == "10.0.0.2"
    assert result["llm.ListenPort"] == "26000"
    assert result["llm.listenIpInfo"] == "10.0.0.2:26000"


def test_prepare_leaves_listen_ip_outside_cache_manager_mode() -> None:
    result = prepare_init_options({"llm.listenIpInfo": "bad"}, LLMRole.PROMPT)
    assert "llm.ListenIp" not in result


def test_prepare_bad_listen_ip() -> None:
    opts = {"llm.EnableCacheManager": "1", "llm.listenIpInfo": "10.0.0.2"}
    with pytest.raises(LLMException) as exc_info:
        prepare_init_options(opts, LLMRole.PROMPT)
    assert_param_invalid(exc_info)
    opts["llm.listenIpInfo"] = "10.0.0.2:port"
    with pytest.raises(ValueError):
        prepare_init_options(opts, LLMRole.PROMPT)


def test_prepare_local_comm_res_defaults() -> None:
    result = prepare_init_options({"llm.LocalCommRes": ""}, LLMRole.DECODER)
    assert result == {
        "llm.LocalCommRes": "",
        "llm.Role": "Decoder",
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
    }
    # Explicit values are kept.
    result = prepare_init_options(
        {"llm.LocalCommRes": "", "llm.EnableRemoteCacheAccessible": "0"}, LLMRole.DECODER
    )
    assert result["llm.EnableRemoteCacheAccessible"] == "0"
    assert result["llm.EnableCacheManager"] == "1"


def test_prepare_local_comm_res_needs_cache_manager() -> None:
    opts = {"llm.LocalCommRes": "", "llm.EnableCacheManager": "0"}
    with pytest.raises(LLMException, match=r"llm\.LocalCommRes") as exc_info:
        prepare_init_options(opts, LLMRole.DECODER)
    assert_param_invalid(exc_info)


def test_prepare_transfer_backend() -> None:
    opts = {
        "llm.TransferBackend": "hixl",
        "llm.EnableCacheManager": "1",
        "llm.listenIpInfo": "1.1.1.1:5",
    }
    result = prepare_init_options(opts, LLMRole.MIX)
    assert result["llm.EnableRemoteCacheAccessible"] == "1"
    assert result["llm.ListenPort"] == "5"


@pytest.mark.parametrize(
    "opts, match",
    [
        ({"llm.TransferBackend": "hixl", "llm.listenIpInfo": "1.1.1.1:5"}, "EnableCacheManager"),
        (
            {
                "llm.TransferBackend": "hixl",
                "llm.EnableCacheManager": "1",
                "llm.EnableRemoteCacheAccessible": "0",
                "llm.listenIpInfo": "1.1.1.1:5",
            },
            "EnableRemoteCacheAccessible",
        ),
        ({"llm.TransferBackend": "hixl", "llm.EnableCacheManager": "1"}, "listenIpInfo"),
    ],
)
def test_prepare_transfer_backend_rules(opts: dict[str, str], match: str) -> None:
    with pytest.raises(LLMException, match=match) as exc_info:
        prepare_init_options(opts, LLMRole.PROMPT)
    assert_param_invalid(exc_info)


@pytest.mark.parametrize("value", ["1,2", "abc", "", "-1"])
def test_prepare_flow_graph_mem_max_size_invalid(value: str) -> None:
    with pytest.raises(LLMException) as exc_info:
        prepare_init_options({"ge.flowGraphMemMaxSize": value}, LLMRole.PROMPT)
    assert_param_invalid(exc_info)


def test_prepare_flow_graph_mem_max_size_ok() -> None:
    result = prepare_init_options({"ge.flowGraphMemMaxSize": "4106127360"}, LLMRole.PROMPT)
    assert result["ge.flowGraphMemMaxSize"] == "4106127360"


@pytest.mark.parametrize(
    "options, role",
    [
        ([("a", "b")], LLMRole.PROMPT),
        (None, LLMRole.PROMPT),
        ({"a": 1}, LLMRole.PROMPT),
        ({1: "a"}, LLMRole.PROMPT),
        ({"ge.flowGraphMemMaxSize": 5}, LLMRole.PROMPT),
        ({}, 1),
    ],
)
def test_prepare_type_errors(options: Any, role: Any) -> None:
    with pytest.raises(TypeError):
        prepare_init_options(options, role)


def test_prepare_transport() -> None:
    result = prepare_init_options({"aio.Transport": "loopback"}, LLMRole.PROMPT)
    assert result["aio.Transport"] == "loopback"
    with pytest.raises(LLMException) as exc_info:
        prepare_init_options({"aio.Transport": "carrier-pigeon"}, LLMRole.PROMPT)
    assert_param_invalid(exc_info)


def test_prepare_from_generated_options() -> None:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.local_comm_res = ""
    cfg.listen_ip_info = "127.0.0.1:26000"
    result = prepare_init_options(cfg.generate_options(), LLMRole.PROMPT)
    assert result == {
        "ge.exec.deviceId": "0",
        "ge.session_device_id": "0",
        "llm.listenIpInfo": "127.0.0.1:26000",
        "llm.LocalCommRes": "",
        "llm.MemoryUtilization": "0.95",
        "llm.Role": "Prompt",
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.ListenIp": "127.0.0.1",
        "llm.ListenPort": "26000",
    }


def test_busy_poll_us_setting() -> None:
    cfg = LLMConfig()
    assert cfg.busy_poll_us is None
    assert OPTION_BUSY_POLL_US not in cfg.generate_options()
    cfg.busy_poll_us = MAX_BUSY_POLL_US
    assert cfg.generate_options()[OPTION_BUSY_POLL_US] == str(MAX_BUSY_POLL_US)
    for bad in (-1, MAX_BUSY_POLL_US + 1):
        with pytest.raises(LLMException) as exc:
            cfg.busy_poll_us = bad
        assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    for wrong in ("100", 1.5, True):
        with pytest.raises(TypeError):
            cfg.busy_poll_us = wrong
    assert cfg.busy_poll_us == MAX_BUSY_POLL_US
    cfg.busy_poll_us = None
    assert cfg.busy_poll_us is None


@pytest.mark.parametrize("value", ["-1", str(MAX_BUSY_POLL_US + 1), "soon"])
def test_init_refuses_a_bad_busy_poll_option(value: str) -> None:
    dd = LLMDataDist(LLMRole.DECODER, 7)
    with pytest.raises(LLMException) as exc:
        dd.init({"ge.exec.deviceId": "0", OPTION_BUSY_POLL_US: value})
    assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
