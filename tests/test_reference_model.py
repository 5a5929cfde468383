"""Cache-key reference counting checked against a small model with hypothesis state machines.

The model: a batch cache's memory is in use while its id reference is held (not yet
deallocated) or any of its keys is bound; pool usage equals the sum of page-rounded sizes of
caches in use.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from aio_datadist import (
    CacheDesc,
    CacheKey,
    DataType,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from tests.conftest import make_options, pool_cfg

PAGE = 1 << 12
POOL = 64 * PAGE


class KeyReferences(RuleBasedStateMachine):
    caches = Bundle("caches")

    def __init__(self) -> None:
        super().__init__()
        self.dd = LLMDataDist(LLMRole.PROMPT, 1)
        self.dd.init(make_options(device_pool=pool_cfg(memory_size=POOL, page_shift=12)))
        self.cm = self.dd.cache_manager
        self.held: dict[int, bool] = {}  # cache_id -> id reference held
        self.keys: dict[int, int] = {}  # req_id -> cache_id
        self.size: dict[int, int] = {}  # cache_id -> bytes in use when alive
        self.next_req = 0

    def expected_used(self) -> int:
        alive = {cid for cid, held in self.held.items() if held} | set(self.keys.values())
        return sum(self.size[c] for c in alive)

    @rule(target=caches, rows=st.integers(1, 4), pages=st.integers(1, 6), nkeys=st.integers(0, 4))
    def allocate(self, rows: int, pages: int, nkeys: int) -> Any:
        nkeys = min(nkeys, rows)
        req_ids = list(range(self.next_req, self.next_req + nkeys))
        desc = CacheDesc(2, [rows, pages * PAGE // rows + 1], DataType.DT_UINT8)
        nbytes = 2 * ((desc.size + PAGE - 1) // PAGE * PAGE)
        largest_free = self.cm.pool_stats(Placement.DEVICE).largest_free
        try:
            cache = self.cm.allocate_cache(desc, [CacheKey(1, req_id=r) for r in req_ids])
        except LLMException as exc:
            assert exc.status_code == LLMStatusCode.LLM_OUT_OF_MEMORY
            assert largest_free < nbytes  # refused only when no free run is large enough
            return None
        self.next_req += nkeys
        self.held[cache.cache_id] = True
        self.size[cache.cache_id] = nbytes
        for r in req_ids:
            self.keys[r] = cache.cache_id
        return cache

    @rule(cache=caches)
    def deallocate(self, cache: Any) -> None:
        if cache is None:
            return
        self.cm.deallocate_cache(cache)
        self.held[cache.cache_id] = False
        assert cache.tensor_addrs == []

    @precondition(lambda self: self.next_req > 0)
    @rule(data=st.data())
    def remove_key(self, data: st.DataObject) -> None:
        req = data.draw(st.integers(0, self.next_req - 1))
        self.cm.remove_cache_key(CacheKey(1, req_id=req))
        self.keys.pop(req, None)

    @invariant()
    def pool_usage_matches_model(self) -> None:
        assert self.cm.pool_stats(Placement.DEVICE).used == self.expected_used()

    def teardown(self) -> None:
        for req in list(self.keys):
            self.cm.remove_cache_key(CacheKey(1, req_id=req))
        self.dd.finalize()


KeyReferences.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestKeyReferences = KeyReferences.TestCase
