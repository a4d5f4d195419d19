"""PrefillAdder's KV budget when a request's matched prefix is the only evictable memory."""

from __future__ import annotations

from workbench.core.managers.schedule_batch import Req
from workbench.core.managers.schedule_policy import AddReqResult, PrefillAdder
from workbench.core.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from workbench.core.mem_cache.radix_cache import RadixCache
from workbench.core.sampling.sampling_params import SamplingParams

POOL = 64
PREFIX = list(range(100, 140))  # 40 cached tokens


def _setup():
    alloc = TokenToKVPoolAllocator(POOL)
    cache = RadixCache(ReqToTokenPool(4, 128), alloc)
    cache.insert(PREFIX, alloc.alloc(len(PREFIX)))  # cached and unlocked: all evictable
    assert alloc.available_size() == POOL - 40 and cache.evictable_size() == 40
    return alloc, cache


def _req(rid: str, extend: int, max_new: int) -> Req:
    ids = PREFIX + list(range(500, 500 + extend))
    return Req(rid, "", ids, SamplingParams(max_new_tokens=max_new, temperature=0.0), eos_token_ids=[2])


def _adder(alloc, cache) -> PrefillAdder:
    return PrefillAdder(cache, alloc, [], new_token_ratio=1.0, max_prefill_tokens=4096, chunked_prefill_size=None)


def test_a_request_that_fits_only_if_its_own_prefix_were_free_is_refused_and_unlocked():
    alloc, cache = _setup()
    # 20 new + 10 reserved = 30 <= 24 free + 40 evictable, but the 40 are its own prefix: once
    # locked they cannot be evicted, leaving 24 < 30.
    req = _req("r", extend=20, max_new=10)
    req.init_next_round_input(cache)
    assert len(req.prefix_indices) == 40
    adder = _adder(alloc, cache)
    assert adder.add_one_req(req) == AddReqResult.NO_TOKEN
    assert adder.can_run_list == []
    assert cache.evictable_size() == 40 and cache.protected_size() == 0  # the lock was undone


def test_a_request_that_fits_beside_its_locked_prefix_is_admitted_with_the_prefix_locked():
    alloc, cache = _setup()
    req = _req("r", extend=14, max_new=10)  # 24 <= 24 free
    req.init_next_round_input(cache)
    adder = _adder(alloc, cache)
    assert adder.add_one_req(req) == AddReqResult.CONTINUE
    assert adder.can_run_list == [req]
    assert cache.protected_size() == 40 and cache.evictable_size() == 0
    assert adder.rem_total_tokens == 0
    # What was admitted really fits: the allocator can hand out its new tokens without evicting.
    assert alloc.alloc(req.extend_input_len) is not None
