"""HiRadixCache (HiCache's device + host tiers): random workloads against a model of prefixes.

The model is the set of keys ever inserted: every cached prefix (in any tier) is a prefix of one
of them, so a match may never be longer than the longest common prefix with that set; and when
nothing can be lost (write_through / write_back with a host pool that never fills) it must be
exactly that long. The KV itself is checked too: every insert writes each token's id (per layer)
into its device slots, so a match's slots must read back its tokens, whichever tier they came
back from. After every operation the tiers' bookkeeping is checked (`check`): device slots free +
in the tree + held by the test == the pool, the host tier's own check (`host_problems`), lock
counts, and the evictable counters. All on the real pools (CPU).
"""

from __future__ import annotations

import random
import time

import pytest
import torch
from workbench.core.mem_cache.hicache_storage import STORAGE_PAGE_SIZE, HiCacheFile, storage_namespace
from workbench.core.mem_cache.hiradix_cache import WRITE_POLICIES, HiRadixCache
from workbench.core.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from workbench.core.mem_cache.memory_pool_host import MHATokenToKVPoolHost
from workbench.core.trace.events import CacheTree, HiCacheTransfer, decode_json, encode_json

LAYERS = 2


def make(policy: str, device_tokens: int = 48, host_tokens: int = 96):
    alloc = TokenToKVPoolAllocator(device_tokens)
    kv = MHATokenToKVPool(device_tokens, torch.float32, head_num=1, head_dim=2, layer_num=LAYERS)
    host = MHATokenToKVPoolHost(kv, host_tokens)
    events: list = []
    cache = HiRadixCache(ReqToTokenPool(4, 64), alloc, host, write_policy=policy, on_event=events.append)
    return cache, alloc, kv, events


def write_kv(kv: MHATokenToKVPool, slots: torch.Tensor, tokens: list[int]) -> None:
    """The stand-in forward: each token's id (+ 1000 x layer) as its K, minus that as its V."""
    t = torch.tensor(tokens, dtype=torch.float32)
    for layer in range(LAYERS):
        kv.k_buffer[layer][slots] = (t + 1000 * layer).view(-1, 1, 1).expand(-1, 1, 2)
        kv.v_buffer[layer][slots] = -(t + 1000 * layer).view(-1, 1, 1).expand(-1, 1, 2)


def assert_kv(kv: MHATokenToKVPool, slots: torch.Tensor, tokens: list[int]) -> None:
    t = torch.tensor(tokens, dtype=torch.float32)
    for layer in range(LAYERS):
        assert torch.equal(kv.k_buffer[layer][slots][:, 0, 0], t + 1000 * layer), f"layer {layer} K"
        assert torch.equal(kv.v_buffer[layer][slots][:, 0, 1], -(t + 1000 * layer)), f"layer {layer} V"


def check(cache: HiRadixCache, alloc: TokenToKVPoolAllocator, held: list) -> None:
    """Both tiers add up; locks are what the test holds; device counters match the nodes."""
    problems = cache.host_problems()
    assert not problems, problems
    slots = torch.cat([alloc.free_slots, cache.all_values()])
    assert slots.numel() == alloc.size, (alloc.available_size(), cache.all_values().numel(), alloc.size)
    assert torch.equal(torch.sort(slots).values, torch.arange(1, alloc.size + 1)), "a device slot twice or lost"
    want: dict[int, int] = {}
    for node in held:
        while node is not cache.root_node:
            want[node.id] = want.get(node.id, 0) + 1
            node = node.parent
    ev = lk = 0
    for n in cache._iter_nodes():
        assert n.lock_ref == want.get(n.id, 0), f"#{n.id} lock_ref {n.lock_ref}"
        if n.lock_ref:
            lk += len(n.value)
        else:
            ev += len(n.value)
    assert (ev, lk) == (cache.evictable_size(), cache.protected_size())
    assert cache.total_size() == ev + lk


