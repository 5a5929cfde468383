"""Value types: CacheDesc, the three key types, MemInfo, transfer configs and KvCache."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aio_datadist.data_type import DataType, element_size
from aio_datadist.enums import Memtype, Placement
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    KvCache,
    MemInfo,
    TransferConfig,
    TransferWithCacheKeyConfig,
    check_blocks_key_range,
    is_valid_id,
)

INVALID = 2**64 - 1


@contextmanager
def param_invalid() -> Iterator[None]:
    """Expect an LLMException whose status is LLM_PARAM_INVALID."""
    with pytest.raises(LLMException) as exc_info:
        yield
    assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID


# -- CacheDesc ------------------------------------------------------------------------------


def test_cache_desc_defaults_and_properties() -> None:
    desc = CacheDesc(80, [4, 2048, 1, 128], DataType.DT_FLOAT16)
    assert desc.num_tensors == 80
    assert desc.shape == [4, 2048, 1, 128]
    assert desc.data_type is DataType.DT_FLOAT16
    assert desc.placement is Placement.DEVICE
    assert desc.batch_dim == 0
    assert desc.batch_size == 4
    assert desc.seq_len_dim_index == -1
    assert desc.kv_tensor_format is None
    assert desc.size == 4 * 2048 * 128 * 2
    assert desc._is_blocks is False


def test_cache_desc_all_arguments() -> None:
    desc = CacheDesc(2, (3, 5, 7), DataType.DT_INT64, Placement.HOST, 1, 2, "ND")
    assert desc.shape == [3, 5, 7]
    assert desc.placement is Placement.HOST
    assert desc.batch_dim == 1
    assert desc.batch_size == 5
    assert desc.seq_len_dim_index == 2
    assert desc.kv_tensor_format == "ND"
    assert desc.size == 3 * 5 * 7 * 8


def test_cache_desc_repr() -> None:
    desc = CacheDesc(2, [4, 16], DataType.DT_FLOAT)
    assert repr(desc) == (
        "CacheDesc(num_tensors=2, shape=[4, 16], data_type=DataType.DT_FLOAT, "
        "placement=Placement.DEVICE, batch_dim_index=0, seq_len_dim_index=-1,"
        "kv_tensor_format=None)"
    )


def test_cache_desc_copies_shape() -> None:
    shape = [2, 8]
    desc = CacheDesc(1, shape, DataType.DT_UINT8)
    shape[1] = 1000
    assert desc.shape == [2, 8]
    assert desc.size == 16


@pytest.mark.parametrize("data_type", list(DataType))
def test_cache_desc_size_per_type(data_type: DataType) -> None:
    desc = CacheDesc(3, [2, 3, 5], data_type)
    assert desc.size == 30 * element_size(data_type)


@given(
    st.lists(st.integers(min_value=0, max_value=64), min_size=1, max_size=6),
    st.sampled_from(list(DataType)),
    st.integers(min_value=0, max_value=2**32 - 1),
)
def test_cache_desc_size_is_one_tensor(shape: list[int], data_type: DataType, n: int) -> None:
    desc = CacheDesc(n, shape, data_type)
    assert desc.size == math.prod(shape) * element_size(data_type)


def test_cache_desc_update_dim() -> None:
    desc = CacheDesc(2, [4, 16], DataType.DT_FLOAT)
    assert desc.size == 256
    desc.update_dim(1, 32)
    assert desc.shape == [4, 32]
    assert desc.size == 512
    desc.update_dim(0, 8)
    assert desc.batch_size == 4  # fixed at construction
    assert desc.size == 1024


def test_cache_desc_update_dim_errors() -> None:
    desc = CacheDesc(2, [4, 16], DataType.DT_FLOAT)
    with param_invalid():
        desc.update_dim(2, 1)
    with param_invalid():
        desc.update_dim(-1, 1)
    with pytest.raises(ValueError):
        desc.update_dim(0, 2**63)
    with pytest.raises(TypeError):
        desc.update_dim("0", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        desc.update_dim(0, 1.0)  # type: ignore[arg-type]
    assert desc.shape == [4, 16]


def test_cache_desc_negative_dim_has_no_size() -> None:
    desc = CacheDesc(2, [4, -1], DataType.DT_FLOAT, seq_len_dim_index=1)
    with param_invalid():
        _ = desc.size
    desc.update_dim(1, 10)
    assert desc.size == 160


def test_cache_desc_size_names_the_negative_dimension() -> None:
    desc = CacheDesc(2, [4, 8, -3], DataType.DT_FLOAT)  # accepted, as in the reference
    with pytest.raises(LLMException) as exc_info:
        _ = desc.size
    assert exc_info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    message = str(exc_info.value)
    assert message.startswith("Failed to calc tensor size")
    assert "dimension 2 is -3" in message


def test_cache_desc_size_overflow() -> None:
    desc = CacheDesc(1, [2**62, 4], DataType.DT_FLOAT)
    with param_invalid():
        _ = desc.size


def test_cache_desc_zero_dim_is_zero_bytes() -> None:
    assert CacheDesc(1, [0, 4], DataType.DT_FLOAT).size == 0


def test_cache_desc_dimension_count() -> None:
    assert CacheDesc(1, [1] * 32, DataType.DT_INT8).size == 1
    with param_invalid():
        CacheDesc(1, [1] * 33, DataType.DT_INT8)
    with param_invalid():
        CacheDesc(1, [], DataType.DT_INT8)  # no batch dimension to index


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_tensors": "1"},
        {"num_tensors": None},
        {"num_tensors": True},
        {"shape": 4},
        {"shape": [4, "16"]},
        {"shape": [4.0, 16]},
        {"shape": [True, 16]},
        {"data_type": 1},
        {"placement": 1},
        {"batch_dim_index": 0.0},
        {"seq_len_dim_index": None},
        {"kv_tensor_format": 5},
    ],
)
def test_cache_desc_type_errors(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"num_tensors": 2, "shape": [4, 16], "data_type": DataType.DT_FLOAT}
    args.update(kwargs)
    with pytest.raises(TypeError):
        CacheDesc(**args)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_tensors": -1},
        {"num_tensors": 2**32},
        {"shape": [4, 2**63]},
        {"shape": [-(2**63) - 1, 4]},
        {"seq_len_dim_index": 2**31},
    ],
)
def test_cache_desc_value_errors(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"num_tensors": 2, "shape": [4, 16], "data_type": DataType.DT_FLOAT}
    args.update(kwargs)
    with pytest.raises(ValueError):
        CacheDesc(**args)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_dim_index": 2},
        {"batch_dim_index": -1},
        {"seq_len_dim_index": 2},
        {"seq_len_dim_index": -2},
    ],
)
def test_cache_desc_invalid_dims(kwargs: dict[str, Any]) -> None:
    with param_invalid():
        CacheDesc(2, [4, 16], DataType.DT_FLOAT, **kwargs)


def test_cache_desc_is_blocks_flag_is_settable() -> None:
    desc = CacheDesc(2, [4, 16], DataType.DT_FLOAT)
    desc._is_blocks = True
    assert desc._is_blocks is True
    with pytest.raises(AttributeError):
        desc.size = 3  # type: ignore[misc]


# -- CacheKey -------------------------------------------------------------------------------


def test_cache_key_positional() -> None:
    key = CacheKey(1, 2, 3, 4)
    assert (key.cluster_id, key.req_id, key.model_id, key.prefix_id) == (1, 2, 3, 4)
    assert key.prompt_cluster_id == 1
    key = CacheKey(1, 2)
    assert (key.model_id, key.prefix_id) == (0, INVALID)


def test_cache_key_keywords() -> None:
    key = CacheKey(prompt_cluster_id=5, req_id=6, model_id=7)
    assert (key.cluster_id, key.req_id, key.model_id, key.prefix_id) == (5, 6, 7, INVALID)
    key = CacheKey(cluster_id=5, req_id=6, prefix_id=9)
    assert key.prefix_id == 9
    key = CacheKey(5, req_id=6)
    assert (key.cluster_id, key.req_id) == (5, 6)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((1, 2, 3, 4, 5), {}),
        ((1, 2, 3), {"prefix_id": 4, "model_id": 0}),
        ((), {"req_id": 1}),
        ((), {"cluster_id": 1}),
        ((1,), {}),
        ((1, 2), {"request_id": 3}),
        ((1, 2), {"cluster_id": 3}),
        ((), {"cluster_id": 1, "prompt_cluster_id": 1, "req_id": 2}),
    ],
)
def test_cache_key_param_invalid(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with param_invalid():
        CacheKey(*args, **kwargs)


@pytest.mark.parametrize("field", ["cluster_id", "req_id", "model_id", "prefix_id"])
def test_cache_key_ranges(field: str) -> None:
    base = {"cluster_id": 1, "req_id": 2}
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match=field):
            CacheKey(**{**base, field: bad})
    for bad_type in ("1", 1.0, None, True):
        with pytest.raises(TypeError, match=field):
            CacheKey(**{**base, field: bad_type})


def test_cache_key_eq_hash() -> None:
    a = CacheKey(prompt_cluster_id=1, req_id=2, model_id=0)
    b = CacheKey(1, 2, 0, INVALID)
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != CacheKey(1, 2, 1)
    assert a != CacheKey(2, 2)
    assert a != CacheKey(1, 2, 0, 7)
    assert a != (1, 2, 0, INVALID)


def test_cache_key_placeholder() -> None:
    assert CacheKey(1, INVALID).is_placeholder()
    assert not CacheKey(1, 0).is_placeholder()
    assert not CacheKey(1, INVALID, 0, 3).is_placeholder()


def test_cache_key_identity() -> None:
    assert CacheKey(1, 5, 2).identity() == ("req", 5, 2)
    assert CacheKey(1, 5, 2, 9).identity() == ("prefix", 9, 2)
    assert CacheKey(1, INVALID, 2, 9).identity() == ("prefix", 9, 2)
    # The cluster id is not part of the identity.
    assert CacheKey(1, 5).identity() == CacheKey(2, 5).identity()


def test_is_valid_id() -> None:
    assert is_valid_id(0)
    assert is_valid_id(2**64 - 2)
    assert not is_valid_id(INVALID)
    assert not is_valid_id(-1)


def test_cache_key_repr() -> None:
    assert repr(CacheKey(1, 2, 3)) == (
        f"CacheKey(cluster_id=1, req_id=2, prefix_id={INVALID}, model_id=3)"
    )


# -- CacheKeyByIdAndIndex -------------------------------------------------------------------


def test_cache_key_by_id() -> None:
    key = CacheKeyByIdAndIndex(1, 2)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (1, 2, 0)
    key = CacheKeyByIdAndIndex(cluster_id=2**64 - 1, cache_id=-(2**63), batch_index=2**32 - 1)
    assert (key.cluster_id, key.cache_id, key.batch_index) == (2**64 - 1, -(2**63), 2**32 - 1)
    assert repr(CacheKeyByIdAndIndex(1, 2, 3)) == (
        "CacheKeyByIdAndIndex(cluster_id=1, cache_id=2, batch_index=3)"
    )
    assert CacheKeyByIdAndIndex(1, 2, 3) == CacheKeyByIdAndIndex(1, 2, 3)
    assert hash(CacheKeyByIdAndIndex(1, 2, 3)) == hash(CacheKeyByIdAndIndex(1, 2, 3))
    assert CacheKeyByIdAndIndex(1, 2, 3) != CacheKeyByIdAndIndex(1, 2, 4)


@pytest.mark.parametrize(
    "args", [(-1, 1, 0), (2**64, 1, 0), (1, 2**63, 0), (1, 1, -1), (1, 1, 2**32)]
)
def test_cache_key_by_id_ranges(args: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError):
        CacheKeyByIdAndIndex(*args)


@pytest.mark.parametrize("args", [("1", 1, 0), (1, None, 0), (1, 1, 0.0), (1, True, 0)])
def test_cache_key_by_id_types(args: tuple[Any, Any, Any]) -> None:
    with pytest.raises(TypeError):
        CacheKeyByIdAndIndex(*args)


# -- BlocksCacheKey -------------------------------------------------------------------------


def test_blocks_cache_key() -> None:
    key = BlocksCacheKey(1)
    assert (key.cluster_id, key.prompt_cluster_id, key.model_id) == (1, 1, 0)
    assert BlocksCacheKey(1, 2).model_id == 2
    assert BlocksCacheKey(cluster_id=3, model_id=1).cluster_id == 3
    assert BlocksCacheKey(prompt_cluster_id=4).cluster_id == 4
    # Type check only: the reference does not range-check these ints.
    assert BlocksCacheKey(-1, 2**70).model_id == 2**70
    assert BlocksCacheKey(-1, 0).cluster_id == -1


@pytest.mark.parametrize(
    "key, field",
    [
        (BlocksCacheKey(-1, 0), "cluster_id -1"),
        (BlocksCacheKey(2**64, 0), f"cluster_id {2**64}"),
        (BlocksCacheKey(1, -5), "model_id -5"),
    ],
)
def test_blocks_cache_key_range_is_checked_where_it_is_used(
    key: BlocksCacheKey, field: str
) -> None:
    with pytest.raises(ValueError) as exc_info:
        check_blocks_key_range("src_cache_key", key)
    message = str(exc_info.value)
    assert message.startswith(f"src_cache_key {key!r}: ")
    assert f"BlocksCacheKey {field} is outside uint64" in message
    check_blocks_key_range("src_cache_key", BlocksCacheKey(2**64 - 1, 2**64 - 1))


def test_blocks_cache_key_repr_eq_hash() -> None:
    assert repr(BlocksCacheKey(1, 2)) == "BlocksCacheKey(cluster_id=1, model_id=2)"
    assert repr(BlocksCacheKey(prompt_cluster_id=1)) == (
        "BlocksCacheKey(prompt_cluster_id=1, model_id=0)"
    )
    a = BlocksCacheKey(prompt_cluster_id=1, model_id=0)
    b = BlocksCacheKey(1)
    assert a == b
    assert hash(a) == hash(b)
    assert a != BlocksCacheKey(1, 1)
    assert a != BlocksCacheKey(2)
    assert a != CacheKeyByIdAndIndex(1, 0)


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((1, 2, 3), {}),
        ((1,), {"model_id": 2, "cluster_id": 1}),
        ((), {"model_id": 1}),
        ((), {}),
        ((1,), {"req_id": 1}),
        ((1,), {"prompt_cluster_id": 1}),
    ],
)
def test_blocks_cache_key_param_invalid(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with param_invalid():
        BlocksCacheKey(*args, **kwargs)


@pytest.mark.parametrize("args", [("1",), (1, "0"), (None,), (1.0, 0), (True,)])
def test_blocks_cache_key_types(args: tuple[Any, ...]) -> None:
    with pytest.raises(TypeError):
        BlocksCacheKey(*args)


# -- MemInfo --------------------------------------------------------------------------------


def test_mem_info() -> None:
    info = MemInfo(Memtype.MEM_TYPE_DEVICE, 1234, 10)
    assert (info.mem_type, info.addr, info.size) == (Memtype.MEM_TYPE_DEVICE, 1234, 10)
    assert repr(info) == "MemInfo(mem_type=Memtype.MEM_TYPE_DEVICE, addr=1234, size=10)"


@pytest.mark.parametrize(
    "args", [(0, 1, 1), (Memtype.MEM_TYPE_HOST, "1", 1), (Memtype.MEM_TYPE_HOST, 1, None)]
)
def test_mem_info_types(args: tuple[Any, Any, Any]) -> None:
    with pytest.raises(TypeError):
        MemInfo(*args)


# -- TransferConfig -------------------------------------------------------------------------


def test_transfer_config() -> None:
    cfg = TransferConfig(1, [10, 20, 30, 40], range(0, 2), 3)
    assert cfg.dst_cluster_id == 1
    assert cfg.dst_addrs == [10, 20, 30, 40]
    assert cfg.src_layer_range == range(0, 2)
    assert cfg.src_batch_index == 3
    assert cfg.dst_layer_range is None
    assert repr(cfg) == (
        "TransferConfig(dst_cluster_id=1, dst_addrs=[10, 20, 30, 40], "
        "src_layer_range=range(0, 2), src_batch_index=3)"
    )
    cfg = TransferConfig(2, (1, 2))
    assert cfg.src_layer_range is None
    assert cfg.src_batch_index == 0


def test_transfer_config_setters() -> None:
    cfg = TransferConfig(1, [1, 2])
    cfg.dst_cluster_id = 9
    cfg.dst_addrs = (5, 6, 7, 8)
    cfg.src_layer_range = range(1, 3)
    cfg.src_batch_index = 4
    assert (cfg.dst_cluster_id, cfg.dst_addrs, cfg.src_layer_range, cfg.src_batch_index) == (
        9,
        (5, 6, 7, 8),
        range(1, 3),
        4,
    )
    cfg.src_layer_range = None
    assert cfg.src_layer_range is None
    with pytest.raises(ValueError):
        cfg.dst_cluster_id = -1
    with pytest.raises(TypeError):
        cfg.dst_addrs = [1, "2"]  # type: ignore[list-item]
    with pytest.raises(ValueError):
        cfg.dst_addrs = [2**64]
    with param_invalid():
        cfg.src_layer_range = range(2, 1)
    with pytest.raises(ValueError):
        cfg.src_batch_index = 2**32
    assert (cfg.dst_cluster_id, cfg.dst_addrs, cfg.src_batch_index) == (9, (5, 6, 7, 8), 4)


@pytest.mark.parametrize(
    "args, error",
    [
        ((-1, [1]), ValueError),
        (("1", [1]), TypeError),
        ((1, 5), TypeError),
        ((1, None), TypeError),
        ((1, [-1]), ValueError),
        ((1, [1.0]), TypeError),
        ((1, [1], [0, 1]), TypeError),
        ((1, [1], None, -1), ValueError),
        ((1, [1], None, 2**32), ValueError),
        ((1, [1], None, None), TypeError),
    ],
)
def test_transfer_config_errors(args: tuple[Any, ...], error: type[Exception]) -> None:
    with pytest.raises(error):
        TransferConfig(*args)


@pytest.mark.parametrize("layer_range", [range(0, 4, 2), range(2, 2), range(3, 1), range(-1, 2)])
def test_transfer_config_bad_range(layer_range: range) -> None:
    with param_invalid():
        TransferConfig(1, [1, 2], layer_range)


# -- TransferWithCacheKeyConfig -------------------------------------------------------------


def test_transfer_with_key_config() -> None:
    key = BlocksCacheKey(1)
    cfg = TransferWithCacheKeyConfig(key, range(0, 40), range(0, 40))
    assert cfg.cache_key is key
    assert cfg.src_layer_range == range(0, 40)
    assert cfg.dst_layer_range == range(0, 40)
    assert cfg.src_batch_index == 0
    assert cfg.dst_cluster_id == 1
    by_id = CacheKeyByIdAndIndex(7, 3, 1)
    cfg = TransferWithCacheKeyConfig(by_id, range(2, 4), range(0, 2), 5)
    assert (cfg.dst_cluster_id, cfg.src_batch_index) == (7, 5)
    assert repr(cfg) == (
        "TransferWithCacheKeyConfig(cache_key=CacheKeyByIdAndIndex(cluster_id=7, cache_id=3, "
        "batch_index=1), src_layer_range=range(2, 4), dst_layer_range=range(0, 2), "
        "src_batch_index=5)"
    )


def test_transfer_with_key_config_ranges_required() -> None:
    key = BlocksCacheKey(1)
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(key)
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(key, range(0, 1))
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(key, None, range(0, 1))
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(None, range(0, 1), range(0, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TransferWithCacheKeyConfig(CacheKey(1, 2), range(0, 1), range(0, 1))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "src, dst",
    [
        (range(0, 2), range(0, 3)),
        (range(1, 3), range(0, 1)),
        (range(0, 4, 2), range(0, 2)),
        (range(0, 2), range(2, 0)),
    ],
)
def test_transfer_with_key_config_bad_ranges(src: range, dst: range) -> None:
    with param_invalid():
        TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 1), src, dst)


def test_transfer_with_key_config_batch_index() -> None:
    with param_invalid():
        TransferWithCacheKeyConfig(BlocksCacheKey(1), range(0, 1), range(0, 1), 1)
    with pytest.raises(ValueError):
        TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 1), range(0, 1), range(0, 1), -1)


def test_transfer_with_key_config_setters() -> None:
    cfg = TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(1, 1), range(0, 2), range(0, 2), 3)
    cfg.src_layer_range = range(1, 3)
    cfg.dst_layer_range = range(4, 6)
    cfg.src_batch_index = 0
    cfg.cache_key = BlocksCacheKey(9)
    assert (cfg.src_layer_range, cfg.dst_layer_range, cfg.dst_cluster_id) == (
        range(1, 3),
        range(4, 6),
        9,
    )
    with param_invalid():
        cfg.src_batch_index = 1  # blocks key needs 0
    with pytest.raises(TypeError):
        cfg.src_layer_range = None  # type: ignore[assignment]
    with pytest.raises(TypeError):
        cfg.dst_layer_range = [0, 1]  # type: ignore[assignment]
    with param_invalid():
        cfg.dst_layer_range = range(0, 4, 2)
    with pytest.raises(TypeError):
        cfg.cache_key = CacheKey(1, 2)  # type: ignore[assignment]
    cfg.cache_key = CacheKeyByIdAndIndex(2, 1)
    cfg.src_batch_index = 6
    with param_invalid():
        cfg.cache_key = BlocksCacheKey(3)  # would leave a blocks key with batch index 6
    assert (cfg.dst_cluster_id, cfg.src_batch_index) == (2, 6)


# -- KvCache --------------------------------------------------------------------------------


def _host_desc(n: int = 2) -> CacheDesc:
    return CacheDesc(n, [4, 8], DataType.DT_FLOAT, Placement.HOST)


def test_kv_cache() -> None:
    desc = _host_desc()
    cache = KvCache(5, desc, [[1, 2]])
    assert (cache.cache_id, cache.cache_desc, cache.per_device_tensor_addrs) == (5, desc, [[1, 2]])
    assert repr(cache) == "KvCache(cache_id = 5, num_devices = 1)"
    with pytest.raises(ValueError):
        KvCache(2**63, desc, [])
    with pytest.raises(TypeError):
        KvCache("1", desc, [])  # type: ignore[arg-type]


def test_kv_cache_create_cpu_cache() -> None:
    desc = _host_desc()
    flat = KvCache.create_cpu_cache(desc, [100, 200])
    assert flat.cache_id == -1
    assert flat.per_device_tensor_addrs == [[100, 200]]
    nested = KvCache.create_cpu_cache(desc, [[1, 2], [3, 4]])
    assert nested.per_device_tensor_addrs == [[1, 2], [3, 4]]


@pytest.mark.parametrize("addrs", [[], [1], [1, 2, 3], [[1, 2], 3], [1, [2, 3]], [[1, 2], [3]]])
def test_kv_cache_create_cpu_cache_invalid(addrs: Any) -> None:
    with param_invalid():
        KvCache.create_cpu_cache(_host_desc(), addrs)


def test_kv_cache_create_cpu_cache_errors() -> None:
    with param_invalid():
        KvCache.create_cpu_cache(CacheDesc(2, [4, 8], DataType.DT_FLOAT), [1, 2])
    with pytest.raises(TypeError):
        KvCache.create_cpu_cache(_host_desc(), (1, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        KvCache.create_cpu_cache(_host_desc(), [1, "2"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        KvCache.create_cpu_cache(_host_desc(), [[1, "2"]])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        KvCache.create_cpu_cache("desc", [1, 2])  # type: ignore[arg-type]
