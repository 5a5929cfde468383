"""Link tables over the loopback transport: the documented link/unlink results and rules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from aio_datadist import LLMClusterInfo, LLMException, LLMRole, LLMStatusCode
from aio_datadist._engine.links import LinkTable, check_clusters, overall_status
from aio_datadist._log import get_logger
from aio_datadist._transport.base import Hello, RequestKind, Served
from aio_datadist._transport.loopback import LoopbackTransport
from aio_datadist.status import KvCacheNotExistError

S = LLMStatusCode.LLM_SUCCESS


def info(remote: int, port: int | None = None, *, local: bool = True) -> LLMClusterInfo:
    c = LLMClusterInfo()
    c.remote_cluster_id = remote
    if local:
        c.append_local_ip_info("127.0.0.1", 0)
    if port is not None:
        c.append_remote_ip_info("127.0.0.1", port)
    return c


class _Refuse:
    """A request handler with no memory to serve."""

    serve_table = None

    def serve(
        self, peer: Hello, kind: RequestKind, body: bytes, nbytes: int, *, stream: bool = False
    ) -> Served:
        raise KvCacheNotExistError("nothing here", status_code=LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


@pytest.fixture
def tables() -> Iterator[dict[int, LinkTable]]:
    made: dict[int, LinkTable] = {}
    transport = LoopbackTransport()
    for cluster_id, role in ((1, LLMRole.PROMPT), (2, LLMRole.DECODER), (3, LLMRole.DECODER)):
        made[cluster_id] = LinkTable(
            Hello(cluster_id, role), transport, _Refuse(), get_logger("test")
        )
    made[1].listen("127.0.0.1", 26001)
    yield made
    for table in made.values():
        table.close()


def test_link_both_directions_and_graceful_unlink(tables: dict[int, LinkTable]) -> None:
    prompt, decoder = tables[1], tables[2]
    assert decoder.link_clusters([info(1, 26001)], 1000) == (S, [S])
    link = decoder.get(1)
    assert link is not None and link.remote == Hello(1, LLMRole.PROMPT) and link.initiator
    served = prompt.get(2)
    assert served is not None and served.remote.role is LLMRole.DECODER and not served.initiator
    assert decoder.link_clusters([info(1, 26001)], 1000) == (
        LLMStatusCode.LLM_ALREADY_LINK,
        [LLMStatusCode.LLM_ALREADY_LINK],
    )
    assert decoder.unlink_clusters([info(1, 26001)], 1000, force=False) == (S, [S])
    assert decoder.get(1) is None and prompt.get(2) is None  # both ends gone
    assert decoder.link_clusters([info(1, 26001)], 1000) == (S, [S])  # can link again


def test_forced_unlink_is_local_only(tables: dict[int, LinkTable]) -> None:
    prompt, decoder = tables[1], tables[2]
    decoder.link_clusters([info(1, 26001)], 1000)
    assert decoder.unlink_clusters([info(1)], 1000, force=True) == (S, [S])
    assert decoder.get(1) is None and decoder.broken(1) is None
    # The prompt's end closed with it: a broken link, until the prompt unlinks too.
    broken = prompt.broken(2)
    assert prompt.get(2) is None and broken is not None and "force=True" in broken.reason
    with pytest.raises(LLMException) as failed:
        prompt.route(2)
    assert failed.value.status_code == LLMStatusCode.LLM_LINK_FAILED
    assert "cluster 2" in str(failed.value) and "force=True" in str(failed.value)
    assert prompt.unlink_clusters([info(2)], 1000, force=True) == (S, [S])
    assert prompt.get(2) is None and prompt.broken(2) is None
    # A forced unlink of a link that is already gone succeeds; a graceful one reports it.
    assert prompt.unlink_clusters([info(2)], 1000, force=True) == (S, [S])
    code = LLMStatusCode.LLM_NOT_YET_LINK
    assert decoder.unlink_clusters([info(1, 26001)], 1000, force=False) == (code, [code])


def test_per_cluster_results_keep_input_order(tables: dict[int, LinkTable]) -> None:
    decoder = tables[2]
    tables[3].listen("127.0.0.1", 26003)
    bad_port, wrong_id = info(5, 26999), info(9, 26003)
    ret, rets = decoder.link_clusters([info(1, 26001), bad_port, wrong_id, info(3, 26003)], 1000)
    F = LLMStatusCode.LLM_LINK_FAILED
    assert rets == [S, F, F, S] and ret == F
    assert decoder.get(1) is not None and decoder.get(3) is not None and decoder.get(9) is None
    assert len(decoder) == 2


def test_listener_rules(tables: dict[int, LinkTable]) -> None:
    prompt, decoder = tables[1], tables[2]
    with pytest.raises(OSError, match="in use"):
        decoder.listen("127.0.0.1", 26001)
    prompt.stop_listening()
    code = LLMStatusCode.LLM_LINK_FAILED
    assert decoder.link_clusters([info(1, 26001)], 1000) == (code, [code])
    decoder.listen("127.0.0.1", 26001)  # the freed address is usable at once
    assert decoder.listen_address == ("127.0.0.1", 26001)


def test_peer_close_is_seen(tables: dict[int, LinkTable]) -> None:
    prompt, decoder = tables[1], tables[2]
    decoder.link_clusters([info(1, 26001)], 1000)
    prompt.close()  # finalize tells every peer
    assert decoder.get(1) is None and len(decoder) == 0


def test_self_link_and_missing_remote_ip(tables: dict[int, LinkTable]) -> None:
    prompt = tables[1]
    code = LLMStatusCode.LLM_LINK_FAILED
    assert prompt.link_clusters([info(1, 26001)], 1000) == (code, [code])
    code = LLMStatusCode.LLM_PARAM_INVALID
    assert prompt.link_clusters([info(2)], 1000) == (code, [code])
    assert prompt.link_clusters([], 1000) == (code, [])
    assert prompt.unlink_clusters([info(2, 1), info(2)], 1000, force=False)[1][0] == (
        LLMStatusCode.LLM_NOT_YET_LINK
    )
    many = [info(10 + i, 26001) for i in range(17)]
    limit = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
    assert prompt.link_clusters(many, 1000) == (limit, [limit] * 17)


def test_check_clusters() -> None:
    with pytest.raises(TypeError):
        check_clusters(info(1), 1000, need_local_ip=False)
    with pytest.raises(TypeError):
        check_clusters([object()], 1000, need_local_ip=False)
    with pytest.raises(TypeError):
        check_clusters([info(1)], 1.5, need_local_ip=False)
    with pytest.raises(ValueError):
        check_clusters([info(1)], 2**31, need_local_ip=False)
    for clusters, timeout, need in (
        ([info(1)], 0, False),
        ([LLMClusterInfo()], 1000, False),
        ([info(1, local=False)], 1000, True),
    ):
        with pytest.raises(LLMException) as exc:
            check_clusters(clusters, timeout, need_local_ip=need)
        assert exc.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    check_clusters((info(1, local=False),), 1, need_local_ip=False)


def test_overall_status_is_last_failure() -> None:
    F, T = LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_TIMEOUT
    assert overall_status([S, S]) == S
    assert overall_status([F, S, T, S]) == T


def test_link_retry_count_waits_for_a_starting_server(tables: dict[int, LinkTable]) -> None:
    import threading

    decoder, late = tables[2], tables[3]
    assert decoder.link_clusters([info(3, 26003)], 300) == (
        LLMStatusCode.LLM_LINK_FAILED,
        [LLMStatusCode.LLM_LINK_FAILED],
    )
    decoder.retry_count = 20
    timer = threading.Timer(0.2, late.listen, ("127.0.0.1", 26003))
    timer.start()
    try:
        assert decoder.link_clusters([info(3, 26003)], 3000) == (S, [S])
    finally:
        timer.join()


def test_broken_links_are_remembered_up_to_a_bound_oldest_dropped_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aio_datadist._engine import links as links_module

    monkeypatch.setattr(links_module, "MAX_BROKEN_LINKS", 8)
    table = links_module.LinkTable.__new__(links_module.LinkTable)
    table._entries = {}
    table._broke_since_trim = 0
    for n in range(40):  # as _forget does, lock held
        table._entries[(n, True)] = links_module.BrokenLink(n, True, "", "gone", at=1000.0 + n)
        table._trim_broken()
        assert len(table._entries) <= 8 + 8 // 4  # never more than a quarter past the bound
    kept = sorted(key[0] for key in table._entries)
    assert kept == list(range(40 - len(kept), 40))  # the newest stay
