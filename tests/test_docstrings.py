"""The public API documents itself: what ``help()`` and the API reference show is complete.

Every public method of the classes below has its own docstring of at least two lines (a
summary and what it does), not a pointer to another class ("As ``X``"); every public
property has one too.
"""

from __future__ import annotations

import inspect

import pytest

from aio_datadist import (
    AsyncCacheManager,
    AsyncLLMDataDist,
    Cache,
    CacheTask,
    LLMDataDist,
)
from aio_datadist.sync import CacheManager

CLASSES = [AsyncLLMDataDist, AsyncCacheManager, LLMDataDist, CacheManager, CacheTask, Cache]
#: Dunder methods that are part of the API (``await task``, ``async with``).
PUBLIC_DUNDERS = {"__await__", "__aenter__", "__aexit__"}


def _members(cls: type) -> list[tuple[str, object]]:
    found: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("aio_datadist"):
            for name, value in vars(klass).items():
                if not name.startswith("_") or name in PUBLIC_DUNDERS:
                    found[name] = value
    return sorted(found.items())


METHODS = [
    pytest.param(cls, name, value, id=f"{cls.__name__}.{name}")
    for cls in CLASSES
    for name, value in _members(cls)
    if not isinstance(value, property)
    and callable(value.__func__ if isinstance(value, classmethod | staticmethod) else value)
]
PROPERTIES = [
    pytest.param(cls, name, value, id=f"{cls.__name__}.{name}")
    for cls in CLASSES
    for name, value in _members(cls)
    if isinstance(value, property)
]


def test_the_classes_have_public_methods() -> None:
    names = {p.id for p in METHODS}
    assert "AsyncCacheManager.pull_blocks" in names
    assert "CacheTask.__await__" in names
    assert "Cache.create_cpu_cache" in names
    assert "AsyncLLMDataDist.__aenter__" in names
    assert len(METHODS) > 60


def _doc(value: object) -> str:
    func = value.__func__ if isinstance(value, classmethod | staticmethod) else value
    return inspect.cleandoc(getattr(func, "__doc__", None) or "")


@pytest.mark.parametrize(("cls", "name", "value"), METHODS)
def test_every_public_method_has_its_own_docstring(cls: type, name: str, value: object) -> None:
    doc = _doc(value)
    assert doc, f"{cls.__name__}.{name} has no docstring"
    assert not doc.startswith("As "), f"{cls.__name__}.{name} only points elsewhere"
    assert len(doc.splitlines()) >= 2, f"{cls.__name__}.{name} has a one-line docstring"
    assert doc.splitlines()[0].strip().endswith((".", ":")) or doc.splitlines()[1].strip(), (
        f"{cls.__name__}.{name}: the summary line should end its sentence"
    )


@pytest.mark.parametrize(("cls", "name", "value"), PROPERTIES)
def test_every_public_property_has_a_docstring(cls: type, name: str, value: object) -> None:
    doc = _doc(value)
    assert doc, f"{cls.__name__}.{name} has no docstring"
    assert not doc.startswith("As "), f"{cls.__name__}.{name} only points elsewhere"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_class_has_a_docstring_of_its_own(cls: type) -> None:
    doc = inspect.cleandoc(cls.__doc__ or "")
    assert len(doc.splitlines()) >= 2, f"{cls.__name__} needs a summary and a description"


@pytest.mark.parametrize("cls", [AsyncLLMDataDist, AsyncCacheManager], ids=lambda c: c.__name__)
def test_the_async_face_never_names_the_unexported_blocking_class(cls: type) -> None:
    for name, value in _members(cls):
        doc = _doc(value.fget if isinstance(value, property) else value)
        assert "``CacheManager." not in doc, f"{cls.__name__}.{name} names CacheManager.X"
