"""A testing kit for async test suites that use aio_datadist.

* :func:`linked_pair`: a prompt and a decoder :class:`~aio_datadist.AsyncLLMDataDist`,
  initialised and linked over the in-process loopback transport, in one line::

      async with linked_pair() as pair:
          cache = await pair.decoder.cache_manager.allocate_blocks_cache(desc)
          ...

* :class:`LinkFaults` (``pair.faults``, or :func:`link_faults` for engines of your own):
  fail the next transfers with a chosen status code, delay answers, stall a link until
  released, drop a link as if the peer died; so a serving team tests its own timeout,
  retry and fallback paths without sockets or a second process.
* ``aio_datadist.testing.plugin``: an opt-in pytest plugin with a ``datadist_pair``
  fixture (needs pytest-asyncio).

The loopback transport is the library's own, not a mock: requests are served by the peer
engine's planning and bounds checks and move their bytes with the native copy; only the
socket is missing. Faults act on the requests one end makes (pulls and pushes of caches and
blocks, through either face); nothing else about the link changes.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from aio_datadist._options import engine_options
from aio_datadist._transport.faults import LinkFaults
from aio_datadist._transport.loopback import LoopbackChannel
from aio_datadist.aio import AsyncLLMDataDist
from aio_datadist.cluster import LLMClusterInfo
from aio_datadist.enums import LLMRole
from aio_datadist.status import (
    FeatureNotEnabledError,
    LLMException,
    LLMStatusCode,
    NotYetLinkError,
)
from aio_datadist.sync import LLMDataDist

__all__ = ("LinkFaults", "LinkedPair", "link_faults", "linked_pair")

#: Loopback ports handed to pairs' prompt listeners (any free name will do in-process).
_PORTS = itertools.count(40000 + os.getpid() % 10000)


def link_faults(datadist: AsyncLLMDataDist | LLMDataDist, cluster_id: int) -> LinkFaults:
    """The faults of the requests ``datadist`` makes on its live loopback link to
    ``cluster_id``.

    :raises TypeError: ``datadist`` is not an engine of either face.
    :raises RuntimeError: it is not initialised.
    :raises LLMException: ``LLM_NOT_YET_LINK`` when no link to ``cluster_id`` is live,
        ``LLM_FEATURE_NOT_ENABLED`` when the link is not over the loopback transport.
    """
    if not isinstance(datadist, AsyncLLMDataDist | LLMDataDist):
        raise TypeError(
            f"datadist must be an AsyncLLMDataDist or LLMDataDist, got {type(datadist).__name__}"
        )
    link = datadist._engine.link_table().get(cluster_id)
    if link is None:
        raise NotYetLinkError(
            f"cluster {cluster_id} has no live link to inject faults into",
            status_code=LLMStatusCode.LLM_NOT_YET_LINK,
        )
    if not isinstance(link.channel, LoopbackChannel):
        raise FeatureNotEnabledError(
            "faults are injected on the loopback transport only "
            f"(the link to cluster {cluster_id} is {type(link.channel).__name__})",
            status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
        )
    return link.channel.faults


@dataclass(frozen=True)
class LinkedPair:
    """A prompt and a decoder engine linked over the loopback transport."""

    #: The prompt engine (it listens; role ``PROMPT``).
    prompt: AsyncLLMDataDist
    #: The decoder engine (it linked to the prompt; role ``DECODER``).
    decoder: AsyncLLMDataDist

    @property
    def prompt_cluster_id(self) -> int:
        """The prompt's cluster id (what the decoder's keys name)."""
        return self.prompt.cluster_id

    @property
    def decoder_cluster_id(self) -> int:
        """The decoder's cluster id."""
        return self.decoder.cluster_id

    @property
    def faults(self) -> LinkFaults:
        """Faults of the decoder's requests to the prompt (its pulls, and its pushes)."""
        return link_faults(self.decoder, self.prompt_cluster_id)

    @property
    def prompt_faults(self) -> LinkFaults:
        """Faults of the prompt's requests to the decoder (pushes from the prompt side)."""
        return link_faults(self.prompt, self.decoder_cluster_id)


def _options(
    pool_bytes: int,
    host_pool_bytes: int | None,
    timeout_ms: int,
    link_secret: str | bytes | None,
    listen: str | None,
    extra: Mapping[str, str] | None,
) -> dict[str, str]:
    options = engine_options(
        transport="loopback",
        pool_bytes=pool_bytes,
        timeout_ms=timeout_ms,
        listen=listen,
        host_pool_bytes=host_pool_bytes,
        link_secret=link_secret,
    )
    options.update(extra or {})
    return options


@contextlib.asynccontextmanager
async def linked_pair(
    *,
    prompt_cluster_id: int = 1,
    decoder_cluster_id: int = 2,
    pool_bytes: int = 64 << 20,
    host_pool_bytes: int | None = None,
    sync_kv_timeout: int = 1000,
    link_secret: str | bytes | None = None,
    options: Mapping[str, str] | None = None,
) -> AsyncIterator[LinkedPair]:
    """A prompt and a decoder, initialised (cache manager mode, remote cache access on) and
    linked over the loopback transport; both finalized on exit (which closes the link).

    :param prompt_cluster_id: the prompt's cluster id.
    :param decoder_cluster_id: the decoder's cluster id (another one).
    :param pool_bytes: each engine's device memory pool (``mem_pool_cfg``); device memory is
        the runtime's (``AIO_DATADIST_RUNTIME=host`` makes it host memory anywhere).
    :param host_pool_bytes: each engine's host memory pool, or None for none.
    :param sync_kv_timeout: the transfer deadline in ms (short, so timeout paths are quick).
    :param link_secret: a link secret both engines hold, or None.
    :param options: more option strings for both engines; they win over the above.
    :raises ValueError: the two cluster ids are equal.
    :raises LLMException: an engine did not initialise, or the link failed (its status).
    """
    if prompt_cluster_id == decoder_cluster_id:
        raise ValueError(f"the two engines need different cluster ids, got {prompt_cluster_id}")
    port = next(_PORTS)
    prompt = AsyncLLMDataDist(LLMRole.PROMPT, prompt_cluster_id)
    decoder = AsyncLLMDataDist(LLMRole.DECODER, decoder_cluster_id)
    started: list[AsyncLLMDataDist] = []
    try:
        for engine, listen in ((prompt, f"127.0.0.1:{port}"), (decoder, None)):
            await engine.init(
                _options(pool_bytes, host_pool_bytes, sync_kv_timeout, link_secret, listen, options)
            )
            started.append(engine)
        info = LLMClusterInfo()
        info.remote_cluster_id = prompt_cluster_id
        info.append_local_ip_info("127.0.0.1", 0)
        info.append_remote_ip_info("127.0.0.1", port)
        ret, results = await decoder.link_clusters([info], 5000)
        if ret != LLMStatusCode.LLM_SUCCESS:
            status = results[0] if results else ret
            raise LLMException(
                f"the decoder could not link to the prompt: {status!s}", status_code=status
            )
        yield LinkedPair(prompt, decoder)
    finally:
        for engine in reversed(started):
            await engine.finalize()
