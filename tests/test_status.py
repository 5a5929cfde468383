"""The exception hierarchy: one exported ``LLMException`` subclass per raised status code."""

from __future__ import annotations

import pickle

import pytest

import aio_datadist
from aio_datadist import status
from aio_datadist.status import LLMException, LLMStatusCode, lookup, raise_for_status

SUBCLASSES = [
    cls
    for cls in vars(status).values()
    if isinstance(cls, type) and issubclass(cls, LLMException) and cls is not LLMException
]

#: The codes with no subclass of their own: v1-only, reserved or unknown.
UNCLASSED = {
    LLMStatusCode.LLM_SUCCESS,
    LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
    LLMStatusCode.LLM_REQUEST_ALREADY_COMPLETED,
    LLMStatusCode.LLM_PREFIX_ALREADY_EXIST,
    LLMStatusCode.LLM_PREFIX_NOT_EXIST,
    LLMStatusCode.LLM_SEQ_LENOVERLIMIT,
    LLMStatusCode.LLM_NO_FREE_BLOCK,
    LLMStatusCode.LLM_BLOCKS_OUT_OF_MEMORY,
    LLMStatusCode.LLM_DEVICE_MEM_ERROR,
    LLMStatusCode.LLM_SUSPECT_REMOTE_ERROR,
    LLMStatusCode.LLM_UNKNOWN_ERROR,
}


#: The reference package's documented names, in its order (``v2_list``).
V2_NAMES = [
    "LLMClusterInfo",
    "LLMStatusCode",
    "LLMException",
    "LLMRole",
    "LlmConfig",
    "LLMConfig",
    "DataType",
    "Status",
    "CacheDesc",
    "CacheKey",
    "CacheKeyByIdAndIndex",
    "KvCache",
    "Cache",
    "BlocksCacheKey",
    "LLMDataDist",
    "Placement",
    "RegisterMemStatus",
    "LayerSynchronizer",
    "TransferConfig",
    "CacheTask",
    "TransferWithCacheKeyConfig",
    "Memtype",
    "MemInfo",
]


def test_every_subclass_has_its_own_code_and_is_found_by_it() -> None:
    assert len(SUBCLASSES) == 18
    codes = [cls.code for cls in SUBCLASSES]
    assert len(set(codes)) == len(codes)
    for cls in SUBCLASSES:
        assert isinstance(cls.code, LLMStatusCode)
        assert lookup(cls.code) is cls
        assert lookup(int(cls.code)) is cls


def test_every_code_but_the_unclassed_has_a_subclass() -> None:
    classed = {cls.code for cls in SUBCLASSES}
    assert classed == set(LLMStatusCode) - UNCLASSED
    for code in UNCLASSED:
        assert lookup(code) is LLMException


@pytest.mark.parametrize("cls", SUBCLASSES, ids=lambda c: c.__name__)
def test_the_base_class_built_with_a_code_is_its_subclass(cls: type[LLMException]) -> None:
    assert cls.code is not None
    exc = LLMException("boom", status_code=cls.code)
    assert type(exc) is cls
    assert exc.status_code == cls.code
    assert isinstance(exc, LLMException) and isinstance(exc, RuntimeError)
    assert type(cls("boom")).__name__ == cls.__name__
    assert cls("boom").status_code == cls.code  # a subclass built without a code takes its own
    with pytest.raises(cls) as info:
        raise_for_status(cls.code, "boom")
    assert info.value.status_code == cls.code
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is cls and again.status_code == cls.code and again.args == exc.args


@pytest.mark.parametrize("cls", SUBCLASSES, ids=lambda c: c.__name__)
def test_every_subclass_is_exported_from_the_root_and_documents_its_code(
    cls: type[LLMException],
) -> None:
    assert cls.__name__ in aio_datadist.__all__
    assert getattr(aio_datadist, cls.__name__) is cls
    assert issubclass(cls, LLMException)
    assert cls.code is not None
    assert f"``{cls.code.name}``" in (cls.__doc__ or "")
    # The drawn tree in LLMException's docstring lists it with its code.
    line = next(
        (ln for ln in (LLMException.__doc__ or "").splitlines() if f" {cls.__name__} " in ln),
        "",
    )
    assert line.split()[-1] == cls.code.name


def test_the_documented_names_stay_first_and_star_import_works() -> None:
    assert aio_datadist.v2_list == aio_datadist.__all__[:23]
    assert aio_datadist.v2_list == V2_NAMES
    assert len(set(aio_datadist.__all__)) == len(aio_datadist.__all__)
    namespace: dict[str, object] = {}
    exec("from aio_datadist import *", namespace)
    for name in aio_datadist.__all__:
        assert namespace[name] is getattr(aio_datadist, name)
    for cls in SUBCLASSES:
        assert namespace[cls.__name__] is cls


def test_an_unknown_code_stays_an_int_on_the_base_class() -> None:
    exc = LLMException("odd", status_code=12345)
    assert type(exc) is LLMException
    assert exc.status_code == 12345
    with pytest.raises(LLMException) as info:
        raise_for_status(12345, "odd")
    assert type(info.value) is status.LLMFailedError