def lcp(a: list[int], b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def cache_request(cache: HiRadixCache, alloc, kv, key: list[int]) -> bool:
    """What the scheduler does for one request: match (loading back), lock, compute the rest into
    new slots, insert, free duplicates, unlock. False when the device cannot hold it."""
    m = cache.match_prefix(key)
    cache.inc_lock_ref(m.last_node)
    need = len(key) - len(m.device_indices)
    if alloc.available_size() < need:
        cache.evict(need - alloc.available_size())
    new = alloc.alloc(need)
    if new is None:
        cache.dec_lock_ref(m.last_node)
        return False
    write_kv(kv, new, key[len(m.device_indices) :])
    value = torch.cat([m.device_indices, new])
    cached = cache.insert(key, value)
    if cached > len(m.device_indices):
        alloc.free(value[len(m.device_indices) : cached])
    cache.dec_lock_ref(m.last_node)
    return True


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("host_tokens", [400, 40])
def test_random_workload_against_model(policy, seed, host_tokens):
    rng = random.Random(seed)
    cache, alloc, kv, _ = make(policy, device_tokens=48, host_tokens=host_tokens)
    lossless = policy != "write_through_selective" and host_tokens >= 400
    stems = [[rng.randrange(3, 50) for _ in range(rng.randrange(2, 10))] for _ in range(5)]
    inserted: set[tuple] = set()
    held: list = []
    loads = 0
    for _ in range(250):
        op = rng.random()
        key = rng.choice(stems) + [rng.randrange(3, 50) for _ in range(rng.randrange(0, 8))]
        if op < 0.35:
            if cache_request(cache, alloc, kv, key):
                inserted.add(tuple(key))
        elif op < 0.65:
            before = cache.load_back_count
            m = cache.match_prefix(key)
            loads += cache.load_back_count - before
            n = len(m.device_indices)
            best = max((lcp(key, k) for k in inserted), default=0)
            assert n <= best, f"matched {n} tokens but only {best} were ever inserted"
            if lossless and not held and n < best:
                pytest.fail(f"{policy}: lost a prefix: matched {n} of {best}\n{cache.pretty_print()}")
            assert_kv(kv, m.device_indices, key[:n])
            if rng.random() < 0.3:
                cache.inc_lock_ref(m.last_node)
                held.append(m.last_node)
        elif op < 0.8:
            cache.evict(rng.randrange(1, 30))
        elif op < 0.88:
            if not lossless:  # (the lossless runs check that host eviction is never needed)
                cache.evict_host(rng.randrange(1, 30))
        elif held:
            node = held.pop(rng.randrange(len(held)))
            cache.dec_lock_ref(node)
        check(cache, alloc, held)
    # every locked path is still on the device with its KV intact
    for node in held:
        assert not node.evicted
    if policy != "write_through_selective":
        assert loads > 0, "the workload never loaded anything back from host"


def test_evicted_prompt_comes_back_from_host_with_its_kv():
    cache, alloc, kv, events = make("write_back", device_tokens=32, host_tokens=64)
    a = list(range(100, 124))
    assert cache_request(cache, alloc, kv, a)
    assert cache_request(cache, alloc, kv, list(range(200, 224)))  # evicts `a` (written back)
    tiers = {n.text or n.node_id: n.tier for n in cache.snapshot()[1:]}
    assert "host" in tiers.values(), cache.pretty_print()
    m = cache.match_prefix(a)
    assert len(m.device_indices) == len(a)
    assert_kv(kv, m.device_indices, a)
    kinds = [e.what for e in events if isinstance(e, HiCacheTransfer)]
    assert "write_back" in kinds and "load_back" in kinds
    load = [e for e in events if isinstance(e, HiCacheTransfer) and e.what == "load_back"][-1]
    assert load.tokens == len(a) and load.bytes == len(a) * 2 * LAYERS * 2 * 4
    check(cache, alloc, [])
    # the tier travels with the tree snapshot
    tree = CacheTree(nodes=cache.snapshot(), evictable_size=0, protected_size=0)
    assert {n.tier for n in decode_json(encode_json(tree)).nodes[1:]} <= {"device", "host", "device+host"}


def test_write_through_backs_up_on_insert_and_selective_waits_for_a_hit():
    for policy, backed_after_insert in (("write_through", True), ("write_through_selective", False)):
        cache, alloc, kv, _ = make(policy)
        key = list(range(10, 20))
        cache_request(cache, alloc, kv, key)
        node = cache.match_prefix(key).last_node  # a hit: selective backs up now
        assert node.host_value is not None
        cache2, alloc2, kv2, _ = make(policy)
        cache_request(cache2, alloc2, kv2, key)
        first = next(iter(cache2.root_node.children.values()))
        assert (first.host_value is not None) == backed_after_insert


def test_no_room_on_device_keeps_the_match_on_the_device_part():
    cache, alloc, kv, _ = make("write_through", device_tokens=16, host_tokens=64)
    c = list(range(300, 310))
    cache_request(cache, alloc, kv, c)
    assert cache.evict(100) == 10  # c is backed on host: the node stays, host-only
    a = list(range(100, 112))
    cache_request(cache, alloc, kv, a)
    pin = cache.match_prefix(a).last_node
    cache.inc_lock_ref(pin)  # 12 of 16 device slots locked: c's 10 cannot come back
    before = cache.load_back_count
    m = cache.match_prefix(c)
    assert len(m.device_indices) == 0 and m.last_node is cache.root_node
    assert cache.load_back_count == before
    assert cache._tier(cache.root_node.children[300]) == "host"
    check(cache, alloc, [pin])
    cache.dec_lock_ref(pin)
    m = cache.match_prefix(c)  # now it fits (a is evicted to host for it)
    assert len(m.device_indices) == 10
    assert_kv(kv, m.device_indices, c)
    check(cache, alloc, [])


def make_with_storage(tmp_path, policy="wait_complete", namespace="model-a", dtype=torch.float32):
    alloc = TokenToKVPoolAllocator(96)
    kv = MHATokenToKVPool(96, dtype, head_num=1, head_dim=2, layer_num=LAYERS)
    host = MHATokenToKVPoolHost(kv, 192)
    ns = storage_namespace(namespace, dtype, LAYERS, 1, 2, "tp0/1")
    storage = HiCacheFile(ns, policy, storage_dir=str(tmp_path))
    cache = HiRadixCache(ReqToTokenPool(4, 128), alloc, host, "write_through", storage=storage)
    return cache, alloc, kv


@pytest.mark.parametrize("policy", ["wait_complete", "timeout", "best_effort"])
def test_file_tier_serves_a_new_cache_the_pages_an_old_one_wrote(tmp_path, policy):
    first, alloc, kv = make_with_storage(tmp_path, policy)
    key = list(range(100, 100 + 2 * STORAGE_PAGE_SIZE + 5))  # two whole pages and a tail
    assert cache_request(first, alloc, kv, key)
    assert first.storage is not None and first.storage.pages_written == 2
    # a restart: a new cache (empty tree, fresh pools) over the same directory
    cache, alloc, kv = make_with_storage(tmp_path, policy)
    m = cache.match_prefix(key)
    if policy == "best_effort":  # nothing waited for: the read runs in the background
        assert len(m.device_indices) == 0
        for _ in range(200):
            if not cache.storage._inflight:
                break
            time.sleep(0.01)
        m = cache.match_prefix(key)
    assert len(m.device_indices) == 2 * STORAGE_PAGE_SIZE
    assert_kv(kv, m.device_indices, key[: 2 * STORAGE_PAGE_SIZE])
    check(cache, alloc, [])
    # a prompt sharing one page, then diverging: one page from storage, no more
    other = key[:STORAGE_PAGE_SIZE] + [7] * (STORAGE_PAGE_SIZE + 3)
    fresh, alloc2, kv2 = make_with_storage(tmp_path, "wait_complete")
    m = fresh.match_prefix(other)
    assert len(m.device_indices) == STORAGE_PAGE_SIZE
    assert_kv(kv2, m.device_indices, other[:STORAGE_PAGE_SIZE])


def test_file_tier_pages_of_another_model_or_dtype_are_not_read(tmp_path):
    first, alloc, kv = make_with_storage(tmp_path)
    key = list(range(100, 100 + 2 * STORAGE_PAGE_SIZE))
    assert cache_request(first, alloc, kv, key)
    for ns, dtype in (("model-b", torch.float32), ("model-a", torch.bfloat16)):
        cache, _, _ = make_with_storage(tmp_path, namespace=ns, dtype=dtype)
        assert len(cache.match_prefix(key).device_indices) == 0
    cache, _, _ = make_with_storage(tmp_path)
    assert len(cache.match_prefix(key).device_indices) == 2 * STORAGE_PAGE_SIZE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the pinned host pool and its copy stream")
def test_cuda_host_pool_round_trip_on_its_own_stream():
    kv = MHATokenToKVPool(64, torch.float16, head_num=2, head_dim=8, layer_num=3, device="cuda")
    for layer in range(3):
        kv.k_buffer[layer].copy_(torch.randn_like(kv.k_buffer[layer]))
        kv.v_buffer[layer].copy_(torch.randn_like(kv.v_buffer[layer]))
    host = MHATokenToKVPoolHost(kv, 128)
    assert host.k_buffer.is_pinned() and host.copy_stream is not None
    src = torch.arange(5, 25, device="cuda")
    hidx = host.alloc(20)
    host.backup_from_device(hidx, src)
    dst = torch.arange(30, 50, device="cuda")
    host.load_to_device(hidx, dst)  # queued on the copy stream; the current stream waits for it
    for layer in range(3):
        assert torch.equal(kv.k_buffer[layer][dst], kv.k_buffer[layer][src])
        assert torch.equal(kv.v_buffer[layer][dst], kv.v_buffer[layer][src])


def test_a_backup_for_a_hit_never_takes_the_host_only_tail_of_the_same_match():
    cache, alloc, kv, _ = make("write_through", device_tokens=48, host_tokens=10)
    d, e, y = list(range(10, 15)), list(range(20, 25)), list(range(30, 35))
    cache_request(cache, alloc, kv, d)
    cache_request(cache, alloc, kv, d + e)  # d and e both backed: the host is full
    d_node = cache.root_node.children[10]
    cache.token_to_kv_pool_host.free(d_node.host_value)  # as if d had found the host full
    d_node.host_value = None
    cache_request(cache, alloc, kv, y)  # backed: the host is full again
    assert cache.evict(5) == 5 and cache._tier(d_node.children[20]) == "host"  # e: host-only, under d
    m = cache.match_prefix(d + e)  # d's hit wants a backup; the only host-only leaf is e, in this match
    assert len(m.device_indices) == 10
    assert_kv(kv, m.device_indices, d + e)
    check(cache, alloc, [])
