"""An opt-in pytest plugin: a linked prompt/decoder pair as a fixture.

Enable it in a ``conftest.py`` with ``pytest_plugins = ["aio_datadist.testing.plugin"]``
(or ``pytest -p aio_datadist.testing.plugin``). It needs pytest-asyncio. Fixtures:

* ``datadist_pair``: an :class:`~aio_datadist.testing.LinkedPair` made by
  :func:`~aio_datadist.testing.linked_pair` with its defaults, finalized after the test;
  its ``faults`` start clear for every test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

try:
    import pytest_asyncio
except ImportError as exc:  # a clear message where pytest would print an import trace
    raise ImportError(
        "aio_datadist.testing.plugin needs pytest-asyncio: pip install pytest-asyncio"
    ) from exc

from aio_datadist.testing import LinkedPair, linked_pair

__all__ = ("datadist_pair",)


@pytest_asyncio.fixture
async def datadist_pair() -> AsyncIterator[LinkedPair]:
    """A prompt and a decoder linked over the loopback transport (see ``linked_pair``)."""
    async with linked_pair() as pair:
        yield pair
