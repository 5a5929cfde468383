"""The link table follows what exists: a model of link, unlink, kill and pull over TCP.

A hypothesis state machine drives a listening prompt (cluster 1) and two decoders (clusters
2 and 3) through links, graceful and forced unlinks from either end, decoders killed (their
sockets cut without a word, then a new engine under the same cluster id) and pulls both ways,
and checks after every step that each table shows exactly the links that are open, the
broken links the model expects, and that each pull gives the bytes or the documented code.

Two races get tests of their own: a relink right after a forced unlink that raced pulls in
flight, and a link whose channel threads cannot start.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist._engine.engine import Engine
from aio_datadist.sync import CacheManager
from tests.conftest import make_options, pool_cfg

S = LLMStatusCode
PROMPT = 1
DECODERS = (2, 3)
BLOCKS, BLOCK_BYTES = 4, 4096


def desc() -> CacheDesc:
    return CacheDesc(2, [BLOCKS, BLOCK_BYTES], DataType.DT_UINT8, Placement.DEVICE)


class Side:
    """One engine with a blocks cache of its own, filled with its cluster id."""

    def __init__(self, role: LLMRole, cluster_id: int, listen: str | None = None) -> None:
        self.cluster_id = cluster_id
        self.engine = Engine(role, cluster_id)
        self.engine.init(
            make_options(
                device_pool=pool_cfg(8 << 20),
                remote_accessible=True,
                transport="tcp",
                listen=listen,
                sync_kv_timeout=3000,
            )
        )
        caches, planner, links = self.engine.caches, self.engine.planner, self.engine.links
        assert caches is not None and planner is not None and links is not None
        self.cm = CacheManager(caches, planner, links)
        self.own = self.cm.allocate_blocks_cache(desc(), BlocksCacheKey(cluster_id))
        for view in self.own.as_numpy():
            view[...] = cluster_id
        self.dst = self.cm.allocate_blocks_cache(desc())

    @property
    def table(self) -> Any:
        return self.engine.link_table()

    def pull_from(self, cluster_id: int) -> None:
        """Pull every block of ``cluster_id`` and check it."""
        for view in self.dst.as_numpy():
            view[...] = 0
        self.cm.pull_blocks(BlocksCacheKey(cluster_id), self.dst, [0, 1, 2, 3], [0, 1, 2, 3])
        assert all((view == cluster_id).all() for view in self.dst.as_numpy())

    def sever(self) -> None:
        """Die without a word: cut every link's socket (the peer reads EOF, no BYE)."""
        for entry in list(self.table._entries.values()):
            sock = getattr(getattr(entry, "channel", None), "_sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.engine.finalize()


def info(cluster_id: int, port: int | None) -> LLMClusterInfo:
    c = LLMClusterInfo()
    c.remote_cluster_id = cluster_id
    c.append_local_ip_info("127.0.0.1", 0)
    c.append_remote_ip_info("127.0.0.1", port if port is not None else 1)
    return c


def eventually(check: Callable[[], bool], what: str, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(0.002)


class LinkModel(RuleBasedStateMachine):
    """Links between a prompt and two decoders, against a model of what should exist."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt = Side(LLMRole.PROMPT, PROMPT, listen="127.0.0.1:0")
        address = self.prompt.table.listen_address
        assert address is not None
        self.port = address[1]
        self.decoders = {c: Side(LLMRole.DECODER, c) for c in DECODERS}
        self.live = dict.fromkeys(DECODERS, False)  # the pair is linked
        self.broken_at_prompt = dict.fromkeys(DECODERS, False)
        self.broken_at_decoder = dict.fromkeys(DECODERS, False)

    def teardown(self) -> None:
        for side in (*self.decoders.values(), self.prompt):
            side.close()

    decoder = st.sampled_from(DECODERS)

    @rule(c=decoder)
    def link(self, c: int) -> None:
        ret, rets = self.decoders[c].engine.link_clusters([info(PROMPT, self.port)], 3000)
        if self.live[c]:
            assert ret == S.LLM_ALREADY_LINK, rets.errors
        else:
            assert ret == S.LLM_SUCCESS, rets.errors
            self.live[c] = True
            self.broken_at_prompt[c] = self.broken_at_decoder[c] = False

    @rule(c=decoder, force=st.booleans())
    def decoder_unlinks(self, c: int, force: bool) -> None:
        ret, rets = self.decoders[c].engine.unlink_clusters([info(PROMPT, self.port)], 3000, force)
        if not (self.live[c] or self.broken_at_decoder[c]) and not force:
            assert ret == S.LLM_NOT_YET_LINK, rets.errors
        else:
            assert ret == S.LLM_SUCCESS, rets.errors
        if self.live[c]:
            self.broken_at_prompt[c] = force  # a forced unlink leaves the other end failed
        self.live[c] = self.broken_at_decoder[c] = False

    @rule(c=decoder, force=st.booleans())
    def prompt_unlinks(self, c: int, force: bool) -> None:
        ret, rets = self.prompt.engine.unlink_clusters([info(c, None)], 3000, force)
        if not (self.live[c] or self.broken_at_prompt[c]) and not force:
            assert ret == S.LLM_NOT_YET_LINK, rets.errors
        else:
            assert ret == S.LLM_SUCCESS, rets.errors
        if self.live[c]:
            self.broken_at_decoder[c] = force
        self.live[c] = self.broken_at_prompt[c] = False

    @rule(c=decoder)
    def kill_decoder(self, c: int) -> None:
        old = self.decoders[c]
        old.sever()
        old.close()
        self.decoders[c] = Side(LLMRole.DECODER, c)
        if self.live[c]:
            self.broken_at_prompt[c] = True
        self.live[c] = self.broken_at_decoder[c] = False

    def expect_pull(self, puller: Side, source: int, live: bool, broken: bool) -> None:
        try:
            puller.pull_from(source)
        except LLMException as exc:
            want = S.LLM_LINK_FAILED if broken else S.LLM_NOT_YET_LINK
            assert not live and exc.status_code == want, exc
        else:
            assert live

    @rule(c=decoder)
    def decoder_pulls(self, c: int) -> None:
        self.expect_pull(self.decoders[c], PROMPT, self.live[c], self.broken_at_decoder[c])

    @precondition(lambda self: any(self.live.values()) or any(self.broken_at_prompt.values()))
    @rule(c=decoder)
    def prompt_pulls(self, c: int) -> None:
        self.expect_pull(self.prompt, c, self.live[c], self.broken_at_prompt[c])

    @invariant()
    def tables_show_what_exists(self) -> None:
        for c, side in self.decoders.items():

            def agrees(c: int = c, side: Side = side) -> bool:
                return (
                    (side.table.get(PROMPT) is not None) == self.live[c]
                    and (self.prompt.table.get(c) is not None) == self.live[c]
                    and (side.table.broken(PROMPT) is not None) == self.broken_at_decoder[c]
                    and (self.prompt.table.broken(c) is not None) == self.broken_at_prompt[c]
                )

            eventually(agrees, f"the tables agree with the model for cluster {c}")
        assert len(self.prompt.table) == sum(self.live.values())


TestLinkModel = LinkModel.TestCase
TestLinkModel.settings = settings(max_examples=30, stateful_step_count=20, deadline=None)


@pytest.fixture
def pair() -> Iterator[tuple[Side, Side, int]]:
    prompt = Side(LLMRole.PROMPT, PROMPT, listen="127.0.0.1:0")
    decoder = Side(LLMRole.DECODER, 2)
    address = prompt.table.listen_address
    assert address is not None
    yield prompt, decoder, address[1]
    decoder.close()
    prompt.close()


def pulls(decoder: Side, stop: threading.Event, outcomes: list[BaseException | None]) -> None:
    """Pull from the prompt until ``stop``, recording each outcome."""
    while not stop.is_set():
        try:
            decoder.cm.pull_blocks(BlocksCacheKey(PROMPT), decoder.dst, [0, 1], [0, 1])
            outcomes.append(None)
        except LLMException as exc:
            outcomes.append(exc)


def test_a_relink_right_after_a_forced_unlink_racing_pulls_succeeds(
    pair: tuple[Side, Side, int],
) -> None:
    _, decoder, port = pair
    target = info(PROMPT, port)
    for _ in range(100):
        ret, rets = decoder.engine.link_clusters([target], 3000)
        assert ret == S.LLM_SUCCESS, rets.errors
        stop = threading.Event()
        outcomes: list[BaseException | None] = []
        workers = [threading.Thread(target=pulls, args=(decoder, stop, outcomes)) for _ in "ab"]
        for worker in workers:
            worker.start()
        time.sleep(0.001)
        assert decoder.engine.unlink_clusters([target], 3000, True)[0] == S.LLM_SUCCESS
        stop.set()
        for worker in workers:
            worker.join()
        codes = {e.status_code for e in outcomes if isinstance(e, LLMException)}
        assert codes <= {S.LLM_LINK_FAILED, S.LLM_NOT_YET_LINK}, codes
        # No wait for the prompt to notice: the relink goes through at once.
        ret, rets = decoder.engine.link_clusters([target], 3000)
        assert ret == S.LLM_SUCCESS, rets.errors
        decoder.pull_from(PROMPT)
        assert decoder.engine.unlink_clusters([target], 3000, False)[0] == S.LLM_SUCCESS


def test_a_link_whose_threads_cannot_start_leaves_nothing_that_refuses_a_relink(
    pair: tuple[Side, Side, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt, decoder, port = pair
    start = threading.Thread.start

    def failing(self: threading.Thread) -> None:
        if self.name.startswith("aio-dd-tcp-read-"):
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", failing)
    ret, rets = decoder.engine.link_clusters([info(PROMPT, port)], 3000)
    assert ret == S.LLM_LINK_FAILED
    error = rets.errors[0]
    assert error is not None and "can't start new thread" in str(error)
    monkeypatch.setattr(threading.Thread, "start", start)
    assert decoder.table.get(PROMPT) is None and decoder.table.broken(PROMPT) is None
    eventually(lambda: prompt.table.get(2) is None, "the prompt drops the half-made link")
    ret, rets = decoder.engine.link_clusters([info(PROMPT, port)], 3000)
    assert ret == S.LLM_SUCCESS, rets.errors
    decoder.pull_from(PROMPT)
    prompt.pull_from(2)


def test_link_results_say_why(pair: tuple[Side, Side, int]) -> None:
    _, decoder, port = pair
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    wrong = info(9, port)  # the prompt there is cluster 1
    ret, rets = decoder.engine.link_clusters([info(PROMPT, closed_port), wrong], 3000)
    assert ret == S.LLM_LINK_FAILED and rets == [S.LLM_LINK_FAILED, S.LLM_LINK_FAILED]
    refused, mismatch = rets.errors
    assert refused is not None and "refused" in str(refused).lower()
    assert refused.status_code == S.LLM_LINK_FAILED
    assert mismatch is not None and "cluster 1" in str(mismatch) and "not 9" in str(mismatch)
    ret, rets = decoder.engine.link_clusters([info(PROMPT, port)], 3000)
    assert (ret, rets.errors) == (S.LLM_SUCCESS, [None])
    ret, rets = decoder.engine.link_clusters([info(PROMPT, port)], 3000)
    assert ret == S.LLM_ALREADY_LINK and "already linked" in str(rets.errors[0])


def test_link_results_name_an_authentication_failure() -> None:
    prompt = Side(LLMRole.PROMPT, PROMPT, listen="127.0.0.1:0")
    decoder = Engine(LLMRole.DECODER, 2)
    options = make_options(transport="tcp", link_secret="not the prompt's")
    try:
        decoder.init(options)
        address = prompt.table.listen_address
        assert address is not None
        ret, rets = decoder.link_clusters([info(PROMPT, address[1])], 3000)
        assert ret == S.LLM_LINK_FAILED
        assert rets.errors[0] is not None and "secret" in str(rets.errors[0])
    finally:
        decoder.finalize()
        prompt.close()
