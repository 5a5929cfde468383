"""Array views of caches: numpy always, torch when installed; lifetime beyond finalize."""

from __future__ import annotations

import numpy as np
import pytest

from aio_datadist import CacheDesc, DataType, Placement
from aio_datadist._memory.views import numpy_dtype
from tests.conftest import Face, make_options, pool_cfg


@pytest.mark.parametrize(
    ("data_type", "dtype"),
    [
        (DataType.DT_FLOAT, np.float32),
        (DataType.DT_FLOAT16, np.float16),
        (DataType.DT_BF16, np.uint16),
        (DataType.DT_INT8, np.int8),
        (DataType.DT_UINT64, np.uint64),
        (DataType.DT_BOOL, np.bool_),
        (DataType.DT_DOUBLE, np.float64),
    ],
)
def test_numpy_dtypes(data_type: DataType, dtype: type) -> None:
    assert numpy_dtype(data_type) == np.dtype(dtype)


async def test_view_outlives_finalize(make_face) -> None:
    f: Face = make_face()
    await f.init(make_options(host_pool=pool_cfg()))
    cache = await f.cm.allocate_cache(CacheDesc(1, [2, 1024], DataType.DT_INT32, Placement.HOST))
    (view,) = cache.as_numpy()
    view[...] = 5
    await f.finalize()
    # The pool is gone, but the arena stays mapped while the view exists.
    assert int(view.sum()) == 5 * 2 * 1024
    view[...] = 6
    del view


async def test_torch_views_share_memory(face: Face) -> None:
    torch = pytest.importorskip("torch")
    cache = await face.cm.allocate_blocks_cache(CacheDesc(2, [4, 8], DataType.DT_BF16))
    k, v = cache.as_torch()
    assert k.dtype == torch.bfloat16 and tuple(k.shape) == (4, 8)
    k[1] = 1.5
    v.fill_(-2.0)
    await face.cm.copy_blocks(cache, {1: [3]})
    assert float(k[3].float().sum()) == 12.0
    assert float(v.float().sum()) == -64.0
    raw = cache.as_numpy()[0]
    assert raw[3, 0] == 0x3FC0  # bfloat16 bits of 1.5
    del k, v
    await face.cm.deallocate_blocks_cache(cache)
